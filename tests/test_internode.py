"""EPBuffer across nodes (``node_size < world_size``): node peers by stores, other nodes through the
proxy (TCP), on CPU ranks against the oracle.

The same checks as the intranode matrix (tests/ep_cases.py: ragged T with 0 and max_tokens,
uniform / skewed / sparse / no-expert routing, a repeat for determinism, NaN poison, tagged rows
exact, fp8 bytes and scales bit-exact, combine exact on integer data), for 2 nodes x 2, 4 x 1,
3 x 1 and 2 x 1, with private capacities that send every row in round 2 (0), some (1), and none
(the default); bf16, fp8 quantized in-kernel and pre-quantized fp8; then the errors: a batch
beyond the overflow capacity, a second combine of one dispatch, a silent rank (in dispatch and in
combine: the others' errors name it), a rank process killed mid-run.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import dist_util
import native_hooks as hooks
from ep_cases import DTYPES, Case, make_inputs, run_calls

# (ranks, node size, private capacity, faults): together every dtype, layout, alignment and
# routing kind reaches every topology, round 2 runs with and without round-1 rows, and two
# topologies run with delay and reorder injection on every connection (writes sharded over the
# TCP streams, so they land out of order).
TOPOLOGIES = {
    "2x2-pc0-faults": (4, 2, 0, True),
    "4x1-pc1-faults": (4, 1, 1, True),
    "3x1-default": (3, 1, None, False),
    "2x1-pc1": (2, 1, 1, False),
}


def _cases(R: int, i: int):
    calls = ("uniform", "skewed", "sparse", "none", "repeat")
    return [
        Case(R=R, E=2 * R, K=2 + 2 * (i % 2), dtype="bf16", layout="masked", calls=calls, seed=40 + i),
        Case(R=R, E=R * (1 + i % 2), K=3, dtype="fp8", layout="packed", align=(1, 16)[i % 2], data="random",
             H=144 if i == 2 else 128, calls=("uniform", "sparse", "repeat"), seed=50 + i),
        Case(R=R, E=2 * R, K=8, dtype=("fp8pre", "bf16")[i % 2], layout=("packed", "masked")[i % 2], align=16,
             calls=("skewed", "uniform", "repeat"), seed=60 + i),
    ]


def _matrix_worker(rank, world_size, node_size, private_capacity, faults, cases):
    import moe_ep

    group = moe_ep.EPGroup(node_size=node_size)
    fails = []
    for c in cases:
        with moe_ep.EPBuffer(group, c.E, c.H, c.M, c.K, dispatch_dtype=DTYPES[c.dtype], layout=c.layout,
                             expert_alignment=c.align, timeout_s=30.0, private_capacity=private_capacity) as buf:
            if buf.remote is None:
                return [f"rank {rank}: node_size={node_size} of {world_size} did not take the inter-node path"]
            if faults:
                buf.remote.proxy.engine.set_min_shard_bytes(1)
                hooks.set_fault(buf.remote.proxy.engine, delay_us=300, reorder=True)
            fails += run_calls(group, buf, c)
    return fails


@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_matrix_across_nodes(topo):
    R, G, pc, faults = TOPOLOGIES[topo]
    i = list(TOPOLOGIES).index(topo)
    results = dist_util.run(R, _matrix_worker, G, pc, faults, _cases(R, i), timeout=600)
    fails = [f for r in results for f in r]
    assert not fails, f"{len(fails)} failed checks:\n" + "\n".join(fails[:30])


def _errors_worker(rank, world_size):
    """Every rank: overflow beyond capacity, then a second combine of one dispatch."""
    import moe_ep

    group = moe_ep.EPGroup(node_size=1)
    log = {}
    case = Case(R=world_size, E=2 * world_size, K=2, calls=("uniform",), M=4)
    inp = make_inputs(case, 0)[rank]
    # No private slots and no overflow rows: every remote row is refused, on every rank, the same epoch.
    buf = moe_ep.EPBuffer(group, case.E, case.H, case.M, case.K, timeout_s=20.0, private_capacity=0,
                          overflow_capacity=0)
    try:
        buf.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
        log["capacity"] = "no error"
    except moe_ep.CapacityError as exc:
        log["capacity"] = "CapacityError"
        try:
            buf.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
            log["after"] = "no error"
        except moe_ep.BufferBrokenError:
            log["after"] = "BufferBrokenError"
        log["capacity_msg"] = str(exc)
    buf.close()
    group.barrier()
    with moe_ep.EPBuffer(group, case.E, case.H, case.M, case.K, timeout_s=20.0) as buf:
        h = buf.dispatch(inp.x, inp.topk_idx, inp.topk_weights)
        y = torch.zeros(h.expert_x.shape, dtype=torch.bfloat16)
        out = buf.combine(y, h)
        log["combine_zero"] = bool((out == 0).all())
        try:
            buf.combine(y, h)
            log["second_combine"] = "no error"
        except ValueError as exc:
            log["second_combine"] = "handle" in str(exc)
    return log


def test_errors_across_nodes():
    logs = dist_util.run(2, _errors_worker, timeout=300)
    for r, log in enumerate(logs):
        assert log["capacity"] == "CapacityError", (r, log)
        assert log["after"] == "BufferBrokenError", (r, log)
        assert log["combine_zero"] is True, (r, log)
        assert log["second_combine"] is True, (r, log)


def _to_every_rank_inputs(rank, world_size, M, H):
    """M tokens, each selecting an expert of rank R-1 and one of another rank (E = 2R, K = 2), so
    every rank sends rows to every other over the calls and combines rows from rank R-1."""
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(M, H, generator=g).to(torch.bfloat16)
    idx = torch.tensor([[2 * (world_size - 1), 2 * ((rank + 1 + t) % world_size) + 1] for t in range(M)])
    w = torch.rand(M, 2, generator=g)
    return x, idx, w


def _error_fields(exc, t0):
    """What the tests check of a peer error (picklable), or ``other`` for any other exception."""
    from moe_ep import CommTimeoutError
    from moe_ep.native.library import PeerLostError

    if isinstance(exc, (CommTimeoutError, PeerLostError)):
        return dict(type=type(exc).__name__, rank=exc.rank, peer=exc.peer, phase=exc.phase, msg=str(exc),
                    elapsed=time.monotonic() - t0)
    return dict(other=f"{type(exc).__name__}: {exc}")


def _silent_worker(rank, world_size, timeout_s, phase):
    """Rank R-1 never calls ``phase`` (after one good dispatch and combine; for combine, it does
    dispatch); the others raise CommTimeoutError naming it, in time."""
    import moe_ep

    group = moe_ep.EPGroup(node_size=1)
    M, H, silent = 4, 128, rank == world_size - 1
    x, idx, w = _to_every_rank_inputs(rank, world_size, M, H)
    res = {"rank": rank}
    buf = moe_ep.EPBuffer(group, 2 * world_size, H, M, 2, timeout_s=timeout_s)
    try:
        h = buf.dispatch(x, idx, w)
        buf.combine(h.expert_x, h)
        if phase == "combine":
            h = buf.dispatch(x, idx, w)
        if not silent:
            t0 = time.monotonic()
            try:
                buf.combine(h.expert_x, h) if phase == "combine" else buf.dispatch(x, idx, w)
                res["error"] = None
            except Exception as exc:  # noqa: BLE001
                res["error"] = _error_fields(exc, t0)
    finally:
        group.barrier()
        buf.close()
    return res


@pytest.mark.parametrize("phase", ["dispatch", "combine"])
def test_silent_rank_across_nodes(phase):
    """A rank that stays alive but does not call dispatch (or combine): the others' proxies time
    out within timeout_s, and the CommTimeoutError names the rank, the silent peer and the phase."""
    R, timeout_s = 3, 3.0
    results = dist_util.run(R, _silent_worker, timeout_s, phase, timeout=120)
    for res in results[:-1]:
        err = res["error"]
        assert err is not None and err.get("type") == "CommTimeoutError", res
        assert (err["rank"], err["peer"], err["phase"]) == (res["rank"], R - 1, phase), res
        assert f"rank {res['rank']}: peer {R - 1} did not signal {phase}" in err["msg"], err["msg"]
        assert f"no immediate from peer {R - 1}" in err["msg"], err["msg"]
        assert timeout_s * 0.9 <= err["elapsed"] <= timeout_s + 5.0, res


def _killed_worker(rank, world_size, victim, when, timeout_s, node_size=1, good=2, M=4):
    """``good`` good dispatch + combine calls (checked), then ``victim`` SIGKILLs its own process
    before its next dispatch, or between it and its combine; the others report their error.
    ``node_size``: 1 (every peer through the proxy) or the world (the node path; on GPUs, ranks
    that share one map each other's memory through CUDA IPC). ``M``: tokens per rank."""
    import moe_ep

    group = moe_ep.EPGroup(node_size=node_size)
    H = 128
    x, idx, w = (t.to(group.device) for t in _to_every_rank_inputs(rank, world_size, M, H))
    want = (x.float() * w.sum(1, keepdim=True)).to(torch.bfloat16)  # identity experts
    res = {"rank": rank, "good": 0}
    buf = moe_ep.EPBuffer(group, 2 * world_size, H, M, 2, timeout_s=timeout_s)
    try:
        for call in range(good + 1):
            # The victim dies after its previous call returned, i.e. every write of that call is
            # counted on both sides; the pause lets its transport's acknowledgements go out.
            if rank == victim and call == good and when == "dispatch":
                time.sleep(0.3)
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.monotonic()
            h = buf.dispatch(x, idx, w)
            buf.synchronize()  # on a GPU the kernel's error surfaces here
            if rank == victim and call == good:
                time.sleep(0.3)
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.monotonic()
            out = buf.combine(h.expert_x, h)
            buf.synchronize()
            torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
            res["good"] += 1
        res["error"] = None
    except Exception as exc:  # noqa: BLE001
        res["error"] = _error_fields(exc, t0)
        try:
            buf.dispatch(x, idx, w)
            res["after"] = "no error"
        except moe_ep.BufferBrokenError:
            res["after"] = "BufferBrokenError"
    # At once: a slower survivor may notice this close before the killed rank's connections go,
    # and must still name the killed rank (the goodbye this close sends names it; ARCHITECTURE §10).
    buf.close()  # no collective: the process group lost a member
    return res


@pytest.mark.parametrize("when", ["dispatch", "combine"])
@pytest.mark.parametrize("R,node_size", [(3, 1), (4, 1), (4, 2)], ids=["3x1", "4x1", "2x2"])
def test_rank_killed_across_nodes(R, node_size, when):
    """A rank process killed (SIGKILL) mid-run, after two good dispatch/combine calls, before its
    third dispatch or between it and its combine: the survivors raise PeerLostError or
    CommTimeoutError naming that rank and the phase within the deadline, never hang, and the
    buffer is broken after. Every survivor closes its buffer as soon as it raised, so another may
    see that close before the killed rank's (2x2: rank 1 is rank 0's node peer)."""
    # 6 s: the two good calls of four ranks on a loaded 2-core machine stay well inside it; the
    # survivors' errors come from the lost connections at once (2x2: rank 0 names its node peer
    # at the deadline)
    victim, timeout_s = 1, 6.0
    got = dist_util.run_with_victim(R, victim, _killed_worker, victim, when, timeout_s, node_size, timeout=60)
    _check_survivors(got, R, victim, when, timeout_s + 3.0)


def _check_survivors(got, R, victim, when, within_s):
    """Every rank but ``victim`` had two good calls, then an error naming itself, the victim and the
    phase within ``within_s``, and a broken buffer after."""
    assert sorted(got) == [r for r in range(R) if r != victim]
    for r, res in got.items():
        err = res["error"]
        assert res["good"] == 2 and err is not None and "other" not in err, res
        assert err["type"] in ("PeerLostError", "CommTimeoutError"), res
        assert (err["rank"], err["peer"], err["phase"]) == (r, victim, when), res
        assert f"peer {victim}" in err["msg"] and f"rank {r}" in err["msg"], err["msg"]
        assert err["elapsed"] < within_s, res
        assert res["after"] == "BufferBrokenError", res


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["node", "across-nodes"])
@pytest.mark.parametrize("when", ["dispatch", "combine"])
def test_rank_killed_gpu(when, path):
    """The same on GPUs, R=2 (sharing one GPU where there is one): on the node path the survivor's
    kernel gives up at its deadline (the victim's memory stays mapped until the survivor closes);
    across nodes its proxy sees the connection drop or times out."""
    dist_util.need_gpu()
    R, victim, timeout_s = 2, 1, 4.0
    got = dist_util.run_with_victim(R, victim, _killed_worker, victim, when, timeout_s,
                                    R if path == "node" else 1, timeout=180, backend=dist_util.gpu_backend(R))
    _check_survivors(got, R, victim, when, timeout_s + 8.0)


