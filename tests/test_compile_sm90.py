"""The kernels compile for sm_90 (H100/H200) on a machine with no GPU, with 16-byte accesses.

The CPU interpreter never runs Triton's compiler, so GPU-only compile errors (loop-carried types,
constexpr misuse) and lost vectorization would otherwise show up only on a GPU. Launches are
recorded from real dispatch/combine calls at decode and prefill shapes (without running them),
then compiled for sm_90 in a process without TRITON_INTERPRET.
"""
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch

import moe_ep
from moe_ep.testing.aot import signature

_COMPILE = r"""
import importlib, pickle, re, sys
from moe_ep.testing.aot import compile_for


def own_loop(ptx):
    # The loop holding the last fp8 conversion (the dispatch's own-row loop; None without one):
    # loads in the block before it, per-element byte selects, plain and streaming vector stores in it.
    lines = ptx.split("\n")
    cvt = [i for i, l in enumerate(lines) if "cvt.rn.satfinite.e4m3x2" in l]
    if not cvt:
        return None
    labels = [i for i, l in enumerate(lines) if re.match(r"^\$L__BB\d+_\d+:", l)]

    def back_edge(i):  # the branch after the conversion back to label line i (its loop's end), or None
        name = re.escape(lines[i].split(":")[0])
        return next((j for j in range(cvt[-1], len(lines)) if re.search(r"bra(\.uni)?\s+" + name + ";", lines[j])), None)
    # The innermost loop around the conversion: the last label before it that a later branch goes back to.
    top = max(i for i in labels if i < cvt[-1] and back_edge(i) is not None)
    end = back_edge(top)
    body = lines[top:end]
    # Loads before the loop whose registers the loop reads (its first tile, loaded ahead), directly
    # or through the moves that split them into 16-bit halves before the loop.
    body_text = "\n".join(lines[top:end])
    def feeds_loop(i):
        l = lines[i]
        regs = set(re.findall(r"%r\d+", l.split("{")[1].split("}")[0])) if "{" in l else set()
        for m in lines[i + 1:top]:
            mv = re.match(r"\s*mov\.b32\s+(\{[^}]*\}|%\w+),\s*(%r\d+);", m)
            if mv and mv.group(2) in regs:
                regs |= set(re.findall(r"%r?s?\d+", mv.group(1)))
        return any(re.search(re.escape(r) + r"\b", body_text) for r in regs)
    return dict(prologue_loads=sum("ld.global.v4" in l and feeds_loop(i) for i, l in enumerate(lines[:top])),
                selects_b16=sum("selp.b16" in l for l in body),
                plain_vector_stores=sum(bool(re.search(r"st\.global\.v[24]", l)) for l in body),
                streaming_stores=sum("st.global.cs" in l for l in body),
                barriers=sum("bar.sync" in l for l in body),
                l2_prefetches=sum("cp.async.bulk.prefetch.L2" in l for l in lines))


out, loops = [], []
for mod, name, spec in pickle.load(open(sys.argv[1], "rb")):
    k = compile_for(getattr(importlib.import_module(mod), name), spec)
    ptx = k.asm["ptx"]
    out.append((name, len(re.findall(r"st\.global(?:\.cs)?\.v[24]", ptx)), len(re.findall(r"st\.global(?:\.cs)?\.b8", ptx)),
                len(re.findall(r"globaltimer", ptx)), len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx))))
    loops.append(own_loop(ptx))
pickle.dump(out, open(sys.argv[1] + ".out", "wb"))
pickle.dump(loops, open(sys.argv[1] + ".loops", "wb"))
"""


def gpu_chunking(monkeypatch) -> None:
    """Chunk counts as on a GPU (the interpreter caps them: moe_ep.core.workspace.max_chunks)."""
    import moe_ep.core.workspace

    monkeypatch.setattr(moe_ep.core.workspace, "interpreting", lambda: False)


