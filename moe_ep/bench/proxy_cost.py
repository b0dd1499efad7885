"""Proxy cost on CPU over TCP loopback: time per posted write and per protocol phase.

    python -m moe_ep.bench.proxy_cost                          # both parts, table + JSON on stdout
    python -m moe_ep.bench.proxy_cost --json out.json --ranks 2 4 8 16 --streams 4 1 --epochs 200

Part "post" (one process, two TCP engines): for each write size, the native loop
``moe_ep_bench_post`` posts ``n`` writes back to back and reports the time per ``post_write`` call
and per completed write (first post to last completion, divided by n); then it posts writes one
at a time and reports the p50/p99 of one ``post_write`` call and of post -> completion. Every
number is measured in native code, so it is the engine's cost, not that of ctypes.

Part "phase" (one process per rank, node_size=1 so every peer is remote, 16-byte rows, one row
to every peer (``--rows`` rows with that option); private capacity 2, so round 2 is empty, or 0
with --private-capacity 0, so every row goes in round 2, through an overflow region of
``--overflow-capacity`` rows (default: all of them, one window; fewer: a receiver's rows cross in
windows, one credit round trip each: the cost of a round)): each rank's native kernel stand-in ``moe_ep_bench_drive`` rings every bell
of dispatch and combine for ``warmup + epochs`` epochs, each right after the previous ready word.
Reported over all ranks and measured epochs:
  - proxy dispatch / combine: bell seen -> ready written, by the proxy thread (its own
    phase time: posting, waiting for the peers' immediates and its own completions);
  - proxy D1: header bell seen -> every peer's header counted (``hdr_ready``);
  - kernel dispatch / combine: bells written -> ready seen, as a kernel polling the mailbox
    would see it (adds the proxy's bell polling and the stand-in's own polling);
  - CPU per epoch and rank: CPU time of the proxy thread in a dispatch and in a combine (p50),
    plus that of the transport's thread per epoch (mean): the work one rank's proxy needs
    per dispatch + combine, whatever the scheduling.
A phase is a collective: its time includes waiting for the slowest peer, so on a machine with
fewer cores than ranks it measures scheduling as much as the proxy.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import threading
import time

import numpy as np

from ..core import settings

SIZES = [0, 4096, 65536, 1 << 20]
POST_N = {0: 20000, 4096: 20000, 65536: 4000, 1 << 20: 300}
SERIAL_N = {0: 2000, 4096: 2000, 65536: 1000, 1 << 20: 100}
RB = CRB = 16


def _meta(argv) -> dict:
    cpu = "?"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except OSError:
        pass
    commit = settings.commit()
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "?"
        except OSError:
            commit = "?"
    return dict(cpu=cpu, cores=os.cpu_count(), kernel=platform.release(), load=os.getloadavg(),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=commit,
                command="python -m moe_ep.bench.proxy_cost " + " ".join(argv))


# ----------------------------------------------------------------------------- post cost

def make_engine(rank: int, world: int, streams: int, transport: str):
    """One rank's engine on this host: ``tcp`` (``streams`` sockets per peer), ``verbs``, or
    ``libfabric:PROVIDER`` (e.g. ``libfabric:tcp;ofi_rxm``, ``libfabric:udp;ofi_rxd``, on the
    loopback domain; ``streams`` is not used)."""
    from moe_ep.native.transports import Engine, FabricTransport

    if transport.startswith("libfabric:"):
        prov = transport.split(":", 1)[1]
        local = prov.split(";")[0] in ("tcp", "udp")
        return FabricTransport(rank, world, provider=prov, domain="lo" if local else None)
    return Engine(rank, world, streams=streams, transport=transport)


def post_cost(streams: int, sizes=SIZES, scale: float = 1.0, transport: str = "tcp") -> list[dict]:
    from moe_ep.native.bench import bench_post

    a, b = (make_engine(r, 2, streams, transport) for r in (0, 1))
    src, dst = np.ones(max(sizes) or 16, np.uint8), np.zeros(max(sizes) or 16, np.uint8)
    try:
        for e, buf in ((a, src), (b, np.zeros(16, np.uint8))):
            e.register(buf)
        for e, buf in ((a, np.zeros(16, np.uint8)), (b, dst)):
            e.register(buf)
        eps = [a.endpoint, b.endpoint]
        t = threading.Thread(target=b.connect, args=(eps, 10))  # (libfabric: both ends answer hellos at once)
        t.start()
        a.connect(eps, 10)
        t.join()
        rows = []
        for size in sizes:
            n, ns = max(10, int(POST_N[size] * scale)), max(10, int(SERIAL_N[size] * scale))
            bench_post(a, 1, 1, 2, size, n=min(n, 100), n_serial=10)  # warm-up
            r = bench_post(a, 1, 1, 2, size, n=n, n_serial=ns)
            assert r["failed"] == 0, r
            rows.append(dict(transport=transport, streams=streams, bytes=size, n=n, n_serial=ns,
                             post_us=r["post_total_ns"] / n / 1e3,
                             complete_us=r["complete_total_ns"] / n / 1e3,
                             gbps=size * n / r["complete_total_ns"] if size else 0.0,
                             serial_post_p50_us=r["serial_post_p50_ns"] / 1e3,
                             serial_post_p99_us=r["serial_post_p99_ns"] / 1e3,
                             serial_latency_p50_us=r["serial_latency_p50_ns"] / 1e3,
                             serial_latency_p99_us=r["serial_latency_p99_ns"] / 1e3))
        return rows
    finally:
        a.close()
        b.close()


# ----------------------------------------------------------------------------- phase time

def _rank_main(rank, R, transport, streams, warmup, epochs, poll, cap, conn, rows=1, ovcap=None, rb=RB, crb=CRB):
    try:
        from moe_ep.native.bench import bench_drive
        from moe_ep.native.proxy import Proxy, proxy_region_bytes

        eng = make_engine(rank, R, streams, transport)
        ovcap = R * rows if ovcap is None else ovcap
        kw = dict(node_size=1, num_local_experts=1, row_bytes=rb, comb_row_bytes=crb, private_capacity=cap,
                  overflow_capacity=ovcap, max_send_rows=R * rows)
        # (the combine send region at least as the proxy sizes it: round-1 slots of every peer, then the windows)
        comb_send = max(proxy_region_bytes(R, **kw)["comb_send"], (R * rows + ovcap) * crb)
        px = Proxy(eng, **kw, timeout_s=30, spin_us=poll["proxy_spin_us"], sleep_us=poll["proxy_sleep_us"],
                   regions={"comb_send": np.zeros(comb_send, np.uint8)})
        conn.send(eng.endpoint)
        eng.connect(conn.recv(), timeout_s=30)
        counts = np.full(R, rows, np.int32)
        counts[rank] = 0
        for p in range(R):
            hdr = px.header(p)
            hdr[:R] = counts
            hdr[R] = 1
        for p, off in px.disp_offsets(counts).items():  # `rows` rows of rb bytes to every peer, every epoch
            px.disp_send[off:off + rows * rb] = p
        px.comb_send[:(R - 1) * rows * crb] = rank
        px.start()
        conn.send("ready")
        assert conn.recv() == "go"
        kw = dict(spin_us=poll["drive_spin_us"], sleep_us=poll["drive_sleep_us"])
        bench_drive(px, 1, warmup, **kw)
        io0 = eng.cpu_ns()
        disp, comb = bench_drive(px, warmup + 1, epochs, **kw)
        io_cpu = (eng.cpu_ns() - io0) / epochs
        prox = {"dispatch": [], "d1": [], "combine": [], "dispatch_cpu": [], "combine_cpu": []}
        for kind, e, seen, mid, ready, cpu, *_ in px.phase_records():
            if e > warmup:
                prox[kind].append(ready - seen)
                prox[kind + "_cpu"].append(cpu)
                if kind == "dispatch":
                    prox["d1"].append(mid - seen)
        # the rows really arrived (last epoch: one row from every peer, in its parity copy; in
        # round 1, or with no private capacity in the overflow region in source order)
        e = warmup + epochs
        for s in range(R):
            if s != rank and (cap or (R - 1) * rows <= ovcap):  # (several windows: the region holds the last)
                if cap:
                    got = px.round1[px.round1_offset(e, s):][:rows * rb if rows <= cap else rb]
                else:
                    got = px.overflow[px.overflow_offset(e) + rb * rows * (s - (s > rank)):][:rb]
                assert (got == rank).all(), s
        conn.send(("done", disp, comb, prox, io_cpu))
        conn.recv()
        px.close()
        eng.close()
    except BaseException as ex:  # noqa: BLE001 - reported to the parent
        import traceback

        conn.send(("exception", f"{type(ex).__name__}: {ex}\n{traceback.format_exc()}"))


def _pct(v, q):
    return float(np.percentile(np.asarray(v, np.float64), q)) / 1e3 if len(v) else float("nan")


POLL = dict(proxy_spin_us=0.0, proxy_sleep_us=50.0, drive_spin_us=0.0, drive_sleep_us=50.0)


def phase_time(R: int, streams: int, epochs: int, warmup: int = 20, poll: dict = POLL, wall_s: float = 300.0,
               transport: str = "tcp", private_capacity: int = 2, rows: int = 1,
               overflow_capacity: int | None = None, row_bytes: tuple[int, int] = (RB, CRB)) -> dict:
    ctx = mp.get_context("fork")
    procs = []
    for r in range(R):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_rank_main, daemon=True,
                        args=(r, R, transport, streams, warmup, epochs, poll, private_capacity, child, rows,
                              overflow_capacity, *row_bytes))
        p.start()
        procs.append((p, parent))
    try:
        def recv(c, what):
            if not c.poll(wall_s):
                raise TimeoutError(f"a rank did not answer ({what}) within {wall_s} s")
            m = c.recv()
            if isinstance(m, tuple) and m[0] == "exception":
                raise RuntimeError(m[1])
            return m

        eps = [recv(c, "endpoint") for _, c in procs]
        for _, c in procs:
            c.send(eps)
        for _, c in procs:
            assert recv(c, "connect") == "ready"
        for _, c in procs:
            c.send("go")
        res = [recv(c, "epochs") for _, c in procs]
        for _, c in procs:
            c.send("close")
        for p, _ in procs:
            p.join(30)
    finally:
        for p, _ in procs:
            if p.is_alive():
                p.kill()
    disp = [x for r in res for x in r[1]]
    comb = [x for r in res for x in r[2]]
    prox = {k: [x for r in res for x in r[3][k]] for k in res[0][3]}
    out = dict(transport=transport, ranks=R, peers=R - 1, streams=streams, epochs=epochs,
               private_capacity=private_capacity, rows=rows, overflow_capacity=overflow_capacity,
               row_bytes=row_bytes[0], comb_row_bytes=row_bytes[1],
               windows=-(-(R - 1) * rows // overflow_capacity) if overflow_capacity and not private_capacity else 1,
               threads_per_rank=3 * streams * (R - 1) + 3, **poll)
    for name, v in (("proxy_dispatch", prox["dispatch"]), ("proxy_d1", prox["d1"]),
                    ("proxy_combine", prox["combine"]), ("kernel_dispatch", disp), ("kernel_combine", comb)):
        out[name + "_p50_us"], out[name + "_p99_us"] = _pct(v, 50), _pct(v, 99)
    # CPU per epoch (dispatch + combine) of one rank: its proxy thread plus its transport's thread
    out["cpu_proxy_dispatch_p50_us"] = _pct(prox["dispatch_cpu"], 50)
    out["cpu_proxy_combine_p50_us"] = _pct(prox["combine_cpu"], 50)
    out["cpu_io_per_epoch_us"] = float(np.mean([r[4] for r in res])) / 1e3
    out["cpu_per_epoch_us"] = out["cpu_proxy_dispatch_p50_us"] + out["cpu_proxy_combine_p50_us"] + \
        out["cpu_io_per_epoch_us"]
    return out


# ----------------------------------------------------------------------------- output

def _md(cols, rows) -> str:
    """A markdown table: header cells, then one list of cells per row (numbers right-aligned)."""
    out = ["| " + " | ".join(cols) + " |", "|" + " ---: |" * len(cols)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _pp(r, name, digits=0):
    return f"{r[name + '_p50_us']:.{digits}f} / {r[name + '_p99_us']:.{digits}f}"


def post_table(rows) -> str:
    return _md(["transport", "streams", "bytes", "post_write (µs, back to back)", "per completed write (µs)", "GB/s",
                "serial post p50 (µs)", "serial post→completion p50 / p99 (µs)"],
               [[r["transport"], r["streams"], r["bytes"], f"{r['post_us']:.2f}", f"{r['complete_us']:.2f}",
                 f"{r['gbps']:.2f}", f"{r['serial_post_p50_us']:.2f}", _pp(r, "serial_latency", 1)] for r in rows])


def phase_table(rows) -> str:
    return _md(["transport", "streams", "ranks (peers)", "proxy dispatch p50 / p99 (µs)", "proxy D1 p50 (µs)",
                "proxy combine p50 / p99 (µs)", "kernel-view dispatch p50 / p99 (µs)",
                "kernel-view combine p50 / p99 (µs)",
                "CPU per epoch and rank (µs): proxy dispatch + proxy combine + transport"],
               [[r["transport"], r["streams"], f"{r['ranks']} ({r['peers']})", _pp(r, "proxy_dispatch"),
                 f"{r['proxy_d1_p50_us']:.0f}", _pp(r, "proxy_combine"), _pp(r, "kernel_dispatch"),
                 _pp(r, "kernel_combine"), f"{r['cpu_proxy_dispatch_p50_us']:.0f} + {r['cpu_proxy_combine_p50_us']:.0f}"
                 f" + {r['cpu_io_per_epoch_us']:.0f} = {r['cpu_per_epoch_us']:.0f}"] for r in rows])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m moe_ep.bench.proxy_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=["post", "phase", "all"], default="all")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--streams", type=int, nargs="+", default=[4, 1])
    ap.add_argument("--transports", nargs="+", default=["tcp"],
                    help="tcp, verbs, or libfabric:PROVIDER (e.g. 'libfabric:tcp;ofi_rxm' 'libfabric:udp;ofi_rxd')")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=1, help="runs per phase row; the one with the best p50 is kept")
    ap.add_argument("--post-scale", type=float, default=1.0, help="scales the number of posted writes")
    for k, v in POLL.items():
        ap.add_argument("--" + k.replace("_", "-"), type=float, default=v,
                        help="doorbell polling of the proxy thread / ready polling of the kernel stand-in")
    ap.add_argument("--private-capacity", type=int, default=2,
                    help="round-1 rows per peer: 2 (default) leaves round 2 empty, 0 sends every row in round 2")
    ap.add_argument("--rows", type=int, default=1, help="rows from every rank to every peer")
    ap.add_argument("--overflow-capacity", type=int, default=None,
                    help="rows of the overflow region (default: every row, one window)")
    ap.add_argument("--row-bytes", default=f"{RB},{CRB}", metavar="DISPATCH,COMBINE",
                    help="bytes of a dispatch row and of a combine row (default 16,16; H 7168, K 8, fp8 dispatch "
                         "and bf16 combine as RemoteSpec sizes them: 7504,14336)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    res = dict(meta=_meta(argv), post=[], phase=[])
    if args.part in ("post", "all"):
        for t in args.transports:
            for s in args.streams:
                res["post"] += post_cost(s, scale=args.post_scale, transport=t)
        print(post_table(res["post"]), flush=True)
    if args.part in ("phase", "all"):
        poll = {k: getattr(args, k) for k in POLL}
        row_bytes = tuple(int(x) for x in args.row_bytes.split(","))
        if len(row_bytes) != 2 or min(row_bytes) < 16 or any(b % 16 for b in row_bytes):
            ap.error(f"--row-bytes: expected DISPATCH,COMBINE, multiples of 16 bytes, got {args.row_bytes!r}")
        for t in args.transports:
            for s in args.streams:
                for R in args.ranks:
                    runs = [phase_time(R, s, args.epochs, args.warmup, poll, transport=t,
                                       private_capacity=args.private_capacity, rows=args.rows,
                                       overflow_capacity=args.overflow_capacity, row_bytes=row_bytes)
                            for _ in range(args.repeat)]
                    best = min(runs, key=lambda r: r["proxy_dispatch_p50_us"] + r["proxy_combine_p50_us"])
                    best["repeats"] = args.repeat
                    res["phase"].append(best)
                    print(f"{t} streams={s} ranks={R}: proxy dispatch p50 {best['proxy_dispatch_p50_us']:.0f} us, "
                          f"combine p50 {best['proxy_combine_p50_us']:.0f} us", file=sys.stderr, flush=True)
        print(phase_table(res["phase"]), flush=True)
    res["meta"]["load_after"] = os.getloadavg()
    text = json.dumps(res, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
