"""Node-symmetric memory: one byte buffer per rank that every rank of the node can address.

GPU: torch symmetric memory (CUDA backend, multicast off) over the node's process group; each
rank gets device pointers to its node peers' buffers, and Triton kernels store into them over
NVLink. With ``node_size == 1`` there is nothing to map: plain device memory.
CPU: one shared-memory segment per rank under /dev/shm, mapped by every rank process of the node;
the same Triton kernels (TRITON_INTERPRET=1) store into them through raw addresses.
"""
from __future__ import annotations

import os
import uuid
from typing import List

import torch
import torch.distributed as dist

from .group import EPGroup


class SymmetricWorkspace:
    """``nbytes`` zeroed bytes on every rank of the node, mapped by all of them.

    Attributes:
        local: uint8 ``[nbytes]`` tensor on ``group.device``: this rank's buffer.
        peer_ptrs: int64 ``[node_size]`` tensor on ``group.device``: the address, valid in this
            process, of each node peer's buffer (index = rank within the node).
    """

    def __init__(self, group: EPGroup, nbytes: int):
        self.group, self.nbytes = group, int(nbytes)
        self._handle = None
        self._views: List[torch.Tensor] = []
        if group.device.type == "cuda":
            self._init_cuda()
        else:
            self._init_shm()
        self.peer_ptrs = torch.tensor(self._ptrs, dtype=torch.int64, device=group.device)

    def _init_cuda(self) -> None:
        g = self.group
        if g.node_size == 1:  # no node peers: plain device memory (other nodes go through the proxy)
            self.local = torch.zeros(self.nbytes, dtype=torch.uint8, device=g.device)
            self._ptrs = [self.local.data_ptr()]
            return
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem
        try:
            symm_mem.set_backend("CUDA")
        except Exception:  # older torch: CUDA is the only backend
            pass
        self.local = symm_mem.empty(self.nbytes, dtype=torch.uint8, device=g.device)
        self.local.zero_()
        torch.cuda.synchronize(g.device)
        self._handle = symm_mem.rendezvous(self.local, group=g.node_group())
        self._ptrs = [int(p) for p in self._handle.buffer_ptrs]
        g.barrier()

    def _init_shm(self) -> None:
        g = self.group
        tag = g.all_gather_object(uuid.uuid4().hex)[0]
        node0 = g.rank - g.rank % g.node_size
        paths = [f"/dev/shm/moe_ep_{tag}_{r}" for r in range(g.world_size)]
        fd = os.open(paths[g.rank], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, max(self.nbytes, 1))  # a new file reads as zeros
        finally:
            os.close(fd)
        g.barrier()
        try:  # only the ranks of this node map each other's segment
            self._views = [torch.from_file(paths[node0 + i], shared=True, size=max(self.nbytes, 1), dtype=torch.uint8)
                           for i in range(g.node_size)]
        finally:
            g.barrier()
            os.unlink(paths[g.rank])  # mappings stay valid; nothing is left in /dev/shm
        self.local = self._views[g.rank - node0][: self.nbytes]
        self._ptrs = [v.data_ptr() for v in self._views]

    def close(self) -> None:
        """Drops this rank's references; the memory goes when every rank has closed."""
        self._views = []
        self._handle = None
        self.local = None  # type: ignore[assignment]
