"""Combine: validation and the combine kernel (one launch on a GPU; its send and receive halves as
two launches under the interpreter)."""
from __future__ import annotations

from typing import Optional

import torch

from . import host_wait
from .calls import (Parts, Replays, Weights, aligned, check_tensor, finish, internode_consts, launch_half,
                    launch_halves, node_dims, planned_half, replayed_recv)
from ..core.workspace import pow2
from ..kernels.args import CombineModes, CombineTiles, Dims, Offsets, constexprs
from ..kernels.combine import node_combine_kernel
from ..internode.combine_kernels import internode_combine_kernel
from ..kernels.launch import arg_positions, runtime_args
from .result import DispatchResult
from ..core.tuning import pipelined_width

# The arguments that may change between calls of one launch key (the caller's; the rest is the
# buffer's): with combine-time weights also the weights' (and their sums') pointers.
_DYNAMIC = arg_positions(node_combine_kernel, "y_ptr", "out_ptr", "T")
_WEIGHTED_DYNAMIC = _DYNAMIC + arg_positions(node_combine_kernel, "wy_ptr", "wout_ptr", "cw_ptr")
# The same of the inter-node kernel (moe_ep.internode)
_REMOTE_DYNAMIC = arg_positions(internode_combine_kernel, "y_ptr", "out_ptr", "T")
_REMOTE_WEIGHTED = _REMOTE_DYNAMIC + arg_positions(internode_combine_kernel, "wy_ptr", "wout_ptr", "cw_ptr")


# The launch argument a replayed combine patches besides its pointers (moe_ep.ops.replay).
_SCALARS = {"T": 0}


def replayed(parts: Parts, buffer, expert_y, handle, out, topk_weights=None, hooked: bool = False):
    """The eager fast path of a combine (with a receive hook or without, as ``hooked``): as
    ``dispatch.replayed`` (the latest replayed combine of its kind with or without ``out``, with
    or without combine-time weights, for the latest dispatch's handle of ``buffer``, the
    ``EPBuffer`` of ``parts``, any token count; its ``Replay.latest`` and ``_combined`` written
    out); returns the output (``hooked``: and the hook), or None where the path does not apply
    (then ``combine`` decides, with every check)."""
    calls = parts.calls
    if (type(handle) is not DispatchResult or handle.buffer is not buffer or handle.serial != calls.serial
            or not calls.ready() or (calls.remote and parts.memory.remote.combined == handle.serial)):
        return None  # (combine raises the error)
    T = handle.num_tokens
    replays = calls.hooked if hooked else calls.replays
    if topk_weights is not None:
        got = _replayed_weighted(parts, replays, expert_y, topk_weights, out, T)
        if got is None:
            return None
        out, last, inputs = got
    elif out is None:
        last = replays.combine.last
        if last is None or not last.guard.check(expert_y):
            return None
        p = expert_y.data_ptr()
        if p & 15:  # (the guard was kept only for an entry whose pointers were all aligned)
            return None
        out = new_output(parts, T)
        inputs = (p, out.data_ptr(), T)
        last.run(calls.launch.stream(), inputs)
    else:
        last = replays.combine_out.last
        if last is None:
            return None
        if not (last.exact.check(expert_y, out) and T == last.scalars[0]) and \
                not (last.guard.check(expert_y, out) and out.shape[0] == T):
            return None  # (the guard leaves out's token count free: it must be the handle's)
        p, q = expert_y.data_ptr(), out.data_ptr()
        y_bytes, row_bytes = last.value
        if (p | q) & 15 or _spans_meet(p, q, y_bytes, T * row_bytes):
            return None  # (an out over expert_y: combine raises the error)
        inputs = (p, q, T)
        last.run(calls.launch.stream(), inputs)
    if calls.remote:
        parts.memory.remote.claim_combine(handle.serial)
        if not hooked:  # across nodes: the receive half now (under the interpreter, after the host waits)
            if parts.interp:
                host_wait.wait_combine(parts, calls.epochs[1] + 1, T)
            last.run_later(calls.launch.stream(), inputs)
    calls.epochs[1] += 1
    if hooked:
        return out, calls.make_hook("combine", replayed_recv(parts, last, inputs, host_wait.wait_combine,
                                                             calls.epochs[1], T), parts.check_usable, parts.interp)
    if parts.interp:
        parts.check_usable()
    return out


