"""Inputs, expert functions and checks shared by the multi-rank tests.

Every rank builds the inputs of *all* ranks from one seed (cheap, and it lets the routing respect
global limits), then uses its own slice. Rank-side functions here return lists of failure strings
rather than stopping at the first, so one run reports every bad configuration precisely.

Data kinds:
- ``tagged``: integer-valued rows that bf16 and fp8 hold exactly: ``x[t,0] = source rank``,
  ``x[t,1] = token index``, one channel of 28 in each 128-channel block (so the fp8 scale is
  exactly 1/16), the rest random integers in [-8, 8]. Weights are +-{1/4, 1/2, 1, 2} and the exact
  expert function keeps every partial sum representable in bf16, so combine is checked exactly.
- ``random``: bf16 normals of varied magnitude per row (one all-zero row per rank), weights in
  [0, 1), a float expert function; combine is checked against a bf16 tolerance.

The rows layout (``layout="rows"``) is checked against ``moe_ep.testing.reference.reference_rows`` row for
row in order (its order is part of the contract), with every field of its result; the caller's
expert step reduces each row over its local experts (so combine's answer is the same MoE output),
and every other call also hands back combine weights (``rows_wy``), whose sums are checked too.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

FP8 = torch.float8_e4m3fn
DTYPES = {"bf16": torch.bfloat16, "fp8": FP8, "fp8pre": FP8}
MAX_REPORT = 6


# ---------------------------------------------------------------------------- cases
@dataclass
class Case:
    """One buffer configuration and the sequence of calls made on it.

    ``calls``: routing kinds in order; ``"repeat"`` repeats call 0's inputs exactly (determinism).
    ``dtype``: ``bf16``, ``fp8`` (bf16 input quantized in-kernel) or ``fp8pre`` (fp8 input + scales).
    ``late_weights``: the weights go to combine (``topk_weights=``); dispatch gets wrong ones.
    ``hooks``: every call with ``return_recv_hook=True``; between a call and its hook the caller
    overwrites the inputs it passed (the receive half must not read them).
    ``cm_scales``: the buffer's fp8 scales column-major in each expert's block (masked fp8).
    ``fused_internode``: ``Tuning(fused_internode=True)`` (across nodes, one launch per op where
    every program is resident).
    ``graph_launch``: ``Tuning(graph_launch=...)`` (replayed calls of two launches as one graph
    launch); None: the buffer's default (on across nodes, on a GPU).
    """

    R: int
    E: int
    K: int
    dtype: str = "bf16"
    layout: str = "masked"
    align: int = 1
    H: int = 128
    M: int = 8
    data: str = "tagged"
    calls: Sequence[str] = ("uniform", "skewed", "sparse", "repeat")
    seed: int = 0
    late_weights: bool = False
    programs: Optional[int] = None  # EPBuffer(num_programs=); None: the buffer's default
    hooks: bool = False
    cm_scales: bool = False  # EPBuffer(column_major_scales=True): masked fp8 only
    recv_rows: object = None  # EPBuffer(max_recv_rows=): packed and rows; None: sized per call
    fused_internode: bool = False
    graph_launch: Optional[bool] = None

    @property
    def name(self) -> str:
        return (f"R{self.R}-E{self.E}-K{self.K}-{self.dtype}-{self.layout}-a{self.align}-H{self.H}-M{self.M}-"
                f"{self.data}-s{self.seed}" + ("-late" if self.late_weights else "")
                + (f"-p{self.programs}" if self.programs else "") + ("-hooks" if self.hooks else "") + ("-cm" if self.cm_scales else "")
                + (f"-rows{self.recv_rows}" if self.recv_rows is not None else "")
                + ("-fused" if self.fused_internode else "") + ({True: "-graph-launch", False: "-no-graph-launch"}.get(self.graph_launch, "")))

    def token_counts(self, call: int) -> List[int]:
        """Ragged T per rank: each call mixes max_tokens, 0 and an in-between count."""
        g = torch.Generator().manual_seed(self.seed * 7919 + call * 31 + 5)
        mid = int(torch.randint(1, max(2, self.M), (1,), generator=g)) if self.M > 1 else 1
        choices = [self.M, 0, mid]
        return [choices[(call + r) % 3] for r in range(self.R)]


@dataclass
class RankInputs:
    x: torch.Tensor  # [T, H] bf16, or fp8 for fp8pre
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    x_scales: Optional[torch.Tensor] = None


def _route(kind: str, Ts: List[int], E: int, K: int, g: torch.Generator) -> List[torch.Tensor]:
    out = []
    hot = int(torch.randint(0, E, (1,), generator=g))
    subset = torch.randperm(E, generator=g)[: max(1, E // 4)]
    zipf_order = torch.randperm(E, generator=g)
    for T in Ts:
        idx = torch.full((T, K), -1, dtype=torch.int64)
        for t in range(T):
            if kind == "uniform":
                row = (torch.randperm(E, generator=g)[:K] if K <= E
                       else torch.randint(0, E, (K,), generator=g))
            elif kind == "skewed":  # every token selects the hot expert
                others = torch.randperm(E - 1, generator=g)[: K - 1]
                others = others + (others >= hot).long()
                if K - 1 > E - 1:
                    others = torch.cat([others, torch.randint(0, E, (K - 1 - (E - 1),), generator=g)])
                row = torch.cat([torch.tensor([hot]), others])[torch.randperm(K, generator=g)]
            elif kind == "sparse":  # few experts used (empty experts and ranks), -1 ids, duplicates
                row = subset[torch.randint(0, len(subset), (K,), generator=g)]
                if K >= 2 and t % 3 == 0:
                    row[1] = row[0]  # a duplicate within the token
                row = torch.where(torch.rand(K, generator=g) < 0.35, torch.tensor(-1), row)
                if t % 5 == 4:
                    row[:] = -1  # a token with no expert at all
            elif kind == "none":
                row = torch.full((K,), -1, dtype=torch.int64)
            elif kind == "zipf":  # expert popularity ~ 1 / rank^1.2 (a few hot experts, a long tail)
                pz = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
                row = torch.multinomial(pz[zipf_order], K, replacement=K > E, generator=g)
            elif kind == "all_to_one":  # every token of every rank to the last rank's experts
                EL = E // len(Ts)
                row = (len(Ts) - 1) * EL + (torch.randperm(EL, generator=g)[:K] if K <= EL
                                            else torch.randint(0, EL, (K,), generator=g))
            else:
                raise ValueError(kind)
            idx[t] = row
        out.append(idx)
    return out


def _cap(idxs: List[torch.Tensor], E: int, cap: int) -> None:
    """Drops selections (to -1) beyond ``cap`` per expert, over all ranks (the masked layout's
    rows per expert; only reachable with duplicates)."""
    seen = Counter()
    for idx in idxs:
        for t in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if e >= 0:
                    seen[e] += 1
                    if seen[e] > cap:
                        idx[t, k] = -1


def make_inputs(case: Case, call: int) -> List[RankInputs]:
    """Inputs of every rank for call ``call`` of ``case`` (CPU tensors)."""
    if call > 0 and case.calls[call] == "repeat":
        return make_inputs(case, 0)
    kind = case.calls[call]
    g = torch.Generator().manual_seed(case.seed * 1_000_003 + call * 101 + case.R)
    Ts = case.token_counts(call)
    idxs = _route(kind, Ts, case.E, case.K, g)
    _cap(idxs, case.E, case.R * case.M)
    out = []
    H = case.H
    for r, T in enumerate(Ts):
        if case.data == "tagged":
            x = torch.randint(-8, 9, (T, H), generator=g).float()
            x[:, 2::128] = 28.0  # block max 28: fp8 scale exactly 1/16
            x[:, 0] = r
            x[:, 1] = torch.arange(T, dtype=torch.float32)
            vals = torch.tensor([0.25, 0.5, 1.0, 2.0])
            w = vals[torch.randint(0, 4, (T, case.K), generator=g)]
            w = w * (torch.randint(0, 2, (T, case.K), generator=g) * 2 - 1)
        else:
            mag = torch.exp(torch.randn(T, 1, generator=g) * 2)
            x = torch.randn(T, H, generator=g) * mag
            if T:
                x[T // 2] = 0.0
            w = torch.rand(T, case.K, generator=g)
        x = x.to(torch.bfloat16)
        idx = idxs[r]
        if r % 2 == 1:
            idx = idx.to(torch.int32)  # both index dtypes are accepted
        inp = RankInputs(x, idx.contiguous(), w.float().contiguous())
        if case.dtype == "fp8pre":
            from moe_ep.core.fp8 import quantize_fp8

            q, s = quantize_fp8(x)
            # Scales the kernel cannot re-derive: the given (q, scales) must travel untouched.
            inp.x, inp.x_scales = q, (s * 2.0).contiguous()
        out.append(inp)
    return out


# ---------------------------------------------------------------------------- expert functions
_TABLES: Dict[Tuple[str, int, int, str], torch.Tensor] = {}


def _table(kind: str, e: int, H: int, device) -> torch.Tensor:
    """Per-expert constants, cached per device (so a CUDA graph captures no host copy)."""
    key = (kind, e, H, str(device))
    if key not in _TABLES:
        if kind == "offsets":
            t = torch.randint(0, 7, (H,), generator=torch.Generator().manual_seed(1000 + e)).float()
        else:
            t = torch.randn(H, generator=torch.Generator().manual_seed(2000 + e))
        _TABLES[key] = t.to(device)
    return _TABLES[key]


def exact_expert(e: int, rows: torch.Tensor) -> torch.Tensor:
    """Integer rows -> integers in [-3, 3], a different function per expert (bf16 holds every
    weighted sum of <= 8 of them with weights +-{1/4..2} exactly)."""
    return torch.remainder(rows.float() + _table("offsets", e, rows.shape[-1], rows.device), 7.0) - 3.0


def float_expert(e: int, rows: torch.Tensor) -> torch.Tensor:
    """A float expert, rounded to bf16 as the expert output handed to combine is."""
    b = _table("bias", e, rows.shape[-1], rows.device)
    return (rows.float() * (0.5 + 0.125 * (e % 7)) + b).to(torch.bfloat16).float()


def expert_fn_for(case: Case):
    return exact_expert if case.data == "tagged" else float_expert


# ---------------------------------------------------------------------------- reading a dispatch result
def received(handle, case: Case, e: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The valid rows (and scales) of local expert ``e`` in the implementation's output (CPU)."""
    c = int(handle.expert_counts[e])
    if case.layout == "masked":
        x = handle.expert_x[e, :c]
        s = handle.expert_scales[e, :c] if handle.expert_scales is not None else None
    else:
        o = int(handle.expert_offsets[e])
        x = handle.expert_x[o:o + c]
        s = handle.expert_scales[o:o + c] if handle.expert_scales is not None else None
    return x.cpu().clone(), (s.cpu().clone() if s is not None else None)


