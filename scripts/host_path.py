"""Host time of eager replayed calls on a CPU, no GPU needed: what moe_ep's own Python and its
native launch cost per call, the part of an eager decode call a faster host does not remove.

A decode-sized buffer (R=1, T=128, H=7168, K=8, E=256, fp8 dispatch, masked) on the CPU; its
launches go through real native plans (csrc/launch/launch.cc) into a stand-in CUDA driver whose
cuLaunchKernel only records its arguments (tests/stand_in_cuda.py), so a call costs what it costs
on a GPU host minus the driver's launch and torch's allocator. Prints the median host time of each
call (3 rounds of 3000 calls; T = 128, and T changing every call through 1..128; calls with a
receive hook, the hook included; DeepEP's low-latency pair through ``moe_ep.deep_ep``, its dispatch
also with T changing every call) and, for
scale, a launch alone and an allocation; then the same calls across nodes (2 rank processes, 2
nodes of 1, their proxies over TCP loopback; nothing runs, so nothing waits).

    TRITON_INTERPRET=1 python scripts/host_path.py
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
os.environ.setdefault("TRITON_INTERPRET", "1")

from stand_in_cuda import fake_cuda_lib  # noqa: E402

os.environ["MOE_EP_CUDA_LIB"] = fake_cuda_lib(tempfile.mkdtemp(prefix="moe_ep_host_path_"))

import torch  # noqa: E402

import moe_ep  # noqa: E402
from moe_ep.native.launch import LaunchPlan  # noqa: E402


class _Plan:
    """A plan whose bound launches are native plans of 8-byte parameters (the stand-in ignores them)."""

    def __init__(self, arg_names, nargs: int, dynamic):
        self.arg_names, self.nargs = tuple(arg_names), nargs
        self.dynamic = tuple(range(nargs) if dynamic is None else dynamic)
        self.bound: dict = {}

    def bind(self, args, positions):
        # kept by what it fixes, as NativePlan keeps its bound launches
        fixed = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a
                      for i, a in enumerate(args) if i in self.dynamic and i not in positions)
        key = (tuple(positions), fixed)
        if key not in self.bound:
            self.bound[key] = LaunchPlan(0x1, 32, 1024, 0, [8] * self.nargs, [0] * self.nargs, list(positions))
        return self.bound[key]


class _Launcher:
    """Stands in for the buffer's Launcher: a plan per key, as it keeps them; launches nothing itself."""

    def stream(self) -> int:
        return 0

    def __init__(self):
        self.plans: dict = {}

    def planned(self, key):
        return self.plans.get(key)

    def __call__(self, key, fn, grid, args, consts, dynamic=None):
        if key not in self.plans:
            self.plans[key] = _Plan(fn.arg_names, len(args), dynamic)
        return self.plans[key]


def _deep_ep_buffer():
    """A ``moe_ep.deep_ep.Buffer`` on a one-rank gloo group whose EPBuffers launch as on a GPU,
    into the stand-in driver (each made by the wrapper on first use, patched as it is made)."""
    import torch.distributed as dist

    import moe_ep.ops.buffer
    import moe_ep.deep_ep as deep_ep

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(prefix="moe_ep_host_path_"),
                                rank=0, world_size=1)
    made = moe_ep.ops.buffer.EPBuffer.__init__

    def init(self, *args, **kwargs):
        made(self, *args, **kwargs)
        self.parts.tuning, self.parts.interp, self.calls.launch = self.tuning.replace(fused=True), False, _Launcher()
    moe_ep.ops.buffer.EPBuffer.__init__ = init
    return deep_ep.Buffer(dist.group.WORLD, 0, 1 << 20, low_latency_mode=True, num_qps_per_rank=256)


def _decode_buffer(group, fused: bool) -> tuple:
    """A decode buffer (T=128, H=7168, E=256, K=8, fp8 dispatch, masked) whose launches go into the
    stand-in driver (``fused``: one launch per call, as on a GPU), with a dispatch, a combine and
    a dispatch + ``combine(out=)`` recorded (each combine after its own dispatch, as across nodes
    it must be): ``(buf, x, idx, w, y, out, last handle)``."""
    T, H = 128, 7168
    buf = moe_ep.EPBuffer(group, 256, H, T, 8, dispatch_dtype=torch.float8_e4m3fn, layout="masked")
    if fused:
        buf.parts.tuning = buf.tuning.replace(fused=True)
    buf.parts.interp, buf.calls.launch = False, _Launcher()
    x = torch.randn(T, H, dtype=torch.bfloat16)
    idx, w = torch.randint(0, 256, (T, 8)), torch.rand(T, 8)
    h = buf.dispatch(x, idx, w)  # recorded here, replayed by the caller
    y = torch.zeros(h.expert_x.shape, dtype=torch.bfloat16)
    out = torch.empty(T, H, dtype=torch.bfloat16)
    buf.combine(y, h)
    h = buf.dispatch(x, idx, w)
    buf.combine(y, h, out=out)
    return buf, x, idx, w, y, out, h


