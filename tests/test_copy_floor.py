"""moe_ep.bench.copy_floor at tiny sizes: every variant's kernel writes what torch writes, the checker
rejects a wrong output (and a wrong output becomes an error row, never a time), and the command line
writes its JSON. On a machine without a GPU the kernels run in Triton's interpreter."""
from __future__ import annotations

import json

import pytest
import torch

from moe_ep.bench import copy_floor as cf
from moe_ep.core.interpret import interpreting

needs_interpreter = pytest.mark.skipif(not interpreting(), reason="--device cpu runs in Triton's interpreter")

# 37 rows (no multiple of 2, 3 or 8: partial steps), 2304-byte rows (576 words: a masked 1024-word
# block, and 9 chunks of 64 words, so the 4- and 8-chunk boxes run past a row's end)
ROWS, ROW_BYTES, EXPAND, PROGRAMS = 37, 2304, 3, (2, 3)


@pytest.fixture(scope="module")
def device() -> torch.device:
    if interpreting():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("no GPU and no TRITON_INTERPRET")
    return torch.device("cuda")


@pytest.fixture(scope="module")
def inp(device) -> cf.Inputs:
    return cf.make_inputs(ROWS, ROW_BYTES, EXPAND, device, seed=1)


def _tma_or_skip(device):
    why = cf.tma_unavailable(device)
    if why:
        pytest.skip(why)


@pytest.mark.parametrize("programs", PROGRAMS)
def test_gathers_match_torch(inp, device, programs):
    ref = cf.reference_gather(inp)
    assert not ref.equal(inp.src), "the permutation must move rows"
    runs = {"plain": lambda o: cf.gather_plain(inp.src, inp.perm, o, programs=programs),
            "pipelined-3": lambda o: cf.gather_pipelined(inp.src, inp.perm, o, programs=programs, stages=3)}
    for n in (2, 4, 8):
        runs[f"inflight-{n}"] = lambda o, n=n: cf.gather_inflight(inp.src, inp.perm, o, programs=programs,
                                                                   rows_in_flight=n)
    for name, run in runs.items():
        out = torch.zeros_like(inp.src)
        run(out)
        assert cf.check(out, ref) is None, name


@pytest.mark.parametrize("programs", PROGRAMS)
def test_read_sums_match_torch(inp, programs):
    """read-N adds every row's channels by column (float32, exact on small integers), whatever the
    program count and the rows in flight; the reference is the plain column sum (one 2048-channel
    piece holds a 1152-channel row)."""
    src = cf.reduce_inputs(inp)[0]
    C = src.shape[1]
    ref = cf.reference_read(src)
    assert ref.shape == (cf.read_width(src),) and not bool(ref[C:].any())
    assert ref[:C].equal(src.double().sum(0).float()) and bool(ref.abs().sum() > 0)
    for n, maxnreg in ((2, ""), (4, ""), (8, ""), (8, "full")):
        out = torch.zeros_like(ref)
        cf.read_rows(src, inp.perm, out, programs=programs, rows_in_flight=n, maxnreg=maxnreg)
        assert cf.check(out, ref) is None, n


