"""moe_ep.memory_plan against live buffers, and the per-rank memory it gives at DeepSeek-V3 shapes.

(a) On CPU ranks (one node of 2; 2 nodes of 1 and of 2, the proxy over TCP), for masked, packed and
rows: the plan equals ``EPBuffer.memory()`` region by region (bytes and where), and both equal the
bytes of every tensor the buffer actually holds (found by walking it, not through the plan).
(b) The issue's table (H 7168, K 8, E 256, fp8, 8 ranks a node, 4096 tokens a rank) at EP8 and
EP64, region by region: the worst-case baseline (``max_recv_rows="worst"``), which later memory
work is measured against; and the packed layout sized per call (the default) at a uniform batch.
(c) ``moe-ep-bench memory`` prints the table and writes the JSON.
"""
from __future__ import annotations

import json

import pytest
import torch

import dist_util

GIB = float(1 << 30)
SLACK = 16  # bytes: one small allocation (CallState keeps a 2-byte bf16 scalar of its own)

# (layout, dispatch dtype, expert_alignment, expert_capacity, column_major_scales)
CONFIGS = [("masked", "bf16", 1, None, False), ("masked", "fp8", 1, 5, True), ("packed", "fp8", 16, None, False),
           ("packed", "bf16", 1, None, False), ("rows", "fp8", 1, None, False)]
DT = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def _held_bytes(buf) -> int:
    """Bytes of every distinct storage the buffer's objects hold (the node peers' mappings left out)."""
    objs = [buf.parts.memory, buf.workspace, buf.calls]
    if buf.remote is not None:
        objs += [buf.remote, buf.remote.state]
    seen, total = set(), 0
    for obj in objs:
        values = []
        for name, v in vars(obj).items():
            if name == "_views":  # the workspace's mappings of every node rank's memory (its own: local)
                continue
            values += list(v.values()) if isinstance(v, dict) else list(v) if isinstance(v, (list, tuple)) else [v]
        for t in values:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    total += s.nbytes()
    return total


def _plan_worker(rank, world_size, node_size, private_capacity, budget=None):
    import moe_ep

    group = moe_ep.EPGroup(node_size=node_size)
    out = []
    for layout, dt, align, cap, cm in CONFIGS:
        kw = dict(num_experts=2 * world_size, hidden=256, max_tokens=6, topk=3, dispatch_dtype=DT[dt], layout=layout,
                  expert_alignment=align, expert_capacity=cap, column_major_scales=cm)
        if budget is not None:
            kw["overflow_budget_bytes"] = budget
        plan = moe_ep.memory_plan(world_size=world_size, node_size=node_size, private_capacity=private_capacity,
                                  device="cpu", **kw)
        with moe_ep.EPBuffer(group, timeout_s=60.0, private_capacity=private_capacity, **kw) as buf:
            assert (buf.remote is not None) == (node_size < world_size)
            live = buf.memory()
            held = _held_bytes(buf)
            if budget is not None:  # the region: what the budget holds in two copies (whole rows)
                sp = buf.remote.spec
                assert sp.overflow_capacity == budget // (2 * sp.row_bytes) >= 1, (sp.overflow_capacity, sp.row_bytes)
                assert plan["overflow"] == 2 * sp.overflow_capacity * sp.row_bytes <= budget
        out.append((layout, dt, plan, live, held))
    return out


@pytest.mark.parametrize("R,G,pc,budget", [(2, 2, None, None), (2, 1, None, None), (4, 2, 1, None), (2, 1, 0, 2048)],
                         ids=["node-2", "2x1", "2x2-pc1", "2x1-budget"])
def test_plan_equals_live_buffer(R, G, pc, budget):
    for rank, results in enumerate(dist_util.run(R, _plan_worker, G, pc, budget, timeout=600)):
        for layout, dt, plan, live, held in results:
            what = f"rank {rank} {layout} {dt} R={R} G={G}"
            assert [(r.name, r.where) for r in plan.regions] == [(r.name, r.where) for r in live.regions], what
            for p, q in zip(plan.regions, live.regions):
                assert abs(p.bytes - q.bytes) <= SLACK, f"{what}: {p.name} planned {p.bytes}, holds {q.bytes}"
            assert abs(held - plan.total_bytes) <= SLACK, f"{what}: holds {held} bytes, planned {plan.total_bytes}"
            assert plan.device_bytes == 0 and plan.host_bytes == plan.total_bytes  # CPU ranks: host memory only
            if G < R:
                assert plan["overflow"] > 0 and plan["remote_state"] > 0
            assert plan["workspace"] > 0 and plan["expert_x"] > 0


