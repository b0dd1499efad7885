"""transformers' own expert parallelism with ``ep_implementation="moe_ep"`` (moe_ep.integrations.transformers).

Tiny random models of nine families (``moe_ep.integrations.hf_tiny.tiny_ep_model``: two MoE
layers, 8 experts, top-2 to top-6) are saved once by the test process; every rank loads them the way a
user does, ``from_pretrained(path, distributed_config=DistributedConfig(ep_size=R, fsdp_size=R,
ep_implementation=...))``, so transformers shards and loads the experts and FSDP-shards the rest.
Each rank runs its own tokens. Oracles, on every rank:
- the same checkpoint without any parallelism, ``experts_implementation="eager"``, one process:
  this rank's logits; the gradients of the mean over ranks of every rank's loss (what FSDP's
  averaged gradients are); the tokens of a greedy generate();
- transformers' ``ep_implementation="all_to_all"`` on the same ranks: logits and gradients.
moe_ep carries bf16 on the wire (the models are float32), hence the bf16 tolerances below.

CI runs every family at R=2 with gradients, generate on three families, R=4 on three families,
tensor parallelism (tp_size=2 with ep_size 2 and 4), gradient checkpointing, one MoE layer with a
rank that has no tokens, fp8 dispatch; the full matrix (R=4 and generate on every family) is
``slow`` (``-m slow``). A rank with no tokens is tested on one layer: the models themselves do not
run an empty batch. GPU tests (``-m gpu``): bf16 models at R=2 and 4, one layer in a CUDA graph.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

import dist_util

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'moe_ep[hf]')")
pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'moe_ep[hf]')")
try:  # an older transformers (a GPU machine's own, which cannot pip install): skip, do not fail
    from transformers.distributed import expert_parallel as _ep

    _ep.EPImplementationInterface  # noqa: B018
except (ImportError, AttributeError):
    pytest.skip("transformers < 5.23 (no EPImplementationInterface): pip install 'moe_ep[hf]'", allow_module_level=True)

from moe_ep.integrations.hf_tiny import EP_FAMILIES, VOCAB, tiny_ep_model  # noqa: E402

# Largest error relative to the oracle's largest entry, measured on 2 and 4 CPU ranks over the nine
# families (float32 models, bf16 on the wire): logits 2.9e-3, gradients 2.0e-2 (DeepSeek-V3's
# first router, whose experts are damped to 1%); all_to_all against the oracle 2e-6.
LOGITS_RTOL, GRAD_RTOL = 1e-2, 5e-2
# A gradient far smaller than the model's largest holds mostly the rounding of larger terms that nearly
# cancel (attention's key bias: a bias shared by a query's keys cancels in its softmax but for RoPE;
# 1e-5 against a largest entry of 0.17-0.19 in these models, float32), and that rounding scales with the
# model's gradients, not with its own: each gradient is judged against at least GRAD_FLOOR x the
# oracle's largest gradient entry. (bf16 on one GPU, R=4: a k_proj bias shard of largest entry 1.3e-6
# came with 9e-8 of error, both through moe_ep and through all_to_all.)
GRAD_FLOOR = 1e-4
FP8_LOGITS_RTOL = 1e-1  # e4m3 keeps 3 mantissa bits: up to 6% per dispatched element
CI_SUBSET = ("gpt_oss", "deepseek_v3", "qwen2_moe")  # biases + clamped SwiGLU, group routing, shared-expert gate


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> str:
    """Every family's tiny model saved as a checkpoint (float32, safetensors)."""
    root = tmp_path_factory.mktemp("tiny_ep")
    for fam in EP_FAMILIES:
        tiny_ep_model(fam).save_pretrained(root / fam)
    return str(root)


