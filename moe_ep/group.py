"""EPGroup: the ranks taking part in expert parallelism, their node structure and device."""
from __future__ import annotations

import os
import socket
from typing import Optional

import torch
import torch.distributed as dist


class EPGroup:
    """Wraps a ``torch.distributed`` process group for expert parallelism.

    Args:
        pg: the process group; ``None`` means WORLD when torch.distributed is initialised,
            and a single rank (R=1) when it is not.
        node_size: ranks per node (sharing NVLink on GPU, shared memory on CPU). Default: the
            ranks on this host, or ``MOE_EP_NODE_SIZE`` when set.

    Attributes:
        rank, world_size: this rank and R within ``pg``.
        node_size: ranks per node; ranks ``[n*node_size, (n+1)*node_size)`` form node ``n``.
        device: ``cuda:<local rank>`` when the backend is NCCL (or R=1 with a GPU), else ``cpu``.
    """

    def __init__(self, pg: Optional[dist.ProcessGroup] = None, node_size: Optional[int] = None):
        if pg is None and dist.is_available() and dist.is_initialized():
            pg = dist.group.WORLD
        self.pg = pg
        if pg is None:
            self.rank, self.world_size = 0, 1
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        else:
            self.rank, self.world_size = dist.get_rank(pg), dist.get_world_size(pg)
            backend = str(dist.get_backend(pg)).lower()
        self.backend = backend
        if "nccl" in backend:
            local = int(os.environ.get("LOCAL_RANK", self.rank % max(1, torch.cuda.device_count())))
            self.device = torch.device("cuda", local)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.node_size = self._node_size(node_size)

    def _node_size(self, node_size: Optional[int]) -> int:
        if node_size is None and os.environ.get("MOE_EP_NODE_SIZE"):
            node_size = int(os.environ["MOE_EP_NODE_SIZE"])
        if node_size is None:
            if self.pg is None:
                node_size = 1
            else:
                hosts = [None] * self.world_size
                dist.all_gather_object(hosts, socket.gethostname(), group=self.pg)
                node_size = hosts.count(hosts[0])
        if node_size < 1 or self.world_size % node_size != 0:
            raise ValueError(f"node_size: expected a divisor of world_size={self.world_size}, got {node_size}")
        return node_size

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.node_size

    def barrier(self) -> None:
        """Blocks until every rank of the group reaches it (no-op for R=1)."""
        if self.pg is not None and self.world_size > 1:
            if "nccl" in self.backend:
                dist.barrier(group=self.pg, device_ids=[self.device.index])
            else:
                dist.barrier(group=self.pg)

    def all_gather_object(self, obj):
        """Returns ``[obj from rank 0, ..., obj from rank R-1]``."""
        if self.pg is None or self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def __repr__(self) -> str:
        return (f"EPGroup(rank={self.rank}, world_size={self.world_size}, node_size={self.node_size}, "
                f"device={self.device})")
