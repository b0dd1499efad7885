"""EPBuffer across nodes with an overflow region of a few rows, so ordinary batches cross in 3+
windows (docs/ARCHITECTURE.md §10, "Round 2 in windows"): dispatch and combine equal the oracle
(tests/ep_cases.py checks) for uniform, zipf and all-to-one routing, in the masked, packed and
rows layouts, bf16 and fp8, on 2 nodes x 2 and 4 x 1; the proxy's trace shows the windows. (The
memory plan with ``overflow_budget_bytes``: tests/test_memory_plan.py.)"""
from __future__ import annotations

import pytest

import dist_util
from ep_cases import DTYPES, Case, run_calls

# (ranks, node size, private capacity, overflow capacity): rows of one window. M = 8 tokens a rank,
# so a receiver's overflow stream reaches 16 (2 x 2) or 24 (4 x 1) rows: 3 to 8 windows.
TOPOLOGIES = {
    "2x2-pc0-ov3": (4, 2, 0, 3),
    "4x1-pc1-ov2": (4, 1, 1, 2),
}


def _cases(R: int, i: int):
    return [
        Case(R=R, E=2 * R, K=2, dtype="bf16", layout="masked", calls=("all_to_one", "uniform", "zipf"), seed=70 + i),
        Case(R=R, E=2 * R, K=3, dtype="fp8", layout="packed", align=(1, 16)[i % 2], calls=("zipf", "all_to_one"),
             seed=80 + i, hooks=i == 1),
        Case(R=R, E=R, K=2, dtype=("bf16", "fp8")[i % 2], layout="rows", calls=("all_to_one", "uniform"),
             seed=90 + i),
    ]


def _windows(trace) -> dict:
    """Per dispatch epoch: overflow windows beyond the first that landed on this rank."""
    out = {}
    for _, kind, _, epoch in trace:
        if kind == "ov_ready":
            out[epoch] = out.get(epoch, 0) + 1
    return out


def _worker(rank, world_size, node_size, private_capacity, overflow_capacity, cases, gpu=False):
    import moe_ep
    import torch

    device = torch.device("cuda", rank % torch.cuda.device_count()) if gpu else None
    group = moe_ep.EPGroup(node_size=node_size, device=device)
    fails, most = [], 0
    for c in cases:
        with moe_ep.EPBuffer(group, c.E, c.H, c.M, c.K, dispatch_dtype=DTYPES[c.dtype], layout=c.layout,
                             expert_alignment=c.align, timeout_s=30.0, private_capacity=private_capacity,
                             overflow_capacity=overflow_capacity) as buf:
            assert buf.remote is not None and buf.remote.spec.overflow_capacity == overflow_capacity
            if gpu and not buf.remote.gpu:
                return [f"rank {rank}: did not take the GPU inter-node path"], 0
            fails += run_calls(group, buf, c)
            most = max([most, *_windows(buf.remote.proxy.trace()).values()])
    return fails, most


def _check(R: int, out) -> None:
    fails = [f for r in out for f in r[0]]
    assert not fails, f"{len(fails)} failed checks:\n" + "\n".join(fails[:30])
    # all-to-one: the last rank takes every remote token, in windows of `ov` rows (the first
    # window and at least 2 more)
    assert out[R - 1][1] >= 2, [r[1] for r in out]


@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_rounds_equal_the_oracle(topo):
    R, G, pc, ov = TOPOLOGIES[topo]
    _check(R, dist_util.run(R, _worker, G, pc, ov, _cases(R, list(TOPOLOGIES).index(topo)), timeout=600))


@pytest.mark.gpu
@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_rounds_equal_the_oracle_gpu(topo):
    """The same on GPU ranks (sharing the GPUs there are; the proxy over TCP loopback): the windows'
    mailbox words in pinned memory, the receive kernel's later windows with every program resident."""
    if dist_util.cuda_device_count() < 1:
        pytest.skip("needs a CUDA GPU")
    R, G, pc, ov = TOPOLOGIES[topo]
    _check(R, dist_util.run(R, _worker, G, pc, ov, _cases(R, list(TOPOLOGIES).index(topo)), True, timeout=900,
                            backend="gloo-cuda"))


def _killed_in_window_worker(rank, world_size, victim, timeout_s):
    """Every token of every rank to ``victim``'s experts, through an overflow region of 2 rows (12
    windows a dispatch at R = 4 x 1, 8 tokens a rank): one good dispatch + combine, then the victim
    SIGKILLs its own process during the next dispatch, once its proxy has taken window 3 (a watcher
    thread reading the proxy's trace); the others report their error."""
    import os
    import signal
    import threading
    import time

    import torch

    import moe_ep
    from test_internode import _error_fields

    group = moe_ep.EPGroup(node_size=1)
    M, H = 8, 128
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(M, H, generator=g).to(torch.bfloat16)
    idx = torch.tensor([[2 * victim, 2 * victim + 1]] * M)
    w = torch.rand(M, 2, generator=g)
    want = (x.float() * w.sum(1, keepdim=True)).to(torch.bfloat16)  # identity experts
    res = {"rank": rank, "good": 0, "windows": 0}
    buf = moe_ep.EPBuffer(group, 2 * world_size, H, M, 2, timeout_s=timeout_s, private_capacity=0,
                          overflow_capacity=2)
    t0 = time.monotonic()
    try:
        for call in range(2):
            if rank == victim and call == 1:
                epoch = max((e for _, _, _, e in buf.remote.proxy.trace()), default=0) + 1

                def watch():
                    while True:
                        if _windows(buf.remote.proxy.trace()).get(epoch, 0) >= 3:
                            os.kill(os.getpid(), signal.SIGKILL)
                        time.sleep(0.002)
                threading.Thread(target=watch, daemon=True).start()
            t0 = time.monotonic()
            h = buf.dispatch(x, idx, w)
            if rank == victim:
                res["windows"] = max(_windows(buf.remote.proxy.trace()).values(), default=0)
            t0 = time.monotonic()
            out = buf.combine(h.expert_x, h)
            torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
            res["good"] += 1
        res["error"] = None
    except Exception as exc:  # noqa: BLE001
        res["error"] = _error_fields(exc, t0)
    buf.close()
    return res


def test_rank_killed_in_a_later_window():
    """The receiver of every overflow row is killed once window 3 of a dispatch's 12 has landed
    (windows 0-3 carry rank 0's rows, 4-7 rank 2's, 8-11 rank 3's): ranks 2 and 3, waiting for its
    credit of a later window, raise PeerLostError or CommTimeoutError naming it and the dispatch
    within the deadline (rank 0, whose rows all went, in the dispatch or the combine that follows);
    nobody hangs."""
    R, victim, timeout_s = 4, 1, 6.0
    got = dist_util.run_with_victim(R, victim, _killed_in_window_worker, victim, timeout_s, timeout=90)
    assert sorted(got) == [r for r in range(R) if r != victim]
    for r, res in got.items():
        err = res["error"]
        assert res["good"] == 1 and err is not None and "other" not in err, res
        assert err["type"] in ("PeerLostError", "CommTimeoutError"), res
        assert (err["rank"], err["peer"]) == (r, victim), res
        # (a loaded machine may let the watcher see window 3 late, so only the last source's rows
        # are sure to be waiting then)
        assert err["phase"] in (("dispatch",) if r == R - 1 else ("dispatch", "combine")), res
        assert err["elapsed"] < timeout_s + 3.0, res
