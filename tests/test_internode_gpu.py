"""The inter-node path on GPUs: kernels ring the proxy's doorbells and wait for its ready words in
pinned host memory, the proxy (TCP) moves the rows, against the oracle; then CUDA-graph capture and
replay of that whole exchange, and a silent peer.

Ranks form a gloo group, so rank processes may share one GPU (as they do on a one-GPU machine;
with as many GPUs as ranks each has its own). 2 ranks as 2 nodes of one (every peer through the
proxy), and 2 nodes x 2 ranks (node peers by stores into CUDA-IPC-mapped memory, the other node
through the proxy). Marked ``gpu``: skipped without CUDA.
"""
from __future__ import annotations

import pytest
import torch

import dist_util
from ep_cases import DTYPES, Case, run_calls

pytestmark = pytest.mark.gpu


def _need_gpu():
    if dist_util.cuda_device_count() < 1:
        pytest.skip("needs a CUDA GPU")


def _group(rank: int, node_size: int = 1):
    import moe_ep

    return moe_ep.EPGroup(node_size=node_size, device=torch.device("cuda", rank % torch.cuda.device_count()))


def _matrix_worker(rank, world_size, cases, private_capacity, node_size=1):
    import moe_ep

    group = _group(rank, node_size)
    fails = []
    for c in cases:
        with moe_ep.EPBuffer(group, c.E, c.H, c.M, c.K, dispatch_dtype=DTYPES[c.dtype], layout=c.layout,
                             expert_alignment=c.align, timeout_s=30.0, private_capacity=private_capacity) as buf:
            if buf.remote is None or not buf.remote.gpu:
                return [f"rank {rank}: did not take the GPU inter-node path"]
            fails += run_calls(group, buf, c)
            buf.synchronize()
    return fails


CASES = [
    dict(E=8, K=4, dtype="fp8", layout="masked", H=256, M=32, data="random"),
    dict(E=8, K=8, dtype="bf16", layout="packed", align=16, H=128, M=48),
    dict(E=4, K=2, dtype="fp8pre", layout="packed", H=384, M=16, data="random"),
    dict(E=16, K=8, dtype="fp8", layout="masked", H=7168, M=128, data="random"),  # decode rows
]
ROWS_CASES = [  # the rows layout (one row per (token, rank); tests/test_rows.py on CPU)
    dict(E=8, K=4, dtype="fp8", layout="rows", H=256, M=32, data="random"),
    dict(E=8, K=8, dtype="bf16", layout="rows", H=128, M=48),
    dict(E=4, K=2, dtype="fp8pre", layout="rows", H=384, M=16, data="random"),
]


def _run(R: int, fn, *args):
    """``fn`` on R rank processes of a gloo group on the GPUs there are; fails on any failure string."""
    _need_gpu()
    fails = [f for r in dist_util.run(R, fn, *args, timeout=900, backend="gloo-cuda") for f in r]
    assert not fails, "\n".join(fails[:40])


CALLS = ("uniform", "skewed", "sparse", "none", "repeat")
# (ranks, node size, private capacity): 2 nodes of 1 with every row in round 2 or the default
# private slots; 2 nodes x 2 ranks (node peers through CUDA-IPC-mapped memory), some rows in round 2.
TOPOLOGIES = {"2x1-round2-only": (2, 1, 0), "2x1-default": (2, 1, None), "2x2-pc1": (4, 2, 1)}


