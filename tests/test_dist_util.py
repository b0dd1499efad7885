"""The multi-process runner itself: results, remote errors, deadlines, and recovery."""
from __future__ import annotations

import os
import time

import pytest

import dist_util


def _identity(rank, world_size, value):
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return rank, world_size, value, int(t), os.environ.get("TRITON_INTERPRET")


def _boom(rank, world_size):
    if rank == 1:
        raise KeyError("rank one broke")
    return rank


def _hang(rank, world_size):
    if rank == 0:
        time.sleep(3600)
    return rank


def _die(rank, world_size):
    if rank == 1:
        os._exit(3)
    return rank


def test_results_in_rank_order():
    out = dist_util.run(2, _identity, "v")
    assert out == [(0, 2, "v", 3, "1"), (1, 2, "v", 3, "1")]


def test_remote_exception_carries_traceback():
    with pytest.raises(dist_util.RankError) as info:
        dist_util.run(2, _boom)
    assert info.value.rank == 1 and info.value.exc_type == "KeyError"
    assert "rank one broke" in str(info.value) and "_boom" in info.value.remote_traceback
    assert dist_util.run(2, _identity, 1)[1][3] == 3  # the pool is still usable


def _peer_timeout_first(rank, world_size):
    if rank == 0:  # what a peer of a failed rank gets: its collective times out (here, at once)
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 120000ms for recv")
    time.sleep(0.5)
    raise ValueError("the cause")


def test_reported_error_is_the_cause_not_a_peers_timeout():
    with pytest.raises(dist_util.RankError) as info:
        dist_util.run(2, _peer_timeout_first)
    assert info.value.rank == 1 and info.value.exc_type == "ValueError"
    assert "rank 0: RuntimeError: [gloo" in str(info.value)  # the other rank's message comes along


def test_deadline_kills_and_pool_restarts():
    t0 = time.monotonic()
    with pytest.raises(dist_util.RunTimeout, match=r"ranks \[0\]"):
        dist_util.run(2, _hang, timeout=3)
    assert time.monotonic() - t0 < 30
    assert dist_util.run(2, _identity, 2)[0][3] == 3


def test_dead_rank_is_reported_and_pool_restarts():
    with pytest.raises(dist_util.PoolDied, match=r"\[1\]"):
        dist_util.run(2, _die, timeout=60)
    assert dist_util.run(2, _identity, 3)[1][:3] == (1, 2, 3)


def _raise_while_peer_waits(rank, world_size):
    if rank == 1:
        raise ValueError("the cause")
    time.sleep(120)  # (a peer waiting for it in a collective)
    return rank


def test_an_error_cuts_the_others_wait(monkeypatch):
    """After one rank raises, the others get ``ERROR_GRACE_S``, not the run's whole deadline; the
    error is reported as the cause, with the ranks that did not answer, and the pool restarts."""
    monkeypatch.setattr(dist_util, "ERROR_GRACE_S", 1.0)
    t0 = time.monotonic()
    with pytest.raises(dist_util.RankError, match=r"the cause.*ranks \[0\]: no answer") as info:
        dist_util.run(2, _raise_while_peer_waits, timeout=100)
    assert info.value.rank == 1 and time.monotonic() - t0 < 30
    assert dist_util.run(2, _identity, 4)[0][:3] == (0, 2, 4)
