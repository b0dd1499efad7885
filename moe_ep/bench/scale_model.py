"""Scale model (no hardware): moe_ep's dispatch/combine latency and bytes per phase at EP8..EP256, from measured costs, sourced link constants and the bench's routing draws.

    moe-ep-bench model --ep 8,16,32,64,128,256 --gpus-per-node 8 --nic cx7 --tokens 128 [--json OUT]
    moe-ep-bench model --check        # predictions against published numbers of other systems

Nothing here runs a kernel or a proxy. A prediction is arithmetic on three kinds of input:

1. Costs measured on moe_ep itself (docs/PERFORMANCE.md: "Today", "Conventions"; docs/performance-log/gpu.md: "Copy floor"): the R=1
   kernel times, the Triton peer-store bandwidth over NVLink, the GPU flag round trip, the launch
   inside a CUDA graph, the per-SM copy bandwidth, and the proxy thread's CPU per op against
   simulated peers to EP128 (null transport).
2. Link constants (``GPUS``, ``NICS``), each with where it comes from written beside it.
3. Routing statistics from a draw of ``moe_ep.bench.workloads.make_routing`` (the generator the
   bench feeds every backend), one draw per rank: ``C[s, p]`` = tokens of rank ``s`` with at least
   one of their K experts on rank ``p`` (one row per (token, destination rank): moe_ep's dedup).
   Bytes moved are exact counts on that draw.

Per op the phases are (formulas beside each in ``_dispatch`` / ``_combine``):

    kernel          the R=1 kernel (route, quantize, own rows, expansion), linear in tokens
    nvlink          rows to node peers: max over ranks of bytes / NVLink store bandwidth + a flag round trip
    pack            the send half writes remote rows into the registered send buffer (+ one launch)
    bells           the GPU -> proxy bell and the proxy -> GPU ready word: one flag round trip
    proxy           the proxy thread's CPU per op (measured, null transport) + extra posts for k NICs
    nic             round 1 (headers, rows up to the private capacity) and round 2 (overflow) on the
                    wire at the mean rank's bytes: latency per round + bytes / bandwidth + per-message cost
    slowest_source  what the most loaded rank (sent or received bytes) adds over the mean rank
    unpack          the receive half copies the remote rows into the expert layout (+ one launch)

    latency = kernel + max(nvlink, pack + bells + max(proxy, nic + slowest_source)) + unpack

(on one node: kernel + nvlink). The proxy posts each write as soon as its bell rings, so its CPU
overlaps the wire; whichever is longer is on the critical path.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np

from .args import int_list

PROG = "moe-ep-bench model"
DATE = "2026-12-05"

# ----------------------------------------------------------------------------- measured on moe_ep

# R=1 kernel times, CUDA-graph replays, torch.profiler device time (docs/PERFORMANCE.md "Today",
# 1x H200, commit 563b693): decode T=128 masked fp8 dispatch 7.4 us, bf16 combine 4.8 us; prefill
# T=4096 packed, 132 programs, 102.2 / 135.2 us. Interpolated linearly in tokens between the two.
# (bf16 dispatch uses the fp8 line: at T=4096 and 32 programs they differ by 4%, PERFORMANCE.md
# "Prefill, R=1: T=4096, packed".)
KERNEL_US = {"dispatch": ((128, 7.4), (4096, 102.2)), "combine": ((128, 4.8), (4096, 135.2))}
FLAG_RTT_US = 3.3           # GPU->GPU flag round trip over NVLink, release/acquire .sys (2x H200; PERFORMANCE.md "Conventions", Floor);
                            # also stands in for GPU<->host bells through pinned memory (not measured natively)
LAUNCH_IN_GRAPH_US = 0.7    # one launch inside a CUDA graph (2x H200; PERFORMANCE.md "Conventions", Floor)
COPY_GBS = 3892.0           # HBM row copy, read + written bytes, 132 programs, inflight-4 (1x H200; docs/performance-log/gpu.md "Copy floor")
FP8_BLOCK = 128             # channels per float32 fp8 scale (moe_ep.core.fp8)

# The proxy thread's CPU per decode op against R-1 simulated peers, null transport, 8 ranks per
# node, p50, in quiet minutes of this 2-core machine (docs/performance-log/proxy.md "Proxy cost to
# EP128, second pass": R = 64, 128 at commit b67112e; R = 8, 16, 32 from that pass's first build,
# within 8 % of it): linear between the measured R, beyond R=128 the slope per peer (95 / 27 ns).
PROXY_US = {"dispatch": {8: 1.2, 16: 1.5, 32: 2.9, 64: 6.2, 128: 12.9},
            "combine": {8: 0.0, 16: 0.7, 32: 1.2, 64: 2.1, 128: 3.7}}
PROXY_SLOPE_US = {"dispatch": 0.095, "combine": 0.027}
POST_US = 0.25              # one post_write, back to back: 0.1-0.4 us (docs/performance-log/proxy.md "Proxy cost (CPU, TCP loopback)")
MIN_SHARD = 16384           # bytes: a write is split over k NICs only in shards of at least this (ARCHITECTURE §9)


# ----------------------------------------------------------------------------- link constants

@dataclass(frozen=True)
class Gpu:
    """NVLink as moe_ep's node kernels see it."""

    name: str
    nvlink_gbs: float       # GB/s per direction that Triton peer stores reach
    source: str


