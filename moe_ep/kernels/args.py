"""The kernels' argument groups: named tuples of constexprs the host passes as one argument each,
and of runtime values a kernel builds once and hands its helpers (``io.x_ptr``, ``DIM.K``). The
inter-node kernels (``moe_ep.internode``) take the node kernel's four groups as one (``NodeGroups``)
and their own sizes as another (``Remote``).

A kernel reads a group's field as the constexpr or value it names, so the compiled code is the
one the same arguments passed one by one give (``scripts/sass_digest.py`` shows it, kernel by
kernel). Why these forms (Triton 3.6): a ``tl.constexpr`` parameter may hold a named tuple, but a
field read from it is a plain Python value, which ``tl.static_range`` refuses, so the host wraps
every field in ``tl.constexpr`` (``constexprs``; not for the interpreter, which runs the kernel as
Python); a named tuple built inside a kernel keeps each field as it was (constexpr or tensor).
A group of groups is a constexpr too: the host wraps each inner group as it wraps a field
(``node_groups``), so ``NODE.DIM`` reads as the ``DIM`` the node kernel takes. Runtime pointers stay
separate parameters of the launched kernel, so a launch plan binds and patches them by position
as before (``kernels/launch.py``).
"""
from __future__ import annotations

from typing import Mapping, NamedTuple

import triton.language as tl


class Offsets(NamedTuple):
    """Byte offsets of the workspace regions from a rank's base (``moe_ep.core.workspace``'s names)."""

    hdr_flag: int = 0
    disp_flag: int = 0
    comb_flag: int = 0
    wgt_flag: int = 0
    hdr: int = 0
    meta_i: int = 0
    meta_w: int = 0
    rows: int = 0
    comb: int = 0
    comb_w: int = 0


class Dims(NamedTuple):
    """The buffer's sizes as the kernels name them."""

    RANK: int   # this rank's index in its node
    NODE0: int  # global rank of the node's first rank
    R: int      # ranks in all
    N: int      # ranks of the node
    M: int      # max tokens a rank sends
    K: int      # topk
    E: int      # experts
    EL: int     # experts of a rank
    H: int      # hidden
    W: int      # int32 words of a payload row's elements
    NB: int     # fp8 scale blocks of a row (1 for bf16)
    RB: int     # bytes of a workspace row (payload and scales)
    HDR: int    # int32 words of a header
    CMAX: int   # most chunks of a rank's tokens
    ALIGN: int  # rows an expert's block is aligned to (packed layout)
    CAP: int    # rows of an expert (masked) or of the layout (packed, rows)


class DispatchModes(NamedTuple):
    """What a dispatch launch does besides its half (``SEND``/``RECV``)."""

    GLOBAL: bool  # other nodes: every source's counts from the count matrix
    FP8: bool     # fp8 payload (quantized in the send half unless PREQ)
    PREQ: bool    # the caller's x is fp8 already, with its scales
    DIRECT: bool  # decode sizes: no routing histogram, the ids counted in the kernel
    PACKED: bool  # the packed layout
    ROWS: bool    # the rows layout
    OWN_X: bool   # this rank's own rows from x in the receive half
    INTERP: bool  # under the interpreter


class DispatchTiles(NamedTuple):
    """A dispatch's block sizes and pipelining."""

    BLOCK_T: int   # tokens of a chunk
    BLOCK_K: int
    BLOCK_C: int   # chunks per histogram load
    BLOCK_H: int   # channels of a payload tile
    BLOCK_EL: int
    BLOCK_W: int   # int32 words of a received row's tile
    BLOCK_NB: int
    BLOCK_TS: int  # tokens of an own-rows sub-block
    BLOCK_HS: int  # channels of an own-rows tile
    STAGES: int
    PREFETCH: int  # own sub-blocks asked of the L2 ahead (prefetch_l2), 0 for none
    CM_ROWS: int   # fp8 scales column-major in blocks of this many rows (scale_ptr), 0: row-major


class CombineModes(NamedTuple):
    """What a combine launch does besides its halves (``SEND``/``RECV``/``PUSH``)."""

    BASE_F32: bool  # a float32 out: the sum itself, not rounded
    WEIGHTS: bool   # combine-time weights pushed to the owners
    ROWS: bool      # the rows layout
    OWN_Y: bool     # this rank's own rows from expert_y in the receive half
    WIN: bool       # rows layout: combine weights of each received row given
    WOUT: bool      # rows layout: their sums over owners out
    INTERP: bool
    XROWS: bool = False  # the inter-node path's partial rows summed too


