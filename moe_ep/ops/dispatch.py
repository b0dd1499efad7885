"""Dispatch: validation and the launches (routing histogram at prefill sizes; the dispatch kernel:
one launch on a GPU, its send and receive halves as two launches under the interpreter; across
nodes the inter-node kernel's two halves, one launch where ``Tuning.fused_internode``)."""
from __future__ import annotations

from typing import Optional

import torch

from . import host_wait
from .calls import (Parts, aligned, check_tensor, finish, internode_consts, launch_half, launch_halves, node_dims,
                    planned_half, replayed_recv)
from ..kernels.args import DispatchModes, DispatchTiles, Dims, Offsets, constexprs
from ..kernels.dispatch import node_dispatch_kernel
from .result import DispatchResult
from ..core.capture import capturing
from ..core.workspace import chunking, pow2
from .sizing import RECV_ROW_ALLOCS
from ..core.tuning import pipelined_width
from ..kernels.launch import arg_positions, runtime_args
from ..kernels.recv_total import recv_total_kernel
from ..kernels.route import route_hist_kernel
from ..internode.dispatch_kernels import internode_dispatch_kernel


# Decode sizes: up to this many selections (T * K) a dispatch counts earlier selections in its own
# kernel (DIRECT) instead of launching the routing histogram first (cheaper than a launch there).
DIRECT_MAX = 2048


def validate(parts: Parts, x, topk_idx, topk_weights, x_scales) -> int:
    """Checks every input against the buffer (``dispatch``'s arguments); returns T. Raises before any memory is touched."""
    dev, H, K = parts.memory.device, parts.shape.hidden, parts.shape.topk
    if x_scales is None:
        check_tensor("x", x, (torch.bfloat16,), (None, H), dev)
    else:
        if not parts.shape.fp8:
            raise TypeError("x_scales: pre-quantized fp8 input needs an EPBuffer with dispatch_dtype=torch.float8_e4m3fn")
        check_tensor("x", x, (torch.float8_e4m3fn,), (None, H), dev)
    T = x.shape[0]
    if T > parts.shape.max_tokens:
        raise ValueError(f"x: expected at most max_tokens={parts.shape.max_tokens} tokens, got {T}")
    if x_scales is not None:
        check_tensor("x_scales", x_scales, (torch.float32,), (T, parts.shape.num_scale_blocks), dev)
    check_tensor("topk_idx", topk_idx, (torch.int32, torch.int64), (None, None), dev)
    if topk_idx.shape != (T, K):
        raise ValueError(f"topk_idx: expected shape [{T}, {K}] (tokens of x, topk of the buffer), got {list(topk_idx.shape)}")
    check_tensor("topk_weights", topk_weights, (torch.float32,), (T, K), dev)
    if dev.type == "cpu" and T > 0:
        check_ids_on_host(topk_idx, parts.shape.num_experts)
    return T


def check_ids_on_host(topk_idx: torch.Tensor, num_experts: int) -> None:
    """``ValueError`` naming the first expert id of ``topk_idx`` (a CPU tensor) outside ``[-1,
    num_experts)``. On CPU this costs no device sync; on a GPU the routing kernel checks instead
    and the error comes at the next call or ``synchronize()`` (those ids are treated as -1)."""
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    if bool(bad.any()):
        v = topk_idx[bad][0].item()
        raise ValueError(f"topk_idx: expected expert ids in [-1, {num_experts}), got {v}")


def token_shape(parts: Parts, T: int) -> tuple:
    """``(structure, (T, BT, NC))`` of a dispatch of ``T`` tokens: its chunking
    (``chunking``: BT tokens a chunk, NC chunks), and the launch structure it selects, which its
    replays are keyed by besides the signature: None at decode sizes (``T * topk <= DIRECT_MAX``:
    the dispatch launch alone), else the routing histogram's grid and block, ``(NC, pow2(BT))``.
    T, BT and NC are the replay's scalars (``_SCALARS``). Kept per T in ``parts.calls.token_shapes``
    (T <= max_tokens: bounded), which the fast path reads first."""
    BT, NC = chunking(T, parts.shape.chunks)
    got = parts.calls.token_shapes[T] = (None if T * parts.shape.topk <= DIRECT_MAX else (NC, pow2(BT)), (T, BT, NC))
    return got


