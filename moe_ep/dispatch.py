"""Dispatch: validation and the launches (routing histogram at prefill sizes; the dispatch kernel:
one launch on a GPU, its send and receive halves as two launches under the interpreter)."""
from __future__ import annotations

from typing import Optional

import torch

from . import host_wait
from .kernels.dispatch import dispatch_kernel
from .handle import DispatchResult
from .layout import chunking, pow2
from .kernels.launch import arg_positions, runtime_args
from .kernels.route import route_hist_kernel
from .internode.dispatch_kernels import internode_dispatch_recv_kernel, internode_dispatch_send_kernel


# Decode sizes: up to this many selections (T * K) a dispatch counts earlier selections in its own
# kernel (DIRECT) instead of launching the routing histogram first (cheaper than a launch there).
DIRECT_MAX = 2048


def on_device(t: torch.Tensor, device: torch.device) -> bool:
    """Whether tensor ``t`` is on ``device``: cheaper than comparing torch.device objects (this
    runs on every eager call)."""
    return t.is_cuda and t.get_device() == device.index if device.type == "cuda" else t.device == device


def _check_tensor(name: str, t, dtypes, shape, device) -> None:
    if (isinstance(t, torch.Tensor) and t.dtype in dtypes and len(t.shape) == len(shape)
            and all(s is None or a == s for a, s in zip(t.shape, shape)) and on_device(t, device) and t.is_contiguous()):
        return  # the common case, checked cheaply; below, the same checks one by one for the message
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and a != s for a, s in zip(t.shape, shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if not on_device(t, device):
        raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


def validate(buf, x, topk_idx, topk_weights, x_scales) -> int:
    """Checks every input against the buffer; returns T. Raises before any memory is touched."""
    dev, H, K = buf.device, buf.hidden, buf.topk
    if x_scales is None:
        _check_tensor("x", x, (torch.bfloat16,), (None, H), dev)
    else:
        if not buf.fp8:
            raise TypeError("x_scales: pre-quantized fp8 input needs an EPBuffer with dispatch_dtype=torch.float8_e4m3fn")
        _check_tensor("x", x, (torch.float8_e4m3fn,), (None, H), dev)
    T = x.shape[0]
    if T > buf.max_tokens:
        raise ValueError(f"x: expected at most max_tokens={buf.max_tokens} tokens, got {T}")
    if x_scales is not None:
        _check_tensor("x_scales", x_scales, (torch.float32,), (T, buf.num_scale_blocks), dev)
    _check_tensor("topk_idx", topk_idx, (torch.int32, torch.int64), (None, None), dev)
    if topk_idx.shape != (T, K):
        raise ValueError(f"topk_idx: expected shape [{T}, {K}] (tokens of x, topk of the buffer), got {list(topk_idx.shape)}")
    _check_tensor("topk_weights", topk_weights, (torch.float32,), (T, K), dev)
    if dev.type == "cpu" and T > 0:
        check_ids_on_host(topk_idx, buf.num_experts)
    return T


def check_ids_on_host(topk_idx: torch.Tensor, num_experts: int) -> None:
    """``ValueError`` naming the first expert id of ``topk_idx`` (a CPU tensor) outside ``[-1,
    num_experts)``. On CPU this costs no device sync; on a GPU the routing kernel checks instead
    and the error comes at the next call or ``synchronize()`` (those ids are treated as -1)."""
    bad = (topk_idx < -1) | (topk_idx >= num_experts)
    if bool(bad.any()):
        v = topk_idx[bad][0].item()
        raise ValueError(f"topk_idx: expected expert ids in [-1, {num_experts}), got {v}")


def launch_halves(buf, key: tuple, kernel, args: tuple, dynamic: tuple, consts, host_wait) -> list:
    """One launch doing both halves (``SEND`` and ``RECV``) where ``buf.fused``; else the send half,
    ``host_wait()`` under the interpreter (which cannot spin in a kernel), then the receive half.
    ``consts()`` gives the constexprs without SEND/RECV; ``key`` names what can change them;
    ``dynamic``: positions in ``args`` that may differ between calls (the rest is the buffer's).
    Returns ``(plan, args)`` of each launch (``moe_ep.replay``)."""
    if buf.fused:
        return [(launch_half(buf, key, kernel, args, dynamic, consts, True, True), args)]
    first = launch_half(buf, key, kernel, args, dynamic, consts, True, False)
    if buf.interp:
        host_wait()
    return [(first, args), (launch_half(buf, key, kernel, args, dynamic, consts, False, True), args)]


def launch_half(buf, key: tuple, kernel, args: tuple, dynamic: tuple, consts, send: bool, recv: bool):
    """One half's launch; returns its plan (``Launcher``)."""
    return buf.calls.launch(key + (send, recv), kernel, buf.num_programs, args,
                       lambda: dict(consts(), SEND=send, RECV=recv), dynamic)


def planned_half(buf, key: tuple, send: bool, recv: bool):
    """The plan of a half ``launch_half`` launched before with these arguments, or None."""
    return buf.calls.launch.planned(key + (send, recv))


def _aligned(t: torch.Tensor) -> bool:
    return (t.data_ptr() & 15) == 0


def token_shape(buf, T: int) -> tuple:
    """``(structure, (T, BT, NC))`` of a dispatch of ``T`` tokens on ``buf``: its chunking
    (``chunking``: BT tokens a chunk, NC chunks), and the launch structure it selects, which its
    replays are keyed by besides the signature: None at decode sizes (``T * topk <= DIRECT_MAX``:
    the dispatch launch alone), else the routing histogram's grid and block, ``(NC, pow2(BT))``.
    T, BT and NC are the replay's scalars (``_SCALARS``). Kept per T in ``buf.calls.token_shapes``
    (T <= max_tokens: bounded), which the fast path reads first."""
    BT, NC = chunking(T, buf.chunks)
    got = buf.calls.token_shapes[T] = (None if T * buf.topk <= DIRECT_MAX else (NC, pow2(BT)), (T, BT, NC))
    return got


def replayed(buf, x, topk_idx, topk_weights, x_scales=None, hooked: bool = False):
    """The eager fast path: a dispatch (with a receive hook or without, as ``hooked``) whose
    tensors are like those of the latest replayed one of its kind, with or without ``x_scales``
    (``Replay.latest``: its guard passes, every pointer
    16-byte aligned; any token count of the same launch structure, at most ``max_tokens``, the
    same in every input) on a buffer whose full path would pass without a word (open, not broken,
    no kernel or proxy error record, no receive hook pending) launches as that one did with this
    call's pointers and token count. Returns its ``DispatchResult`` (``hooked``: and the hook,
    which launches the recorded receive half; across nodes, without a hook, the receive half goes
    at once), or None where the path does not apply (then ``dispatch`` decides, with every check).

    ``Replay.latest`` and ``_dispatched`` are written out here: each Python call costs ~0.1 us
    on a CPU and more on a slow host, and this is the whole host time of an eager decode dispatch
    but the launch (issue "Eager calls at the speed of a graph")."""
    calls = buf.calls
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
        if T > buf.max_tokens or topk_idx.shape[0] != T or topk_weights.shape[0] != T or \
                (x_scales is not None and x_scales.shape[0] != T):
            return None
        structure, scalars = calls.token_shapes.get(T) or token_shape(buf, T)
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
        if buf.interp:
            host_wait.wait_dispatch(buf, calls.epochs[0] + 1)
        last.run_later(calls.launch.stream(), inputs)
    calls.epochs[0] += 1
    calls.serial += 1
    result = DispatchResult.issued(calls.result_fields, buf, scalars[0], calls.serial)
    if hooked:
        return result, calls.make_hook("dispatch", replayed_recv(buf, last, inputs, host_wait.wait_dispatch,
                                                                 calls.epochs[0]), buf.check_usable, buf.interp)
    if buf.interp:
        buf.check_usable()
    return result


def replayed_recv(buf, entry, inputs: tuple, wait, *wait_args):
    """The receive half of a replayed call with a hook: ``entry``'s later launches with the call's
    ``inputs``, on the stream current when the hook runs (under the interpreter after
    ``wait(buf, *wait_args)``, the host's wait for the peers' flags)."""
    def recv() -> None:
        if buf.interp:
            wait(buf, *wait_args)
        entry.run_later(buf.calls.launch.stream(), inputs)
    return recv


# The launch arguments a replayed dispatch patches besides its pointers, by name: their index
# among its scalars (moe_ep.replay).
_SCALARS = {"T": 0, "BT": 1, "NC": 2}


def dispatch(buf, x, topk_idx, topk_weights, x_scales: Optional[torch.Tensor] = None,
             return_recv_hook: bool = False, latest_tried: bool = False):
    """The full path (``latest_tried``: ``replayed`` missed just before, as ``Replay.find`` takes it)."""
    calls = buf.calls
    if calls.pending is not None:
        calls.check_no_pending("dispatch")
    T = validate(buf, x, topk_idx, topk_weights, x_scales)
    CMAX = buf.chunks
    launch_structure, scalars = calls.token_shapes.get(T) or token_shape(buf, T)
    _, BT, NC = scalars
    direct = launch_structure is None  # decode sizes: the send half counts earlier selections itself
    # Replays (moe_ep.replay), one per set of inputs (with and without x_scales), for calls
    # without and with a receive hook.
    replay = (calls.hooked if return_recv_hook else calls.replays).of_dispatch(x_scales is not None)
    tensors = (x, topk_idx, topk_weights) if x_scales is None else (x, topk_idx, topk_weights, x_scales)
    hit, sig, ptrs = replay.find(tensors, launch_structure, latest_tried)
    # The dispatch kernel's input pointers (its arguments 0-3), the replayed ones.
    inputs = (ptrs[0], ptrs[3] if x_scales is not None else calls.err_ptr, ptrs[1], ptrs[2]) if ptrs else ()
    if hit is not None:
        hit.run(calls.launch.stream(), inputs + scalars)
        recv = replayed_recv(buf, hit, inputs + scalars, host_wait.wait_dispatch, calls.epochs[0] + 1) \
            if hit.later else None
        if recv is not None and not return_recv_hook:  # across nodes: the receive half now
            recv()
            recv = None
        return _dispatched(buf, T, recv)
    fp8_in = x_scales is not None
    rows = buf.layout == "rows"
    # This rank's own rows come from x in the receive half (no round trip through the workspace),
    # so x must still hold them then: true within one call (stream order), not across a receive
    # hook (the caller may reuse x meanwhile).
    own_x = not return_recv_hook
    launches = []
    if T > 0 and not direct:
        hist_args = runtime_args(route_hist_kernel, topk_ptr=topk_idx, hist_ptr=buf.hist, state_ptr=buf.state,
                                 err_ptr=buf.err, T=T, BT=BT)
        launches.append((calls.launch(("hist", NC, pow2(BT), topk_idx.dtype, _aligned(topk_idx)), route_hist_kernel,
                                      NC, hist_args,
                                      lambda: dict(E=buf.num_experts, K=buf.topk, CMAX=CMAX, BLOCK_T=pow2(BT),
                                                   BLOCK_K=pow2(buf.topk, 2), BLOCK_E=pow2(buf.num_experts, 2),
                                                   ROWS=rows, N=buf.node_size, NODE0=buf.node0,
                                                   EL=buf.num_local_experts, BLOCK_N=pow2(buf.node_size, 2),
                                                   RANKS=buf.world_size if buf.remote is not None else 0,
                                                   BLOCK_RANKS=pow2(buf.world_size, 2), num_warps=buf.hist_warps),
                                      _HIST_DYNAMIC), hist_args))
    # (where an argument has no tensor in this buffer, a placeholder the kernel never touches)
    xs = x_scales if fp8_in else buf.err
    out_s = buf.expert_scales if buf.fp8 else buf.err
    offsets = buf.expert_offsets if buf.expert_offsets is not None else buf.expert_counts
    rp = buf.remote
    named = dict(
        x_ptr=x.view(torch.uint8) if fp8_in else x, xs_ptr=xs, topk_ptr=topk_idx, w_ptr=topk_weights,
        hist_ptr=buf.hist, peer_ptr=buf.workspace.peer_ptrs, ws=calls.ws_ptr, state_ptr=buf.state, err_ptr=buf.err,
        out_x_ptr=buf.expert_x_words, out_s_ptr=out_s, counts_ptr=buf.expert_counts,
        offsets_ptr=offsets, recv_pos_ptr=buf.recv_pos, scratch_ptr=buf.scratch, sel_ptr=buf.scratch,
        route_ptr=buf.route_idx, T=T, BT=BT, NC=NC, timeout_ns=calls.timeout_ns, **_rows_args(buf))
    key = ("dispatch", fp8_in, direct, own_x, topk_idx.dtype, _aligned(x), _aligned(xs), _aligned(topk_idx),
           _aligned(topk_weights))
    epoch = calls.epochs[0] + 1
    consts = lambda: _dispatch_consts(buf, fp8_in, direct, own_x)  # noqa: E731
    if rp is not None:
        recv = _dispatch_across_nodes(buf, rp, replay, sig, tensors, launches, inputs, scalars, key, named, consts,
                                      epoch, return_recv_hook)
        return _dispatched(buf, T, recv)
    args = runtime_args(dispatch_kernel, **named)
    if not return_recv_hook:
        launches += launch_halves(buf, key, dispatch_kernel, args, _DISPATCH_DYNAMIC, consts,
                                  lambda: host_wait.wait_dispatch(buf, epoch))
        replay.record(sig, tensors, launches, inputs, None, _SCALARS, scalars)
        recv = None
    else:
        send = launch_half(buf, key, dispatch_kernel, args, _DISPATCH_DYNAMIC, consts, True, False)
        # recorded once the receive half has a plan (a hook of an earlier call launched it)
        later = planned_half(buf, key, False, True)
        if later is not None:
            replay.record(sig, tensors, launches + [(send, args)], inputs, None, _SCALARS, scalars,
                          later=[(later, args)])

        def recv():
            if buf.interp:
                host_wait.wait_dispatch(buf, epoch)
            launch_half(buf, key, dispatch_kernel, args, _DISPATCH_DYNAMIC, consts, False, True)
    return _dispatched(buf, T, recv)


def _dispatch_across_nodes(buf, rp, replay, sig, tensors, launches: list, inputs: tuple, scalars: tuple, key: tuple,
                           named: dict, consts, epoch: int, hooked: bool):
    """The dispatch's two launches with peers on other nodes (``moe_ep.internode``): the send half
    (remote peers' headers and rows, each peer's bell as soon as it is packed, then the node
    stores), then, at once or in the hook, the receive half (node rows placed with the whole count
    matrix, remote rows as they land). Recorded for replays like a node call with a hook: the
    send half when the call is made, the receive half ``later``. Returns the receive half for a
    hook, else None."""
    sargs = runtime_args(internode_dispatch_send_kernel, **{**named, **rp.dispatch_args(send=True)})
    rargs = runtime_args(internode_dispatch_recv_kernel, **{**named, **rp.dispatch_args(send=False)})
    remote_consts = lambda: dict(consts(), **rp.dispatch_consts(buf.block_t))  # noqa: E731
    key = key + ("across nodes",)
    send = launch_half(buf, key, internode_dispatch_send_kernel, sargs, _SEND_DYNAMIC, remote_consts, True, False)

    def recv():
        if buf.interp:
            host_wait.wait_dispatch(buf, epoch)
        return launch_half(buf, key, internode_dispatch_recv_kernel, rargs, _RECV_DYNAMIC, remote_consts, False, True)
    # the receive half's plan: launched now, or (a hook) by an earlier call's hook, if any
    later = planned_half(buf, key, False, True) if hooked else recv()
    if later is not None:
        replay.record(sig, tensors, launches + [(send, sargs)], inputs, None, _SCALARS, scalars,
                      later=[(later, rargs)])
    return recv if hooked else None


def _dispatched(buf, T: int, recv):
    """The end of a dispatch of ``T`` tokens just issued (``recv``: its receive half, for a hook)."""
    calls = buf.calls
    calls.epochs[0] += 1
    calls.serial += 1
    result = DispatchResult.issued(calls.result_fields, buf, T, calls.serial)
    if recv is not None:
        return result, calls.make_hook("dispatch", recv, buf.check_usable, buf.interp)
    if buf.interp:
        buf.check_usable()
    return result


# The arguments that may change between calls of one launch key (the caller's; the rest is the buffer's).
_DISPATCH_DYNAMIC = arg_positions(dispatch_kernel, "x_ptr", "xs_ptr", "topk_ptr", "w_ptr", "T", "BT", "NC")
_SEND_DYNAMIC = arg_positions(internode_dispatch_send_kernel, "x_ptr", "xs_ptr", "topk_ptr", "w_ptr", "T", "BT", "NC")
_RECV_DYNAMIC = arg_positions(internode_dispatch_recv_kernel, "x_ptr", "xs_ptr", "topk_ptr", "w_ptr", "T", "BT", "NC")
_HIST_DYNAMIC = arg_positions(route_hist_kernel, "topk_ptr", "T", "BT")


def _rows_args(buf) -> dict:
    """The dispatch kernel's rows-layout arguments (rows_from, recv ids, weights, source, count);
    other layouts pass a placeholder, which the kernel never touches."""
    names = ("rows_from_ptr", "recv_ids_ptr", "recv_wts_ptr", "recv_src_ptr", "num_recv_ptr")
    if buf.layout != "rows":
        return dict.fromkeys(names, buf.scratch)
    return dict(zip(names, (buf.scratch, buf.recv_topk_idx, buf.recv_topk_weights, buf.recv_src, buf.num_recv)))


SMEM_BUDGET = 160 * 1024  # bytes of shared memory the pipelined loops' stages may take (H100/H200: 227 KB)


def pipelined_width(width: int, stages: int, row_bytes: int) -> int:
    """``width`` (a power of two), halved until ``stages`` tiles of ``row_bytes`` per column fit
    in ``SMEM_BUDGET``; unchanged for plain loops (stages 1)."""
    while stages > 1 and width > 16 and stages * width * row_bytes > SMEM_BUDGET:
        width //= 2
    return width


def own_prefetch_depth(buf, fp8_in: bool) -> int:
    """Sub-blocks ahead the rows dispatch asks the L2 for its own rows (``prefetch_l2``): one when
    it quantizes to fp8 on at most 32 programs, else none. One H200, T=4096, kernel p50: fp8 at 32
    programs 49.1 against 52.6 us without (2 ahead 53.5, 4 ahead 55.4); bf16 at 32 programs and
    both at 132 are slower with it (57.0 / 50.0, 39.2 / 35.5 fp8 at 132)."""
    if buf.prefetch is not None:
        return buf.prefetch
    return 1 if buf.layout == "rows" and buf.fp8 and not fp8_in and buf.num_programs <= 32 else 0


def _dispatch_consts(buf, fp8_in: bool, direct: bool, own_x: bool) -> dict:
    """The dispatch kernel's constexprs (all fixed by the buffer, except PREQ, DIRECT and OWN_X)."""
    off, lay, H, BLOCK_T = buf.off, buf.ws_layout, buf.hidden, buf.block_t
    W = H * (1 if buf.fp8 else 2) // 4
    nb = max(1, buf.num_scale_blocks)
    S = buf.stages
    # fp8 tiles hold whole 128-channel scale blocks, whatever the pipelining budget says
    def channels(tokens):  # channels per payload tile of ``tokens`` rows
        return max(128 if buf.fp8 else 16, pipelined_width(min(pow2(H), 8192 * buf.tile // tokens), S,
                                                           tokens * (1 if fp8_in else 2)))
    block_h = channels(BLOCK_T)
    block_w = pipelined_width(max(16, min(pow2(W), 2048 * buf.tile, 4096 * buf.tile // BLOCK_T)), S, BLOCK_T * 4)
    return dict(off_hflag=off["hdr_flag"], off_dflag=off["disp_flag"], off_hdr=off["hdr"], off_meta_i=off["meta_i"],
                off_meta_w=off["meta_w"], off_rows=off["rows"], off_cflag=off["comb_flag"], RANK=buf.rank - buf.node0, NODE0=buf.node0,
                R=buf.world_size, N=buf.node_size, M=buf.max_tokens, GLOBAL=buf.remote is not None,
                K=buf.topk, E=buf.num_experts, EL=buf.num_local_experts, H=H, W=W, NB=nb, RB=lay.RB, HDR=lay.HDR,
                CMAX=buf.chunks, ALIGN=buf.expert_alignment, CAP=buf.capacity, FP8=buf.fp8, PREQ=fp8_in,
                DIRECT=direct, PACKED=buf.layout == "packed", BLOCK_T=BLOCK_T, BLOCK_K=pow2(buf.topk, 2),
                BLOCK_C=min(buf.chunks, 64), BLOCK_H=block_h, BLOCK_TS=buf.block_ts, BLOCK_HS=channels(buf.block_ts), BLOCK_EL=buf.block_el, BLOCK_W=block_w,
                BLOCK_NB=pow2(nb, 2), STAGES=S, INTERP=buf.interp, ROWS=buf.layout == "rows", OWN_X=own_x,
                PREFETCH=own_prefetch_depth(buf, fp8_in), CM_ROWS=buf.scale_column_rows,
                **buf.launch_options("dispatch"))
