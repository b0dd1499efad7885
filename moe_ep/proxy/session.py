"""Starting a rank's proxy from an ``EPGroup``: engine, regions, endpoint exchange, thread.

The endpoints travel through the group's process group (``all_gather_object``), so a job needs
nothing beyond what ``torch.distributed`` already set up. The transport comes from
``MOE_EP_TRANSPORT`` (``auto`` | ``verbs`` | ``tcp``; ``efa`` is not implemented yet): ``auto``
takes verbs when every rank has a usable verbs device, else tcp, and rank 0 logs which and why.
"""
from __future__ import annotations

import logging
import math
import os
import socket
from typing import Optional

from ..group import EPGroup
from .native import Engine, NativeError, Proxy, TcpTransport, VerbsTransport, verbs_probe

TRANSPORTS = ("auto", "verbs", "tcp", "efa")
_log = logging.getLogger(__name__)


def default_private_capacity(max_tokens: int, topk: int, num_experts: int, world_size: int) -> int:
    """Round-1 rows per (source, remote peer): the rows a peer gets from one source under uniform
    routing (a token touches a rank with probability 1 - C(E - E/R, K) / C(E, K)), plus 25% and 8
    rows of headroom, at most ``max_tokens``. Larger batches spill into round 2, not into errors."""
    el = num_experts // world_size
    k = min(topk, num_experts)
    miss = 1.0
    for i in range(k):  # C(E - EL, K) / C(E, K) as a product, exact for integer K
        miss *= max(0.0, (num_experts - el - i) / (num_experts - i))
    return min(max_tokens, int(math.ceil(1.25 * max_tokens * (1.0 - miss))) + 8)


def _bind_host(group: EPGroup) -> str:
    if os.environ.get("MOE_EP_TCP_HOST"):
        return os.environ["MOE_EP_TCP_HOST"]
    hosts = group.all_gather_object(socket.gethostname())
    if len(set(hosts)) == 1:
        return "127.0.0.1"  # one host: stay on loopback
    return socket.gethostbyname(socket.gethostname())


def select_transport(name: Optional[str] = None) -> tuple[str, str]:
    """This rank's transport and why: ``name`` (default ``MOE_EP_TRANSPORT``, else ``auto``).
    ``auto``: verbs when a verbs device is usable here, else tcp. Asking for ``verbs`` where none
    is usable, for ``efa``, or for an unknown name raises ``NativeError`` / ``ValueError``."""
    want = (name or os.environ.get("MOE_EP_TRANSPORT") or "auto").strip().lower()
    if want not in TRANSPORTS:
        raise ValueError(f"MOE_EP_TRANSPORT={want!r}: expected one of {', '.join(TRANSPORTS)}")
    if want == "efa":
        raise NativeError("MOE_EP_TRANSPORT=efa: efa: not implemented yet (use verbs or tcp)")
    if want == "tcp":
        return "tcp", "MOE_EP_TRANSPORT=tcp"
    ok, what = verbs_probe()
    if want == "verbs":
        if not ok:
            raise NativeError(f"MOE_EP_TRANSPORT=verbs, but no verbs device is usable: {what}")
        return "verbs", f"MOE_EP_TRANSPORT=verbs: {what}"
    return ("verbs", f"auto: verbs {what}") if ok else ("tcp", f"auto: no verbs device ({what})")


def _agreed_transport(group: EPGroup, name: Optional[str]) -> str:
    """Every rank's choice, gathered: auto falls back to tcp unless every rank can use verbs; a
    rank that cannot start the transport it was asked for fails every rank (none waits alone)."""
    try:
        kind, why = select_transport(name)
        err: Optional[Exception] = None
    except (NativeError, ValueError) as e:
        kind, why, err = "", str(e), e
    choices = group.all_gather_object((kind, why))
    failed = [r for r, (k, _) in enumerate(choices) if not k]
    if failed:
        if err is not None:
            raise err
        raise NativeError(f"rank {group.rank}: rank {failed[0]} cannot start its transport: {choices[failed[0]][1]}")
    kinds = {k for k, _ in choices}
    if len(kinds) > 1:
        bad = next(r for r, (k, _) in enumerate(choices) if k != "verbs")
        kind, why = "tcp", f"auto: rank {bad} has no verbs device ({choices[bad][1]})"
    if group.rank == 0:
        _log.info("moe_ep proxy transport: %s (%s)", kind, why)
    return kind


def start_proxy(group: EPGroup, *, num_local_experts: int, row_bytes: int, comb_row_bytes: int,
                private_capacity: int, overflow_capacity: int, max_send_rows: int, timeout_s: float = 30.0,
                streams: int = 4, bind_host: Optional[str] = None, transport: Optional[str] = None,
                regions: Optional[dict] = None, mailbox=None) -> Proxy:
    """Creates this rank's engine (``transport``, default ``MOE_EP_TRANSPORT``: see
    ``select_transport``) and §10 proxy, exchanges endpoints over ``group`` (collective:
    every rank calls it with the same sizes), connects, and starts the proxy thread.

    ``bind_host``: the address peers reach this rank at (default ``MOE_EP_TCP_HOST``, else loopback
    when every rank shares this host, else this host's address). ``regions`` / ``mailbox``: the
    memory to use (``Proxy``'s arguments; default: numpy arrays it allocates).
    """
    engine: Engine
    if _agreed_transport(group, transport) == "verbs":
        engine = VerbsTransport(group.rank, group.world_size)
    else:
        engine = TcpTransport(group.rank, group.world_size, streams=streams, bind_host=bind_host or _bind_host(group))
    proxy = Proxy(engine, node_size=group.node_size, num_local_experts=num_local_experts, row_bytes=row_bytes,
                  comb_row_bytes=comb_row_bytes, private_capacity=private_capacity,
                  overflow_capacity=overflow_capacity, max_send_rows=max_send_rows, timeout_s=timeout_s,
                  regions=regions, mailbox=mailbox)
    engine.connect(group.all_gather_object(engine.endpoint), timeout_s)
    proxy.start()
    return proxy
