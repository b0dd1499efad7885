"""The launches of the inter-node kernels (``moe_ep.internode.kernels``, ``moe_ep.internode.mailbox``).

``moe_ep.internode.path.RemotePath`` drives them for ``EPBuffer``; they take the proxy's regions as
plain uint8 tensors (host memory; pinned on a GPU) and run in this order for dispatch epoch ``e``
(``state.epoch[0] == e`` on the device):

1. ``pack``: count launch + pack launch fill the dispatch send buffer; then ``ring`` writes
   ``disp_doorbell = e`` and ``wait_ready`` waits for ``disp_ready >= e``;
2. ``fill_count_matrix`` (the count matrix ``sel`` from the round-1 headers), ``unpack``;
3. after the experts, ``combine_pack`` fills the combine send buffer; ``comb_doorbell = e``, wait
   for ``comb_ready >= e``; ``combine_unpack`` adds the remote owners' rows to each token.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels.interpret import interpreting
from ..kernels.launch import runtime_args
from ..layout import chunking, pow2
from .kernels import (remote_combine_pack_kernel, remote_combine_unpack_kernel, remote_count_kernel, remote_pack_kernel,
                      remote_sel_kernel, remote_unpack_kernel, remote_unpack_rows_kernel)
from .mailbox import ring_kernel, wait_ready_kernel
from .spec import RemoteSpec, RemoteState


def _launch(fn, grid: int, args: tuple, consts: dict) -> None:
    """Every launch of this module goes through here (tests replace it to record launches);
    ``args`` as ``runtime_args`` gives them."""
    fn[(grid,)](*args, **consts)


def _common(spec: RemoteSpec) -> dict:
    return dict(RANK=spec.rank, R=spec.world, BLOCK_R=pow2(spec.world, 2), BLOCK_K=pow2(spec.topk, 2))


def pack(spec: RemoteSpec, st: RemoteState, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
         send: torch.Tensor, x_scales: Optional[torch.Tensor] = None, num_programs: int = 2,
         num_warps: int = 4) -> None:
    """Dispatch send side for remote destinations: fills ``send`` (uint8, at least
    ``region_bytes()["disp_send"]``) with ``[HDR_p | rows_p]`` for every ``p != rank`` in rank
    order, ``st.send_counts`` and ``st.send_pos``. Two launches: per-chunk counts (grid = chunks),
    then the pack (grid ``num_programs``); counts stay on the device.

    x: bf16 [T, H] (or float8_e4m3fn with ``x_scales`` float32 [T, NB], fp8 only); topk_idx:
    int32/int64 [T, K] (-1: none); topk_weights: float32 [T, K].
    """
    preq = x_scales is not None
    if preq and not spec.fp8:
        raise TypeError("x_scales: pre-quantized input needs an fp8 RemoteSpec")
    T = x.shape[0]
    CMAX = spec.chunks
    BT, NC = chunking(T, CMAX)
    NC = NC if T > 0 else 0
    st.num_chunks = NC
    E, K, EL = spec.num_experts, spec.topk, spec.num_local_experts
    BLOCK_T = pow2(BT, 2)
    if NC:
        _launch(remote_count_kernel, NC, runtime_args(remote_count_kernel, topk_ptr=topk_idx, rhist_ptr=st.rhist,
                                                      ehist_ptr=st.ehist, err_ptr=st.err, epoch_ptr=st.epoch, T=T,
                                                      BT=BT),
                dict(R=spec.world, E=E, EL=EL, K=K, CMAX=CMAX, BLOCK_T=BLOCK_T, BLOCK_K=pow2(K, 2), BLOCK_E=pow2(E, 2),
                     BLOCK_R=pow2(spec.world, 2), num_warps=num_warps))
    H = spec.hidden
    _launch(remote_pack_kernel, num_programs,
            runtime_args(remote_pack_kernel, x_ptr=x.view(torch.uint8) if preq else x,
                         xs_ptr=x_scales if preq else st.rw, topk_ptr=topk_idx, w_ptr=topk_weights,
                         rhist_ptr=st.rhist, ehist_ptr=st.ehist, send_ptr=send, send_counts_ptr=st.send_counts,
                         send_pos_ptr=st.send_pos, err_ptr=st.err, epoch_ptr=st.epoch, T=T, BT=BT, NC=NC),
            dict(_common(spec), G=spec.node_size, E=E, EL=EL, K=K, H=H, NB=max(1, spec.num_scale_blocks),
                 PW=spec.payload_bytes // 4, RB=spec.row_bytes, HDR=spec.hdr_bytes, MAXROWS=spec.max_send_rows,
                 CMAX=CMAX, FP8=spec.fp8, PREQ=preq, BLOCK_T=BLOCK_T, BLOCK_C=min(CMAX, 64),
                 BLOCK_H=max(128, min(pow2(H, 2), 4096 // BLOCK_T)), BLOCK_EL=pow2(EL, 2), INTERP=interpreting(),
                 num_warps=num_warps))


def fill_count_matrix(spec: RemoteSpec, st: RemoteState, round1: torch.Tensor) -> None:
    """``st.sel[s, e]`` = selections of local expert ``e`` from source ``s``: rows ``s != rank``
    from the round-1 headers of epoch ``st.epoch`` (every source, node peers included, writes
    one there), row ``rank`` from this rank's own histogram; ``st.rows_from`` likewise from the
    count vectors. Run after ``disp_ready``, after ``pack``."""
    EL = spec.num_local_experts
    _launch(remote_sel_kernel, 1,
            runtime_args(remote_sel_kernel, round1_ptr=round1, ehist_ptr=st.ehist, sel_ptr=st.sel,
                         epoch_ptr=st.epoch, NC=st.num_chunks, rhist_ptr=st.rhist, rows_from_ptr=st.rows_from),
            dict(RANK=spec.rank, R=spec.world, EL=EL, HDR=spec.hdr_bytes, SLOT=spec.slot_bytes, CMAX=spec.chunks,
                 BLOCK_EL=pow2(EL, 2), BLOCK_C=min(spec.chunks, 64)))


def unpack(spec: RemoteSpec, st: RemoteState, round1: torch.Tensor, overflow: torch.Tensor,
           expert_x: torch.Tensor, expert_scales: Optional[torch.Tensor], expert_counts: torch.Tensor,
           expert_offsets: Optional[torch.Tensor], num_programs: int = 2, num_warps: int = 4,
           scale_column_rows: int = 0) -> None:
    """Dispatch receive side: every remote source's rows (round-1 slot, then overflow) expanded into
    the expert layout, at ``rows of the expert from lower sources + j`` (``st.sel``, every source).

    expert_x: masked ``[EL, R*M, H]`` or packed ``[R*M*K + EL*(align-1), H]`` (bf16 or fp8);
    expert_scales: float32 ``[..., NB]`` (fp8; ``scale_column_rows`` > 0: column-major in blocks of
    that many rows, ``EPBuffer.scale_column_rows``); expert_counts int32 [EL] and expert_offsets
    int32 [EL + 1] (packed) are written for every source. Records ``st.rpos``/``st.rw``/``st.recv_rows``.
    """
    EL, H, K = spec.num_local_experts, spec.hidden, spec.topk
    W = H * (1 if spec.fp8 else 2) // 4
    nb = max(1, spec.num_scale_blocks)
    words = expert_x.view(torch.uint8).view(torch.int32)
    _launch(remote_unpack_kernel, num_programs,
            runtime_args(remote_unpack_kernel, round1_ptr=round1, overflow_ptr=overflow, sel_ptr=st.sel,
                         out_x_ptr=words, out_s_ptr=expert_scales if spec.fp8 else st.rw, counts_ptr=expert_counts,
                         offsets_ptr=expert_offsets if expert_offsets is not None else expert_counts,
                         rpos_ptr=st.rpos, rw_ptr=st.rw, recv_rows_ptr=st.recv_rows, err_ptr=st.err,
                         epoch_ptr=st.epoch),
            dict(_common(spec), G=spec.node_size, EL=EL, K=K, H=H, W=W, NB=nb, PW=spec.payload_bytes // 4,
                 RB=spec.row_bytes, HDR=spec.hdr_bytes, PCAP=spec.private_capacity, OVCAP=spec.overflow_capacity,
                 ROWS=spec.recv_rows, CAP=spec.expert_capacity, ALIGN=spec.expert_alignment,
                 PACKED=spec.layout == "packed", FP8=spec.fp8, BLOCK_RW=16, BLOCK_EL=pow2(EL, 2),
                 BLOCK_W=max(16, min(pow2(W, 2), 256)), BLOCK_NB=pow2(nb, 2), CM_ROWS=scale_column_rows,
                 num_warps=num_warps))


def unpack_rows(spec: RemoteSpec, st: RemoteState, round1: torch.Tensor, overflow: torch.Tensor,
                expert_x: torch.Tensor, expert_scales: Optional[torch.Tensor], recv_topk_idx: torch.Tensor,
                recv_topk_weights: torch.Tensor, recv_src: torch.Tensor, num_programs: int = 2,
                num_warps: int = 4) -> None:
    """Rows layout, dispatch receive side: every remote source's rows (round-1 slot, then overflow)
    into the rows layout at ``rows of every lower source + i`` (``st.rows_from``), with their local
    ids, weights and sources; ``st.rpos[g, 0]`` = the row of received row ``g``.

    expert_x ``[R*M, H]`` (bf16 or fp8), expert_scales float32 ``[R*M, NB]`` (fp8), recv_topk_idx
    int32 / recv_topk_weights float32 ``[R*M, K]``, recv_src int32 ``[R*M]``."""
    H, K = spec.hidden, spec.topk
    W = H * (1 if spec.fp8 else 2) // 4
    nb = max(1, spec.num_scale_blocks)
    _launch(remote_unpack_rows_kernel, num_programs,
            runtime_args(remote_unpack_rows_kernel, round1_ptr=round1, overflow_ptr=overflow,
                         rows_from_ptr=st.rows_from, out_x_ptr=expert_x.view(torch.uint8).view(torch.int32),
                         out_s_ptr=expert_scales if spec.fp8 else st.rw, ids_ptr=recv_topk_idx,
                         wts_ptr=recv_topk_weights, src_ptr=recv_src, rpos_ptr=st.rpos, recv_rows_ptr=st.recv_rows,
                         err_ptr=st.err, epoch_ptr=st.epoch),
            dict(_common(spec), G=spec.node_size, M=spec.max_tokens, K=K, H=H, W=W, NB=nb, PW=spec.payload_bytes // 4,
                 RB=spec.row_bytes, HDR=spec.hdr_bytes, PCAP=spec.private_capacity, OVCAP=spec.overflow_capacity,
                 ROWS=spec.recv_rows, FP8=spec.fp8, BLOCK_RW=16, BLOCK_W=max(16, min(pow2(W, 2), 256)),
                 BLOCK_NB=pow2(nb, 2), num_warps=num_warps))


def combine_pack(spec: RemoteSpec, st: RemoteState, expert_y: torch.Tensor, comb_send: torch.Tensor,
                 num_programs: int = 2, num_warps: int = 4, topk_weights: Optional[torch.Tensor] = None) -> None:
    """Owner side: one pre-reduced bf16 row per received row (``sum_k w * y[rpos]`` in float32, one
    rounding) into ``comb_send`` (uint8), in the order received. expert_y: bf16, the layout of expert_x.
    Rows layout: the received row of ``expert_y`` as it is, then its ``topk_weights`` (float32
    ``[R*M, K]``; zeros when None)."""
    H, rows = spec.hidden, spec.layout == "rows"
    wy = topk_weights if topk_weights is not None else st.rw
    _launch(remote_combine_pack_kernel, num_programs,
            runtime_args(remote_combine_pack_kernel, y_ptr=expert_y, rpos_ptr=st.rpos, rw_ptr=wy if rows else st.rw,
                         recv_rows_ptr=st.recv_rows, comb_send_ptr=comb_send),
            dict(R=spec.world, K=spec.topk, H=H, BLOCK_RW=16, BLOCK_K=pow2(spec.topk, 2),
                 BLOCK_H=max(16, min(pow2(H, 2), 512)), BLOCK_R=pow2(spec.world, 2), INTERP=interpreting(),
                 CRB=spec.comb_row_bytes, ROWS=rows, WIN=topk_weights is not None, num_warps=num_warps))


def combine_unpack(spec: RemoteSpec, st: RemoteState, comb_recv: torch.Tensor, topk_idx: torch.Tensor,
                   out: torch.Tensor, base: Optional[torch.Tensor] = None, num_programs: int = 2,
                   num_warps: int = 4, wout: Optional[torch.Tensor] = None) -> None:
    """Source side: ``out[t] = bf16(base[t] + sum over remote owners p of row(p, t))`` in float32,
    ``row(p, t)`` at ``sum of c_{rank,p'} over remote p' < p + send_pos[t, p]`` in the epoch's copy
    of ``comb_recv`` (uint8). topk_idx: the [T, K] routing given to ``pack``; out: bf16 [T, H], or
    float32 [T, H] for the sum itself (not rounded);
    base: float32 [T, H] (the node owners' sum) or None. Rows layout: ``wout`` float32 [T, K]
    (the node owners' weight sums) gets the remote owners' rows' weights added."""
    T, H = out.shape
    _launch(remote_combine_unpack_kernel, num_programs,
            runtime_args(remote_combine_unpack_kernel, comb_recv_ptr=comb_recv, topk_ptr=topk_idx,
                         send_pos_ptr=st.send_pos, send_counts_ptr=st.send_counts,
                         base_ptr=base if base is not None else st.rw, out_ptr=out, epoch_ptr=st.epoch, T=T,
                         wout_ptr=wout if wout is not None else st.rw),
            dict(_common(spec), G=spec.node_size, E=spec.num_experts, EL=spec.num_local_experts, K=spec.topk, H=H,
                 MAXROWS=spec.max_send_rows, HAS_BASE=base is not None, BLOCK_T=16,
                 BLOCK_H=max(16, min(pow2(H, 2), 512)), INTERP=interpreting(), CRB=spec.comb_row_bytes,
                 WOUT=wout is not None, OUT_F32=out.dtype == torch.float32, num_warps=num_warps))


def ring(st: RemoteState, mailbox: torch.Tensor, phase: str) -> None:
    """Kernel side of a doorbell: ``mailbox[doorbell of phase] = st.epoch`` (one program, stream
    ordered after the launch that packed the send buffer). mailbox: int64 [8], host memory the
    device can address (pinned on a GPU)."""
    _launch(ring_kernel, 1, runtime_args(ring_kernel, mb_ptr=mailbox, epoch_ptr=st.epoch),
            dict(WORD=0 if phase == "dispatch" else 2))


def wait_ready(st: RemoteState, mailbox: torch.Tensor, err: torch.Tensor, timeout_ns: int, phase: str) -> None:
    """Kernel side of a ready word: the launches after this one see what the proxy received for
    ``st.epoch`` (or ``err``, int64 [8] host-visible, records the proxy's error or the timeout)."""
    _launch(wait_ready_kernel, 1,
            runtime_args(wait_ready_kernel, mb_ptr=mailbox, epoch_ptr=st.epoch, err_ptr=err, timeout_ns=timeout_ns),
            dict(WORD=1 if phase == "dispatch" else 3, PHASE=0 if phase == "dispatch" else 1, INTERP=interpreting()))


__all__ = ["pack", "fill_count_matrix", "unpack", "unpack_rows", "combine_pack",
           "combine_unpack", "ring", "wait_ready"]
