"""Results of the bench CLI: the JSON document (schema: moe_ep/bench/schema.json), the table, merging."""
from __future__ import annotations

import json
import os
import platform
import sys
from typing import Iterable, Optional

import torch

SCHEMA_VERSION = 1
OP_NAMES = {"dispatch": "dispatch", "combine": "combine", "pair": "dispatch+combine"}


def label(entry: dict) -> str:
    """``backend[/variant]``, e.g. ``deepep/low_latency``."""
    return entry["backend"] + (f"/{entry['variant']}" if entry.get("variant") else "")


def environment(device: torch.device, world_size: int) -> dict:
    """Hardware, versions and commit (moe_ep/bench/intranode.py's fields plus the launch's)."""
    from .intranode import environment as base_env

    env = base_env(device)
    import numpy

    env.update(python=platform.python_version(), numpy=numpy.__version__, platform=platform.platform(),
               world_size=world_size, local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
               cuda=torch.version.cuda, nccl=None, deep_ep=None,
               gpus_per_host=torch.cuda.device_count() if device.type == "cuda" else 0)
    if device.type == "cuda":
        v = torch.cuda.nccl.version()
        env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    try:
        from importlib.metadata import version

        env["deep_ep"] = version("deep_ep")
    except Exception:  # noqa: BLE001 - not installed (or installed without metadata)
        try:
            import deep_ep

            env["deep_ep"] = getattr(deep_ep, "__version__", "unknown version")
        except Exception:  # noqa: BLE001
            env["deep_ep"] = None
    return env


def document(config: dict, env: dict, entries: list[dict], command: str) -> dict:
    return dict(schema_version=SCHEMA_VERSION, tool="moe-ep-bench", command=command, config=config, env=env,
                results=entries)


def write_json(path: str, doc: dict) -> None:
    """Writes atomically (a crash mid-sweep leaves the previous complete file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def load(paths: Iterable[str]) -> list[dict]:
    """Reads JSON documents, each validated against moe_ep/bench/schema.json (ValueError naming the file)."""
    from .schema import validate_document

    docs = []
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        problems = validate_document(doc)
        if problems:
            raise ValueError(f"{path}: not a moe-ep-bench result: {problems[0]}")
        docs.append(doc)
    return docs


def merge(docs: list[dict]) -> dict:
    """One document with every entry of ``docs`` (config and env of the first; the others' kept in ``merged``)."""
    first = docs[0]
    out = dict(first, results=[e for d in docs for e in d["results"]])
    out["merged"] = [dict(command=d["command"], config=d["config"], env=d["env"]) for d in docs]
    return out


def _fmt(v: Optional[float], width: int = 9) -> str:
    if v is None:
        return f"{'-':>{width}}"
    return f"{v:>{width}.1f}" if abs(v) >= 0.1 else f"{v:>{width}.3g}"


def format_table(doc: dict) -> str:
    """Every entry side by side, grouped by EP size, token count and requested SMs."""
    c, env = doc["config"], doc["env"]
    lines = [f"moe-ep-bench  {c['model'] or 'custom shape'}: H={c['hidden']} K={c['topk']} E={c['num_experts']} dispatch={c['dispatch_dtype']} "
             f"combine={c['combine_dtype']} layout={c['layout']} routing={c['routing']['kind']} "
             f"iters={c['iters']}  [{env.get('device')}, torch {env.get('torch')}, {env.get('commit')}]"]
    if env.get("ranks_per_gpu", 0) > 1:
        lines.append(f"{env['world_size']} ranks on {env['gpus']} GPU{'s' * (env['gpus'] > 1)} ({env['ranks_per_gpu']} "
                     f"per GPU, time-sliced): times are not NVLink timings, and no GB/s is given")
    groups: dict[tuple, list[dict]] = {}
    for e in doc["results"]:
        groups.setdefault((e["world_size"], e["num_tokens"], e["num_sms_requested"]), []).append(e)
    head = (f"  {'backend':<20} {'launch':<6} {'SMs':>4} {'op':<17} {'p50 us':>9} {'p90 us':>9} {'p99 us':>9} "
            f"{'GB/s all':>9} {'GB/s xgpu':>9}")
    for (r, t, sms), entries in groups.items():
        lines.append("")
        lines.append(f"R={r} T={t}" + (f" --num-sms {sms}" if sms is not None else ""))
        lines.append(head)
        for e in entries:
            sm = "-" if e["sms"] is None else str(e["sms"])
            if e["status"] != "ok":
                lines.append(f"  {label(e):<20} {e['launch']:<6} {sm:>4} {e['status']}: {e['reason']}")
                continue
            for op, name in OP_NAMES.items():
                s = e["ops"][op]
                lines.append(f"  {label(e):<20} {e['launch']:<6} {sm:>4} {name:<17} {_fmt(s['p50_us'])} "
                             f"{_fmt(s['p90_us'])} {_fmt(s['p99_us'])} {_fmt(s['gbps_all'])} {_fmt(s['gbps_xgpu'])}")
        checks = [f"{label(e)}/{e['launch']} {e['check_rel_err']:.1e}" for e in entries if e["status"] == "ok"]
        if checks:
            lines.append("  pre-check (max rel. error vs moe_ep.testing.reference): " + ", ".join(checks))
    return "\n".join(lines)


def command_line() -> str:
    return " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:])
