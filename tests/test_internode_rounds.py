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
