"""Node memory: one byte buffer per rank that every rank of the node can address.

Four backends, chosen per buffer by ``select_node_memory`` (every rank of a node picks the same):

- ``symm``: torch symmetric memory (CUDA backend, multicast off) over the node's process group,
  when every rank of the node has its own GPU; Triton kernels store into peers over NVLink.
- ``ipc``: plain device memory (``cudaMalloc``) shared with legacy CUDA IPC (cupy's runtime
  binding): each rank exports a handle, the node's ranks exchange them, each opens its peers'. It
  serves ranks that share one GPU (symmetric memory refuses them) and torch builds whose
  symmetric memory is missing or does not rendezvous.
- ``local``: no node peers (``node_size == 1``): plain device memory (other nodes go through the proxy).
- ``shm`` (CPU): one shared-memory segment per rank under /dev/shm, mapped by every rank process of
  the node; the same Triton kernels (TRITON_INTERPRET=1) store into them through raw addresses.
"""
from __future__ import annotations

import atexit
import logging
import os
import uuid
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from . import settings
from .group import EPGroup

_log = logging.getLogger(__name__)
BACKENDS = settings.NODE_MEMORY  # what MOE_EP_NODE_MEMORY may force


class SymmetricWorkspace:
    """``nbytes`` zeroed bytes on every rank of the node, mapped by all of them.

    Attributes:
        local: uint8 ``[nbytes]`` tensor on ``group.device``: this rank's buffer.
        peer_ptrs: int64 ``[node_size]`` tensor on ``group.device``: the address, valid in this
            process, of each node peer's buffer (index = rank within the node).
        backend: ``"symm"``, ``"ipc"``, ``"local"`` or ``"shm"``; ``why``: the reason, for logs.
    """

    def __init__(self, group: EPGroup, nbytes: int):
        self.group, self.nbytes = group, int(nbytes)
        self._handle = None
        self._ipc: Optional[IpcMemory] = None
        self._views: List[torch.Tensor] = []
        self.backend, self.why = select_node_memory(group)
        if self.backend == "shm":
            self._init_shm()
        elif self.backend == "local":
            self.local = torch.zeros(self.nbytes, dtype=torch.uint8, device=group.device)
            self._ptrs = [self.local.data_ptr()]
        elif self.backend == "symm":
            self._init_symm()
        else:
            self._init_ipc()
        self.peer_ptrs = torch.tensor(self._ptrs, dtype=torch.int64, device=group.device)

    def _init_symm(self) -> None:
        """Torch symmetric memory; if the rendezvous fails on any rank of the node, every rank of it
        falls back to IPC (the outcome is agreed over the node group, so none is left waiting)."""
        g = self.group
        err = None
        try:
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
        except Exception as exc:  # noqa: BLE001 - agreed on below
            err = f"{type(exc).__name__}: {exc}"
        errs = _node_gather(g, err)
        if any(errs):
            r, e = next((g.rank - g.rank % g.node_size + i, e) for i, e in enumerate(errs) if e)
            self._handle, self.local = None, None  # type: ignore[assignment]
            self.backend, self.why = "ipc", f"symmetric memory failed on rank {r} ({e.splitlines()[0][:200]})"
            _log.warning("moe_ep: %s; using CUDA IPC node memory", self.why)
            self._init_ipc()
            return
        g.barrier()

    def _init_ipc(self) -> None:
        self._ipc = IpcMemory(self.group, self.nbytes)
        self.local = self._ipc.local
        self._ptrs = self._ipc.peer_ptrs

    def _init_shm(self) -> None:
        g = self.group
        self._views = map_node_files(g, "ws", max(self.nbytes, 1))
        self.local = self._views[g.rank % g.node_size][: self.nbytes]
        self._ptrs = [v.data_ptr() for v in self._views]

    def close(self) -> None:
        """Drops this rank's references; IPC: unmaps the peers' memory now and frees this rank's
        once every node peer has unmapped it (or exited). Not collective: ranks may close in any
        order. Call it after the device is done with the buffer."""
        if self._ipc is not None:
            self._ipc.close()
            self._ipc = None
        self._views = []
        self._handle = None
        self.local = None  # type: ignore[assignment]