# The issue's numbers (GiB): DeepSeek-V3, fp8 dispatch, 8 ranks a node, 4096 tokens a rank. round1
# is 2 R private_capacity row_bytes = 2 * 64 * 623 * 7504 B = 0.557 GiB (the issue says 0.57).
DSV3 = dict(num_experts=256, hidden=7168, max_tokens=4096, topk=8, dispatch_dtype=torch.float8_e4m3fn)
ISSUE = {  # (EP, layout): {region or sum: GiB}
    (8, "packed"): {"workspace": 1.33, "expert": 1.80, "proxy": 0.0, "total": 3.14},
    # overflow: the default budget, 128 MiB in two copies, and comb_send one window's rows, (R - G)
    # cap + B = 43,831 rows (the issue's 2.72 and 3.06 GiB held every row that could come; the
    # overflow now crosses in windows of 8943 rows, both ways); the rest as the issue has it
    (64, "packed"): {"workspace": 1.33, "expert": 14.44, "proxy": 2.37, "overflow": 0.125, "comb_send": 0.585,
                     "round1": 0.557, "comb_recv": 0.875, "disp_send": 0.229, "total": 18.16},
    (8, "rows"): {"expert": 0.23},
    (64, "rows"): {"expert": 1.80},
}
PROXY = ("disp_send", "round1", "overflow", "comb_send", "comb_recv")


@pytest.mark.parametrize("ep,layout", list(ISSUE))
def test_issue_table_at_deepseek_v3_shapes(ep, layout):
    import moe_ep

    worst = dict(max_recv_rows="worst")  # the baseline: every row that can come
    plan = moe_ep.memory_plan(world_size=ep, node_size=8, layout=layout, **worst, **DSV3)
    got = {"expert": plan["expert_x"] + plan["expert_scales"], "proxy": sum(plan[n] for n in PROXY),
           "total": plan.total_bytes, **{r.name: r.bytes for r in plan.regions}}
    for name, want in ISSUE[(ep, layout)].items():
        assert got[name] / GIB == pytest.approx(want, rel=0.01, abs=0.005), f"EP{ep} {layout} {name}"
    assert (plan["overflow"] > 0) == (ep > 8)
    if ep > 8:  # the proxy's rows in GPU memory (proxy_memory="auto"); headers and mailbox pinned host
        assert {r.where for r in plan.regions if r.name in PROXY} == {"device"}
        assert plan.host_bytes == plan.pinned_bytes > 0
        host = moe_ep.memory_plan(world_size=ep, node_size=8, layout=layout, proxy_memory="host", **worst, **DSV3)
        assert host.total_bytes == plan.total_bytes and host.pinned_bytes == plan.pinned_bytes + got["proxy"]
    text = plan.format()
    assert f"{plan.total_bytes / GIB:.2f}" in text and "expert_x" in text


