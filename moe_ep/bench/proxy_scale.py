"""One real proxy against R-1 simulated peers over a null transport: the proxy's own CPU per op to R=128.

    python -m moe_ep.bench.proxy_scale --ranks 8 16 32 64 128 --shapes decode prefill --repeat 3 \\
        --json scale.json --plot scale.png          # also: moe-ep-bench proxy ...

Rank 0's proxy (the real one, ``csrc/proxy/proxy.cc``) runs dispatch + combine for ``warmup +
epochs`` epochs over ``NullTransport`` (``csrc/proxy/null_transport.cc``: a post completes at
once, nothing moves). The native simulator ``moe_ep_sim_drive`` is both rank 0's kernels (its
bells, its count vector) and its R-1 peers: per epoch it adds exactly the immediates they would
send (D0 from every other rank with that rank's count vector as header, D1 / D2 from each remote
source with rows / overflow for rank 0, C from each remote owner rank 0 sent rows to), either all
before the bells (``early``: nothing to wait for, the proxy's floor) or one at a time after them
(``spread``: the proxy sees them arrive). 8 ranks per node, so node peers send only headers.

Counts: per epoch one of ``--draws`` count matrices, each drawn from top-K routing over E experts
(``uniform``, or ``zipf`` as in ``moe_ep.bench.workloads.Routing``): ``c[s, p]`` = tokens of s
with an expert on p. Capacities as ``EPBuffer`` sets them (``default_private_capacity``); the
overflow region is sized to the draws (the proxy never touches row memory here).

Reported per (shape, arrival, R) and op: the proxy thread's CPU and wall time per phase (p50 /
p99 over epochs; of ``--repeat`` runs the one with the best CPU p50), the writes it posted and the
doorbells it saw per op (checked against the count matrices), and per (shape, arrival, op) a
least-squares line of CPU p50 over R: its slope in ns per peer.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from dataclasses import asdict, dataclass

import numpy as np

TARGETS = dict(ep64_us=5.0, ep128_us=10.0, slope_ns=60.0)  # decode, null transport (issue 42)


@dataclass(frozen=True)
class Shape:
    """Tokens per rank T, hidden H, top-k K, experts E; fp8 dispatch rows, bf16 combine rows."""

    name: str
    tokens: int
    hidden: int = 7168
    topk: int = 8
    num_experts: int = 256


SHAPES = {"decode": Shape("decode", 128), "prefill": Shape("prefill", 4096)}


def count_matrix(R: int, sh: Shape, rng: np.random.Generator, routing: str = "uniform",
                 zipf_s: float = 1.0) -> np.ndarray:
    """int32 [R, R]: ``c[s, p]`` tokens of rank s with at least one of their K experts on rank p
    (experts ``p * E/R ..`` live on p). Top-K without replacement by the Gumbel trick: uniform
    scores for ``uniform``, ``log(1 / (e + 1) ** zipf_s)`` plus Gumbel noise for ``zipf``."""
    E, K, T, EL = sh.num_experts, sh.topk, sh.tokens, sh.num_experts // R
    bias = 0.0 if routing == "uniform" else -zipf_s * np.log(np.arange(1, E + 1, dtype=np.float64))
    C = np.zeros((R, R), np.int32)
    for s in range(R):
        g = bias - np.log(-np.log(rng.random((T, E))))
        idx = np.argpartition(-g, K - 1, axis=1)[:, :K]
        hit = np.zeros((T, R), bool)
        hit[np.arange(T)[:, None], idx // EL] = True
        C[s] = hit.sum(axis=0)
    return C


@functools.lru_cache(maxsize=4)
def _draws(R: int, sh: Shape, n: int, seed: int, routing: str) -> np.ndarray:
    """``n`` count matrices [n, R, R] (cached: repeats of a point reuse them)."""
    rng = np.random.default_rng(seed * 7919 + R)
    return np.stack([count_matrix(R, sh, rng, routing) for _ in range(n)])


def expected(C: np.ndarray, me: int, G: int, cap: int) -> dict[str, int]:
    """Writes rank ``me``'s proxy posts for one epoch of matrix C and doorbells it sees."""
    R = C.shape[0]
    remote = [p for p in range(R) if p // G != me // G]
    return dict(D0=R - 1, D1=sum(int(C[me, p] > 0) for p in remote), D2=sum(int(C[me, p] > cap) for p in remote),
                C=sum(int(C[s, me] > 0) for s in remote),
                dispatch_bells=1 + len(remote), combine_bells=sum(int(C[s, me] > 0) for s in remote))


@dataclass
class Point:
    """One (shape, arrival, R) run's inputs."""

    R: int
    shape: Shape
    arrival: str = "early"
    epochs: int = 200
    warmup: int = 20
    draws: int = 4
    seed: int = 0
    gap_ns: int = 0
    node_size: int = 8
    routing: str = "uniform"
    rank: str = "first"  # the real proxy's rank: "first" (0) or "last" (R-1, the longest offset sums)
    trace: str = "phases"  # its trace level (Proxy's ``trace``): what EPBuffer runs with by default
    cpus: tuple[int, ...] = ()  # (simulator's CPU, proxy thread's CPU); () leaves placement to the scheduler


def _pct(v, q) -> float:
    return float(np.percentile(np.asarray(v, np.float64), q)) / 1e3 if len(v) else float("nan")


def _start_pinned(px, cpus: tuple[int, ...]) -> set[int] | None:
    """Starts the proxy; with ``cpus`` = (a, b), the calling thread (the simulator: the kernels and
    the peers) runs on CPU a from now on and the proxy's thread on CPU b. Whether the two share a
    core changes the proxy's CPU by half on a 2-core host (what the peers write is then in its own
    cache, not another core's): the scheduler picks either, so pin them to compare runs."""
    if not cpus:
        px.start()
        return None
    sim_cpu, proxy_cpu = cpus
    mask = os.sched_getaffinity(0)  # (returned: run_point gives it back to this thread)
    os.sched_setaffinity(0, {sim_cpu})  # (this thread only)
    before = set(os.listdir("/proc/self/task"))
    px.start()
    for tid in set(os.listdir("/proc/self/task")) - before:
        os.sched_setaffinity(int(tid), {proxy_cpu})
    return mask


def run_point(pt: Point) -> dict:
    """Runs one point and returns its row (µs, counts per op); raises on a proxy error or a count mismatch."""
    from moe_ep.internode.spec import default_private_capacity
    from moe_ep.internode.spec import RemoteSpec
    from moe_ep.native.bench import NullTransport, SimConfig, sim_drive
    from moe_ep.native.proxy import Proxy

    R, sh, G = pt.R, pt.shape, min(pt.node_size, pt.R)
    me = 0 if pt.rank == "first" else R - 1
    mats = _draws(R, sh, pt.draws, pt.seed, pt.routing)
    cap = default_private_capacity(sh.tokens, sh.topk, sh.num_experts, R)
    spec = RemoteSpec(rank=me, world=R, node_size=G, num_experts=sh.num_experts, topk=sh.topk, hidden=sh.hidden,
                      max_tokens=sh.tokens, fp8=True, private_capacity=cap, overflow_capacity=1)
    ov = np.maximum(mats - cap, 0)
    node = np.arange(R) // G
    ov[:, node[:, None] == node[None, :]] = 0
    ovcap = max(1, int(ov.sum(axis=1).max()))
    eng = NullTransport(me, R)
    px = Proxy(eng, node_size=G, num_local_experts=spec.num_local_experts, row_bytes=spec.row_bytes,
               comb_row_bytes=spec.comb_row_bytes, private_capacity=cap, overflow_capacity=ovcap,
               max_send_rows=spec.max_send_rows, timeout_s=10, spin_us=50, sleep_us=20, trace=pt.trace)
    mask = None
    try:
        cfg = SimConfig(me, R, G, cap, px.hdr_bytes, px.keys["hdr_send"], px.keys["hdr_recv"], pt.draws,
                        int(pt.arrival == "spread"), pt.gap_ns, 10_000_000_000, 1_000_000_000, 0)
        counts = np.ascontiguousarray(mats, np.int32)
        n = pt.warmup + pt.epochs
        mask = _start_pinned(px, pt.cpus)
        sim_drive(eng, px, cfg, counts, 1, n)
        recs = [r for r in px.phase_records() if r[1] > pt.warmup]
        stats = eng.stats()
        stats["post_calls"] = eng.post_calls()
    finally:
        px.close()
        eng.close()
        if pt.cpus and mask is not None:
            os.sched_setaffinity(0, mask)
    return _row(pt, mats, cap, recs, stats, n, me)


def _row(pt: Point, mats, cap: int, recs, stats: dict, n: int, me: int) -> dict:
    """The reported row, after checking posts (all epochs) and each op's posts and doorbells
    (the phase records) against the count matrices."""
    G = min(pt.node_size, pt.R)
    want = [expected(mats[e % pt.draws], me, G, cap) for e in range(1, n + 1)]
    for k in ("D0", "D1", "D2", "C"):
        if stats[k] != sum(w[k] for w in want):
            raise AssertionError(f"R={pt.R}: {k} writes posted {stats[k]}, the count matrices say "
                                 f"{sum(w[k] for w in want)}")
    for op, e, *_, posts, bells in recs:
        w = want[e - 1]
        wp = w["D0"] + w["D1"] + w["D2"] if op == "dispatch" else w["C"]
        if (posts, bells) != (wp, w[op + "_bells"]):
            raise AssertionError(f"R={pt.R} {op} epoch {e}: {posts} posts and {bells} bells, the count matrix "
                                 f"says {wp} and {w[op + '_bells']}")
    row = dict(ranks=pt.R, peers=pt.R - 1, shape=pt.shape.name, arrival=pt.arrival, routing=pt.routing,
               private_capacity=cap, epochs=pt.epochs, gap_ns=pt.gap_ns, rank=me, trace=pt.trace,
               post_calls_per_epoch=stats.get("post_calls", 0) / n,  # transport calls: a batch of writes is one
               cpus=list(pt.cpus))
    for op, ph in (("dispatch", ("D0", "D1", "D2")), ("combine", ("C",))):
        cpu = [r[5] for r in recs if r[0] == op]
        wall = [r[4] - r[2] for r in recs if r[0] == op]
        row[op] = dict(cpu_p50_us=_pct(cpu, 50), cpu_p99_us=_pct(cpu, 99), wall_p50_us=_pct(wall, 50),
                       wall_p99_us=_pct(wall, 99),
                       posts_per_op=sum(stats[k] for k in ph) / n,
                       bells_per_op=float(np.median([r[7] for r in recs if r[0] == op])) if recs else float("nan"),
                       bells_expected=float(np.mean([w[op + "_bells"] for w in want])))
    return row


def floor(R: int, node_size: int = 8, iters: int = 2000, reps: int = 5, cpus: tuple[int, ...] = (),
          shards: int = 1) -> dict:
    """The floor of one decode dispatch at R ranks (``moe_ep_sim_floor``): the posts and their
    completions, the immediates taken, the headers copied and scanned, each timed alone on one
    thread (µs per dispatch, best of ``reps``), and their sum; then the headers and the immediates
    again as another thread wrote them (``*_written_us``; with ``cpus`` = (a, b), the writer on CPU
    a and this thread on CPU b, as ``--cpus SIM,PROXY`` places the simulator and the proxy), and
    that sum (``sum_written_us``: the floor of a proxy whose peers' writes land from another core).
    ``shards`` > 1: the same for one of that many proxy threads, each serving a block of consecutive peers."""
    from moe_ep.native.bench import sim_floor

    mask = None
    if cpus:
        mask = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cpus[1]})
    try:
        posts, immediates, headers, headers_w, immediates_w = sim_floor(R, min(node_size, R), iters, reps,
                                                                        cpus[0] if cpus else -1, shards)
    finally:
        if mask is not None:
            os.sched_setaffinity(0, mask)
    parts = dict(posts_us=posts / 1e3, immediates_us=immediates / 1e3, headers_us=headers / 1e3)
    written = dict(immediates_written_us=immediates_w / 1e3, headers_written_us=headers_w / 1e3)
    return dict(ranks=R, shards=shards, **parts, sum_us=sum(parts.values()), **written,
                sum_written_us=parts["posts_us"] + sum(written.values()))


