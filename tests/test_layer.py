"""MoELayer against a dense single-process MoE with the same weights.

The reference (this file, written independently of the layer) routes with the published
formulas, runs every selected expert on the values dispatch delivers (bf16, or the fp8 round trip
of ``moe_ep.core.fp8``) in float32, sums with the routing weights and adds the shared experts. Every
rank builds the same dense weights from one seed, loads them into an EP layer (each rank keeps
its experts) and checks its own tokens: forward under no_grad, and forward + backward against
the reference's autograd (x, router, shared experts on every rank; routed experts summed over
ranks, each rank's slice). Ragged tokens per rank, including 0 and more than max_tokens (chunks).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import dist_util

FP8 = torch.float8_e4m3fn


@dataclass
class LayerCase:
    router: str = "softmax"
    shared: int = 0
    dtype: str = "bf16"
    layout: str = "packed"
    train: bool = True
    grouped_mm: object = None
    H: int = 128
    F: int = 64
    E: int = 8
    M: int = 8
    seed: int = 0

    @property
    def K(self) -> int:
        return 2 if self.router == "softmax" else 3

    @property
    def name(self) -> str:
        return f"{self.router}-shared{self.shared}-{self.dtype}-{self.layout}-train{int(self.train)}-gmm{self.grouped_mm}"

    def layer_kwargs(self):
        kw = dict(router=self.router, shared_experts=self.shared, dispatch_dtype=self.dtype, layout=self.layout,
                  max_tokens=self.M, grouped_mm=self.grouped_mm)
        if self.router == "sigmoid":
            kw.update(n_group=4, topk_group=2, routed_scaling_factor=2.5)
        return kw


def cases(R: int):
    """Every (router, shared, dtype), each either a no_grad forward or forward + backward, with the
    mode, layout and GEMM path rotating with R; R=4 runs the half of the matrix where
    dtype = router xor shared (both modes still meet every router, shared setting and dtype)."""
    out, i = [], 0
    for router in ("softmax", "sigmoid"):
        for shared in (0, 1):
            for dtype in ("bf16", "fp8"):
                if R < 4 or (dtype == "fp8") == ((router == "sigmoid") != bool(shared)):
                    out.append(LayerCase(router=router, shared=shared, dtype=dtype,
                                         layout=("packed", "masked")[((i >> 2) + (i >> 1) + R) % 2], train=(i + R // 2) % 2 == 0,
                                         grouped_mm=(None, True)[(i // 2) % 2], seed=100 * R + i))
                i += 1
    return out


# ---------------------------------------------------------------------------- the dense reference
def dense_weights(c: LayerCase):
    g = torch.Generator().manual_seed(c.seed)
    sd = {"gate.weight": torch.randn(c.E, c.H, generator=g) * c.H ** -0.5,
          "experts.gate_up_proj": torch.randn(c.E, 2 * c.F, c.H, generator=g) * c.H ** -0.5,
          "experts.down_proj": torch.randn(c.E, c.H, c.F, generator=g) * c.F ** -0.5}
    if c.router == "sigmoid":
        sd["gate.e_score_correction_bias"] = torch.randn(c.E, generator=g) * 0.1
    if c.shared:
        sF = c.shared * c.F
        sd["shared_experts.gate_proj.weight"] = torch.randn(sF, c.H, generator=g) * c.H ** -0.5
        sd["shared_experts.up_proj.weight"] = torch.randn(sF, c.H, generator=g) * c.H ** -0.5
        sd["shared_experts.down_proj.weight"] = torch.randn(c.H, sF, generator=g) * sF ** -0.5
    return sd


GROUPS = 4  # the grouped router's n_group; topk_group = 2 of them are kept


def group_choice(c: LayerCase, biased: torch.Tensor):
    """``(group_scores [T, 4], allowed [T, 4] bool)`` of DeepSeek-V3's grouped choice: a group's
    score is the sum of its top two biased scores, the best two groups are allowed."""
    group_scores = biased.view(biased.shape[0], GROUPS, c.E // GROUPS).topk(2, dim=-1).values.sum(-1)
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, group_scores.topk(2, dim=-1).indices, True)
    return group_scores, allowed


def ref_route(c: LayerCase, sd, x):
    """(weights [T, K] float32, ids [T, K]) by the Mixtral/Qwen3 and DeepSeek-V3 formulas."""
    logits = x.float() @ sd["gate.weight"].float().t()
    if c.router == "softmax":
        p = logits.softmax(-1)
        w, idx = p.topk(c.K, dim=-1)
        return w / w.sum(-1, keepdim=True), idx
    s = logits.sigmoid()
    biased = s.detach() + sd["gate.e_score_correction_bias"]
    _, allowed = group_choice(c, biased)
    per = biased.view(x.shape[0], GROUPS, c.E // GROUPS)
    idx = per.masked_fill(~allowed[..., None], -float("inf")).view(-1, c.E).topk(c.K, dim=-1).indices
    w = s.gather(1, idx)
    return 2.5 * w / (w.sum(-1, keepdim=True) + 1e-20), idx


def ref_delivered(c: LayerCase, x):
    """What the experts receive: bf16(x), or its fp8 round trip; gradients pass straight through."""
    from moe_ep.core.fp8 import dequantize_fp8, quantize_fp8

    xb = x.to(torch.bfloat16)
    v = xb.float() if c.dtype == "bf16" else dequantize_fp8(*quantize_fp8(xb))
    return x + (v - x).detach()


def ref_moe(c: LayerCase, sd, x):
    w, idx = ref_route(c, sd, x)
    xq = ref_delivered(c, x)
    out = x * 0.0  # keeps the graph when no token picks an expert
    for e in range(c.E):
        t, k = (idx == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        gate, up = (xq[t] @ sd["experts.gate_up_proj"][e].t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ sd["experts.down_proj"][e].t()
        out = out.index_add(0, t, w[t, k, None] * y)
    if c.shared:
        h = F.silu(x @ sd["shared_experts.gate_proj.weight"].t()) * (x @ sd["shared_experts.up_proj.weight"].t())
        out = out + h @ sd["shared_experts.down_proj.weight"].t()
    return out, idx


def as_held(sd):
    """The dense weights as a bf16 layer holds them, in float32 for the reference: every weight
    rounded to bf16, the router's score bias not (a float32 buffer whatever the layer's dtype; a
    rounded one moves it by up to 4e-4, more than the sigmoid tie margin, and flips choices)."""
    return {k: v.float() if k == "gate.e_score_correction_bias" else v.to(torch.bfloat16).float()
            for k, v in sd.items()}


def close(name, got, want, rtol=1e-2):
    """A failure string unless ``max|got - want| <= rtol * max|want|`` (bf16 rounding, float32 sums)."""
    got, want = got.float(), want.float()
    if got.shape != want.shape:
        return [f"{name}: shape {list(got.shape)} != {list(want.shape)}"]
    if not torch.isfinite(got).all():
        return [f"{name}: non-finite values"]
    err, scale = (got - want).abs().max().item() if got.numel() else 0.0, want.abs().max().item() if want.numel() else 0.0
    return [] if err <= rtol * max(scale, 1e-6) else [f"{name}: max error {err:.3g} > {rtol} x {scale:.3g}"]


# ---------------------------------------------------------------------------- rank side
def token_counts(c: LayerCase, R: int):
    """Per rank: more than max_tokens (two chunks), 0, a partial chunk, exactly max_tokens."""
    return [(c.M + 3, 0, 5, c.M)[(r + c.seed) % 4] for r in range(R)]


def check_case(rank: int, R: int, c: LayerCase, group=None):
    import moe_ep

    fails = []
    sd = dense_weights(c)
    layer = moe_ep.MoELayer.from_dense(sd, c.H, c.F, c.E, c.K, group=group, **c.layer_kwargs())
    EL = c.E // R
    assert layer.experts.gate_up_proj.shape[0] == EL
    T = token_counts(c, R)[rank]
    g = torch.Generator().manual_seed(c.seed * 31 + rank)
    x = torch.randn(T, c.H, generator=g)
    want, _ = ref_moe(c, sd, x)
    if not c.train:
        with torch.no_grad():
            out = layer(x.view(1, T, c.H)).view(T, c.H)
        fails += close("forward (no_grad)", out, want)
    # state_dict gives the dense weights back (collective), exactly.
    back = layer.state_dict()
    for k, v in sd.items():
        if k not in back or not torch.equal(back[k], v):
            fails.append(f"state_dict[{k}] differs from the dense weights loaded")
    if c.train:
        xg = x.clone().requires_grad_(True)
        gy = torch.randn(T, c.H, generator=g)
        out = layer(xg)
        fails += close("forward (training)", out, want)
        (out * gy).sum().backward()
        ref = ref_params(sd)
        xr = x.clone().requires_grad_(True)
        (ref_moe(c, ref, xr)[0] * gy).sum().backward()
        fails += close("grad x", xg.grad, xr.grad, 2e-2)
        fails += param_grad_fails(layer, ref, rank, R, 2e-2)
    layer.close()
    return [f"R{R} rank {rank} {c.name}: {f}" for f in fails]


def ref_params(sd):
    """The dense weights as leaves of the reference's autograd (the router's bias is not trained)."""
    return {k: v if k.endswith("bias") else v.clone().requires_grad_(True) for k, v in sd.items()}


def param_grad_fails(layer, ref, rank: int, R: int, rtol: float):
    """Each parameter's gradient against the reference's (after its backward): routed experts see
    every rank's tokens, so theirs is summed over ranks (a collective) and this rank's slice taken."""
    import torch.distributed as dist

    fails = []
    EL = layer.experts.gate_up_proj.shape[0]
    for name, p in layer.named_parameters():
        want = ref[name].grad if ref[name].grad is not None else torch.zeros_like(ref[name])
        if name.startswith("experts."):
            if R > 1:
                want = want.to(p.device)
                dist.all_reduce(want)
            want = want.cpu()[rank * EL:(rank + 1) * EL]
        if p.grad is None:
            fails.append(f"grad {name}: missing")
            continue
        fails += close(f"grad {name}", p.grad.cpu(), want, rtol)
    return fails


def layer_worker(rank: int, R: int, case_list):
    fails = []
    for c in case_list:
        fails += check_case(rank, R, c)
    return fails


# ---------------------------------------------------------------------------- tests
@pytest.mark.parametrize("R", [2, 4])
def test_layer_matches_dense(R):
    fails = [f for r in dist_util.run(R, layer_worker, cases(R)) for f in r]
    assert not fails, "\n".join(fails)


def test_layer_single_rank_without_process_group():
    """R=1 with torch.distributed not initialised: the same matrix in this process."""
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized())
    fails = [f for c in cases(1) for f in check_case(0, 1, c)]
    assert not fails, "\n".join(fails)


def test_cases_cover_the_matrix():
    combos = {(r, s, d) for r in ("softmax", "sigmoid") for s in (0, 1) for d in ("bf16", "fp8")}
    everything = [c for R in (1, 2, 4) for c in cases(R)]
    for train in (False, True):
        assert {(c.router, c.shared, c.dtype) for c in everything if c.train == train} == combos
    for R in (1, 2, 4):
        cs = cases(R)
        assert {(c.router, c.shared, c.dtype) for c in cs} == combos or R == 4
        for attr in ("router", "shared", "dtype", "layout", "train", "grouped_mm"):
            assert len({getattr(c, attr) for c in cs}) == 2, (R, attr)
        Ts = token_counts(cs[0], 4)
        assert 0 in Ts and max(Ts) > cs[0].M


def test_reference_catches_a_wrong_layer():
    """The comparison can fail: the layer with one expert's weights perturbed does not pass."""
    import moe_ep

    c = LayerCase(seed=7)
    sd = dense_weights(c)
    bad = dict(sd)
    bad["experts.down_proj"] = sd["experts.down_proj"].clone()
    bad["experts.down_proj"][3] *= 1.25
    layer = moe_ep.MoELayer.from_dense(bad, c.H, c.F, c.E, c.K, **c.layer_kwargs())
    x = torch.randn(c.M, c.H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = layer(x)
    want, idx = ref_moe(c, sd, x)
    assert (idx == 3).any()
    assert close("forward", got, want), "a layer with a perturbed expert passed the comparison"
    layer.close()


def test_bad_arguments():
    import moe_ep

    with pytest.raises(ValueError, match="hidden"):
        moe_ep.MoELayer(100, 64, 8, 2)
    with pytest.raises(ValueError, match="router"):
        moe_ep.MoELayer(128, 64, 8, 2, router="relu")
    with pytest.raises(ValueError, match="topk"):
        moe_ep.MoELayer(128, 64, 8, 9)
    with pytest.raises(ValueError, match="n_group"):
        moe_ep.MoELayer(128, 64, 8, 2, router="sigmoid", n_group=3)
    with pytest.raises(ValueError, match="n_group"):
        moe_ep.MoELayer(128, 64, 8, 2, n_group=2)
    with pytest.raises(ValueError, match="topk_group"):
        moe_ep.MoELayer(128, 64, 8, 2, router="sigmoid", n_group=4, topk_group=5)
    with pytest.raises(TypeError, match="dispatch_dtype"):
        moe_ep.MoELayer(128, 64, 8, 2, dispatch_dtype=torch.float16)
    with pytest.raises(ValueError, match="layout"):
        moe_ep.MoELayer(128, 64, 8, 2, layout="dense")
    with pytest.raises(ValueError, match="activation"):
        moe_ep.MoELayer(128, 64, 8, 2, activation="relu")
    with pytest.raises(ValueError, match="shared_experts"):
        moe_ep.MoELayer(128, 64, 8, 2, shared_experts=-1)
    with pytest.raises(TypeError, match="group"):
        moe_ep.MoELayer(128, 64, 8, 2, group="world")
    layer = moe_ep.MoELayer(128, 64, 8, 2)
    with pytest.raises(ValueError, match="x: expected a floating point tensor"):
        layer(torch.zeros(4, 64))
    with pytest.raises(TypeError, match="x"):
        layer([1.0])


# ---------------------------------------------------------------------------- GPUs
def _gpu_worker(rank: int, R: int, case_list):
    import moe_ep

    group = moe_ep.EPGroup()
    fails = []
    for c in case_list:
        fails += check_case_gpu(rank, R, c, group)
    return fails


def route_gaps(c: LayerCase, sd, x) -> torch.Tensor:
    """[T] float32: how far each token's top-k choice is from a tie: the gap between its last
    chosen expert and the best other one, and for the grouped choice also between the last chosen
    group and the best other group (group scores: each group's top two)."""
    logits = x.float() @ sd["gate.weight"].float().t()
    scores = logits.softmax(-1) if c.router == "softmax" else logits.sigmoid() + sd["gate.e_score_correction_bias"]
    if c.router == "sigmoid":  # the grouped choice (as ref_route)
        _, idx = ref_route(c, sd, x)
        group_scores, allowed = group_choice(c, scores)
        ranked = group_scores.sort(-1, descending=True).values
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter(1, idx, True)
        # The chosen experts compete only with the other experts of the chosen groups.
        others = ~chosen & allowed.repeat_interleave(c.E // GROUPS, dim=1)
        rest = scores.masked_fill(~others, -float("inf")).max(-1).values
        expert_gap = scores.masked_fill(~chosen, float("inf")).min(-1).values - rest
        return torch.minimum(expert_gap, ranked[:, 1] - ranked[:, 2])
    top = scores.topk(c.K + 1, dim=-1).values
    return top[:, c.K - 1] - top[:, c.K]


def decisive(c: LayerCase, sd, x, margin: float):
    """Tokens whose top-k choice is at least ``margin`` from a tie (``route_gaps``): bf16 router
    logits on a GPU cannot flip them."""
    return route_gaps(c, sd, x) >= margin


def test_reference_holds_the_layers_weights():
    """The GPU checks' reference weights (``as_held``) are bit for bit those a bf16 layer holds."""
    import moe_ep

    for router in ("softmax", "sigmoid"):
        c = LayerCase(router=router, shared=1, H=64, F=32, E=16, M=8, seed=3)
        sd = dense_weights(c)
        layer = moe_ep.MoELayer.from_dense(sd, c.H, c.F, c.E, c.K, dtype=torch.bfloat16, **c.layer_kwargs())
        held, want = layer.state_dict(), as_held(sd)
        for k, v in want.items():
            got = held[k].float()
            if k.startswith("experts."):  # this rank's experts: all of them with one rank
                got = got.view(v.shape)
            assert torch.equal(got, v), k
        layer.close()


def test_route_gaps_at_every_token_count():
    """The GPU test's routing-tie filter for a rank with no tokens (one rank of four has none)
    and with some: one gap per token, each >= 0 (the chosen experts score at least the rest)."""
    for router in ("softmax", "sigmoid"):
        c = LayerCase(router=router, H=64, F=32, E=16, M=8, seed=1)
        sd = dense_weights(c)
        assert route_gaps(c, sd, torch.zeros(0, c.H)).shape == (0,)
        gaps = route_gaps(c, sd, torch.randn(7, c.H, generator=torch.Generator().manual_seed(2)))
        assert gaps.shape == (7,) and bool((gaps >= 0).all()), gaps


def check_case_gpu(rank, R, c, group):
    """The CPU check with the layer on the GPU (bf16 weights, grouped_mm), the reference on the
    CPU with the same bf16-rounded weights; tokens near a routing tie are left out."""
    import moe_ep

    sd = dense_weights(c)
    layer = moe_ep.MoELayer.from_dense(sd, c.H, c.F, c.E, c.K, group=group, dtype=torch.bfloat16,
                                       **c.layer_kwargs())
    T = token_counts(c, R)[rank]
    x = torch.randn(T, c.H, generator=torch.Generator().manual_seed(c.seed * 31 + rank)).to(torch.bfloat16).float()
    bf = as_held(sd)
    keep = decisive(c, bf, x, 1e-2 if c.router == "softmax" else 1e-4)
    ref = ref_params(bf)
    xr = x.clone().requires_grad_(True)
    want, _ = ref_moe(c, ref, xr)
    with torch.no_grad():
        out = layer(x.to(group.device, torch.bfloat16)).cpu()
    fails = close("forward", out[keep], want.detach()[keep], 3e-2)
    if c.train:
        # Tokens near a routing tie get no output gradient, so no gradient depends on how they route.
        gy = torch.randn(T, c.H, generator=torch.Generator().manual_seed(c.seed)) * keep[:, None]
        xg = x.to(group.device, torch.bfloat16).requires_grad_(True)
        (layer(xg).float() * gy.to(group.device)).sum().backward()
        (want * gy).sum().backward()
        fails += close("grad x", xg.grad.cpu()[keep], xr.grad[keep], 5e-2)
        fails += param_grad_fails(layer, ref, rank, R, 5e-2)  # bf16 weights and gradients on the GPU
    layer.close()
    return [f"R{R} rank {rank} {c.name}: {f}" for f in fails]


def _gpu_cases():
    big = dict(H=512, F=256, E=16, M=64)
    return [LayerCase(router=r, shared=s, dtype=d, layout=lay, train=True, **big, seed=i)
            for i, (r, s, d, lay) in enumerate([("softmax", 0, "bf16", "packed"), ("softmax", 1, "fp8", "masked"),
                                                ("sigmoid", 1, "bf16", "masked"), ("sigmoid", 0, "fp8", "packed")])]


def run_on_gpus(R: int, fn, *args):
    """Runs ``fn`` on R GPU ranks (sharing the GPUs there are; skipped without one); fails on any
    failure string."""
    dist_util.need_gpu()
    fails = [f for r in dist_util.run(R, fn, *args, backend=dist_util.gpu_backend(R)) for f in r]
    assert not fails, "\n".join(fails)


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 2, 4])
def test_layer_gpu(R):
    run_on_gpus(R, _gpu_worker, _gpu_cases())