def replayed(parts: Parts, buffer, x, topk_idx, topk_weights, x_scales=None, hooked: bool = False):
    """The eager fast path: a dispatch (with a receive hook or without, as ``hooked``) whose
    tensors are like those of the latest replayed one of its kind, with or without ``x_scales``
    (``Replay.latest``: its guard passes, every pointer
    16-byte aligned; any token count of the same launch structure, at most ``max_tokens``, the
    same in every input) on a buffer whose full path would pass without a word (open, not broken,
    no kernel or proxy error record, no receive hook pending) launches as that one did with this
    call's pointers and token count. Returns its ``DispatchResult`` (naming ``buffer``, the
    ``EPBuffer`` of ``parts``; ``hooked``: and the hook, which launches the recorded receive half;
    across nodes, without a hook, the receive half goes at once), or None where the path does not
    apply (then ``dispatch`` decides, with every check).

    ``Replay.latest`` and ``_dispatched`` are written out here: each Python call costs ~0.1 us
    on a CPU and more on a slow host, and this is the whole host time of an eager decode dispatch
    but the launch (issue "Eager calls at the speed of a graph")."""
    calls = parts.calls
    replays = calls.hooked if hooked else calls.replays
    last = (replays.dispatch if x_scales is None else replays.dispatch_scales).last
    if last is None or not calls.ready():
        return None
    tensors = (x, topk_idx, topk_weights) if x_scales is None else (x, topk_idx, topk_weights, x_scales)
    if last.exact.check(*tensors):  # the entry's own token count
        scalars = last.scalars
    else:  # another token count: the inputs must agree on it (the guard leaves it free)
        if not last.guard.check(*tensors):
            return None
        T = x.shape[0]
        if T > parts.shape.max_tokens or topk_idx.shape[0] != T or topk_weights.shape[0] != T or \
                (x_scales is not None and x_scales.shape[0] != T):
            return None
        structure, scalars = calls.token_shapes.get(T) or token_shape(parts, T)
        if last.extra != structure:
            return None
    p, q, r = x.data_ptr(), topk_idx.data_ptr(), topk_weights.data_ptr()
    s = calls.err_ptr if x_scales is None else x_scales.data_ptr()  # (the error record: the kernel's placeholder)
    if (p | q | r | s) & 15:  # (the guard was kept only for an entry whose pointers were all aligned)
        return None
    # the dispatch kernel's input pointers (its arguments 0-3), then the scalars (_SCALARS)
    inputs = (p, s, q, r) + scalars
    last.run(calls.launch.stream(), inputs)
    if last.later and not hooked:  # across nodes: the receive half now (under the interpreter, after the host waits)
        if parts.interp:
            host_wait.wait_dispatch(parts, calls.epochs[0] + 1)
        last.run_later(calls.launch.stream(), inputs)
    calls.epochs[0] += 1
    calls.serial += 1
    result = DispatchResult.issued(calls.result_fields, buffer, scalars[0], calls.serial)
    if hooked:
        return result, calls.make_hook("dispatch", replayed_recv(parts, last, inputs, host_wait.wait_dispatch,
                                                                 calls.epochs[0]), parts.check_usable, parts.interp)
    if parts.interp:
        parts.check_usable()
    return result


# The launch arguments a replayed dispatch patches besides its pointers, by name: their index
# among its scalars (moe_ep.ops.replay).
_SCALARS = {"T": 0, "BT": 1, "NC": 2}


