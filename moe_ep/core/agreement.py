"""Agreement at construction: every rank's arguments compared, and failures shared, with a deadline.

A collective object (``EPBuffer``) is built by every rank of a group with what must be the same
arguments. A rank whose arguments are refused must not leave the others blocked in a collective,
and arguments that differ across ranks must not give wrong answers later. So every rank, whether
its own checks passed or not, takes part in one exchange before any memory is allocated: it
publishes ``ok`` with a signature of its arguments, or its error, under a key of the process
group's key-value store, then waits (with a deadline) for every rank's key. Every rank then
raises the same way: the failing rank its own error, the others a ``RuntimeError`` naming it;
differing arguments a ``ValueError`` naming the argument and each rank's value; a rank that never
arrives a ``CommTimeoutError`` naming it. The store (not a gloo/NCCL collective) is what gives
every wait a deadline and tells who did not arrive.

Keys: ``moe_ep/<what>/<n>/<phase>/<rank>``, with ``n`` counting the constructions on that process
group in this process (every rank constructs in the same order, as for any collective).
"""
from __future__ import annotations

import datetime
import functools
import pickle
from typing import Any, Callable, Dict, List, Optional, Tuple

from .errors import CommTimeoutError

_SEQ: Dict[Any, int] = {}  # process group -> constructions started on it in this process


def _store_of(pg):
    """The process group's own key-value store (prefixed per group). torch has no public accessor;
    ``_get_process_group_store`` reads the map torch keeps of every group it created."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_process_group_store(pg)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _group_by_value(values: List[Any]) -> str:
    """'128 on rank 0, 256 on ranks [1, 2]'."""
    by: Dict[str, List[int]] = {}
    for r, v in enumerate(values):
        by.setdefault(repr(v), []).append(r)
    return ", ".join(f"{v} on rank {rs[0]}" if len(rs) == 1 else f"{v} on ranks {rs}" for v, rs in by.items())


def mismatch(signatures: List[Dict[str, Any]]) -> Optional[str]:
    """The message for the first argument whose value differs across ``signatures`` (one dict per
    rank, the same keys in the same order), or None when all agree."""
    for name in signatures[0]:
        values = [s.get(name) for s in signatures]
        if any(v != values[0] for v in values):
            return f"{name}: expected the same value on every rank, got {_group_by_value(values)}"
    return None


class Agreement:
    """One construction's exchanges on ``group`` (an ``EPGroup``); a no-op for a single rank.

    ``agree(signature, timeout_s)`` publishes ``ok`` and this rank's signature and checks every
    rank's; ``fail(exc)`` publishes this rank's error instead (without waiting); ``done(timeout_s)``
    is a barrier with a deadline that ends construction."""

    def __init__(self, group, what: str):
        self.what = what
        pg = getattr(group, "pg", None)
        self.rank = getattr(group, "rank", 0)
        self.world_size = getattr(group, "world_size", 1)
        self.store = _store_of(pg) if pg is not None and self.world_size > 1 else None
        self.phase = "args"
        if self.store is not None:
            n = _SEQ.get(pg, 0)
            _SEQ[pg] = n + 1
            self.prefix = f"moe_ep/{what}/{n}"

    def _key(self, phase: str, rank: int) -> str:
        return f"{self.prefix}/{phase}/{rank}"

    def _publish(self, value: Tuple[str, Any]) -> None:
        self.store.set(self._key(self.phase, self.rank), pickle.dumps(value))

    def fail(self, exc: BaseException) -> None:
        """Tells the other ranks that this rank's construction raised ``exc`` (in the current
        phase); they raise instead of waiting for it."""
        if self.store is not None:
            try:
                self._publish(("error", _describe(exc)))
            except Exception:  # noqa: BLE001 - the store itself is gone: the original error matters
                pass

    def _gather(self, value: Any, timeout_s: float) -> List[Any]:
        """Publishes ``("ok", value)`` and returns every rank's value, or raises (see the module doc)."""
        self._publish(("ok", value))
        keys = [self._key(self.phase, r) for r in range(self.world_size)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except RuntimeError:  # DistStoreError: not every key arrived in time
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            if missing:  # raised, hence published (collective_init): a late rank does not go on alone
                raise CommTimeoutError(
                    self.rank, missing[0], f"{self.what} construction", 0, timeout_s,
                    message=f"rank {self.rank}: rank(s) {missing} did not reach {self.what} construction "
                            f"({self.phase}) within {timeout_s:g} s (they raised before taking part, are "
                            f"stuck or dead, or construct something else)") from None
        got = [pickle.loads(v) for v in self.store.multi_get(keys)]
        errors = [(r, msg) for r, (status, msg) in enumerate(got) if status != "ok"]
        if errors:
            text = "; ".join(f"rank {r}: {msg}" for r, msg in errors)
            raise RuntimeError(f"rank {self.rank}: {self.what} construction failed on rank(s) "
                               f"{[r for r, _ in errors]}: {text}")
        return [v for _, v in got]

    def agree(self, signature: Dict[str, Any], timeout_s: float) -> None:
        """Raises unless every rank passed its own checks and has the same ``signature`` (plain
        values keyed by argument name) within ``timeout_s``."""
        if self.store is None:
            return
        msg = mismatch(self._gather(signature, timeout_s))
        self.phase = "done"
        if msg is not None:
            raise ValueError(msg)

    def done(self, timeout_s: float) -> None:
        """A barrier with a deadline at the end of construction (errors as for ``agree``); then
        this rank's key of the argument exchange is removed (every rank has read it)."""
        if self.store is None:
            return
        self._gather(None, timeout_s)
        self.store.delete_key(self._key("args", self.rank))


def collective_init(what: str) -> Callable:
    """Decorator of ``__init__(self, group, ...)`` of a collective object: sets ``self._agreement``
    (an :class:`Agreement` on ``group``) before the body runs, and publishes any exception the body
    raises to the other ranks before re-raising it."""
    def wrap(init: Callable) -> Callable:
        @functools.wraps(init)
        def wrapper(self, group, *args, **kwargs):
            self._agreement = Agreement(group, what)
            try:
                init(self, group, *args, **kwargs)
            except BaseException as exc:
                self._agreement.fail(exc)
                raise
        return wrapper
    return wrap
