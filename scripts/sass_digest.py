"""The sm_90 machine code (SASS) of the main launches, one digest each, on a machine with no GPU.

Records the launches of a dispatch and a combine (without running them) at four configurations,
on one rank and across 2 nodes of one rank (lines "2x1-...": the inter-node kernels), compiles
each for sm_90 in a process without TRITON_INTERPRET and prints a digest of its SASS:
run it on two trees (before and after a change) to show which kernels the change leaves as they
were, instruction for instruction, or with a tuning variable set to see what it does to a
kernel's registers (``MOE_EP_COMBINE_WARPS=32 python scripts/sass_digest.py``, read as every buffer
reads them, by ``moe_ep.Tuning.from_env``; the configs' warps stand for a GPU buffer's defaults,
``MOE_EP_NUM_WARPS`` replaces them).

    python scripts/sass_digest.py   # a line per launch: config, kernel, digest, SASS lines, registers, stack
    SASS_LOOPS=1 python scripts/sass_digest.py   # and under each, its loops that store: how many of a
                                                 # step's loads go out before its first float op
    SASS_NODE=2 python scripts/sass_digest.py    # each combine also as a node of 2 ranks compiles it
                                                 # (line "...-N2": its send half, R >= 2)
    SASS_DIR=/tmp/a python scripts/sass_digest.py  # and each launch's SASS into that folder

Why the loop lines: the prefill loops' times followed how many of a step's loads are issued before
the math starts (ptxas may sink loads to save registers), not their shape (docs/performance-log/gpu.md,
"Thirteenth pass"). Why SASS_NODE: the launches are recorded on one CPU rank, whose combine has
no send half; the N2 line compiles the same launch with the node size set to 2 (its workspace
offsets stay the one-rank buffer's: right for registers, spills and loop schedules, which is
what it is for, not a kernel to run), as a register budget may spill there only.
"""
import hashlib
import importlib
import os
import pickle
import re
import socket
import subprocess
import sys
import tempfile

# (tokens, hidden, dispatch dtype, layout, programs, warps): prefill fp8 and bf16 packed, rows fp8
# at 32 programs, decode masked fp8; warps and the combine's shape as a GPU buffer takes them.
CONFIGS = [(4096, 7168, "fp8", "packed", 32, 16), (4096, 7168, "bf16", "packed", 132, 16),
           (4096, 7168, "fp8", "rows", 32, 32), (128, 7168, "fp8", "masked", 132, 16)]
# The same across 2 nodes of one rank (the inter-node kernels: two launches a dispatch, two a
# combine), prefill at 512 tokens (CPU ranks hold the proxy's regions in host memory).
INTERNODE_CONFIGS = [(512, 7168, "fp8", "packed", 32, 16), (512, 7168, "bf16", "packed", 132, 16),
                     (512, 7168, "fp8", "rows", 32, 32), (128, 7168, "fp8", "masked", 132, 16)]