def dispatch(parts: Parts, buffer, x, topk_idx, topk_weights, x_scales: Optional[torch.Tensor] = None,
             return_recv_hook: bool = False, latest_tried: bool = False):
    """The full path of ``EPBuffer.dispatch`` on ``parts`` (its result names ``buffer``, the
    ``EPBuffer``; ``latest_tried``: ``replayed`` missed just before, as ``Replay.find`` takes it),
    its checks starting with ``Parts.check_usable``."""
    parts.check_usable()
    calls, shape, mem = parts.calls, parts.shape, parts.memory
    if calls.pending is not None:
        calls.check_no_pending("dispatch")
    T = validate(parts, x, topk_idx, topk_weights, x_scales)
    launch_structure, scalars = calls.token_shapes.get(T) or token_shape(parts, T)
    _, BT, NC = scalars
    direct = launch_structure is None  # decode sizes: the send half counts earlier selections itself
    # Replays (moe_ep.ops.replay), one per set of inputs (with and without x_scales), for calls
    # without and with a receive hook.
    replay = (calls.hooked if return_recv_hook else calls.replays).of_dispatch(x_scales is not None)
    sized = mem.per_call
    if sized:
        # Sized per call: no replays (each call reads its rows on the host); under CUDA graph
        # capture (no host read there) the worst case, allocated once, as with max_recv_rows="worst".
        replay = NO_REPLAY
        if capturing(mem.device):
            _fit(parts, shape.worst_rows)
            sized = False
    tensors = (x, topk_idx, topk_weights) if x_scales is None else (x, topk_idx, topk_weights, x_scales)
    hit, sig, ptrs = replay.find(tensors, launch_structure, latest_tried)
    # The dispatch kernel's input pointers (its arguments 0-3), the replayed ones.
    inputs = (ptrs[0], ptrs[3] if x_scales is not None else calls.err_ptr, ptrs[1], ptrs[2]) if ptrs else ()
    if hit is not None:
        hit.run(calls.launch.stream(), inputs + scalars)
        recv = replayed_recv(parts, hit, inputs + scalars, host_wait.wait_dispatch, calls.epochs[0] + 1) \
            if hit.later else None
        if recv is not None and not return_recv_hook:  # across nodes: the receive half now
            recv()
            recv = None
        return _dispatched(parts, buffer, T, recv)
    fp8_in = x_scales is not None
    # This rank's own rows come from x in the receive half (no round trip through the workspace),
    # so x must still hold them then: true within one call (stream order), not across a receive
    # hook (the caller may reuse x meanwhile).
    own_x = not return_recv_hook
    launches = []
    if T > 0 and not direct:
        hist_args = runtime_args(route_hist_kernel, topk_ptr=topk_idx, hist_ptr=mem.hist, state_ptr=mem.state,
                                 err_ptr=mem.err, T=T, BT=BT)
        launches.append((calls.launch(("hist", NC, pow2(BT), topk_idx.dtype, aligned(topk_idx)), route_hist_kernel,
                                      NC, hist_args, lambda: _hist_consts(parts, BT), _HIST_DYNAMIC), hist_args))
    # (where an argument has no tensor in this buffer, a placeholder the kernel never touches)
    xs = x_scales if fp8_in else mem.err
    out_s = mem.expert_scales if shape.fp8 else mem.err
    offsets = mem.expert_offsets if mem.expert_offsets is not None else mem.expert_counts
    rp = mem.remote
    named = dict(
        x_ptr=x.view(torch.uint8) if fp8_in else x, xs_ptr=xs, topk_ptr=topk_idx, w_ptr=topk_weights,
        hist_ptr=mem.hist, peer_ptr=mem.workspace.peer_ptrs, ws=calls.ws_ptr, state_ptr=mem.state, err_ptr=mem.err,
        out_x_ptr=mem.expert_x_words, out_s_ptr=out_s, counts_ptr=mem.expert_counts,
        offsets_ptr=offsets, recv_pos_ptr=mem.recv_pos, scratch_ptr=mem.scratch, sel_ptr=mem.scratch,
        route_ptr=mem.route_idx, T=T, BT=BT, NC=NC, timeout_ns=calls.timeout_ns, **_rows_args(parts))
    key = ("dispatch", fp8_in, direct, own_x, topk_idx.dtype, aligned(x), aligned(xs), aligned(topk_idx),
           aligned(topk_weights))
    epoch = calls.epochs[0] + 1
    consts = lambda: _dispatch_consts(parts, fp8_in, direct, own_x)  # noqa: E731
    if sized:
        return _dispatch_sized(parts, buffer, T, launches, key, named, consts, epoch, return_recv_hook)
    if rp is not None:
        recv = _dispatch_across_nodes(parts, rp, replay, sig, tensors, launches, inputs, scalars, key, named, consts,
                                      epoch, return_recv_hook)
        return _dispatched(parts, buffer, T, recv)
    args = runtime_args(node_dispatch_kernel, **named)
    if not return_recv_hook:
        launches += launch_halves(parts, key, node_dispatch_kernel, args, _DISPATCH_DYNAMIC, consts,
                                  lambda: host_wait.wait_dispatch(parts, epoch), parts.tuning.fused)
        replay.record(sig, tensors, launches, inputs, None, _SCALARS, scalars)
        recv = None
    else:
        send = launch_half(parts, key, node_dispatch_kernel, args, _DISPATCH_DYNAMIC, consts, True, False)
        # recorded once the receive half has a plan (a hook of an earlier call launched it)
        later = planned_half(parts, key, False, True)
        if later is not None:
            replay.record(sig, tensors, launches + [(send, args)], inputs, None, _SCALARS, scalars,
                          later=[(later, args)])

        def recv():
            if parts.interp:
                host_wait.wait_dispatch(parts, epoch)
            launch_half(parts, key, node_dispatch_kernel, args, _DISPATCH_DYNAMIC, consts, False, True)
    return _dispatched(parts, buffer, T, recv)


