"""The bench CLI end to end on 2 CPU ranks (torchrun, gloo, Triton interpreter) with tiny shapes.

One sweep (2 token counts, every backend, zipf routing with -1 holes) serves most assertions: the
run exits 0, its JSON validates against moe_ep/bench/schema.json, moe_ep and nccl ran (pre-check, timing,
stats) while symm_mem, deepep and CUDA graphs say why they are not available, the table and the
progress bar are printed, and the plot is a PNG. Times on CPU are meaningless and not checked.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys

import pytest

from moe_ep.bench import cli, report
from moe_ep.bench.schema import validate_document

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = ["--device", "cpu", "--tokens", "4,8", "--hidden", "128", "--num-experts", "4", "--topk", "2",
        "--iters", "2", "--warmup", "1", "--routing", "zipf", "--zipf-s", "1.2", "--holes", "0.1"]


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    json_path, png_path = out / "r.json", out / "r.png"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "moe_ep.bench",
           *TINY, "--output", str(json_path), "--plot", str(png_path)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return p, json_path, png_path


def test_sweep_exits_0_and_json_validates(sweep):
    p, json_path, _ = sweep
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    doc = json.loads(json_path.read_text())
    assert validate_document(doc) == []
    assert doc["config"]["tokens"] == [4, 8] and doc["config"]["routing"] == dict(kind="zipf", zipf_s=1.2, holes=0.1)
    assert doc["env"]["world_size"] == 2 and doc["env"]["torch"]


def test_sweep_runs_moe_ep_and_nccl_and_says_why_others_cannot(sweep):
    p, json_path, _ = sweep
    doc = json.loads(json_path.read_text())
    by = {(e["backend"], e["variant"], e["launch"], e["num_tokens"]): e for e in doc["results"]}
    for t in (4, 8):
        for key in (("moe_ep", None, "eager", t), ("nccl", None, "eager", t)):
            e = by[key]
            assert e["status"] == "ok", e
            assert e["check_rel_err"] <= 3e-2
            for op in ("dispatch", "combine", "pair"):
                s = e["ops"][op]
                assert 0 < s["p50_us"] <= s["p90_us"] <= s["p99_us"]
                assert s["gbps_all"] >= s["gbps_xgpu"] > 0
        assert by[("moe_ep", None, "eager", t)]["sms"] == 2  # CPU default: 2 programs
        graph = by[("moe_ep", None, "graph", t)]
        assert graph["status"] == "not available" and "GPU" in graph["reason"]
        for key in (("symm_mem", None, "eager", t), ("deepep", "normal", "eager", t),
                    ("deepep", "low_latency", "eager", t)):
            assert by[key]["status"] == "not available" and by[key]["reason"], by[key]
    assert "not available: needs CUDA GPUs" in p.stdout
    assert "dispatch+combine" in p.stdout and "pre-check" in p.stdout
    assert "10/10" in p.stderr  # the progress bar: 5 backend variants x 2 token counts


def test_sweep_plot_is_a_png(sweep):
    if not _has_matplotlib():
        pytest.skip("matplotlib is not installed (the CLI then prints how to plot later)")
    _, _, png_path = sweep
    data = png_path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000


def test_plot_table_merge_subcommands_on_result_files(sweep, tmp_path, capsys):
    _, json_path, _ = sweep
    doc = json.loads(json_path.read_text())
    other = copy.deepcopy(doc)  # the same results as if measured at EP size 4: the EP-size panel
    for e in other["results"]:
        e["world_size"] = 4
    other_path = tmp_path / "r4.json"
    other_path.write_text(json.dumps(other))
    merged = tmp_path / "merged.json"
    assert cli.main(["merge", str(json_path), str(other_path), "--output", str(merged)]) == 0
    merged_doc = json.loads(merged.read_text())
    assert validate_document(merged_doc) == [] and len(merged_doc["merged"]) == 2
    assert cli.main(["table", str(merged)]) == 0
    assert "R=4 T=8" in capsys.readouterr().out
    if _has_matplotlib():
        png = tmp_path / "sweep.png"
        assert cli.main(["plot", str(json_path), str(other_path), "-o", str(png)]) == 0
        assert png.read_bytes().startswith(PNG_SIGNATURE)


def test_plot_without_matplotlib_says_so(sweep, tmp_path, monkeypatch, capsys):
    _, json_path, _ = sweep
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    png = tmp_path / "none.png"
    assert cli.main(["plot", str(json_path), "-o", str(png)]) == 3
    assert "matplotlib is not installed" in capsys.readouterr().err and not png.exists()


def test_wrong_flag_gives_a_clear_error():
    p = subprocess.run([sys.executable, "-m", "moe_ep.bench", "--tokkens", "4"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "unrecognized arguments: --tokkens" in p.stderr


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "4,x"], "--tokens: expected a comma-separated list of non-negative integers"),
    (["--backends", "moe_ep,foo"], "--backends: expected a comma-separated list of moe_ep, nccl, symm_mem, deepep"),
    (["--holes", "1.5"], "--holes: expected a probability in [0, 1), got 1.5"),
    (["--topk", "9", "--num-experts", "8"], "--topk: expected at most --num-experts (8)"),
    (["--preset", "train"], "argument --preset: invalid choice: 'train'"),
])
def test_bad_values_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_run_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_presets_and_models_resolve():
    a = cli.parse_run_args(["--preset", "prefill"])
    assert (a.tokens, a.hidden, a.topk, a.num_experts, a.dispatch_dtype, a.layout, a.model) == \
        ([4096], 7168, 8, 256, "fp8", "packed", "deepseek-v3")
    a = cli.parse_run_args(["--model", "qwen3-30b", "--tokens", "1,16,128", "--dispatch-dtype", "bf16"])
    assert (a.tokens, a.hidden, a.topk, a.num_experts, a.dispatch_dtype, a.model) == \
        ([1, 16, 128], 2048, 8, 128, "bf16", "qwen3-30b")
    a = cli.parse_run_args(["--model", "mixtral-8x7b", "--topk", "1"])
    assert (a.hidden, a.topk, a.num_experts, a.layout, a.model) == (4096, 1, 8, "masked", None)


def test_schema_validator_names_the_problem(sweep):
    _, json_path, _ = sweep
    doc = json.loads(json_path.read_text())
    doc["results"][0]["status"] = "great"
    del doc["env"]["commit"]
    problems = validate_document(doc)
    assert any("$.results[0].status: expected one of" in p for p in problems)
    assert any("$.env: missing required key 'commit'" in p for p in problems)
    with pytest.raises(ValueError, match="not a moe-ep-bench result"):
        bad = json_path.with_name("bad.json")
        bad.write_text(json.dumps(doc))
        report.load([str(bad)])


def test_console_script_entry():
    import importlib

    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        target = tomllib.load(f)["project"]["scripts"]["moe-ep-bench"]
    module, func = target.split(":")
    assert callable(getattr(importlib.import_module(module), func))
    exe = shutil.which("moe-ep-bench")
    if exe is not None:  # installed (pip install -e .): the script itself
        p = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0 and "--backends" in p.stdout


def test_node_size_below_ep_size_is_reported_not_fatal(tmp_path):
    """--node-size 1 on 2 ranks asks for moe_ep's inter-node path: on CPU ranks it runs (proxy + TCP)."""
    out = tmp_path / "ns.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "moe_ep.bench",
           "--device", "cpu", "--tokens", "4", "--hidden", "128", "--num-experts", "4", "--topk", "2",
           "--iters", "1", "--warmup", "0", "--backends", "moe_ep", "--node-size", "1", "--no-progress",
           "--output", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (entry, *_) = json.loads(out.read_text())["results"]
    assert entry["status"] == "ok", entry


