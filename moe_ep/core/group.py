"""EPGroup: the ranks taking part in expert parallelism, their node structure and device."""
from __future__ import annotations

import os
import socket
import sys
import warnings
from typing import NoReturn, Optional, Sequence

import torch
import torch.distributed as dist

from . import settings


class EPGroup:
    """Wraps a ``torch.distributed`` process group for expert parallelism.

    Args:
        pg: the process group; ``None`` means WORLD when torch.distributed is initialised,
            and a single rank (R=1) when it is not.
        node_size: ranks per node (sharing NVLink on GPU, shared memory on CPU). Default: the
            ranks on this host, or ``MOE_EP_NODE_SIZE`` when set. On GPU the default also needs
            every pair of those ranks' devices to reach each other peer to peer
            (``torch.cuda.can_device_access_peer``); if one pair cannot, it is 1 (with a warning
            naming the pair), so the proxy carries everything.
        device: overrides the device below (e.g. ``"cuda:0"`` on a gloo group).

    Attributes:
        rank, world_size: this rank and R within ``pg``.
        node_size: ranks per node; ranks ``[n*node_size, (n+1)*node_size)`` form node ``n``.
        device: the ``device`` given; else ``MOE_EP_DEVICE`` when set (``cuda`` means
            ``cuda:<LOCAL_RANK % GPUs>``, or ``cuda:N`` / ``cpu``); else ``cuda:<local rank>`` when the
            backend is NCCL (or R=1 with a GPU), else ``cpu``. A gloo group may name a CUDA device,
            and several ranks may share one GPU then (NCCL refuses that): their node memory goes
            through CUDA IPC (``moe_ep.core.node_memory``), and timings are not NVLink timings.
        ranks_per_device: the most ranks of the group that share one GPU (1 on CPU, or when every
            rank has its own GPU).
    """

    def __init__(self, pg: Optional[dist.ProcessGroup] = None, node_size: Optional[int] = None,
                 device: Optional[torch.device | str] = None):
        if pg is None and dist.is_available() and dist.is_initialized():
            pg = dist.group.WORLD
        self.pg = pg
        self._node_pg: Optional[dist.ProcessGroup] = None
        if pg is None:
            self.rank, self.world_size = 0, 1
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        else:
            self.rank, self.world_size = dist.get_rank(pg), dist.get_world_size(pg)
            backend = str(dist.get_backend(pg)).lower()
        self.backend = backend
        named = settings.device() if device is None else ""
        if named:
            device = env_device(named, "MOE_EP_DEVICE")
        if device is not None:
            self.device = torch.device(device)
            if self.device.type == "cuda":
                if self.device.index is None:
                    self.device = torch.device("cuda", torch.cuda.current_device())
                torch.cuda.set_device(self.device)
            elif self.device.type != "cpu":
                raise ValueError(f"device: expected a cuda or cpu device, got {device!r}")
        elif "nccl" in backend:
            local = int(os.environ.get("LOCAL_RANK", self.rank % max(1, torch.cuda.device_count())))
            self.device = torch.device("cuda", local)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.node_size = self._node_size(node_size)
        # (host, GPU uuid) of every rank: which ranks share a GPU (node memory, program counts).
        self.device_keys = self._device_keys()
        self.ranks_per_device = (max(self.device_keys.count(k) for k in self.device_keys)
                                 if self.device.type == "cuda" else 1)

    def _node_size(self, node_size: Optional[int]) -> int:
        if node_size is None:
            node_size = settings.node_size()
        if node_size is None:
            if self.pg is None:
                node_size = 1
            else:
                hosts = [None] * self.world_size
                dist.all_gather_object(hosts, socket.gethostname(), group=self.pg)
                node_size = hosts.count(hosts[0])
                if self.device.type == "cuda" and node_size > 1 and self.world_size % node_size == 0:
                    node_size, msg = p2p_node_size(node_size, self._p2p_matrix(node_size))
                    if msg:
                        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        if node_size < 1 or self.world_size % node_size != 0:
            raise ValueError(f"node_size: expected a divisor of world_size={self.world_size}, got {node_size}")
        return node_size

    def _device_keys(self) -> list:
        """``[(host, GPU uuid)]`` per rank, gathered (CUDA only; ``[(host, "cpu")] * R`` on CPU, not
        gathered: CPU ranks share no device memory)."""
        host = socket.gethostname()
        if self.device.type != "cuda":
            return [(host, "cpu")] * self.world_size
        return [tuple(k) for k in self.all_gather_object((host, str(torch.cuda.get_device_properties(self.device).uuid)))]

    def node_shares_device(self) -> bool:
        """True when two ranks of this rank's node use the same GPU (legacy CUDA IPC then maps the
        node peers' memory; torch symmetric memory refuses such a node)."""
        n0 = self.rank - self.rank % self.node_size
        keys = self.device_keys[n0:n0 + self.node_size]
        return self.device.type == "cuda" and len(set(keys)) < len(keys)

    def _p2p_matrix(self, node_size: int) -> list:
        """[i][j]: rank i's GPU can access rank j's peer to peer (None for ranks of other nodes),
        gathered over the process group; each rank fills its own row."""
        devs = [None] * self.world_size
        dist.all_gather_object(devs, self.device.index, group=self.pg)
        node = self.rank // node_size
        row = [None] * self.world_size
        for j in range(node * node_size, (node + 1) * node_size):
            row[j] = j == self.rank or devs[j] == self.device.index or \
                bool(torch.cuda.can_device_access_peer(self.device.index, devs[j]))
        rows = [None] * self.world_size
        dist.all_gather_object(rows, row, group=self.pg)
        return [[rows[i][j] for j in range(self.world_size)] for i in range(self.world_size)]

    def node_group(self) -> Optional[dist.ProcessGroup]:
        """The process group of this rank's node (``pg`` itself when there is one node). Collective
        the first time: every rank of ``pg`` calls it (``EPBuffer`` does, at construction)."""
        if self.node_size == self.world_size:
            return self.pg
        if self._node_pg is None:
            ranks = [dist.get_global_rank(self.pg, r) for r in range(self.world_size)]
            for n in range(self.num_nodes):  # every rank creates every node's group, in order
                sub = dist.new_group(ranks[n * self.node_size:(n + 1) * self.node_size])
                if n == self.rank // self.node_size:
                    self._node_pg = sub
        return self._node_pg

    @property
    def collective_device(self) -> torch.device:
        """Where tensors for this group's collectives must live: ``device`` under NCCL; the CPU under
        gloo, which gathers host tensors only (a gloo group may still run on GPUs)."""
        return self.device if "nccl" in self.backend else torch.device("cpu")

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


