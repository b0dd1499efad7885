"""EPBuffer end to end over the verbs transport: two CPU rank processes as two nodes
(``node_size=1``), so every row goes through the proxies over RDMA writes with immediates; the
dispatch and combine results are checked against the oracle (tests/ep_cases.py). Two buffers
between them cover bf16 and fp8, masked and packed, round 1 (the default private capacity) and
round 2 alone (``private_capacity=0``), two calls each (both parities of every region). Then
three ranks as three nodes, one killed (SIGKILL) after a good call, before its combine: each
survivor's error names it, though every survivor closes its buffer at once (its goodbye SEND names
the killed rank); and three bare engines (no torch) saying goodbye.

``rdma``-marked: needs a usable verbs device (a NIC, or Soft-RoCE), skipped with the reason
elsewhere (failed with ``MOE_EP_REQUIRE_RDMA=1``). It is in CI's Soft-RoCE VM step, where the
machine is emulated: so this process does not import torch (``--noconftest``; the two rank
processes do, once each) and the ranks are plain spawned processes with one deadline.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import socket
import time
import traceback

import numpy as np
import pytest

from engine_cases import CLEAN_GOODBYE, connect_all as _connect_all, goodbye_names_the_cause
from test_verbs_transport import _dev, errors, rdma_test, transports

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
        out.put((rank, (fails, engines)))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, ([f"rank {rank} raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}"], [])))


KILLED_R, VICTIM = 3, 1
DETECT_S = 60.0  # a survivor's error comes from the lost connection, long before TIMEOUT_S


def _killed_rank(rank: int, port: int, out, when: str) -> None:
    """One of three ranks over verbs running tests/test_internode.py's killed-rank worker (two
    tokens a rank, one good call): rank 1 kills its process before its second dispatch
    (``when="dispatch"``) or before its combine."""
    os.environ.update(TRITON_INTERPRET="1", MOE_EP_TRANSPORT="verbs")
    try:
        import torch.distributed as dist

        from test_internode import _killed_worker

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=KILLED_R)
        out.put((rank, _killed_worker(rank, KILLED_R, VICTIM, when, TIMEOUT_S, good=1, M=2)))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, {"raised": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}))


def _run_ranks(target, world: int, *args, victim: int = -1) -> dict:
    """Spawns ``world`` rank processes ``target(rank, port, out, *args)`` (``port``: their process
    group's); returns {rank: what it put in ``out``} of every rank but ``victim``, which must die."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target, args=(r, port, out, *args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    want = {r for r in range(world) if r != victim}
    got, deadline = {}, time.monotonic() + DEADLINE_S
    try:
        while len(got) < len(want):
            try:
                rank, value = out.get(timeout=1.0)
                got[rank] = value
            except queue.Empty:
                dead = {r: p.exitcode for r, p in enumerate(procs) if r in want - set(got) and p.exitcode is not None}
                assert not dead, f"rank process(es) exited without an answer (exit codes {dead})"
                assert time.monotonic() < deadline, f"ranks {sorted(want - set(got))} did not finish in {DEADLINE_S} s"
        if victim >= 0:
            procs[victim].join(10)
            assert procs[victim].exitcode == -signal.SIGKILL, f"the victim's exit code: {procs[victim].exitcode}"
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return got


@rdma_test
def test_epbuffer_over_verbs_two_nodes():
    got = _run_ranks(_rank, 2)
    fails = [f for fl, _ in got.values() for f in fl]
    assert not fails, "\n".join(fails[:40])
    assert all(e == ["VerbsTransport"] * len(CASES) for _, e in got.values()), got


@rdma_test
def test_rank_killed_over_verbs():
    """Three ranks as three nodes over verbs; rank 1 is killed after a good call, between its
    dispatch and its combine (one case: each costs minutes under emulation; tests/test_internode.py
    kills in both phases over tcp). Each survivor raises PeerLostError naming rank 1 in combine,
    from its lost queue pairs or from the other survivor's goodbye, well within the buffers'
    deadline, though every survivor closes its buffer at once."""
    when = "combine"
    got = _run_ranks(_killed_rank, KILLED_R, when, victim=VICTIM)
    for r, res in got.items():
        assert "raised" not in res, res["raised"]
        err = res["error"]
        assert res["good"] == 1 and err is not None and "other" not in err, res
        assert err["type"] == "PeerLostError" and (err["rank"], err["peer"], err["phase"]) == (r, VICTIM, when), res
        assert f"peer {VICTIM}" in err["msg"] and err["elapsed"] < DETECT_S, res
        assert res["after"] == "BufferBrokenError", res


@rdma_test
@pytest.mark.parametrize("nics", [1, 2])
def test_verbs_goodbye(nics):
    """Three verbs engines in this process (the device opened ``nics`` times each; no torch):
    rank 1 closes after an error naming rank 2, and both others lose it by its goodbye at once
    (RC has no keepalive: without it they would learn nothing until they wrote to it), hearing the
    cause. Then rank 2 closes cleanly: rank 0 only remembers that, and its next write to rank 2
    fails as any write to a vanished peer does, the loss naming the clean goodbye."""
    es = [transports.VerbsTransport(r, 3, device=",".join([_dev()] * nics)) for r in range(3)]
    mem = [np.zeros(4096, np.uint8) for _ in es]
    try:
        keys = [e.register(m) for e, m in zip(es, mem)]
        _connect_all(es)
        goodbye_names_the_cause(errors.CommTimeoutError, es, "verbs device")
        es[0].post_write(2, keys[0], 0, keys[2], 0, 64, imm=7)
        (c,) = es[0].wait_completions(1, 60, check=False)
        msg = es[0].peer_error(2)
        assert c.status == transports.CQ_PEER_LOST and "failed: " in msg, msg
        assert msg.endswith(CLEAN_GOODBYE), msg
    finally:
        for e in es:
            e.close()