GPUS = {
    # 368 GB/s: Triton peer stores of 16 KB blocks, 132 programs, measured on 2x H200 NV18 (PERFORMANCE.md "Conventions");
    # physical 18 links x 26.56 GB/s = 478 GB/s per direction (NVIDIA: NVLink 4, 900 GB/s bidirectional).
    "h200": Gpu("h200", 368.0, "measured, 2x H200 NV18 (Triton peer stores); NVIDIA spec 900 GB/s bidirectional"),
    # H100 SXM has the same 18 NVLink-4 links (NVIDIA H100 datasheet: 900 GB/s); the H200 figure is used.
    "h100": Gpu("h100", 368.0, "H200's measured figure; same NVLink 4 x18 (NVIDIA H100 datasheet, 900 GB/s)"),
    # H800: "~160 GB/s NVLink maximum bandwidth" (deepseek-ai/DeepEP README, docs/legacy.md, Performance).
    "h800": Gpu("h800", 160.0, "DeepEP README: H800 ~160 GB/s NVLink maximum bandwidth"),
}


@dataclass(frozen=True)
class Nic:
    """The RDMA NICs of one GPU."""

    name: str
    gbps_per_nic: float     # line rate per NIC and direction, Gb/s
    nics: int               # NICs per GPU (a write is sharded over them)
    latency_us: float       # one write + its immediate, posted -> counted at the receiver
    msg_us: float           # NIC time per message (shard), on each NIC
    source: str

    @property
    def gbs(self) -> float:
        """GB/s per GPU and direction."""
        return self.gbps_per_nic * self.nics / 8.0


NICS = {
    # NVIDIA ConnectX-7: 400 Gb/s per port (ConnectX-7 product brief), one NIC per GPU in DGX/HGX H100
    # builds. Latency 2.5 us: middle of the 2-3 us of a GPUDirect RDMA write with immediate across one
    # switch (issue 42's figure; ib_write_lat on IB is ~1-2 us host to host). Message cost: the NIC's
    # message rate is >100 M/s (ConnectX-7 product brief), i.e. <0.01 us per message.
    "cx7": Nic("cx7", 400.0, 1, 2.5, 0.01,
               "ConnectX-7 product brief (400 Gb/s, >100 M msg/s); latency 2-3 us (issue 42)"),
    # AWS p5.48xlarge: 3200 Gb/s EFA per 8 H100 = 4 x 100 Gb/s EFA devices per GPU (AWS p5 instance
    # page). Latency: ~10+ us for a write through SRD with a host proxy (issue 42's figure; AWS
    # publishes none); 12 us used. Message cost 0.5 us: an assumption for libfabric's efa software
    # path per fi_writedata (no public figure found); the pplx-garden EFA post (research.perplexity.ai,
    # "Enabling Trillion-Parameter Models on AWS EFA") names per-message overhead as EFA's cost.
    "efa": Nic("efa", 100.0, 4, 12.0, 0.5,
               "AWS p5: 3200 Gb/s per 8 GPUs = 4 x 100 Gb/s per GPU; latency ~10+ us (issue 42, assumed 12); "
               "0.5 us per message (assumption)"),
    # AWS p5en.48xlarge: 16 x 200 Gb/s EFA (EFAv3) per 8 H200 = 2 x 200 Gb/s per GPU (AWS p5en page;
    # UCCL-EP README "8x H200 + 16x 200Gb/s EFA"); latency and message cost as "efa".
    "efa-p5en": Nic("efa-p5en", 200.0, 2, 12.0, 0.5,
                    "AWS p5en: 16 x 200 Gb/s per 8 GPUs = 2 x 200 Gb/s per GPU (UCCL-EP README); latency and "
                    "message cost as efa"),
}