def _replayed_weighted(parts: Parts, replays: Replays, expert_y, topk_weights, out, T: int):
    """``replayed`` with combine-time weights from ``replays`` (the buffer's, or its hooked ones):
    masked and packed layouts push them to the owners (``[T, K]``); the rows layout's are per
    received row (``[rows of expert_x, K]``) and their sums come back in a new ``[T, K]`` tensor.
    Launches and returns ``(result, entry, inputs)``, or None."""
    rows = parts.shape.layout == "rows"
    tensors = (expert_y, topk_weights) if out is None else (expert_y, topk_weights, out)
    if rows:  # (Replays.of_combine, written out: this runs on every call)
        last = (replays.rows_weights if out is None else replays.rows_weights_out).last
    else:
        last = (replays.pushed if out is None else replays.pushed_out).last
    if last is None:
        return None
    if not (last.exact.check(*tensors) and T == last.scalars[0]) and \
            not (last.guard.check(*tensors) and all(t.shape[0] == T for t in tensors[1 + rows:])):
        return None  # (the guard leaves the token counts free: they must be the handle's)
    p, w = expert_y.data_ptr(), topk_weights.data_ptr()
    q = out.data_ptr() if out is not None else 0
    if (p | w | q) & 15:  # (the guard was kept only for an entry whose pointers were all aligned)
        return None
    if out is None:
        out = new_output(parts, T)
        q = out.data_ptr()
    else:
        y_bytes, row_bytes = last.value
        if _spans_meet(p, q, y_bytes, T * row_bytes):
            return None  # (an out over expert_y: combine raises the error)
    calls = parts.calls
    if rows:
        wout = new_weight_sums(parts, T)
        inputs = (p, q, w, wout.data_ptr(), calls.err_ptr, T)
        result = out, wout
    else:
        inputs, result = (p, q, w, calls.err_ptr, T), out
    last.run(calls.launch.stream(), inputs)
    return result, last, inputs


def _spans_meet(p: int, q: int, p_bytes: int, q_bytes: int) -> bool:
    """Whether the byte spans [p, p + p_bytes) and [q, q + q_bytes) share a byte."""
    return p < q + q_bytes and q < p + p_bytes


