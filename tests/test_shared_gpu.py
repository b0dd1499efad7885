"""Several ranks on one GPU: the CUDA-IPC node memory backend (selection, closing in any order, a rank
that exits first, no leak, the device-memory check) and a long random soak against the oracle.

The ranks form a gloo group with ``MOE_EP_DEVICE=cuda`` (tests/dist_util.py's ``gloo-cuda`` pool),
so rank r runs on ``cuda:<r % GPUs>``: on a one-GPU machine they all share it (time-sliced; these
are correctness tests, not NVLink timings). Where ranks have their own GPUs the IPC tests force
``MOE_EP_NODE_MEMORY=ipc``. Marked ``gpu``: skipped without CUDA.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

import dist_util

pytestmark = pytest.mark.gpu


def _ipc_env(world_size: int):
    """Forces IPC where every rank would have its own GPU (selection picks it anyway when they share)."""
    if torch.cuda.device_count() >= world_size:
        os.environ["MOE_EP_NODE_MEMORY"] = "ipc"


def _big_buffer(group):
    """A buffer whose workspace is large enough (~115 MiB at R=2) for a leak to show in mem_get_info."""
    import moe_ep

    return moe_ep.EPBuffer(group, 2 * group.world_size, 7168, 1024, 2, timeout_s=30.0)


def _free_bytes(group) -> int:
    group.barrier()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    group.barrier()
    return torch.cuda.mem_get_info()[0]


def _close_order_worker(rank, world_size):
    """Two buffers, closed A then B on rank 0 and (later) B then A on the others, three times:
    rank 0's memory waits until its peers unmap it, nothing is leaked afterwards."""
    import moe_ep
    from moe_ep.core.node_memory import release_deferred

    _ipc_env(world_size)
    group = moe_ep.EPGroup()
    log = {"backend": None, "pending_after_own_close": [], "pending_after_all": [], "free": []}
    _big_buffer(group).close()  # warm-up: contexts, kernels, torch's caches
    group.barrier()  # every rank has closed it: each rank's own memory can go now
    log["pending_after_warmup"] = release_deferred()
    base = _free_bytes(group)
    for cycle in range(3):
        a, b = _big_buffer(group), _big_buffer(group)
        log["backend"] = (a.workspace.backend, b.workspace.backend)
        if rank == 0:
            a.close()
            b.close()
            log["pending_after_own_close"].append(release_deferred())  # peers still map both
            group.barrier()
        else:
            time.sleep(0.5)
            b.close()
            a.close()
            group.barrier()
        group.barrier()
        log["pending_after_all"].append(release_deferred())
        del a, b  # their expert layouts go back to torch's cache (emptied by _free_bytes)
        log["free"].append(base - _free_bytes(group))
    return log


def test_ipc_close_in_any_order_no_leak():
    dist_util.need_gpu()
    R = 2
    logs = dist_util.run(R, _close_order_worker, timeout=600, backend="gloo-cuda")
    for r, log in enumerate(logs):
        assert log["backend"] == ("ipc", "ipc"), (r, log)
        assert log["pending_after_warmup"] == 0 and log["pending_after_all"] == [0, 0, 0], (r, log)
        assert all(abs(d) < 32 << 20 for d in log["free"]), f"rank {r}: device memory not returned: {log['free']}"
    assert logs[0]["pending_after_own_close"] == [2, 2, 2], logs[0]