def _dispatch_across_nodes(parts: Parts, rp, replay, sig, tensors, launches: list, inputs: tuple, scalars: tuple,
                           key: tuple, named: dict, consts, epoch: int, hooked: bool):
    """The dispatch with peers on other nodes (``moe_ep.internode``): the send half (remote peers'
    headers and rows, each peer's bell as soon as it is packed, then the node stores), then, at
    once or in the hook, the receive half (node rows placed with the whole count matrix, remote
    rows as they land); without a hook one launch doing both where ``tuning.fused_internode``.
    Recorded for replays like a node call with a hook: the launch made when the call is made,
    the receive half (two launches) ``later``. Returns the receive half for a hook, else None."""
    args = runtime_args(internode_dispatch_kernel, **{**named, **rp.dispatch_args()})
    remote_consts = lambda: internode_consts(parts, consts(), rp.dispatch_consts(parts.shape.block_t))  # noqa: E731
    key = key + ("across nodes",)
    if not hooked:
        done = launch_halves(parts, key, internode_dispatch_kernel, args, _REMOTE_DYNAMIC, remote_consts,
                             lambda: host_wait.wait_dispatch(parts, epoch), parts.tuning.fused_internode)
        replay.record(sig, tensors, launches + done[:1], inputs, None, _SCALARS, scalars, later=done[1:])
        return None
    send = launch_half(parts, key, internode_dispatch_kernel, args, _REMOTE_DYNAMIC, remote_consts, True, False)

    def recv():
        if parts.interp:
            host_wait.wait_dispatch(parts, epoch)
        launch_half(parts, key, internode_dispatch_kernel, args, _REMOTE_DYNAMIC, remote_consts, False, True)
    # the receive half's plan, where an earlier call's hook launched it
    later = planned_half(parts, key, False, True)
    if later is not None:
        replay.record(sig, tensors, launches + [(send, args)], inputs, None, _SCALARS, scalars, later=[(later, args)])
    return recv


class _NoReplay:
    """The ``Replay`` of a packed or rows buffer sized per call: it finds and records nothing (each call
    reads its rows on the host between its halves, which a replayed launch would skip)."""

    def find(self, tensors, structure, latest_tried):
        return None, None, ()

    def record(self, *args, **kw) -> None:
        pass


NO_REPLAY = _NoReplay()


def _fit(parts: Parts, rows: int) -> None:
    """The expert layout holds ``rows`` rows (``BufferMemory.fit_rows``), which every
    ``DispatchResult`` from now on shows."""
    parts.memory.fit_rows(rows)
    parts.calls.result_fields.update(parts.memory.result_fields())


def recv_rows(parts: Parts, epoch: int) -> int:
    """Sized per call, between a dispatch's send and receive halves: the rows it brings this rank in
    dispatch ``epoch``, from the headers (packed: ``offsets[-1]``, each local expert's selections
    from every source, padded to ``expert_alignment``; rows: ``num_recv``, each source's rows).
    One launch of ``recv_total_kernel`` (it waits for the headers), then one host read: on a GPU
    after a stream sync, the cost of DeepEP's normal-mode dispatch without ``num_worst_tokens``;
    under the interpreter after the host's wait. Raises the recorded error where a header did not
    come."""
    mem, calls = parts.memory, parts.calls
    rp = mem.remote
    if rp is None:
        remote = dict(hdr_recv_ptr=mem.err, own_ptr=mem.scratch, sel_ptr=mem.scratch, rows_from_ptr=mem.scratch,
                      mb_ptr=mem.err, rtimeout_ns=0, spins=0)
    else:
        st = rp.state
        remote = dict(hdr_recv_ptr=rp.regions["hdr_recv"], own_ptr=st.own, sel_ptr=st.sel, rows_from_ptr=st.rows_from,
                      mb_ptr=rp.mailbox, rtimeout_ns=rp.rtimeout_ns, spins=rp.spins)
    args = runtime_args(recv_total_kernel, ws=calls.ws_ptr, state_ptr=mem.state, err_ptr=mem.err,
                        need_ptr=mem.recv_need, timeout_ns=calls.timeout_ns, **remote)
    calls.launch(("recv_total",), recv_total_kernel, 1, args, lambda: _recv_total_consts(parts), ())
    if mem.device.type == "cuda":
        torch.cuda.current_stream(mem.device).synchronize()
    need = int(mem.recv_need[0])
    if need < 0:
        parts.check_usable()  # (raises what the kernel recorded)
        raise RuntimeError(f"rank {parts.rank}: dispatch epoch {epoch}: the headers did not come and "
                           f"no error was recorded")
    return need


