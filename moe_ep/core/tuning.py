"""``Tuning``: an EPBuffer's launch knobs, the measured rule for each, the one reader of ``MOE_EP_*`` tuning.

The knobs shape the launches (warps, register budgets, payload tiles, chunks, ...). A field left
``None`` takes the rule ``Tuning.resolve`` applies to the buffer's shape (measured on H200s: the
numbers are in its comments and in docs/performance-log/gpu.md); a value forces that knob. A buffer's
chosen values are ``EPBuffer.tuning`` (a ``ResolvedTuning``). No knob changes what a dispatch or
combine computes, only how the kernels go about it.

    buf = EPBuffer(group, E, H, M, K, tuning=Tuning(num_warps=16, combine_warps=32))
    buf = EPBuffer(..., tuning=Tuning.from_env().replace(tile=1))   # the variables, one knob changed

The variables (``MOE_EP_NUM_WARPS=16`` and the others in ``ENV``) still work, for one release, when
no ``tuning`` is given: ``EPBuffer`` then takes ``Tuning.from_env()``.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Optional, Union

from .workspace import COMBINE_STEP_TOKENS, OWN_TILE_TOKENS, pow2

WARPS = (1, 2, 4, 8, 16, 32)  # the warps a Triton program may have
SMEM_BUDGET = 160 * 1024  # bytes of shared memory the pipelined loops' stages may take (H100/H200: 227 KB)

# field -> (its variable, what the field accepts: "warps", "positive", "count", "maxnreg" or "flag");
# fields added since (``fused_internode``, ``graph_launch``) have no variable: they are passed as ``Tuning`` fields only
ENV = {"num_warps": ("MOE_EP_NUM_WARPS", "warps"),
       "combine_warps": ("MOE_EP_COMBINE_WARPS", "warps"),
       "maxnreg": ("MOE_EP_MAXNREG", "maxnreg"),
       "tile": ("MOE_EP_TILE", "positive"),
       "stages": ("MOE_EP_STAGES", "positive"),
       "combine_tokens": ("MOE_EP_COMBINE_TOKENS", "positive"),
       "own_tokens": ("MOE_EP_OWN_TOKENS", "positive"),
       "hist_warps": ("MOE_EP_HIST_WARPS", "warps"),
       "prefetch": ("MOE_EP_PREFETCH", "count"),
       "split": ("MOE_EP_SPLIT", "flag"),
       "max_chunks": ("MOE_EP_MAX_CHUNKS", "positive")}
_EXPECTED = {"warps": "a power of two from 1 to 32", "positive": "a positive integer", "count": "an integer >= 0",
             "maxnreg": "'none', 'full' or a register count from 16 to 255", "flag": "a bool"}


def _valid(kind: str, v) -> bool:
    """Whether ``v`` (not None) is a value of a field of ``kind``."""
    if kind == "flag":
        return isinstance(v, bool)
    if kind == "maxnreg":  # a spec as register_budget reads it, or a count as an int
        v = str(v) if isinstance(v, int) and not isinstance(v, bool) else v
        return isinstance(v, str) and (v in ("none", "full") or (v.isdigit() and 16 <= int(v) <= 255))
    if not isinstance(v, int) or isinstance(v, bool):
        return False
    return v in WARPS if kind == "warps" else v >= (0 if kind == "count" else 1)


def _parse(name: str, kind: str, text: str):
    """The value of variable ``name`` (a field of ``kind``) from its ``text``; "" is unset (None).
    ValueError naming the variable for anything the field does not accept."""
    if text == "":
        return None
    if kind == "flag":
        return text != "0"  # as before: any value but "0" splits
    value = text if kind == "maxnreg" else int(text) if text.isdigit() else None
    if value is None or not _valid(kind, value):
        raise ValueError(f"{name}: expected {_EXPECTED[kind]}, got {text!r}")
    return value


def pipelined_width(width: int, stages: int, row_bytes: int) -> int:
    """``width`` (a power of two), halved until ``stages`` tiles of ``row_bytes`` per column fit
    in ``SMEM_BUDGET``; unchanged for plain loops (stages 1). The payload tiles' rule, read by the
    dispatch's and the combine's constexprs."""
    while stages > 1 and width > 16 and stages * width * row_bytes > SMEM_BUDGET:
        width //= 2
    return width


class CombineShape(NamedTuple):
    """How the combine kernel is launched where it differs from the dispatch kernel."""
    warps: Optional[int]   # warps a program (None: the dispatch's num_warps)
    tokens: Optional[int]  # tokens per step of the receive half (None: the layout's rule, in Tuning.resolve)
    maxnreg: str           # register budget, as kernels.launch.register_budget reads it ("": ptxas's choice)


def combine_shape(layout: str, programs: int, selections: int, gpu: bool) -> CombineShape:
    """The combine kernel's default shape for a buffer of ``layout`` on ``programs`` programs whose
    calls hold up to ``selections`` = max_tokens * topk (token, expert) pairs, on a GPU or not.

    Packed prefill on few SMs: 32 warps, steps of 4 tokens (pieces of 4 KB a row) and the whole
    register file (64 a thread). One H200, R=1, T=4096, 32 programs, kernel p50 of 50 graph
    replays: 198.9-199.4 us against 216.2 for 16 warps in steps of 8 (fp8 and bf16 dispatch
    alike); without the budget ptxas keeps 4 of a step's 8 loads ahead of its first add, not 8,
    and the same shape takes 265 us. At 132 programs it equals the default (133.2 against 133.5),
    the rows layout is slower with it (59.0 against 42.4) and so is masked decode (5.9 against
    4.8), so those keep the dispatch's shape. A budget of 56 spills in the send half (R >= 2)."""
    if gpu and layout == "packed" and programs <= 64 and selections > 2048:
        return CombineShape(32, 4, "full")
    return CombineShape(None, None, "")