def record_calls(group, configs, rec: list, prefix: str = "", weights: bool = False,
                 fused_internode: bool = False) -> None:
    """Appends to ``rec`` the launches (name, module, kernel, launch spec) of one dispatch and one
    combine per config of ``configs`` on ``group``'s rank, without running them; ``weights``: the
    rows layout's combine takes combine weights; ``fused_internode``: across nodes, each op's two
    halves in one launch (``Tuning.fused_internode``). Runs under the interpreter."""
    import torch

    import moe_ep
    import moe_ep.core.workspace
    from moe_ep.core.tuning import combine_shape
    from moe_ep.testing.aot import signature

    moe_ep.core.workspace.interpreting = lambda: False  # the chunking a GPU gets
    asked = moe_ep.Tuning.from_env()  # the tuning variables set, if any (each buffer takes them too)
    for T, H, dt, layout, P, warps in configs:
        name = f"{prefix}{layout}-{dt}-T{T}-p{P}"

        def spy(key, fn, grid, args, consts, dynamic=None, name=name):
            consts = consts() if callable(consts) else consts
            rec.append((name, fn.fn.__module__, fn.fn.__name__, signature(fn.arg_names, args, consts)))

        dtype = torch.float8_e4m3fn if dt == "fp8" else torch.bfloat16
        # (fused across nodes: packed and rows received tensors at their worst case, so the dispatch
        # fuses too; sized per call, its two halves have the count between them)
        worst = dict(max_recv_rows="worst") if fused_internode and layout != "masked" else {}
        buf = moe_ep.EPBuffer(group, 256, H, T, 8, dispatch_dtype=dtype, layout=layout, num_programs=P, **worst)
        # (a CPU buffer's default is 4 warps)
        gpu = dict(num_warps=asked.num_warps or warps, fused=True, fused_internode=fused_internode)
        shape = combine_shape(layout, P, T * 8, gpu=True)  # (a CPU buffer's combine takes the dispatch's)
        if asked.combine_warps is None:
            gpu["combine_warps"] = shape.warps
        if asked.maxnreg is None:
            gpu["combine_maxnreg"] = shape.maxnreg
        if asked.combine_tokens is None and shape.tokens:
            gpu["combine_recv_tokens"] = min(buf.sizes.block_t, shape.tokens)
        buf.parts.tuning, buf.parts.interp, buf.calls.launch = buf.tuning.replace(**gpu), False, spy
        h = buf.dispatch(torch.zeros(T, H, dtype=torch.bfloat16), torch.zeros(T, 8, dtype=torch.int64),
                         torch.zeros(T, 8))
        wts = torch.zeros(h.expert_x.shape[0], 8) if weights and layout == "rows" else None
        buf.combine(torch.empty(h.expert_x.shape, dtype=torch.bfloat16), h, topk_weights=wts)
        buf.close()


def record(path: str) -> None:
    """The launches of CONFIGS on one rank into ``path``, then those of INTERNODE_CONFIGS on rank 0
    of 2 nodes of 1 rank (``record_across_nodes``); runs under the interpreter."""
    import torch.multiprocessing as mp

    import moe_ep

    rec = []
    record_calls(moe_ep.EPGroup(), CONFIGS, rec)
    pickle.dump(rec, open(path, "wb"))
    with socket.socket() as s:  # a free port for the two ranks' gloo group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(record_across_nodes, args=(2, port, path + ".2x1"), nprocs=2, join=True)
    pickle.dump(rec + pickle.load(open(path + ".2x1", "rb")), open(path, "wb"))


def record_across_nodes(rank: int, world: int, port: int, path: str) -> None:
    """Rank ``rank`` of ``world`` nodes of one rank each (CPU ranks over gloo, their proxies over
    TCP) records INTERNODE_CONFIGS' launches (rows with combine weights), as two launches an op
    and as one (lines "2x1-fused-..."); rank 0 writes them to ``path``."""
    import torch
    import torch.distributed as dist

    import moe_ep

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    rec = []
    group = moe_ep.EPGroup(node_size=1)
    record_calls(group, INTERNODE_CONFIGS, rec, prefix=f"{world}x1-", weights=True)
    record_calls(group, INTERNODE_CONFIGS, rec, prefix=f"{world}x1-fused-", weights=True, fused_internode=True)
    if rank == 0:
        pickle.dump(rec, open(path, "wb"))
    dist.barrier()
    dist.destroy_process_group()


