"""EPBuffer end to end over the verbs transport: two CPU rank processes as two nodes
(``node_size=1``), so every row goes through the proxies over RDMA writes with immediates; the
dispatch and combine results are checked against the oracle (tests/ep_cases.py). Two buffers
between them cover bf16 and fp8, masked and packed, round 1 (the default private capacity) and
round 2 alone (``private_capacity=0``), two calls each (both parities of every region).

``rdma``-marked: needs a usable verbs device (a NIC, or Soft-RoCE), skipped with the reason
elsewhere (failed with ``MOE_EP_REQUIRE_RDMA=1``). It is in CI's Soft-RoCE VM step, where the
machine is emulated: so this process does not import torch (``--noconftest``; the two rank
processes do, once each) and the ranks are plain spawned processes with one deadline.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import traceback

from test_verbs_transport import rdma_test

DEADLINE_S = 900.0  # the whole run; under emulation each rank's `import torch` alone takes ~50 s
TIMEOUT_S = 300.0   # the buffers' deadline: an emulated rank can lag its peer by a minute (first launches)
# (Case fields, private_capacity): one buffer each
# (M=2: two chunks of one token each per source, so each program of the two still takes a chunk;
# the interpreter's steps under emulation are what this test's time is made of)
CASES = [(dict(R=2, E=4, K=2, dtype="bf16", layout="masked", M=2, calls=("uniform", "sparse"), seed=5), None),
         (dict(R=2, E=2, K=3, dtype="fp8", layout="packed", align=16, M=2, data="random", calls=("skewed", "uniform"),
               seed=6), 0)]


def _rank(rank: int, port: int, out) -> None:
    """One rank: its process group, then each case's buffer over verbs, checked by ep_cases."""
    os.environ.update(TRITON_INTERPRET="1", MOE_EP_TRANSPORT="verbs")
    try:
        import torch.distributed as dist

        import moe_ep
        from ep_cases import DTYPES, Case, run_calls

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        group = moe_ep.EPGroup(node_size=1)
        fails, engines = [], []
        for fields, private_capacity in CASES:
            c = Case(**fields)
            with moe_ep.EPBuffer(group, c.E, c.H, c.M, c.K, dispatch_dtype=DTYPES[c.dtype], layout=c.layout,
                                 expert_alignment=c.align, timeout_s=TIMEOUT_S,
                                 private_capacity=private_capacity) as buf:
                engines.append(type(buf.remote.proxy.engine).__name__)
                fails += run_calls(group, buf, c)
        dist.destroy_process_group()
        out.put((rank, fails, engines))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, [f"rank {rank} raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}"], []))


@rdma_test
def test_epbuffer_over_verbs_two_nodes():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, port, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + DEADLINE_S
    try:
        while len(got) < 2:
            try:
                rank, fails, engines = out.get(timeout=1.0)
                got[rank] = (fails, engines)
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(procs) if r not in got and p.exitcode is not None}
                assert not dead, f"rank process(es) exited without an answer (exit codes {dead})"
                assert time.monotonic() < deadline, f"ranks {sorted({0, 1} - set(got))} did not finish in {DEADLINE_S} s"
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    fails = [f for fl, _ in got.values() for f in fl]
    assert not fails, "\n".join(fails[:40])
    assert all(e == ["VerbsTransport"] * len(CASES) for _, e in got.values()), got
