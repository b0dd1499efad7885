"""Combine: validation and the combine kernel (one launch on a GPU; its send and receive halves as
two launches under the interpreter)."""
from __future__ import annotations

import torch

from .dispatch import _aligned, _check_tensor, _pow2, launch_half, launch_halves, pipelined_width
from .kernels.combine import combine_kernel
from .handle import DispatchResult
from .replay import signature


def combine(buf, expert_y: torch.Tensor, handle, return_recv_hook: bool = False, out=None):
    buf._check_no_pending("combine")
    if not isinstance(handle, DispatchResult) or handle._buffer is not buf:
        raise TypeError("handle: expected the DispatchResult returned by this buffer's dispatch")
    if handle._serial != buf._serial:
        raise ValueError("handle: stale; a later dispatch on this buffer replaced its routing "
                         "(combine the latest dispatch, or use one buffer per in-flight layer)")
    T = handle.num_tokens
    sig, ptrs = signature((expert_y, out))
    sig = (sig, T) if sig is not None else None
    hit = buf._replays[1].get(sig) if not return_recv_hook else None
    if hit is not None:
        if out is None:
            out = torch.empty(T, buf.hidden, dtype=torch.bfloat16, device=buf.device)
        hit.run(buf._launch.stream(), (ptrs[0], out.data_ptr()))
        return _combined(buf, out, None)
    _check_tensor("expert_y", expert_y, (torch.bfloat16,), tuple(buf.expert_x.shape), buf.device)
    if out is not None:
        _check_tensor("out", out, (torch.bfloat16,), (T, buf.hidden), buf.device)
    rp = buf.remote
    if out is None:
        out = torch.empty(T, buf.hidden, dtype=torch.bfloat16, device=buf.device)
    # With other nodes the node owners' sum stays float32 until the remote rows are added.
    base = torch.empty(T, buf.hidden, dtype=torch.float32, device=buf.device) if rp is not None else out
    # The dispatch's expert ids, kept by the buffer (rows [0, T)): the caller's topk_idx may be reused.
    args = (expert_y, buf.route_idx, base, buf._ws_ptr, buf.workspace.peer_ptrs, buf.state, buf.err, buf.recv_pos,
            buf._timeout_ns, T)
    key = ("combine", _aligned(expert_y), _aligned(base))
    epoch = buf._epochs[1] + 1
    consts = lambda: _combine_consts(buf)  # noqa: E731
    dyn = (0, 2, 9)
    if rp is None:
        if not return_recv_hook:
            launches = launch_halves(buf, key, combine_kernel, args, dyn, consts,
                                     lambda: buf._host_wait_combine(epoch, T))
            buf._replays[1].record(sig, launches, (ptrs[0], base.data_ptr()), None)
            recv = None
        else:
            launch_half(buf, key, combine_kernel, args, dyn, consts, True, False)

            def recv():
                if buf.interp:
                    buf._host_wait_combine(epoch, T)
                launch_half(buf, key, combine_kernel, args, dyn, consts, False, True)
    else:
        depoch = buf._epochs[0]  # the proxy's combine carries the epoch of the dispatch it answers
        rp.combine_send(buf, expert_y, handle._serial, depoch)  # refuses a second combine first
        launch_half(buf, key, combine_kernel, args, dyn, consts, True, False)

        def recv():
            if buf.interp:
                buf._host_wait_combine(epoch, T)
            rp.wait(buf, "combine", depoch)
            launch_half(buf, key, combine_kernel, args, dyn, consts, False, True)
            rp.combine_recv(buf, buf.route_idx[:T], base, out)
        if not return_recv_hook:
            recv()
            recv = None
    return _combined(buf, out, recv)


def _combined(buf, out: torch.Tensor, recv):
    """The end of a combine into ``out`` just issued (``recv``: its receive half, for a hook)."""
    buf._epochs[1] += 1
    if recv is not None:
        return out, buf._make_hook("combine", recv)
    if buf.interp:
        buf._check_usable()
    return out


def _combine_consts(buf) -> dict:
    """The combine kernel's constexprs (all fixed by the buffer)."""
    off, H, BLOCK_T = buf.off, buf.hidden, buf.block_t
    return dict(off_cflag=off["comb_flag"], off_hdr=off["hdr"], off_meta_w=off["meta_w"], off_comb=off["comb"],
                RANK=buf.rank - buf.node0, NODE0=buf.node0, N=buf.node_size, M=buf.max_tokens, K=buf.topk,
                E=buf.num_experts, BASE_F32=buf.remote is not None,
                EL=buf.num_local_experts, H=H, HDR=buf.ws_layout.HDR, CMAX=buf.chunks, BLOCK_T=BLOCK_T,
                BLOCK_K=_pow2(buf.topk, 2),
                BLOCK_H=pipelined_width(max(16, min(_pow2(H), 2048 * buf.tile, 8192 * buf.tile // BLOCK_T)),
                                        buf.stages, buf.topk * BLOCK_T * 2),
                STAGES=buf.stages, INTERP=buf.interp, num_warps=buf.num_warps)