def fit(rows: list[dict]) -> list[dict]:
    """Least squares ``cpu_p50 = a + b * R`` per (shape, arrival, op): ``b`` in ns per peer."""
    out = []
    for key in sorted({(r["shape"], r["arrival"]) for r in rows}):
        sel = sorted((r for r in rows if (r["shape"], r["arrival"]) == key), key=lambda r: r["ranks"])
        if len(sel) < 2:
            continue
        for op in ("dispatch", "combine"):
            pts = [(r["ranks"], r[op]["cpu_p50_us"] * 1e3) for r in sel if np.isfinite(r[op]["cpu_p50_us"])]
            if len(pts) < 2:  # (R = 8 is one node: no combine)
                continue
            b, a = np.polyfit(*np.array(pts, np.float64).T, 1)
            out.append(dict(shape=key[0], arrival=key[1], op=op, slope_ns_per_peer=float(b), intercept_us=float(a) / 1e3))
    return out


def targets(rows: list[dict], fits: list[dict], arrival: str = "early") -> list[dict]:
    """Issue 42's targets (decode, null transport) against the rows of one arrival."""
    res = []
    for op in ("dispatch", "combine"):
        for R, lim in ((64, TARGETS["ep64_us"]), (128, TARGETS["ep128_us"])):
            r = [x for x in rows if x["shape"] == "decode" and x["arrival"] == arrival and x["ranks"] == R]
            if r:
                v = r[0][op]["cpu_p50_us"]
                res.append(dict(what=f"decode {op} EP{R} CPU p50 ≤ {lim:g} µs", value=round(v, 2), met=v <= lim))
        f = [x for x in fits if x["shape"] == "decode" and x["arrival"] == arrival and x["op"] == op]
        if f:
            v = f[0]["slope_ns_per_peer"]
            res.append(dict(what=f"decode {op} slope ≤ {TARGETS['slope_ns']:g} ns/peer", value=round(v, 1),
                            met=v <= TARGETS["slope_ns"]))
    return res