@dataclass(frozen=True)
class ResolvedTuning:
    """The launch shape a buffer takes (``Tuning.resolve``): every knob decided."""

    asked: "Tuning"             # the Tuning given (its None fields: the rules)
    fused: bool                 # one launch per dispatch / combine (else a send and a receive launch)
    fused_internode: bool       # the same for the inter-node kernels (``Tuning.fused_internode`` and ``fused``)
    num_warps: int              # warps a dispatch program (and a combine program unless combine_warps)
    combine_warps: Optional[int]  # warps a combine program (None: num_warps)
    dispatch_maxnreg: str       # registers a dispatch thread may use (register_budget's spec; "": ptxas's choice)
    combine_maxnreg: str        # registers a combine thread may use (the same)
    tile: int                   # payload tile scale of dispatch's loops (bytes per step scale with it)
    combine_tile: int           # of combine's send half (the owner's pre-reduction for a peer)
    combine_recv_tile: int      # of combine's receive half (the sum of the owners' rows; own pre-reduction)
    stages: int                 # payload loops' software-pipeline depth (tiles in flight; 1: plain loops)
    block_ts: int               # tokens per sub-block of the loops over a chunk's own rows
    combine_recv_tokens: int    # tokens per step of combine's receive half
    hist_warps: int             # warps of the routing-histogram launch
    prefetch: Optional[int]     # rows layout: own sub-blocks asked of the L2 ahead (None: dispatch's rule)

    def replace(self, **changes) -> "ResolvedTuning":
        """This launch shape with ``changes`` (``dataclasses.replace``; no rule is applied again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Tuning:
    """How an EPBuffer launches its kernels; ``None`` (and ``split=False``): the measured rule of
    ``resolve`` for that knob. Values are checked here (``ValueError`` naming the field).

    Fields (``ENV`` names each one's variable):
        num_warps: warps per program of the dispatch, and of the combine unless ``combine_warps``
            (a power of two, 1 to 32).
        combine_warps: warps per program of the combine (a power of two, 1 to 32).
        maxnreg: registers a thread of the dispatch and of the combine may use: ``"none"``
            (ptxas's choice), ``"full"`` (the register file over the program's threads) or a count
            from 16 to 255 (an int or its digits).
        tile: payload tile scale of all three payload loops (dispatch, combine's send and receive
            halves): the bytes a program moves per loop step scale with it.
        stages: software-pipeline depth of the payload loops (tiles in flight; 1: plain loops);
            GPUs only (CPU ranks take 1).
        combine_tokens: tokens per step of combine's receive half (rounded up to a power of two,
            at most a chunk).
        own_tokens: tokens per sub-block of the loops over a chunk's own rows (rounded up to a
            power of two, at most a chunk).
        hist_warps: warps per program of the routing-histogram launch (a power of two, 1 to 32).
        prefetch: rows layout: sub-blocks of own rows the dispatch asks the L2 for ahead (0: none).
        split: True: every dispatch and combine as two launches (send half, receive half).
        fused_internode: one launch per inter-node op where every program is resident (where
            the node ops fuse): about 3 µs less host time per eager call (5.7 against 8.9 µs per
            decode dispatch on an H100), but on a GPU that ranks time-slice its ops take far longer
            on the device; off by default (docs/ARCHITECTURE.md §10). For host-bound eager decode
            with a GPU per rank.
        max_chunks: rows layout: the most chunks a source's tokens are cut into (rounded up to a
            power of two); sizes the workspace (``moe_ep.core.workspace.max_chunks``).
        graph_launch: a replayed eager call of two launches or more (across nodes: its send and
            receive halves) issued as one CUDA graph launch, its pointers and token count written
            into the graph's nodes per call; GPUs only, not for calls with a receive hook (inside
            a caller's CUDA graph capture the launches go one by one). None (default): on for
            buffers with peers on other nodes (an eager decode dispatch / ``combine(out=)`` across
            2 x 1 nodes on an H100: 6.0 / 5.2 µs of host time against 16.6 / 15.5 with two
            launches), off inside a node (where it would only join prefill's routing histogram
            to its dispatch, not measured); True / False force it.
    """

    num_warps: Optional[int] = None
    combine_warps: Optional[int] = None
    maxnreg: Union[None, str, int] = None
    tile: Optional[int] = None
    stages: Optional[int] = None
    combine_tokens: Optional[int] = None
    own_tokens: Optional[int] = None
    hist_warps: Optional[int] = None
    prefetch: Optional[int] = None
    split: bool = False
    max_chunks: Optional[int] = None
    fused_internode: bool = False
    graph_launch: Optional[bool] = None

    def __post_init__(self):
        for name, (_, kind) in ENV.items():
            v = getattr(self, name)
            if v is not None and not _valid(kind, v):
                raise ValueError(f"{name}: expected {_EXPECTED[kind]}, got {v!r}")
        if not isinstance(self.fused_internode, bool):
            raise ValueError(f"fused_internode: expected a bool, got {self.fused_internode!r}")
        if self.graph_launch is not None and not isinstance(self.graph_launch, bool):
            raise ValueError(f"graph_launch: expected None or a bool, got {self.graph_launch!r}")
        if isinstance(self.maxnreg, int):
            object.__setattr__(self, "maxnreg", str(self.maxnreg))  # one spelling: Tuning(maxnreg=64) == "64"

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "Tuning":
        """The Tuning the ``MOE_EP_*`` tuning variables of ``env`` (default ``os.environ``) set;
        an unset or empty variable leaves its field to the rule. ``ValueError`` naming the
        variable for a value its field does not take."""
        env = os.environ if env is None else env
        values = {name: _parse(var, kind, env.get(var, "")) for name, (var, kind) in ENV.items()}
        return cls(**{name: v for name, v in values.items() if v is not None})

    def replace(self, **changes) -> "Tuning":
        """This Tuning with ``changes`` (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def resolve(self, shape: "BufferShape", sms: int) -> ResolvedTuning:
        """Every knob for a buffer of ``shape`` (``moe_ep.ops.sizing.BufferShape``, its chunks sized with
        ``max_chunks``) on a device of ``sms`` SMs (2 on CPU ranks): the field where it is set,
        else the measured rule below."""
        gpu, P, layout = shape.device_type == "cuda", shape.num_programs, shape.layout
        selections, block_t = shape.max_tokens * shape.topk, shape.block_t
        # One launch per dispatch / combine on a GPU when every program can be resident at once
        # (its programs wait for their peers' counterparts); else, and under the interpreter, the
        # send and receive halves go as two launches. ``split`` forces two launches.
        fused = gpu and P <= sms and not self.split
        # Across nodes the same condition makes one launch of the inter-node kernels' halves, where
        # asked (``fused_internode``): every program does its whole send half (no wait there)
        # before its first wait, so a resident grid never waits for a program not yet running.
        # Warps per program: few programs, or few tokens each, need more warps each to keep enough
        # bytes in flight (measured on H200: 32 programs at prefill, 16 warps 523/524 us vs 8 warps
        # 663/774 us for dispatch/combine; 132 programs at decode, 12.0/7.3 us vs 12.6/8.3 us).
        # Many programs with many tokens each (prefill at 132 programs, one H200, T=4096, 50 graph
        # replays, kernel p50 dispatch/combine): 16 warps for packed (fp8 101.2/135.7 against 104.3/137.7
        # us at 8, bf16 159.5/135.0 against 163.3/137.9) and rows (fp8 34.9/35.4 against 37.9/40.3),
        # 8 for masked (105.6/138.3 against 111.6/150.0 at 16).
        few = P <= 64 or selections <= 2048
        warps = (16 if few or layout != "masked" else 8) if gpu else 4
        if layout == "rows" and gpu and P <= 64:
            # The rows layout's large chunks at few programs: 32 warps (one H200, T=4096, 32
            # programs, fp8: dispatch 60.4 -> 56.6 us, combine 50.8 -> 47.5 us against 16 warps).
            warps = 32
        num_warps = self.num_warps or warps
        # The combine kernel's shape where it differs from the dispatch's (``combine_shape``): its
        # warps (None: num_warps), its tokens per receive step (below) and its register budget.
        cshape = combine_shape(layout, P, selections, gpu)
        # The registers a thread of the dispatch and of the combine kernel may use (specs as
        # ``register_budget`` reads them; "": ptxas's own choice): the dispatch none, the combine
        # its shape's; ``maxnreg`` sets both.
        maxnreg = self.maxnreg or ""
        # Bytes a program moves per loop step scale with these (payload tiles): ``tile`` for
        # dispatch's loops, ``combine_tile`` for combine's send half (the owner's pre-reduction for
        # a peer), ``combine_recv_tile`` for its receive half (the sum of the owners' rows, and this
        # rank's own pre-reduction). Measured on H200 at prefill, R=1, fp8 (docs/performance-log/gpu.md,
        # "Payload tile sweep"): dispatch 272 / 317 us at tile 2 / 1 with 32 programs and 111 / 123
        # us with 132; the receive-half pre-reduction 249 / 283 us at tile 1 / 2 (32 programs);
        # the send-half pre-reduction 404 / 478 us at tile 2 / 1 (32 programs, earlier kernels).
        # Tiles of 4 spill registers. ``tile`` sets all three.
        few_sms = P <= 64 and gpu
        combine_tile = self.tile or (2 if few_sms else 1)
        # (rows layout: the receive half reads one own row per token, no pre-reduction: the send
        # half's tile, measured 69 us at tile 2 against 90 us at tile 1, T=4096, 32 programs; and
        # at <= 64 programs, with 32 warps and 128-token chunks, tile 4: 42.0 us against 47.5 us)
        rows_recv = 4 if (few_sms and num_warps >= 32) else combine_tile
        # Tokens per step of combine's receive half: at most COMBINE_STEP_TOKENS of a chunk (packed;
        # masked at <= 64 programs), the chunk then going in sub-blocks whose channel steps hold as
        # many elements in longer pieces of each row. One H200, R=1, T=4096 (16-token chunks), 50
        # graph replays, kernel p50, fp8: packed 214.4 us in steps of 8 tokens by 1024 channels
        # against 235.0 for whole chunks by 512 at 32 programs, 134.9 against 136.0 at 132 (steps
        # of 4 and 2 tokens slower: 260.3, 251.9); masked 224.6 against 251.4 at 32 programs, but
        # 159.7 against 150.2 at 132 (8 warps there). The rows layout keeps whole chunks (43.8 us
        # against 46.6 in steps of 32 at 32 programs).
        steps = layout == "packed" or (layout == "masked" and P <= 64)
        step = cshape.tokens or (COMBINE_STEP_TOKENS if steps else block_t)
        return ResolvedTuning(
            asked=self, fused=fused, fused_internode=fused and self.fused_internode, num_warps=num_warps, combine_warps=self.combine_warps or cshape.warps,
            dispatch_maxnreg=maxnreg, combine_maxnreg=maxnreg or cshape.maxnreg,
            tile=self.tile or (2 if gpu else 1), combine_tile=combine_tile,
            combine_recv_tile=self.tile or (rows_recv if layout == "rows" else 1),
            # Software-pipeline depth of the payload loops (Triton's loop pipeliner: asynchronous
            # copies into shared memory, ``stages`` tiles in flight); 1 = plain loops.
            stages=(self.stages or 1) if gpu else 1,
            # Tokens per tile of the loops that move a chunk's own rows (OWN_TILE_TOKENS at most:
            # the rows layout's chunks are larger, and go through those loops in sub-blocks;
            # ``own_tokens`` sets every layout's sub-blocks).
            block_ts=min(block_t, pow2(self.own_tokens) if self.own_tokens else OWN_TILE_TOKENS),
            combine_recv_tokens=min(block_t, pow2(self.combine_tokens or step)),
            # Warps of the routing-histogram launch (one program per chunk): 16 for chunks of 128
            # tokens or more (one H200, rows fp8 at 32 programs: 55.9 against 56.9 us with 4; at
            # 132 programs, 32-token chunks, 4 stays: 35.6 against 36.4).
            hist_warps=self.hist_warps or (16 if block_t >= 128 else 4),
            # Rows layout: sub-blocks of own tokens asked of the L2 ahead of the dispatch's own-row
            # loop (prefetch_l2); None: the dispatch's rule (own_prefetch_depth).
            prefetch=self.prefetch)