def _tokens(rank: int, length: int = 0) -> torch.Tensor:
    """Rank ``rank``'s batch: ``[2, 3 + rank]`` token ids (ranks differ in length and content)."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, VOCAB, (2, length or 3 + rank), generator=g)


def _close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float, floor: float = 1e-6) -> list:
    """``got`` within ``rtol`` of ``want``'s largest entry, or of ``floor`` where that is smaller."""
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    if got.shape != want.shape:
        return [f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"]
    if want.numel() == 0:
        return []
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    return [] if err <= rtol * max(scale, floor) else [f"{name}: max error {err:.3g} > {rtol} x {scale:.3g}"]


def _greedy_agrees(name: str, ref, new: torch.Tensor, ref_new: torch.Tensor, rtol: float) -> list:
    """Greedy tokens ``new`` against the oracle's ``ref_new`` (``[B, T]``, same prompt): equal, or,
    in bf16 (``rtol`` > 0), first differing where the oracle itself scores both tokens within ``rtol``
    of its largest logit (a near tie that bf16 rounding may break either way); after that token the
    sequences are not comparable. With ``rtol`` 0 only exact equality passes."""
    if new.shape != ref_new.shape:
        return [f"{name}: shape {tuple(new.shape)} != oracle {tuple(ref_new.shape)}"]
    for b in range(new.shape[0]):
        diff = (new[b] != ref_new[b]).nonzero()
        if diff.numel() == 0:
            continue
        p = int(diff[0])
        with torch.no_grad():
            logits = ref(ref_new[b:b + 1, :p]).logits[0, -1].float()
        gap = (logits[ref_new[b, p]] - logits[new[b, p]]).item()
        if gap > rtol * logits.abs().max().item():
            return [f"{name}: {new[:, -3:].tolist()} != oracle {ref_new[:, -3:].tolist()} (row {b}, position "
                    f"{p}: the oracle's logit gap {gap:.3g} is no near tie)"]
    return []


def _load(path: str, impl: str, R: int, dtype: torch.dtype = torch.float32, tp: int = 1, ep: int = 0):
    """The checkpoint on R ranks: ``tp_size=tp``, ``ep_size=ep`` (default R), ``fsdp_size=R // tp``."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, distributed_config=DistributedConfig(
        tp_size=tp, ep_size=ep or R, fsdp_size=R // tp, ep_implementation=impl))


def _gpu_rank(rank: int) -> torch.device:
    """Ranks sharing GPUs: transformers binds ``cuda:<LOCAL_RANK>``, so LOCAL_RANK names this rank's GPU."""
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    os.environ["LOCAL_RANK"] = str(dev.index)
    torch.cuda.set_device(dev)
    return dev


def _grads(model, gather: bool = True) -> dict:
    """Every parameter's gradient as ``(tensor, index)``: what this rank compares and where it sits in
    the whole gradient (``whole[index]``). ``gather``: DTensors gathered whole (collective), index
    ``...``; else each rank's own shard with its slices, no collective (ranks sharing a GPU over gloo:
    torch's gather of CUDA DTensors dies there of a segmentation fault, torch 2.11)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None or not hasattr(g, "full_tensor"):
            out[name] = None if g is None else (g, ...)
        elif gather:
            out[name] = (g.full_tensor(), ...)
        else:
            if any(pl.is_partial() for pl in g.placements):
                raise AssertionError(f"{name}: a partial gradient {g.placements} cannot be compared shard by shard")
            shape, offset = compute_local_shape_and_global_offset(g.shape, g.device_mesh, g.placements)
            out[name] = (g.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape)))
    return out


def ep_models_worker(rank: int, R: int, root: str, families, grads: bool = True, generate=(),
                     gpu: bool = False, tp: int = 1, ep: int = 0, checkpointing: bool = False,
                     gather_grads: bool = True) -> dict:
    """On every rank: each family through moe_ep, all_to_all and the one-process oracle (float32 on
    CPU; bfloat16 on a GPU with ``gpu``). With ``tp > 1`` the ranks of a TP group (consecutive
    ranks) share their batch; ``ep``: the EP size (default R); ``checkpointing``: the distributed
    models recompute each layer's forward (dispatch and combine too) inside the backward;
    ``gather_grads``: gradients compared whole (gathered), else shard by shard (``_grads``)."""
    import moe_ep.integrations.transformers as mt
    from transformers import AutoModelForCausalLM

    fails, secs = [], {}
    dev, dtype = (_gpu_rank(rank), torch.bfloat16) if gpu else (torch.device("cpu"), torch.float32)
    lt, gt = (GPU_RTOL, GPU_RTOL) if gpu else (LOGITS_RTOL, GRAD_RTOL)
    ids, batches = _tokens(rank // tp).to(dev), R // tp
    for fam in families:
        t0 = time.perf_counter()
        path = os.path.join(root, fam)
        ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager", dtype=dtype).to(dev)
        want = ref(ids).logits
        if grads:
            loss = sum(ref(_tokens(b).to(dev), labels=_tokens(b).to(dev)).loss for b in range(batches)) / batches
            loss.backward()
            want_grads = {n: p.grad for n, p in ref.named_parameters()}
            gfloor = GRAD_FLOOR * max(g.abs().max().item() for g in want_grads.values() if g is not None)
        got_grads = {}
        for impl in ("moe_ep", "all_to_all"):
            model = _load(path, impl, R, dtype, tp, ep)
            if checkpointing:
                model.gradient_checkpointing_enable()
                model.train()
            tag = f"R{R} tp{tp} rank {rank} {fam} {impl}"
            if grads:
                out = model(ids, labels=ids)
                fails += _close(f"{tag} logits", out.logits, want, lt)
                out.loss.backward()
                got_grads[impl] = _grads(model, gather_grads)
                for n, w in want_grads.items():
                    g = got_grads[impl][n]
                    if g is None:
                        fails.append(f"{tag}: no gradient for {n}")
                    elif w is not None:
                        fails += _close(f"{tag} grad {n}", g[0], w[g[1]], gt, gfloor)
            else:
                with torch.no_grad():
                    fails += _close(f"{tag} logits", model(ids).logits, want, lt)
            if fam in generate:
                new = model.generate(ids, max_new_tokens=3, do_sample=False)
                ref_new = ref.generate(ids, max_new_tokens=3, do_sample=False)
                fails += _greedy_agrees(f"{tag} generate", ref, new, ref_new, lt if gpu else 0.0)
            del model
        if grads:  # moe_ep against transformers' own all_to_all, gradient by gradient
            for n, g in got_grads["moe_ep"].items():
                w = got_grads["all_to_all"][n]
                if g is not None and w is not None:
                    fails += _close(f"R{R} rank {rank} {fam} moe_ep vs all_to_all grad {n}", g[0], w[0], gt, gfloor)
        mt.close_all()
        secs[fam] = round(time.perf_counter() - t0, 2)
    return {"fails": fails, "secs": secs}


def _run(R: int, *args, **kw) -> None:
    res = dist_util.run(R, ep_models_worker, *args, **kw)
    fails = [f for r in res for f in r["fails"]]
    assert not fails, "\n".join(fails[:40])


def test_families_two_ranks(checkpoints):
    """Every family at R=2: logits and every gradient against the oracle and all_to_all; generate
    on the CI subset."""
    _run(2, checkpoints, EP_FAMILIES, generate=CI_SUBSET)


def test_subset_four_ranks(checkpoints):
    """R=4 on the CI subset, gradients compared shard by shard (the path ranks sharing a GPU take)."""
    _run(4, checkpoints, CI_SUBSET, gather_grads=False)


@pytest.mark.slow
@pytest.mark.parametrize("R", [2, 4])
def test_families_full_matrix(checkpoints, R):
    """Every family at R=2 and 4 with gradients and generate (``-m slow``)."""
    _run(R, checkpoints, EP_FAMILIES, generate=EP_FAMILIES)


def _routing(T: int, E: int, K: int, seed: int):
    """``[T, K]`` distinct expert ids and ``[T, K]`` positive weights (float32), reproducible."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
    return idx.long(), torch.rand(T, K, generator=g) + 0.1


def ep_layer_worker(rank: int, R: int, root: str, family: str) -> dict:
    """One MoE layer's experts called directly (rank R-1 with no tokens; then a batch that makes the
    buffers grow; then no tokens anywhere), fp8 dispatch, the host agreements per model forward,
    and a sabotaged expert that the logits comparison must catch."""
    import moe_ep.integrations.transformers as mt
    from transformers import AutoModelForCausalLM

    fails = []
    path = os.path.join(root, family)
    ref = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
    model = _load(path, "moe_ep", R)
    ids = _tokens(rank)
    with torch.no_grad():
        want = ref(ids).logits
        fails += _close("logits", model(ids).logits, want, LOGITS_RTOL)
    ex = next(iter(mt._EXCHANGES.values()))
    before = ex.agreements
    with torch.no_grad():
        model(ids)
    layers = sum(1 for m in model.modules() if type(m).__name__.endswith("Experts"))
    if ex.agreements - before != layers:
        fails.append(f"host agreements per forward: {ex.agreements - before}, expected one per MoE layer ({layers})")

    experts, ref_experts = model.model.layers[1].mlp.experts, ref.model.layers[1].mlp.experts
    H, E, K = ref.config.hidden_size, ref_experts.num_experts, 2
    for step, T in enumerate([(5, 0), (40, 0), (0, 0)]):
        T = T[0] if rank < R - 1 else T[1]  # the last rank brings no tokens
        idx, w = _routing(T, E, K, seed=10 * step + rank)
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank + step))
        gy = torch.randn(T, H, generator=torch.Generator().manual_seed(50 + rank + step))
        xs, ws = [x.clone().requires_grad_(True) for _ in range(2)], [w.clone().requires_grad_(True) for _ in range(2)]
        out = experts(xs[0], idx, ws[0])
        ref_out = ref_experts(xs[1], idx, ws[1])
        (out * gy).sum().backward()
        if ref_out.requires_grad:  # the eager experts build no graph for an empty batch
            (ref_out * gy).sum().backward()
        for t in (xs[1], ws[1]):
            t.grad = torch.zeros_like(t) if t.grad is None else t.grad
        tag = f"R{R} rank {rank} layer call {step} (T={T})"
        fails += _close(f"{tag} out", out, ref_out, LOGITS_RTOL)
        fails += _close(f"{tag} grad x", xs[0].grad, xs[1].grad, GRAD_RTOL)
        fails += _close(f"{tag} grad weights", ws[0].grad, ws[1].grad, GRAD_RTOL)
    if ex.max_tokens != 64:
        fails.append(f"max_tokens after a 40-token batch: {ex.max_tokens}, expected 64 (agreed, a power of two)")

    with torch.no_grad():  # the comparison can fail: one rank's experts of the last layer off by 25%
        if rank == 0:
            experts.down_proj.to_local().mul_(1.25)
        hit = _close("sabotaged logits", model(ids).logits, want, LOGITS_RTOL)
        if rank == 0 and not hit:
            fails.append("logits stayed within tolerance with rank 0's last-layer experts scaled by 1.25")
    del model
    mt.close_all()

    model = _load(path, "moe_ep_fp8", R)
    out = model(ids, labels=ids)
    fails += _close(f"R{R} rank {rank} fp8 logits", out.logits, want, FP8_LOGITS_RTOL)
    out.loss.backward()
    bad = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad.to_local()).all()]
    if bad:
        fails.append(f"R{R} rank {rank} fp8: missing or non-finite gradients {bad[:4]}")
    mt.close_all()
    return {"fails": [f"R{R} rank {rank} {family} {f}" for f in fails]}


