"""Combine: validation and the combine kernel (one launch on a GPU; its send and receive halves as
two launches under the interpreter)."""
from __future__ import annotations

import torch

from .dispatch import _check_tensor, _pow2, launch_halves
from .kernels.combine import combine_kernel
from .handle import DispatchResult


def combine(buf, expert_y: torch.Tensor, handle) -> torch.Tensor:
    if not isinstance(handle, DispatchResult) or handle._buffer is not buf:
        raise TypeError("handle: expected the DispatchResult returned by this buffer's dispatch")
    if handle._serial != buf._serial:
        raise ValueError("handle: stale; a later dispatch on this buffer replaced its routing "
                         "(combine the latest dispatch, or use one buffer per in-flight layer)")
    _check_tensor("expert_y", expert_y, (torch.bfloat16,), tuple(buf.expert_x.shape), buf.device)
    N, M, K, E, EL, H = buf.world_size, buf.max_tokens, buf.topk, buf.num_experts, buf.num_local_experts, buf.hidden
    off, T = buf.off, handle.num_tokens
    out = torch.empty(T, H, dtype=torch.bfloat16, device=buf.device)
    BLOCK_T = buf.block_t
    args = (expert_y, handle.topk_idx, out, buf.workspace.local.data_ptr(), buf.workspace.peer_ptrs, buf.state,
            buf.err, buf.recv_pos, int(buf.timeout_s * 1e9), T)
    consts = dict(off_cflag=off["comb_flag"], off_hdr=off["hdr"], off_meta_w=off["meta_w"], off_comb=off["comb"],
                  RANK=buf.rank, N=N, M=M, K=K, E=E, EL=EL, H=H, HDR=buf.ws_layout.HDR, CMAX=buf.chunks,
                  BLOCK_T=BLOCK_T, BLOCK_K=_pow2(K, 2), BLOCK_H=max(16, min(_pow2(H), 2048, 8192 // BLOCK_T)),
                  INTERP=buf.interp, num_warps=buf.num_warps)
    epoch = buf._epochs[1] + 1
    launch_halves(buf, combine_kernel, args, consts, lambda: buf._host_wait_combine(epoch, T))
    buf._epochs[1] = epoch
    if buf.interp:
        buf._check_usable()
    return out