def test_routing_is_seeded_skewed_and_has_holes():
    from moe_ep.bench.workloads import Routing, Workload, make_routing

    def wl(kind: str, holes: float, seed: int = 0) -> Workload:
        return Workload(num_tokens=512, hidden=16, topk=4, num_experts=16, dispatch_dtype="bf16",
                        combine_dtype="bf16", layout="masked", expert_alignment=1,
                        routing=Routing(kind=kind, zipf_s=1.5, holes=holes), seed=seed)

    x0, idx0, w0 = make_routing(wl("zipf", 0.25), rank=1)
    x1, idx1, _ = make_routing(wl("zipf", 0.25), rank=1)
    assert x0.equal(x1) and idx0.equal(idx1)                      # same seed and rank: same inputs
    assert not make_routing(wl("zipf", 0.25), rank=0)[1].equal(idx0)
    assert abs(float((idx0 == -1).float().mean()) - 0.25) < 0.05
    valid = idx0[idx0 >= 0]
    counts = valid.bincount(minlength=16)
    assert counts[0] > 3 * counts[15]                             # expert 0 is the hottest
    for row in idx0.tolist():                                     # distinct experts per token
        picked = [e for e in row if e >= 0]
        assert len(picked) == len(set(picked))
    _, uni, _ = make_routing(wl("uniform", 0.0), rank=0)
    assert (uni >= 0).all() and all(len(set(r)) == 4 for r in uni.tolist())
    assert w0.sum(dim=1).sub(1).abs().max() < 1e-5


