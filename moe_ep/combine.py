"""Combine: validation and the two launches (pre-reduce + send, receive + sum)."""
from __future__ import annotations

import torch

from .dispatch import _check_tensor, _pow2, tile_rows
from .kernels.combine import combine_recv_kernel, combine_send_kernel
from .handle import DispatchResult
from .kernels.launch import launch


def combine(buf, expert_y: torch.Tensor, handle) -> torch.Tensor:
    if not isinstance(handle, DispatchResult) or handle._buffer is not buf:
        raise TypeError("handle: expected the DispatchResult returned by this buffer's dispatch")
    if handle._serial != buf._serial:
        raise ValueError("handle: stale; a later dispatch on this buffer replaced its routing "
                         "(combine the latest dispatch, or use one buffer per in-flight layer)")
    _check_tensor("expert_y", expert_y, (torch.bfloat16,), tuple(buf.expert_x.shape), buf.device)
    N, M, K, E, EL, H = buf.world_size, buf.max_tokens, buf.topk, buf.num_experts, buf.num_local_experts, buf.hidden
    off, T, interp = buf.off, handle.num_tokens, buf.interp
    BLOCK_K = _pow2(K, 2)
    block_r = tile_rows(N * max(T, 1), buf.num_programs)
    launch(combine_send_kernel, buf.num_programs,
           (expert_y, buf.workspace.local.data_ptr(), buf.workspace.peer_ptrs, buf.state, buf.recv_pos),
           dict(off_comb_flag=off["comb_flag"], off_hdr=off["hdr"], off_meta_w=off["meta_w"], off_comb=off["comb"], RANK=buf.rank, N=N, M=M, K=K, H=H, HDR=buf.ws_layout.HDR,
                BLOCK_R=block_r, BLOCK_K=BLOCK_K, BLOCK_H=max(16, min(_pow2(H), 2048, 8192 // block_r)),
                INTERP=interp, num_warps=buf.num_warps))
    epoch = buf._epochs[1] + 1
    if interp:
        buf._host_wait("comb_flag", epoch, "combine")
    out = torch.empty(T, H, dtype=torch.bfloat16, device=buf.device)
    block_t = tile_rows(T, buf.num_programs)
    launch(combine_recv_kernel, max(1, min(-(-T // block_t), buf.num_programs)),
           (handle.topk_idx, out, buf.workspace.local.data_ptr(), buf.state, buf.err,
            int(buf.timeout_s * 1e9), T),
           dict(off_comb_flag=off["comb_flag"], off_comb=off["comb"], N=N, M=M, K=K, E=E, EL=EL, H=H,
                BLOCK_T=block_t, BLOCK_K=BLOCK_K, BLOCK_H=max(16, min(_pow2(H), 2048, 8192 // block_t)),
                INTERP=interp, num_warps=buf.num_warps))
    buf._epochs[1] = epoch
    if interp:
        buf._check_usable()
    return out
