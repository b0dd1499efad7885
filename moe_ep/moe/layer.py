"""MoELayer: a drop-in expert-parallel Mixture-of-Experts block (router -> dispatch -> experts -> combine)."""
from __future__ import annotations

from typing import Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from .runner import ExpertParallelRunner
from .experts import LocalExperts, SharedExperts, check_activation
from ..core.capture import capturing
from ..core.group import EPGroup
from .router import Router
from ..core.tuning import Tuning

FP8 = torch.float8_e4m3fn
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp8": FP8, "float8_e4m3fn": FP8}


def _positive_int(name: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name}: expected a positive int, got {v!r}")
    return v


def _as_group(group) -> EPGroup:
    if group is None:
        return EPGroup()
    if isinstance(group, EPGroup):
        return group
    if isinstance(group, dist.ProcessGroup):
        return EPGroup(group)
    raise TypeError(f"group: expected None, a moe_ep.EPGroup or a torch.distributed.ProcessGroup, "
                    f"got {type(group).__name__}")


def _as_dispatch_dtype(v) -> torch.dtype:
    v = _DTYPES.get(v, v) if isinstance(v, str) else v
    if v not in (torch.bfloat16, FP8):
        raise TypeError(f"dispatch_dtype: expected torch.bfloat16 or torch.float8_e4m3fn ('bf16' / 'fp8'), got {v!r}")
    return v


