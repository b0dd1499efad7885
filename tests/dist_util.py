"""Multi-process runner for tests: persistent pools of rank processes, one pool per (R, backend).

``run(R, fn, *args)`` calls the module-level function ``fn(rank, world_size, *args)`` on every rank
of a pool of R processes that share an initialised ``torch.distributed`` process group, and returns
the list of the ranks' return values. An exception in a rank is re-raised in the caller as
:class:`RankError` carrying the rank's traceback text. Every call has a deadline: a rank that does
not answer in time (a hang in the code under test) fails the call, and the pool is killed and
started afresh on the next call; so is a pool in which a process died.

Backends:
- ``"gloo"``: CPU ranks, ``TRITON_INTERPRET=1`` is set in each process before triton is imported.
- ``"nccl"``: one GPU per rank (``cuda:<rank>``), ``LOCAL_RANK`` set, ``TRITON_INTERPRET`` removed.
- ``"gloo-cuda"``: a gloo group on GPU processes (``TRITON_INTERPRET`` removed, ``LOCAL_RANK`` and
  ``MOE_EP_DEVICE=cuda`` set): ``EPGroup()`` puts rank r on ``cuda:<r % GPUs>``, so ranks share GPUs
  when there are fewer GPUs than ranks (NCCL refuses that). ``gpu_backend(R)`` picks ``nccl`` when
  every rank can have its own GPU, else this.

Workers start with the spawn method, so ``fn`` and its arguments must be picklable (module-level
functions of importable modules; tensors are fine but small plain data is cheaper).
"""
from __future__ import annotations

import atexit
import faulthandler
import os
import pickle
import queue
import re
import socket
import time
import traceback
from typing import Any, Dict, List, Optional, Tuple

import torch.multiprocessing as mp

ERROR_GRACE_S = 60.0  # after a rank's error, how long the others may still take
DEFAULT_TIMEOUT_S = float(os.environ.get("MOE_EP_TEST_RUN_TIMEOUT", "600"))
_START_TIMEOUT_S = 180.0


class RankError(AssertionError):
    """A rank raised; ``rank``, ``exc_type`` (name) and ``remote_traceback`` (text) say where and what."""

    def __init__(self, rank: int, exc_type: str, message: str, remote_traceback: str):
        self.rank, self.exc_type, self.remote_traceback = rank, exc_type, remote_traceback
        super().__init__(f"rank {rank} raised {exc_type}: {message}\n--- traceback on rank {rank} ---\n"
                         f"{remote_traceback}")


class RunTimeout(AssertionError):
    """Some ranks did not answer within the call's deadline (the pool has been killed)."""