def digest(path: str) -> None:
    """Compiles every recorded launch for sm_90 and prints its SASS digest; runs without the interpreter."""
    import triton

    from moe_ep.testing.aot import compile_for

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    launches = []
    for name, mod, kernel, spec in pickle.load(open(path, "rb")):
        launches.append((name, mod, kernel, spec))
        node = int(os.environ.get("SASS_NODE") or 1)
        if kernel == "node_combine_kernel" and node > 1:  # (its sizes in DIM: moe_ep.kernels.args)
            dim = spec["consts"]["DIM"]._replace(**{f: triton.language.constexpr(v) for f, v in
                                                    (("N", node), ("RANK", 0), ("NODE0", 0))})
            launches.append((f"{name}-N{node}", mod, kernel, {**spec, "consts": {**spec["consts"], "DIM": dim}}))
    for name, mod, kernel, spec in launches:
        k = compile_for(getattr(importlib.import_module(mod), kernel), spec)
        cubin = path + ".cubin"
        open(cubin, "wb").write(k.asm["cubin"])
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
        code = [line.strip() for line in sass.splitlines() if line.strip().startswith("/*")]
        use = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
        regs, stack = (re.search(rf"{what}:(\d+)", use).group(1) for what in ("REG", "STACK"))
        half = _half(spec["consts"])
        if os.environ.get("SASS_DIR"):  # each launch's SASS, to diff two trees' launches line by line
            open(os.path.join(os.environ["SASS_DIR"], f"{name}-{kernel}{half}.sass"), "w").write(sass)
        print(f"{name:<34} {kernel + half:<36} {hashlib.sha1(chr(10).join(code).encode()).hexdigest()[:12]} "
              f"{len(code):>6} lines, {regs:>3} registers, {stack:>4} bytes of stack")
        if os.environ.get("SASS_LOOPS"):
            for line in loop_schedules(sass):
                print(f"    {line}")


def _half(consts: dict) -> str:
    """``[send]``, ``[recv]`` or ``[both]`` for a launch of a kernel with SEND/RECV halves, else ""."""
    if "SEND" not in consts:
        return ""
    return {(True, False): "[send]", (False, True): "[recv]", (True, True): "[both]"}.get(
        (bool(consts["SEND"]), bool(consts["RECV"])), "[none]")


FLOAT_OPS = ("FFMA", "FADD", "FMUL", "FMNMX", "F2FP", "HFMA2", "HADD2", "HMUL2")


def loop_schedules(sass: str) -> list:
    """One line per innermost loop of ``sass`` that stores to global memory (a backward branch with
    no such loop inside it; waiting loops do not count): its instructions, its global loads, and
    how many of them come before its first float op."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    at = {a: i for i, (a, _) in enumerate(ins)}
    loops = []  # (first, last) instruction indices
    for last, (a, text) in enumerate(ins):
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) <= a and int(target.group(1), 16) in at:
            loops.append((at[int(target.group(1), 16)], last))
    op = [t.split()[1] if t.startswith("@") else t.split()[0] for _, t in ins]
    loops = [(f, l) for f, l in loops if any(o.startswith("STG") for o in op[f:l + 1])]
    out = []
    for first, last in loops:
        if any(first <= f and l < last for f, l in loops if (f, l) != (first, last)):
            continue  # an outer loop: its inner loops are reported
        body = [t for _, t in ins[first:last + 1]]
        ops = op[first:last + 1]
        loads = [j for j, op in enumerate(ops) if op.startswith("LDG")]
        fp = next((j for j, op in enumerate(ops) if op.split(".")[0] in FLOAT_OPS), len(ops))
        out.append(f"loop {ins[first][0]:#x}-{ins[last][0]:#x}: {len(body)} instructions, {len(loads)} global "
                   f"loads, {sum(j < fp for j in loads)} before the first float op, "
                   f"{sum(op.startswith('STG') for op in ops)} global stores")
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3:
        (record if sys.argv[1] == "record" else digest)(sys.argv[2])
        sys.exit(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "launches.pkl")
        env = dict(os.environ, TRITON_INTERPRET="1")
        subprocess.run([sys.executable, __file__, "record", path], env=env, check=True)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = os.path.join(tmp, "cache")
        subprocess.run([sys.executable, __file__, "digest", path], env=env, check=True)
