"""moe_ep.Tuning: the variables parsed (and refused, naming them) by ``Tuning.from_env`` alone; a
Tuning given to EPBuffer, MoELayer or the DeepEP adapter reaches the launches, as the variables
do; the measured rules give a GPU buffer's numbers (computed, no GPU); no other module reads a
tuning variable."""
from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
import torch

import dist_util

BASE = dict(num_experts=4, hidden=128, max_tokens=4, topk=2)
ROOT = pathlib.Path(__file__).resolve().parents[1]

# variable, its text, the field's value
GOOD = [("MOE_EP_NUM_WARPS", "8", 8), ("MOE_EP_COMBINE_WARPS", "32", 32), ("MOE_EP_MAXNREG", "full", "full"),
        ("MOE_EP_MAXNREG", "64", "64"), ("MOE_EP_TILE", "2", 2), ("MOE_EP_STAGES", "3", 3),
        ("MOE_EP_COMBINE_TOKENS", "2", 2), ("MOE_EP_OWN_TOKENS", "4", 4), ("MOE_EP_HIST_WARPS", "16", 16),
        ("MOE_EP_PREFETCH", "0", 0), ("MOE_EP_SPLIT", "1", True), ("MOE_EP_SPLIT", "0", False),
        ("MOE_EP_MAX_CHUNKS", "64", 64)]
BAD = [("MOE_EP_NUM_WARPS", "3"), ("MOE_EP_NUM_WARPS", "64"), ("MOE_EP_COMBINE_WARPS", "x"),
       ("MOE_EP_MAXNREG", "8"), ("MOE_EP_MAXNREG", "max"), ("MOE_EP_TILE", "0"), ("MOE_EP_STAGES", "-1"),
       ("MOE_EP_COMBINE_TOKENS", "0"), ("MOE_EP_OWN_TOKENS", "x"), ("MOE_EP_HIST_WARPS", "5"),
       ("MOE_EP_PREFETCH", "-1"), ("MOE_EP_MAX_CHUNKS", "1.5")]


def test_every_variable_has_a_field():
    from moe_ep.core.tuning import ENV, Tuning

    # (fields added since the variables were kept for one release take none: fused_internode, graph_launch)
    assert set(ENV) == {f.name for f in dataclasses.fields(Tuning)} - {"fused_internode", "graph_launch"}
    assert {var for var, _, _ in GOOD} == {var for var, _ in ENV.values()}


@pytest.mark.parametrize("var,text,value", GOOD)
def test_from_env_parses(var, text, value):
    from moe_ep.core.tuning import ENV, Tuning

    field = next(name for name, (v, _) in ENV.items() if v == var)
    t = Tuning.from_env({var: text})
    assert getattr(t, field) == value
    assert t == Tuning(**{field: value})  # the env route and the dataclass alike
    assert Tuning.from_env({var: ""}) == Tuning() == Tuning.from_env({})  # empty: unset


@pytest.mark.parametrize("var,bad", BAD)
def test_from_env_refuses_naming_the_variable(var, bad):
    from moe_ep import Tuning

    with pytest.raises(ValueError, match=f"^{var}: expected .*got '{re.escape(bad)}'"):
        Tuning.from_env({var: bad})


@pytest.mark.parametrize("kw", [dict(num_warps=3), dict(combine_warps=0), dict(maxnreg="max"), dict(maxnreg=8),
                                dict(tile=0), dict(stages=True), dict(prefetch=-1), dict(split=1),
                                dict(max_chunks=2.0)])
def test_fields_are_checked_naming_the_field(kw):
    from moe_ep import Tuning

    (name, v), = kw.items()
    with pytest.raises(ValueError, match=f"^{name}: expected .*got {re.escape(repr(v))}"):
        Tuning(**kw)
    with pytest.raises(ValueError, match=f"^{name}: "):
        Tuning().replace(**kw)


def test_maxnreg_count_is_one_spelling():
    from moe_ep import Tuning

    assert Tuning(maxnreg=64) == Tuning(maxnreg="64") == Tuning.from_env({"MOE_EP_MAXNREG": "64"})


def _gpu_shape(T, dt, layout, P, **kw):
    from moe_ep.ops.sizing import BufferShape

    return BufferShape(world_size=1, node_size=1, num_experts=256, hidden=7168, max_tokens=T, topk=8,
                       num_programs=P, dispatch_dtype=torch.float8_e4m3fn if dt == "fp8" else torch.bfloat16,
                       layout=layout, device_type="cuda", **kw)