def _exit_first_worker(rank, world_size, victim):
    """A round trip, then the victim kills itself while holding the buffer; the survivor closes
    (unmapping the dead rank's memory), frees its own, and the GPU still works for it."""
    import signal

    import moe_ep
    from moe_ep.core.node_memory import release_deferred

    _ipc_env(world_size)
    group = moe_ep.EPGroup()
    pids = group.all_gather_object(os.getpid())
    buf = moe_ep.EPBuffer(group, 2 * world_size, 256, 8, 2, timeout_s=10.0)
    dev = group.device
    x = torch.ones(8, 256, dtype=torch.bfloat16, device=dev)
    idx = torch.tensor([[0, 2 * world_size - 1]] * 8, device=dev)
    h = buf.dispatch(x, idx, torch.ones(8, 2, device=dev))
    out = buf.combine(h.expert_x, h)
    buf.synchronize()
    ok = bool((out.float() == 2.0).all())
    backend = buf.workspace.backend
    group.barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pids[victim]}") and time.monotonic() < deadline:
        with open(f"/proc/{pids[victim]}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.05)
    buf.close()
    pending = release_deferred()
    y = torch.arange(1000, device=dev, dtype=torch.float32).sum().item()  # the context is healthy
    return {"round_trip": ok, "backend": backend, "pending": pending, "sum": y}


def test_ipc_rank_exits_first():
    dist_util.need_gpu()
    got = dist_util.run_with_victim(2, 1, _exit_first_worker, 1, timeout=180, backend="gloo-cuda")
    res = got[0]
    assert res["backend"] == "ipc" and res["round_trip"] and res["pending"] == 0 and res["sum"] == 499500.0, res


def _memory_check_worker(rank, world_size):
    """More than the shared GPU holds: MemoryError on every rank, naming the sizes, before anything
    is allocated (and nothing hangs)."""
    import moe_ep
    from moe_ep.core.node_memory import check_device_memory

    group = moe_ep.EPGroup()
    out = {"shares": group.ranks_per_device}
    free = torch.cuda.mem_get_info()[0]
    try:
        check_device_memory(group, int(0.7 * free))
        out["check"] = "no error"
    except MemoryError as exc:
        out["check"] = str(exc)
    before = _free_bytes(group)
    try:  # E=2R, H=7168, max_tokens 2^20: ~60 GiB of workspace + ~30 GiB of expert rows per rank
        moe_ep.EPBuffer(group, 2 * world_size, 7168, 1 << 20, 2)
        out["buffer"] = "no error"
    except MemoryError as exc:
        out["buffer"] = str(exc)
    out["leaked"] = before - _free_bytes(group)
    return out


def test_device_memory_check():
    n = dist_util.need_gpu()
    R = 2
    if n >= R:
        pytest.skip("needs ranks that share a GPU (fewer GPUs than 2)")
    for r, res in enumerate(dist_util.run(R, _memory_check_worker, timeout=300, backend="gloo-cuda")):
        assert res["shares"] == 2, res
        for key in ("check", "buffer"):
            msg = res[key]
            assert "ranks [0, 1] share one GPU" in msg and "GiB free" in msg and "need" in msg, (r, key, msg)
        assert abs(res["leaked"]) < 32 << 20, res


def _forced_worker(rank, world_size, value):
    import moe_ep

    old = os.environ.get("MOE_EP_NODE_MEMORY")
    os.environ["MOE_EP_NODE_MEMORY"] = value
    try:
        with moe_ep.EPBuffer(moe_ep.EPGroup(), 2 * world_size, 128, 4, 2) as buf:
            return buf.workspace.backend
    except ValueError as exc:
        return f"ValueError: {exc}"
    finally:
        if old is None:
            os.environ.pop("MOE_EP_NODE_MEMORY")
        else:
            os.environ["MOE_EP_NODE_MEMORY"] = old


def test_forced_node_memory():
    """MOE_EP_NODE_MEMORY: ipc is taken; symm is refused by name when ranks share a GPU; others by name."""
    n = dist_util.need_gpu()
    assert dist_util.run(2, _forced_worker, "ipc", backend="gloo-cuda") == ["ipc", "ipc"]
    for r, msg in enumerate(dist_util.run(2, _forced_worker, "shmem", backend="gloo-cuda")):
        assert msg.startswith("ValueError: MOE_EP_NODE_MEMORY") and "shmem" in msg, (r, msg)
    if n < 2:
        for r, msg in enumerate(dist_util.run(2, _forced_worker, "symm", backend="gloo-cuda")):
            assert msg.startswith("ValueError: MOE_EP_NODE_MEMORY=symm") and "share a GPU" in msg, (r, msg)


# ---------------------------------------------------------------------------- soak
SOAK_PAIRS = int(os.environ.get("MOE_EP_SOAK_PAIRS", "10000"))


def _soak_worker(rank, world_size, pairs, seed):
    """``pairs`` dispatch+combine pairs on four buffers (bf16/fp8 x masked/packed, taken in turn),
    random T in [0, max_tokens], random experts with -1 holes and tokens with none, each combined
    output compared with ``moe_ep.testing.reference.moe_local`` (bf16 tolerance). Returns the counts."""
    import moe_ep
    from ep_cases import Case, float_expert
    from moe_ep.testing.reference import moe_local
    from test_dispatch_combine import _expert_all_rows

    group = moe_ep.EPGroup()
    dev = group.device
    R, E, H, M, K = world_size, 4 * world_size, 256, 32, 4
    first = rank * (E // R)
    configs = [(dt, lay) for dt in ("bf16", "fp8") for lay in ("masked", "packed")]
    cases = [Case(R=R, E=E, K=K, dtype=dt, layout=lay, align=8 if lay == "packed" else 1, H=H, M=M, data="random")
             for dt, lay in configs]
    bufs = [moe_ep.EPBuffer(group, E, H, M, K, dispatch_dtype=torch.float8_e4m3fn if c.dtype == "fp8" else torch.bfloat16,
                            layout=c.layout, expert_alignment=c.align, timeout_s=60.0) for c in cases]
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    bad_pairs, bad_tokens, worst, tokens = 0, 0, 0.0, 0
    first_bad = None
    try:
        for i in range(pairs):
            c, buf = cases[i % 4], bufs[i % 4]
            T = int(torch.randint(0, M + 1, (1,), generator=g))
            x = (torch.randn(T, H, generator=g) * torch.exp(torch.randn(T, 1, generator=g))).to(torch.bfloat16)
            idx = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
            idx[torch.rand(T, K, generator=g) < 0.2] = -1
            idx[torch.rand(T, generator=g) < 0.1] = -1
            w = torch.rand(T, K, generator=g)
            h = buf.dispatch(x.to(dev), idx.to(dev), w.to(dev))
            vals = h.expert_x.float()
            if h.expert_scales is not None:
                vals = vals * h.expert_scales.repeat_interleave(128, dim=-1)[..., :H]
            out = buf.combine(_expert_all_rows(float_expert, vals, h, c, first), h).float().cpu()
            dt = torch.float8_e4m3fn if c.dtype == "fp8" else torch.bfloat16
            ref = moe_local(E, x, idx, w, float_expert, dispatch_dtype=dt)
            ref_abs = moe_local(E, x, idx, w, lambda e, r: float_expert(e, r).abs(), dispatch_dtype=dt)
            err = (out - ref).abs()
            bad = ~(err <= 2e-2 * ref_abs + 1e-30)
            tokens += T
            if T:
                worst = max(worst, float((err / (ref_abs + 1e-30)).max()))
            if bool(bad.any()):
                bad_pairs += 1
                bad_tokens += int(bad.any(dim=1).sum())
                first_bad = first_bad or f"pair {i} ({c.dtype} {c.layout}, T={T})"
        for b in bufs:
            b.synchronize()
    finally:
        for b in bufs:
            b.close()
    return {"pairs": pairs, "tokens": tokens, "bad_pairs": bad_pairs, "bad_tokens": bad_tokens,
            "worst_rel_err": worst, "first_bad": first_bad}


def test_soak_r2():
    """10,000 random dispatch+combine pairs at R=2 (MOE_EP_SOAK_PAIRS to change), none may differ."""
    dist_util.need_gpu()
    t0 = time.monotonic()
    results = dist_util.run(2, _soak_worker, SOAK_PAIRS, 7, timeout=1800, backend=dist_util.gpu_backend(2))
    took = time.monotonic() - t0
    summary = {k: [r[k] for r in results] for k in results[0]}
    print(f"soak R=2: {SOAK_PAIRS} pairs per rank in {took:.0f} s: {summary}")
    assert all(r["bad_pairs"] == 0 for r in results), summary
    assert all(r["tokens"] > SOAK_PAIRS for r in results), summary
