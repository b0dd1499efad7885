"""Memory of an EPBuffer from its arguments alone: the one sizing code the buffer allocates by, and
``memory_plan``, which adds it up per region before any node is rented (no process group, no GPU).

``BufferShape`` checks the arguments (the messages ``EPBuffer`` raises) and gives the shape and
dtype of every allocation (``allocations()``: node workspace, expert layout, routing state, the
proxy's regions and state across nodes); ``EPBuffer`` allocates each tensor from it, and
``EPBuffer.memory()`` reads the same entries back from the live tensors. ``MemoryPlan`` is the
per-region sum: device memory, pinned host memory, host memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import torch

from ..core.fp8 import num_scale_blocks
from ..internode.spec import PROXY_MEMORY, ROW_REGIONS, RemoteSpec, layout_capacity, touch_probability
from ..core.workspace import WorkspaceLayout, pow2
from ..native.protocol import mailbox_words
from ..core.tuning import Tuning

DEVICE, PINNED, HOST = "device", "pinned host", "host"  # where an allocation lives
WORST = "worst"  # max_recv_rows: the received tensors allocated once for every row that can come
# Allocations with one row per received row (packed, rows layouts): sized per call, to a cap or the worst case.
RECV_ROW_ALLOCS = ("expert_x", "expert_scales", "recv_topk_idx", "recv_topk_weights", "recv_src")
PLAN_PROGRAMS = 132  # programs a launch memory_plan takes on GPUs: EPBuffer's default on an H100 SXM or H200 (SMs)
GIB = 1 << 30
# The regions of a plan, in table order (those a buffer does not allocate are left out).
PLAN_REGIONS = ("workspace", "expert_x", "expert_scales", "rows_meta", "routing", *ROW_REGIONS, "remote_state",
                "headers", "host_words")


@dataclass(frozen=True)
class Alloc:
    """One allocation: a ``shape`` tensor of ``dtype`` in ``where`` memory, counted in plan ``region``."""

    region: str
    shape: tuple
    dtype: torch.dtype
    where: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def allocate(a: Alloc, device: torch.device, fill: Optional[float] = 0) -> torch.Tensor:
    """The tensor of ``a``: on ``device`` (the rank's GPU or CPU), or pinned host memory where
    ``a.where`` says so; zeros, ``fill``, or uninitialised with ``fill=None``."""
    kw = dict(dtype=a.dtype, pin_memory=True) if a.where == PINNED else dict(dtype=a.dtype, device=device)
    if fill is None:
        return torch.empty(a.shape, **kw)
    return torch.full(a.shape, fill, **kw) if fill else torch.zeros(a.shape, **kw)


def size_text(nbytes: int) -> str:
    """``nbytes`` for a log line: GiB with 2 decimals; below a GiB MiB, below a MiB KiB, with 1."""
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"


def where_of(t: torch.Tensor) -> str:
    """Where tensor ``t``'s memory lives: ``"device"`` (a GPU), ``"pinned host"`` or ``"host"``."""
    if t.device.type != "cpu":
        return DEVICE
    return PINNED if torch.cuda.is_available() and t.is_pinned() else HOST


def uniform_recv_rows(max_tokens: int, topk: int, num_local_experts: int, expert_alignment: int = 1) -> int:
    """The packed rows a rank receives, on average, when every rank dispatches ``max_tokens`` tokens
    routed uniformly: ``M*K`` selections (R sources each sending it ``M*K/R``), plus at most
    ``alignment - 1`` rows of padding per local expert. What a buffer sized per call holds at such
    a batch (``moe-ep-bench memory``'s packed rows)."""
    return max_tokens * topk + num_local_experts * (expert_alignment - 1)


def uniform_rows_layout_rows(world_size: int, max_tokens: int, topk: int, num_experts: int) -> int:
    """The rows-layout rows a rank receives, on average, when every rank dispatches ``max_tokens``
    tokens routed uniformly: one per source token with a selection on the rank, ``R*M`` times the
    chance that K distinct experts of E touch its E/R (``touch_probability``), rounded up. What a
    rows buffer sized per call holds at such a batch (``moe-ep-bench memory``'s rows layout)."""
    return math.ceil(world_size * max_tokens * touch_probability(topk, num_experts, world_size))


def _positive(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name}: expected a positive int, got {v!r}")


@dataclass(frozen=True)
class BufferShape:
    """The arguments of an ``EPBuffer`` that size its memory, checked (``EPBuffer``'s messages).

    ``world_size`` R ranks in nodes of ``node_size`` G (G < R: the proxy path); ``device_type``
    ``"cuda"`` or ``"cpu"`` (CPU ranks: every allocation in plain host memory); the rest as
    ``EPBuffer`` takes them (``num_programs`` resolved: the launch's programs).
    """

    world_size: int
    node_size: int
    num_experts: int
    hidden: int
    max_tokens: int
    topk: int
    num_programs: int
    dispatch_dtype: torch.dtype = torch.bfloat16
    combine_dtype: torch.dtype = torch.bfloat16
    layout: str = "masked"
    expert_alignment: int = 1
    expert_capacity: Optional[int] = None
    column_major_scales: bool = False
    private_capacity: Optional[int] = None
    overflow_capacity: Optional[int] = None
    overflow_budget_bytes: Optional[int] = None
    proxy_memory: str = "auto"
    device_type: str = "cuda"
    max_chunks: Optional[int] = None  # rows layout: the most chunks of a source (Tuning.max_chunks; None: the rule)
    max_recv_rows: object = None  # packed, rows: None (sized per call), "worst" or a cap in rows (recv_rows_mode)

    def __post_init__(self):
        R, layout = self.world_size, self.layout
        for name in ("world_size", "node_size", "num_experts", "hidden", "max_tokens", "topk", "expert_alignment"):
            _positive(name, getattr(self, name))
        if R % self.node_size:
            raise ValueError(f"node_size: expected a divisor of world_size={R}, got {self.node_size}")
        if self.num_experts % R != 0:
            raise ValueError(f"num_experts: expected a multiple of world_size={R}, got {self.num_experts}")
        if self.hidden % 16 != 0:
            raise ValueError(f"hidden: expected a multiple of 16, got {self.hidden}")
        if self.dispatch_dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            raise TypeError(f"dispatch_dtype: expected torch.bfloat16 or torch.float8_e4m3fn, got {self.dispatch_dtype}")
        if self.combine_dtype != torch.bfloat16:
            raise TypeError(f"combine_dtype: expected torch.bfloat16, got {self.combine_dtype}")
        if layout not in ("masked", "packed", "rows"):
            raise ValueError(f"layout: expected 'masked', 'packed' or 'rows', got {layout!r}")
        if layout == "rows" and self.expert_alignment != 1:
            raise ValueError(f"expert_alignment: expected 1 with layout='rows' (rows are not grouped by expert; "
                             f"aligning them is the caller's business), got {self.expert_alignment}")
        if self.expert_capacity is not None:
            if layout != "masked":
                raise ValueError(f"expert_capacity: only with layout='masked' (got layout={layout!r}, whose capacity "
                                 f"holds every row)")
            c = self.expert_capacity
            if not isinstance(c, int) or isinstance(c, bool) or not 1 <= c <= R * self.max_tokens:
                raise ValueError(f"expert_capacity: expected None or an int in [1, world_size * max_tokens = "
                                 f"{R * self.max_tokens}], got {c!r}")
        if not isinstance(self.column_major_scales, bool):
            raise TypeError(f"column_major_scales: expected a bool, got {type(self.column_major_scales).__name__}")
        if self.column_major_scales and (layout != "masked" or self.dispatch_dtype != torch.float8_e4m3fn):
            raise ValueError(f"column_major_scales: only with layout='masked' and dispatch_dtype=torch.float8_e4m3fn "
                             f"(got layout={layout!r}, dispatch_dtype={self.dispatch_dtype})")
        if self.proxy_memory not in PROXY_MEMORY:
            raise ValueError(f"proxy_memory: expected one of {', '.join(PROXY_MEMORY)}, got {self.proxy_memory!r}")
        for name in ("private_capacity", "overflow_capacity", "overflow_budget_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{name}: expected None or an int >= 0, got {v!r}")
        cap = self.max_recv_rows
        if cap is not None:
            if layout == "masked":
                raise ValueError(f"max_recv_rows: only with layout='packed' or 'rows' (got layout={layout!r}, whose "
                                 f"expert_x is allocated once at its expert_capacity)")
            worst = self.worst_rows
            if cap != WORST and (not isinstance(cap, int) or isinstance(cap, bool) or not 1 <= cap <= worst):
                what = ("world_size * max_tokens * topk + num_local_experts * (expert_alignment - 1)"
                        if layout == "packed" else "world_size * max_tokens")
                raise ValueError(f"max_recv_rows: expected None (sized per call), {WORST!r} or an int in [1, "
                                 f"{worst}] ({what}), got {cap!r}")
        n = self.num_programs
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"num_programs: expected a positive int, got {n!r}")
        if self.device_type not in ("cuda", "cpu"):
            raise ValueError(f"device_type: expected 'cuda' or 'cpu', got {self.device_type!r}")

    # -------------------------------------------------------------- sizes
    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.world_size

    @property
    def fp8(self) -> bool:
        return self.dispatch_dtype == torch.float8_e4m3fn

    @property
    def num_scale_blocks(self) -> int:
        """Float32 scales per row (fp8 dispatch: one per 128 channels), else 0."""
        return num_scale_blocks(self.hidden) if self.fp8 else 0

    @cached_property
    def workspace(self) -> WorkspaceLayout:
        """The node workspace's layout (``moe_ep.core.workspace``): uint8 ``[workspace.offsets()["total"]]`` a rank."""
        return WorkspaceLayout(N=self.node_size, M=self.max_tokens, K=self.topk, EL=self.num_local_experts,
                               H=self.hidden, payload_bytes=self.hidden * (1 if self.fp8 else 2) + 4 * self.num_scale_blocks,
                               rows=self.layout == "rows", programs=self.num_programs, max_chunks=self.max_chunks)

    @cached_property
    def offsets(self) -> dict:
        """Byte offsets of the workspace's regions by name (``WorkspaceLayout.offsets``; ``"total"``: its size)."""
        return self.workspace.offsets()

    @property
    def chunks(self) -> int:
        """CMAX, the most chunks a source's tokens are cut into (``moe_ep.core.workspace.max_chunks``)."""
        return self.workspace.CMAX

    @property
    def block_t(self) -> int:
        """Tokens of a source's largest chunk, a power of two (the kernels' chunk block)."""
        return pow2(-(-self.max_tokens // self.workspace.CMAX))

    @property
    def worst_rows(self) -> int:
        """The rows every layout block may need at worst (``layout_capacity``): masked, per local
        expert (``expert_capacity`` or R*M); packed, in all (R*M*K, each expert's block padded to
        ``expert_alignment``: a token may list one expert several times, and each selection is a
        row, so ``min(K, EL)`` rows per source token is no bound); rows: R*M."""
        return layout_capacity(self.layout, self.world_size, self.max_tokens, self.topk, self.num_local_experts,
                               self.expert_alignment, self.expert_capacity)

    @property
    def recv_rows_mode(self) -> str:
        """How the packed and rows layouts' received tensors (``RECV_ROW_ALLOCS``: ``expert_x``, fp8
        ``expert_scales``; rows layout also ``recv_topk_idx``, ``recv_topk_weights``, ``recv_src``)
        are sized: ``"per_call"`` (``max_recv_rows=None``: to the rows each dispatch brings, read on
        the host between its send and receive halves; the worst case under CUDA graph capture),
        ``"worst"`` (allocated once at ``worst_rows``) or ``"cap"`` (allocated once at
        ``max_recv_rows``; a dispatch needing more raises ``CapacityError``). Masked: ``"worst"``
        (its capacity)."""
        if self.layout == "masked" or self.max_recv_rows == WORST:
            return "worst"
        return "per_call" if self.max_recv_rows is None else "cap"

    @property
    def capacity(self) -> int:
        """The rows the kernels may address (their ``CAP``): masked, of each local expert's block;
        packed and rows, in all: ``max_recv_rows`` as a cap, else ``worst_rows`` (per call the
        allocation is exactly what arrives, never more than this)."""
        return self.max_recv_rows if self.recv_rows_mode == "cap" else self.worst_rows

    @property
    def allocated_rows(self) -> int:
        """Rows of ``expert_x`` a buffer allocates when built: its capacity, or 1 when sized per call
        (it grows to each call's rows: ``BufferMemory.fit_rows``)."""
        return 1 if self.recv_rows_mode == "per_call" else self.capacity

    @property
    def row_bytes(self) -> int:
        """Bytes one row of the expert layout takes: ``expert_x`` and, fp8, its scales."""
        return self.hidden * self.dispatch_dtype.itemsize + 4 * self.num_scale_blocks

    @property
    def scale_column_rows(self) -> int:
        """Rows of a column-major block of ``expert_scales`` (the kernels' ``CM_ROWS``: the capacity
        with ``column_major_scales``), 0 for row-major scales."""
        return self.capacity if self.column_major_scales else 0

    @property
    def lead(self) -> tuple:
        """The leading dims of ``expert_x`` as allocated: ``(EL, capacity)`` masked, else
        ``(allocated_rows,)``."""
        return (self.num_local_experts, self.capacity) if self.layout == "masked" else (self.allocated_rows,)

    @property
    def block_el(self) -> int:
        """Local experts as a Triton block (a power of two, at least 2)."""
        return max(2, 1 << (self.num_local_experts - 1).bit_length())

    def remote_spec(self, rank: int = 0) -> Optional[RemoteSpec]:
        """The inter-node path's shapes for ``rank`` (None when one node holds every rank); its
        sizes are the same for every rank."""
        if self.node_size >= self.world_size:
            return None
        return RemoteSpec.with_defaults(
            rank=rank, world=self.world_size, node_size=self.node_size, num_experts=self.num_experts, topk=self.topk,
            hidden=self.hidden, max_tokens=self.max_tokens, fp8=self.fp8, private_capacity=self.private_capacity,
            overflow_capacity=self.overflow_capacity, overflow_budget_bytes=self.overflow_budget_bytes,
            layout=self.layout, expert_alignment=self.expert_alignment,
            masked_capacity=self.capacity if self.layout == "masked" else None)

    def allocations(self) -> dict[str, Alloc]:
        """Every allocation of the buffer, by where it lives on it (an attribute path: ``"hist"``,
        ``"workspace.local"``, ``"remote.regions.round1"``). On GPUs the proxy's row regions are
        planned in device memory unless ``proxy_memory="host"`` (``"auto"`` takes GPU memory where
        the transport registers it: verbs, efa; tcp falls back to pinned host memory)."""
        R, G, N, M, K = self.world_size, self.node_size, self.node_size, self.max_tokens, self.topk
        E, EL, P, H = self.num_experts, self.num_local_experts, self.num_programs, self.hidden
        gpu = self.device_type == "cuda"
        dev, pinned = (DEVICE, PINNED) if gpu else (HOST, HOST)
        i32, i64, f32 = torch.int32, torch.int64, torch.float32
        rows, remote = self.layout == "rows", self.remote_spec()
        ws = self.workspace
        out = {"workspace.local": Alloc("workspace", (ws.offsets()["total"],), torch.uint8, dev),
               "workspace.peer_ptrs": Alloc("routing", (N,), i64, dev),
               "state": Alloc("routing", (2, P), i64, dev),
               "err": Alloc("host_words", (8,), i64, pinned),
               # rows layout: N more rows (each node peer's tokens per chunk); with other nodes N, then R
               "hist": Alloc("routing", (E + (N if rows or G < R else 0) + (R if G < R else 0), ws.CMAX), i32, dev),
               "recv_pos": Alloc("routing", (N, M, K), i32, dev),
               "route_idx": Alloc("routing", (M, K), i32, dev),
               "scratch": Alloc("routing", (P, self.block_el), i32, dev),
               "expert_x": Alloc("expert_x", (*self.lead, H), self.dispatch_dtype, dev)}
        if self.column_major_scales:  # allocated [EL, NB, capacity], viewed [EL, capacity, NB]
            out["expert_scales"] = Alloc("expert_scales", (EL, self.num_scale_blocks, self.capacity), f32, dev)
        elif self.fp8:
            out["expert_scales"] = Alloc("expert_scales", (*self.lead, self.num_scale_blocks), f32, dev)
        out["expert_counts"] = Alloc("routing", (EL,), i32, dev)
        if self.layout == "packed":
            out["expert_offsets"] = Alloc("routing", (EL + 1,), i32, dev)
        if self.recv_rows_mode == "per_call":  # the rows a call brings, written by a kernel, read by the host
            out["recv_need"] = Alloc("host_words", (1,), i64, pinned)
        if rows:  # per received row its local ids, weights and source; the count of rows
            out.update({"recv_topk_idx": Alloc("rows_meta", (*self.lead, K), i32, dev),
                        "recv_topk_weights": Alloc("rows_meta", (*self.lead, K), f32, dev),
                        "recv_src": Alloc("rows_meta", self.lead, i32, dev),
                        "num_recv": Alloc("rows_meta", (1,), i32, dev)})
        if remote is not None:
            for name, (shape, dtype) in remote.state_shapes(P).items():
                out[f"remote.state.{name}"] = Alloc("remote_state", shape, dtype, dev)
            row_where = (PINNED if self.proxy_memory == "host" else DEVICE) if gpu else HOST
            for name, nbytes in remote.region_sizes().items():
                where, region = (row_where, name) if name in ROW_REGIONS else (pinned, "headers")
                out[f"remote.regions.{name}"] = Alloc(region, (nbytes,), torch.uint8, where)
            out["remote.mailbox"] = Alloc("host_words", (mailbox_words(R),), i64, pinned)
        return out

    def plan(self, recv_rows: Optional[int] = None) -> "MemoryPlan":
        """The per-region sums of ``allocations()``; sized per call, ``recv_rows`` is the rows the
        received tensors (``RECV_ROW_ALLOCS``) hold after a dispatch that brought that many (None:
        as built). ``ValueError`` for ``recv_rows`` outside ``[0, worst_rows]`` or with another mode."""
        allocs = self.allocations()
        if recv_rows is not None:
            if self.recv_rows_mode != "per_call":
                raise ValueError(f"recv_rows: only for a packed or rows buffer sized per call (max_recv_rows=None), "
                                 f"this one's expert_x is {self.recv_rows_mode}")
            if not isinstance(recv_rows, int) or isinstance(recv_rows, bool) or not 0 <= recv_rows <= self.worst_rows:
                raise ValueError(f"recv_rows: expected an int in [0, {self.worst_rows}], got {recv_rows!r}")
            for key in RECV_ROW_ALLOCS:
                if key in allocs:
                    a = allocs[key]
                    allocs[key] = Alloc(a.region, (max(1, recv_rows), *a.shape[1:]), a.dtype, a.where)
        return MemoryPlan.of({k: (a.region, a.nbytes, a.where) for k, a in allocs.items()})


# ----------------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class Region:
    """One region of a plan: ``bytes`` in ``where`` memory (``"device"``, ``"pinned host"``, ``"host"``)."""

    name: str
    bytes: int
    where: str


@dataclass(frozen=True)
class MemoryPlan:
    """The memory of one rank's ``EPBuffer``, region by region (``PLAN_REGIONS`` order).

    Regions: ``workspace`` (node memory every node peer maps: flags, headers, rows, combine rows),
    ``expert_x`` / ``expert_scales`` (the expert layout), ``rows_meta`` (rows layout: ids, weights,
    source per received row), ``routing`` (histograms, positions, launch state), across nodes the
    proxy's row regions ``disp_send``, ``round1``, ``overflow``, ``comb_send``, ``comb_recv``, its
    ``remote_state`` and ``headers``, and ``host_words`` (error record, mailbox).
    """

    regions: tuple

    @classmethod
    def of(cls, entries: dict) -> "MemoryPlan":
        """From ``{key: (region, bytes, where)}``: bytes summed per (region, where)."""
        sums: dict = {}
        for region, nbytes, where in entries.values():
            sums[(region, where)] = sums.get((region, where), 0) + int(nbytes)
        order = {n: i for i, n in enumerate(PLAN_REGIONS)}
        keys = sorted(sums, key=lambda k: (order.get(k[0], len(order)), k[1]))
        return cls(tuple(Region(n, sums[(n, w)], w) for n, w in keys))

    def __getitem__(self, name: str) -> int:
        """Bytes of region ``name`` (wherever it lives); 0 for a region the buffer does not have."""
        return sum(r.bytes for r in self.regions if r.name == name)

    def bytes_in(self, where: str) -> int:
        return sum(r.bytes for r in self.regions if r.where == where)

    @property
    def device_bytes(self) -> int:
        return self.bytes_in(DEVICE)

    @property
    def pinned_bytes(self) -> int:
        return self.bytes_in(PINNED)

    @property
    def host_bytes(self) -> int:
        """Host memory, pinned or not."""
        return self.total_bytes - self.device_bytes

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.regions)

    def biggest(self, n: int = 3) -> list:
        """The ``n`` largest regions, largest first."""
        return sorted(self.regions, key=lambda r: -r.bytes)[:n]

    def as_dict(self) -> dict:
        """JSON-ready: bytes per region with where, and the sums."""
        return dict(regions=[dict(name=r.name, bytes=r.bytes, where=r.where) for r in self.regions],
                    device_bytes=self.device_bytes, pinned_bytes=self.pinned_bytes, host_bytes=self.host_bytes,
                    total_bytes=self.total_bytes)

    def format(self) -> str:
        """A table: one line per region (GiB, 2 decimals; MiB for the small ones), then the sums."""
        lines = [f"{'region':<15} {'where':<12} {'GiB':>8} {'MiB':>11}"]
        for r in self.regions:
            lines.append(f"{r.name:<15} {r.where:<12} {r.bytes / GIB:>8.2f} {r.bytes / 2**20:>11.2f}")
        for label, v in (("device", self.device_bytes), ("host", self.host_bytes), ("total", self.total_bytes)):
            lines.append(f"{label:<28} {v / GIB:>8.2f} {v / 2**20:>11.2f}")
        return "\n".join(lines)


def memory_plan(*, world_size: int, node_size: int, num_experts: int, hidden: int, max_tokens: int, topk: int,
                dispatch_dtype: torch.dtype = torch.bfloat16, combine_dtype: torch.dtype = torch.bfloat16,
                layout: str = "masked", expert_alignment: int = 1, num_programs: Optional[int] = None,
                private_capacity: Optional[int] = None, overflow_capacity: Optional[int] = None,
                expert_capacity: Optional[int] = None, column_major_scales: bool = False,
                proxy_memory: str = "auto", device: str = "cuda", tuning: Optional[Tuning] = None,
                max_recv_rows=None, recv_rows: Optional[int] = None,
                overflow_budget_bytes: Optional[int] = None) -> MemoryPlan:
    """The memory one rank's ``EPBuffer`` of these arguments will hold, per region, before anything
    is allocated: the sizes the buffer allocates by (``BufferShape.allocations``), for ``world_size``
    ranks in nodes of ``node_size``. No process group, no GPU; nothing is started.

    The keywords are ``EPBuffer``'s (checked with its messages); ``num_programs`` defaults to
    ``PLAN_PROGRAMS`` (132) on GPUs and 2 on CPU ranks, as ``EPBuffer`` takes it there. ``device``:
    ``"cuda"`` (the GPU's memory is ``"device"``; error record, mailbox, headers in pinned host
    memory; the proxy's row regions per ``proxy_memory``) or ``"cpu"`` (CPU ranks: all ``"host"``).
    ``tuning``: the buffer's ``Tuning`` (default ``Tuning.from_env()``, as ``EPBuffer``'s); its
    ``max_chunks`` sizes the rows layout's chunk flags and histograms. ``max_recv_rows``: packed and
    rows, as ``EPBuffer`` takes it; sized per call (None), the received tensors a buffer holds are
    what its largest dispatch so far brought: ``recv_rows`` plans them after a dispatch of that many
    rows (default: as built, one row).
    """
    if tuning is None:
        tuning = Tuning.from_env()
    if num_programs is None:
        num_programs = PLAN_PROGRAMS if device == "cuda" else 2
    return BufferShape(world_size=world_size, node_size=node_size, num_experts=num_experts, hidden=hidden,
                       max_tokens=max_tokens, topk=topk, num_programs=num_programs, dispatch_dtype=dispatch_dtype,
                       combine_dtype=combine_dtype, layout=layout, expert_alignment=expert_alignment,
                       expert_capacity=expert_capacity, column_major_scales=column_major_scales,
                       private_capacity=private_capacity, overflow_capacity=overflow_capacity,
                       overflow_budget_bytes=overflow_budget_bytes, proxy_memory=proxy_memory, device_type=device,
                       max_chunks=tuning.max_chunks, max_recv_rows=max_recv_rows).plan(recv_rows)