# ---------------------------------------------------------------- launches, overlap, the proxy's order

class _CountingLauncher:
    """The buffer's launcher, counting the launches of each kernel (by name)."""

    def __init__(self, inner):
        self.inner, self.names = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, key, fn, grid, args, consts, dynamic=None):
        c = consts() if callable(consts) else consts
        self.names.append((fn.fn.__name__, c["SEND"], c["RECV"]) if "SEND" in c else fn.fn.__name__)
        return self.inner(key, fn, grid, args, consts, dynamic)


class _RecordingLauncher:
    """A launcher that records each launch as (kernel, SEND, RECV) and runs nothing (no plans)."""

    def __init__(self):
        self.names = []

    def __call__(self, key, fn, grid, args, consts, dynamic=None):
        c = consts()
        self.names.append((fn.fn.__name__, c["SEND"], c["RECV"]))

    def planned(self, key):
        return None


def _launches_worker(rank, world_size, node_size, direct_max):
    """Launches of one dispatch and one combine (checked), at decode sizes and, with
    ``direct_max`` lowered, with the routing histogram first (prefill's structure)."""
    import moe_ep
    import moe_ep.ops.dispatch

    kept = moe_ep.ops.dispatch.DIRECT_MAX  # (the pool's process runs later tests too)
    moe_ep.ops.dispatch.DIRECT_MAX = direct_max
    try:
        group = moe_ep.EPGroup(node_size=node_size)
        M, H = 4, 128
        x, idx, w = _to_every_rank_inputs(rank, world_size, M, H)
        want = (x.float() * w.sum(1, keepdim=True)).to(torch.bfloat16)  # identity experts
        with moe_ep.EPBuffer(group, 2 * world_size, H, M, 2, timeout_s=20.0) as buf:
            buf.calls.launch = la = _CountingLauncher(buf.calls.launch)
            h = buf.dispatch(x, idx, w)
            disp = list(la.names)
            out = buf.combine(h.expert_x, h)
            comb = la.names[len(disp):]
            torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
            return disp, comb
    finally:
        moe_ep.ops.dispatch.DIRECT_MAX = kept