def _record(monkeypatch, configs, **buffer_kwargs):
    gpu_chunking(monkeypatch)
    rec = []

    def spy(key, fn, grid, args, consts, dynamic=None):
        consts = consts() if callable(consts) else consts
        rec.append((fn.fn.__module__, fn.fn.__name__, signature(fn.arg_names, args, consts)))

    g = moe_ep.EPGroup()
    for T, H, dt, layout, fused, *own in configs:  # own: that config's buffer kwargs
        buf = moe_ep.EPBuffer(g, 256, H, T, 8, dispatch_dtype=dt, layout=layout, num_programs=132,
                              **{**buffer_kwargs, **(own[0] if own else {})})
        # What a GPU launches: both halves in one kernel; or, with more programs than SMs, the two
        # halves as two kernels (then the receive half spins on the GPU).
        buf.parts.tuning = buf.tuning.replace(num_warps=8, fused=fused)
        buf.parts.interp = False
        buf.calls.launch = spy
        x = torch.zeros(T, H, dtype=torch.bfloat16)
        h = buf.dispatch(x, torch.zeros(T, 8, dtype=torch.int64), torch.zeros(T, 8))
        buf.combine(torch.empty(h.expert_x.shape, dtype=torch.bfloat16), h)
        buf.close()
    return rec