class PoolDied(AssertionError):
    """A rank process exited during a call (the pool has been killed)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, backend: str, port: int, tasks, results) -> None:
    faulthandler.enable()  # a rank that dies of a signal prints its Python stack (the parent sees only -11)
    # The environment must be right before torch/triton (and the code under test) are imported.
    if backend == "gloo":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
        os.environ["LOCAL_RANK"] = str(rank)
        if backend == "gloo-cuda":
            os.environ["MOE_EP_DEVICE"] = "cuda"
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        kwargs = {}
        if backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", rank)
        dist.init_process_group("gloo" if backend == "gloo-cuda" else backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=120), **kwargs)
        results.put(("ready", rank, True, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put(("ready", rank, False, (type(exc).__name__, str(exc), traceback.format_exc())))
        return
    # DIST_UTIL_STACKS_S=N: a rank whose call runs over N seconds prints its Python stacks.
    stacks_after_s = float(os.environ.get("DIST_UTIL_STACKS_S", "0"))
    while True:
        item = tasks.get()
        if item is None:
            break
        call_id, payload = item
        if stacks_after_s:  # where each rank is when a call hangs (stderr, before the timeouts fire)
            faulthandler.dump_traceback_later(stacks_after_s)
        try:
            fn, args, kwargs = pickle.loads(payload)  # here, so an import error is reported, not fatal
            value = fn(rank, world_size, *args, **kwargs)
            results.put((call_id, rank, True, value))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            results.put((call_id, rank, False, (type(exc).__name__, str(exc), traceback.format_exc())))
        finally:
            if stacks_after_s:
                faulthandler.cancel_dump_traceback_later()
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def _consequence(name: str, msg: str) -> bool:
    """Whether an error is what a rank gets when a peer failed: our timeouts, a broken buffer, a
    collective that timed out or lost its peer."""
    return name in ("CommTimeoutError", "BufferBrokenError") or (
        "gloo" in msg and ("Timed out" in msg or "Connection closed" in msg))


class Pool:
    """R rank processes with an initialised process group; see the module docstring."""

    def __init__(self, world_size: int, backend: str = "gloo"):
        self.world_size, self.backend = world_size, backend
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        port = _free_port()
        self._procs = [ctx.Process(target=_worker, args=(r, world_size, backend, port, self._tasks[r], self._results),
                                   daemon=True, name=f"moe_ep-test-rank{r}")
                       for r in range(world_size)]
        self._call_id = 0
        self.alive = True
        for p in self._procs:
            p.start()
        ready = self._collect("ready", _START_TIMEOUT_S)
        bad = [(r, v) for r, (ok, v) in sorted(ready.items()) if not ok]
        if bad:
            self.kill()
            r, (name, msg, tb) = bad[0]
            raise RankError(r, name, f"process group set-up failed: {msg}", tb)

    def _collect(self, call_id, timeout_s: float) -> Dict[int, Tuple[bool, Any]]:
        got: Dict[int, Tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout_s
        erred = False
        while len(got) < self.world_size:
            if not erred and any(not ok for ok, _ in got.values()):
                # A rank raised: the others usually wait for it in a collective, so they get a grace,
                # not the whole deadline (then the pool goes and the error is reported as the cause).
                erred, deadline = True, min(deadline, time.monotonic() + ERROR_GRACE_S)
            try:
                cid, rank, ok, value = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in got]
                if dead:
                    codes = {r: self._procs[r].exitcode for r in dead}
                    self.kill()
                    raise PoolDied(f"rank process(es) {dead} exited (exit codes {codes}) during the call; "
                                   f"answered: {sorted(got)}")
                if time.monotonic() > deadline and erred:
                    self.kill()
                    return got  # (run raises the error that came; the pool restarts at the next run)
                if time.monotonic() > deadline:
                    missing = [r for r in range(self.world_size) if r not in got]
                    early = {r: v for r, v in got.items()}
                    self.kill()
                    msg = f"ranks {missing} did not finish within {timeout_s:g} s (pool killed)"
                    errs = [(r, v[1]) for r, v in sorted(early.items()) if not v[0]]
                    if errs:
                        r, (name, m, tb) = errs[0]
                        msg += f"; meanwhile rank {r} raised {name}: {m}\n{tb}"
                    raise RunTimeout(msg)
                continue
            if cid == call_id:
                got[rank] = (ok, value)
        return got

    def run(self, fn, *args, timeout: Optional[float] = None, **kwargs) -> List[Any]:
        if not self.alive:
            raise RuntimeError("pool is dead")
        self._call_id += 1
        payload = pickle.dumps((fn, args, kwargs))
        for q in self._tasks:
            q.put((self._call_id, payload))
        got = self._collect(self._call_id, DEFAULT_TIMEOUT_S if timeout is None else timeout)
        errors = [(r, v) for r, (ok, v) in got.items() if not ok]  # in the order they arrived
        if errors:
            # Report the root cause: a peer's timeout (ours, or a collective's) is usually the
            # consequence of another rank's error; otherwise the error that came first.
            errors.sort(key=lambda rv: _consequence(*rv[1][:2]))
            r, (name, msg, tb) = errors[0]
            others = ", ".join(f"rank {q}: {v[0]}: {v[1][:300]}" for q, v in errors[1:])
            silent = [q for q in range(self.world_size) if q not in got]
            if silent:
                others += (", " if others else "") + f"ranks {silent}: no answer {ERROR_GRACE_S:g} s after it (pool killed)"
            raise RankError(r, name, msg + (f" (also {others})" if others else ""), tb)
        return [got[r][1] for r in range(self.world_size)]

    def close(self, grace_s: float = 10.0) -> None:
        if not self.alive:
            return
        for q in self._tasks:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        deadline = time.monotonic() + grace_s
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Ends this pool's processes (each by its own handle) and marks the pool dead."""
        self.alive = False
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)