class CombineTiles(NamedTuple):
    """A combine's block sizes and pipelining."""

    BLOCK_T: int
    BLOCK_K: int
    BLOCK_H: int   # channels of a send-half step
    BLOCK_HR: int  # channels of a receive-half step
    BLOCK_TR: int  # tokens of a receive-half step
    STAGES: int


class NodeGroups(NamedTuple):
    """The node kernel's four constexpr groups (dispatch's or combine's) as one argument of an
    inter-node kernel, which hands them on to the node kernel for the node peers' part."""

    OFF: Offsets
    DIM: Dims
    MODE: object  # DispatchModes or CombineModes
    TILE: object  # DispatchTiles or CombineTiles


class Remote(NamedTuple):
    """The inter-node path's sizes and tiles (``moe_ep.internode.spec.RemoteSpec``); each kernel
    reads those of its op (the rest keep 0)."""

    PW: int = 0        # dispatch: int32 words of a remote row's payload (where its trailer starts)
    RB: int = 0        # dispatch: bytes of a remote row (a multiple of 16)
    HDR: int = 0       # dispatch: bytes of a header slot
    CRB: int = 0       # combine: bytes of a combine row
    MAXROWS: int = 0   # rows of the dispatch's send buffer, and of a copy of the combine's receive region
    PCAP: int = 0      # round-1 rows of a source
    OVCAP: int = 0     # rows of an overflow window
    ROWS_CAP: int = 0  # dispatch: rows received across nodes at most (rpos, rw)
    BLOCK_R: int = 0   # ranks, to a power of 2
    BLOCK_RW: int = 0  # remote rows of an unpack / send block
    BLOCK_RH: int = 0  # channels of a remote row's tile
    OWN: int = 0       # dispatch: where ``own`` starts in the tally (int32 words; RemoteSpec.tally_at)
    GOT: int = 0       # dispatch: where ``recv_rows`` starts in the tally


class DispatchIO(NamedTuple):
    """A dispatch's runtime pointers and sizes its helpers take (the kernel's parameters of those names)."""

    x_ptr: object
    xs_ptr: object
    topk_ptr: object
    w_ptr: object
    hist_ptr: object
    peer_ptr: object
    ws: object
    err_ptr: object
    out_x_ptr: object
    out_s_ptr: object
    recv_pos_ptr: object
    sel_ptr: object
    route_ptr: object
    rows_from_ptr: object
    recv_ids_ptr: object
    recv_wts_ptr: object
    recv_src_ptr: object
    T: object
    BT: object


class Clock(NamedTuple):
    """A launch's epoch, its parity, and its waits' start and deadline (nanoseconds)."""

    epoch: object
    par: object
    t0_ns: object
    timeout_ns: object


class RemoteIO(NamedTuple):
    """An inter-node dispatch's runtime pointers and scalars its helpers take (the kernel's
    parameters of those names; a half passes placeholders, here 0, for the others)."""

    send_ptr: object
    comb_row_ptr: object
    mb_ptr: object
    rpos_ptr: object
    rw_ptr: object
    rtimeout_ns: object
    spins: object


def node_groups(consts: Mapping, compiled: bool = True) -> NodeGroups:
    """The node kernel's groups ``OFF``, ``DIM``, ``MODE``, ``TILE`` of ``consts`` (as the
    dispatch's or combine's constexprs give them) as one ``NodeGroups``; ``compiled``: each group
    wrapped in ``tl.constexpr``, as ``constexprs`` wraps a field."""
    g = NodeGroups(*(consts[f] for f in NodeGroups._fields))
    return NodeGroups(*map(tl.constexpr, g)) if compiled else g


def constexprs(group, values: Mapping, compiled: bool = True):
    """The named tuple ``group`` with each field from ``values`` by its name (a field ``values``
    lacks keeps its default; KeyError naming a field without either). ``compiled``: each field
    wrapped in ``tl.constexpr``, as a compiled kernel's ``tl.constexpr`` parameter of that group
    takes it; the interpreter takes the plain values (it runs the kernel as Python, where a
    wrapped field lacks a tensor's methods)."""
    missing = [f for f in group._fields if f not in values and f not in group._field_defaults]
    if missing:
        raise KeyError(f"{group.__name__}: no value for fields {missing}")
    g = group(**{f: values[f] for f in group._fields if f in values})
    return group(*map(tl.constexpr, g)) if compiled else g
