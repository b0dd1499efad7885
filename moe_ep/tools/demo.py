"""The main job: multi-rank dispatch -> experts -> combine on random routing, checked against the oracle.

    python -m moe_ep.demo                              # 4 CPU ranks (gloo, shared memory, Triton interpreter)
    torchrun --nproc-per-node=2 -m moe_ep.demo         # GPUs over NVLink (also works on CPUs with gloo)
    torchrun --nproc-per-node=4 -m moe_ep.demo         # on a 1-GPU machine: 4 ranks share it (CUDA IPC)
    MOE_EP_NODE_SIZE=2 python -m moe_ep.demo           # 4 CPU ranks as 2 nodes: the inter-node path too

Each rank routes its tokens to random experts (uniform, skewed, with -1 holes; T differs per
rank), dispatches, applies a per-expert function to the received rows, combines, and compares the
counts and the output with ``moe_ep.testing.reference``. Rank 0 prints one line per configuration.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def _expert(e: int, rows: torch.Tensor) -> torch.Tensor:
    """A stand-in expert: a different affine map per expert, rounded to bf16 like real outputs."""
    return (rows.float() * (1.0 + 0.25 * (e % 4)) - 0.5 * (e % 3)).to(torch.bfloat16).float()


def _routing(gen, T, E, K, kind):
    if kind == "skewed":  # every token picks expert 0 first
        idx = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K]
        idx[:, 0] = 0
        idx[:, 1:][idx[:, 1:] == 0] = E - 1
    else:
        idx = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K]
    if kind == "holes":
        idx[torch.rand(T, K, generator=gen) < 0.3] = -1
    return idx


def run(group, E: int, H: int, M: int, K: int, dtype: torch.dtype, layout: str, calls: int = 3) -> dict:
    import moe_ep
    from moe_ep.testing.reference import reference_dispatch, reference_moe

    dev, rank, R = group.device, group.rank, group.world_size
    EL = E // R
    worst, times = 0.0, []
    with moe_ep.EPBuffer(group, E, H, M, K, dispatch_dtype=dtype, layout=layout) as buf:
        memory = f"{buf.workspace.backend} ({buf.workspace.why})"
        for call in range(calls):
            gen = torch.Generator().manual_seed(1234 + 97 * call + rank)
            T = int(torch.randint(0 if call else M // 2, M + 1, (1,), generator=gen))
            x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(dev)
            idx = _routing(gen, T, E, K, ("uniform", "skewed", "holes")[call % 3]).contiguous().to(dev)
            w = torch.rand(T, K, generator=gen).to(dev)
            t0 = time.perf_counter()
            h = buf.dispatch(x, idx, w)
            vals = h.expert_x.float()
            if h.expert_scales is not None:
                vals = vals * h.expert_scales.repeat_interleave(128, dim=-1)[..., :H]
            y = torch.zeros(h.expert_x.shape, dtype=torch.bfloat16, device=dev)
            counts = h.expert_counts.tolist()
            for e in range(EL):
                if layout == "masked":
                    y[e, :counts[e]] = _expert(rank * EL + e, vals[e, :counts[e]]).to(torch.bfloat16)
                else:
                    o = int(h.expert_offsets[e])
                    y[o:o + counts[e]] = _expert(rank * EL + e, vals[o:o + counts[e]]).to(torch.bfloat16)
            out = buf.combine(y, h)
            buf.synchronize()
            times.append(time.perf_counter() - t0)
            ref = reference_dispatch(group, E, x, idx, w, dispatch_dtype=dtype)
            if list(ref.counts) != counts:
                raise AssertionError(f"rank {rank} call {call}: expert_counts {counts} != oracle {list(ref.counts)}")
            exp = reference_moe(group, E, x, idx, w, _expert, dispatch_dtype=dtype)
            scale = exp.abs().max().item() + 1e-6
            err = (out.float() - exp).abs().max().item() / scale if T else 0.0
            if not err <= 2e-2:
                raise AssertionError(f"rank {rank} call {call}: combine differs from the oracle (rel err {err:.2e})")
            worst = max(worst, err)
    return {"err": worst, "ms": 1e3 * min(times), "memory": memory}


def main(argv=None) -> None:
    import moe_ep

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=None, help="E (default: 8 per rank on CPU, 256 on GPU)")
    ap.add_argument("--hidden", type=int, default=None, help="H (default: 256 on CPU, 7168 on GPU)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per rank (default: 16 on CPU, 128 on GPU)")
    ap.add_argument("--topk", type=int, default=None, help="K (default: 4 on CPU, 8 on GPU)")
    args = ap.parse_args(argv)
    group = moe_ep.EPGroup()
    gpu = group.device.type == "cuda"
    R = group.world_size
    E = args.experts or (256 if gpu else 8 * R)
    H = args.hidden or (7168 if gpu else 256)
    M = args.max_tokens or (128 if gpu else 16)
    K = args.topk or (8 if gpu else 4)
    gpus = len({k for k in group.device_keys})
    if gpu and group.ranks_per_device > 1:
        where = (f"{gpus} GPU{'s' * (gpus > 1)} ({group.ranks_per_device} ranks per GPU, time-sliced: "
                 f"correctness, not NVLink timings)")
    elif gpu:
        where = f"{gpus} GPU{'s' * (gpus > 1)}"
    else:
        where = "CPU shared memory + Triton interpreter"
    if group.node_size < R:  # MOE_EP_NODE_SIZE: nodes of that many ranks, the proxy between them
        where += f", {group.num_nodes} nodes of {group.node_size} (proxy over TCP between nodes)"
    if group.rank == 0:
        print(f"moe_ep demo: {R} ranks on {where}; E={E} H={H} max_tokens={M} K={K}", flush=True)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for layout in ("masked", "packed"):
            r = run(group, E, H, M, K, dtype, layout)
            errs = group.all_gather_object(r)
            if group.rank == 0:
                if dtype == torch.bfloat16 and layout == "masked":
                    print(f"  node memory: {r['memory']}", flush=True)
                print(f"  {str(dtype)[6:]:14s} {layout:7s} dispatch+experts+combine matches the oracle on all "
                      f"{R} ranks (max rel err {max(e['err'] for e in errs):.1e}, "
                      f"best call {min(e['ms'] for e in errs):.1f} ms)", flush=True)
    if group.rank == 0:
        print("OK", flush=True)


def _finish(ok: bool) -> None:
    """The end of a rank: after a failure the group is torn down (no barrier: the peers may be
    stuck in another collective, and tearing down is what stops them); after a run that passed,
    ``exit_rank`` (a last barrier, then leave without the teardown that aborted gloo ranks)."""
    if not ok:
        dist.destroy_process_group()
        return
    from moe_ep.core.group import exit_rank

    exit_rank(0)


def _spawned(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    ok = False
    try:
        main([])
        ok = True
    finally:
        _finish(ok)


if __name__ == "__main__":
    if "WORLD_SIZE" in os.environ:  # under torchrun
        # On CPUs under torchrun, set TRITON_INTERPRET=1 in the environment (EPBuffer says so if not).
        # More ranks than GPUs: a gloo group, ranks share the GPUs (init_distributed says so).
        from moe_ep.core.group import init_distributed

        how = init_distributed()
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"moe_ep demo: {how}", flush=True)
        ok = False
        try:
            main()
            ok = True
        finally:
            _finish(ok)
    else:  # a laptop: 4 CPU ranks
        import socket

        import torch.multiprocessing as mp

        os.environ["TRITON_INTERPRET"] = "1"  # the ranks start fresh and read it before importing triton
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_spawned, args=(4, port), nprocs=4)
