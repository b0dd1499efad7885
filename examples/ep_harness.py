"""What the framework-style examples share: `import deep_ep` switched onto moe_ep, the rank
processes, the experts' weights and the dense layer their output is checked against.

Imported first by examples/vllm_style_low_latency.py, megatron_style_fused_a2a.py and
elastic_buffer.py, before their own `import deep_ep`:

- **The alias.** Where `import deep_ep` does not already load moe_ep (``python -m
  moe_ep.deep_ep.install`` was not run), the forwarding package that command writes is written
  into a temporary directory (``install(target)``, as ``--target DIR`` does) put first on
  ``sys.path`` and ``PYTHONPATH``, so this process and its rank processes import moe_ep under
  DeepEP's name. A real DeepEP installed here is refused, naming it.
- **The ranks.** ``launch(main)``: under torchrun, ``main`` runs on torchrun's processes (NCCL on
  GPUs; gloo and the Triton interpreter when ``TRITON_INTERPRET=1`` or no GPU); else on
  ``--ranks`` CPU processes of its own (gloo, ``TRITON_INTERPRET=1``). Exit status 1 when a
  rank's check failed or a rank raised.
- **The check.** ``check_on_rank0``: every rank's inputs and results go to rank 0, which runs all
  ranks' tokens through one dense layer with the same expert weights (a single process, plain
  torch) and compares; one result line, ending in ``OK`` or ``MISMATCH``.
"""
from __future__ import annotations

import argparse
import atexit
import datetime
import os
import shutil
import socket
import sys
import tempfile
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

# CPU ranks (our own, or torchrun's on a machine without a GPU) run the kernels in the Triton
# interpreter: set before moe_ep imports triton.
if "WORLD_SIZE" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
elif not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

Tensor = torch.Tensor


# ---------------------------------------------------------------------------- import deep_ep
def switch_on_deep_ep_alias() -> Optional[str]:
    """Makes ``import deep_ep`` load ``moe_ep.deep_ep``; returns the forwarding package's directory
    when this call wrote one (None: it was already active). ``RuntimeError`` when a real DeepEP is
    installed (moe_ep will not shadow it)."""
    from moe_ep.deep_ep_alias import status

    if status()["active"]:
        return None
    from moe_ep.deep_ep.install import install

    target = tempfile.mkdtemp(prefix="moe_ep_deep_ep_alias_")
    atexit.register(shutil.rmtree, target, True)
    pkg = install(target)
    sys.path.insert(0, target)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [target, os.environ.get("PYTHONPATH", "")]))
    return pkg


switch_on_deep_ep_alias()


# ---------------------------------------------------------------------------- the model
def device() -> torch.device:
    """This rank's device: its GPU under torchrun on GPUs, else the CPU."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def expert_weights(num_experts: int, hidden: int, inter: int, seed: int = 0) -> Tuple[Tensor, Tensor]:
    """The experts of the model, the same on every rank: SwiGLU MLPs, float32 on the CPU,
    ``w1 [E, H, 2*I]`` (gate | up) and ``w2 [E, I, H]``."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(num_experts, hidden, 2 * inter, generator=g) * hidden ** -0.5
    w2 = torch.randn(num_experts, inter, hidden, generator=g) * inter ** -0.5
    return w1, w2


class World(NamedTuple):
    """This rank's place in an example: the group, its rank, the ranks R, its device, the experts
    E, every expert's weights (`expert_weights`: float32 on the CPU) and its own experts' slice."""

    group: dist.ProcessGroup
    rank: int
    R: int
    dev: torch.device
    E: int
    w1: Tensor
    w2: Tensor
    mine: slice


def world(experts_per_rank: int, hidden: int, inter: int) -> World:
    """The ``World`` of this rank: the default group, ``experts_per_rank`` experts a rank."""
    rank, R = dist.get_rank(), dist.get_world_size()
    E = experts_per_rank * R
    w1, w2 = expert_weights(E, hidden, inter)
    return World(dist.group.WORLD, rank, R, device(), E, w1, w2,
                 slice(rank * experts_per_rank, (rank + 1) * experts_per_rank))