def test_rules_give_a_gpu_buffers_numbers(monkeypatch):
    """The measured rules at scripts/sass_digest.py's four configurations (an H200: 132 SMs),
    computed: (num_warps, combine_warps, combine_maxnreg, tile, combine_tile, combine_recv_tile,
    block_ts, combine_recv_tokens, hist_warps)."""
    import moe_ep.core.workspace
    from moe_ep import Tuning

    monkeypatch.setattr(moe_ep.core.workspace, "interpreting", lambda: False)  # a GPU's chunking
    want = {(4096, "fp8", "packed", 32): (16, 32, "full", 2, 2, 1, 16, 4, 4),
            (4096, "bf16", "packed", 132): (16, None, "", 2, 1, 1, 16, 8, 4),
            (4096, "fp8", "rows", 32): (32, None, "", 2, 2, 4, 16, 128, 16),
            (128, "fp8", "masked", 132): (16, None, "", 2, 1, 1, 1, 1, 4)}
    for config, numbers in want.items():
        t = Tuning().resolve(_gpu_shape(*config), sms=132)
        got = (t.num_warps, t.combine_warps, t.combine_maxnreg, t.tile, t.combine_tile, t.combine_recv_tile,
               t.block_ts, t.combine_recv_tokens, t.hist_warps)
        assert got == numbers, config
        assert t.fused and t.stages == 1 and t.dispatch_maxnreg == "" and t.prefetch is None
    assert not Tuning().resolve(_gpu_shape(128, "fp8", "masked", 133), sms=132).fused  # not all resident
    assert not Tuning(split=True).resolve(_gpu_shape(128, "fp8", "masked", 32), sms=132).fused
    # one launch per inter-node op: only where asked, and only where the node ops fuse (off by default)
    assert not Tuning().resolve(_gpu_shape(128, "fp8", "masked", 32), sms=132).fused_internode
    assert Tuning(fused_internode=True).resolve(_gpu_shape(128, "fp8", "masked", 32), sms=132).fused_internode
    assert not Tuning(fused_internode=True).resolve(_gpu_shape(128, "fp8", "masked", 133), sms=132).fused_internode
    assert not Tuning(fused_internode=True, split=True).resolve(_gpu_shape(128, "fp8", "masked", 32),
                                                                sms=132).fused_internode
    with pytest.raises(ValueError, match="fused_internode: expected a bool"):
        Tuning(fused_internode=1)
    with pytest.raises(ValueError, match="graph_launch: expected None or a bool"):
        Tuning(graph_launch="yes")
    assert Tuning().graph_launch is None and Tuning(graph_launch=False).graph_launch is False
    forced = Tuning(num_warps=8, maxnreg="none", tile=1, combine_tokens=2, hist_warps=2, stages=2)
    t = forced.resolve(_gpu_shape(4096, "fp8", "packed", 32), sms=132)
    assert (t.num_warps, t.combine_warps, t.dispatch_maxnreg, t.combine_maxnreg, t.tile, t.combine_tile,
            t.combine_recv_tile, t.combine_recv_tokens, t.hist_warps, t.stages) == \
        (8, 32, "none", "none", 1, 1, 1, 2, 2, 2)


def test_max_chunks_sizes_the_rows_layout(monkeypatch):
    """``max_chunks`` (rows layout) sets the chunks, so the workspace and histograms, and memory_plan
    takes it as the buffer does."""
    import moe_ep.core.workspace
    from moe_ep import Tuning, memory_plan

    monkeypatch.setattr(moe_ep.core.workspace, "interpreting", lambda: False)
    assert _gpu_shape(4096, "fp8", "rows", 32).workspace.CMAX == 32
    shape = _gpu_shape(4096, "fp8", "rows", 32, max_chunks=64)
    assert (shape.workspace.CMAX, shape.block_t) == (64, 64)
    assert Tuning(max_chunks=64).resolve(shape, 132).hist_warps == 4  # 64-token chunks
    kw = dict(world_size=8, node_size=8, num_experts=256, hidden=7168, max_tokens=4096, topk=8, layout="rows",
              num_programs=32)
    monkeypatch.delenv("MOE_EP_MAX_CHUNKS", raising=False)
    default, more = memory_plan(**kw), memory_plan(**kw, tuning=Tuning(max_chunks=64))
    assert more["routing"] > default["routing"] and more["workspace"] > default["workspace"]
    monkeypatch.setenv("MOE_EP_MAX_CHUNKS", "64")
    assert memory_plan(**kw) == more


def _launched_warps(buf) -> dict:
    """{kernel name: the warps it was launched with} over one dispatch + combine of ``buf``."""
    launch, warps = buf.calls.launch, {}

    def spy(key, fn, grid, args, consts, dynamic=None):
        c = consts() if callable(consts) else consts
        warps.setdefault(fn.fn.__name__, set()).add(c["num_warps"])
        return launch(key, fn, grid, args, consts, dynamic)

    buf.calls.launch = spy
    h = buf.dispatch(torch.randn(4, 128, dtype=torch.bfloat16), torch.tensor([[0, 1]] * 4), torch.ones(4, 2))
    buf.combine(torch.zeros(h.expert_x.shape, dtype=torch.bfloat16), h)
    return warps