def _compile(rec, tmp_path, loops: bool = False):
    """Compiles recorded launches for sm_90 in a fresh process without TRITON_INTERPRET; returns
    (name, vector stores, byte stores, globaltimer reads, fp8 conversions) per launch, and with
    ``loops`` also the own-row loop's counts per launch (``own_loop`` above; None without fp8)."""
    path = tmp_path / "launches.pkl"
    pickle.dump(rec, open(path, "wb"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", _COMPILE, str(path)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    results = pickle.load(open(str(path) + ".out", "rb"))
    return (results, pickle.load(open(str(path) + ".loops", "rb"))) if loops else results


def test_kernels_compile_for_sm90(monkeypatch, tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    rec = _record(monkeypatch, [(128, 7168, torch.float8_e4m3fn, "masked", True),
                                (512, 7168, torch.bfloat16, "packed", True, dict(max_recv_rows="worst")),
                                (512, 2048, torch.float8_e4m3fn, "packed", True),
                                (128, 7168, torch.float8_e4m3fn, "masked", False)])
    # one launch each when fused (decode, T*K <= 2048, needs no routing-histogram launch); two
    # halves each when not; a packed dispatch sized per call (the default) is the routing
    # histogram, the send half, the count between the halves and the receive half
    assert len(rec) == 2 + 3 + 5 + 4
    assert [r[1] for r in rec].count("recv_total_kernel") == 1
    results = _compile(rec, tmp_path)
    assert next(t for name, _, _, t, _ in results if name == "recv_total_kernel") > 0, "no GPU deadline"
    fp8_cvt = 0
    for (_, _, spec), (name, vec_stores, byte_stores, timers, cvts) in zip(rec, results):
        # Peer stores must be 8- or 16-byte vectors: one NVLink transaction per byte is 10-100x slower.
        if name in ("node_dispatch_kernel", "node_combine_kernel"):
            c = spec["consts"]
            # Alone in its node, a send half stores no payload at all: its own rows go from x /
            # expert_y to their places in the receive half, not through the workspace.
            alone_send = c["N"] == 1 and c["SEND"] and not c["RECV"] and c.get("OWN_X", c.get("OWN_Y"))
            assert (vec_stores == 0 if alone_send else vec_stores > 0) and byte_stores == 0, \
                (name, vec_stores, byte_stores)
            assert timers > 0, f"{name}: compiled without the GPU deadline (INTERP variant?)"
            fp8_cvt += cvts
    assert fp8_cvt > 0, "fp8 quantization does not use the hardware conversion on sm_90"


def _record_remote_worker(rank, world_size, configs):
    """Each rank of 2 nodes of 1 records (does not run) the launches of one dispatch and combine
    per config ``(T, H, dtype, layout, buffer kwargs, fused)``, as a GPU would make them: chunks
    and constexprs of a GPU, the halves as two launches, or one where ``fused``
    (``Tuning.fused_internode``). Rank 0 returns them."""
    import moe_ep
    import moe_ep.core.workspace

    kept = moe_ep.core.workspace.interpreting  # (the pool's process runs later tests too)
    moe_ep.core.workspace.interpreting = lambda: False
    rec = []

    def spy(key, fn, grid, args, consts, dynamic=None):
        consts = consts() if callable(consts) else consts
        rec.append((fn.fn.__module__, fn.fn.__name__, signature(fn.arg_names, args, consts)))

    try:
        group = moe_ep.EPGroup(node_size=1)
        for T, H, dt, layout, kwargs, fused in configs:
            buf = moe_ep.EPBuffer(group, 256, H, T, 8, dispatch_dtype=dt, layout=layout, num_programs=132, **kwargs)
            buf.parts.tuning = buf.tuning.replace(num_warps=8, fused=fused, fused_internode=fused)
            buf.parts.interp = False
            buf.calls.launch = spy
            h = buf.dispatch(torch.zeros(T, H, dtype=torch.bfloat16), torch.zeros(T, 8, dtype=torch.int64),
                             torch.zeros(T, 8))
            wts = torch.zeros(h.expert_x.shape[0], 8) if layout == "rows" else None
            buf.combine(torch.zeros(h.expert_x.shape, dtype=torch.bfloat16), h, topk_weights=wts)
            buf.close()
    finally:
        moe_ep.core.workspace.interpreting = kept
    return rec if rank == 0 else None


def _record_remote(configs):
    import dist_util

    return dist_util.run(2, _record_remote_worker, configs, timeout=600)[0]


_REMOTE_KERNELS = {"internode_dispatch_kernel", "internode_combine_kernel"}


def test_internode_kernels_compile_for_sm90(tmp_path):
    """The inter-node launches (two per op: send and receive halves; prefill adds the routing
    histogram with its rank rows), at decode (fp8 masked, column-major scales) and prefill (bf16
    packed), and the rows layout with combine weights, compile for sm_90: vector row stores, the
    GPU deadline in every wait, the hardware fp8 conversion; and decode's one launch per op with
    ``Tuning.fused_internode`` (both halves)."""
    pytest.importorskip("triton.backends.nvidia")
    rec = _record_remote([(128, 7168, torch.float8_e4m3fn, "masked", dict(column_major_scales=True), False),
                          (512, 7168, torch.bfloat16, "packed", {}, False),
                          (128, 7168, torch.float8_e4m3fn, "rows", {}, False),
                          (128, 7168, torch.float8_e4m3fn, "masked", {}, True)])
    names = [r[1] for r in rec]
    # two launches a dispatch and two a combine; the prefill dispatch also the routing histogram
    # and, packed and rows sized per call, the count between its halves (from the proxy's headers);
    # fused, one a dispatch and one a combine
    assert names.count("route_hist_kernel") == 1 and names.count("recv_total_kernel") == 2, names
    assert len(names) == 3 * 4 + 3 + 2, names
    halves = [(spec["consts"]["SEND"], spec["consts"]["RECV"]) for _, n, spec in rec if n in _REMOTE_KERNELS]
    assert halves == [(True, False), (False, True)] * 6 + [(True, True)] * 2, halves
    assert all(n in _REMOTE_KERNELS or n in ("route_hist_kernel", "recv_total_kernel") for n in names), names
    tots = [spec["consts"] for _, n, spec in rec if n == "recv_total_kernel"]
    assert all(c["GLOBAL"] is True for c in tots) and [c["ROWS"] for c in tots] == [False, True], tots
    hist = next(spec for _, n, spec in rec if n == "route_hist_kernel")
    assert hist["consts"]["RANKS"] == 2, hist["consts"]
    cm = [spec["consts"]["CM_ROWS"] for _, n, spec in rec if n.startswith("internode_dispatch")]
    assert cm[0] > 0 and cm[1] > 0, cm
    results = _compile(rec, tmp_path)
    for name, vec_stores, byte_stores, timers, cvts in results:
        if name in _REMOTE_KERNELS:
            assert vec_stores > 0, (name, vec_stores)
            assert timers > 0, f"{name}: compiled without the GPU deadline"
    sends = [r for (_, n, spec), r in zip(rec, results) if n == "internode_dispatch_kernel" and spec["consts"]["SEND"]]
    assert sum(cvts for _, _, _, _, cvts in sends) > 0


def test_column_major_scales_compile_for_sm90(monkeypatch, tmp_path):
    """A masked fp8 buffer with ``column_major_scales`` (decode, one launch and two halves) compiles
    for sm_90, quantizing with the hardware fp8 conversion (across nodes:
    ``test_internode_kernels_compile_for_sm90``)."""
    pytest.importorskip("triton.backends.nvidia")
    rec = _record(monkeypatch, [(128, 7168, torch.float8_e4m3fn, "masked", True),
                                (128, 7168, torch.float8_e4m3fn, "masked", False)], column_major_scales=True)
    cm = [spec["consts"]["CM_ROWS"] for _, name, spec in rec if name == "node_dispatch_kernel"]
    assert cm and all(c > 0 for c in cm), cm
    results = _compile(rec, tmp_path)
    assert sum(cvts for name, _, _, _, cvts in results if name == "node_dispatch_kernel") > 0


def test_rows_kernels_compile_for_sm90(monkeypatch, tmp_path):
    """The rows layout's launches (decode and prefill, fused and in halves, combine with weights)
    compile for sm_90 with vector stores (across nodes: ``test_internode_kernels_compile_for_sm90``)."""
    pytest.importorskip("triton.backends.nvidia")
    monkeypatch.setenv("MOE_EP_PREFETCH", "1")  # the own rows' L2 prefetch (on its own at <= 32 programs)
    worst = dict(max_recv_rows="worst")  # (sized per call, the count kernel: test_internode_kernels_compile_for_sm90)
    rec = _record(monkeypatch, [(4096, 7168, torch.float8_e4m3fn, "rows", True, worst),
                                (128, 7168, torch.bfloat16, "rows", True, worst),
                                (128, 7168, torch.float8_e4m3fn, "rows", False, worst)])
    g = moe_ep.EPGroup()
    buf = moe_ep.EPBuffer(g, 256, 7168, 256, 8, layout="rows", num_programs=132, **worst)
    buf.parts.interp, buf.parts.tuning = False, buf.tuning.replace(fused=True)
    buf.calls.launch = lambda key, fn, grid, args, consts, dynamic=None: rec.append(
        (fn.fn.__module__, fn.fn.__name__, signature(fn.arg_names, args, consts() if callable(consts) else consts)))
    h = buf.dispatch(torch.zeros(256, 7168, dtype=torch.bfloat16), torch.zeros(256, 8, dtype=torch.int64),
                     torch.zeros(256, 8))
    buf.combine(torch.empty(h.expert_x.shape, dtype=torch.bfloat16), h, topk_weights=torch.zeros(256, 8))
    buf.close()
    names = [r[1] for r in rec]
    assert names.count("route_hist_kernel") == 1, names
    results, loops = _compile(rec, tmp_path, loops=True)
    assert all(byte_stores == 0 for _, _, byte_stores, _, _ in results), results
    own = [(r[2]["consts"], loop) for r, loop in zip(rec, loops) if r[1] == "node_dispatch_kernel"]
    own = [loop for c, loop in own if c["FP8"] and c["RECV"] and c["OWN_X"] and c["H"] > c["BLOCK_H"]]
    # The own-row loop at T=4096 (7 tiles of 1024 channels; at R=1 it writes every row): its first
    # tile is loaded before the loop (each step then loads the next one before working on this one:
    # two tiles in flight), no per-element select for non-finite blocks (the NaN factor does it),
    # streaming stores only, and no CTA barrier: the scales are stored from the layout they are
    # computed in (store_in_place), not moved through shared memory. (The kernels before it had
    # no prologue load and 32 selects; then two barriers per tile, 89 against 77 us at prefill.)
    # With the L2 prefetch on, two bulk prefetches in the kernel: the first sub-blocks at its start,
    # a later one as each sub-block starts.
    assert len(own) == 1 and own[0]["prologue_loads"] > 0 and own[0]["selects_b16"] == 0 and \
        own[0]["streaming_stores"] > 0 and own[0]["plain_vector_stores"] == 0 and own[0]["barriers"] == 0 and \
        own[0]["l2_prefetches"] == 2, own
    # Every dispatch / combine launch stores rows as vectors, except the two send halves of the
    # unfused R = 1 buffer: its own rows skip the workspace, so they store no payload at all.
    node = [v for name, v, _, _, _ in results if name in ("node_dispatch_kernel", "node_combine_kernel")]
    assert len(node) == 10 and sum(v == 0 for v in node) == 2, results
    assert any(cvts for name, _, _, _, cvts in results if name == "node_dispatch_kernel"), "no hardware fp8 conversion"