def combine(parts: Parts, buffer, expert_y: torch.Tensor, handle, return_recv_hook: bool = False, topk_weights=None,
            out=None, latest_tried: bool = False):
    """The full path of ``EPBuffer.combine`` on ``parts`` (``handle`` must be the latest result of
    ``buffer``, the ``EPBuffer``; ``latest_tried``: ``replayed`` looked the call up just before and
    missed), its checks starting with ``Parts.check_usable``."""
    parts.check_usable()
    calls, shape, mem = parts.calls, parts.shape, parts.memory
    dev = mem.device
    if calls.pending is not None:
        calls.check_no_pending("combine")
    if not isinstance(handle, DispatchResult) or handle.buffer is not buffer:
        raise TypeError("handle: expected the DispatchResult returned by this buffer's dispatch")
    if handle.serial != calls.serial:
        raise ValueError("handle: stale; a later dispatch on this buffer replaced its routing "
                         "(combine the latest dispatch, or use one buffer per in-flight layer)")
    rows = shape.layout == "rows"
    T = handle.num_tokens
    if isinstance(out, torch.Tensor) and isinstance(expert_y, torch.Tensor) and \
            _spans_meet(expert_y.data_ptr(), out.data_ptr(), expert_y.nbytes, out.nbytes):
        # (checked before any launch, replayed or not: the kernel would read rows it has overwritten)
        raise ValueError("out: overlaps expert_y in memory (combine reads expert_y while it writes out); "
                         "pass a separate tensor")
    check_tensor("expert_y", expert_y, (torch.bfloat16,), tuple(handle.expert_x.shape), dev)
    if out is not None:
        check_tensor("out", out, (torch.bfloat16, torch.float32), (T, shape.hidden), dev)
    rp = mem.remote
    if rp is not None and rp.combined == handle.serial:
        rp.claim_combine(handle.serial)  # (raises: the proxy serves one combine per dispatch)
    # masked/packed: weights at combine, per source token, pushed to the owners over the dispatch's
    push = topk_weights is not None and not rows
    if topk_weights is not None:
        if rows:
            check_tensor("topk_weights", topk_weights, (torch.float32,), (handle.expert_x.shape[0], shape.topk), dev)
        else:
            check_tensor("topk_weights", topk_weights, (torch.float32,), (T, shape.topk), dev)
            if rp is not None:
                raise ValueError(f"topk_weights: combine-time weights reach node peers only; with other nodes "
                                 f"(node_size={shape.node_size} < world_size={shape.world_size}) pass them to "
                                 f"dispatch")
    # Replays (moe_ep.ops.replay), without and with a receive hook. One Replay per set of inputs:
    # expert_y, then the weights (pushed, or the rows layout's), then out if given; T, from the
    # handle, is a scalar (_SCALARS). The rows layout's weight sums come back in a new tensor,
    # allocated per call like the output, whose pointer the replay patches too.
    given_out = out is not None
    weights = Weights.NONE if topk_weights is None else Weights.PUSHED if push else Weights.ROWS
    tensors = (expert_y,) + ((topk_weights,) if topk_weights is not None else ()) + ((out,) if given_out else ())
    replay = (calls.hooked if return_recv_hook else calls.replays).of_combine(weights, given_out)
    hit, sig, ptrs = replay.find(tensors, None, latest_tried)
    out_f32 = out is not None and out.dtype == torch.float32
    if out is None:
        out = new_output(parts, T)
    wout = new_weight_sums(parts, T) if rows and topk_weights is not None else None
    result = (out, wout) if wout is not None else out

    def pointers() -> tuple:  # the call's pointers, as its replays take them (_inputs)
        return _inputs(parts, ptrs[0], out.data_ptr(), ptrs[1] if topk_weights is not None else None, wout)
    if hit is not None:
        inputs = pointers() + (T,)
        if rp is not None:
            rp.claim_combine(handle.serial)
        hit.run(calls.launch.stream(), inputs)
        recv = replayed_recv(parts, hit, inputs, host_wait.wait_combine, calls.epochs[1] + 1, T) if hit.later else None
        if recv is not None and not return_recv_hook:  # across nodes: the receive half now
            recv()
            recv = None
        return _combined(parts, result, recv)
    # This rank's own tokens' rows are read from expert_y by the receive half (rows layout: as they
    # are; masked/packed: pre-reduced there), not across a hook (the caller may reuse expert_y).
    own_y = not return_recv_hook
    # The dispatch's expert ids, kept by the buffer (rows [0, T)): the caller's topk_idx may be reused.
    # (where an argument has no tensor in this call, the error record: a placeholder never touched)
    named = dict(y_ptr=expert_y, topk_ptr=mem.route_idx, out_ptr=out, ws=calls.ws_ptr,
                 peer_ptr=mem.workspace.peer_ptrs, state_ptr=mem.state, err_ptr=mem.err, recv_pos_ptr=mem.recv_pos,
                 timeout_ns=calls.timeout_ns, T=T, wy_ptr=topk_weights if wout is not None else mem.err,
                 wout_ptr=wout if wout is not None else mem.err, cw_ptr=topk_weights if push else mem.err,
                 xrows_ptr=mem.err, xrecv_ptr=mem.err)
    key = ("combine", aligned(expert_y), aligned(out), own_y, wout is not None, push, out_f32)
    epoch = calls.epochs[1] + 1
    # A fused launch pushes the weights itself; else the push is a launch of its own, before the
    # send half (which waits for every peer's push). A float32 ``out`` takes the sum itself.
    consts = lambda: _combine_consts(parts, own_y, wout is not None, push, out_f32)  # noqa: E731
    # (value: with the caller's out, the bytes of expert_y and of a row of out, which the
    # entry's guard fixes: the fast path checks that they do not overlap)
    spans = (expert_y.nbytes, shape.hidden * out.element_size()) if given_out else None
    if rp is not None:
        rp.claim_combine(handle.serial)
        recv = _combine_across_nodes(parts, rp, replay, sig, tensors, pointers(), spans, T, key, named, consts,
                                     topk_weights is not None, epoch, return_recv_hook)
        return _combined(parts, result, recv)
    args = runtime_args(node_combine_kernel, **named)
    dyn = _WEIGHTED_DYNAMIC if topk_weights is not None else _DYNAMIC
    launches = []
    if push and not parts.tuning.fused:
        launches.append((calls.launch(key + ("push",), node_combine_kernel, shape.num_programs, args,
                                      lambda: dict(consts(), PUSH=True, SEND=False, RECV=False), dyn), args))
        if parts.interp:
            host_wait.wait_weights(parts, epoch)
    recorded = sig is not None
    if not return_recv_hook:
        launches += launch_halves(parts, key, node_combine_kernel, args, dyn, consts,
                                  lambda: host_wait.wait_combine(parts, epoch, T), parts.tuning.fused)
        if recorded:
            replay.record(sig, tensors, launches, pointers(), spans, _SCALARS, (T,))
        recv = None
    else:
        send = launch_half(parts, key, node_combine_kernel, args, dyn, consts, True, False)
        # recorded once the receive half has a plan (a hook of an earlier call launched it)
        later = planned_half(parts, key, False, True)
        if recorded and later is not None:
            replay.record(sig, tensors, launches + [(send, args)], pointers(), spans, _SCALARS, (T,),
                          later=[(later, args)])

        def recv():
            if parts.interp:
                host_wait.wait_combine(parts, epoch, T)
            launch_half(parts, key, node_combine_kernel, args, dyn, consts, False, True)
    return _combined(parts, result, recv)