def test_epbuffer_takes_a_tuning_as_it_takes_the_variables(monkeypatch):
    """EPBuffer(tuning=) on a CPU rank: the launches get its warps, and the buffer's resolved tuning
    equals the one the same variables give."""
    import moe_ep
    from moe_ep import Tuning

    for var, _ in BAD:
        monkeypatch.delenv(var, raising=False)
    tuning = Tuning(num_warps=2, combine_warps=8, hist_warps=2)
    with moe_ep.EPBuffer(moe_ep.EPGroup(), **BASE, tuning=tuning) as buf:
        assert buf.tuning.asked is tuning
        assert (buf.tuning.num_warps, buf.tuning.combine_warps, buf.tuning.hist_warps) == (2, 8, 2)
        assert buf.launch_options("dispatch") == {"num_warps": 2}
        assert _launched_warps(buf) == {"node_dispatch_kernel": {2}, "node_combine_kernel": {8}}
        given = buf.tuning
    monkeypatch.setenv("MOE_EP_NUM_WARPS", "2")
    monkeypatch.setenv("MOE_EP_COMBINE_WARPS", "8")
    monkeypatch.setenv("MOE_EP_HIST_WARPS", "2")
    with moe_ep.EPBuffer(moe_ep.EPGroup(), **BASE) as buf:
        assert buf.tuning == given
    with moe_ep.EPBuffer(moe_ep.EPGroup(), **BASE, tuning=Tuning()) as buf:  # a Tuning given: the variables unread
        assert (buf.tuning.num_warps, buf.tuning.combine_warps, buf.tuning.asked) == (4, None, Tuning())
    with pytest.raises(TypeError, match="^tuning: expected moe_ep.Tuning or None, got dict"):
        moe_ep.EPBuffer(moe_ep.EPGroup(), **BASE, tuning={"num_warps": 2})


def test_layer_passes_its_tuning_to_its_buffers():
    import moe_ep
    from moe_ep import Tuning

    tuning = Tuning(num_warps=2)
    layer = moe_ep.MoELayer(128, 64, 4, 2, max_tokens=4, tuning=tuning)
    try:
        buf = layer.runner.buffer("fwd")
        assert buf.tuning.asked is tuning and buf.tuning.num_warps == 2
    finally:
        layer.runner.close()
    with pytest.raises(TypeError, match="^tuning: expected moe_ep.Tuning"):
        moe_ep.MoELayer(128, 64, 4, 2, tuning=2)


def _deep_ep_worker(rank, R):
    import torch.distributed as dist

    import moe_ep.deep_ep as deep_ep
    from moe_ep import Tuning

    tuning, fails = Tuning(num_warps=2), []
    b = deep_ep.Buffer(dist.group.WORLD, tuning=tuning)
    with b._epbuffer(2 * R, 128, 4, 2, torch.bfloat16, "masked") as buf:
        if buf.tuning.asked is not tuning or buf.tuning.num_warps != 2:
            fails.append(f"Buffer: {buf.tuning}")
    e = deep_ep.ElasticBuffer(dist.group.WORLD, tuning=tuning)
    if e._v1.tuning is not tuning:
        fails.append(f"ElasticBuffer: {e._v1.tuning}")
    try:
        deep_ep.Buffer(dist.group.WORLD, tuning="fast")
        fails.append("tuning='fast' was accepted")
    except TypeError as exc:
        if not str(exc).startswith("tuning: "):
            fails.append(f"the error does not name tuning: {exc}")
    return fails


def test_deep_ep_adapter_passes_its_tuning():
    fails = dist_util.run(1, _deep_ep_worker)[0]
    assert not fails, "\n".join(fails)


def test_bench_points_are_tunings():
    from moe_ep import Tuning
    from moe_ep.bench.variants import parse_point

    assert parse_point("fp8 rows MOE_EP_TILE=2", env={}) == ("fp8", "rows", Tuning(tile=2))
    assert parse_point("bf16 packed MOE_EP_TILE=1", env={"MOE_EP_NUM_WARPS": "8", "MOE_EP_TILE": "2"}) == \
        ("bf16", "packed", Tuning(tile=1, num_warps=8))  # the process's variables, the point's on top
    with pytest.raises(ValueError, match="expected NAME=VALUE with NAME one of MOE_EP_NUM_WARPS"):
        parse_point("fp8 rows MOE_EP_TRANSPORT=tcp", env={})
    with pytest.raises(ValueError, match="^MOE_EP_NUM_WARPS: expected"):
        parse_point("fp8 rows MOE_EP_NUM_WARPS=3", env={})


def test_no_other_module_reads_a_tuning_variable():
    """Only moe_ep/core/tuning.py names a tuning variable as a string (the way a read spells it):
    the package, its scripts and its bench go through Tuning.from_env."""
    from moe_ep.core.tuning import ENV

    names = "|".join(var for var, _ in ENV.values())
    quoted, named = re.compile(rf"""["'](?:{names})["']"""), re.compile(names)
    offenders = []
    for path in sorted([*ROOT.joinpath("moe_ep").rglob("*.py"), *ROOT.joinpath("scripts").glob("*.py")]):
        if path == ROOT / "moe_ep" / "core" / "tuning.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if quoted.search(line) or (named.search(line) and re.search(r"environ|getenv", line)):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
