"""EPBuffer end to end over the verbs transport: two CPU rank processes as two nodes
(``node_size=1``), so every row goes through the proxies over RDMA writes with immediates; the
dispatch and combine results are checked against the oracle (tests/ep_cases.py), for bf16 and
fp8 and with round 2 forced.

``rdma``-marked: needs a usable verbs device (a NIC, or Soft-RoCE), skipped with the reason
elsewhere (failed with ``MOE_EP_REQUIRE_RDMA=1``). Runs with ``--noconftest`` too.
"""
from __future__ import annotations

import dist_util
from ep_cases import DTYPES, Case, run_calls
from test_verbs_transport import rdma_test


def _worker(rank, world_size, cases, private_capacity):
    import os

    os.environ["MOE_EP_TRANSPORT"] = "verbs"
    import moe_ep

    group = moe_ep.EPGroup(node_size=1)
    fails, kinds = [], []
    for c in cases:
        with moe_ep.EPBuffer(group, c.E, c.H, c.M, c.K, dispatch_dtype=DTYPES[c.dtype], layout=c.layout,
                             expert_alignment=c.align, timeout_s=60.0, private_capacity=private_capacity) as buf:
            kinds.append(type(buf.remote.proxy.engine).__name__)
            fails += run_calls(group, buf, c)
    return fails, kinds


@rdma_test
def test_epbuffer_over_verbs_two_nodes():
    cases = [Case(R=2, E=4, K=2, dtype="bf16", layout="masked", M=4, calls=("uniform", "sparse"), seed=5),
             Case(R=2, E=2, K=3, dtype="fp8", layout="packed", align=16, M=4, data="random",
                  calls=("skewed", "uniform"), seed=6)]
    for pc in (None, 0):  # default private capacity, then every row in round 2
        results = dist_util.run(2, _worker, cases, pc, timeout=1200)
        fails = [f for r in results for f in r[0]]
        assert not fails, "\n".join(fails[:40])
        assert all(k == "VerbsTransport" for r in results for k in r[1]), results