def _key_rows(x: torch.Tensor, s: Optional[torch.Tensor]) -> List[bytes]:
    xb = x.contiguous().view(torch.uint8).numpy()
    if s is None:
        return [xb[i].tobytes() for i in range(xb.shape[0])]
    sb = np.ascontiguousarray(s.float().numpy()).view(np.uint8)  # (any strides: column-major scales too)
    return [xb[i].tobytes() + sb[i].tobytes() for i in range(xb.shape[0])]


def _bf16_bits(rows: torch.Tensor) -> torch.Tensor:
    """float32 rows that hold bf16 values exactly -> those bf16 values, bit for bit (the high
    halves; torch's float32 -> bf16 cast would rewrite a NaN's bits)."""
    return (rows.contiguous().view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)


def _as_float(x: torch.Tensor, s: Optional[torch.Tensor]) -> torch.Tensor:
    if s is None:
        return x.float()
    from moe_ep.core.fp8 import dequantize_fp8

    return dequantize_fp8(x, s.float())


def poison(handle, out: Optional[torch.Tensor] = None) -> None:
    """NaN-fills what the caller may read, so a later call that leaves rows unwritten is caught."""
    if handle.expert_x.dtype == FP8:
        handle.expert_x.view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
        handle.expert_scales.fill_(float("nan"))
    else:
        handle.expert_x.fill_(float("nan"))
    if handle.recv_topk_idx is not None:
        handle.recv_topk_idx.fill_(-7)
        handle.recv_topk_weights.fill_(float("nan"))
        handle.recv_src.fill_(-7)
        handle.num_recv.fill_(-7)
    if out is not None and out.numel():
        out.fill_(float("nan"))