def _internode_rank(rank: int, init: str, out: str, calls: int) -> None:
    """One of 2 ranks on 2 nodes of 1 (gloo, TCP proxies over loopback): a decode buffer across
    nodes whose launches go into the stand-in driver (nothing runs, so no bell rings and nothing
    waits: moe_ep's own host time); rank 0 writes its medians to ``out``."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    buf, x, idx, w, y, o, _ = _decode_buffer(moe_ep.EPGroup(node_size=1), fused=False)

    def pair(with_out: bool):
        def one():
            hh = buf.dispatch(x, idx, w)
            buf.combine(y, hh, out=o) if with_out else buf.combine(y, hh)
        return one

    def hooked():
        got, hook = buf.dispatch(x, idx, w, return_recv_hook=True)
        hook()
        _, hook = buf.combine(y, got, out=o, return_recv_hook=True)
        hook()
    for _ in range(2):  # recorded by the second call (the first's hook made the receive half's plan)
        hooked()
    rows = [(_median_us(lambda: buf.dispatch(x, idx, w), calls), _median_us(pair(False), calls),
             _median_us(pair(True), calls), _median_us(hooked, calls)) for _ in range(3)]
    dist.barrier()
    buf.close()
    if rank == 0:
        with open(out, "w") as f:
            f.write(repr(rows))


def _internode_rows(calls: int) -> list:
    """``_internode_rank``'s medians (3 rounds): dispatch, dispatch + combine, dispatch + combine(out=),
    both with hooks."""
    import ast

    import torch.multiprocessing as mp

    tmp = tempfile.mkdtemp(prefix="moe_ep_host_path_")
    out = os.path.join(tmp, "internode")
    mp.spawn(_internode_rank, args=("file://" + os.path.join(tmp, "init"), out, calls), nprocs=2)
    with open(out) as f:
        return ast.literal_eval(f.read())


def _median_us(fn, n: int) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t)
    return statistics.median(ts) / 1e3


def main(calls: int = 3000) -> None:
    # As on a GPU: one fused launch per call, no interpreter, the launches native.
    buf, x, idx, w, y, out, h = _decode_buffer(moe_ep.EPGroup(), fused=True)
    T, H = x.shape
    buf.combine(y, h, topk_weights=w, out=out)  # DeepEP's low-latency combine: the weights at combine
    # An eager decode whose batch changes every call: T cycles through 1..128.
    per_T = [(torch.randn(t, H, dtype=torch.bfloat16), torch.randint(0, 256, (t, 8)), torch.rand(t, 8))
             for t in range(1, T + 1)]
    outs = [torch.empty(t, H, dtype=torch.bfloat16) for t in range(1, T + 1)]

    def cycle(with_combine: bool):
        def one():
            inp = per_T[cycle.i % T]
            hh = buf.dispatch(*inp)
            if with_combine:
                buf.combine(y, hh, out=outs[cycle.i % T])
            cycle.i += 1
        return one
    cycle.i = 0

    def hooked_dispatch():  # the send half now, the receive half in the hook (as DeepEP's low-latency API)
        got, hook = buf.dispatch(x, idx, w, return_recv_hook=True)
        hook()
        hooked_dispatch.h = got

    def hooked_combine():  # DeepEP's low-latency combine with a hook: weights at combine, its out
        _, hook = buf.combine(y, hooked_dispatch.h, topk_weights=w, out=out, return_recv_hook=True)
        hook()
    for _ in range(2):  # recorded by the second call (the first's hook made the receive half's plan)
        hooked_dispatch()
        hooked_combine()
    # The rows layout (DeepEP's normal-mode combine): weights per received row, their sums returned.
    rbuf = moe_ep.EPBuffer(moe_ep.EPGroup(), 256, H, T, 8, dispatch_dtype=torch.float8_e4m3fn, layout="rows",
                          max_recv_rows="worst")  # (no host read per call, as DeepEP's normal mode with num_worst_tokens)
    rbuf.parts.tuning, rbuf.parts.interp, rbuf.calls.launch = rbuf.tuning.replace(fused=True), False, _Launcher()
    rh = rbuf.dispatch(x, idx, w)
    ry, rw, out32 = torch.zeros(rh.expert_x.shape, dtype=torch.bfloat16), torch.rand(rh.expert_x.shape[0], 8), out.float()
    rbuf.combine(ry, rh, topk_weights=rw, out=out32)
    # DeepEP's low-latency pair through moe_ep.deep_ep (fp8, receive hooks): the same buffers
    # (their launches into the stand-in too) plus the wrapper's own Python.
    ll = _deep_ep_buffer()
    ll_state = {}

    def ll_dispatch():
        recv_x, _, handle, _, hook = ll.low_latency_dispatch(x, idx, T, 256, use_fp8=True, return_recv_hook=True)
        hook()
        ll_state["h"] = handle

    def ll_combine():
        _, _, hook = ll.low_latency_combine(ll_state["y"], idx, w, ll_state["h"], return_recv_hook=True, out=out)
        hook()
    ll_varying = [(x[:t], idx[:t]) for t in range(T - 31, T + 1)]  # a batch that changes every call

    def ll_dispatch_varying():
        xv, iv = ll_varying[ll_state.setdefault("i", 0) % len(ll_varying)]
        ll_state["i"] += 1
        ll.low_latency_dispatch(xv, iv, T, 256, use_fp8=True, return_recv_hook=True)[4]()
    ll_dispatch()
    ll_state["y"] = torch.zeros(ll_state["h"].result.expert_x.shape, dtype=torch.bfloat16)
    for _ in range(3):  # both buffers of the pair record (the third call of each replays)
        ll_dispatch()
        ll_combine()
    bound = LaunchPlan(0x1, 32, 1024, 0, [8] * 4, [0] * 4, [0, 1, 2, 3])
    ptrs = (x.data_ptr(), idx.data_ptr(), w.data_ptr(), out.data_ptr())
    rows = []
    for _ in range(3):
        d = _median_us(lambda: buf.dispatch(x, idx, w), calls)
        h = buf.dispatch(x, idx, w)
        rows.append((d, _median_us(lambda: buf.combine(y, h), calls), _median_us(lambda: buf.combine(y, h, out=out), calls),
                     _median_us(lambda: buf.combine(y, h, topk_weights=w, out=out), calls),
                     _median_us(cycle(False), calls), _median_us(cycle(True), calls),
                     _median_us(hooked_dispatch, calls), _median_us(hooked_combine, calls),
                     _median_us(lambda: rbuf.combine(ry, rh, topk_weights=rw, out=out32), calls),
                     _median_us(ll_dispatch, calls), _median_us(ll_combine, calls), _median_us(ll_dispatch_varying, calls),
                     _median_us(lambda: bound.launch(0, ptrs), calls), _median_us(lambda: torch.empty_like(out), calls),
                     _median_us(lambda: None, calls)))
    names = ("dispatch", "combine", "combine(out=)", "combine(topk_weights=, out=)", "dispatch, T = 1..128",
             "+ combine(out=), T = 1..128", "dispatch with a hook, + hook()", "combine(w=, out=, hook), + hook()",
             "rows: combine(w=, out=f32)", "deep_ep: low_latency_dispatch + hook",
             "deep_ep: low_latency_combine + hook", "deep_ep: the dispatch, T = 97..128",
             "one native launch", "empty_like [T, H]", "timer alone")
    print(f"host time per call, us (median of {calls}; 3 rounds; the timer's own cost included in each):")
    for i, name in enumerate(names):
        print(f"  {name:36s} " + "  ".join(f"{r[i]:6.2f}" for r in rows))
    across = _internode_rows(calls)
    print("across nodes (2 nodes of 1; two launches a call), us per call:")
    for i, name in enumerate(("dispatch", "dispatch + combine", "dispatch + combine(out=)",
                              "both with a hook, + hooks")):
        print(f"  {name:36s} " + "  ".join(f"{r[i]:6.2f}" for r in across))


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="moe_ep's host time per eager call, on a CPU")
    ap.add_argument("--calls", type=int, default=3000, help="calls per median (3 rounds each)")
    main(ap.parse_args().calls)
