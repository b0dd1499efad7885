"""Receive hooks (``return_recv_hook=True``): the send half now, the receive half when the hook is
called, so two micro-batches on two buffers overlap; against the oracle, on CPU ranks (the node
path and the inter-node path), on a GPU when there is one; plus the misuse errors.
"""
from __future__ import annotations

import pytest
import torch

import dist_util
from ep_cases import (DTYPES, Case, check_combine, check_dispatch, expert_fn_for, first_expert, make_expert_y, make_inputs,
                      reference_for)


def _inputs(case: Case, call: int, rank: int, dev):
    inp = make_inputs(case, call)[rank]
    sc = inp.x_scales.to(dev) if inp.x_scales is not None else None
    return inp.x.to(dev), inp.topk_idx.to(dev), inp.topk_weights.to(dev), sc


def _two_batches(group, bufs, cases, call: int):
    """Batch A and batch B: both send halves, then both receive halves (B's before A's for
    combine), each result checked against the oracle. Returns failure strings."""
    from moe_ep.testing.reference import moe_local, reference_moe

    r = group.rank
    ins = [_inputs(c, call, r, group.device) for c in cases]
    refs = [reference_for(group, c, x, i, w, s) for c, (x, i, w, s) in zip(cases, ins)]
    pend = [b.dispatch(x, i, w, x_scales=s, return_recv_hook=True) for b, (x, i, w, s) in zip(bufs, ins)]
    for _, hook in pend:
        hook()
    fails, ys = [], []
    for n, (c, (h, _), ref) in enumerate(zip(cases, pend, refs)):
        where = f"[overlap {'AB'[n]} {c.name} rank {r} call {call}]"
        f = check_dispatch(h, ref, c, where)
        fails += f
        fn = expert_fn_for(c)
        ys.append(make_expert_y(h, c, fn, first_expert(ref, c)) if not f else
                  torch.zeros(h.expert_x.shape, dtype=torch.bfloat16, device=group.device))
    outs = [b.combine(y, h, return_recv_hook=True) for b, y, (h, _) in zip(bufs, ys, pend)]
    for _, hook in reversed(outs):
        hook()
    for n, (c, (x, i, w, s), (out, _)) in enumerate(zip(cases, ins, outs)):
        where = f"[overlap {'AB'[n]} {c.name} rank {r} call {call} combine]"
        fn = expert_fn_for(c)
        dt = DTYPES[c.dtype]
        exp = reference_moe(group, c.E, x, i, w, fn, x_scales=s, dispatch_dtype=dt)
        exp_abs = moe_local(c.E, x, i, w.abs(), lambda e, rows: fn(e, rows).abs(), x_scales=s, dispatch_dtype=dt)
        fails += check_combine(out, exp, exp_abs, x.shape[0], c, where)
    return fails


def _misuse(buf, case: Case, group) -> list:
    """A second call before the hook, a combine of a pending dispatch, a hook called twice."""
    x, i, w, s = _inputs(case, 0, group.rank, group.device)
    log = []
    h, hook = buf.dispatch(x, i, w, x_scales=s, return_recv_hook=True)
    for what, fn in (("dispatch", lambda: buf.dispatch(x, i, w, x_scales=s)),
                     ("combine", lambda: buf.combine(torch.zeros(h.expert_x.shape, dtype=torch.bfloat16,
                                                                 device=group.device), h))):
        try:
            fn()
            log.append(f"{what} before the dispatch hook did not raise")
        except ValueError as exc:
            if "receive hook" not in str(exc):
                log.append(f"{what} before the hook: message does not name the hook: {exc}")
    hook()
    try:
        hook()
        log.append("a second hook() call did not raise")
    except RuntimeError:
        pass
    out, chook = buf.combine(torch.zeros(h.expert_x.shape, dtype=torch.bfloat16, device=group.device), h,
                             return_recv_hook=True)
    chook()
    return log


def _worker(rank, world_size, cases, node_size, misuse, timeout_s=30.0):
    import moe_ep

    group = moe_ep.EPGroup(node_size=node_size)  # in a gloo-cuda pool: cuda:<rank % GPUs>
    bufs = [moe_ep.EPBuffer(group, c.E, c.H, c.M, c.K, dispatch_dtype=DTYPES[c.dtype], layout=c.layout,
                            expert_alignment=c.align, timeout_s=timeout_s) for c in cases]
    try:
        fails = []
        for call in range(len(cases[0].calls)):
            fails += _two_batches(group, bufs, cases, call)
        if misuse:
            fails += _misuse(bufs[0], cases[0], group)
        for b in bufs:
            b.synchronize()
        return fails
    finally:
        for b in bufs:
            b.close()


def _cases(R: int):
    return [Case(R=R, E=2 * R, K=2, dtype="bf16", layout="masked", calls=("uniform", "skewed"), seed=11),
            Case(R=R, E=R, K=3, dtype="fp8", layout="packed", align=16, data="random", calls=("sparse", "uniform"),
                 seed=12)]


@pytest.mark.parametrize("R,node_size", [(2, None), (3, None), (2, 1)], ids=["R2", "R3", "R2-across-nodes"])
def test_two_batches_overlap(R, node_size):
    results = dist_util.run(R, _worker, _cases(R), node_size, R == 2 and node_size is None, timeout=600)
    fails = [f for r in results for f in r]
    assert not fails, "\n".join(fails[:40])


@pytest.mark.gpu
@pytest.mark.parametrize("node_size", [None, 1], ids=["node", "across-nodes"])
def test_two_batches_overlap_gpu(node_size):
    dist_util.need_gpu()
    if node_size is None:  # the node path: a rank per GPU (nccl), or two sharing one (CUDA IPC)
        results = dist_util.run(2, _worker, _cases(2), None, True, timeout=600, backend=dist_util.gpu_backend(2))
    else:  # every peer through the proxy; ranks may share a GPU (gloo)
        results = dist_util.run(2, _worker, _cases(2), 1, False, timeout=600, backend="gloo-cuda")
    fails = [f for r in results for f in r]
    assert not fails, "\n".join(fails[:40])