def _combine_across_nodes(parts: Parts, rp, replay, sig, tensors, inputs: tuple, spans, T: int, key: tuple, named: dict,
                          consts, weighted: bool, epoch: int, hooked: bool):
    """The combine with peers on other nodes (``moe_ep.internode``): the send half (each remote
    source's rows pre-reduced, its bell as soon as they are, then the node stores), then, at once
    or in the hook, the receive half (every owner's partial rows summed, remote ones included, one
    rounding); without a hook one launch doing both where ``tuning.fused_internode``. Recorded like
    ``_dispatch_across_nodes``. Returns the receive half for a hook, else None."""
    args = runtime_args(internode_combine_kernel, **{**named, **rp.combine_args()})
    remote_consts = lambda: internode_consts(parts, consts(), rp.combine_consts())  # noqa: E731
    key = key + ("across nodes",)
    dyn = _REMOTE_WEIGHTED if weighted else _REMOTE_DYNAMIC
    if not hooked:
        done = launch_halves(parts, key, internode_combine_kernel, args, dyn, remote_consts,
                             lambda: host_wait.wait_combine(parts, epoch, T), parts.tuning.fused_internode)
        replay.record(sig, tensors, done[:1], inputs, spans, _SCALARS, (T,), later=done[1:])
        return None
    send = launch_half(parts, key, internode_combine_kernel, args, dyn, remote_consts, True, False)

    def recv():
        if parts.interp:
            host_wait.wait_combine(parts, epoch, T)
        launch_half(parts, key, internode_combine_kernel, args, dyn, remote_consts, False, True)
    later = planned_half(parts, key, False, True)  # (an earlier call's hook launched it, if any)
    if later is not None:
        replay.record(sig, tensors, [(send, args)], inputs, spans, _SCALARS, (T,), later=[(later, args)])
    return recv


_SHAPES = 64  # output shapes kept per buffer (views of one element, a few hundred bytes each)


def _inputs(parts: Parts, y: int, out: int, weights, wout=None) -> tuple:
    """The pointers a replayed combine patches, in its entries' order: ``expert_y`` and the
    output; with pushed weights then the weights and the buffer's error record (the kernel's
    placeholder for the rows layout's weight arguments); with the rows layout's weights then
    those, the new tensor ``wout`` of their sums, and the error record (the placeholder for the
    pushed weights)."""
    if weights is None:
        return y, out
    if wout is None:
        return y, out, weights, parts.calls.err_ptr
    return y, out, weights, wout.data_ptr(), parts.calls.err_ptr