def table(rows: list[dict]) -> str:
    """Markdown: one line per (shape, arrival, R), dispatch and combine side by side."""
    cols = ["shape", "arrival", "R", "dispatch CPU p50 / p99 (µs)", "wall p50 / p99 (µs)", "posts", "bells",
            "combine CPU p50 / p99 (µs)", "wall p50 / p99 (µs)", "posts", "bells"]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * 3 + " ---: |" * (len(cols) - 3)]
    for r in rows:
        cells = [r["shape"], r["arrival"], str(r["ranks"])]
        for op in ("dispatch", "combine"):
            d = r[op]
            cells += [f"{d['cpu_p50_us']:.1f} / {d['cpu_p99_us']:.1f}", f"{d['wall_p50_us']:.1f} / {d['wall_p99_us']:.1f}",
                      f"{d['posts_per_op']:.1f}", f"{d['bells_per_op']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> str:
    """CPU p50 per op vs R, one line per (shape, arrival, op), log-2 x axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r["shape"], r["arrival"]) for r in rows}):
        sel = sorted((r for r in rows if (r["shape"], r["arrival"]) == key), key=lambda r: r["ranks"])
        for op, style in (("dispatch", "-o"), ("combine", "--s")):
            ax.plot([r["ranks"] for r in sel], [r[op]["cpu_p50_us"] for r in sel], style, label=f"{key[0]} {key[1]} {op}")
    ax.axhline(TARGETS["ep64_us"], color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks R (8 per node)")
    ax.set_ylabel("proxy thread CPU per op, p50 (µs)")
    ax.set_title("Proxy cost, null transport, one proxy vs R-1 simulated peers")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def sweep(ranks, shapes, arrivals, repeat: int = 1, **kw) -> list[dict]:
    """Every (shape, arrival, R) point, best of ``repeat`` runs by dispatch + combine CPU p50."""
    rows = []
    for s in shapes:
        for a in arrivals:
            for R in ranks:
                runs = [run_point(Point(R, SHAPES[s], a, **kw)) for _ in range(repeat)]
                best = min(runs, key=lambda r: r["dispatch"]["cpu_p50_us"] + r["combine"]["cpu_p50_us"])
                best["repeats"] = repeat
                rows.append(best)
                print(f"{s} {a} R={R}: dispatch CPU p50 {best['dispatch']['cpu_p50_us']:.1f} us, "
                      f"combine {best['combine']['cpu_p50_us']:.1f} us", file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    from .proxy_cost import _meta

    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m moe_ep.bench.proxy_scale", description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["decode", "prefill"])
    ap.add_argument("--arrivals", nargs="+", choices=["early", "spread"], default=["early", "spread"])
    ap.add_argument("--routing", choices=["uniform", "zipf"], default="uniform")
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--draws", type=int, default=4, help="count matrices, used in turn")
    ap.add_argument("--gap-ns", type=int, default=0, help="spread: between two injected immediates")
    ap.add_argument("--repeat", type=int, default=1, help="runs per point; the best CPU p50 is kept")
    ap.add_argument("--rank", choices=["first", "last"], default="first",
                    help="the real proxy's rank: 0, or R-1 (the longest offset sums)")
    ap.add_argument("--trace", choices=["off", "phases", "peers"], default="phases",
                    help="the proxy's trace level (EPBuffer's default: phases)")
    ap.add_argument("--cpus", default="", metavar="SIM,PROXY",
                    help="pin the simulator and the proxy thread to these CPUs (e.g. 0,1: apart, as a NIC's "
                         "writes and the proxy are; 0,0: one core); default: the scheduler's choice")
    ap.add_argument("--floor", action="store_true",
                    help="also the floor per R: a dispatch's posts, immediates and headers timed alone, then "
                         "the headers and immediates as another thread (on SIM of --cpus) wrote them")
    ap.add_argument("--floor-shards", type=int, default=1, metavar="S",
                    help="--floor for one of S proxy threads, each serving a block of R/S peers (default 1)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", metavar="PNG", help="CPU p50 vs R")
    a = ap.parse_args(argv)
    cpus = tuple(int(c) for c in a.cpus.split(",")) if a.cpus else ()
    rows = sweep(a.ranks, a.shapes, a.arrivals, a.repeat, epochs=a.epochs, warmup=a.warmup, draws=a.draws,
                 gap_ns=a.gap_ns, routing=a.routing, rank=a.rank, trace=a.trace,
                 cpus=cpus)
    fits = fit(rows)
    meta = _meta(argv)
    meta["command"] = "python -m moe_ep.bench.proxy_scale " + " ".join(argv)
    doc = dict(meta=meta, shapes={k: asdict(v) for k, v in SHAPES.items()}, rows=rows, fits=fits,
               targets={arr: targets(rows, fits, arr) for arr in a.arrivals})
    if a.floor:
        doc["floor"] = [floor(R, cpus=cpus, shards=a.floor_shards) for R in a.ranks]
    print(table(rows))
    for f in doc.get("floor", []):
        who = "" if f["shards"] == 1 else f", one of {f['shards']} threads"
        print(f"floor R={f['ranks']}{who}: posts {f['posts_us']:.2f} + immediates {f['immediates_us']:.2f} + headers "
              f"{f['headers_us']:.2f} = {f['sum_us']:.2f} us per dispatch; written by another thread: immediates "
              f"{f['immediates_written_us']:.2f}, headers {f['headers_written_us']:.2f}, with the posts "
              f"{f['sum_written_us']:.2f} us")
    for f in fits:
        print(f"fit {f['shape']} {f['arrival']} {f['op']}: {f['slope_ns_per_peer']:.1f} ns/peer, "
              f"intercept {f['intercept_us']:.2f} us")
    for arr, ts in doc["targets"].items():
        for t in ts:
            print(f"target ({arr}) {t['what']}: {t['value']} {'met' if t['met'] else 'MISSED'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    if a.plot:
        print(f"plot: {plot(rows, a.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
