"""Shapes and device state of one rank's inter-node path (docs/ARCHITECTURE.md §10, "Remote row
format"): ``RemoteSpec`` (row format, header, region sizes; what the proxy must agree with) and
``RemoteState`` (the device tensors the kernels keep from dispatch to combine)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..core.fp8 import num_scale_blocks
from ..core.workspace import max_chunks

# The proxy's registration order: five regions of rows (GPU memory where the transport can
# register it), then the headers (host memory: the proxy reads the counts).
REGIONS = ("disp_send", "round1", "overflow", "comb_send", "comb_recv", "hdr_send", "hdr_recv")
ROW_REGIONS = REGIONS[:5]
PROXY_MEMORY = ("auto", "gpu", "host")  # EPBuffer's proxy_memory: where the row regions go on a GPU
# EPBuffer's overflow_budget_bytes default: bytes of the overflow region, both parity copies
# (docs/ARCHITECTURE.md §10 "Round 2 in windows": a window of this size costs one credit round trip
# more than the wire time of its rows, a few percent at 128 MiB).
DEFAULT_OVERFLOW_BUDGET = 128 << 20


def layout_capacity(layout: str, world: int, max_tokens: int, topk: int, num_local_experts: int,
                    alignment: int, masked_capacity: Optional[int] = None) -> int:
    """Rows of the expert layout: masked, rows of each local expert's block (``masked_capacity``,
    else R*M); packed, rows in all (R*M*K, each expert's block padded to ``alignment``); rows, R*M
    (one per source token)."""
    R, M = world, max_tokens
    if layout == "masked":
        return masked_capacity or R * M
    if layout == "rows":
        return R * M
    return R * M * topk + num_local_experts * (alignment - 1)


def touch_probability(topk: int, num_experts: int, world_size: int) -> float:
    """The chance that a token routed uniformly (K distinct experts of E) selects at least one of a
    rank's E/R experts: 1 - C(E - E/R, K) / C(E, K)."""
    el = num_experts // world_size
    miss = 1.0
    for i in range(min(topk, num_experts)):  # C(E - EL, K) / C(E, K) as a product, exact for integer K
        miss *= max(0.0, (num_experts - el - i) / (num_experts - i))
    return 1.0 - miss


def default_private_capacity(max_tokens: int, topk: int, num_experts: int, world_size: int) -> int:
    """Round-1 rows per (source, remote peer): the rows a peer gets from one source under uniform
    routing (``touch_probability``), plus 25% and 8 rows of headroom, at most ``max_tokens``.
    Larger batches spill into round 2, not into errors."""
    return min(max_tokens, int(math.ceil(1.25 * max_tokens * touch_probability(topk, num_experts, world_size))) + 8)



def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class RemoteSpec:
    """One rank's shapes for the inter-node path.

    ``rank``/``world`` R/``node_size`` G; ``num_experts`` E (``EL = E / R`` local); ``topk`` K;
    ``hidden`` H (a multiple of 16); ``max_tokens`` M; ``fp8`` (fp8 dispatch, quantized in-kernel);
    ``private_capacity`` (rows per source in the round-1 slot), ``overflow_capacity`` (rows of the
    overflow region: one window of a receiver's overflow stream, which crosses in as many windows
    as it needs);
    ``max_send_rows`` (rows in the send buffer; default ``M * min(K, R - G)``: a token sends one
    row per destination rank, and its K selections reach at most K remote ranks);
    ``layout`` ``"masked"``/``"packed"``/``"rows"`` and ``expert_alignment`` as in ``EPBuffer``.
    """

    rank: int
    world: int
    node_size: int
    num_experts: int
    topk: int
    hidden: int
    max_tokens: int
    fp8: bool
    private_capacity: int
    overflow_capacity: int
    max_send_rows: Optional[int] = None
    layout: str = "masked"
    expert_alignment: int = 1
    masked_capacity: Optional[int] = None  # masked: rows per expert when not R * M (EPBuffer's expert_capacity)

    @classmethod
    def with_defaults(cls, *, private_capacity: Optional[int], overflow_capacity: Optional[int],
                      overflow_budget_bytes: Optional[int] = None, **kw) -> "RemoteSpec":
        """``RemoteSpec(**kw)`` with ``EPBuffer``'s capacities: ``private_capacity`` (None:
        ``default_private_capacity``) at most M; ``overflow_capacity`` (None: the rows of one
        window, what ``overflow_budget_bytes`` (None: ``DEFAULT_OVERFLOW_BUDGET``) holds in two
        parity copies, at least 1, at most every row that could come in round 2, ``(R - G) * (M -
        private_capacity)``)."""
        M, R = kw["max_tokens"], kw["world"]
        if private_capacity is None:
            private_capacity = default_private_capacity(M, kw["topk"], kw["num_experts"], R)
        private_capacity = min(private_capacity, M)
        if overflow_capacity is None:
            budget = DEFAULT_OVERFLOW_BUDGET if overflow_budget_bytes is None else overflow_budget_bytes
            worst = (R - kw["node_size"]) * (M - private_capacity)
            overflow_capacity = min(worst, max(1, budget // (2 * cls(private_capacity=0, overflow_capacity=0,
                                                                        **kw).row_bytes)))
        return cls(private_capacity=private_capacity, overflow_capacity=overflow_capacity, **kw)

    def __post_init__(self):
        if self.world % self.node_size or self.num_experts % self.world or self.hidden % 16:
            raise ValueError("RemoteSpec: node_size must divide world, world num_experts, 16 hidden")
        if self.max_send_rows is None:
            object.__setattr__(self, "max_send_rows", min(self.topk, self.n_remote) * self.max_tokens)

    # -------------------------------------------------------------- the row format
    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.world

    @property
    def n_remote(self) -> int:
        """Ranks on other nodes."""
        return self.world - self.node_size

    def remote(self, p: int) -> bool:
        return p // self.node_size != self.rank // self.node_size

    @property
    def num_scale_blocks(self) -> int:
        return num_scale_blocks(self.hidden) if self.fp8 else 0

    @property
    def payload_bytes(self) -> int:
        """bf16 ``2H``, or fp8 ``H + 4 * NB`` (H % 16 == 0, so the scales are 4-byte aligned)."""
        return self.hidden * (1 if self.fp8 else 2) + 4 * self.num_scale_blocks

    @property
    def trailer_words(self) -> int:
        """int32 words after the payload: token, lid[K], j[K], w[K] (float32 bits)."""
        return 1 + 3 * self.topk

    @property
    def row_bytes(self) -> int:
        """RB, the proxy's ``row_bytes``: payload + trailer, 16-byte aligned (rows move as 16-byte vectors)."""
        return _align(self.payload_bytes + 4 * self.trailer_words, 16)

    @property
    def comb_row_bytes(self) -> int:
        """One bf16 combine row (rows layout: followed by its K float32 combine weights, 16-byte aligned)."""
        if self.layout == "rows":
            return _align(2 * self.hidden + 4 * self.topk, 16)
        return 2 * self.hidden

    @property
    def hdr_bytes(self) -> int:
        """HDR: int32[R] count vector + int32[EL], padded to 16 bytes (the proxy's ``proxy_hdr_bytes``)."""
        return _align(4 * (self.world + self.num_local_experts), 16)

    @property
    def slot_bytes(self) -> int:
        """One source's round-1 slot: its first ``private_capacity`` rows."""
        return self.private_capacity * self.row_bytes

    @property
    def recv_rows(self) -> int:
        """The most rows one dispatch delivers from remote sources, one per (source, token): ``(R -
        G) * M`` (the rows of ``rpos`` / ``rw``; the combine send region holds one window's,
        ``(R - G) * private_capacity + overflow_capacity``)."""
        return self.n_remote * self.max_tokens

    @property
    def expert_capacity(self) -> int:
        """The expert layout's rows (``layout_capacity``)."""
        return layout_capacity(self.layout, self.world, self.max_tokens, self.topk, self.num_local_experts,
                               self.expert_alignment, self.masked_capacity)

    def region_bytes(self) -> dict:
        """Minimum byte size of each proxy region (``moe_ep_proxy_region_bytes``, in ``REGIONS`` order)."""
        R, hdr, rb, crb = self.world, self.hdr_bytes, self.row_bytes, self.comb_row_bytes
        return {"disp_send": self.max_send_rows * rb,
                "round1": 2 * R * self.slot_bytes,
                "overflow": 2 * self.overflow_capacity * rb,
                "comb_send": (self.n_remote * self.private_capacity + self.overflow_capacity) * crb,
                "comb_recv": 2 * self.max_send_rows * crb,
                "hdr_send": R * hdr,
                "hdr_recv": 2 * R * hdr}

    def region_sizes(self) -> dict:
        """Bytes allocated for each region: ``region_bytes``, at least 16 (a region is never empty)."""
        return {n: max(16, b) for n, b in self.region_bytes().items()}

    def state_shapes(self, programs: int) -> dict:
        """``{name: (shape, dtype)}`` of the ``RemoteState`` tensors for ``programs`` programs a launch."""
        R, EL, K, M, i32 = self.world, self.num_local_experts, self.topk, self.max_tokens, torch.int32
        rows = max(1, self.recv_rows)
        return {"tally": ((self.tally_at("end"),), i32), "comb_row": ((M, K), i32),
                "sel": ((programs, R, EL), i32), "rows_from": ((programs, R), i32), "rpos": ((rows, K), i32),
                "rw": ((rows, K), torch.float32)}

    def tally_at(self, part: str) -> int:
        """Where ``part`` of the ``RemoteState.tally`` starts (int32 words): ``"arrive"`` [2R + 2],
        then ``"own"`` [EL + 1], then ``"recv_rows"`` [R]; ``"end"``: its length. One tensor, so
        the dispatch kernel takes the three as one pointer (<= 40 parameters)."""
        R, EL = self.world, self.num_local_experts
        return {"arrive": 0, "own": 2 * R + 2, "recv_rows": 2 * R + EL + 3, "end": 3 * R + EL + 3}[part]

    def proxy_kwargs(self) -> dict:
        """The ``moe_ep.native.proxy.Proxy`` arguments that must agree with these kernels."""
        return dict(node_size=self.node_size, num_local_experts=self.num_local_experts, row_bytes=self.row_bytes,
                    comb_row_bytes=self.comb_row_bytes, private_capacity=self.private_capacity,
                    overflow_capacity=self.overflow_capacity, max_send_rows=self.max_send_rows)

    @property
    def chunks(self) -> int:
        """CMAX of the count histograms (``moe_ep.core.workspace.max_chunks``)."""
        return max_chunks(self.max_tokens)


