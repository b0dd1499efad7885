"""Whether programs spinning on a word in pinned host memory slow the GPU's other traffic to host memory.

    python -m moe_ep.bench.host_poll
    python -m moe_ep.bench.host_poll --pollers 0,1,66 --warps 1,16 --bytes 1835008 --iters 20
    python -m moe_ep.bench.host_poll --who "one thread,spaced" --space-ns 500

Across nodes a receive half's programs wait for the proxy's ready word, which lives in pinned host
memory: every program of the launch loads it in a loop (``moe_ep.internode.mailbox.wait_value``),
so each look is a read across PCIe (one per warp until this bench's first run; since then one
per program, ``mailbox.look_word``). Meanwhile the GPU moves rows to and from pinned host memory
(over TCP, the send halves write their rows there and the receive halves read the rows the
transport landed). Under MPS the send halves across nodes took milliseconds where the node path
took tens of microseconds (docs/performance-log/gpu.md, "Twenty-second pass"); this bench asks
whether the pollers are why.

Two streams of one process run at once (no time slicing between them): on one, P programs of W
warps load a pinned host word until the host sets it (``--who``: every warp loading it, as the
kernels' waits did; one thread of each program handing it to the others, as they do now; or two
candidates: program 0 alone, handing it on through device memory, or one thread with a pause
between looks); on the other, a copy of BYTES between device memory and pinned host memory,
timed with CUDA events, in both directions (device to host: a send half's rows; host to device:
a receive half reading landed rows). Prints the copy's GB/s for each (P, W, how) and the
pollers' reads of host memory per microsecond. One GPU; the numbers are this GPU's PCIe.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

import torch
import triton
import triton.language as tl

from ..internode.mailbox import look_word
from .args import int_list

PROG = "python -m moe_ep.bench.host_poll"
POLL_TIMEOUT_NS = 20_000_000_000  # a poller gives up after 20 s (a host that never sets the word)
# How the pollers look: every warp of each program (the waits before mailbox.look_word), one
# thread of each program (the waits now), program 0 alone handing the word on through device
# memory, one thread of each program with a pause between looks (the last two: candidates).
WHO = ("every warp", "one thread", "one program", "spaced")


@triton.jit
def _poll_kernel(flag_ptr, looks_ptr, timeout_ns):
    """Loads ``flag_ptr`` (pinned host memory) until it is non-zero or ``timeout_ns`` passed, every
    warp loading it (as the kernels' waits did before ``look_word``); stores the looks it made at ``looks_ptr[pid]``."""
    t0 = tl.extra.cuda.globaltimer()
    n = 0
    v = tl.load(flag_ptr, volatile=True)
    late = 0
    while (v == 0) & (late == 0):
        v = tl.load(flag_ptr, volatile=True)
        n += 1
        late = ((tl.extra.cuda.globaltimer() - t0) > timeout_ns).to(tl.int32)
    tl.store(looks_ptr + tl.program_id(0), n)


@triton.jit
def _poll_one_kernel(flag_ptr, looks_ptr, timeout_ns):
    """``_poll_kernel`` looking as the kernels' waits do (``moe_ep.internode.mailbox.look_word``):
    one thread of the program loads the word and a reduction hands it to the others, one read
    per look for the program instead of one per warp."""
    t0 = tl.extra.cuda.globaltimer()
    n = 0
    v = look_word(flag_ptr)
    late = 0
    while (v == 0) & (late == 0):
        v = look_word(flag_ptr)
        n += 1
        late = ((tl.extra.cuda.globaltimer() - t0) > timeout_ns).to(tl.int32)
    tl.store(looks_ptr + tl.program_id(0), n)


@triton.jit
def _poll_leader_kernel(flag_ptr, mirror_ptr, looks_ptr, timeout_ns):
    """A candidate for the waits: program 0 alone looks at the host word (``look_word``) and,
    once it is up, raises ``mirror_ptr`` (a device word); the other programs spin on that device
    word, so one read crosses PCIe per look for the whole launch. ``looks_ptr[pid]``: host looks."""
    t0 = tl.extra.cuda.globaltimer()
    n = 0
    late = 0
    if tl.program_id(0) == 0:
        v = look_word(flag_ptr)
        while (v == 0) & (late == 0):
            v = look_word(flag_ptr)
            n += 1
            late = ((tl.extra.cuda.globaltimer() - t0) > timeout_ns).to(tl.int32)
        tl.atomic_xchg(mirror_ptr, 1, sem="release", scope="gpu")
    else:
        m = tl.load(mirror_ptr, volatile=True)
        while (m == 0) & (late == 0):
            m = tl.load(mirror_ptr, volatile=True)
            late = ((tl.extra.cuda.globaltimer() - t0) > timeout_ns).to(tl.int32)
    tl.store(looks_ptr + tl.program_id(0), n)


@triton.jit
def _poll_spaced_kernel(flag_ptr, looks_ptr, timeout_ns, space_ns):
    """A candidate for the waits: ``_poll_one_kernel`` with ``space_ns`` between a program's looks
    (spent reading the GPU's clock, no memory traffic): fewer reads in flight, each wait up to
    ``space_ns`` later to see its word."""
    t0 = tl.extra.cuda.globaltimer()
    n = 0
    v = look_word(flag_ptr)
    late = 0
    while (v == 0) & (late == 0):
        t1 = tl.extra.cuda.globaltimer()
        t = t1
        while t - t1 < space_ns:
            t = tl.extra.cuda.globaltimer()
        v = look_word(flag_ptr)
        n += 1
        late = ((t - t0) > timeout_ns).to(tl.int32)
    tl.store(looks_ptr + tl.program_id(0), n)


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """``dst[:n] = src[:n]`` (int64 words), the programs striding over BLOCK-word tiles."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=m), mask=m)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--pollers", type=int_list("--pollers", zero_ok=True), default=[0, 1, 66],
                   help="programs polling the host word (default 0,1,66: none, one, a decode launch's)")
    p.add_argument("--warps", type=int_list("--warps", pow2_only=True), default=[1, 16],
                   help="warps per polling program (default 1,16; the kernels' is 16)")
    p.add_argument("--bytes", type=int, default=128 * 14336,
                   help="bytes a copy moves (default 1835008: 128 combine rows of 7168 bf16)")
    p.add_argument("--copy-programs", type=int, default=32, help="programs of the copy (default 32)")
    p.add_argument("--iters", type=int, default=20, help="timed copies per point (default 20)")
    p.add_argument("--who", default=",".join(WHO),
                   help=f"how the pollers look, comma-separated (default all: {', '.join(WHO)})")
    p.add_argument("--space-ns", type=int, default=1000,
                   help="ns between a program's looks for --who spaced (default 1000)")
    args = p.parse_args(argv)
    if args.bytes < 8 or args.bytes % 8:
        p.error(f"--bytes: a positive multiple of 8, got {args.bytes}")
    if min(args.copy_programs, args.iters) < 1:
        p.error("--copy-programs and --iters must be positive")
    args.who = [w.strip() for w in args.who.split(",")]
    if not args.who or any(w not in WHO for w in args.who):
        p.error(f"--who: expected a comma-separated list of {', '.join(WHO)}; got {','.join(args.who)!r}")
    if args.space_ns < 0:
        p.error(f"--space-ns: expected >= 0, got {args.space_ns}")
    if not torch.cuda.is_available():
        p.error("no CUDA GPU: this benchmark times a GPU's traffic to pinned host memory")
    return args


def measure(pollers: int, warps: int, who: str, direction: str, dev_buf: torch.Tensor, host_buf: torch.Tensor,
            copy_programs: int, iters: int, space_ns: int) -> dict:
    """One point: the copy's time per iteration (µs) and GB/s with ``pollers`` programs of
    ``warps`` warps spinning on a host word meanwhile, looking as ``who`` says (one of ``WHO``),
    and their looks at host memory per µs."""
    flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    mirror = torch.zeros(1, dtype=torch.int64, device=dev_buf.device)
    looks = torch.zeros(max(pollers, 1), dtype=torch.int64, device=dev_buf.device)
    src, dst = (dev_buf, host_buf) if direction == "to host" else (host_buf, dev_buf)
    n = src.numel()
    s_poll, s_copy = torch.cuda.Stream(), torch.cuda.Stream()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    if pollers:
        with torch.cuda.stream(s_poll):
            if who == "every warp":
                _poll_kernel[(pollers,)](flag, looks, POLL_TIMEOUT_NS, num_warps=warps)
            elif who == "one thread":
                _poll_one_kernel[(pollers,)](flag, looks, POLL_TIMEOUT_NS, num_warps=warps)
            elif who == "one program":
                _poll_leader_kernel[(pollers,)](flag, mirror, looks, POLL_TIMEOUT_NS, num_warps=warps)
            else:
                _poll_spaced_kernel[(pollers,)](flag, looks, POLL_TIMEOUT_NS, space_ns, num_warps=warps)
    with torch.cuda.stream(s_copy):
        for i in range(iters + 2):  # two untimed first: the pollers are spinning by then
            if i == 2:
                e0.record()
            _copy_kernel[(copy_programs,)](src, dst, n, BLOCK=2048, num_warps=8)
        e1.record()
    e1.synchronize()
    flag[0] = 1  # the pollers stop (the GPU reads the pinned word)
    torch.cuda.synchronize()
    us = e0.elapsed_time(e1) * 1000.0 / iters
    total_us = max(e0.elapsed_time(e1) * 1000.0, 1e-3)
    return dict(pollers=pollers, warps=warps if pollers else 0, who=who if pollers else "-", direction=direction,
                us=us, gbs=src.numel() * 8 / (us * 1e3),
                looks_per_us=float(looks.sum()) / total_us if pollers else 0.0)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    dev = torch.device("cuda", torch.cuda.current_device())
    words = args.bytes // 8
    dev_buf = torch.arange(words, dtype=torch.int64, device=dev)
    host_buf = torch.zeros(words, dtype=torch.int64, pin_memory=True)
    rows = []
    for direction in ("to host", "from host"):
        for p in args.pollers:
            for w in (args.warps if p else [0]):
                for who in (args.who if p else ["-"]):
                    rows.append(measure(p, w, who, direction, dev_buf, host_buf, args.copy_programs, args.iters,
                                        args.space_ns))
    if not torch.equal(host_buf.to(dev), dev_buf):
        print("the copies moved wrong bytes")
        return 1
    print(f"{torch.cuda.get_device_name(dev)}; torch {torch.__version__}, triton {triton.__version__}; "
          f"{args.bytes} bytes a copy, {args.copy_programs} programs, {args.iters} copies a point; "
          f"spaced: {args.space_ns} ns between looks")
    print(f"{'direction':<10} {'pollers':>7} {'warps':>5} {'who looks':<11} {'us/copy':>9} {'GB/s':>7} {'host looks/us':>13}")
    for r in rows:
        print(f"{r['direction']:<10} {r['pollers']:>7} {r['warps']:>5} {r['who']:<11} {r['us']:>9.1f} "
              f"{r['gbs']:>7.2f} {r['looks_per_us']:>13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
