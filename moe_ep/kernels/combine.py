"""Combine kernels: the expert owner pre-reduces and sends one row per (token, rank) back.

Workspace of each rank, ``par`` = combine epoch & 1:
  comb_flag[owner]                int64, written by owner only, = last combine epoch sent
  comb_rows[par][owner][M][H]     bf16: sum over owner's experts of w * y for the token in that slot
"""
import triton
import triton.language as tl

from .common import PHASE_COMBINE, last_arrival, raise_flag, to_bf16, wait_flag


@triton.jit
def combine_send_kernel(
    y_ptr,             # bf16 [rows, H]: expert outputs in the layout of expert_x
    ws,                # int: address of this rank's workspace
    peer_ptr,          # int64 [N]: workspace base of each node peer
    state_ptr,         # int64 [8]: [0] dispatch epoch, [1] combine epoch, [4] arrival counter
    recv_pos_ptr,      # int32 [N, M, K] from dispatch_recv_kernel
    off_comb_flag, off_hdr, off_meta_w, off_comb,
    RANK: tl.constexpr, N: tl.constexpr, M: tl.constexpr, K: tl.constexpr, H: tl.constexpr,
    HDR: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, INTERP: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dpar = tl.load(state_ptr) & 1
    epoch = tl.load(state_ptr + 1) + 1
    par = epoch & 1
    kk = tl.arange(0, BLOCK_K)
    km = kk < K
    hdr = (ws + off_hdr).to(tl.pointer_type(tl.int32)) + dpar * N * HDR
    meta_w = (ws + off_meta_w).to(tl.pointer_type(tl.float32))
    for s in range(N):
        ts = tl.load(hdr + s * HDR)
        base = tl.load(peer_ptr + s)
        for t in range(pid, ts, nprog):
            r = tl.load(recv_pos_ptr + (s * M + t) * K + kk, mask=km, other=-1).to(tl.int64)
            valid = r >= 0
            if tl.max(valid.to(tl.int32)) > 0:
                w = tl.load(meta_w + ((dpar * N + s) * M + t) * K + kk, mask=valid, other=0.0)
                dst = (base + off_comb).to(tl.pointer_type(tl.bfloat16)) + ((par * N + RANK) * M + t).to(tl.int64) * H
                for h0 in range(0, H, BLOCK_H):
                    hh = h0 + tl.arange(0, BLOCK_H)
                    hm = hh < H
                    y = tl.load(y_ptr + r[:, None] * H + hh[None, :], mask=valid[:, None] & hm[None, :], other=0.0)
                    acc = tl.sum(y.to(tl.float32) * w[:, None], axis=0)
                    tl.store(dst + hh, to_bf16(acc, INTERP), mask=hm)
    if last_arrival(state_ptr + 4):
        for d in tl.static_range(N):
            b = tl.load(peer_ptr + d)
            raise_flag((b + off_comb_flag).to(tl.pointer_type(tl.int64)) + RANK, epoch)


@triton.jit
def combine_recv_kernel(
    topk_ptr,          # [T, K] int32/int64: the routing given to dispatch
    out_ptr,           # bf16 [T, H]
    ws,                # int: address of this rank's workspace
    state_ptr,         # int64 [8]: [1] combine epoch, [5] arrival counter
    err_ptr,           # int64 [8] error record
    timeout_ns, T,
    off_comb_flag, off_comb,
    N: tl.constexpr, M: tl.constexpr, K: tl.constexpr, E: tl.constexpr, EL: tl.constexpr,
    H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, INTERP: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch = tl.load(state_ptr + 1) + 1
    par = epoch & 1
    ok = tl.full([], 1, tl.int32)
    for d in range(N):
        ok = ok & wait_flag((ws + off_comb_flag).to(tl.pointer_type(tl.int64)) + d, epoch, timeout_ns,
                            err_ptr, d, PHASE_COMBINE, INTERP)
    if ok != 0:
        kk = tl.arange(0, BLOCK_K)
        nn = tl.arange(0, BLOCK_N)
        comb = (ws + off_comb).to(tl.pointer_type(tl.bfloat16))
        for t in range(pid, T, nprog):
            ids = tl.load(topk_ptr + t * K + kk, mask=kk < K, other=-1).to(tl.int32)
            dst = tl.where((ids >= 0) & (ids < E), ids // EL, -1)
            go = tl.max((dst[None, :] == nn[:, None]).to(tl.int32), axis=1) > 0
            src = comb + ((par * N + nn) * M + t).to(tl.int64) * H
            for h0 in range(0, H, BLOCK_H):
                hh = h0 + tl.arange(0, BLOCK_H)
                hm = hh < H
                p = tl.load(src[:, None] + hh[None, :], mask=go[:, None] & hm[None, :], other=0.0)
                acc = tl.sum(p.to(tl.float32), axis=0)
                tl.store(out_ptr + t * H + hh, to_bf16(acc, INTERP), mask=hm)
    if last_arrival(state_ptr + 5):
        tl.store(state_ptr + 1, epoch)