_pools: Dict[Tuple[int, str], Pool] = {}


def get_pool(world_size: int, backend: str = "gloo") -> Pool:
    key = (world_size, backend)
    pool = _pools.get(key)
    if pool is None or not pool.alive or any(not p.is_alive() for p in pool._procs):
        if pool is not None:
            pool.kill()
        pool = _pools[key] = Pool(world_size, backend)
    return pool


def run(world_size: int, fn, *args, timeout: Optional[float] = None, backend: str = "gloo", **kwargs) -> List[Any]:
    """Runs ``fn(rank, world_size, *args, **kwargs)`` on every rank of the (R, backend) pool; see module doc."""
    return get_pool(world_size, backend).run(fn, *args, timeout=timeout, **kwargs)


def shutdown() -> None:
    for key in list(_pools):
        _pools.pop(key).close()


atexit.register(shutdown)


def run_with_victim(R: int, victim: int, fn, *args, timeout: float, backend: str = "gloo") -> Dict[int, Any]:
    """``run`` for a call in which rank ``victim`` kills its own process (SIGKILL): returns the other
    ranks' values, failing if one raised or did not answer within ``timeout`` (a hang). The pool
    (whose process group lost a member) is killed afterwards; the next run starts a fresh one."""
    import signal

    pool = get_pool(R, backend)
    pool._call_id += 1
    payload = pickle.dumps((fn, args, {}))
    for q in pool._tasks:
        q.put((pool._call_id, payload))
    got: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < R - 1:
            try:
                cid, rank, ok, value = pool._results.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(R)) - set(got) - {victim})
                raise AssertionError(f"ranks {missing} did not answer within {timeout} s (hang)") from None
            if cid != pool._call_id:
                continue
            if not ok:
                raise RankError(rank, *value)
            assert rank != victim, f"the victim answered: {value}"
            got[rank] = value
        pool._procs[victim].join(10)
        assert pool._procs[victim].exitcode == -signal.SIGKILL, pool._procs[victim].exitcode
    finally:
        pool.kill()
    return got


def gpu_backend(R: int) -> str:
    """``nccl`` when there are at least R GPUs (a rank per GPU), else ``gloo-cuda`` (ranks share them)."""
    return "nccl" if cuda_device_count() >= R else "gloo-cuda"


def need_gpu() -> int:
    """The number of GPUs; skips the calling test when there is none."""
    n = cuda_device_count()
    if n < 1:
        import pytest

        pytest.skip("needs a CUDA GPU")
    return n


def cuda_device_count() -> int:
    """GPUs visible to this process, without initialising CUDA here (spawned workers do that)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def expect_error(log: List[str], what: str, fn, words, types=(ValueError, TypeError)) -> None:
    """Appends to ``log`` unless ``fn()`` raises one of ``types`` whose message names one of
    ``words`` (each a whole word or phrase): what a rank's refusal checks collect and return."""
    try:
        fn()
    except types as exc:
        if not any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(w)}(?![A-Za-z0-9_])", str(exc)) for w in words):
            log.append(f"{what}: {type(exc).__name__} does not name {' or '.join(words)}: {exc}")
    except Exception as exc:  # noqa: BLE001
        names = "/".join(t.__name__ for t in types)
        log.append(f"{what}: raised {type(exc).__name__} (expected {names}): {exc}")
    else:
        log.append(f"{what}: did not raise")