def expert_mlp(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    """One expert on rows ``x`` (float32 ``[n, H]``): ``silu(x @ gate) * (x @ up) @ w2``."""
    gate, up = (x @ w1).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ w2


def dense_moe(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    """The dense layer: every token through each expert it selected, weighted and summed, float32
    ``[T, H]`` (ids -1 select nothing). Differentiable in ``x``, ``topk_weights`` and the weights."""
    x = x.float()
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(w1.shape[0]):
        rows, k = (topk_idx == e).nonzero(as_tuple=True)
        if rows.numel():
            y = expert_mlp(x[rows], w1[e], w2[e]) * topk_weights[rows, k].unsqueeze(1)
            out = out.index_add(0, rows, y)
    return out


def dense_step(everyone: List[Dict[str, Tensor]], s: str, w1: Tensor, w2: Tensor, experts_per_rank: int,
               backward: bool) -> List[Dict[str, Tensor]]:
    """The dense layer's answer for one step (key suffix ``s``) of every rank: all ranks' tokens
    (``x``, ``ids``, ``w``) through ``dense_moe`` in one process; per rank its ``out`` and, with
    ``backward`` (loss = sum(out * probe)), the gradients of its x, its topk weights and its
    experts' w1 / w2."""
    sizes = [d["x" + s].shape[0] for d in everyone]
    xs = torch.cat([d["x" + s] for d in everyone]).float().requires_grad_()
    ws = torch.cat([d["w" + s] for d in everyone]).requires_grad_()
    W1, W2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    out = dense_moe(xs, torch.cat([d["ids" + s] for d in everyone]), ws, W1, W2)
    expected: List[Dict[str, Tensor]] = [{"out" + s: o} for o in out.detach().split(sizes)]
    if backward:
        (out * torch.cat([d["probe" + s] for d in everyone])).sum().backward()
        for r, (gx, gw) in enumerate(zip(xs.grad.split(sizes), ws.grad.split(sizes))):
            rs = slice(r * experts_per_rank, (r + 1) * experts_per_rank)
            expected[r].update({"x_grad" + s: gx, "topk_weights_grad" + s: gw,
                                "w1_grad" + s: W1.grad[rs], "w2_grad" + s: W2.grad[rs]})
    return expected



def dense_steps(steps: Dict[str, bool], w1: Tensor, w2: Tensor, experts_per_rank: int
                ) -> Callable[[List[Dict[str, Tensor]]], List[Dict[str, Tensor]]]:
    """The check's ``dense`` for several steps: ``steps`` maps each step's key suffix to whether it
    had a backward; the returned function gives every rank's expected dict over all steps."""
    def dense(everyone: List[Dict[str, Tensor]]) -> List[Dict[str, Tensor]]:
        expected: List[Dict[str, Tensor]] = [{} for _ in everyone]
        for s, backward in steps.items():
            for r, e in enumerate(dense_step(everyone, s, w1, w2, experts_per_rank, backward)):
                expected[r].update(e)
        return expected
    return dense

def route(num_tokens: int, num_experts: int, num_topk: int, gen: torch.Generator) -> Tuple[Tensor, Tensor]:
    """A router's output: ``(topk_idx int64 [T, K], topk_weights float32 [T, K])``, K distinct
    experts per token, softmax weights."""
    scores = torch.randn(num_tokens, num_experts, generator=gen)
    weights, idx = torch.topk(scores.softmax(dim=-1), num_topk, dim=-1)
    return idx.to(torch.int64), weights.float()


# ---------------------------------------------------------------------------- the check
def rel_err(got: Tensor, want: Tensor) -> float:
    """Largest absolute difference relative to the largest expected magnitude."""
    if want.numel() == 0:
        return 0.0
    return float((got.float().cpu() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


def check_on_rank0(what: str, mine: Dict[str, Tensor],
                   dense: Callable[[List[Dict[str, Tensor]]], List[Dict[str, Tensor]]], tol: float,
                   group: Optional[dist.ProcessGroup] = None) -> bool:
    """Gathers every rank's ``mine`` (CPU copies) to rank 0, where ``dense(all ranks' dicts)``
    gives each rank's expected tensors (for the keys it returns); each is compared by ``rel_err``.
    Rank 0 prints one line; every rank returns True when all errors are within ``tol``."""
    group = group or dist.group.WORLD
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    everyone: List[Optional[Dict[str, Tensor]]] = [None] * R
    dist.all_gather_object(everyone, {k: v.detach().cpu() for k, v in mine.items()}, group=group)
    verdict: List[object] = [None]
    if rank == 0:
        expected = dense(everyone)  # type: ignore[arg-type]
        errs = {(r, k): rel_err(everyone[r][k], want) for r in range(R) for k, want in expected[r].items()}
        worst_key = max(errs, key=errs.get)
        worst = errs[worst_key]
        import deep_ep

        where = f"{R} ranks on {device().type}, deep_ep is {deep_ep.__name__}"
        names = sorted({k.split(".")[0] for _, k in errs})  # "out.1.0" -> "out"
        if worst <= tol:
            line = (f"{what}, {where}: {', '.join(names)} {'match' if len(names) > 1 else 'matches'} the dense layer "
                    f"(max rel err {worst:.1e} <= {tol:.0e}). OK")
        else:
            line = (f"{what}, {where}: {worst_key[1]} of rank {worst_key[0]} differs from the dense layer "
                    f"(rel err {worst:.2e} > {tol:.0e}). MISMATCH")
        print(line, flush=True)
        verdict[0] = worst <= tol
    dist.broadcast_object_list(verdict, src=0, group=group)
    return bool(verdict[0])


# ---------------------------------------------------------------------------- the ranks
def _spawned(rank: int, world_size: int, port: int, main: Callable[[], bool]) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    try:
        ok = main()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Every rank has the same verdict: a last barrier, then leave without the teardown that
    # aborts a spawned gloo rank now and then (moe_ep.core.group.exit_rank).
    from moe_ep.core.group import exit_rank

    exit_rank(0 if ok else 1)


def launch(main: Callable[[], bool], doc: str) -> None:
    """Runs ``main`` (True: its check passed) on every rank, under torchrun or on ``--ranks`` CPU
    processes of its own; exits with status 1 when a rank's check failed or a rank raised."""
    if "WORLD_SIZE" in os.environ:  # under torchrun
        # NCCL with a GPU per local rank; gloo with ranks sharing a GPU (more local ranks than
        # GPUs), or CPU ranks: moe_ep's launcher helper picks, as the package's own jobs do.
        from moe_ep.core.group import init_distributed

        init_distributed("auto" if device().type == "cuda" else "cpu")
        try:
            ok = main()
        finally:
            dist.destroy_process_group()
        sys.exit(0 if ok else 1)
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="CPU rank processes to start (default 2)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(_spawned, args=(args.ranks, port, main), nprocs=args.ranks)
    except mp.ProcessExitedException as e:  # a rank's check failed (its line says which)
        print(f"rank {e.error_index} exited with status {e.exit_code}", file=sys.stderr)
        sys.exit(1)
    except mp.ProcessRaisedException as e:
        print(f"a rank raised:\n{e}", file=sys.stderr)
        sys.exit(1)