@pytest.mark.parametrize("programs", PROGRAMS)
def test_expand_matches_torch(inp, programs):
    out = torch.zeros(ROWS * EXPAND, ROW_BYTES // 4, dtype=torch.int32, device=inp.src.device)
    cf.expand_rows(inp.src, inp.dest, out, programs=programs)
    ref = cf.reference_expand(inp)
    assert cf.check(out, ref) is None
    for k in range(EXPAND):  # the reference itself: row dest[i, k] is src[i]
        assert ref[inp.dest[:, k].long()].equal(inp.src)


@pytest.mark.parametrize("box_rows", (4, 8))
def test_tma_matches_torch(inp, device, box_rows):
    _tma_or_skip(device)
    assert cf.tma_box(ROW_BYTES // 4, box_rows) == (box_rows, 64)
    out = torch.zeros_like(inp.src)
    cf.gather_tma(inp.src, inp.perm, out, programs=3, box_rows=box_rows, stages=2)
    assert cf.check(out, cf.reference_gather(inp)) is None


@pytest.mark.gpu
@pytest.mark.parametrize("programs", PROGRAMS)
def test_ring_matches_torch(inp, device, programs):
    """The Gluon ring gather and expansion (2304-byte rows: 9 chunks of 64 words in a 16-chunk box,
    the overhang zero-filled on load and skipped on store) at 2, 3 and as many slots as fit, with
    1, 2 and 4 of them behind (being stored); the fp8 expansion with 2 and 3 staging buffers."""
    why = cf.ring_unavailable(device)
    if why:
        pytest.skip(why)
    for stages, behind in ((2, 1), (3, 1), (3, 2), (0, 1), (0, 4)):
        out = torch.zeros_like(inp.src)
        cf.ring_variant(inp, out, expand=False, stages=stages, behind=behind)(programs)
        assert cf.check(out, cf.reference_gather(inp)) is None, f"gather, {stages} slots, {behind} behind"
        out = torch.zeros(ROWS * EXPAND, ROW_BYTES // 4, dtype=torch.int32, device=device)
        cf.ring_variant(inp, out, expand=True, stages=stages, behind=behind)(programs)
        assert cf.check(out, cf.reference_expand(inp)) is None, f"expansion, {stages} slots, {behind} behind"
    # bf16 rows of 1536 channels: 12 blocks of 128 in a 16-block box; wire rows of 1584 bytes
    x = cf.fp8_source(cf.make_inputs(ROWS, 1536, EXPAND, device))
    for qbufs in (2, 3):
        out = torch.zeros(ROWS * EXPAND, 1536 + 4 * 12, dtype=torch.uint8, device=device)
        cf.ring_fp8_variant(x, inp.dest, out, qbufs=qbufs)(programs)
        assert cf.check(out, cf.reference_fp8_expand(x, inp.dest)) is None, f"fp8 expansion, {qbufs} buffers"


_RING_COMPILE = r"""
import json, re
from moe_ep.bench import tma_ring
from moe_ep.testing.aot import compile_gluon_for, descriptor_type
from moe_ep.core.workspace import pow2

def facts(kern, **more):
    ptx = kern.asm["ptx"]
    return dict(more, shared=kern.metadata.shared, st_global="st.global" in ptx, st_global_v="st.global.v" in ptx,
                loads=len(re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::cluster\.global", ptx)),
                stores=len(re.findall(r"cp\.async\.bulk\.tensor\.3d\.global\.shared::cta", ptx)),
                ld_global=len(re.findall(r"ld\.global", ptx)))

out = []
for words, gather, k in ((1792, True, 1), (1792, False, 8), (3584, True, 1)):
    chunks, box, cols = tma_ring.row_box(words)
    stages = tma_ring.max_stages(words * 4, words)
    d = descriptor_type("i32", [1, box, cols], 32)
    kern = compile_gluon_for(tma_ring.ring_copy_kernel, dict(src_desc=d, dst_desc=d, idx_ptr="*i32", rows="i32"),
                             dict(GATHER=gather, K=k, BLOCK_K=pow2(k), STAGES=stages, BEHIND=4))
    out.append(facts(kern, kind="copy", words=words, gather=gather, k=k, stages=stages, slot=box * cols * 4))
for hidden, k, q in ((7168, 8, 4), (1536, 3, 2)):
    box, stages = pow2(hidden // 128), tma_ring.fp8_stages(hidden, q)
    kern = compile_gluon_for(tma_ring.ring_fp8_expand_kernel,
                             dict(src_desc=descriptor_type("bf16", [1, box, 128], 16),
                                  dst_desc=descriptor_type("fp8e4nv", [1, box, 128], 8), scale_ptr="*fp32",
                                  idx_ptr="*i32", rows="i32", scale_stride="i32"),
                             dict(CHUNKS=hidden // 128, K=k, BLOCK_K=pow2(k), STAGES=stages, QBUFS=q))
    out.append(facts(kern, kind="fp8", hidden=hidden, k=k, stages=stages, slot=box * 128 * 2, qbufs=q))
print(json.dumps(out))
"""


def test_ring_kernel_compiles_for_sm90():
    """The ring kernels compile for sm_90 without a GPU (in a process without TRITON_INTERPRET) at
    the copy floor's row sizes with as many slots as fit: within one program's shared memory, one
    bulk tensor load per slot and one store per destination row in the PTX, and no row through
    registers to memory (the fp8 expansion stores its scales alone from registers)."""
    import json
    import os
    import subprocess
    import sys

    from moe_ep.bench import tma_ring

    assert tma_ring.row_box(1792) == (7, 8, 256) and tma_ring.row_box(576) == (9, 16, 64)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", _RING_COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    for f in json.loads(p.stdout.strip().splitlines()[-1]):
        assert f["stages"] * f["slot"] <= f["shared"] <= tma_ring.SMEM_BYTES, f
        if f["kind"] == "copy":
            assert (f["loads"], f["stores"]) == (f["stages"] - 4 + 1, f["k"]), f  # 4 behind
            assert not f["st_global"], f"row bytes went through registers: {f}"
            # the loads are the indices alone, each loaded once, one step ahead of its use
            assert f["ld_global"] <= f["stages"] + 1 + 2 * (f["k"] // 4), f
        else:
            assert (f["loads"], f["stores"]) == (f["stages"] + 1, f["k"]), f
            assert f["shared"] >= (f["stages"] + f["qbufs"] / 2) * f["slot"], f"fp8 staging buffers: {f}"
            assert not f["st_global_v"], f"fp8 rows went through registers to memory: {f}"
    with pytest.raises(ValueError, match="behind"):
        tma_ring.ring_copy(None, None, torch.zeros(1, dtype=torch.int32), 1, gather=True, k=1, stages=2, behind=2,
                           programs=1)
    with pytest.raises(ValueError, match="idx: expected contiguous int32"):  # int64 indices would be misread
        tma_ring.ring_copy(None, None, torch.zeros(1, dtype=torch.int64), 1, gather=True, k=1, stages=2, behind=1,
                           programs=1)
    with pytest.raises(ValueError, match="x: expected bfloat16"):
        tma_ring.ring_fp8_expand(torch.zeros(4, 256), torch.zeros(8, 264, dtype=torch.uint8),
                                 torch.zeros(4, 2, dtype=torch.int32), qbufs=2, programs=1)


def test_tma_box():
    assert cf.tma_box(1792, 8) == (8, 256)  # 7168-byte rows: 7 chunks of 256 words, one box of 8
    assert cf.tma_box(1792, 4) == (4, 256)
    assert cf.tma_box(64, 8) == (1, 64)  # a row of one 64-word chunk: one-chunk boxes
    assert cf.tma_box(4096, 16) == (16, 256)


def test_check_rejects_wrong_outputs(inp):
    ref = cf.reference_gather(inp)
    out = ref.clone()
    assert cf.check(out, ref) is None
    out[5, 7] ^= 1  # one bit of one word
    assert "1 of 37 rows (first: row 5)" in cf.check(out, ref)
    assert "expected" in cf.check(ref[:-1], ref)
    # a kernel that gathers through the wrong permutation is caught
    wrong = torch.zeros_like(inp.src)
    cf.gather_plain(inp.src, inp.perm.roll(1), wrong, programs=2)
    assert cf.check(wrong, ref) is not None


def test_a_wrong_output_is_an_error_row_not_a_time(inp):
    out = torch.zeros_like(inp.src)

    def half_done(programs):  # a "kernel" that skips its last row
        out[:-1] = cf.reference_gather(inp)[:-1]

    v = cf.Variant("broken", half_done, out, lambda: cf.reference_gather(inp), 1, 1)
    row = cf.measure(v, 2, iters=1, warmup=0, cuda=False)
    assert row["error"].startswith("wrong output") and "p50_us" not in row
    good = cf.Variant("good", lambda p: out.copy_(cf.reference_gather(inp)), out, lambda: cf.reference_gather(inp),
                      100, 100)
    row = cf.measure(good, 2, iters=2, warmup=0, cuda=False)
    assert "error" not in row and row["p50_us"] > 0 and row["gbps_per_program"] == pytest.approx(row["gbps"] / 2)


@needs_interpreter
def test_cli_cpu_writes_json(tmp_path, capsys):
    path = tmp_path / "floor.json"
    assert cf.main(["--device", "cpu", "--programs", "2", "--iters", "1", "--warmup", "0",
                    "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["times_meaningful"] is False and doc["hardware"] == "cpu"
    assert doc["args"]["rows"] == 64 and doc["args"]["row_bytes"] == 256
    assert {"torch", "triton", "commit"} <= set(doc["env"])
    names = [r["variant"] for r in doc["rows"]]
    assert names == ["plain", "inflight-2", "inflight-4", "inflight-8", "read-2", "read-4", "read-8",
                     *(f"prefetch-{n}-a{a}" for n in (2, 4) for a in (1, 2, 4)), "pipelined-3", "expand-8",
                     *(f"reduce-8-t{t}-c{c}" for t, c in cf.REDUCE_SHAPES), "tma-1x64-s3",
                     *(n for s in ("4", "8", "max") for b in (1, 2, 4) if s == "max" or b < int(s)
                       for n in (f"ring-{s}-b{b}", f"ring-expand-8-s{s}-b{b}")),
                     "ring-fp8-expand-8-w4-q2", "ring-fp8-expand-8-w4-q4", "ring-fp8-expand-8-w8-q4",
                     "torch copy_", "torch index_select"]
    for r in doc["rows"]:
        if r["variant"].startswith("ring"):  # Gluon kernels: GPU only
            assert r["error"].startswith("not available: Gluon"), r
            continue
        assert "error" not in r, r
        assert r["programs"] == ("n/a" if r["variant"].startswith("torch") else 2)
        assert r["p50_us"] > 0 and r["gbps"] > 0
    expand = doc["rows"][names.index("expand-8")]
    assert expand["write_bytes"] == 8 * expand["read_bytes"] == 8 * 64 * 256
    read = doc["rows"][names.index("read-8")]
    assert read["read_bytes"] == 64 * 256 and read["write_bytes"] == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert table[-1].startswith("times are meaningless")
    assert table[-2].startswith("torch index_select")


def test_cli_errors(monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SystemExit):
        cf.parse_args(["--device", "cpu"])
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        cf.parse_args([])
    assert "no CUDA GPU" in capsys.readouterr().err
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for bad in (["--row-bytes", "100"], ["--inflight", "3"], ["--programs", "0"], ["--maxnreg", "lots"]):
        with pytest.raises(SystemExit):
            cf.parse_args(["--device", "cpu"] + bad)
    assert "--maxnreg: expected 'none', 'full' or a register count" in capsys.readouterr().err
    assert cf.parse_args(["--device", "cpu", "--maxnreg", "full"]).maxnreg == "full"


def test_register_budget_lines_are_named():
    """With a register budget the read and reduce lines say so in their names (and still match torch)."""
    inp = cf.make_inputs(16, 256, 2, "cpu")
    names = [v.name for v in cf.variants(inp, inflight=[2], stages=2, tma_box_rows=[], num_warps=4, maxnreg="full")]
    assert "read-2-rfull" in names and "reduce-2-t16-c512-rfull" in names and "inflight-2" in names