class RemoteState:
    """Device tensors of one rank's inter-node path (int32, on ``device``; ``P`` programs a launch).

    ``tally`` (``RemoteSpec.tally_at``) holds ``arrive``, ``own`` and ``recv_rows``, views of it.
    ``own`` [EL + 1]: this rank's selections of its own local experts, and its tokens with a
    selection on itself (the send half's, for the receive half's count matrix: the caller may
    reuse ``topk_idx`` meanwhile); ``comb_row`` [M, K]: row in the combine receive region of each
    token's partial row from a remote owner (at the token's first selection on it), else -1;
    ``arrive`` [2R + 2]: programs of the current launch done with each peer's dispatch rows (then
    with the headers, at [R]), each source's combine rows ([R + 1 + s]) and overflow window 0
    ([2R + 1]), back to 0 after each launch; ``sel`` [P, R, EL] and ``rows_from`` [P, R]: each program's copy of the count matrix
    and of the rows each source sends this rank; ``rpos`` / ``rw`` (float32) [recv_rows, K]: layout
    row and weight of each received (row, k); ``recv_rows`` [R]: rows received from each remote source.
    """

    def __init__(self, spec: RemoteSpec, device: torch.device | str = "cpu", programs: int = 1):
        self.spec = spec
        for name, (shape, dtype) in spec.state_shapes(programs).items():  # zeros, as RemoteSpec.state_shapes sizes them
            setattr(self, name, torch.zeros(shape, dtype=dtype, device=device))
        t = self.tally
        self.arrive, self.own, self.recv_rows = (t[spec.tally_at(a):spec.tally_at(b)] for a, b in (
            ("arrive", "own"), ("own", "recv_rows"), ("recv_rows", "end")))