# ----------------------------------------------------------------------------- published numbers

@dataclass(frozen=True)
class Published:
    """One published decode point of another system (their byte conventions, their kernels)."""

    system: str
    ep: int
    nic: str
    gpu: str
    tokens: int
    hidden: int
    experts: int
    dispatch_us: float
    combine_us: float
    source: str
    why_apart: str          # printed when the residual is over MISS_PCT


MISS_PCT = 35.0
_PPLX = "github.com/perplexityai/pplx-garden docs/fabric-lib.md (commit 2446003), 'Decode (128 tokens)' table"
_DEEPEP = "github.com/deepseek-ai/DeepEP docs/legacy.md (commit 0297fc8), 'Low-latency kernels with pure RDMA'"
_UCCL = "github.com/uccl-project/uccl ep/README.md (commit 021c2c0), 'Low-latency kernels', 'On p5en'"
_WHY_PPLX_EFA = ("their EFA path: libfabric writes from a host proxy without GPUDirect Async, one write per "
                 "peer and per NIC; our EFA latency and per-message cost are assumptions, not measurements")
_WHY_DEEPEP = ("DeepEP low-latency sends one row per (token, expert) (no dedup: ~K/ranks-touched x our bytes) "
               "and sends node peers' rows over RDMA too, GPU-initiated (IBGDA, no proxy)")
_WHY_UCCL = ("UCCL-EP keeps DeepEP's low-latency message pattern (a write per token and expert, no dedup) "
             "through a CPU proxy on EFA: many small writes, each paying EFA's per-message cost")
_WHY_PPLX_CX7 = "fabric-lib's kernels and Rust proxy vs ours (dedup is the same idea)"

PUBLISHED = (
    Published("pplx-garden fabric-lib", 16, "cx7", "h200", 128, 7168, 256, 110.2, 185.5, _PPLX, _WHY_PPLX_CX7),
    Published("pplx-garden fabric-lib", 32, "cx7", "h200", 128, 7168, 256, 153.9, 266.3, _PPLX, _WHY_PPLX_CX7),
    Published("pplx-garden fabric-lib", 64, "cx7", "h200", 128, 7168, 256, 187.5, 309.1, _PPLX, _WHY_PPLX_CX7),
    Published("pplx-garden fabric-lib", 16, "efa-p5en", "h200", 128, 7168, 256, 214.8, 241.5, _PPLX, _WHY_PPLX_EFA),
    Published("pplx-garden fabric-lib", 32, "efa-p5en", "h200", 128, 7168, 256, 229.1, 335.0, _PPLX, _WHY_PPLX_EFA),
    Published("pplx-garden fabric-lib", 64, "efa-p5en", "h200", 128, 7168, 256, 266.7, 391.2, _PPLX, _WHY_PPLX_EFA),
    Published("DeepEP V1 low-latency", 16, "cx7", "h800", 128, 7168, 256, 118.0, 195.0, _DEEPEP, _WHY_DEEPEP),
    Published("DeepEP V1 low-latency", 32, "cx7", "h800", 128, 7168, 256, 155.0, 273.0, _DEEPEP, _WHY_DEEPEP),
    Published("DeepEP V1 low-latency", 64, "cx7", "h800", 128, 7168, 256, 173.0, 314.0, _DEEPEP, _WHY_DEEPEP),
    Published("DeepEP V1 low-latency", 128, "cx7", "h800", 128, 7168, 256, 192.0, 369.0, _DEEPEP, _WHY_DEEPEP),
    Published("DeepEP V1 low-latency", 256, "cx7", "h800", 128, 7168, 256, 194.0, 360.0, _DEEPEP, _WHY_DEEPEP),
    # UCCL's command line uses --num-experts=288 (so EP24 divides it); the table does not restate E.
    Published("UCCL-EP", 16, "efa-p5en", "h200", 128, 7168, 288, 226.0, 293.0, _UCCL, _WHY_UCCL),
    Published("UCCL-EP", 24, "efa-p5en", "h200", 128, 7168, 288, 386.0, 580.0, _UCCL, _WHY_UCCL),
    Published("UCCL-EP", 32, "efa-p5en", "h200", 128, 7168, 288, 465.0, 694.0, _UCCL, _WHY_UCCL),
)
# Hardware notes: pplx-garden's blog names 8x H200 inference nodes; its benchmark command uses
# --nets-per-gpu 2 (p5en's 2 x 200 Gb/s) for EFA. DeepEP: H800 + ConnectX-7 400 Gb/s. UCCL: p5en.