class MoELayer(nn.Module):
    """An MoE block whose routed experts are spread over the ranks of ``group`` (expert parallelism).

    ``forward(x)``: the router picks ``topk`` of ``num_experts`` experts per token, moe_ep's
    dispatch sends each token to the ranks that hold them, each rank runs its experts as one
    grouped GEMM over the dispatched rows, combine brings back the weighted sum, and the shared
    experts (if any) are added. Every rank calls forward (and backward) the same number of times.

    Args:
        hidden: H (a multiple of 16). ffn_hidden: F, the intermediate size of one routed expert.
        num_experts: E, a multiple of R; rank r holds experts ``[r*E/R, (r+1)*E/R)``. topk: K.
        group: ``None`` (torch.distributed's WORLD when initialised, else a single rank), an
            ``EPGroup`` or a ``ProcessGroup``.
        router: ``"softmax"`` (Mixtral, Qwen3-MoE) or ``"sigmoid"`` (DeepSeek-V3: correction bias,
            grouped top-k with ``n_group`` / ``topk_group``); see :class:`moe_ep.moe.router.Router`.
        norm_topk_prob: renormalise the top-k weights. routed_scaling_factor: scales them.
        activation: ``"silu"`` (SwiGLU) or ``"gelu"``; experts are gated MLPs.
        shared_experts: how many shared experts (0: none); they form one dense MLP of
            ``shared_ffn_hidden`` (default ``shared_experts * ffn_hidden``) that every token goes through.
        dispatch_dtype: ``torch.bfloat16`` or ``torch.float8_e4m3fn`` (rows quantized in the
            dispatch kernel, per 128 channels); combine is bf16.
        layout: ``"packed"`` (experts' rows contiguous: the grouped GEMM computes only dispatched
            rows) or ``"masked"`` (the GEMM runs over every expert's full capacity on GPU).
        max_tokens: tokens per dispatch; a forward with more tokens runs in chunks. With R > 1
            and ``sync_chunks`` the ranks agree on the number of chunks (an all-reduce per forward);
            with ``sync_chunks=False`` every forward must have at most ``max_tokens`` tokens.
        expert_alignment: packed only: each expert's rows start at a multiple of this.
        grouped_mm: True / False forces ``torch.nn.functional.grouped_mm`` / the per-expert loop;
            None: grouped_mm on CUDA with bf16 weights, the loop elsewhere.
        device, dtype: of the parameters (default ``group.device`` and torch's default dtype).
        tuning: the ``moe_ep.Tuning`` of the layer's buffers (default: ``Tuning.from_env()``, as
            ``EPBuffer`` takes it).

    Weights use the names and dense layout of HF transformers: ``gate.weight [E, H]``
    (``gate.e_score_correction_bias [E]`` for sigmoid), ``experts.gate_up_proj [E, 2F, H]``,
    ``experts.down_proj [E, H, F]``, ``shared_experts.{gate,up,down}_proj.weight``. A rank stores
    only its experts; ``load_state_dict`` of the dense layout keeps its slice, and ``state_dict``
    gathers the dense tensors back (collective when R > 1).
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, topk: int,
                 group: Union[None, EPGroup, dist.ProcessGroup] = None, router: str = "softmax",
                 n_group: Optional[int] = None, topk_group: Optional[int] = None, norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0, activation: str = "silu", shared_experts: int = 0,
                 shared_ffn_hidden: Optional[int] = None, dispatch_dtype=torch.bfloat16, layout: str = "packed",
                 max_tokens: int = 1024, expert_alignment: int = 1, timeout_s: float = 30.0,
                 sync_chunks: bool = True, grouped_mm: Optional[bool] = None, device=None,
                 dtype: Optional[torch.dtype] = None, tuning: Optional[Tuning] = None):
        super().__init__()
        for name, v in (("hidden", hidden), ("ffn_hidden", ffn_hidden), ("num_experts", num_experts),
                        ("topk", topk), ("max_tokens", max_tokens), ("expert_alignment", expert_alignment)):
            _positive_int(name, v)
        if hidden % 16 != 0:
            raise ValueError(f"hidden: expected a multiple of 16, got {hidden}")
        if not isinstance(shared_experts, int) or isinstance(shared_experts, bool) or shared_experts < 0:
            raise ValueError(f"shared_experts: expected an int >= 0, got {shared_experts!r}")
        if layout not in ("masked", "packed"):
            # (EPBuffer's "rows" layout hands the expert step whole tokens, not rows grouped per
            # expert; this layer's grouped GEMMs need the latter.)
            raise ValueError(f"layout: expected 'masked' or 'packed' (MoELayer does not take the rows layout), "
                             f"got {layout!r}")
        if grouped_mm not in (None, True, False):
            raise TypeError(f"grouped_mm: expected None, True or False, got {grouped_mm!r}")
        if tuning is not None and not isinstance(tuning, Tuning):  # (the buffers come at first use)
            raise TypeError(f"tuning: expected moe_ep.Tuning or None, got {type(tuning).__name__}")
        act = check_activation(activation)
        self.group = _as_group(group)
        R = self.group.world_size
        if num_experts % R != 0:
            raise ValueError(f"num_experts: expected a multiple of the group's world_size={R}, got {num_experts}")
        device = self.group.device if device is None else torch.device(device)
        self.hidden, self.ffn_hidden, self.num_experts, self.topk = hidden, ffn_hidden, num_experts, topk
        self.max_tokens, self.sync_chunks = max_tokens, bool(sync_chunks)
        self.dispatch_dtype = _as_dispatch_dtype(dispatch_dtype)
        self.layout = layout
        self.gate = Router(hidden, num_experts, topk, router, n_group, topk_group, norm_topk_prob,
                           routed_scaling_factor, device=device, dtype=dtype)
        self.experts = LocalExperts(self.group, num_experts, hidden, ffn_hidden, device=device, dtype=dtype)
        if shared_experts:
            shared_ffn = shared_experts * ffn_hidden if shared_ffn_hidden is None else shared_ffn_hidden
            self.shared_experts = SharedExperts(hidden, _positive_int("shared_ffn_hidden", shared_ffn), act,
                                                device=device, dtype=dtype)
        else:
            self.shared_experts = None
        self.runner = ExpertParallelRunner(self.group, num_experts, hidden, max_tokens, topk, self.dispatch_dtype,
                                           layout, expert_alignment, timeout_s, act, grouped_mm, tuning)

    @classmethod
    def from_dense(cls, state_dict: Mapping[str, torch.Tensor], *args, **kwargs) -> "MoELayer":
        """A layer built with ``(*args, **kwargs)`` whose weights come from the dense (unsharded)
        ``state_dict`` of the same layout; each rank keeps its own experts."""
        layer = cls(*args, **kwargs)
        layer.load_state_dict(state_dict)
        return layer

    @property
    def num_local_experts(self) -> int:
        return self.experts.num_local_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., H]`` floating point on the layer's device -> the same shape and dtype."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point() or x.shape[-1:] != (self.hidden,):
            raise ValueError(f"x: expected a floating point tensor [..., {self.hidden}], got {x.dtype} {list(x.shape)}")
        if x.device != self.gate.weight.device:
            raise ValueError(f"x: expected a tensor on {self.gate.weight.device}, got {x.device}")
        xt = x.reshape(-1, self.hidden)
        _, topk_weights, topk_idx = self.gate(xt)
        out = self._routed(xt, topk_weights.float(), topk_idx)
        if self.shared_experts is not None:
            out = out + self.shared_experts(xt)
        return out.view(x.shape)

    def _num_chunks(self, T: int) -> int:
        n = max(1, -(-T // self.max_tokens))
        if self.group.world_size == 1:
            return n
        in_capture = capturing(self.group.device)
        if self.sync_chunks and not in_capture:
            t = torch.tensor([n], dtype=torch.int64, device=self.group.collective_device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group.pg)
            return int(t.item())
        if n > 1:
            raise ValueError(f"x: {T} tokens exceed max_tokens={self.max_tokens}, and the ranks cannot agree on "
                             f"chunks ({'graph capture' if in_capture else 'sync_chunks=False'})")
        return 1

    def _routed(self, xt: torch.Tensor, topk_weights: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        T, M = xt.shape[0], self.max_tokens
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        needs_grad = torch.is_grad_enabled() and (xt.requires_grad or topk_weights.requires_grad
                                                  or gate_up.requires_grad or down.requires_grad)
        run = self.runner.train if needs_grad else self.runner.infer
        xb = xt.to(torch.bfloat16)
        outs = []
        for i in range(self._num_chunks(T)):
            s = slice(min(i * M, T), min((i + 1) * M, T))
            outs.append(run(xb[s].contiguous(), topk_weights[s].contiguous(), topk_idx[s].contiguous(), gate_up, down))
        return (torch.cat(outs) if len(outs) > 1 else outs[0]).to(xt.dtype)

    def close(self) -> None:
        """Releases the communication buffers (made again on the next forward)."""
        self.runner.close()

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, num_experts={self.num_experts}, "
                f"topk={self.topk}, router={self.gate.kind!r}, ranks={self.group.world_size}, "
                f"dispatch_dtype={self.dispatch_dtype}, layout={self.layout!r}, max_tokens={self.max_tokens}")