def env_device(value: str, name: str = "device") -> torch.device:
    """The device a ``MOE_EP_DEVICE``-style string names: ``cuda`` is ``cuda:<LOCAL_RANK % GPUs>``
    (several local ranks then share GPUs round-robin), ``cuda:N`` and ``cpu`` as torch reads them."""
    if value == "cuda":
        n = torch.cuda.device_count()
        if n == 0:
            raise ValueError(f"{name}: 'cuda' asked for, but no CUDA GPU is visible")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % n)
    try:
        dev = torch.device(value)
    except RuntimeError as exc:
        raise ValueError(f"{name}: expected 'cuda', 'cuda:N' or 'cpu', got {value!r}") from exc
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"{name}: expected 'cuda', 'cuda:N' or 'cpu', got {value!r}")
    return dev


def init_distributed(device: str = "auto", timeout_s: float = 600.0) -> str:
    """Initialises ``torch.distributed`` for an EP job started by torchrun (``env://``), or as one
    rank without it, choosing the backend for the GPUs there are:

    - ``device="cpu"`` (or ``auto`` with no GPU): gloo, CPU ranks;
    - each local rank has its own GPU: NCCL on ``cuda:<LOCAL_RANK>``;
    - more local ranks than GPUs (e.g. 4 ranks on a 1-GPU machine): NCCL refuses two ranks on one
      GPU, so gloo, with ``MOE_EP_DEVICE=cuda`` set so that ``EPGroup()`` puts local rank ``l`` on
      ``cuda:<l % GPUs>``.

    Returns a short description for logs, e.g. ``"4 ranks on 1 GPU (ranks share GPUs)"``.
    """
    import datetime

    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    world = int(os.environ["WORLD_SIZE"])
    local, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", world))
    timeout = datetime.timedelta(seconds=timeout_s)
    gpus = torch.cuda.device_count() if device in ("auto", "cuda") and torch.cuda.is_available() else 0
    if device == "cuda" and gpus == 0:
        raise ValueError("device: 'cuda' asked for, but no CUDA GPU is visible")
    if gpus == 0:
        dist.init_process_group("gloo", timeout=timeout)
        return f"{world} CPU rank{'s' * (world > 1)}"
    if local_world <= gpus:
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local))
        return f"{world} rank{'s' * (world > 1)}, one GPU each"
    settings.set_device("cuda")
    torch.cuda.set_device(local % gpus)
    dist.init_process_group("gloo", timeout=timeout)
    return (f"{world} ranks on {gpus} GPU{'s' * (gpus > 1)} per host ({local_world} local ranks share them: "
            f"gloo group, CUDA IPC node memory; timings are not NVLink timings)")


def exit_rank(code: int = 0) -> NoReturn:
    """Ends a rank process once every rank of the default group got here: a last barrier, then
    ``os._exit(code)`` without the group's teardown and the interpreter's. That teardown aborted a
    spawned gloo rank now and then after every check had passed ("terminate called without an
    active exception", twice in CI, once after a barrier had been added before it). Call it only
    where every rank will (a check whose verdict all ranks share); after a failure that not every
    rank saw, tear the group down instead (``dist.destroy_process_group()``): peers may wait in
    another collective. Buffers should be closed first (their shared memory is unlinked once
    mapped, so nothing is left behind)."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def p2p_node_size(node_size: int, can_access: Sequence[Sequence[Optional[bool]]]) -> tuple:
    """The default node size given peer-to-peer reachability: ``(node_size, None)`` when
    ``can_access[i][j]`` and ``can_access[j][i]`` hold for every pair of ranks i != j of one node
    (ranks ``[n*node_size, (n+1)*node_size)``), else ``(1, warning)`` naming the first pair that
    cannot reach each other. Entries for ranks of different nodes are not looked at."""
    R = len(can_access)
    for n in range(R // node_size):
        for i in range(n * node_size, (n + 1) * node_size):
            for j in range(i + 1, (n + 1) * node_size):
                if not (can_access[i][j] and can_access[j][i]):
                    return 1, (f"moe_ep: ranks {i} and {j} share a host but their GPUs cannot access each "
                               f"other peer to peer; using node_size=1 (set MOE_EP_NODE_SIZE to override)")
    return node_size, None
