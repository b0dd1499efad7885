"""Inter-node kernels (moe_ep/internode/kernels.py) on CPU under the interpreter, against the oracle.

R ranks are emulated in one process with plain tensors. Per epoch: every rank packs its send
buffer; a Python stand-in for the proxy (written from ARCHITECTURE.md §10, independently of
csrc/proxy) copies each rank's ``[HDR_p | rows_p]`` into every peer's round-1 slot and overflow
region at the protocol's offsets, in the epoch's parity copy; every rank fills its count matrix
and unpacks. The expert layout must equal ``moe_ep.reference`` bit for bit in every row that came
from a remote source, and keep its NaN poison everywhere else (rows from node peers are the
intranode kernels' job). Then combine: the owners pre-reduce into their combine send buffers, the
stand-in delivers them, and each source's output (node owners' part given as ``base``) must equal
the exact answer with the kernels' roundings, and the float32 oracle within bf16 rounding.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from moe_ep.internode import launches as remote
from moe_ep.fp8 import dequantize_fp8, quantize_fp8
from moe_ep.kernels.aot import signature
from moe_ep.reference import GatheredInputs, dispatch_from_gathered, moe_local
from moe_ep.internode.spec import REGIONS, RemoteSpec, RemoteState

FP8 = torch.float8_e4m3fn
WEIGHTS = torch.tensor([-0.5, 0.25, 0.5, 1.0, 2.0])


@dataclass
class Cfg:
    R: int
    G: int
    cap: int
    dtype: str = "bf16"
    layout: str = "masked"
    align: int = 1
    H: int = 128
    M: int = 6
    K: int = 3
    EL: int = 2


# ------------------------------------------------------------------------ inputs and oracle
def _inputs(cfg: Cfg, routing: str, seed: int):
    """Per rank (x bf16 [T,H], topk_idx int64 [T,K], topk_weights float32 [T,K]). Ragged T with a
    zero-token rank; -1 ids; ``skewed`` sends most selections to rank R-1's experts (a remote rank
    for most sources, so private slots overflow)."""
    g = torch.Generator().manual_seed(seed)
    R, E, K, H, M = cfg.R, cfg.R * cfg.EL, cfg.K, cfg.H, cfg.M
    out = []
    for r in range(R):
        T = [M, 0, M - 2, 3][(r + seed) % 4]
        # Integer values in [-8, 8] scaled per row by 2^k: exact in bf16, varied fp8 scales.
        x = torch.randint(-8, 9, (T, H), generator=g).float()
        x *= 2.0 ** torch.randint(-3, 4, (T, 1), generator=g).float()
        if T:
            x[0] = 0  # the fp8 amax floor
        if routing == "skewed":
            hot = torch.arange((R - 1) * cfg.EL, R * cfg.EL)
            cold = torch.randint(0, E, (T, K), generator=g)
            ids = torch.where(torch.rand(T, K, generator=g) < 0.8, hot[torch.randint(0, cfg.EL, (T, K), generator=g)],
                              cold)
        else:
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
        ids = ids.long()
        ids[torch.rand(T, K, generator=g) < 0.2] = -1
        w = WEIGHTS[torch.randint(0, len(WEIGHTS), (T, K), generator=g)]
        out.append((x.to(torch.bfloat16), ids, w.float()))
    return out


def _expert_fn(e: int, v: torch.Tensor) -> torch.Tensor:
    """Integer-valued (so sums are exact in float32); NaN stays NaN (poisoned rows show up)."""
    return torch.round(v).clamp(-16, 16) + (e % 3)


def _poison(t: torch.Tensor) -> torch.Tensor:
    """All bytes 0xFF: NaN in bf16, fp8 e4m3fn and float32."""
    t.view(torch.uint8).fill_(0xFF)
    return t


# ------------------------------------------------------------------------ proxy stand-in
def _deliver_dispatch(specs, regs, e: int, swap_overflow: bool = False):
    """What the proxies of every rank do for dispatch epoch ``e`` (rounds 1 and 2, §10). Returns
    the count matrix C[s][p] read from each source's first header, as the proxy does."""
    R = len(specs)
    sp0 = specs[0]
    HDR, RB, cap = sp0.hdr_bytes, sp0.row_bytes, sp0.private_capacity
    C = torch.stack([regs[s]["disp_send"][:4 * R].view(torch.int32) for s in range(R)]).long()
    for p in range(R):
        over = sum(max(0, int(C[s, p]) - cap) for s in range(R) if specs[p].remote(s))
        assert over <= sp0.overflow_capacity, "test sizes the overflow region for every batch"
    for s in range(R):
        o = 0
        for p in range(R):
            if p == s:
                continue
            rem = specs[s].remote(p)
            c = int(C[s, p]) if rem else 0
            n1, ov = min(c, cap), max(0, c - cap)
            dst = ((e & 1) * R + s) * specs[p].slot_bytes
            regs[p]["round1"][dst:dst + HDR + n1 * RB] = regs[s]["disp_send"][o:o + HDR + n1 * RB]
            if ov:
                lower = [q for q in range(R) if specs[p].remote(q) and (q > s if swap_overflow else q < s)]
                roff = sum(max(0, int(C[q, p]) - cap) for q in lower)
                a = (e & 1) * sp0.overflow_capacity * RB + roff * RB
                regs[p]["overflow"][a:a + ov * RB] = regs[s]["disp_send"][o + HDR + n1 * RB:o + HDR + c * RB]
            o += HDR + c * RB
    return C


