"""Where the time of one dispatch / combine goes, on a GPU: host and device, per kernel.

    torchrun --nproc-per-node=1 -m moe_ep.bench.profile_ops --preset decode
    torchrun --nproc-per-node=2 -m moe_ep.bench.profile_ops --preset prefill --num-programs 32
    torchrun --nproc-per-node=4 -m moe_ep.bench.profile_ops   # 4 ranks on 1 GPU: gloo, CUDA IPC
    MOE_EP_NODE_SIZE=1 torchrun --nproc-per-node=2 -m moe_ep.bench.profile_ops   # 2 nodes of 1: the proxy (TCP)
    MOE_EP_NODE_SIZE=1 torchrun --nproc-per-node=2 -m moe_ep.bench.profile_ops --fused-internode   # one launch an op
    MOE_EP_NODE_SIZE=1 torchrun --nproc-per-node=2 -m moe_ep.bench.profile_ops --graph-launch off   # two launches, not one graph

Prints, for rank 0: the host time to issue a call (Python and launch, no device sync; the median
over many calls of dispatch, of combine returning a new tensor and of combine with ``out=``; of
dispatch and ``combine(out=)`` when the token count changes every call; of a dispatch and a
``combine(topk_weights=, out=)`` with receive hooks, each with its hook), the
top host functions of those calls (cProfile), the launch cost of an empty Triton kernel through
``moe_ep.kernels.launch`` and through ``kernel[grid]``, the device time of each kernel
(torch.profiler, mean over calls), and across nodes where the proxy's time goes in synchronized
pairs (its phase records). ``MOE_EP_LAUNCH=triton`` times Triton's launcher instead of the
native one. Not a benchmark of record: ``moe_ep.bench.intranode`` is.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from ..core import settings
from .intranode import PRESETS


@triton.jit
def _empty_kernel(p, n):
    pass


def _host_us(fn, n: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(n):
        fn()
        if i % 50 == 49:
            torch.cuda.synchronize()  # keep the queue short: measure issue cost, not back-pressure
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e6 / n


def _issue_us(fns, n: int) -> list[list[float]]:
    """Host times (us) of each of ``fns``, called in turn ``n`` times (no sync in between but every
    50 rounds, outside the timings, to keep the queue short)."""
    times: list[list[float]] = [[] for _ in fns]
    clock = time.perf_counter_ns
    torch.cuda.synchronize()
    for i in range(n):
        for f, ts in zip(fns, times):
            t = clock()
            f()
            ts.append((clock() - t) / 1e3)
        if i % 50 == 49:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return times


def _graph_replay_line(disp, comb_out, calls: int) -> str:
    """The host time of replaying a CUDA graph of one dispatch and ``combine(out=)`` (the same
    launches an eager pair makes, in one ``cudaGraphLaunch``): what issuing a call's launches as
    one graph would cost against launching them one by one."""
    try:
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            disp()
            comb_out()
        g.replay()
        torch.cuda.synchronize()
        kernels = "?"
        try:  # (the graph's kernel nodes, where this torch can say)
            kernels = str(sum(1 for n in g.raw_cuda_graph_nodes() if "kernel" in str(n).lower()))
        except Exception:  # noqa: BLE001
            pass
        return (f"a CUDA graph of dispatch + combine(out=) ({kernels} kernel nodes): replay, host "
                f"{_host_us(g.replay, calls):.1f} us")
    except Exception as exc:  # noqa: BLE001 - a diagnostic line, not a failure of the profile
        return f"a CUDA graph of dispatch + combine(out=): not measured ({type(exc).__name__}: {exc})"


def _proxy_phases(proxy, pair, n: int = 50) -> list[str]:
    """Across nodes: ``n`` synchronized dispatch + combine pairs, their wall time, and where the
    proxy's time went in them (its phase records, steady-clock ns; median over the pairs): from
    the bell it saw to round 1 counted (dispatch) and to its ready words, its own CPU, and the
    gap from one phase's ready to the next phase's bell (the GPU's side: the receive half, the
    next op's send half and the bell's way to the host)."""
    walls = []
    for _ in range(n):
        t = time.perf_counter()
        pair()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t) * 1e6)
    recs = proxy.phase_records()[-2 * n:]
    med = statistics.median
    out = [f"proxy phases over {n} synchronized pairs (wall per pair p50 {med(walls):.1f} us, "
           f"min {min(walls):.1f}); median us, bell seen -> round 1 in (dispatch) -> ready, proxy CPU, "
           f"ready -> next phase's bell seen:"]
    for kind in ("dispatch", "combine"):
        mine = [(i, r) for i, r in enumerate(recs) if r[0] == kind]
        if not mine:
            continue
        gaps = [(recs[i + 1][2] - r[4]) / 1e3 for i, r in mine if i + 1 < len(recs)]
        out.append(f"    {kind:8s} round 1 {med([(r[3] - r[2]) / 1e3 for _, r in mine]):9.1f}  "
                   f"ready {med([(r[4] - r[2]) / 1e3 for _, r in mine]):9.1f}  "
                   f"cpu {med([r[5] / 1e3 for _, r in mine]):7.1f}  "
                   f"then {med(gaps) if gaps else float('nan'):9.1f}")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m moe_ep.bench.profile_ops", description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=["decode", "prefill"], default="decode")
    p.add_argument("--dispatch-dtype", choices=["fp8", "bf16"], default="fp8")
    p.add_argument("--layout", choices=["masked", "packed"], default=None)
    p.add_argument("--num-programs", type=int, default=None)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--fused-internode", action="store_true",
                   help="across nodes, each op's two halves in one launch (Tuning.fused_internode)")
    p.add_argument("--graph-launch", choices=["auto", "on", "off"], default="auto",
                   help="replayed calls of several launches as one CUDA graph launch (Tuning.graph_launch: "
                        "auto, the default, is on across nodes)")
    args = p.parse_args(argv)
    import moe_ep
    from moe_ep.ops.combine import new_output
    from moe_ep.core.group import init_distributed
    from moe_ep.kernels.launch import Launcher, NativePlan, launch, launch_path
    from moe_ep.native.launch import hot_library

    how = init_distributed()
    group = moe_ep.EPGroup()
    dev, rank, R = group.device, group.rank, group.world_size
    cfg = PRESETS[args.preset]
    T, H, K, E = cfg["num_tokens"], cfg["hidden"], cfg["topk"], cfg["num_experts"]
    layout = args.layout or ("masked" if args.preset == "decode" else "packed")
    g = torch.Generator(device="cpu").manual_seed(rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(dev)
    w = torch.rand(T, K, generator=g).to(dev)
    kw = dict(dispatch_dtype=torch.float8_e4m3fn if args.dispatch_dtype == "fp8" else torch.bfloat16, layout=layout)
    if args.num_programs:
        kw["num_programs"] = args.num_programs
    if layout != "masked":  # the kernels as before (sized per call, a dispatch adds a host sync)
        kw["max_recv_rows"] = "worst"
    if args.fused_internode or args.graph_launch != "auto":
        kw["tuning"] = moe_ep.Tuning.from_env().replace(
            fused_internode=args.fused_internode, graph_launch={"auto": None, "on": True, "off": False}[args.graph_launch])
    lines = []
    with moe_ep.EPBuffer(group, E, H, T, K, **kw) as buf:
        d = buf.dispatch(x, idx, w)
        y = torch.zeros(d.expert_x.shape, dtype=torch.bfloat16, device=dev)
        buf.combine(y, d)
        out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
        st = {}

        def disp():
            st["d"] = buf.dispatch(x, idx, w)

        def comb():
            buf.combine(y, st["d"])

        def comb_out():
            buf.combine(y, st["d"], out=out)

        def pair():
            disp()
            comb()

        for _ in range(20):
            pair()
            disp()
            comb_out()
        hd = _host_us(pair, args.calls)
        # every rank issues the same sequence: dispatch, combine, dispatch, combine(out=)
        t_d, t_c, t_d2, t_co = _issue_us([disp, comb, disp, comb_out], args.calls)
        med = statistics.median
        lines.append(f"host to issue (median, no sync): dispatch {med(t_d + t_d2):.1f} us, combine {med(t_c):.1f} us, "
                     f"combine(out=) {med(t_co):.1f} us   [launch path {launch_path()}]")
        # an eager loop whose batch changes every call: T cycles through 32 counts (T-31 .. T)
        batches = [(x[:t], idx[:t], w[:t], out[:t]) for t in range(max(1, T - 31), T + 1)]
        st["i"] = 0

        def disp_varying():
            st["i"] = (st["i"] + 1) % len(batches)
            st["d"] = buf.dispatch(*batches[st["i"]][:3])

        def comb_varying():
            buf.combine(y, st["d"], out=batches[st["i"]][3])

        for _ in range(2 * len(batches)):
            disp_varying()
            comb_varying()
        t_dv, t_cv = _issue_us([disp_varying, comb_varying], args.calls)
        lines.append(f"host to issue, T changing every call ({len(batches)} counts): dispatch {med(t_dv):.1f} us, "
                     f"combine(out=) {med(t_cv):.1f} us")

        # calls with a receive hook, as DeepEP's low-latency API makes them (weights at combine)
        def disp_hooked():
            st["d"], hook = buf.dispatch(x, idx, w, return_recv_hook=True)
            hook()

        # (across nodes weights come with the dispatch: combine-time weights reach node peers only)
        late = dict(topk_weights=w) if buf.remote is None else {}

        def comb_hooked():
            _, hook = buf.combine(y, st["d"], out=out, return_recv_hook=True, **late)
            hook()

        for _ in range(20):
            disp_hooked()
            comb_hooked()
        t_dh, t_ch = _issue_us([disp_hooked, comb_hooked], args.calls)
        lines.append(f"host to issue with a receive hook (the call and its hook): dispatch {med(t_dh):.1f} us, "
                     f"combine({'topk_weights=, ' if late else ''}out=) {med(t_ch):.1f} us")
        # where the host time of the pairs goes
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.calls):
            pair()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
        lines.append(f"host per dispatch+combine pair (no sync): {hd:.1f} us   "
                     f"[programs={buf.num_programs} fused={buf.tuning.fused} "
                     f"fused_internode={buf.tuning.fused_internode} warps={buf.tuning.num_warps}]")
        lines.append("cProfile, by own time (" + str(args.calls) + " pairs):")
        lines += ["    " + ln for ln in s.getvalue().splitlines()[6:26] if ln.strip()]
        a = torch.zeros(16, device=dev)
        launch(_empty_kernel, 1, (a, 3), {})  # compile first
        e1 = _host_us(lambda: launch(_empty_kernel, 1, (a, 3), {}), 1000)
        e2 = _host_us(lambda: _empty_kernel[(1,)](a, 3), 1000)
        lines.append(f"empty kernel launch, host: moe_ep launch() {e1:.1f} us, kernel[grid] {e2:.1f} us")
        # what one launch costs below Python: a bound plan (one call of the library's launch
        # function: cuLaunchKernel), a ctypes call that does nothing, and a tiny torch op for comparison
        la = Launcher(dev)
        plan = la(("empty",), _empty_kernel, 1, (a, 3), {}, (0,))
        if isinstance(plan, NativePlan):
            b, s, p0 = plan.bind((a, 3), [0]), la.stream(), a.data_ptr()
            e3 = _host_us(lambda: b.launch(s, (p0,)), 1000)
            nop = hot_library().moe_ep_abi_version
            e4 = _host_us(nop, 1000)
            e5 = _host_us(lambda: a.add_(1), 1000)
            lines.append(f"one native launch (bound plan) {e3:.1f} us; a no-op ctypes call {e4:.2f} us; "
                         f"torch a.add_(1) {e5:.1f} us")
        # what a combine's new output tensor costs, three ways of asking the caching allocator
        a1 = _host_us(lambda: torch.empty(T, H, dtype=torch.bfloat16, device=dev), 1000)
        a2 = _host_us(lambda: out.new_empty((T, H)), 1000)
        a3 = _host_us(lambda: torch.empty_like(out), 1000)
        a4 = _host_us(lambda: new_output(buf.parts, T), 1000)
        lines.append(f"a [T, H] bf16 output: torch.empty {a1:.2f} us, new_empty {a2:.2f} us, empty_like {a3:.2f} us, "
                     f"moe_ep.ops.combine.new_output {a4:.2f} us")
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(50):
                pair()
            torch.cuda.synchronize()
        lines.append("device time per call (torch.profiler, mean of 50; #i = i-th launch of that kernel in a call):")
        per: dict = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA and "kernel" in ev.name:
                per.setdefault(ev.name, []).append(ev.device_time)
        for name, ts in sorted(per.items(), key=lambda kv: -sum(kv[1])):
            n = max(1, len(ts) // 50)  # launches of this kernel per dispatch+combine pair
            for i in range(n):
                mine = ts[i::n]
                lines.append(f"    {name[:50]:50s} #{i} {sum(mine) / len(mine):9.1f} us  x{len(mine)}")
        lines.append(_graph_replay_line(disp, comb_out, calls=args.calls))
        if buf.remote is not None:
            lines += _proxy_phases(buf.remote.proxy, pair)
    dist.barrier()
    if rank == 0:
        nodes = f" nodes of {group.node_size}" if group.node_size < R else ""
        print(f"== profile_ops {args.preset} R={R}{nodes} T={T} H={H} K={K} E={E} {args.dispatch_dtype} {layout} "
              f"[{torch.cuda.get_device_name(dev)}; {how}; MOE_EP_LAUNCH={settings.value('MOE_EP_LAUNCH')}]")
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
