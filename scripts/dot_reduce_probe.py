"""Probe: the combine's weighted sum of K gathered rows per token as a tensor-core product.

out[t] = sum_k w[t, k] * y[r[t, k]] for TT tokens at once is A @ B with B the TT*K gathered rows
[TT*K, HC] and A the block-diagonal [TT, TT*K] weights; the weights go in two bf16 parts (hi + lo)
so the products keep ~16 bits of each weight. Times the loop at 32 and 132 programs against the
float32 reference; not part of the package. (Interpreted on a CPU the dot rows come out wrong:
the interpreter's bf16 dot; the FMA row checks the script.)
"""
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

from moe_ep.kernels.common import pre_reduce_tile


@triton.jit
def reduce_dot(y_ptr, r_ptr, w_ptr, out_ptr, T, H: tl.constexpr, K: tl.constexpr, TT: tl.constexpr,
               HC: tl.constexpr, STAGES: tl.constexpr, SPLIT: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    RK: tl.constexpr = TT * K
    j = tl.arange(0, RK)
    tt = tl.arange(0, TT)
    for b in range(pid, tl.cdiv(T, TT), P):
        tj = b * TT + j // K
        r = tl.load(r_ptr + tj * K + j % K, mask=tj < T, other=-1)
        w = tl.load(w_ptr + tj * K + j % K, mask=tj < T, other=0.0)
        a = tl.where((j[None, :] // K) == tt[:, None], w[None, :], 0.0)
        a_hi = a.to(tl.bfloat16)
        a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
        rows = y_ptr + r.to(tl.int64)[:, None] * H
        t = b * TT + tt
        for h0 in tl.range(0, H, HC, num_stages=STAGES):
            hh = h0 + tl.arange(0, HC)
            y = tl.load(rows + hh[None, :], mask=(r >= 0)[:, None], other=0.0)
            acc = tl.dot(a_hi, y, out_dtype=tl.float32)
            if SPLIT:
                acc = tl.dot(a_lo, y, acc, out_dtype=tl.float32)
            tl.store(out_ptr + t[:, None].to(tl.int64) * H + hh[None, :], acc.to(tl.bfloat16), mask=(t < T)[:, None])


@triton.jit
def reduce_fma(y_ptr, r_ptr, w_ptr, out_ptr, T, H: tl.constexpr, K: tl.constexpr, TT: tl.constexpr,
               HC: tl.constexpr, BK: tl.constexpr):
    """The combine's own loop as shipped (``pre_reduce_tile``: K loads of [TT, HC] a step, float32
    FMA), for comparison."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    kk = tl.arange(0, BK)
    tt = tl.arange(0, TT)
    for b in range(pid, tl.cdiv(T, TT), P):
        t = b * TT + tt
        m2 = (t < T)[:, None] & (kk[None, :] < K)
        r = tl.load(r_ptr + t[:, None] * K + kk[None, :], mask=m2, other=-1)
        w = tl.load(w_ptr + t[:, None] * K + kk[None, :], mask=m2, other=0.0)
        for h0 in range(0, H, HC):
            hh = h0 + tl.arange(0, HC)
            hm = (t < T)[:, None] & (hh < H)[None, :]
            acc = pre_reduce_tile(y_ptr, r, w, kk, hh, hm, K, H, TT, HC)
            tl.store(out_ptr + t[:, None].to(tl.int64) * H + hh[None, :], acc.to(tl.bfloat16), mask=hm)


def main():
    small = not torch.cuda.is_available()
    dev = "cpu" if small else "cuda"
    T, H, K = (32, 256, 8) if small else (4096, 7168, 8)
    g = torch.Generator(device=dev).manual_seed(0)
    y = torch.randn(T * K + 64, H, device=dev, generator=g).to(torch.bfloat16)
    r = torch.randperm(T * K, device=dev, generator=g).view(T, K).to(torch.int32)
    r[3, 5] = -1  # a selection with no row
    w = torch.rand(T, K, device=dev, generator=g)
    ref = torch.einsum("tk,tkh->th", w * (r >= 0), y[r.clamp(min=0).long()].float())
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    progs = [4] if small else [32, 132]
    shapes = ([(16, 64, 1, 4, 1)] if small else
              [(tt, hc, st, nw, sp) for tt, hc, st, nw, sp in
               itertools.product((16, 32), (64, 128, 256), (2, 3, 4), (4, 8), (1,))] + [(16, 128, 3, 4, 0)])
    gbytes = (T * K * H * 2 + T * H * 2) / 1e9
    print(f"{'kernel':<34}" + "".join(f"{p:>10} progs" for p in progs) + "   max err / ulp")
    rows = [("fma", dict(TT=16, HC=1024, BK=8), 16)] if not small else [("fma", dict(TT=4, HC=64, BK=8), 4)]
    rows += [(f"dot-t{tt}-c{hc}-s{st}-w{nw}" + ("" if sp else "-nosplit"),
              dict(TT=tt, HC=hc, STAGES=st, SPLIT=sp), nw) for tt, hc, st, nw, sp in shapes]
    for name, kw, nw in rows:
        kern = reduce_fma if name == "fma" else reduce_dot
        times = []
        try:
            for P in progs:
                def run():
                    kern[(P,)](y, r, w, out, T, H=H, K=K, num_warps=nw, **kw)
                run()
                if small:
                    times.append(0.0)
                    continue
                torch.cuda.synchronize()
                times.append(triton.testing.do_bench(run, warmup=5, rep=40, return_mode="median") * 1e3)
            err = ((out.float() - ref).abs() / ref.abs().clamp(min=1e-3)).max().item()
            bad = (out.float() - ref.to(torch.bfloat16).float()).abs() > ref.abs() * 2 ** -7
            print(f"{name:<34}" + "".join(f"{t:>10.1f} us   " for t in times) + f"   {err:.1e} ({int(bad.sum())} over 1 ulp)",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{name:<34} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    print(f"(bytes moved: {gbytes:.3f} GB; at 200 us that is {gbytes / 200e-6 / 1e12:.2f} TB/s)")


if __name__ == "__main__":
    sys.exit(main())
