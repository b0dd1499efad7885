"""EPBuffer end to end over the libfabric transport (``MOE_EP_TRANSPORT=libfabric``) on CPU ranks:
2 nodes x 1 and 2 nodes x 2 (node peers by stores, the other node through the proxies over
``tcp;ofi_rxm`` and ``udp;ofi_rxd`` on loopback), checked against the oracle (tests/ep_cases.py);
then a rank killed mid-run, whose survivors name it.

The 2x1 cases cover bf16 masked with a receive hook, fp8 packed with round 2 alone
(``private_capacity=0``) and the rows layout; 2x2 runs one bf16 packed case with round 2 alone.
"""
from __future__ import annotations

import os

import pytest

import dist_util
from ep_cases import DTYPES, Case, run_calls
from test_fabric_transport import PROBES
from test_internode import _check_survivors, _killed_worker

CASES_2x1 = [(dict(R=2, E=4, K=2, dtype="bf16", layout="masked", M=4, calls=("uniform", "sparse"), hooks=True,
                   seed=5), None),
             (dict(R=2, E=2, K=3, dtype="fp8", layout="packed", align=16, M=4, data="random",
                   calls=("skewed", "uniform"), seed=6), 0),
             (dict(R=2, E=4, K=2, dtype="bf16", layout="rows", M=4, calls=("uniform",), seed=7), 1)]
CASES_2x2 = [(dict(R=4, E=8, K=3, dtype="bf16", layout="packed", M=4, calls=("uniform", "skewed"), seed=8), 0)]


def _env(prov: str) -> dict:
    return {"MOE_EP_TRANSPORT": "libfabric", "MOE_EP_FI_PROVIDER": prov}


def _with_env(env: dict, fn, *args):
    """fn(*args) with ``env`` set in this (pooled, reused) rank process, restored after."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn(*args)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _cases_worker(rank, world_size, node_size, prov, cases):
    def run():
        import moe_ep

        group = moe_ep.EPGroup(node_size=node_size)
        fails = []
        for fields, pc in cases:
            c = Case(**fields)
            with moe_ep.EPBuffer(group, c.E, c.H, c.M, c.K, dispatch_dtype=DTYPES[c.dtype], layout=c.layout,
                                 expert_alignment=c.align, timeout_s=60.0, private_capacity=pc) as buf:
                eng = buf.remote.proxy.engine
                if type(eng).__name__ != "FabricTransport" or eng.describe()["provider"] != prov:
                    return [f"rank {rank}: engine {type(eng).__name__} {getattr(eng, 'describe', dict)()}"]
                fails += run_calls(group, buf, c)
        return fails

    return _with_env(_env(prov), run)


def _params():
    return [pytest.param(p, marks=pytest.mark.skipif(not PROBES[p][0], reason=f"libfabric {p}: {PROBES[p][1]}"))
            for p in ("tcp;ofi_rxm", "udp;ofi_rxd")]


@pytest.mark.parametrize("prov", _params())
def test_epbuffer_over_libfabric_2x1(prov):
    fails = [f for r in dist_util.run(2, _cases_worker, 1, prov, CASES_2x1, timeout=600) for f in r]
    assert not fails, f"{len(fails)} failed checks:\n" + "\n".join(fails[:30])


@pytest.mark.parametrize("prov", _params())
def test_epbuffer_over_libfabric_2x2(prov):
    fails = [f for r in dist_util.run(4, _cases_worker, 2, prov, CASES_2x2, timeout=600) for f in r]
    assert not fails, f"{len(fails)} failed checks:\n" + "\n".join(fails[:30])


def _killed(rank, world_size, victim, when, timeout_s, prov):
    return _with_env(_env(prov), _killed_worker, rank, world_size, victim, when, timeout_s, 1, 2, 2)


@pytest.mark.parametrize("prov", _params())
def test_rank_killed_over_libfabric(prov):
    """Three ranks as three nodes; rank 1 SIGKILLs itself before its combine after two good calls:
    each survivor raises naming rank 1 and the combine within its deadline (the lost peer: a
    failed or unanswered keepalive, or the other survivor's goodbye naming it)."""
    victim, timeout_s = 1, 12.0
    got = dist_util.run_with_victim(3, victim, _killed, victim, "combine", timeout_s, prov, timeout=120)
    _check_survivors(got, 3, victim, "combine", timeout_s + 3.0)