# ----------------------------------------------------------------------------- routing statistics

@dataclass(frozen=True)
class Shape:
    """The workload of one prediction."""

    tokens: int = 128
    hidden: int = 7168
    topk: int = 8
    experts: int = 256
    dtype: str = "fp8"          # dispatch payload; combine is bf16
    routing: str = "uniform"    # uniform | zipf | holes (uniform with a share of -1 selections)
    zipf_s: float = 1.0
    holes: float = 0.1          # holes only
    seed: int = 0


@functools.lru_cache(maxsize=64)
def _draw(R: int, shape: Shape) -> np.ndarray:
    """``C[s, p]`` int64 [R, R]: rows rank s sends to rank p, from ``make_routing`` of every rank
    (x drawn with hidden 16: the routing's distribution is the bench's, the draw is cheap)."""
    from .workloads import Routing, Workload, make_routing

    kind = "uniform" if shape.routing == "holes" else shape.routing
    routing = Routing(kind=kind, zipf_s=shape.zipf_s, holes=shape.holes if shape.routing == "holes" else 0.0)
    wl = Workload(num_tokens=shape.tokens, hidden=16, topk=shape.topk, num_experts=shape.experts,
                  dispatch_dtype=shape.dtype, combine_dtype="bf16", layout="masked", expert_alignment=1,
                  routing=routing, seed=shape.seed)
    el = shape.experts // R
    C = np.zeros((R, R), np.int64)
    for s in range(R):
        idx = make_routing(wl, s)[1].numpy()
        hit = np.zeros((shape.tokens, R + 1), bool)          # column R: a -1 selection
        dst = np.where(idx >= 0, idx // el, R)
        hit[np.arange(shape.tokens)[:, None], dst] = True
        C[s] = hit[:, :R].sum(axis=0)
    return C


def count_matrix(R: int, shape: Shape) -> np.ndarray:
    """A copy of the drawn count matrix ``C[s, p]`` for ``R`` ranks."""
    return _draw(R, shape).copy()


def touch_probability(R: int, topk: int, experts: int) -> float:
    """Uniform top-K: the probability that a token has an expert on a given rank,
    ``1 - C(E - E/R, K) / C(E, K)``."""
    el, miss = experts // R, 1.0
    for i in range(topk):
        miss *= max(0.0, (experts - el - i) / (experts - i))
    return 1.0 - miss


def routing_stats(C: np.ndarray, G: int) -> dict:
    """Rows per destination rank and node, the slowest source, the share crossing nodes."""
    R = C.shape[0]
    node = np.arange(R) // G
    remote = node[:, None] != node[None, :]
    off = ~np.eye(R, dtype=bool)
    N = R // G
    per_node = np.stack([C[:, node == n].sum(axis=1) for n in range(N)], axis=1)      # [s, n]
    other_node = node[:, None] != np.arange(N)[None, :]
    sent_remote = (C * remote).sum(axis=1)
    recv_remote = (C * remote).sum(axis=0)
    total = int(C.sum())
    return dict(rows_per_dest_rank=float(C[off].mean()) if R > 1 else 0.0,
                rows_per_dest_node=float(per_node[other_node].mean()) if N > 1 else 0.0,
                rows_sent_remote_mean=float(sent_remote.mean()),
                rows_sent_remote_max=int(sent_remote.max()),
                rows_recv_remote_max=int(recv_remote.max()),
                slowest_source=int(sent_remote.argmax()),
                cross_node_fraction=float((C * remote).sum() / total) if total else 0.0,
                rows_total=total)


# ----------------------------------------------------------------------------- the model

def _kernel_us(op: str, tokens: int) -> float:
    """The R=1 kernel of ``op`` at ``tokens`` per rank: the line through the two measured points."""
    (t0, k0), (t1, k1) = KERNEL_US[op]
    return max(0.0, k0 + (tokens - t0) * (k1 - k0) / (t1 - t0))


def _proxy_us(op: str, R: int) -> float:
    """The proxy thread's measured CPU per op at R ranks (linear between measured R, slope beyond)."""
    pts = sorted(PROXY_US[op].items())
    if R >= pts[-1][0]:
        return pts[-1][1] + (R - pts[-1][0]) * PROXY_SLOPE_US[op]
    return float(np.interp(R, [r for r, _ in pts], [v for _, v in pts]))


def _shards(nbytes: int, k: int) -> int:
    """Messages one write of ``nbytes`` becomes over ``k`` NICs (shards of at least MIN_SHARD)."""
    return max(1, min(k, nbytes // MIN_SHARD)) if nbytes > 0 else 1


def _spec(R: int, G: int, shape: Shape):
    """moe_ep's row format and capacities for this shape (the ones ``EPBuffer`` would set)."""
    from moe_ep.internode.spec import RemoteSpec, default_private_capacity

    cap = default_private_capacity(shape.tokens, shape.topk, shape.experts, R)
    return RemoteSpec(rank=0, world=R, node_size=G, num_experts=shape.experts, topk=shape.topk,
                      hidden=shape.hidden, max_tokens=shape.tokens, fp8=shape.dtype == "fp8",
                      private_capacity=cap, overflow_capacity=0)


def payload_bytes(hidden: int, dtype: str) -> int:
    """A dispatch row's payload: fp8 ``H + 4 * ceil(H / 128)`` (its scales) or bf16 ``2H``."""
    return hidden + 4 * math.ceil(hidden / FP8_BLOCK) if dtype == "fp8" else 2 * hidden


def _critical(phases: dict, single_node: bool) -> tuple[float, list[str], str]:
    """Total, the phases on the critical path, and the one that dominates it."""
    p = phases
    if single_node:
        path = ["kernel", "nvlink"]
    else:
        wire = p["nic"] + p["slowest_source"]
        tail = ["proxy"] if p["proxy"] > wire else ["nic", "slowest_source"]
        remote = p["pack"] + p["bells"] + max(p["proxy"], wire)
        path = ["kernel"] + (["nvlink"] if p["nvlink"] > remote else ["pack", "bells"] + tail) + ["unpack"]
    total = sum(p[k] for k in path)
    return total, path, max(path, key=lambda k: p[k])


def _remote(R: int, G: int) -> np.ndarray:
    """bool [R, R]: ranks s and p on different nodes (G ranks per node)."""
    node = np.arange(R) // G
    return node[:, None] != node[None, :]


def _nvlink(ph: dict, C: np.ndarray, G: int, row_bytes: int, gpu: Gpu, sent_axis: int) -> dict:
    """The NVLink term into ``ph``: max over ranks of max(bytes sent, bytes received) to / from node
    peers / NVLink + the flag round trip; rows C[s, p] are sent along ``sent_axis`` (1: by s, 0: by
    p). Returns the NVLink bytes (per rank, in all)."""
    R = C.shape[0]
    local_peer = ~_remote(R, G) & ~np.eye(R, dtype=bool)
    nv_out, nv_in = (C * local_peer).sum(axis=sent_axis) * row_bytes, (C * local_peer).sum(axis=1 - sent_axis) * row_bytes
    nv_max = int(max(nv_out.max(), nv_in.max())) if R > 1 else 0
    ph["nvlink"] = (nv_max / (gpu.nvlink_gbs * 1e3) + FLAG_RTT_US) if nv_max else 0.0
    return dict(nvlink_per_rank=float(nv_out.mean()), nvlink_total=int(nv_out.sum()))


def _one_node(ph: dict, bytes_: dict) -> dict:
    """One node holds every rank: no proxy, no NIC."""
    for k in ("pack", "bells", "proxy", "nic", "slowest_source", "unpack"):
        ph[k] = 0.0
    bytes_.update(nic_per_rank=0.0, nic_total=0, round2_total=0, headers_total=0)
    return _finish(ph, bytes_, True, dict(writes_per_rank=0.0, round2_writes=0))


def _dispatch(C: np.ndarray, G: int, shape: Shape, gpu: Gpu, nic: Nic) -> dict:
    R = C.shape[0]
    remote = _remote(R, G)
    pay = payload_bytes(shape.hidden, shape.dtype)
    # kernel = the R=1 kernel line at T tokens
    ph = dict(kernel=_kernel_us("dispatch", shape.tokens))
    bytes_ = _nvlink(ph, C, G, pay, gpu, sent_axis=1)  # source s sends C[s, p] rows to node peer p
    if R <= G:
        return _one_node(ph, bytes_)
    spec = _spec(R, G, shape)
    rb, cap, hdr = spec.row_bytes, spec.private_capacity, spec.hdr_bytes
    # round 1: a header to each of the R-1 other ranks; rows min(c, cap) to each remote peer.
    # round 2: the overflow max(0, c - cap) to each remote peer, once every header is in.
    r1 = np.where(remote, np.minimum(C, cap), 0)
    r2 = np.where(remote, np.maximum(C - cap, 0), 0)
    out = (r1 + r2).sum(axis=1) * rb + (R - 1) * hdr                      # per source, bytes on its NIC
    inn = (r1 + r2).sum(axis=0) * rb + (R - 1) * hdr                      # per destination
    k = nic.nics
    msgs = np.array([(R - 1) + sum(_shards(int(r1[s, p] * rb), k) for p in np.nonzero(r1[s])[0])
                     + sum(_shards(int(r2[s, p] * rb), k) for p in np.nonzero(r2[s])[0]) for s in range(R)])
    writes = (R - 1) + (r1 > 0).sum(axis=1) + (r2 > 0).sum(axis=1)
    has_r2 = bool(r2.any())
    # pack = remote rows (read + written) / copy bandwidth + one launch
    ph["pack"] = 2 * float((r1 + r2).sum(axis=1).max() * rb) / (COPY_GBS * 1e3) + LAUNCH_IN_GRAPH_US
    # bells = one GPU <-> host flag round trip (bell seen by the proxy, ready word seen by the kernel)
    ph["bells"] = FLAG_RTT_US
    # proxy = measured CPU per op at R + (posts beyond one per write, for k NICs) x post cost
    ph["proxy"] = _proxy_us("dispatch", R) + float((msgs - writes).mean()) * POST_US
    # nic = (1 + round 2) x latency + mean rank's bytes / bandwidth + its messages per NIC x message cost
    ph["nic"] = (nic.latency_us * (2 if has_r2 else 1) + float(out.mean()) / (nic.gbs * 1e3)
                 + float(msgs.mean()) / k * nic.msg_us)
    # slowest_source = (max over ranks of bytes out or in - mean) / bandwidth
    ph["slowest_source"] = (float(max(out.max(), inn.max())) - float(out.mean())) / (nic.gbs * 1e3)
    # unpack = remote rows received (read + written) / copy bandwidth + one launch
    ph["unpack"] = 2 * float((r1 + r2).sum(axis=0).max() * rb) / (COPY_GBS * 1e3) + LAUNCH_IN_GRAPH_US
    bytes_.update(nic_per_rank=float(out.mean()), nic_total=int(out.sum()), round2_total=int(r2.sum() * rb),
                  headers_total=int(R * (R - 1) * hdr))
    return _finish(ph, bytes_, False, dict(writes_per_rank=float(writes.mean()), round2_writes=int((r2 > 0).sum()),
                                           private_capacity=cap, row_bytes=rb))


def _combine(C: np.ndarray, G: int, shape: Shape, gpu: Gpu, nic: Nic) -> dict:
    R = C.shape[0]
    remote = _remote(R, G)
    row = 2 * shape.hidden                                                  # one bf16 row per (token, owner)
    ph = dict(kernel=_kernel_us("combine", shape.tokens))
    bytes_ = _nvlink(ph, C, G, row, gpu, sent_axis=0)  # owner p sends back C[s, p] rows to node peer s
    if R <= G:
        return _one_node(ph, bytes_)
    Cr = np.where(remote, C, 0)
    out = Cr.sum(axis=0) * row                                             # per owner
    inn = Cr.sum(axis=1) * row                                             # per source
    k = nic.nics
    msgs = np.array([sum(_shards(int(Cr[s, p] * row), k) for s in np.nonzero(Cr[:, p])[0]) for p in range(R)])
    writes = (Cr > 0).sum(axis=0)
    # pack = pre-reduced rows for remote sources written to the send buffer (read + written) + one launch
    ph["pack"] = 2 * float(out.max()) / (COPY_GBS * 1e3) + LAUNCH_IN_GRAPH_US
    ph["bells"] = FLAG_RTT_US
    # proxy = measured combine CPU per op at R + extra posts for k NICs
    ph["proxy"] = _proxy_us("combine", R) + float((msgs - writes).mean()) * POST_US
    # nic = latency + mean owner's bytes / bandwidth + messages per NIC x message cost (no round 2)
    ph["nic"] = nic.latency_us + float(out.mean()) / (nic.gbs * 1e3) + float(msgs.mean()) / k * nic.msg_us
    ph["slowest_source"] = (float(max(out.max(), inn.max())) - float(out.mean())) / (nic.gbs * 1e3)
    # unpack = partial rows received, summed into out (read + written) + one launch
    ph["unpack"] = 2 * float(inn.max()) / (COPY_GBS * 1e3) + LAUNCH_IN_GRAPH_US
    bytes_.update(nic_per_rank=float(out.mean()), nic_total=int(out.sum()), round2_total=0, headers_total=0)
    return _finish(ph, bytes_, False, dict(writes_per_rank=float(writes.mean()), round2_writes=0))


def _finish(ph: dict, bytes_: dict, single: bool, extra: dict) -> dict:
    total, path, dom = _critical(ph, single)
    return dict(phases_us={k: round(v, 3) for k, v in ph.items()}, latency_us=round(total, 2),
                critical_path=path, dominant=dom, bytes=bytes_, **extra)


def predict(ep: int, gpus_per_node: int, nic: str, shape: Shape, gpu: str = "h200") -> dict:
    """One EP size: routing statistics and, per op, phases (µs), latency, critical path, bytes."""
    if shape.experts % ep:
        raise ValueError(f"--ep {ep}: expected a divisor of --experts {shape.experts}")
    G = min(gpus_per_node, ep)
    if ep % G:
        raise ValueError(f"--ep {ep}: expected a multiple of --gpus-per-node {gpus_per_node}")
    C = _draw(ep, shape)
    g, n = GPUS[gpu], NICS[nic]
    stats = routing_stats(C, G)
    stats["touch_probability_uniform"] = touch_probability(ep, shape.topk, shape.experts)
    return dict(ep=ep, nodes=ep // G, gpus_per_node=G, nic=nic, gpu=gpu, routing=stats,
                dispatch=_dispatch(C, G, shape, g, n), combine=_combine(C, G, shape, g, n))


# ----------------------------------------------------------------------------- check and output

def check(seed: int = 0) -> list[dict]:
    """Every published point against the model's prediction at its shape (uniform routing)."""
    rows = []
    for pub in PUBLISHED:
        shape = Shape(tokens=pub.tokens, hidden=pub.hidden, topk=8, experts=pub.experts, seed=seed)
        p = predict(pub.ep, 8, pub.nic, shape, pub.gpu)
        row = dict(system=pub.system, ep=pub.ep, nic=pub.nic, gpu=pub.gpu, tokens=pub.tokens, hidden=pub.hidden,
                   experts=pub.experts, source=pub.source)
        for op, pv in (("dispatch", pub.dispatch_us), ("combine", pub.combine_us)):
            pred = p[op]["latency_us"]
            res = 100.0 * (pred - pv) / pv
            row[op] = dict(published_us=pv, predicted_us=pred, residual_pct=round(res, 1),
                           miss=abs(res) > MISS_PCT, dominant=p[op]["dominant"])
        row["why_apart"] = pub.why_apart if (row["dispatch"]["miss"] or row["combine"]["miss"]) else ""
        rows.append(row)
    return rows


def format_check(rows: list[dict]) -> str:
    """Markdown: prediction vs published, residual %, and the reason for each miss."""
    lines = [f"| system | EP | NIC | GPU | dispatch pub / pred (µs) | residual | combine pub / pred (µs) | residual | "
             f"miss (>{MISS_PCT:g}%): why |",
             "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        d, c = r["dispatch"], r["combine"]
        lines.append(f"| {r['system']} | {r['ep']} | {r['nic']} | {r['gpu']} | {d['published_us']:g} / "
                     f"{d['predicted_us']:.1f} | {d['residual_pct']:+.0f}%{' MISS' if d['miss'] else ''} | "
                     f"{c['published_us']:g} / {c['predicted_us']:.1f} | {c['residual_pct']:+.0f}%"
                     f"{' MISS' if c['miss'] else ''} | {r['why_apart']} |")
    srcs = sorted({r["source"] for r in rows})
    return "\n".join(lines + [""] + [f"source: {s}" for s in srcs])


PHASES = ("kernel", "nvlink", "pack", "bells", "proxy", "nic", "slowest_source", "unpack")


def format_table(points: list[dict]) -> str:
    """Markdown: one line per (EP, op): each phase (µs), the latency, what dominates, bytes."""
    cols = ["EP", "op"] + list(PHASES) + ["latency", "dominant", "NVLink MB/rank", "NIC MB/rank", "round 2 MB",
                                          "cross-node"]
    lines = ["| " + " | ".join(cols) + " |",
             "|" + " --- |" * 2 + " ---: |" * len(PHASES) + " ---: | --- |" + " ---: |" * 4]
    for p in points:
        for op in ("dispatch", "combine"):
            d = p[op]
            cells = [str(p["ep"]), op] + [f"{d['phases_us'][k]:.1f}" for k in PHASES]
            cells += [f"**{d['latency_us']:.1f}**", d["dominant"], f"{d['bytes']['nvlink_per_rank'] / 1e6:.2f}",
                      f"{d['bytes']['nic_per_rank'] / 1e6:.2f}", f"{d['bytes']['round2_total'] / 1e6:.2f}",
                      f"{p['routing']['cross_node_fraction']:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The ``moe-ep-bench model`` arguments."""
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ep", type=int_list("--ep"), default=[8, 16, 32, 64, 128, 256], help="EP sizes (default 8,...,256)")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="ranks per NVLink node (default 8)")
    ap.add_argument("--nic", choices=sorted(NICS), default="cx7",
                    help="cx7: ConnectX-7 400 Gb/s per GPU; efa: AWS p5, 4 x 100 Gb/s per GPU; efa-p5en: 2 x 200 Gb/s")
    ap.add_argument("--gpu", choices=sorted(GPUS), default="h200", help="sets the NVLink bandwidth (default h200)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per rank (default 128)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8", help="dispatch payload (combine is bf16)")
    ap.add_argument("--routing", choices=["uniform", "zipf", "holes"], default="uniform",
                    help="the bench's generators: uniform, zipf (--zipf-s), holes (uniform with --holes of -1 ids)")
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--holes", type=float, default=0.1, help="share of -1 selections for --routing holes")
    ap.add_argument("--seed", type=int, default=0, help="routing draw seed")
    ap.add_argument("--check", action="store_true", help="predictions against published numbers, with residuals")
    ap.add_argument("--json", metavar="OUT", help="write the results here")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``moe-ep-bench model``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser()
    a = ap.parse_args(argv)
    if a.hidden % 16 or a.hidden < 16 or a.topk < 1 or a.topk > a.experts or a.tokens < 1 or a.gpus_per_node < 1:
        ap.error("expected --hidden a positive multiple of 16, 1 <= --topk <= --experts, --tokens >= 1, "
                 "--gpus-per-node >= 1")
    if not 0.0 <= a.holes < 1.0:
        ap.error(f"--holes: expected a probability in [0, 1), got {a.holes}")
    shape = Shape(tokens=a.tokens, hidden=a.hidden, topk=a.topk, experts=a.experts, dtype=a.dtype, routing=a.routing,
                  zipf_s=a.zipf_s, holes=a.holes, seed=a.seed)
    doc = dict(meta=dict(command=" ".join(["moe-ep-bench", "model"] + argv), model="moe_ep.bench.scale_model",
                         hardware="model (no hardware)"),
               config=dict(asdict(shape), gpus_per_node=a.gpus_per_node, nic=a.nic, gpu=a.gpu, ep=a.ep),
               constants=dict(gpu=asdict(GPUS[a.gpu]), nic=dict(asdict(NICS[a.nic]), gbs_per_gpu=NICS[a.nic].gbs),
                              kernel_us=KERNEL_US, flag_rtt_us=FLAG_RTT_US, launch_in_graph_us=LAUNCH_IN_GRAPH_US,
                              copy_gbs=COPY_GBS, proxy_us=PROXY_US, proxy_slope_us=PROXY_SLOPE_US, post_us=POST_US))
    if a.check:
        rows = check(a.seed)
        doc["check"] = rows
        print(format_check(rows))
    else:
        try:
            points = [predict(ep, a.gpus_per_node, a.nic, shape, a.gpu) for ep in a.ep]
        except ValueError as e:
            ap.error(str(e))
        doc["points"] = points
        print(f"{PROG}: T={a.tokens} H={a.hidden} K={a.topk} E={a.experts} {a.dtype} dispatch, {a.routing} routing, "
              f"{a.gpus_per_node} GPUs per node, {a.nic} ({NICS[a.nic].gbs:g} GB/s per GPU), {a.gpu} NVLink "
              f"{GPUS[a.gpu].nvlink_gbs:g} GB/s; µs (predictions, no hardware)")
        print(format_table(points))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"results: {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