def test_one_layer_zero_tokens_growth_fp8(checkpoints):
    res = dist_util.run(2, ep_layer_worker, checkpoints, "qwen3_moe")
    fails = [f for r in res for f in r["fails"]]
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("R,tp,ep", [(2, 2, 2), (4, 2, 4)])
def test_tensor_parallel(checkpoints, R, tp, ep):
    """tp_size=2 (the two ranks of a TP group share a batch; each sends half of it): ep_size = tp_size
    without FSDP, and ep_size = 4 over two TP groups with FSDP; logits, gradients, generate."""
    fams = ("mixtral", "qwen3_moe") if R == 2 else ("deepseek_v3",)
    _run(R, checkpoints, fams, generate=fams[:1], tp=tp, ep=ep)


def test_gradient_checkpointing(checkpoints):
    """Each layer's dispatch and combine run again inside the backward, between other layers' backwards."""
    _run(2, checkpoints, ("mixtral",), checkpointing=True)


def test_register_options():
    """register() checks its options and puts the class into transformers' registry under its name."""
    from transformers.distributed.expert_parallel import EPImplementationInterface

    import moe_ep.integrations.transformers as mt

    assert {"moe_ep", "moe_ep_fp8"} <= set(EPImplementationInterface())
    cls = mt.register("moe_ep_fixed_test", dispatch_dtype="fp8", max_tokens=128)
    assert EPImplementationInterface()["moe_ep_fixed_test"] is cls
    with pytest.raises(ValueError, match="dispatch_dtype"):
        mt.register("x", dispatch_dtype="fp16")
    with pytest.raises(ValueError, match="max_tokens"):
        mt.register("x", max_tokens=0)