# ----------------------------------------------------------------------------- selection

def select_node_memory(group: EPGroup) -> Tuple[str, str]:
    """``(backend, why)`` for a workspace of ``group``'s node: ``shm`` on CPU, ``local`` without node
    peers, else ``MOE_EP_NODE_MEMORY`` (``symm`` / ``ipc``, the same on every rank) or ``ipc`` when
    two ranks of the node share a GPU or symmetric memory is missing on some rank, else ``symm``.
    Collective over the group on GPUs with node peers."""
    if group.device.type != "cuda":
        return "shm", "CPU ranks"
    if group.node_size == 1:
        return "local", "no node peers"
    forced = settings.node_memory()
    views = group.all_gather_object((forced, symm_available()))
    if len({v[0] for v in views}) != 1:
        raise ValueError(f"MOE_EP_NODE_MEMORY: expected the same value on every rank, got "
                         f"{[v[0] for v in views]} (by rank)")
    n0 = group.rank - group.rank % group.node_size
    node = views[n0:n0 + group.node_size]
    shared = group.node_shares_device()
    if forced == "symm":
        if shared:
            raise ValueError("MOE_EP_NODE_MEMORY=symm: ranks of this node share a GPU, which torch symmetric "
                             "memory refuses; use ipc (or unset it)")
        return "symm", "MOE_EP_NODE_MEMORY=symm"
    if forced == "ipc":
        return "ipc", "MOE_EP_NODE_MEMORY=ipc"
    if shared:
        return "ipc", f"ranks share a GPU ({group.ranks_per_device} per GPU)"
    missing = [n0 + i for i, v in enumerate(node) if not v[1]]
    if missing:
        return "ipc", f"torch symmetric memory unavailable on rank {missing[0]}"
    return "symm", "every rank has its own GPU"


def symm_available() -> bool:
    """Whether this torch build has CUDA symmetric memory (``empty`` and ``rendezvous``)."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except Exception:  # noqa: BLE001
        return False
    return hasattr(symm_mem, "empty") and hasattr(symm_mem, "rendezvous")


def check_device_memory(group: EPGroup, nbytes: int, what: str = "buffer") -> None:
    """Raises ``MemoryError`` on every rank, before anything is allocated, when the ranks that share
    a GPU together need more than it has free (``nbytes`` per rank: this rank's need). Collective
    over the group on GPUs; nothing on CPU."""
    if group.device.type != "cuda":
        return
    free = torch.cuda.mem_get_info(group.device)[0]
    views = group.all_gather_object((int(nbytes), int(free)))
    for key in dict.fromkeys(group.device_keys):
        ranks = [r for r, k in enumerate(group.device_keys) if k == key]
        need = sum(views[r][0] for r in ranks)
        avail = min(views[r][1] for r in ranks)
        if need > avail:
            gib = 1 << 30
            raise MemoryError(
                f"moe_ep {what}: ranks {ranks} share one GPU ({key[0]}, {key[1]}) and together need "
                f"{need / gib:.2f} GiB ({' + '.join(f'{views[r][0] / gib:.2f}' for r in ranks)}) but it has "
                f"{avail / gib:.2f} GiB free: use fewer ranks per GPU, a smaller max_tokens, or fewer buffers")


def _node_gather(group: EPGroup, obj) -> list:
    """``obj`` of every rank of this rank's node, in node order (over the node's process group)."""
    pg = group.node_group()
    if pg is None or group.node_size == 1:
        return [obj]
    out = [None] * group.node_size
    dist.all_gather_object(out, obj, group=pg)
    return out


def map_node_files(group: EPGroup, kind: str, nbytes: int) -> List[torch.Tensor]:
    """One ``nbytes`` file per rank of the node in /dev/shm, created zeroed by its rank and mapped
    shared by every rank of the node, then unlinked (the mappings stay; nothing is left behind).
    Returns the node's uint8 views, in node order. Collective over the group."""
    g = group
    tag = g.all_gather_object(uuid.uuid4().hex)[0]
    node0 = g.rank - g.rank % g.node_size
    paths = [f"/dev/shm/moe_ep_{kind}_{tag}_{r}" for r in range(g.world_size)]
    fd = os.open(paths[g.rank], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)  # a new file reads as zeros
    finally:
        os.close(fd)
    g.barrier()
    try:  # only the ranks of this node map each other's file
        return [torch.from_file(paths[node0 + i], shared=True, size=nbytes, dtype=torch.uint8)
                for i in range(g.node_size)]
    finally:
        g.barrier()
        os.unlink(paths[g.rank])


