"""An MoE decode layer calling DeepEP's low-latency pair the way vLLM's DeepEP low-latency path does
(hooks, `out=`, UE8M0 scales), run on moe_ep through an unedited `import deep_ep`.

    python examples/vllm_style_low_latency.py                       # 2 CPU ranks (gloo, Triton interpreter)
    python examples/vllm_style_low_latency.py --ranks 4
    torchrun --nproc-per-node=2 examples/vllm_style_low_latency.py  # GPUs (CPUs: TRITON_INTERPRET=1 torchrun ...)

The calls are those of vLLM's low-latency prepare/finalize
(vllm/model_executor/layers/fused_moe/deepep_ll_prepare_finalize.py, with its all-to-all manager):
- a ``deep_ep.Buffer`` sized by ``Buffer.get_low_latency_rdma_size_hint`` in low-latency mode with
  one QP per local expert;
- ``low_latency_dispatch(..., use_fp8=True, round_scale=True, use_ue8m0=True, async_finish=False,
  return_recv_hook=True)``: the call sends, the hook receives. Two micro-batches are in flight
  (vLLM's dual-batch overlap): both are dispatched before the first hook runs;
- the experts run on the packed ``[E_local, R*M, H]`` fp8 rows with their UE8M0 scales (four
  exponent bytes per int32, the layout DeepGEMM's masked grouped GEMM takes), only the first
  ``expert_num_tokens[e]`` rows of expert e being real;
- ``low_latency_combine(..., async_finish=False, zero_copy=False, return_recv_hook=True,
  out=output)`` into a preallocated output, weights applied by the combine.

The hidden size is a multiple of 512 (an int32 packs the scales of four 128-channel blocks).
Rank 0 checks every rank's output against the dense layer run on all ranks' tokens rounded to
fp8 as the dispatch rounds them (per 128 channels, scale ``2^ceil(log2(amax / 448))``).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import ep_harness  # first: makes `import deep_ep` load moe_ep; the ranks; the dense check

import torch  # noqa: E402

import deep_ep  # noqa: E402  (DeepEP's API; here moe_ep's)

HIDDEN, INTER = 512, 64  # hidden: a multiple of 512 (UE8M0 packs)
EXPERTS_PER_RANK, TOPK = 2, 2
MAX_TOKENS_PER_RANK = 8  # vLLM's max_tokens_per_rank (the decode batch bound)
STEPS, UBATCHES = 2, 2
TOL = 2e-2  # bf16 rounding of the expert output and of the combined sum


class LowLatencyPrepareFinalize:
    """vLLM's DeepEP low-latency prepare/finalize, reduced to its DeepEP calls: dispatch and
    combine each return a receive hook; one handle per micro-batch."""

    def __init__(self, buffer: "deep_ep.Buffer", max_tokens_per_rank: int, use_fp8_dispatch: bool = True,
                 use_ue8m0_dispatch: bool = True) -> None:
        self.buffer = buffer
        self.max_tokens_per_rank = max_tokens_per_rank
        self.use_fp8_dispatch = use_fp8_dispatch
        self.use_ue8m0_dispatch = use_ue8m0_dispatch  # set when the experts take packed UE8M0 scales
        self.handles: List[object] = [None, None]

    def prepare_async(self, a1: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                      ubatch: int) -> Tuple[Callable[[], None], Callable[[], Tuple[tuple, torch.Tensor]]]:
        """Sends ``a1`` to its experts; returns ``(hook, receiver)``: call the hook, then the
        receiver gives ``((fp8 rows, int32 UE8M0 scales), expert_num_tokens)``."""
        expert_x, expert_num_tokens, handle, _, hook = self.buffer.low_latency_dispatch(
            a1, topk_ids, self.max_tokens_per_rank, num_experts,
            use_fp8=self.use_fp8_dispatch,
            round_scale=self.use_ue8m0_dispatch,  # power-of-two scales, needed for UE8M0
            use_ue8m0=self.use_ue8m0_dispatch,
            async_finish=False,
            return_recv_hook=True)
        self.handles[ubatch] = handle
        return hook, lambda: (expert_x, expert_num_tokens)

    def finalize_async(self, output: torch.Tensor, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, ubatch: int) -> Callable[[], None]:
        """Sends the experts' rows back, weighted and summed into ``output`` once the returned hook
        has run."""
        handle = self.handles[ubatch]
        assert handle is not None
        _, _, recv_hook = self.buffer.low_latency_combine(
            fused_expert_output, topk_ids, topk_weights, handle,
            async_finish=False, zero_copy=False, return_recv_hook=True, out=output)
        return recv_hook


def ue8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., H/512]`` UE8M0 packs (block 4j+i's biased exponent in byte i) -> float32
    ``[..., H/128]`` scales ``2^(byte - 127)``."""
    exps = torch.stack([(scales >> (8 * i)) & 0xFF for i in range(4)], dim=-1).flatten(-2)
    return torch.ldexp(torch.ones(exps.shape, device=scales.device), exps - 127)