def _harness_probe() -> None:
    """One gloo rank: fake backends that refuse, crash and give wrong outputs; prints the entries."""
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PROBE_PORT"])
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    import moe_ep
    from moe_ep.bench import harness
    from moe_ep.bench.backends import Backend, Context, NotAvailable, Runner
    from moe_ep.bench.workloads import Routing, Workload, make_inputs

    class Fake(Runner):
        def __init__(self, inputs, mode):
            self.inputs, self.mode = inputs, mode

        def dispatch(self):
            if self.mode == "crash":
                raise RuntimeError("boom")

        def make_expert_output(self):
            pass

        def combine(self):
            self.out = self.inputs.ref * (2 if self.mode == "wrong" else 1)

    class FakeBackend(Backend):
        name = "nccl"
        variants = ("refuse", "crash", "wrong", "right")

        def open(self, variant, wl, inputs):
            if variant == "refuse":
                raise NotAvailable("not on this machine")
            return Fake(inputs, variant)

    group = moe_ep.EPGroup()
    ctx = Context(group=group, device=torch.device("cpu"), rank=0, world_size=1, num_sms=None, node_size=None,
                  tokens=[8], timeout_s=10.0)
    wl = Workload(num_tokens=8, hidden=32, topk=2, num_experts=4, dispatch_dtype="bf16", combine_dtype="bf16",
                  layout="masked", expert_alignment=1, routing=Routing(), seed=0)
    inputs = make_inputs(wl, group)
    backend = FakeBackend(ctx)
    out = {v: harness.run_variant(backend, v, wl, inputs, ctx, harness.Options(2, 1, True), None)
           for v in backend.variants}
    print("PROBE" + json.dumps(out))
    dist.destroy_process_group()


def test_harness_reports_refusals_crashes_and_wrong_outputs():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (f"import sys; sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, 'tests')!r}]; "
            "import test_bench_cli as t; t._harness_probe()")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PROBE_PORT=str(port), TRITON_INTERPRET="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.split("PROBE", 1)[1])
    (refuse,) = out["refuse"]
    assert refuse["status"] == "not available" and refuse["reason"] == "not on this machine"
    (crash,) = out["crash"]
    assert crash["status"] == "failed" and "pre-check: RuntimeError: boom" in crash["reason"]
    (wrong,) = out["wrong"]
    assert wrong["status"] == "failed" and "max rel. error vs the oracle 1 > 0.03" in wrong["reason"]
    assert wrong["ops"] is None  # a backend that fails its pre-check is not timed
    (right,) = out["right"]
    assert right["status"] == "ok" and right["check_rel_err"] == 0 and right["ops"]["pair"]["p50_us"] > 0
