"""Starting a rank's proxy from an ``EPGroup``: engine, regions, endpoint exchange, thread.

The endpoints travel through the group's process group (``all_gather_object``), so a job needs
nothing beyond what ``torch.distributed`` already set up.
"""
from __future__ import annotations

import math
import os
import socket
from typing import Optional

from ..group import EPGroup
from .native import Proxy, TcpTransport


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


def start_proxy(group: EPGroup, *, num_local_experts: int, row_bytes: int, comb_row_bytes: int,
                private_capacity: int, overflow_capacity: int, max_send_rows: int, timeout_s: float = 30.0,
                streams: int = 4, bind_host: Optional[str] = None) -> Proxy:
    """Creates this rank's TCP engine and §10 proxy, exchanges endpoints over ``group`` (collective:
    every rank calls it with the same sizes), connects, and starts the proxy thread.

    ``bind_host``: the address peers reach this rank at (default ``MOE_EP_TCP_HOST``, else loopback
    when every rank shares this host, else this host's address).
    """
    engine = TcpTransport(group.rank, group.world_size, streams=streams, bind_host=bind_host or _bind_host(group))
    proxy = Proxy(engine, node_size=group.node_size, num_local_experts=num_local_experts, row_bytes=row_bytes,
                  comb_row_bytes=comb_row_bytes, private_capacity=private_capacity,
                  overflow_capacity=overflow_capacity, max_send_rows=max_send_rows, timeout_s=timeout_s)
    engine.connect(group.all_gather_object(engine.endpoint), timeout_s)
    proxy.start()
    return proxy