@pytest.mark.parametrize("R,node_size", [(2, 1), (4, 2), (2, 2)], ids=["2x1", "2x2", "node"])
def test_launches_per_op(R, node_size):
    """Two launches per dispatch and per combine across nodes, as on the node path under the
    interpreter (send and receive halves; a GPU runs the node path's two as one): the inter-node
    kernels do the node stores, the pack for remote peers and its bells in the send half, and the
    waits, the count matrix, the node rows and the remote rows in the receive half. At prefill
    sizes the dispatch launches the routing histogram first (with its rank rows), on both paths."""
    across = node_size < R
    disp_k, comb_k = ("internode_dispatch_kernel", "internode_combine_kernel") if across else \
        ("node_dispatch_kernel", "node_combine_kernel")
    for direct_max, hist in ((2048, []), (0, ["route_hist_kernel"])):
        for disp, comb in dist_util.run(R, _launches_worker, node_size, direct_max, timeout=300):
            assert disp == hist + [(disp_k, True, False), (disp_k, False, True)], disp
            assert comb == [(comb_k, True, False), (comb_k, False, True)], comb


def _fused_launches_worker(rank, world_size, node_size):
    """The launches a GPU would make (recorded, not run: constexprs of a compiled kernel, no host
    waits) for one dispatch and one combine across nodes, without and with ``fused_internode``,
    and for a call with receive hooks with it; each launch as (kernel, SEND, RECV)."""
    import moe_ep

    group = moe_ep.EPGroup(node_size=node_size)
    M, H = 4, 128
    x, idx, w = _to_every_rank_inputs(rank, world_size, M, H)
    got = {}
    for name, fused, hooked in (("two", False, False), ("one", True, False), ("hooked", True, True)):
        with moe_ep.EPBuffer(group, 2 * world_size, H, M, 2, timeout_s=20.0,
                             tuning=moe_ep.Tuning(fused_internode=fused)) as buf:
            # as on a GPU whose SMs hold every program (the node ops fuse there too)
            buf.parts.tuning = buf.tuning.replace(fused=True, fused_internode=fused)
            buf.parts.interp, buf.calls.launch = False, _RecordingLauncher()
            names = buf.calls.launch.names
            if hooked:
                h, hook = buf.dispatch(x, idx, w, return_recv_hook=True)
                hook()
                disp = list(names)
                _, hook = buf.combine(h.expert_x, h, return_recv_hook=True)
                hook()
            else:
                h = buf.dispatch(x, idx, w)
                disp = list(names)
                buf.combine(h.expert_x, h)
            got[name] = (disp, names[len(disp):])
    return got