def _dense_experts(weights: torch.Tensor):
    """experts(rows, ids, w) = sum_k w[:, k] * rows @ weights[ids[:, k]].T, ids out of range skipped."""
    def experts(rows, ids, w):
        ok = (ids >= 0) & (ids < weights.shape[0])
        y = torch.einsum("nh,nkoh->nko", rows, weights[ids.clamp(0, weights.shape[0] - 1)])
        return (y * (w * ok).unsqueeze(-1)).sum(1)
    return experts


def test_rows_moe_one_rank_against_dense():
    """``rows_moe`` without a process group: output and gradients (tokens, routing weights, expert
    weights) equal the same experts on the tokens themselves; a fixed max_tokens refuses more."""
    import moe_ep
    from moe_ep.moe.rows_autograd import RowsExchange, rows_moe

    ex = RowsExchange(moe_ep.EPGroup(), max_tokens=8)
    E, K, H = 4, 2, 32
    g = torch.Generator().manual_seed(0)
    weights = (torch.randn(E, H, H, generator=g) / H ** 0.5).requires_grad_(True)
    idx, w = _routing(6, E, K, seed=1)
    idx[0, 1] = -1  # a selection of no expert
    x = torch.randn(6, H, generator=g).bfloat16().float()
    xs, ws = [x.clone().requires_grad_(True) for _ in range(2)], [w.clone().requires_grad_(True) for _ in range(2)]
    out = rows_moe(ex, _dense_experts(weights), xs[0], idx, ws[0], E, sentinel=E)
    want = _dense_experts(weights)(xs[1], idx, ws[1])
    gy = torch.randn(6, H, generator=g)
    gw_got = torch.autograd.grad((out * gy).sum(), [xs[0], ws[0], weights])
    gw_want = torch.autograd.grad((want * gy).sum(), [xs[1], ws[1], weights])
    fails = _close("out", out, want, 1e-2)
    for name, a, b in zip(("x", "weights", "experts"), gw_got, gw_want):
        fails += _close(f"grad {name}", a, b, 2e-2)
    assert not fails, "\n".join(fails)
    with pytest.raises(ValueError, match="max_tokens"):
        rows_moe(ex, _dense_experts(weights), torch.zeros(9, H), torch.zeros(9, K, dtype=torch.long),
                 torch.ones(9, K), E)
    ex.close()