def _recv_total_consts(parts: Parts) -> dict:
    """``recv_total_kernel``'s constexprs."""
    s, rp = parts.shape, parts.memory.remote
    return dict(off_hflag=s.offsets["hdr_flag"], off_hdr=s.offsets["hdr"], NODE0=parts.node0, ME=parts.rank,
                N=s.node_size, R=s.world_size, EL=s.num_local_experts, HDR=s.workspace.HDR,
                REM_HDR=rp.spec.hdr_bytes if rp is not None else 16, ALIGN=s.expert_alignment, GLOBAL=rp is not None,
                BLOCK_R=pow2(s.world_size, 2), BLOCK_EL=s.block_el, INTERP=parts.interp, ROWS=s.layout == "rows",
                num_warps=1)


def _dispatch_sized(parts: Parts, buffer, T: int, launches: list, key: tuple, named: dict, consts, epoch: int,
                    hooked: bool):
    """A dispatch sized per call (packed or rows): the send half, then (at once, or in the hook) the
    rows it brings read on the host (``recv_rows``), the received tensors fitted to them, and the
    receive half writing into them. ``launches``: the routing histogram's, issued already."""
    rp = parts.memory.remote
    if rp is None:
        kernel, extra, dynamic, all_consts = node_dispatch_kernel, {}, _DISPATCH_DYNAMIC, consts
    else:
        kernel, extra, dynamic = internode_dispatch_kernel, rp.dispatch_args(), _REMOTE_DYNAMIC
        all_consts = lambda: internode_consts(parts, consts(), rp.dispatch_consts(parts.shape.block_t))  # noqa: E731
        key = key + ("across nodes",)
    launch_half(parts, key, kernel, runtime_args(kernel, **{**named, **extra}), dynamic, all_consts, True, False)
    result = []

    def recv():
        if parts.interp:
            host_wait.wait_dispatch(parts, epoch)
        _fit(parts, recv_rows(parts, epoch))
        mem = parts.memory
        out = dict(named, out_x_ptr=mem.expert_x_words, out_s_ptr=mem.expert_scales if parts.shape.fp8 else mem.err,
                   **_rows_args(parts))
        # (the receive half's plan keeps the received tensors' addresses: one plan per allocation)
        launch_half(parts, key + ("rows at",) + mem.recv_row_ptrs(), kernel, runtime_args(kernel, **{**out, **extra}),
                    dynamic, all_consts, False, True)
        if result:  # a hook's: the result issued with the send half shows the rows now
            fields = parts.calls.result_fields
            result[0].__dict__.update({k: fields[k] for k in RECV_ROW_ALLOCS})
    if not hooked:
        recv()
        return _dispatched(parts, buffer, T, None)
    out = _dispatched(parts, buffer, T, recv)
    result.append(out[0])
    return out


def _dispatched(parts: Parts, buffer, T: int, recv):
    """The end of a dispatch of ``T`` tokens just issued (``recv``: its receive half, for a hook):
    its ``DispatchResult``, naming ``buffer``."""
    calls = parts.calls
    calls.epochs[0] += 1
    calls.serial += 1
    return finish(parts, "dispatch", DispatchResult.issued(calls.result_fields, buffer, T, calls.serial), recv)


# The arguments that may change between calls of one launch key (the caller's; the rest is the buffer's).
_DISPATCH_DYNAMIC = arg_positions(node_dispatch_kernel, "x_ptr", "xs_ptr", "topk_ptr", "w_ptr", "T", "BT", "NC")
_REMOTE_DYNAMIC = arg_positions(internode_dispatch_kernel, "x_ptr", "xs_ptr", "topk_ptr", "w_ptr", "T", "BT", "NC")
_HIST_DYNAMIC = arg_positions(route_hist_kernel, "topk_ptr", "T", "BT")


