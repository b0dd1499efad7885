"""Runs one backend variant on one sweep point: pre-check against the oracle, warm-up, timing.

Every rank runs the same steps; after each step the ranks agree on its outcome (an error on any
rank stops that entry on all ranks, so the sweep goes on with the next one). Timing follows
moe_ep/bench/intranode.py: CUDA events on GPU (wall clock on CPU), dispatch and combine timed alone
(alternating, so each combine follows its dispatch) and the pair; p50/p90/p99 over iterations on
each rank, then the max over ranks.
"""
from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .backends import Backend, Context, NotAvailable, Runner
from .intranode import Timer, max_over_ranks, percentile, sync
from .workloads import CHECK_TOL, CHECK_TOL_OWN_FP8, Inputs, Workload, rel_err

OPS = ("dispatch", "combine", "pair")
QUANTILES = (50, 90, 99)


@dataclass
class Options:
    iters: int
    warmup: int
    graph: bool


class EntryError(Exception):
    """An entry stops: ``status`` is "not available" or "failed"; the message is the reason."""

    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


def agree(step: Callable[[], object], what: str) -> list:
    """Runs ``step`` on every rank and returns every rank's value (indexed by rank; numbers only,
    else None); if it raised anywhere, raises the same EntryError on every rank.

    Failures that stop every rank at the same step (a shape a backend refuses, a missing library)
    are the common case. A rank that fails inside a collective that the others go on with (the
    backend's own, or the timing barriers) leaves them waiting there until that collective's own
    deadline (moe_ep's ``--timeout-s``, the process group's 10 minutes); so the pre-check reads
    its error locally and reduces it here, outside any step."""
    outcome: Optional[tuple[str, str]] = None
    value = None
    try:
        value = step()
    except NotAvailable as e:
        outcome = ("not available", str(e))
    except EntryError as e:
        outcome = (e.status, e.reason)
    except Exception as e:  # noqa: BLE001 - any error of a backend ends its entry, not the sweep
        last = traceback.extract_tb(e.__traceback__)[-1]
        outcome = ("failed", f"{what}: {type(e).__name__}: {e} ({last.filename.split('/')[-1]}:{last.lineno})")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (outcome, value if outcome is None and _small(value) else None))
    for rank, (o, _) in enumerate(gathered):
        if o is not None:
            reason = o[1] if o[0] == "not available" else f"rank {rank}: {o[1]}"
            raise EntryError(o[0], reason)
    return [v for _, v in gathered]


def _small(value: object) -> bool:
    """Plain numbers travel to every rank; anything else (runners, time lists) stays local."""
    return isinstance(value, (int, float))


def op_stats(times_us: list[float], nbytes: tuple[float, float], device: torch.device,
             bandwidth: bool = True) -> dict:
    """p50/p90/p99 (max over ranks) and GB/s at the p50, both conventions; ``bandwidth=False``
    (ranks that share GPUs: no row crosses NVLink) leaves the GB/s empty."""
    q = max_over_ranks([percentile(times_us, p) for p in QUANTILES], device)
    row = {f"p{p}_us": v for p, v in zip(QUANTILES, q)}
    p50_s = q[0] * 1e-6
    ok = bandwidth and p50_s > 0
    row["gbps_all"] = nbytes[0] / p50_s / 1e9 if ok else None
    row["gbps_xgpu"] = nbytes[1] / p50_s / 1e9 if ok else None
    return row


def _op_bytes(traffic: dict) -> dict[str, tuple[float, float]]:
    d = (traffic["dispatch_bytes"], traffic["dispatch_bytes_xgpu"])
    c = (traffic["combine_bytes"], traffic["combine_bytes_xgpu"])
    return {"dispatch": d, "combine": c, "pair": (d[0] + c[0], d[1] + c[1])}