def test_rows_exchange_tuning(monkeypatch):
    """``RowsExchange(tuning=...)`` (and ``register(tuning=...)``'s exchanges) make their buffers with
    that ``Tuning``; ``None``: the tuning variables when a buffer is made, as ``EPBuffer`` does."""
    import moe_ep
    import moe_ep.integrations.transformers as mt
    from moe_ep.moe.rows_autograd import RowsExchange

    tuned = moe_ep.Tuning(tile=1, num_warps=2)
    ex = mt._exchange(None, 8, 30.0, tuned)
    assert ex.tuning is tuned and ex is mt._exchange(None, 8, 30.0, tuned) is not mt._exchange(None, 8, 30.0)
    buf = ex.buffer(4, 2, 32, torch.bfloat16)
    assert buf.tuning.asked == tuned and buf.tuning.num_warps == 2
    mt.close_all()
    monkeypatch.setenv("MOE_EP_NUM_WARPS", "8")
    ex = RowsExchange(moe_ep.EPGroup(), max_tokens=8)
    assert ex.buffer(4, 2, 32, torch.bfloat16).tuning.num_warps == 8
    ex.close()
    with pytest.raises(TypeError, match="tuning: expected moe_ep.Tuning or None, got dict"):
        RowsExchange(moe_ep.EPGroup(), tuning={"tile": 1})
    with pytest.raises(TypeError, match="tuning: expected moe_ep.Tuning or None, got dict"):
        mt.register("moe_ep_tuned", tuning={"tile": 1})