def _graph_worker(rank: int, R: int, layouts):
    """Inference captured into a CUDA graph equals eager, replayed with new tokens."""
    import moe_ep

    group = moe_ep.EPGroup()
    return [f for layout in layouts for f in _graph_check(group, layout)]


def _graph_check(group, layout: str):
    """Each replay equals eager exactly, and the dense reference (tokens away from routing ties)."""
    import moe_ep

    c = LayerCase(router="sigmoid", shared=1, dtype="fp8", layout=layout, H=512, F=256, E=16, M=64, seed=5)
    bf = as_held(dense_weights(c))
    layer = moe_ep.MoELayer.from_dense(dense_weights(c), c.H, c.F, c.E, c.K, group=group, dtype=torch.bfloat16,
                                       sync_chunks=False, **c.layer_kwargs())
    dev = group.device
    xs = [torch.randn(c.M, c.H, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    static = xs[0].clone()
    fails = []
    with torch.no_grad():
        eager = [layer(x).clone() for x in xs]
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(static)
        for i, x in enumerate(xs):
            static.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            if not torch.equal(out, eager[i]):
                fails.append(f"{layout}: replay {i} differs from eager by {(out - eager[i]).abs().max().item():.3g}")
            xf = x.float().cpu()
            keep = decisive(c, bf, xf, 1e-4)
            want = ref_moe(c, bf, xf)[0]
            bad = close("forward", out.cpu()[keep], want[keep], 3e-2)
            if bad:  # the worst kept token and how far its routing is from a tie
                t = int(keep.nonzero()[(out.cpu()[keep].float() - want[keep]).abs().amax(-1).argmax()])
                bad = [f"{bad[0]} (worst: token {t}, routing gap {route_gaps(c, bf, xf)[t].item():.3g})"]
            fails += [f"{layout}: replay {i}: {f}" for f in bad]
    layer.close()
    return fails


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 2])
def test_layer_cuda_graph_gpu(R):
    run_on_gpus(R, _graph_worker, ("packed", "masked"))