def _local_error(runner: Runner, inputs: Inputs, device: torch.device) -> float:
    """This rank's max rel. error of the latest combine vs the oracle (after the device is done)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return rel_err(runner.output(), inputs.ref)


def _checked(errors: list[float], tol: float = CHECK_TOL) -> float:
    err = max(errors)
    if not err <= tol:  # NaN fails too
        raise EntryError("failed", f"pre-check: max rel. error vs the oracle {err:.3g} > {tol:g}")
    return err


def _time(timer: Timer, d: Callable, c: Callable, p: Callable, iters: int, device) -> dict[str, list[float]]:
    sync(device)
    t_d, t_c = timer.run([d, c], iters)
    sync(device)
    (t_p,) = timer.run([p], iters)
    sync(device)
    return {"dispatch": t_d, "combine": t_c, "pair": t_p}


def _entries(backend: Backend, variant: str, wl: Workload, ctx: Context, opts: Options,
             traffic: Optional[dict]) -> dict[str, dict]:
    launches = ["eager"] + (["graph"] if opts.graph and backend.graphable else [])
    base = dict(backend=backend.name, variant=variant or None, num_tokens=wl.num_tokens,
                num_sms_requested=ctx.num_sms, world_size=ctx.world_size, sms=None, check_rel_err=None,
                ops=None, traffic=traffic)
    return {launch: dict(base, launch=launch, status="ok", reason=None) for launch in launches}


def not_available(backend: Backend, variant: str, wl: Workload, ctx: Context, opts: Options,
                  reason: str) -> list[dict]:
    """The entries of a backend that cannot run here at all."""
    entries = _entries(backend, variant, wl, ctx, opts, None)
    for e in entries.values():
        e.update(status="not available", reason=reason)
    return list(entries.values())


def run_variant(backend: Backend, variant: str, wl: Workload, inputs: Inputs, ctx: Context,
                opts: Options, stream) -> list[dict]:
    """The entries (eager, and graph where the backend allows it) of one backend variant on one point."""
    entries = _entries(backend, variant, wl, ctx, opts, inputs.traffic)
    launches = list(entries)

    def stop(launch_list: list[str], e: EntryError) -> None:
        for launch in launch_list:
            entries[launch].update(status=e.status, reason=e.reason)

    device = ctx.device
    timer = Timer(device, stream)
    nbytes = _op_bytes(inputs.traffic)
    runner: Optional[Runner] = None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        try:
            opened: list[Runner] = []
            agree(lambda: opened.append(backend.open(variant, wl, inputs)), "open")
            runner = opened[0]
            for e in entries.values():
                e["sms"] = runner.sms

            def pair():
                runner.dispatch()
                runner.combine()

            def precheck():
                runner.dispatch()
                runner.make_expert_output()
                runner.combine()
                return _local_error(runner, inputs, device)

            own_fp8 = wl.fp8 and getattr(runner, "own_fp8", False)
            err = _checked(agree(precheck, "pre-check"), CHECK_TOL_OWN_FP8 if own_fp8 else CHECK_TOL)
            for e in entries.values():
                e["check_rel_err"] = err

            def eager():
                for _ in range(opts.warmup):
                    pair()
                return _time(timer, runner.dispatch, runner.combine, pair, opts.iters, device)

            timed: list[dict] = []
            agree(lambda: timed.append(eager()), "eager timing")
            times = timed[0]
            entries["eager"]["ops"] = {op: op_stats(times[op], nbytes[op], device, not ctx.shared_gpus) for op in OPS}
        except EntryError as e:
            stop(launches, e)
            launches = []
        if "graph" in launches:
            try:
                entries["graph"].update(_graph_entry(runner, inputs, opts, timer, nbytes, device, stream,
                                                     not ctx.shared_gpus))
            except EntryError as e:
                stop(["graph"], e)
        if runner is not None:
            with contextlib.suppress(Exception):
                runner.close()
    return list(entries.values())


def _graph_entry(runner: Runner, inputs: Inputs, opts: Options, timer: Timer, nbytes, device, stream,
                 bandwidth: bool) -> dict:
    """Dispatch, combine and the pair captured as three CUDA graphs, replayed and timed."""
    if device.type != "cuda":
        raise EntryError("not available", "CUDA graphs need a GPU")
    if not runner.graphable:
        raise EntryError("not available", "this backend's calls cannot be captured into CUDA graphs")
    graphs: list = []

    def capture():
        sync(device)
        for fn in (runner.dispatch, runner.combine, lambda: (runner.dispatch(), runner.combine())):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local"):
                fn()
            graphs.append(g)
        sync(device)

    agree(capture, "graph capture")
    g_d, g_c, g_p = graphs

    timed: list[dict] = []

    def run():
        for _ in range(opts.warmup):
            g_d.replay()
            g_c.replay()
            g_p.replay()
        timed.append(_time(timer, g_d.replay, g_c.replay, g_p.replay, opts.iters, device))
        return _local_error(runner, inputs, device)

    err = _checked(agree(run, "graph timing"))
    return {"check_rel_err": err, "ops": {op: op_stats(timed[0][op], nbytes[op], device, bandwidth) for op in OPS}}
