"""Dispatch -> this rank's experts -> combine, for inference and (differentiably) for training.

Inference: ``dispatch(x, idx, w)``, the grouped expert MLP over the dispatched rows, then the
weighted ``combine``. Training (:class:`_EPExperts`) runs the same forward with a tag per token in
16 extra columns (its source rank and index) and keeps the experts' autograd graph; the backward
is a dispatch of the output gradient (with unit weights, carrying the tag and the token's expert
ids and weights as digits) followed by a combine of the input gradients (and, in extra columns,
the routing-weight gradients). The tags pair every backward row with its forward row, so the
backward never depends on two buffers ordering rows alike. Gradients: ``x`` (straight through
the fp8 quantization), ``topk_weights``, and the local experts' weights.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..ops.buffer import BufferSet, EPBuffer
from .experts import RowGroups, gated_mlp_rows, use_grouped_mm
from .rows import (SENTINEL, bits_float, decode_digits, delivered, encode_digits, float_bits, flat_rows,
                   num_digits, row_groups, to_layout)
from ..core.capture import capturing
from ..core.tuning import Tuning

FP8 = torch.float8_e4m3fn
TAG_COLS = 16          # forward side channel: [SENTINEL, tag digits (base 16)], one partial fp8 block
TAG_BASE, META_BASE = 16, 256


class ExpertParallelRunner:
    """The communication side of one ``MoELayer``: its ``EPBuffer``s (made on first use; making
    one is collective) and the dispatch -> experts -> combine sequence."""

    def __init__(self, group, num_experts: int, hidden: int, max_tokens: int, topk: int,
                 dispatch_dtype: torch.dtype, layout: str, expert_alignment: int, timeout_s: float, act,
                 grouped_mm: Optional[bool] = None, tuning: Optional[Tuning] = None):
        self.group, self.E, self.H, self.M, self.K = group, num_experts, hidden, max_tokens, topk
        self.R, self.rank = group.world_size, group.rank
        self.EL = num_experts // self.R
        self.dispatch_dtype, self.layout, self.alignment = dispatch_dtype, layout, expert_alignment
        self.timeout_s, self.act, self.grouped_mm, self.tuning = timeout_s, act, grouped_mm, tuning
        self.fp8 = dispatch_dtype == FP8
        # Training forward: x padded to whole 128-channel blocks for fp8, then the tag block.
        self.h_main = -(-hidden // 128) * 128 if self.fp8 else hidden
        self.tag_digits = num_digits(self.R * max_tokens, TAG_BASE)
        # Training backward (bf16): gradient, then [tag, K x (expert id + 1, weight bits)] digits;
        # the combine back reuses those columns for the routing-weight gradients (hi, lo per k).
        self.meta_tag = num_digits(self.R * max_tokens, META_BASE)
        self.meta_id = num_digits(num_experts + 1, META_BASE)
        meta = max(self.meta_tag + topk * (self.meta_id + 4), 2 * topk)
        self.h_bwd = hidden + -(-meta // 16) * 16
        self._buffers = BufferSet()

    # ------------------------------------------------------------------ buffers
    def buffer(self, kind: str) -> EPBuffer:
        return self._buffers.get(kind, lambda: self._make_buffer(kind))

    def _make_buffer(self, kind: str) -> EPBuffer:
        hidden, dtype = {"fwd": (self.H, self.dispatch_dtype),
                         "train": (self.h_main + TAG_COLS, self.dispatch_dtype),
                         "bwd": (self.h_bwd, torch.bfloat16)}[kind]
        return EPBuffer(self.group, self.E, hidden, self.M, self.K, dispatch_dtype=dtype, layout=self.layout,
                        expert_alignment=self.alignment, timeout_s=self.timeout_s, tuning=self.tuning)

    def close(self) -> None:
        self._buffers.close()

    # ------------------------------------------------------------------ helpers
    def _use_gmm(self, w: torch.Tensor) -> bool:
        if self.grouped_mm is not None:
            return self.grouped_mm
        probe = torch.empty(0, self.H, dtype=w.dtype, device=w.device)
        return use_grouped_mm(probe, w)

    def groups(self, d, w: torch.Tensor) -> RowGroups:
        """Row groups of a dispatch; packed rows are cut to the dispatched total unless a CUDA
        graph is being captured (reading the total is a device sync)."""
        dev = d.expert_counts.device
        gmm = self._use_gmm(w)
        host = dev.type == "cpu" or not gmm
        num_rows = None
        if self.layout == "packed" and not capturing(dev):
            # sized per call, the layout holds exactly offsets[-1] rows (no second host read)
            per_call = d.buffer.sizes.recv_rows_mode == "per_call"
            num_rows = d.expert_x.shape[0] if per_call else int(d.expert_offsets[-1])
        return row_groups(d, self.layout, num_rows=num_rows, host=host)

    def experts(self, x: torch.Tensor, g: RowGroups, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        return gated_mlp_rows(x, gate_up, down, g, self.act, grouped_mm=self._use_gmm(gate_up))

    # ------------------------------------------------------------------ inference
    def infer(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_idx: torch.Tensor,
              gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """x ``[T, H]`` bf16, routing ``[T, K]`` -> ``[T, H]`` bf16, with no autograd graph."""
        buf = self.buffer("fwd")
        d = buf.dispatch(x, topk_idx, topk_weights)
        g = self.groups(d, gate_up)
        rows = delivered(d, g.num_rows, slice(0, self.H), gate_up.dtype)
        y = self.experts(rows, g, gate_up, down).to(torch.bfloat16)
        return buf.combine(to_layout(y, d.expert_x), d)

    # ------------------------------------------------------------------ training
    def train(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_idx: torch.Tensor,
              gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """Same as :meth:`infer`, differentiable in x, topk_weights, gate_up and down."""
        return _EPExperts.apply(self, x, topk_weights, topk_idx, gate_up, down)

    def _tags(self, T: int, device) -> torch.Tensor:
        return self.rank * self.M + torch.arange(T, device=device, dtype=torch.int64)

    def train_forward(self, x, topk_weights, topk_idx, gate_up, down):
        T = x.shape[0]
        buf = self.buffer("train")
        cols = [x]
        if self.h_main > self.H:
            cols.append(x.new_zeros(T, self.h_main - self.H))
        tag = torch.zeros(T, TAG_COLS, dtype=torch.bfloat16, device=x.device)
        tag[:, 0] = SENTINEL
        tag[:, 1:1 + self.tag_digits] = encode_digits(self._tags(T, x.device).unsqueeze(1), self.tag_digits,
                                                      TAG_BASE, torch.bfloat16)
        cols.append(tag)
        d = buf.dispatch(torch.cat(cols, dim=1), topk_idx, topk_weights)
        g = self.groups(d, gate_up)
        rows = delivered(d, g.num_rows, slice(0, self.H), gate_up.dtype)
        tag_rows = delivered(d, g.num_rows, slice(self.h_main, self.h_main + TAG_COLS), torch.float32)
        key = self._row_keys(decode_digits(tag_rows[:, 1:1 + self.tag_digits], self.tag_digits, TAG_BASE)[:, 0], g)
        with torch.enable_grad():
            xr = rows.detach().requires_grad_(True)
            y = self.experts(xr, g, gate_up, down)
        yb = y.detach().to(torch.bfloat16)
        full = torch.zeros(g.num_rows, buf.hidden, dtype=torch.bfloat16, device=x.device)
        full[:, :self.H] = yb
        out = buf.combine(to_layout(full, d.expert_x), d)[:, :self.H]
        return out, (xr, y, key)

    def _row_keys(self, tags: torch.Tensor, g: RowGroups) -> torch.Tensor:
        """One key per dispatched row, unique within a dispatch: (local expert, source rank, token); -1 for padding."""
        return torch.where(g.valid, g.expert * (self.R * self.M) + tags, torch.full_like(tags, -1))

    def train_backward(self, grad_out, topk_weights, topk_idx, saved, gate_up, down):
        xr, y, key_f = saved
        T, dev = grad_out.shape[0], grad_out.device
        buf = self.buffer("bwd")
        ids = topk_idx.long() + 1
        tag = encode_digits(self._tags(T, dev).unsqueeze(1), self.meta_tag, META_BASE, torch.bfloat16)
        meta = torch.cat([tag, self._meta_pairs(ids, topk_weights)], dim=1)
        payload = torch.zeros(T, self.h_bwd, dtype=torch.bfloat16, device=dev)
        payload[:, :self.H] = grad_out
        payload[:, self.H:self.H + meta.shape[1]] = meta
        d = buf.dispatch(payload, topk_idx, torch.ones_like(topk_weights))
        g = self.groups(d, gate_up)
        n = g.num_rows
        grad_rows = delivered(d, n, slice(0, self.H), torch.float32)
        meta_rows = flat_rows(d.expert_x, n)[:, self.H:self.H + meta.shape[1]]
        tags = decode_digits(meta_rows[:, :self.meta_tag], self.meta_tag, META_BASE)[:, 0]
        pairs = meta_rows[:, self.meta_tag:self.meta_tag + self.K * (self.meta_id + 4)].reshape(n, self.K, self.meta_id + 4)
        ids_r = decode_digits(pairs[..., :self.meta_id].reshape(n, self.K * self.meta_id), self.meta_id, META_BASE)
        w_r = bits_float(decode_digits(pairs[..., self.meta_id:].reshape(n, self.K * 4), 4, META_BASE))
        expert_id = (self.rank * self.EL + g.expert + 1).unsqueeze(1)
        match = (ids_r == expert_id) & g.valid.unsqueeze(1)
        w_row = (w_r * match).sum(1)
        k_row = match.to(torch.int8).argmax(1)
        # Pair every backward row with its forward row.
        b2f = self._pairing(key_f, self._row_keys(tags, g))
        valid_b = g.valid
        gy_f = torch.zeros_like(y)
        gy_f[b2f[valid_b]] = (w_row.unsqueeze(1) * grad_rows)[valid_b].to(y.dtype)
        params = [p for p in (gate_up, down) if p.requires_grad]
        if y.requires_grad:
            grads = torch.autograd.grad(y, [xr] + params, gy_f, allow_unused=True)
        else:  # no rows reached this rank's experts
            grads = [None] * (1 + len(params))
        grads = [torch.zeros_like(t) if gr is None else gr for t, gr in zip([xr] + params, grads)]
        gx_f = grads[0]
        pg = dict(zip([id(p) for p in params], grads[1:]))
        g_gate_up, g_down = pg.get(id(gate_up)), pg.get(id(down))
        y_b = y.detach()[b2f].float()
        gw_row = torch.where(valid_b, (grad_rows * y_b).sum(1), torch.zeros((), device=dev))
        back = torch.zeros(n, self.h_bwd, dtype=torch.bfloat16, device=dev)
        back[:, :self.H] = torch.where(valid_b.unsqueeze(1), gx_f[b2f].to(torch.bfloat16),
                                       torch.zeros((), dtype=torch.bfloat16, device=dev))
        hi = gw_row.to(torch.bfloat16)
        lo = (gw_row - hi.float()).to(torch.bfloat16)
        rows_i = torch.arange(n, device=dev)
        back[rows_i, self.H + 2 * k_row] = torch.where(valid_b, hi, torch.zeros_like(hi))
        back[rows_i, self.H + 2 * k_row + 1] = torch.where(valid_b, lo, torch.zeros_like(lo))
        out = buf.combine(to_layout(back, d.expert_x), d)
        gx = out[:, :self.H]
        gw = out[:, self.H:self.H + 2 * self.K].float().view(T, self.K, 2).sum(-1)
        return gx, gw, g_gate_up, g_down

    def _meta_pairs(self, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Per token, K x (expert id + 1, weight bits) as base-256 digits: ``[T, K * (meta_id + 4)]``."""
        T = ids.shape[0]
        a = encode_digits(ids, self.meta_id, META_BASE, torch.bfloat16).view(T, self.K, self.meta_id)
        b = encode_digits(float_bits(w), 4, META_BASE, torch.bfloat16).view(T, self.K, 4)
        return torch.cat([a, b], dim=-1).view(T, self.K * (self.meta_id + 4))

    @staticmethod
    def _pairing(key_f: torch.Tensor, key_b: torch.Tensor) -> torch.Tensor:
        """For every backward row, the forward row with the same key (identity when both orders agree)."""
        if key_f.shape == key_b.shape and torch.equal(key_f, key_b):
            return torch.arange(key_b.shape[0], device=key_b.device)
        vf, vb = key_f >= 0, key_b >= 0
        kf, rf = key_f[vf], vf.nonzero().squeeze(1)
        kb, rb = key_b[vb], vb.nonzero().squeeze(1)
        sf, sb = torch.sort(kf), torch.sort(kb)
        if kf.shape != kb.shape or not torch.equal(sf.values, sb.values):
            raise RuntimeError("MoELayer backward: the rows dispatched in the backward are not those of the forward")
        b2f = torch.zeros(key_b.shape[0], dtype=torch.int64, device=key_b.device)
        b2f[rb[sb.indices]] = rf[sf.indices]
        return b2f


class _EPExperts(torch.autograd.Function):
    """dispatch -> experts -> combine with the backward described in the module docstring."""

    @staticmethod
    def forward(ctx, runner: ExpertParallelRunner, x, topk_weights, topk_idx, gate_up, down):
        out, saved = runner.train_forward(x, topk_weights, topk_idx, gate_up, down)
        ctx.runner, ctx.saved = runner, saved
        ctx.save_for_backward(topk_weights, topk_idx, gate_up, down)
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        topk_weights, topk_idx, gate_up, down = ctx.saved_tensors
        gx, gw, g_gate_up, g_down = ctx.runner.train_backward(grad_out.contiguous().to(torch.bfloat16),
                                                              topk_weights, topk_idx, ctx.saved, gate_up, down)
        ctx.saved = None
        return None, gx.to(ctx.x_dtype), gw, None, g_gate_up, g_down