# GPU: bf16 models (experts through grouped_mm), ranks sharing the GPUs there are; tolerances of bf16
# arithmetic in every path (not measured yet: no GPU run so far).
GPU_RTOL = 5e-2


def ep_graph_worker(rank: int, R: int, root: str, family: str) -> list:
    """One MoE layer (the last one's experts) captured in a CUDA graph with a fixed max_tokens, replayed
    with new tokens and routing: equals the eager call."""
    import moe_ep.integrations.transformers as mt

    dev = _gpu_rank(rank)
    mt.register("moe_ep_graph_test", max_tokens=8)
    model = _load(os.path.join(root, family), "moe_ep_graph_test", R, torch.bfloat16)
    experts = model.model.layers[-1].mlp.experts
    H, E = model.config.hidden_size, experts.num_experts * R
    with torch.no_grad():
        model(_tokens(rank, 4).to(dev))  # FSDP's lazy init, the buffers
        x = torch.zeros(4, H, device=dev, dtype=torch.bfloat16)
        idx = torch.zeros(4, 2, device=dev, dtype=torch.long)
        w = torch.zeros(4, 2, device=dev, dtype=torch.bfloat16)
        experts(x, idx, w)  # eager once with these shapes (moe_ep's launch validation)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = experts(x, idx, w)
        fails = []
        for step in range(2):
            i, ww = _routing(4, E, 2, seed=7 * step + rank)
            x.copy_(torch.randn(4, H, generator=torch.Generator().manual_seed(step + rank)))
            idx.copy_(i)
            w.copy_(ww)
            graph.replay()
            got = out.clone()
            fails += _close(f"R{R} rank {rank} graph replay {step}", got, experts(x, idx, w), 1e-3)
    mt.close_all()
    return fails


@pytest.mark.gpu
@pytest.mark.parametrize("R", [2, 4])
def test_families_gpu(checkpoints, R):
    """bf16 on GPU ranks: every family against the one-process model and all_to_all, generate on all.
    Ranks sharing a GPU (gloo on CUDA tensors) compare each rank's shard of every gradient, not
    gathered ones: the gather (``DTensor.full_tensor()``, torch's functional all_gather) dies there
    of a segmentation fault (torch 2.11, one H100)."""
    dist_util.need_gpu()
    backend = dist_util.gpu_backend(R)
    res = dist_util.run(R, ep_models_worker, checkpoints, EP_FAMILIES, generate=EP_FAMILIES, gpu=True,
                        backend=backend, gather_grads=backend != "gloo-cuda")
    fails = [f for r in res for f in r["fails"]]
    assert not fails, "\n".join(fails[:40])


@pytest.mark.gpu
@pytest.mark.parametrize("R", [2, 4])
def test_layer_cuda_graph_gpu(checkpoints, R):
    dist_util.need_gpu()
    fails = [f for r in dist_util.run(R, ep_graph_worker, checkpoints, "qwen3_moe", backend=dist_util.gpu_backend(R))
             for f in r]
    assert not fails, "\n".join(fails)