def new_output(parts: Parts, T: int) -> torch.Tensor:
    """A new contiguous ``[T, hidden]`` bfloat16 tensor on the buffer's device. ``empty_like`` of
    a kept view of that shape (one element, expanded) skips the argument parsing of
    ``torch.empty(T, H, dtype=, device=)``: 2.0 against 2.4 us of host time per call on the
    H200 host (``profile_ops``, with a contiguous tensor as the model). No ``memory_format``
    argument (0.15 us of parsing on a CPU, ~0.4 on the slowest H200 host): a view with stride 0
    is not dense, so torch's preserved format is the contiguous one."""
    calls = parts.calls
    like = calls.out_like.get(T)
    if like is None:
        if len(calls.out_like) >= _SHAPES:
            calls.out_like.clear()
        like = calls.out_like[T] = calls.out_one.expand(T, parts.shape.hidden)
    return torch.empty_like(like)


def new_weight_sums(parts: Parts, T: int) -> torch.Tensor:
    """A new float32 ``[T, topk]`` tensor on the buffer's device: where a rows-layout combine with
    weights returns their sums (full path and replay alike)."""
    return torch.empty(T, parts.shape.topk, dtype=torch.float32, device=parts.memory.device)


def _combined(parts: Parts, result, recv):
    """The end of a combine just issued, returning ``result`` (``recv``: its receive half, for a hook)."""
    parts.calls.epochs[1] += 1
    return finish(parts, "combine", result, recv)


def _combine_consts(parts: Parts, own_y: bool, wts: bool, push: bool, out_f32: bool) -> dict:
    """The combine kernel's constexprs (all fixed by the buffer, except OWN_Y, with weights WIN/WOUT
    or WEIGHTS/PUSH, and BASE_F32): in its groups (``OFF``, ``DIM``, ``MODE``, ``TILE``:
    ``moe_ep.kernels.args``), which the inter-node kernels take as one (``calls.internode_consts``;
    ``XROWS``: theirs), and one by one, as tools read them (each launch picks the names its kernel
    declares). ``push``: combine-time weights pushed to the owners (a
    fused launch pushes them itself: ``PUSH``)."""
    s, t = parts.shape, parts.tuning
    off = s.offsets
    flat = dict(off_cflag=off["comb_flag"], off_wflag=off["wgt_flag"], off_hdr=off["hdr"], off_meta_w=off["meta_w"],
                off_comb=off["comb"], **node_dims(parts), BLOCK_T=s.block_t, BLOCK_K=pow2(s.topk, 2),
                BLOCK_H=_channel_tile(parts, t.combine_tile),
                BLOCK_HR=_channel_tile(parts, t.combine_recv_tile, t.combine_recv_tokens),
                BLOCK_TR=t.combine_recv_tokens, STAGES=t.stages, INTERP=parts.interp, ROWS=s.layout == "rows",
                OWN_Y=own_y, WIN=wts, WOUT=wts, off_comb_w=off["comb_w"], WEIGHTS=push, PUSH=push and t.fused,
                BASE_F32=out_f32, XROWS=parts.memory.remote is not None, **parts.launch_options("combine"))
    c = not parts.interp
    return dict(flat, OFF=constexprs(Offsets, off, c), DIM=constexprs(Dims, flat, c),
                MODE=constexprs(CombineModes, flat, c), TILE=constexprs(CombineTiles, flat, c))


def _channel_tile(parts: Parts, tile: int, tokens: Optional[int] = None) -> int:
    """Channels per combine loop step at payload tile scale ``tile`` for steps of ``tokens`` tokens
    (default a whole chunk, ``block_t``): 8192 * tile elements a step, and for a whole chunk at
    most 2048 * tile channels; K gathered rows of that many tokens must fit the pipelining budget
    when the loops are pipelined."""
    s = parts.shape
    t = tokens or s.block_t
    width = 8192 * tile // t if t < s.block_t else min(2048 * tile, 8192 * tile // t)
    return pipelined_width(max(16, min(pow2(s.hidden), width)), parts.tuning.stages, s.topk * t * 2)