def _deliver_combine(specs, regs, C, e: int):
    """The combine write of every owner (§10): rows received from remote s, in rank order of s,
    into s's combine receive region at sum of c_{s,p'} over remote p' < owner."""
    R = len(specs)
    CRB = specs[0].comb_row_bytes
    for o in range(R):
        loff = 0
        for s in range(R):
            if not specs[o].remote(s) or int(C[s, o]) == 0:
                continue
            n = int(C[s, o])
            roff = sum(int(C[s, q]) for q in range(o) if specs[s].remote(q))
            a = (e & 1) * specs[s].max_send_rows * CRB + roff * CRB
            regs[s]["comb_recv"][a:a + n * CRB] = regs[o]["comb_send"][loff:loff + n * CRB]
            loff += n * CRB


# ------------------------------------------------------------------------ one emulated epoch
def _layout_rows(spec: RemoteSpec, offsets, e: int, i: int) -> int:
    return e * spec.expert_capacity + i if spec.layout == "masked" else int(offsets[e]) + i


def _check_dispatch(cfg, specs, sts, outs, inputs, C, stats):
    R, EL, E = cfg.R, cfg.EL, cfg.R * cfg.EL
    fp8 = cfg.dtype.startswith("fp8")
    gathered = GatheredInputs([i[0] for i in inputs], [i[1] for i in inputs], [i[2] for i in inputs], None)
    for s in range(R):
        ids = inputs[s][1]
        dst = torch.where(ids >= 0, ids // EL, -1)
        want = torch.tensor([int((dst == p).any(1).sum()) for p in range(R)])
        assert torch.equal(sts[s].send_counts.long(), want), f"count vector of rank {s}"
        assert torch.equal(C[s], want), f"header of rank {s}"
    for p in range(R):
        ref = dispatch_from_gathered(gathered, p, R, E, FP8 if fp8 else torch.bfloat16)
        x, sc, counts, offsets = outs[p]
        exp_x = _poison(torch.empty_like(x))
        exp_s = _poison(torch.empty_like(sc)) if fp8 else None
        flat_x = exp_x.view(-1, cfg.H)
        flat_s = exp_s.view(-1, exp_s.shape[-1]) if fp8 else None
        for e in range(EL):
            for i in range(ref.counts[e]):
                s, t = int(ref.src_rank[e][i]), int(ref.src_token[e][i])
                if not specs[p].remote(s):
                    continue  # a node peer's row: the intranode kernels' job, stays poisoned here
                row = _layout_rows(specs[p], offsets, e, i)
                stats["remote_rows"] += 1
                if fp8:
                    flat_x[row] = ref.q[e][i]
                    flat_s[row] = ref.scales[e][i]
                else:
                    flat_x[row] = inputs[s][0][t]
        assert torch.equal(x.view(torch.uint8), exp_x.view(torch.uint8)), f"rank {p}: expert_x"
        if fp8:
            assert torch.equal(sc.view(torch.int32), exp_s.view(torch.int32)), f"rank {p}: expert_scales"
        assert counts.tolist() == ref.counts, f"rank {p}: expert counts"
        if cfg.layout == "packed":
            pad = [(c + cfg.align - 1) // cfg.align * cfg.align for c in ref.counts]
            assert offsets.tolist() == [sum(pad[:e]) for e in range(EL + 1)], f"rank {p}: offsets"
        want_sel = torch.tensor([[int((inputs[s][1] == p * EL + e).sum()) for e in range(EL)] for s in range(R)])
        assert torch.equal(sts[p].sel.long(), want_sel), f"rank {p}: count matrix"


def _check_send_buffer(cfg, spec: RemoteSpec, st: RemoteState, send: torch.Tensor, inp):
    """The trailers of rows_p: token order, the local expert ids for p, their positions j, the
    weights; the header's EL part; ``send_pos``."""
    x, ids, w = inp
    R, EL, K, HDR, RB = cfg.R, cfg.EL, cfg.K, spec.hdr_bytes, spec.row_bytes
    PW = spec.payload_bytes // 4
    # j: the position of each selection among this rank's selections of the same expert
    flat = ids.reshape(-1)
    j = torch.tensor([int((flat[:i] == flat[i]).sum()) for i in range(flat.numel())]).view(ids.shape)
    o = 0
    for p in range(R):
        if p == spec.rank:
            continue
        hdr = send[o:o + HDR].view(torch.int32)
        assert hdr[R:R + EL].tolist() == [int((ids == p * EL + e).sum()) for e in range(EL)], f"HDR_{p} of {spec.rank}"
        toks = torch.nonzero(((ids >= 0) & (ids // EL == p)).any(1)).flatten().tolist() if spec.remote(p) else []
        want_pos = torch.full((x.shape[0],), -1, dtype=torch.int32)
        want_pos[toks] = torch.arange(len(toks), dtype=torch.int32)
        assert torch.equal(st.send_pos[:x.shape[0], p], want_pos), f"send_pos of {spec.rank} for {p}"
        rows = send[o + HDR:o + HDR + len(toks) * RB].view(len(toks), RB // 4, 4).view(torch.int32)[..., 0]
        for n, t in enumerate(toks):
            tr = rows[n, PW:PW + 1 + 3 * K]
            mine = (ids[t] >= 0) & (ids[t] // EL == p)
            assert int(tr[0]) == t
            assert tr[1:1 + K].tolist() == torch.where(mine, ids[t] - p * EL, -1).tolist()
            assert tr[1 + K:1 + 2 * K][mine].tolist() == j[t][mine].tolist()
            assert torch.equal(tr[1 + 2 * K:].view(torch.float32)[mine], w[t][mine])
        o += HDR + len(toks) * RB


def _expert_y(cfg, spec, x, sc, offsets) -> torch.Tensor:
    """bf16 expert outputs in the layout of expert_x (NaN rows stay NaN)."""
    v = dequantize_fp8(x, sc) if cfg.dtype.startswith("fp8") else x.float()
    y = torch.empty(v.shape, dtype=torch.bfloat16)
    for e in range(cfg.EL):
        ge = spec.rank * cfg.EL + e
        if spec.layout == "masked":
            y[e] = _expert_fn(ge, v[e]).to(torch.bfloat16)
        else:
            a, b = int(offsets[e]), int(offsets[e + 1])
            y[a:b] = _expert_fn(ge, v[a:b]).to(torch.bfloat16)
    if spec.layout == "packed":
        y[int(offsets[-1]):] = float("nan")
    return y


def _check_combine(cfg, specs, inputs, outs_c):
    R, EL, E = cfg.R, cfg.EL, cfg.R * cfg.EL
    fp8 = cfg.dtype.startswith("fp8")
    for s in range(R):
        x, ids, w = inputs[s]
        vals = dequantize_fp8(*quantize_fp8(x)) if fp8 else x.float()
        partial = torch.zeros(R, *x.shape)
        for k in range(cfg.K):
            for t in range(x.shape[0]):
                gid = int(ids[t, k])
                if gid >= 0:
                    partial[gid // EL, t] += w[t, k] * _expert_fn(gid, vals[t:t + 1])[0]
        partial = partial.to(torch.bfloat16).float()   # one rounding per (owner, token)
        base = sum(partial[o] for o in range(R) if not specs[s].remote(o))
        remote_sum = sum((partial[o] for o in range(R) if specs[s].remote(o)), torch.zeros(x.shape))
        base_in, out = outs_c[s]
        assert torch.equal(base_in, base if torch.is_tensor(base) else torch.zeros(x.shape))
        want = (base_in + remote_sum).to(torch.bfloat16)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), f"rank {s}: combine output"
        ref = moe_local(E, x, ids, w, _expert_fn, dispatch_dtype=FP8 if fp8 else torch.bfloat16)
        torch.testing.assert_close(out.float(), ref, atol=0.5, rtol=2 ** -7)


def _specs(cfg: Cfg) -> list:
    fp8 = cfg.dtype.startswith("fp8")
    ovcap = cfg.R * cfg.M  # every batch fits (the proxy's capacity error is tested in test_proxy_protocol.py)
    return [RemoteSpec(rank=r, world=cfg.R, node_size=cfg.G, num_experts=cfg.R * cfg.EL, topk=cfg.K, hidden=cfg.H,
                       max_tokens=cfg.M, fp8=fp8, private_capacity=cfg.cap, overflow_capacity=ovcap,
                       layout=cfg.layout, expert_alignment=cfg.align) for r in range(cfg.R)]


def _regions(sp: RemoteSpec) -> dict:
    """The five proxy regions, poisoned; never reset between epochs (as in a real run)."""
    return {n: torch.full((max(16, b),), 0xFF, dtype=torch.uint8) for n, b in sp.region_bytes().items()}


def _seed(cfg: Cfg, e: int) -> int:
    return 97 * e + 13 * cfg.R + 7 * cfg.G + cfg.cap


def _pack_rank(cfg, sp, st, reg, inp) -> None:
    """pack; ``fp8pre`` passes the input quantized beforehand (its bytes equal the in-kernel ones)."""
    x, ids, w = inp
    if cfg.dtype == "fp8pre":
        q, sc = quantize_fp8(x)
        remote.pack(sp, st, q, ids, w, reg["disp_send"], x_scales=sc)
    else:
        remote.pack(sp, st, x, ids, w, reg["disp_send"])


def _unpack_rank(cfg, sp, st, reg, sel_local_only=False):
    """Count matrix + unpack into a poisoned expert layout; returns (expert_x, scales, counts, offsets)."""
    EL, fp8 = cfg.EL, cfg.dtype.startswith("fp8")
    lead = (EL, sp.expert_capacity) if sp.layout == "masked" else (sp.expert_capacity,)
    x = _poison(torch.empty(*lead, cfg.H, dtype=FP8 if fp8 else torch.bfloat16))
    sc = _poison(torch.empty(*lead, sp.num_scale_blocks)) if fp8 else None
    counts = torch.full((EL,), -7, dtype=torch.int32)
    offsets = torch.full((EL + 1,), -7, dtype=torch.int32) if sp.layout == "packed" else None
    remote.fill_count_matrix(sp, st, reg["round1"])
    if sel_local_only:  # a wrong count matrix (node peers' counts missing) must be caught
        for s in range(cfg.R):
            if not sp.remote(s) and s != sp.rank:
                st.sel[s] = 0
    remote.unpack(sp, st, reg["round1"], reg["overflow"], x, sc, counts, offsets)
    assert int(st.err[0]) == 0, st.err
    return x, sc, counts, offsets


def _combine_recv_rank(cfg, specs, st, reg, inp):
    """combine_unpack with the node owners' part as base; returns (base, out)."""
    sp = specs[st.spec.rank]
    base = _node_base(cfg, specs, sp.rank, inp)
    out = torch.full(inp[0].shape, float("nan"), dtype=torch.bfloat16)
    remote.combine_unpack(sp, st, reg["comb_recv"], inp[1], out, base=base)
    return base, out


def _count_rows(cfg, specs, C, stats):
    for s in range(cfg.R):
        for p in range(cfg.R):
            if specs[s].remote(p):
                stats["round1_rows"] += min(int(C[s, p]), cfg.cap)
                stats["overflow_rows"] += max(0, int(C[s, p]) - cfg.cap)


def _run(cfg: Cfg, epochs=(("uniform", 1), ("skewed", 2)), swap_overflow=False, sel_local_only=False):
    """Every rank in this process; the proxies' copies by ``_deliver_*``."""
    R = cfg.R
    specs = _specs(cfg)
    sts = [RemoteState(sp) for sp in specs]
    regs = [_regions(sp) for sp in specs]
    stats = {"remote_rows": 0, "round1_rows": 0, "overflow_rows": 0}
    for routing, e in epochs:
        inputs = _inputs(cfg, routing, seed=_seed(cfg, e))
        for r in range(R):
            sts[r].epoch.fill_(e)
            _pack_rank(cfg, specs[r], sts[r], regs[r], inputs[r])
            _check_send_buffer(cfg, specs[r], sts[r], regs[r]["disp_send"], inputs[r])
        C = _deliver_dispatch(specs, regs, e, swap_overflow=swap_overflow)
        outs = [_unpack_rank(cfg, specs[r], sts[r], regs[r], sel_local_only) for r in range(R)]
        _count_rows(cfg, specs, C, stats)
        _check_dispatch(cfg, specs, sts, outs, inputs, C, stats)
        for r, sp in enumerate(specs):
            remote.combine_pack(sp, sts[r], _expert_y(cfg, sp, *outs[r][:2], outs[r][3]), regs[r]["comb_send"])
        _deliver_combine(specs, regs, C, e)
        _check_combine(cfg, specs, inputs, [_combine_recv_rank(cfg, specs, sts[s], regs[s], inputs[s])
                                            for s in range(R)])
    return stats


def _proxy_rank(cfg: Cfg, rank: int, epochs, conn) -> None:
    """One rank as a process with the native proxy over TCP loopback doing the copies."""
    from moe_ep.proxy import Proxy, TcpTransport

    # A forked child must not enter the parent's intra-op thread pool (it can hang after fork).
    torch.set_num_threads(1)
    try:
        specs = _specs(cfg)
        sp = specs[rank]
        st, reg = RemoteState(sp), _regions(sp)
        eng = TcpTransport(rank, cfg.R, streams=2)
        eng.set_fault(delay_us=100, reorder=True)
        px = Proxy(eng, **sp.proxy_kwargs(), timeout_s=20.0, spin_us=20, sleep_us=200,
                   regions={n: reg[n].numpy() for n in REGIONS})
        conn.send(eng.endpoint)
        eng.connect(conn.recv(), timeout_s=20)
        px.start()
        log = []
        for routing, e in epochs:
            inp = _inputs(cfg, routing, seed=_seed(cfg, e))[rank]
            st.epoch.fill_(e)
            _pack_rank(cfg, sp, st, reg, inp)
            px.ring("dispatch", e)
            px.wait_ready("dispatch", e, 30)
            outs = _unpack_rank(cfg, sp, st, reg)
            remote.combine_pack(sp, st, _expert_y(cfg, sp, *outs[:2], outs[3]), reg["comb_send"])
            px.ring("combine", e)
            px.wait_ready("combine", e, 30)
            log.append((outs, st.send_counts.clone(), st.sel.clone(), _combine_recv_rank(cfg, specs, st, reg, inp)))
        conn.send(("done", log))
        conn.recv()  # every rank finished before any closes
        px.close()
        eng.close()
    except BaseException:  # noqa: BLE001 - reported to the parent
        import traceback

        conn.send(("exception", traceback.format_exc()))


def _run_proxy(cfg: Cfg, epochs) -> dict:
    """The same checks as ``_run``, with one process per rank and the native proxy delivering."""
    import multiprocessing as mp
    from types import SimpleNamespace

    ctx = mp.get_context("fork")
    procs = []
    for r in range(cfg.R):
        a, b = ctx.Pipe()
        pr = ctx.Process(target=_proxy_rank, args=(cfg, r, epochs, b), daemon=True)
        pr.start()
        procs.append((pr, a))
    try:
        eps = []
        for pr, c in procs:
            assert c.poll(60), "rank did not start"
            eps.append(c.recv())
            assert isinstance(eps[-1], str), eps[-1]
        for _, c in procs:
            c.send(eps)
        logs = []
        for r, (pr, c) in enumerate(procs):
            assert c.poll(90), f"rank {r} hung"
            kind, log = c.recv()
            assert kind == "done", f"rank {r}:\n{log}"
            logs.append(log)
        for _, c in procs:
            c.send("close")
        specs = _specs(cfg)
        stats = {"remote_rows": 0, "round1_rows": 0, "overflow_rows": 0}
        for n, (routing, e) in enumerate(epochs):
            inputs = _inputs(cfg, routing, seed=_seed(cfg, e))
            sts = [SimpleNamespace(send_counts=logs[r][n][1], sel=logs[r][n][2]) for r in range(cfg.R)]
            C = torch.stack([st.send_counts for st in sts]).long()
            _count_rows(cfg, specs, C, stats)
            _check_dispatch(cfg, specs, sts, [logs[r][n][0] for r in range(cfg.R)], inputs, C, stats)
            _check_combine(cfg, specs, inputs, [logs[r][n][3] for r in range(cfg.R)])
        for pr, _ in procs:
            pr.join(20)
        return stats
    finally:
        for pr, _ in procs:
            if pr.is_alive():
                pr.kill()


def _node_base(cfg, specs, s, inp):
    """float32 [T, H]: what the node owners (s included) contribute, each pre-reduced to bf16."""
    x, ids, w = inp
    vals = dequantize_fp8(*quantize_fp8(x)) if cfg.dtype.startswith("fp8") else x.float()
    out = torch.zeros(x.shape)
    for o in range(cfg.R):
        if specs[s].remote(o):
            continue
        part = torch.zeros(x.shape)
        for t in range(x.shape[0]):
            for k in range(cfg.K):
                gid = int(ids[t, k])
                if gid >= 0 and gid // cfg.EL == o:
                    part[t] += w[t, k] * _expert_fn(gid, vals[t:t + 1])[0]
        out += part.to(torch.bfloat16).float()
    return out


# ------------------------------------------------------------------------ tests
TOPOS = [(4, 2), (4, 1), (3, 1)]  # 2 nodes x 2, 4 nodes x 1, 3 nodes x 1
COMBOS = [("bf16", "masked", 1), ("fp8", "packed", 4), ("bf16", "packed", 8), ("fp8", "masked", 1),
          ("fp8pre", "packed", 1)]


@pytest.mark.parametrize("cap", [0, 1, 64], ids=["cap0", "cap1", "cap_large"])
@pytest.mark.parametrize("R,G", TOPOS, ids=["2x2", "4x1", "3x1"])
def test_remote_dispatch_combine(R, G, cap):
    i = TOPOS.index((R, G)) * 3 + [0, 1, 64].index(cap)
    dtype, layout, align = COMBOS[i % 5]
    # Two epochs (both parity copies, regions never reset), uniform then skewed routing.
    st = _run(Cfg(R, G, cap, dtype, layout, align, H=256 if i % 3 == 2 else 128))
    assert st["remote_rows"] > 0
    assert (st["overflow_rows"] > 0) == (cap < 64) and (st["round1_rows"] > 0) == (cap > 0), st


@pytest.mark.parametrize("dtype,layout,align", [c for c in COMBOS if c[0] != "bf16" or c[2] == 8])
def test_remote_all_combos_4x1_cap1(dtype, layout, align):
    st = _run(Cfg(4, 1, 1, dtype, layout, align), epochs=(("skewed", 3),))
    assert st["overflow_rows"] > 0 and st["round1_rows"] > 0, st


@pytest.mark.parametrize("R,G,cap,dtype,layout,align", [(4, 2, 1, "fp8", "packed", 4), (3, 1, 0, "bf16", "masked", 1)],
                         ids=["2x2-cap1-fp8-packed", "3x1-cap0-bf16-masked"])
def test_remote_kernels_with_native_proxy(R, G, cap, dtype, layout, align):
    # The formats agree with csrc/proxy: the native proxy over TCP (delay and reorder injection on)
    # delivers what the kernels packed, two epochs in a row.
    pytest.importorskip("moe_ep.proxy.native").lib()
    st = _run_proxy(Cfg(R, G, cap, dtype, layout, align), epochs=(("uniform", 1), ("skewed", 2)))
    assert st["remote_rows"] > 0 and st["overflow_rows"] > 0, st


@pytest.mark.parametrize("mutation", ["swap_overflow", "sel_local_only"])
def test_checks_catch_wrong_offsets(mutation):
    # The checks are strict enough to see an overflow region filled in the wrong source order, and
    # positions computed without the node peers' counts.
    cfg = Cfg(4, 2, 0, "bf16", "masked") if mutation == "sel_local_only" else Cfg(4, 1, 0, "bf16", "masked")
    with pytest.raises(AssertionError, match="expert_x"):
        _run(cfg, epochs=(("uniform", 1), ("skewed", 2)), **{mutation: True})


def test_pack_never_writes_past_max_send_rows():
    # More rows to remote peers than max_send_rows: the error record says capacity, and nothing is
    # written past the send buffer's end (the proxy refuses the epoch as well).
    cfg = Cfg(4, 1, 1)
    sp = RemoteSpec(rank=0, world=4, node_size=1, num_experts=8, topk=3, hidden=128, max_tokens=6, fp8=False,
                    private_capacity=1, overflow_capacity=8, max_send_rows=3)
    st = RemoteState(sp)
    st.epoch.fill_(1)
    n = sp.region_bytes()["disp_send"]
    buf = torch.full((n + 4096,), 0xAB, dtype=torch.uint8)
    x, ids, w = _inputs(cfg, "uniform", seed=4)[0]  # rank 0 of seed 4: 6 tokens
    assert int(((ids >= 0) & (ids // 2 != 0)).any(1).sum()) > 3
    remote.pack(sp, st, x, ids, w, buf[:n])
    assert int(st.err[0]) == 3 and (buf[n:] == 0xAB).all(), st.err
    assert int(st.send_counts[1:].sum()) > 3


def test_sizes_match_the_proxy():
    native = pytest.importorskip("moe_ep.proxy.native")
    for fp8, H, K in ((False, 128, 3), (True, 7168, 8), (True, 2064, 1)):
        sp = RemoteSpec(rank=1, world=4, node_size=2, num_experts=16, topk=K, hidden=H, max_tokens=32, fp8=fp8,
                        private_capacity=5, overflow_capacity=40)
        assert sp.row_bytes % 16 == 0 and sp.row_bytes >= sp.payload_bytes + 4 * (1 + 3 * K)
        assert sp.hdr_bytes == native.hdr_bytes(4, 4)
        cfg = native.ProxyConfig(1, 4, 2, 4, sp.row_bytes, sp.comb_row_bytes, 5, 40, sp.max_send_rows, 1, 0, 0)
        need = (native.ctypes.c_uint64 * 5)()
        native.lib().moe_ep_proxy_region_bytes(native.ctypes.byref(cfg), need)
        assert list(need) == [sp.region_bytes()[n] for n in REGIONS]
    assert RemoteSpec(0, 2, 1, 2, 8, 7168, 128, True, 4, 8).row_bytes == 7504  # 7168 + 4*56 + 4*25, aligned


# ------------------------------------------------------------------------ sm_90 compile
_COMPILE = r"""
import importlib, pickle, re, sys
from moe_ep.kernels.aot import compile_for
out = []
for mod, name, spec in pickle.load(open(sys.argv[1], "rb")):
    if "INTERP" in spec["consts"]:
        spec["consts"]["INTERP"] = False  # recorded under the interpreter; compile the GPU form
    ptx = compile_for(getattr(importlib.import_module(mod), name), spec).asm["ptx"]
    out.append((name, len(re.findall(r"st\.global(?:\.cs)?\.v[24]", ptx)), len(re.findall(r"st\.global(?:\.cs)?\.b8", ptx))))
pickle.dump(out, open(sys.argv[1] + ".out", "wb"))
"""


def test_remote_kernels_compile_for_sm90(monkeypatch, tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    from test_compile_sm90 import gpu_chunking

    gpu_chunking(monkeypatch)
    rec = []

    def spy(fn, grid, args, consts):
        rec.append((fn.fn.__module__, fn.fn.__name__, signature(fn.arg_names, args, consts)))

    monkeypatch.setattr(remote, "_launch", spy)
    for fp8, layout, H, T in ((True, "packed", 7168, 128), (False, "masked", 2048, 512)):
        R, E, K = 4, 32, 8
        sp = RemoteSpec(rank=1, world=R, node_size=1, num_experts=E, topk=K, hidden=H, max_tokens=T, fp8=fp8,
                        private_capacity=16, overflow_capacity=64, layout=layout, expert_alignment=16)
        st = RemoteState(sp)
        x = torch.zeros(T, H, dtype=torch.bfloat16)
        regs = {n: torch.zeros(16, dtype=torch.uint8) for n in REGIONS}  # never run: only recorded
        remote.pack(sp, st, x, torch.zeros(T, K, dtype=torch.int64), torch.zeros(T, K), regs["disp_send"])
        remote.fill_count_matrix(sp, st, regs["round1"])
        ex = torch.zeros(sp.expert_capacity * (E // R if layout == "masked" else 1), H,
                         dtype=FP8 if fp8 else torch.bfloat16)
        sc = torch.zeros(ex.shape[0], sp.num_scale_blocks) if fp8 else None
        remote.unpack(sp, st, regs["round1"], regs["overflow"], ex, sc, torch.zeros(E // R, dtype=torch.int32),
                      torch.zeros(E // R + 1, dtype=torch.int32))
        remote.combine_pack(sp, st, torch.zeros(ex.shape[0], H, dtype=torch.bfloat16), regs["comb_send"])
        remote.combine_unpack(sp, st, regs["comb_recv"], torch.zeros(T, K, dtype=torch.int64),
                              torch.zeros(T, H, dtype=torch.bfloat16), base=None)
        if fp8:  # pre-quantized input
            remote.pack(sp, st, torch.zeros(T, H, dtype=FP8), torch.zeros(T, K, dtype=torch.int32), torch.zeros(T, K),
                        regs["disp_send"], x_scales=torch.zeros(T, sp.num_scale_blocks))
    assert len(rec) == 14
    # The second configuration changes only the pack's and unpack's code (dtype, layout).
    rec = [r for n, r in enumerate(rec) if n < 8 or r[1] in ("remote_pack_kernel", "remote_unpack_kernel")]
    by = {}
    for name, vec, b8 in _compile_sm90(rec, tmp_path):
        by.setdefault(name, []).append((vec, b8))
    # Rows move as vectors (one transaction per byte would be 10-100x slower): the pack's row
    # stores, the unpack's copies into the expert layout, the combine rows.
    for name in ("remote_pack_kernel", "remote_unpack_kernel", "remote_combine_pack_kernel",
                 "remote_combine_unpack_kernel"):
        assert all(vec > 0 and b8 == 0 for vec, b8 in by[name]), (name, by[name])


def _compile_sm90(rec: list, tmp_path) -> list:
    """(kernel name, vector stores, byte stores) of each recorded launch compiled for sm_90 in a
    fresh process: kernels defined under TRITON_INTERPRET cannot be compiled."""
    path = tmp_path / "remote_launches.pkl"
    path.write_bytes(pickle.dumps(rec))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", _COMPILE, str(path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return pickle.loads((tmp_path / "remote_launches.pkl.out").read_bytes())