# ----------------------------------------------------------------------------- CUDA IPC

class IpcMemory:
    """``nbytes`` of zeroed device memory on this rank, mapped by every rank of its node through
    legacy CUDA IPC (``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle``, cupy's runtime binding).

    CUDA leaves it undefined to free exported memory before every importer has closed its
    mapping, and ``close()`` is not collective, so a host-shared table (one small /dev/shm file
    per rank: which peers' memory that rank has mapped, and its pid) says when this rank's memory
    is free to go: ``close()`` unmaps the peers' memory at once, and frees this rank's when no live
    peer maps it any more; until then it waits in a list that every later open and close (and
    ``release_deferred()``) sweeps. A peer whose process has exited maps nothing.

    Attributes:
        local: uint8 ``[nbytes]`` tensor on ``group.device`` over this rank's allocation.
        peer_ptrs: ``[node_size]`` addresses (this process's) of each node rank's memory.
    """

    def __init__(self, group: EPGroup, nbytes: int):
        release_deferred()
        self.group, self.nbytes = group, int(nbytes)
        self.rank, self.dev = group.rank, group.device
        self.N, self.me = group.node_size, group.rank % group.node_size
        rt = _runtime(group.rank)
        self._rt = rt
        self.ptr: Optional[int] = None
        self._opened: List[Optional[int]] = [None] * self.N
        err, handle = None, None
        try:
            self._call("cudaSetDevice", rt.setDevice, self.dev.index)
            self.ptr = self._call("cudaMalloc", rt.malloc, max(self.nbytes, 1))
            # Zeroed on a stream of its own and waited for before the handle leaves this rank: a
            # plain cudaMemset goes on the legacy default stream, behind whatever the caller queued
            # there (a long kernel, say), and could wipe what peers write once they have the handle.
            stream = self._call("cudaStreamCreateWithFlags", rt.streamCreateWithFlags, 1)  # non-blocking
            try:
                self._call("cudaMemsetAsync", rt.memsetAsync, self.ptr, 0, max(self.nbytes, 1), stream)
                self._call("cudaStreamSynchronize", rt.streamSynchronize, stream)
            finally:
                rt.streamDestroy(stream)
            handle = bytes(self._call("cudaIpcGetMemHandle", rt.ipcGetMemHandle, self.ptr))
        except RuntimeError as exc:
            err = str(exc)
        handles = _node_gather(group, (err, handle, os.getpid()))
        self._fail_if_any(handles, "export")
        # The table: row i (rank i's file) holds mapped[j] = 1 while rank i maps rank j's memory,
        # and rank i's pid at [N]; each rank writes only its own row.
        self._rows = [v.view(torch.int64) for v in map_node_files(group, "ipc", 8 * (self.N + 1))]
        self._rows[self.me][self.N] = os.getpid()
        err = None
        try:
            for j, (_, h, _) in enumerate(handles):
                if j != self.me:
                    self._rows[self.me][j] = 1  # before the mapping exists: never under-counted
                    self._opened[j] = self._call("cudaIpcOpenMemHandle", rt.ipcOpenMemHandle, h,
                                                 getattr(rt, "cudaIpcMemLazyEnablePeerAccess", 1))
        except RuntimeError as exc:
            err = str(exc)
        self._fail_if_any(_node_gather(group, (err, None, None)), "open")
        self.peer_ptrs = [self.ptr if j == self.me else int(self._opened[j]) for j in range(self.N)]
        self.local = _device_bytes(self.ptr, self.nbytes, self.dev)
        group.barrier()

    def _call(self, name: str, fn, *args):
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - cupy's CUDARuntimeError, named with rank and call
            raise RuntimeError(f"rank {self.rank}: {name} failed on {self.dev}: {exc}") from exc

    def _fail_if_any(self, results: list, step: str) -> None:
        bad = [(i, e) for i, (e, _, _) in enumerate(results) if e]
        if not bad:
            return
        self.close()
        n0 = self.rank - self.me
        raise RuntimeError(f"moe_ep CUDA IPC node memory ({step}) failed on rank(s) "
                           f"{[n0 + i for i, _ in bad]}: {bad[0][1]}")

    def close(self) -> None:
        """Unmaps the peers' memory; frees this rank's now, or once no live peer maps it."""
        rt = self._rt
        for j, p in enumerate(self._opened):
            if p is not None:
                try:
                    rt.setDevice(self.dev.index)
                    rt.ipcCloseMemHandle(p)
                except Exception as exc:  # noqa: BLE001 - the peer may be gone; nothing to undo
                    _log.debug("moe_ep: rank %d: cudaIpcCloseMemHandle of node rank %d: %s", self.rank, j, exc)
                self._opened[j] = None
        rows = getattr(self, "_rows", None)
        if rows is not None:
            rows[self.me][: self.N] = 0
        self.local = None  # type: ignore[assignment]
        if self.ptr is not None:
            _DEFERRED.append(self)
        release_deferred()

    def peers_mapping(self) -> List[int]:
        """Node ranks (0-based within the node) whose live process still maps this rank's memory."""
        rows = getattr(self, "_rows", None)
        if rows is None:  # failed before the table existed: nobody opened this rank's memory
            return []
        return [i for i in range(self.N)
                if i != self.me and int(rows[i][self.me]) and _alive(int(rows[i][self.N]))]

    def _free(self) -> None:
        try:
            self._rt.setDevice(self.dev.index)
            self._rt.free(self.ptr)
        except Exception as exc:  # noqa: BLE001 - at exit the context may already be gone
            _log.debug("moe_ep: rank %d: cudaFree: %s", self.rank, exc)
        self.ptr = None
        self._rows = None


_DEFERRED: List[IpcMemory] = []


def release_deferred() -> int:
    """Frees every closed IPC allocation of this process that no live peer maps any more; returns
    how many are still waiting for a peer to close (or exit)."""
    for m in list(_DEFERRED):
        if not m.peers_mapping():
            _DEFERRED.remove(m)
            m._free()
    return len(_DEFERRED)


atexit.register(release_deferred)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie has already dropped its GPU mappings)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _runtime(rank: int):
    try:
        import cupy.cuda.runtime as rt
    except Exception as exc:  # noqa: BLE001
        raise RuntimeError(f"rank {rank}: CUDA IPC node memory needs cupy (pip install cupy-cuda12x or "
                           f"cupy-cuda13x, matching torch's CUDA): {exc}") from exc
    return rt


class _CudaArray:
    """The ``__cuda_array_interface__`` of a raw allocation, so torch can view it (no copy)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _device_bytes(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 ``[nbytes]`` tensor on ``device`` over memory this module owns (freed by it, not torch)."""
    return torch.as_tensor(_CudaArray(ptr, nbytes), device=device)