def batched_experts(expert_x: Tuple[torch.Tensor, torch.Tensor], expert_num_tokens: torch.Tensor,
                    w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """vLLM's batched ("masked") experts: fp8 ``[E_local, R*M, H]`` with UE8M0 scales -> bf16
    ``[E_local, R*M, H]``; rows past ``expert_num_tokens[e]`` are zeros (no host read of the counts)."""
    q, packed = expert_x
    EL, RM, H = q.shape
    x = (q.float().view(EL, RM, H // 128, 128) * ue8m0_to_float(packed).unsqueeze(-1)).view(EL, RM, H)
    live = torch.arange(RM, device=q.device)[None, :] < expert_num_tokens[:, None]
    x = torch.where(live.unsqueeze(-1), x, 0.0)  # rows past the count are not written by the dispatch
    out = torch.stack([ep_harness.expert_mlp(x[e], w1[e], w2[e]) for e in range(EL)])
    return torch.where(live.unsqueeze(-1), out, 0.0).to(torch.bfloat16)


def fp8_rounded(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the dispatch delivers it, float32: per 128 channels ``s = 2^ceil(log2(amax / 448))``
    (amax at least 1e-4), each value rounded to e4m3 at ``x / s``, times ``s``."""
    T, H = x.shape
    b = x.float().view(T, H // 128, 128)
    ratio = b.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448.0
    mant, exp = torch.frexp(ratio)  # ratio = mant * 2^exp, mant in [0.5, 1)
    scale = torch.ldexp(torch.ones_like(ratio), exp - (mant == 0.5).int())
    return ((b / scale).to(torch.float8_e4m3fn).float() * scale).view(T, H)


def main() -> bool:
    group, rank, R, dev, E, w1, w2, mine = ep_harness.world(EXPERTS_PER_RANK, HIDDEN, INTER)
    w1_local, w2_local = w1[mine].to(dev), w2[mine].to(dev)  # this rank's experts

    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(MAX_TOKENS_PER_RANK, HIDDEN, R, E)
    buffer = deep_ep.Buffer(group, num_nvl_bytes=0, num_rdma_bytes=num_rdma_bytes, low_latency_mode=True,
                            num_qps_per_rank=E // R, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False)
    pf = LowLatencyPrepareFinalize(buffer, MAX_TOKENS_PER_RANK)

    gen = torch.Generator().manual_seed(100 + rank)
    results: Dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        batches = []
        for u in range(UBATCHES):
            T = (3 + 5 * rank + 2 * step + u) % (MAX_TOKENS_PER_RANK + 1)  # ranks and micro-batches differ
            x = (torch.randn(T, HIDDEN, generator=gen) * 2.0 ** (torch.arange(HIDDEN) // 128 % 3)).to(torch.bfloat16)
            topk_ids, topk_weights = ep_harness.route(T, E, TOPK, gen)
            batches.append((x.to(dev), topk_ids.to(dev), topk_weights.to(dev)))
            results.update({f"x.{step}.{u}": x, f"ids.{step}.{u}": topk_ids, f"w.{step}.{u}": topk_weights})
        # Both micro-batches dispatched before either is received (dual-batch overlap).
        pending = [pf.prepare_async(x, ids, E, u) for u, (x, ids, _) in enumerate(batches)]
        outputs, combine_hooks = [], []
        for u, ((hook, receiver), (x, ids, w)) in enumerate(zip(pending, batches)):
            hook()  # the receive half of micro-batch u's dispatch
            expert_x, expert_num_tokens = receiver()
            y = batched_experts(expert_x, expert_num_tokens, w1_local, w2_local)
            output = torch.empty(x.shape, dtype=torch.bfloat16, device=dev)  # vLLM's preallocated output
            combine_hooks.append(pf.finalize_async(output, y, w, ids, u))
            outputs.append(output)
        for u, hook in enumerate(combine_hooks):
            hook()  # the receive half of micro-batch u's combine: output is ready
            results[f"out.{step}.{u}"] = outputs[u]

    def dense(everyone: List[Dict[str, torch.Tensor]]) -> List[Dict[str, torch.Tensor]]:
        expected: List[Dict[str, torch.Tensor]] = [{} for _ in everyone]
        for step in range(STEPS):
            for u in range(UBATCHES):
                key = f"{step}.{u}"
                xs = torch.cat([fp8_rounded(d[f"x.{key}"]) for d in everyone])
                out = ep_harness.dense_moe(xs, torch.cat([d[f"ids.{key}"] for d in everyone]),
                                           torch.cat([d[f"w.{key}"] for d in everyone]), w1, w2)
                for r, part in enumerate(out.split([d[f"x.{key}"].shape[0] for d in everyone])):
                    expected[r][f"out.{key}"] = part
        return expected

    return ep_harness.check_on_rank0("vLLM-style low-latency (fp8, UE8M0, hooks, out=)", results, dense, TOL)


if __name__ == "__main__":
    ep_harness.launch(main, __doc__)