@pytest.mark.parametrize("R,node_size", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_fused_internode_launches_per_op(R, node_size):
    """With ``Tuning.fused_internode`` on a GPU whose SMs hold every program, one launch per
    inter-node dispatch and combine (both halves); without it two, as before; with a receive hook
    two (the hook's launch is the receive half) either way. Recorded as a GPU makes them, on CPU
    ranks (the interpreter runs programs one after another: it cannot run the fused form)."""
    for got in dist_util.run(R, _fused_launches_worker, node_size, timeout=300):
        for op, kernel in enumerate(("internode_dispatch_kernel", "internode_combine_kernel")):
            assert got["two"][op] == [(kernel, True, False), (kernel, False, True)], got
            assert got["one"][op] == [(kernel, True, True)], got
            assert got["hooked"][op] == [(kernel, True, False), (kernel, False, True)], got


def _fused_one_program_worker(rank, world_size, node_size, cases):
    """``run_calls`` of each case (one program a launch) with the inter-node ops fused, under the
    interpreter: one program has no other program to wait for, so its one launch runs both halves
    here too (its waits spin on the proxy's words, which the proxy thread raises). Returns
    failures, and the inter-node launches' halves seen."""
    import moe_ep
    from ep_cases import make_buffer

    group = moe_ep.EPGroup(node_size=node_size)
    fails, halves = [], set()
    for c in cases:
        with make_buffer(group, c, 30.0) as buf:
            buf.parts.tuning = buf.tuning.replace(fused_internode=True)
            buf.calls.launch = la = _CountingLauncher(buf.calls.launch)
            fails += run_calls(group, buf, c)
            halves |= {n for n in la.names if n[0].startswith("internode_")}
    return fails, halves


@pytest.mark.parametrize("R", [2, 3], ids=["2x1", "3x1"])
def test_fused_internode_one_program(R, node_size=1):
    """The fused inter-node kernels (both halves in one launch, each program's receive half after
    its whole send half, this rank's own counts derived per program) against the oracle, on CPU
    ranks of one program each: masked, packed and rows, bf16 and fp8. Nodes of one rank: the
    interpreter's wait for a node peer's flag looks once (the host waits for them between two
    launches), so 2 x 2 fused runs on GPUs only (tests/test_internode_gpu.py)."""
    cases = [Case(R=R, E=2 * R, K=2, dtype="bf16", layout="masked", programs=1, calls=("uniform", "skewed"), seed=71),
             Case(R=R, E=2 * R, K=3, dtype="fp8", layout="packed", align=16, programs=1, recv_rows="worst",
                  calls=("sparse", "uniform"), seed=72),
             Case(R=R, E=2 * R, K=2, dtype="fp8pre", layout="rows", programs=1, recv_rows="worst",
                  calls=("uniform", "none"), seed=73)]
    for fails, halves in dist_util.run(R, _fused_one_program_worker, node_size, cases, timeout=600):
        assert not fails, "\n".join(fails[:20])
        assert halves == {("internode_dispatch_kernel", True, True), ("internode_combine_kernel", True, True)}, halves


def _overlap_worker(rank, world_size, signal, late):
    """3 nodes of 1. Rank ``late``'s rows bells reach its proxy only once rank 0 has seen the other
    source's rows in its expert layout (its kernels ring a stand-in mailbox; a thread passes the
    header bell on at once, the rows bells when the file ``signal`` exists, or after 15 s, inside
    every deadline), so its rows to rank 0 land late while its header is in time. Rank 0 watches
    its expert layout during its dispatch: the other source's rows must be there while rank
    ``late``'s round-1 ready word is still down (and none of its rows). Then the results against
    the oracle."""
    import threading

    import moe_ep
    from moe_ep.native.protocol import MAILBOX, mailbox_word

    group = moe_ep.EPGroup(node_size=1)
    M, H, R = 4, 128, world_size
    x = torch.full((M, H), float(10 * (rank + 1)), dtype=torch.bfloat16) + torch.arange(M)[:, None]  # 10(r+1) + t
    idx = torch.tensor([[2 * 0 + (t % 2), 2 * ((rank + 1) % R)] for t in range(M)])  # each token: rank 0 and another
    w = torch.ones(M, 2)
    want = (x.float() * 2).to(torch.bfloat16)  # identity experts, weights summing to 2
    res = {"rank": rank}
    with moe_ep.EPBuffer(group, 2 * R, H, M, 2, timeout_s=20.0) as buf:
        rp = buf.remote
        stop = threading.Event()
        if rank == late:
            real, decoy = rp.mailbox, torch.zeros_like(rp.mailbox)
            args = rp.dispatch_args
            rp.dispatch_args = lambda: dict(args(), mb_ptr=decoy)  # (the dispatch's; the combine's stay real)
            bells = slice(mailbox_word("disp_bell", R, 0), mailbox_word("disp_bell", R, R))
            # what the proxy writes for the dispatch kernel, handed on to it as the proxy writes it
            words = [MAILBOX[n] for n in ("disp_ready", "hdr_ready", "err_code", "err_peer", "err_phase",
                                          "err_epoch", "ov_ready")] + \
                [mailbox_word(a, R, p) for a in ("ready1", "ready2") for p in range(R)]

            def relay():  # the proxy's words to the kernel as they come; the header bell at once, the rows bells late
                t0, late_ok = time.monotonic(), False
                while not stop.is_set():
                    decoy[words] = real[words]
                    if int(decoy[MAILBOX["hdr_bell"]]) >= 1:
                        real[MAILBOX["hdr_bell"]] = decoy[MAILBOX["hdr_bell"]]
                    late_ok = late_ok or os.path.exists(signal) or time.monotonic() - t0 > 15
                    if late_ok and int(decoy[bells][[p for p in range(R) if p != rank]].min()) >= 1:
                        real[bells] = decoy[bells]
                    time.sleep(1e-3)
            threading.Thread(target=relay, daemon=True).start()
        seen = []
        if rank == 0:
            buf.parts.memory.expert_x.fill_(float("nan"))
            ready_late = mailbox_word("ready1", R, late)

            def watch():  # which sources' rows are in the layout, while rank 2's are not yet landed
                while not stop.is_set():
                    if int(rp.mailbox[ready_late]) < 1:
                        v = buf.parts.memory.expert_x.float()
                        src = set(int(s) for s in (v[~v.isnan()] // 10 - 1).unique().tolist())
                        seen.append(src)
                        if 3 - late in src:
                            open(signal, "w").close()
                    time.sleep(2e-3)
            threading.Thread(target=watch, daemon=True).start()
        h = buf.dispatch(x, idx, w)
        out = buf.combine(h.expert_x, h)
        stop.set()
        res["ok"] = bool(torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2))
        res["seen"] = seen
    return res


@pytest.mark.parametrize("late", [2, 1], ids=["higher-rank-late", "lower-rank-late"])
def test_remote_sources_unpack_as_they_land(tmp_path, late):
    """A late remote source holds no other's rows back, whatever its rank: rank 0's receive half
    unpacks the other source's rows (their round-1 ready word is up) while the late one's have not
    landed (observed in the expert layout, not timed), and every result still equals the oracle.
    (A kernel that waits for the whole dispatch before unpacking fails both; one that unpacks the
    sources in rank order fails ``lower-rank-late``.)"""
    results = dist_util.run(3, _overlap_worker, str(tmp_path / "seen"), late, timeout=300)
    assert all(r["ok"] for r in results), results
    other, seen = 3 - late, results[0]["seen"]  # per look: the sources (0: own) whose rows were in the layout
    assert any(other in s for s in seen), f"rank {other}'s rows never seen while rank {late}'s were late: {seen[-20:]}"
    assert not any(late in s for s in seen), f"rank {late}'s rows in the layout before its ready word: {seen[-20:]}"


def _trace_worker(rank, world_size):
    import os

    import moe_ep

    os.environ["MOE_EP_PROXY_TRACE"] = "peers"  # bells and posts per peer

    group = moe_ep.EPGroup(node_size=1)
    M, H = 6, 128
    x, idx, w = _to_every_rank_inputs(rank, world_size, M, H)
    with moe_ep.EPBuffer(group, 2 * world_size, H, M, 2, timeout_s=20.0) as buf:
        h = buf.dispatch(x, idx, w)
        buf.combine(h.expert_x, h)
        return [(kind, peer) for _, kind, peer, epoch in buf.remote.proxy.trace() if epoch == 1]


def test_proxy_posts_rows_before_the_last_bell():
    """4 nodes of 1: the send half rings each remote peer's bell as soon as that peer's rows are
    packed, and the proxy posts them at once: on every rank the first round-1 rows write comes
    before the last peer's bell (the proxy's trace)."""
    for r, ev in enumerate(dist_util.run(4, _trace_worker, timeout=300)):
        bells = [i for i, (k, _) in enumerate(ev) if k == "rows_bell"]
        posts = [i for i, (k, _) in enumerate(ev) if k == "post_d1"]
        assert len(bells) == 3 and posts, (r, ev)
        assert posts[0] < bells[-1], (r, ev)
        assert ev.index(("hdr_bell", -1)) < min(i for i, (k, _) in enumerate(ev) if k == "post_d0"), (r, ev)