def _rows_args(parts: Parts) -> dict:
    """The dispatch kernel's rows-layout arguments (rows_from, recv ids, weights, source, count);
    other layouts pass a placeholder, which the kernel never touches."""
    names = ("rows_from_ptr", "recv_ids_ptr", "recv_wts_ptr", "recv_src_ptr", "num_recv_ptr")
    mem = parts.memory
    if parts.shape.layout != "rows":
        return dict.fromkeys(names, mem.scratch)
    return dict(zip(names, (mem.scratch, mem.recv_topk_idx, mem.recv_topk_weights, mem.recv_src, mem.num_recv)))


def own_prefetch_depth(parts: Parts, fp8_in: bool) -> int:
    """Sub-blocks ahead the rows dispatch asks the L2 for its own rows (``prefetch_l2``): one when
    it quantizes to fp8 on at most 32 programs, else none. One H200, T=4096, kernel p50: fp8 at 32
    programs 49.1 against 52.6 us without (2 ahead 53.5, 4 ahead 55.4); bf16 at 32 programs and
    both at 132 are slower with it (57.0 / 50.0, 39.2 / 35.5 fp8 at 132)."""
    shape = parts.shape
    if parts.tuning.prefetch is not None:
        return parts.tuning.prefetch
    return 1 if shape.layout == "rows" and shape.fp8 and not fp8_in and shape.num_programs <= 32 else 0


def _hist_consts(parts: Parts, BT: int) -> dict:
    """The routing histogram's constexprs for chunks of ``BT`` tokens."""
    s = parts.shape
    return dict(E=s.num_experts, K=s.topk, CMAX=s.chunks, BLOCK_T=pow2(BT), BLOCK_K=pow2(s.topk, 2),
                BLOCK_E=pow2(s.num_experts, 2), ROWS=s.layout == "rows", N=s.node_size, NODE0=parts.node0,
                EL=s.num_local_experts, BLOCK_N=pow2(s.node_size, 2),
                RANKS=s.world_size if parts.memory.remote is not None else 0, BLOCK_RANKS=pow2(s.world_size, 2),
                num_warps=parts.tuning.hist_warps)


def _dispatch_consts(parts: Parts, fp8_in: bool, direct: bool, own_x: bool) -> dict:
    """The dispatch kernel's constexprs (all fixed by the buffer, except PREQ, DIRECT and OWN_X): in
    its groups (``OFF``, ``DIM``, ``MODE``, ``TILE``: ``moe_ep.kernels.args``), which the inter-node
    kernels take as one (``calls.internode_consts``), and one by one, as tools read them (each
    launch picks the names its kernel declares)."""
    s, t = parts.shape, parts.tuning
    dims = node_dims(parts)
    off, H, W, nb, BLOCK_T = s.offsets, s.hidden, dims["W"], dims["NB"], s.block_t
    S = t.stages
    # fp8 tiles hold whole 128-channel scale blocks, whatever the pipelining budget says
    def channels(tokens):  # channels per payload tile of ``tokens`` rows
        return max(128 if s.fp8 else 16, pipelined_width(min(pow2(H), 8192 * t.tile // tokens), S,
                                                         tokens * (1 if fp8_in else 2)))
    block_h = channels(BLOCK_T)
    block_w = pipelined_width(max(16, min(pow2(W), 2048 * t.tile, 4096 * t.tile // BLOCK_T)), S, BLOCK_T * 4)
    flat = dict(off_hflag=off["hdr_flag"], off_dflag=off["disp_flag"], off_hdr=off["hdr"], off_meta_i=off["meta_i"],
                off_meta_w=off["meta_w"], off_rows=off["rows"], off_cflag=off["comb_flag"], **dims,
                GLOBAL=parts.memory.remote is not None, FP8=s.fp8, PREQ=fp8_in, DIRECT=direct,
                PACKED=s.layout == "packed", BLOCK_T=BLOCK_T, BLOCK_K=pow2(s.topk, 2), BLOCK_C=min(s.chunks, 64),
                BLOCK_H=block_h, BLOCK_TS=t.block_ts, BLOCK_HS=channels(t.block_ts),
                BLOCK_EL=s.block_el, BLOCK_W=block_w, BLOCK_NB=pow2(nb, 2), STAGES=S, INTERP=parts.interp,
                ROWS=s.layout == "rows", OWN_X=own_x, PREFETCH=own_prefetch_depth(parts, fp8_in),
                CM_ROWS=s.scale_column_rows, **parts.launch_options("dispatch"))
    c = not parts.interp
    return dict(flat, OFF=constexprs(Offsets, off, c), DIM=constexprs(Dims, flat, c),
                MODE=constexprs(DispatchModes, flat, c), TILE=constexprs(DispatchTiles, flat, c))