def reference_for(group, case: Case, x, idx, w, sc):
    """The oracle of ``case``'s layout for one dispatch (collective)."""
    from moe_ep.testing.reference import reference_dispatch, reference_rows

    if case.layout == "rows":
        return reference_rows(group, case.E, case.M, x, idx, w, x_scales=sc, dispatch_dtype=DTYPES[case.dtype])
    return reference_dispatch(group, case.E, x, idx, w, x_scales=sc, dispatch_dtype=DTYPES[case.dtype])


def first_expert(ref, case: Case) -> int:
    """The global id of the first local expert of the rank ``ref`` is for."""
    return ref.rank * (case.E // case.R)


def check_rows(handle, ref, case: Case, where: str) -> List[str]:
    """A rows-layout dispatch result against ``moe_ep.testing.reference.ReferenceRows``: shapes, dtypes,
    counts, then every defined row in order (bit-exact payload, ids, weights, sources). The
    received tensors' rows: sized per call (``case.recv_rows`` None) exactly the oracle's count,
    else the cap or the worst case ``R * M``."""
    fails: List[str] = []
    R, M, H, K, EL = case.R, case.M, case.H, case.K, case.E // case.R
    CAP = ref.num_recv if case.recv_rows is None else R * M if case.recv_rows == "worst" else case.recv_rows
    dt = DTYPES[case.dtype]
    fp8 = dt == FP8
    nb = -(-H // 128)
    x, sc = handle.expert_x, handle.expert_scales
    want = [("expert_x", x, dt, (CAP, H)), ("recv_topk_idx", handle.recv_topk_idx, torch.int32, (CAP, K)),
            ("recv_topk_weights", handle.recv_topk_weights, torch.float32, (CAP, K)),
            ("recv_src", handle.recv_src, torch.int32, (CAP,)), ("num_recv", handle.num_recv, torch.int32, (1,)),
            ("expert_counts", handle.expert_counts, torch.int32, (EL,))]
    if fp8:
        want.append(("expert_scales", sc, torch.float32, (CAP, nb)))
    elif sc is not None:
        fails.append(f"{where}: expert_scales should be None for bf16 dispatch")
    if handle.expert_offsets is not None:
        fails.append(f"{where}: expert_offsets should be None for the rows layout")
    for name, t, dtype, shape in want:
        if t is None or t.dtype != dtype or tuple(t.shape) != shape or t.device != x.device:
            fails.append(f"{where}: {name} {None if t is None else (t.dtype, list(t.shape), str(t.device))}, "
                         f"expected {dtype} {list(shape)} on {x.device}")
    if fails:
        return fails
    n = int(handle.num_recv[0])
    if n != ref.num_recv:
        return [f"{where}: num_recv {n}, expected {ref.num_recv} (sources {ref.src.tolist()[:12]})"]
    counts = [int(c) for c in handle.expert_counts.cpu()]
    if counts != ref.counts:
        fails.append(f"{where}: expert_counts {counts}, expected {ref.counts}")
    got_src = handle.recv_src[:n].cpu().to(torch.int64)
    if not torch.equal(got_src, ref.src):
        bad = (got_src != ref.src).nonzero().flatten()[:MAX_REPORT].tolist()
        return fails + [f"{where}: recv_src differs at rows {bad}: got {got_src[bad].tolist()}, expected "
                        f"{ref.src[bad].tolist()} (order (source rank, source token))"]
    if not torch.equal(handle.recv_topk_idx[:n].cpu(), ref.topk_idx):
        bad = (handle.recv_topk_idx[:n].cpu() != ref.topk_idx).any(1).nonzero().flatten()[:MAX_REPORT].tolist()
        fails.append(f"{where}: recv_topk_idx differs at rows {bad}: got {handle.recv_topk_idx[bad].tolist()}, "
                     f"expected {ref.topk_idx[bad].tolist()}")
    gw = handle.recv_topk_weights[:n].cpu()
    if not torch.equal(gw.view(torch.int32), ref.topk_weights.view(torch.int32)):
        bad = (gw.view(torch.int32) != ref.topk_weights.view(torch.int32)).any(1).nonzero().flatten()[:MAX_REPORT]
        fails.append(f"{where}: recv_topk_weights differ at rows {bad.tolist()}: got {gw[bad].tolist()}, expected "
                     f"{ref.topk_weights[bad].tolist()}")
    if fp8:
        got = _key_rows(x[:n].cpu(), sc[:n].cpu())
        exp = _key_rows(ref.q, ref.scales)
    else:
        got = _key_rows(x[:n].cpu(), None)
        exp = _key_rows(_bf16_bits(ref.rows), None)
    bad = [i for i in range(n) if got[i] != exp[i]]
    if bad:
        fails.append(f"{where}: {len(bad)} of {n} rows differ from the oracle (bit for bit), e.g. rows {bad[:MAX_REPORT]} "
                     f"(sources {[int(ref.src[i]) for i in bad[:MAX_REPORT]]})")
    return fails


def rows_wy(r: int, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The combine weights rank ``r`` hands back with its rows in the tests: the received weights
    plus (r + 1) / 16 in every column, so a token's sum over ranks tells which ranks answered
    (exact in float32 for the tagged weights)."""
    return w.float() + (r + 1) / 16.0


def rows_expert_y(handle, case: Case, fn, rank: int):
    """The caller's side of a rows-layout combine: ``(y, wy)`` with ``y[i] = sum_k w[i,k] *
    fn(first + ids[i,k], row i)`` over the row's local experts (rounded to bf16 once) and ``wy``
    from ``rows_wy``; NaN past ``num_recv`` (combine must not read it)."""
    y = torch.full(handle.expert_x.shape, float("nan"), dtype=torch.bfloat16, device=handle.expert_x.device)
    wy = torch.full(handle.recv_topk_weights.shape, float("nan"), device=handle.expert_x.device)
    n = int(handle.num_recv[0])
    if n == 0:
        return y, wy
    vals = _as_float(handle.expert_x[:n], handle.expert_scales[:n] if handle.expert_scales is not None else None)
    ids, w = handle.recv_topk_idx[:n].long(), handle.recv_topk_weights[:n]
    y[:n] = rows_fn(fn, case.E // case.R)(rank, vals, ids, w).to(torch.bfloat16)
    wy[:n] = rows_wy(rank, ids, w)
    return y, wy


def rows_fn(fn, EL: int):
    """``row_fn`` of ``moe_ep.testing.reference.rows_combine_local`` for the expert function ``fn`` (EL
    local experts per rank): the weighted sum over a row's local experts."""
    def row_fn(r, vals, ids, w):
        f0 = r * EL
        acc = torch.zeros(vals.shape, dtype=torch.float32, device=vals.device)
        for k in range(ids.shape[1]):
            for e in ids[:, k].unique().tolist():
                if e < 0:
                    continue
                m = ids[:, k] == e
                acc[m] += w[m, k:k + 1].float() * fn(f0 + e, vals[m]).float()
        return acc
    return row_fn


def check_dispatch(handle, ref, case: Case, where: str) -> List[str]:
    """Compares one rank's dispatch result with the oracle; returns failure strings."""
    if case.layout == "rows":
        return check_rows(handle, ref, case, where)
    fails: List[str] = []
    R, E, H = case.R, case.E, case.H
    EL = E // R
    dt = DTYPES[case.dtype]
    fp8 = dt == FP8
    nb = -(-H // 128)
    x = handle.expert_x
    if x.dtype != dt:
        fails.append(f"{where}: expert_x dtype {x.dtype}, expected {dt}")
    if case.layout == "masked":
        if tuple(x.shape) != (EL, R * case.M, H):
            fails.append(f"{where}: masked expert_x shape {list(x.shape)}, expected {[EL, R * case.M, H]}")
    elif x.dim() != 2 or x.shape[1] != H:
        fails.append(f"{where}: packed expert_x shape {list(x.shape)}, expected [capacity, {H}]")
    if fp8:
        s = handle.expert_scales
        if s is None or s.dtype != torch.float32 or tuple(s.shape) != tuple(x.shape[:-1]) + (nb,):
            fails.append(f"{where}: expert_scales {None if s is None else (s.dtype, list(s.shape))}, "
                         f"expected float32 {list(x.shape[:-1]) + [nb]}")
    elif handle.expert_scales is not None:
        fails.append(f"{where}: expert_scales should be None for bf16 dispatch")
    counts = handle.expert_counts
    if counts.dtype != torch.int32 or tuple(counts.shape) != (EL,) or counts.device != x.device:
        fails.append(f"{where}: expert_counts {counts.dtype} {list(counts.shape)} on {counts.device}, "
                     f"expected int32 [{EL}] on {x.device}")
    got_counts = [int(c) for c in counts.cpu()]
    if got_counts != ref.counts:
        fails.append(f"{where}: expert_counts {got_counts}, expected {ref.counts}")
    if case.layout == "packed":
        off = handle.expert_offsets
        if off is None or off.dtype != torch.int32 or tuple(off.shape) != (EL + 1,):
            fails.append(f"{where}: expert_offsets {None if off is None else (off.dtype, list(off.shape))}, "
                         f"expected int32 [{EL + 1}]")
        else:
            o = [int(v) for v in off.cpu()]
            a = case.align
            want = [0]
            for c in got_counts:
                want.append(want[-1] + -(-c // a) * a)
            if o != want:
                fails.append(f"{where}: expert_offsets {o}, expected {want} (counts {got_counts} rounded up "
                             f"to {a}, from 0)")
            if o[-1] > x.shape[0]:
                fails.append(f"{where}: expert_offsets[-1]={o[-1]} beyond the packed capacity {x.shape[0]}")
    elif handle.expert_offsets is not None:
        pass  # allowed to exist for masked, but unused
    if fails:
        return fails
    for e in range(EL):
        gx, gs = received(handle, case, e)
        if fp8:
            exp_keys = _key_rows(ref.q[e].cpu(), ref.scales[e].cpu())
        else:
            exp_keys = _key_rows(_bf16_bits(ref.rows[e].cpu()), None)
        got_keys = _key_rows(gx, gs)
        if Counter(got_keys) == Counter(exp_keys):
            continue
        fails.append(f"{where}: local expert {e} (global {ref.first_expert + e}): received rows differ from the "
                     f"oracle: {_explain(gx, gs, got_keys, exp_keys, ref, e, case)}")
    return fails


def _explain(gx, gs, got_keys, exp_keys, ref, e, case) -> str:
    miss = Counter(exp_keys) - Counter(got_keys)
    extra = Counter(got_keys) - Counter(exp_keys)
    exp_src = {}
    for i, k in enumerate(exp_keys):
        exp_src.setdefault(k, []).append((int(ref.src_rank[e][i]), int(ref.src_token[e][i]), int(ref.src_k[e][i])))
    parts = [f"{sum(miss.values())} expected rows missing, {sum(extra.values())} unexpected rows"]
    missing = [exp_src[k][0] for k in list(miss)[:MAX_REPORT]]
    parts.append(f"missing (src_rank, token, k): {missing}")
    if case.data == "tagged":
        gf = _as_float(gx, gs)
        by_tag = {}
        for i in range(ref.rows[e].shape[0]):
            by_tag[(int(ref.src_rank[e][i]), int(ref.src_token[e][i]))] = i
        shown = 0
        for i, k in enumerate(got_keys):
            if k not in extra or shown >= MAX_REPORT:
                continue
            shown += 1
            row = gf[i]
            tag = (row[0].item(), row[1].item())
            tkey = (int(tag[0]), int(tag[1])) if all(v == v for v in tag) else None
            if tkey in by_tag:
                j = by_tag[tkey]
                want = ref.rows[e][j].cpu()
                bad = (row != want) & ~(torch.isnan(row) & torch.isnan(want))
                ch = bad.nonzero().flatten()[:4].tolist()
                note = f"row {i} tagged {tkey}: {int(bad.sum())} channels differ, e.g. ch {ch}: got " \
                       f"{row[ch].tolist()} expected {want[ch].tolist()}"
                if gs is not None:
                    note += f"; scales got {gs[i].tolist()} expected {ref.scales[e][j].tolist()}"
                parts.append(note)
            else:
                parts.append(f"row {i} has tag {tag} which is not expected here (NaN = unwritten row)")
    return "; ".join(parts)


def make_expert_y(handle, case: Case, fn, first_expert: int) -> torch.Tensor:
    EL = case.E // case.R
    if case.layout == "rows":
        return rows_expert_y(handle, case, fn, first_expert // EL)[0]
    y = torch.full(handle.expert_x.shape, float("nan"), dtype=torch.bfloat16, device=handle.expert_x.device)
    for e in range(EL):
        c = int(handle.expert_counts[e])
        if c == 0:
            continue
        if case.layout == "masked":
            x, s = handle.expert_x[e, :c], (handle.expert_scales[e, :c] if handle.expert_scales is not None else None)
        else:
            o = int(handle.expert_offsets[e])
            x, s = handle.expert_x[o:o + c], (handle.expert_scales[o:o + c] if handle.expert_scales is not None else None)
        vals = _as_float(x, s)
        yy = fn(first_expert + e, vals).to(torch.bfloat16)
        if case.layout == "masked":
            y[e, :c] = yy
        else:
            y[o:o + c] = yy
    return y


def check_combine(out: torch.Tensor, ref: torch.Tensor, ref_abs: torch.Tensor, T: int, case: Case,
                  where: str) -> List[str]:
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (T, case.H):
        return [f"{where}: combine returned {out.dtype} {list(out.shape)}, expected bfloat16 [{T}, {case.H}]"]
    got = out.float().cpu()
    ref, ref_abs = ref.cpu(), ref_abs.cpu()
    if case.data == "tagged":
        if not torch.equal(ref.to(torch.bfloat16).float(), ref):  # (a string, not a raise: the other
            # ranks would wait in the next call's collectives for this one)
            return [f"{where}: test data bug: the oracle is not bf16-exact ('tagged' data needs exact dtypes)"]
        bad = got != ref
    else:
        # Two bf16 roundings (the pre-reduced partials and the output; the interpreter truncates):
        # each <= 2^-7 relative to the magnitude of what is rounded.
        bad = ~((got - ref).abs() <= 2e-2 * ref_abs + 1e-30)
    if not bool(bad.any()):
        return []
    rows = bad.any(dim=1).nonzero().flatten().tolist()
    t = rows[0]
    ch = bad[t].nonzero().flatten()[:4].tolist()
    return [f"{where}: combine output differs on tokens {rows[:12]}{'...' if len(rows) > 12 else ''} "
            f"({'exact' if case.data == 'tagged' else 'tolerance'} check); token {t} ch {ch}: got "
            f"{got[t, ch].tolist()} expected {ref[t, ch].tolist()}"]


# ---------------------------------------------------------------------------- rank-side runners
def make_buffer(group, case: Case, timeout_s: float = 60.0):
    """The EPBuffer of ``case``. Every case is one the contract accepts (fp8 with a partial last
    scale block included), so a refusal is a failure, never a skip."""
    import moe_ep

    return moe_ep.EPBuffer(group, case.E, case.H, case.M, case.K, dispatch_dtype=DTYPES[case.dtype],
                           combine_dtype=torch.bfloat16, layout=case.layout, expert_alignment=case.align,
                           timeout_s=timeout_s, **({"num_programs": case.programs} if case.programs else {}),
                           **({"column_major_scales": True} if case.cm_scales else {}),
                           **({"max_recv_rows": case.recv_rows} if case.recv_rows is not None else {}),
                           **({"tuning": moe_ep.Tuning.from_env().replace(fused_internode=case.fused_internode,
                                                                          graph_launch=case.graph_launch)}
                              if case.fused_internode or case.graph_launch is not None else {}))


def _hooked(op, *args, **kwargs):
    """``op(*args, **kwargs, return_recv_hook=True)`` on copies of its tensors, which are then
    overwritten (as a caller reusing its inputs before the hook may), then its hook; returns the result."""
    def copy(v):
        return v.clone() if isinstance(v, torch.Tensor) else v
    args = [copy(a) for a in args]
    kwargs = {k: copy(v) for k, v in kwargs.items() if v is not None}
    got, hook = op(*args, **kwargs, return_recv_hook=True)
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            v.view(torch.uint8).fill_(0x3F)  # (every dtype: bf16 1.49, fp8 1.875, int32/int64 and float32 large)
    hook()
    return got


def run_calls(group, buf, case: Case) -> List[str]:
    """All calls of ``case`` on ``buf``, each checked against the oracle; returns failure strings."""
    from moe_ep.testing.reference import moe_local, reference_moe

    r, dev = group.rank, group.device
    dt = DTYPES[case.dtype]
    fn = expert_fn_for(case)
    fails: List[str] = []
    first = None
    rows = case.layout == "rows"
    for call in range(len(case.calls)):
        where = f"[{case.name} rank {r} call {call} {case.calls[call]}]"
        inp = make_inputs(case, call)[r]
        x = inp.x.to(dev)
        idx = inp.topk_idx.to(dev)
        w = inp.topk_weights.to(dev)
        sc = inp.x_scales.to(dev) if inp.x_scales is not None else None
        ref = reference_for(group, case, x, idx, w, sc)
        wd = w * 3 + 1 if case.late_weights else w  # late: combine must replace these
        if case.hooks:
            h = _hooked(buf.dispatch, x, idx, wd, x_scales=sc)
        else:
            h = buf.dispatch(x, idx, wd, x_scales=sc) if sc is not None else buf.dispatch(x, idx, wd)
        f = check_dispatch(h, ref, case, where)
        fails += f
        if rows:  # checked row for row in order against the oracle: determinism included
            fails += _rows_combine(group, buf, h, case, call, x, idx, w, sc, bad=bool(f), where=where)
            poison(h)
            continue
        if not f:
            snap = [received(h, case, e) for e in range(case.E // case.R)]
            snap_meta = ([int(c) for c in h.expert_counts.cpu()],
                         [int(v) for v in h.expert_offsets.cpu()] if h.expert_offsets is not None else None)
            if call == 0:
                first = (snap, snap_meta)
            elif case.calls[call] == "repeat" and first is not None:
                same = snap_meta == first[1] and all(
                    torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and
                    (a[1] is None or torch.equal(a[1], b[1])) for a, b in zip(snap, first[0]))
                if not same:
                    fails.append(f"{where}: not deterministic: the same inputs as call 0 gave rows in a "
                                 f"different order (or different counts/offsets)")
        # Combine runs even after a bad dispatch, so every rank makes the same calls.
        y = make_expert_y(h, case, fn, first_expert(ref, case)) if not f else \
            torch.full(h.expert_x.shape, float("nan"), dtype=torch.bfloat16, device=dev)
        if case.hooks:
            out = _hooked(buf.combine, y, h, topk_weights=w if case.late_weights else None)
        else:
            out = buf.combine(y, h, topk_weights=w) if case.late_weights else buf.combine(y, h)
        exp = reference_moe(group, case.E, x, idx, w, fn, x_scales=sc, dispatch_dtype=dt)
        if not f:
            exp_abs = moe_local(case.E, x, idx, w.abs(), lambda e, rows: fn(e, rows).abs(),
                                x_scales=sc, dispatch_dtype=dt)
            fails += check_combine(out, exp, exp_abs, x.shape[0], case, where)
        # Poison what the caller can see, so the next call must rewrite it.
        poison(h, out)
        h.expert_counts.fill_(-7)
    return fails


def _rows_combine(group, buf, h, case: Case, call: int, x, idx, w, sc, bad: bool, where: str) -> List[str]:
    """A rows-layout combine after a checked dispatch (every rank calls it, even after a bad
    dispatch); even calls also hand back combine weights and check their sums."""
    from moe_ep.testing.reference import moe_local, reference_moe, rows_combine_local

    dt, fn, r, EL = DTYPES[case.dtype], expert_fn_for(case), group.rank, case.E // case.R
    y, wy = rows_expert_y(h, case, fn, r) if not bad else (
        torch.zeros(h.expert_x.shape, dtype=torch.bfloat16, device=x.device),
        torch.zeros(h.recv_topk_weights.shape, device=x.device))
    fails: List[str] = []
    if call % 2 == 0:
        out, wout = _hooked(buf.combine, y, h, topk_weights=wy) if case.hooks else buf.combine(y, h, topk_weights=wy)
        exp_w = rows_combine_local(case.E, case.R, x, idx, w, lambda rr, v, i, ww: rows_wy(rr, i, ww), x_scales=sc,
                                   dispatch_dtype=dt)
        if not bad:
            fails += _check_weights(wout, exp_w, case, where)
    else:
        out = _hooked(buf.combine, y, h) if case.hooks else buf.combine(y, h)
    exp = reference_moe(group, case.E, x, idx, w, fn, x_scales=sc, dispatch_dtype=dt)
    if not bad:
        exp_abs = moe_local(case.E, x, idx, w.abs(), lambda e, rows: fn(e, rows).abs(), x_scales=sc, dispatch_dtype=dt)
        fails += check_combine(out, exp, exp_abs, x.shape[0], case, where)
    poison(h, out)
    return fails


def _check_weights(wout: torch.Tensor, exp: torch.Tensor, case: Case, where: str) -> List[str]:
    """Combined weights: exact for tagged data (dyadic sums), else within float32 rounding of a
    few additions (the order over ranks differs across nodes)."""
    T = exp.shape[0]
    if wout.dtype != torch.float32 or tuple(wout.shape) != (T, case.K):
        return [f"{where}: combined weights {wout.dtype} {list(wout.shape)}, expected float32 [{T}, {case.K}]"]
    got, exp = wout.cpu(), exp.cpu()
    bad = got != exp if case.data == "tagged" else ~((got - exp).abs() <= 1e-6 * exp.abs() + 1e-30)
    if not bool(bad.any()):
        return []
    t = int(bad.any(1).nonzero()[0])
    return [f"{where}: combined weights differ on tokens {bad.any(1).nonzero().flatten()[:12].tolist()}; token {t}: "
            f"got {got[t].tolist()} expected {exp[t].tolist()}"]


def run_case(group, case: Case, timeout_s: float = 60.0) -> List[str]:
    """A fresh buffer for ``case`` and all its calls; returns this rank's failure strings."""
    with make_buffer(group, case, timeout_s) as buf:
        return run_calls(group, buf, case)


def matrix_worker(rank: int, world_size: int, cases: List[Case], timeout_s: float = 60.0):
    """Runs ``cases`` in order on this rank; returns ``(failures, seconds per case)``."""
    import moe_ep

    group = moe_ep.EPGroup()
    assert group.world_size == world_size and group.rank == rank
    fails, times = [], {}
    for case in cases:
        t0 = time.monotonic()
        fails += run_case(group, case, timeout_s)
        times[case.name] = round(time.monotonic() - t0, 2)
    return fails, times