@pytest.mark.parametrize("ep,total", [(8, 1.56), (64, 3.94)])
def test_packed_sized_per_call_at_deepseek_v3_shapes(ep, total):
    """Sized per call (the default), the packed expert layout holds what a batch brings: at a
    uniform batch (M*K = 32768 rows of 7168 fp8 bytes + 56 scales) 0.225 GiB instead of R*M*K rows
    (EP64: 14.44 GiB); with the overflow in windows of the default budget too, EP64's total goes
    from 23.23 to 3.94 GiB (issue 45's target: <= 4); as built, one row."""
    import moe_ep
    from moe_ep.ops.sizing import uniform_recv_rows

    rows = uniform_recv_rows(4096, 8, 256 // ep)
    plan = moe_ep.memory_plan(world_size=ep, node_size=8, layout="packed", recv_rows=rows, **DSV3)
    assert rows == 32768 and plan["expert_x"] == rows * 7168 and plan["expert_scales"] == rows * 56 * 4
    assert plan.total_bytes / GIB == pytest.approx(total, abs=0.005)
    built = moe_ep.memory_plan(world_size=ep, node_size=8, layout="packed", **DSV3)
    assert built["expert_x"] == 7168 and built.total_bytes == plan.total_bytes - (rows - 1) * (7168 + 224)
    cap = moe_ep.memory_plan(world_size=ep, node_size=8, layout="packed", max_recv_rows=65536, **DSV3)
    assert cap["expert_x"] == 65536 * 7168


@pytest.mark.parametrize("ep,total", [(8, 1.49), (64, 3.94)])
def test_rows_sized_per_call_at_deepseek_v3_shapes(ep, total):
    """Sized per call (the default), the rows layout's received tensors hold what a batch brings:
    at a uniform batch R*M*(1 - C(E - E/R, K)/C(E, K)) rows (EP64: 31,440 of 262,144; EP8: 21,687
    of 32,768) instead of R*M, so EP64 goes from 5.55 to 3.94 GiB (EP8 from 1.56 to 1.49) (issue 45's target: <= 4); a
    cap allocates the cap, ids, weights and sources included."""
    import moe_ep
    from moe_ep.ops.sizing import uniform_rows_layout_rows

    rows = uniform_rows_layout_rows(ep, 4096, 8, 256)
    plan = moe_ep.memory_plan(world_size=ep, node_size=8, layout="rows", recv_rows=rows, **DSV3)
    assert rows == {8: 21687, 64: 31440}[ep]
    assert plan["expert_x"] == rows * 7168 and plan["expert_scales"] == rows * 56 * 4
    assert plan["rows_meta"] == rows * (8 * 4 * 2 + 4) + 4  # ids, weights, source per row; num_recv
    assert plan.total_bytes / GIB == pytest.approx(total, abs=0.005)
    cap = moe_ep.memory_plan(world_size=ep, node_size=8, layout="rows", max_recv_rows=20000, **DSV3)
    assert cap["expert_x"] == 20000 * 7168 and cap["rows_meta"] == 20000 * 68 + 4
    built = moe_ep.memory_plan(world_size=ep, node_size=8, layout="rows", **DSV3)
    assert built.total_bytes == plan.total_bytes - (rows - 1) * (7168 + 224 + 68)


def test_plan_refuses_what_the_buffer_refuses():
    import moe_ep

    with pytest.raises(ValueError, match="^num_experts: expected a multiple of world_size=3, got 256"):
        moe_ep.memory_plan(world_size=3, node_size=3, **DSV3)
    with pytest.raises(ValueError, match="^expert_capacity: only with layout='masked'"):
        moe_ep.memory_plan(world_size=8, node_size=8, layout="rows", expert_capacity=4, **DSV3)
    with pytest.raises(ValueError, match="^proxy_memory: expected one of auto, gpu, host, got 'disk'"):
        moe_ep.memory_plan(world_size=16, node_size=8, proxy_memory="disk", **DSV3)


def test_cli_prints_and_writes_json(tmp_path, capsys):
    import moe_ep
    from moe_ep.bench.cli import main
    from moe_ep.bench.memory import recv_sizing

    out = tmp_path / "memory.json"
    assert main(["memory", "--ep", "8,64", "--gpus-per-node", "8", "--tokens", "4096", "--hidden", "7168", "--topk",
                 "8", "--experts", "256", "--dtype", "fp8", "--layout", "packed,rows", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    rows = [ln.split() for ln in text.splitlines() if ln.split()[:1] == ["4096"]]
    assert [(r[1], r[3]) for r in rows] == [("8", "packed"), ("8", "rows"), ("64", "packed"), ("64", "rows")]
    doc = json.loads(out.read_text())
    assert doc["config"]["num_experts"] == 256 and len(doc["entries"]) == 4
    for r, e in zip(rows, doc["entries"]):
        rows = recv_sizing("uniform", e["layout"], 4096, e["ep"], 8, 256)
        assert "recv_rows" in rows
        plan = moe_ep.memory_plan(world_size=e["ep"], node_size=8, layout=e["layout"], **rows, **DSV3)
        assert e["total_bytes"] == plan.total_bytes and e["regions"] == plan.as_dict()["regions"]
        assert float(r[6]) == round(plan.total_bytes / GIB, 2)
    assert "comb_recv 0.88" in text  # EP64's largest proxy region
    with pytest.raises(SystemExit) as e:
        main(["memory", "--ep", "3", "--experts", "256"])
    assert e.value.code == 2 and "num_experts: expected a multiple of world_size=3" in capsys.readouterr().err


def _settled_free(dev) -> int:
    """The GPU's free bytes once every rank has closed its buffers, freed its IPC node memory that
    waited for a peer to unmap it (``release_deferred``: the first rank to close frees its memory
    at its next sweep), emptied its caching allocator, and the figure has stopped moving."""
    import gc
    import time

    import torch.distributed as dist

    from moe_ep.core.node_memory import release_deferred

    gc.collect()
    torch.cuda.synchronize(dev)
    dist.barrier()  # every rank has closed the last buffer: IPC memory a peer mapped can go now
    release_deferred()
    torch.cuda.empty_cache()
    dist.barrier()
    last, free = -1, torch.cuda.mem_get_info(dev)[0]
    for _ in range(50):
        if free == last:
            break
        time.sleep(0.05)
        last, free = free, torch.cuda.mem_get_info(dev)[0]
    dist.barrier()
    return free


def _device_drop_worker(rank, world_size, node_size, configs):
    """Per config: the GPU's free memory lost while every rank holds its buffer (read on rank 0,
    between barriers, with the ranks' caching allocators emptied first), and the plans' device
    bytes of every rank."""
    import torch.distributed as dist

    import moe_ep

    group = moe_ep.EPGroup(node_size=node_size)
    dev = group.device
    # A small buffer first: what a process pays once, not per buffer (the CUDA runtime that node
    # memory's IPC binding brings, kernels' modules), is spent before anything is measured.
    with moe_ep.EPBuffer(group, num_experts=2 * world_size, hidden=128, max_tokens=4, topk=2, timeout_s=60.0):
        torch.cuda.synchronize(dev)
    out = []
    for kw in configs:
        plan = moe_ep.memory_plan(world_size=world_size, node_size=node_size, device="cuda", **kw)
        planned = torch.tensor([plan.device_bytes], dtype=torch.float64)
        dist.all_reduce(planned)  # (gloo: a CPU tensor)
        free0 = _settled_free(dev)
        with moe_ep.EPBuffer(group, timeout_s=60.0, **kw) as buf:
            torch.cuda.synchronize(dev)
            dist.barrier()
            free1 = torch.cuda.mem_get_info(dev)[0]
            held = buf.memory().device_bytes
            dist.barrier()
        del buf  # (the next config's "before" is read once every rank has let go of this one)
        out.append((kw["layout"], plan.device_bytes, held, int(planned.item()), free0 - free1))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("R,G", [(2, 2), (2, 1)], ids=["node-2", "2x1"])
def test_plan_equals_device_memory_gpu(R, G):
    """On a GPU the plan's device bytes are what the buffers take from the GPU: the free memory the
    ranks' buffers remove together (node memory, workspace, received tensors and proxy state;
    ranks sharing the GPU) is their plans' sum, within what allocators round and the kernels'
    code take (2 MiB a segment, 48 MiB in all). Sizes large enough that a region left out of the
    plan shows: 4096 tokens of 7168 fp8 bytes, packed for the worst case and rows sized per call."""
    dist_util.need_gpu()
    base = dict(num_experts=8 * R, hidden=7168, max_tokens=4096, topk=8, dispatch_dtype=torch.float8_e4m3fn,
                num_programs=32, proxy_memory="host")
    configs = [dict(base, layout="packed", max_recv_rows="worst"), dict(base, layout="rows"),
               dict(base, layout="masked")]
    results = dist_util.run(R, _device_drop_worker, G, configs, timeout=600, backend=dist_util.gpu_backend(R))
    for layout, planned, held, planned_all, dropped in results[0]:
        assert abs(held - planned) <= SLACK, f"{layout}: the live buffer holds {held} device bytes, planned {planned}"
        assert planned_all > 256 << 20, f"{layout}: too small to tell ({planned_all} bytes)"
        assert planned_all <= dropped <= planned_all + (48 << 20), \
            f"{layout} R={R} G={G}: the GPU lost {dropped} bytes for buffers planned at {planned_all}"