@pytest.mark.parametrize("topo", list(TOPOLOGIES))
@pytest.mark.parametrize("layouts", ["masked-packed", "rows"])
def test_matrix_gpu_internode(topo, layouts):
    R, G, pc = TOPOLOGIES[topo]
    kws, seed = (CASES, 90) if layouts == "masked-packed" else (ROWS_CASES, 190)
    cases = [Case(R=R, calls=CALLS, seed=seed + i + 100 * (R > 2), **{**kw, "E": kw["E"] * R // 2})
             for i, kw in enumerate(kws)]
    _run(R, _matrix_worker, cases, pc, G)


@pytest.mark.parametrize("R,G", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
@pytest.mark.parametrize("kw", [dict(dtype="fp8", layout="masked", K=8, data="random"),
                                dict(dtype="bf16", layout="packed", align=16, K=2, data="tagged"),
                                dict(dtype="fp8", layout="rows", K=8, data="tagged")],
                         ids=["fp8-masked", "bf16-packed", "fp8-rows"])
@pytest.mark.parametrize("mode", ["two-launches", "fused", "graph-launch"])
def test_cuda_graph_replay_internode(kw, R, G, mode):
    """CUDA-graph capture of dispatch -> experts -> combine across nodes, replayed with new routing
    against the oracle; ``two-launches``: launched one by one (``Tuning(graph_launch=False)``);
    ``fused``: each op in one launch (``Tuning.fused_internode``); ``graph-launch``: replayed
    eager calls as one graph launch (the default across nodes), the capture made after such a
    replay (the launch graph's kernels go into the caller's graph one by one)."""
    from test_dispatch_combine import _graph_worker

    _run(R, _graph_worker, dict(R=R, E=8, H=256, M=16, seed=78 + R, fused_internode=mode == "fused",
                                graph_launch={"two-launches": False, "graph-launch": True}.get(mode), **kw), G)


def _silent_worker(rank, world_size, timeout_s):
    import time

    import moe_ep

    group = _group(rank)
    buf = moe_ep.EPBuffer(group, 4, 128, 8, 2, timeout_s=timeout_s)
    dev = group.device
    if rank == 1:  # never dispatches; stays alive past the others' deadline
        time.sleep(timeout_s + 12)
        return None
    x = torch.randn(8, 128, device=dev).to(torch.bfloat16)
    idx = torch.tensor([[0, 3]] * 8, device=dev)
    t0 = time.monotonic()
    buf.dispatch(x, idx, torch.ones(8, 2, device=dev))
    try:
        buf.synchronize()
    except moe_ep.CommTimeoutError as exc:
        return (type(exc).__name__, str(exc), exc.rank, exc.peer, exc.phase, time.monotonic() - t0)
    except Exception as exc:  # noqa: BLE001
        return (type(exc).__name__, str(exc), None, None, None, time.monotonic() - t0)
    return ("no error", "", None, None, None, time.monotonic() - t0)


def test_silent_peer_gpu_internode():
    """Rank 1 never dispatches: rank 0's dispatch fails with CommTimeoutError naming it and the
    phase, at synchronize(), within the deadline (plus the wait kernel's slack); nothing hangs."""
    _need_gpu()
    timeout_s = 3.0
    res = dist_util.run(2, _silent_worker, timeout_s, timeout=120, backend="gloo-cuda")[0]
    name, msg, rank, peer, phase, took = res
    assert name == "CommTimeoutError", res
    assert (rank, phase) == (0, "dispatch"), res
    assert peer == 1, f"the silent peer is not named: {msg}"
    assert took < timeout_s + 8, res


# ---------------------------------------------------------------- one launch per op (fused_internode)

def _fused_worker(rank, world_size, cases, private_capacity, node_size):
    """``run_calls`` of each case against the oracle with ``Tuning(fused_internode=True)``; the
    launches the full path made: one per op, both halves, except where a call's receive half is
    its own launch (a receive hook; a packed or rows dispatch sized per call, counted between its
    halves)."""
    import moe_ep
    from test_internode import _CountingLauncher

    group = _group(rank, node_size)
    fails = []
    for c in cases:
        with moe_ep.EPBuffer(group, c.E, c.H, c.M, c.K, dispatch_dtype=DTYPES[c.dtype], layout=c.layout,
                             expert_alignment=c.align, timeout_s=30.0, private_capacity=private_capacity,
                             tuning=moe_ep.Tuning(fused_internode=True),
                             **({"max_recv_rows": c.recv_rows} if c.recv_rows is not None else {})) as buf:
            if buf.remote is None or not buf.remote.gpu or not buf.tuning.fused_internode:
                return [f"rank {rank}: {c.name}: not the fused GPU inter-node path ({buf.num_programs} programs, "
                        f"fused={buf.tuning.fused})"]
            buf.calls.launch = la = _CountingLauncher(buf.calls.launch)
            fails += run_calls(group, buf, c)
            buf.synchronize()
            # (kernel, SEND, RECV) per launch; a hook's receive half is its own launch, and a
            # dispatch sized per call reads its counts on the host between its two halves.
            split = {"internode_dispatch_kernel": c.hooks or (c.layout != "masked" and c.recv_rows is None),
                     "internode_combine_kernel": c.hooks}
            for kernel, two in split.items():
                halves = [n for n in la.names if n[0] == kernel]
                one = [h for h in halves if h[1] and h[2]]
                if not halves or (one if two else len(one) != len(halves)):
                    fails.append(f"rank {rank}: {c.name}: {kernel} launches {halves}")
    return fails


FUSED_CASES = [
    dict(E=16, K=8, dtype="fp8", layout="masked", H=7168, M=128, data="random"),  # decode
    dict(E=8, K=4, dtype="fp8", layout="masked", H=256, M=32, data="random"),
    dict(E=8, K=8, dtype="bf16", layout="packed", align=16, H=128, M=48, recv_rows="worst"),
    dict(E=4, K=2, dtype="fp8pre", layout="packed", H=384, M=16, data="random", recv_rows="worst"),
    dict(E=8, K=4, dtype="fp8", layout="rows", H=256, M=32, data="random", recv_rows="worst"),
    dict(E=8, K=8, dtype="bf16", layout="rows", H=128, M=48),  # sized per call: two launches
    dict(E=8, K=4, dtype="fp8", layout="masked", H=256, M=32, data="random", hooks=True),  # the hook's receive half
]


@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_fused_internode_gpu(topo):
    """``Tuning(fused_internode=True)``: each inter-node dispatch and combine in one launch (both
    halves; programs resident: ranks sharing a GPU take SMs // ranks each), masked, packed and
    rows, against the oracle, with every row in round 2, the default private slots, and node
    peers (2 x 2); calls with hooks and dispatches sized per call keep their two launches."""
    R, G, pc = TOPOLOGIES[topo]
    cases = [Case(R=R, calls=CALLS, seed=290 + i + 100 * (R > 2), **{**kw, "E": kw["E"] * R // 2})
             for i, kw in enumerate(FUSED_CASES)]
    _run(R, _fused_worker, cases, pc, G)


# ---------------------------------------------------------------- replays as one CUDA graph (graph_launch)

def _graph_launch_worker(rank, world_size, cases, node_size):
    """``run_calls`` of each case against the oracle with ``Tuning(graph_launch=True)``; the replays
    must have taken a launch graph (an entry of both halves kept as one graph)."""
    import moe_ep

    group = _group(rank, node_size)
    fails = []
    for c in cases:
        with moe_ep.EPBuffer(group, c.E, c.H, c.M, c.K, dispatch_dtype=DTYPES[c.dtype], layout=c.layout,
                             expert_alignment=c.align, timeout_s=30.0, tuning=moe_ep.Tuning(graph_launch=True),
                             **({"max_recv_rows": c.recv_rows} if c.recv_rows is not None else {})) as buf:
            fails += run_calls(group, buf, c)
            buf.synchronize()
            graphs = sum(e.graph is not None for r in buf.calls.replays for e in r._entries.values())
            if not graphs:
                fails.append(f"rank {rank}: {c.name}: no replay took a launch graph")
    return fails


@pytest.mark.parametrize("topo", ["2x1-default", "2x2-pc1"])
def test_graph_launch_gpu(topo):
    """``Tuning(graph_launch=True)`` across nodes: each replayed dispatch and combine issues its two
    halves as one CUDA graph launch (pointers and token count written into its nodes per call),
    against the oracle over calls of changing routing, masked, packed and rows."""
    R, G, _ = TOPOLOGIES[topo]
    cases = [Case(R=R, calls=CALLS, seed=390 + i + 100 * (R > 2), **{**kw, "E": kw["E"] * R // 2})
             for i, kw in enumerate(FUSED_CASES[:5])]
    _run(R, _graph_launch_worker, cases, G)
