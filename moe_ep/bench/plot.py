"""PNG plots of result documents (matplotlib, Agg backend): one figure with six panels.

Top row: p50 latency vs tokens per rank for dispatch, combine and the pair, one line per backend
variant and launch mode. Bottom row: GB/s vs tokens for dispatch and combine (solid: DeepEP's
convention, local rows counted; dashed: cross-GPU bytes only), and the pair's p50 vs EP size when
the documents span several sizes (merge runs at different world sizes: ``moe-ep-bench plot a.json b.json``).
"""
from __future__ import annotations

from typing import Optional

from .report import OP_NAMES, label


class PlotUnavailable(RuntimeError):
    """matplotlib is missing: the message says how to plot later."""


def _series(entries: list[dict]) -> dict[str, list[dict]]:
    multi_sms = len({e["num_sms_requested"] for e in entries}) > 1
    out: dict[str, list[dict]] = {}
    for e in entries:
        if e["status"] != "ok":
            continue
        name = f"{label(e)} {e['launch']}"
        if multi_sms and e["num_sms_requested"] is not None:
            name += f" {e['num_sms_requested']} SMs"
        out.setdefault(name, []).append(e)
    return out


def plot(docs: list[dict], path: str, title: Optional[str] = None) -> str:
    """Writes the figure of ``docs`` (merged) to ``path`` (PNG); returns the path."""
    try:
        import matplotlib
    except ImportError as e:
        raise PlotUnavailable("matplotlib is not installed: no plot written; install it (pip install matplotlib) "
                              "and run `moe-ep-bench plot RESULT.json --output PLOT.png` later") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    entries = [e for d in docs for e in d["results"]]
    sizes = sorted({e["world_size"] for e in entries})
    series = _series(entries)
    fig, axes = plt.subplots(2, 3, figsize=(16, 9), constrained_layout=True)
    for ax, op in zip(axes[0], OP_NAMES):
        for name, es in series.items():
            pts = sorted((e["num_tokens"], e["ops"][op]["p50_us"]) for e in es if e["world_size"] == sizes[-1])
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set(title=f"{OP_NAMES[op]} p50 latency (R={sizes[-1]})", xlabel="tokens per rank", ylabel="µs")
    for ax, op in zip(axes[1][:2], ("dispatch", "combine")):
        for i, (name, es) in enumerate(series.items()):
            color = f"C{i % 10}"
            for key, style, tag in (("gbps_all", "-", "all"), ("gbps_xgpu", "--", "xgpu")):
                pts = sorted((e["num_tokens"], e["ops"][op][key]) for e in es
                             if e["world_size"] == sizes[-1] and e["ops"][op][key] is not None)
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", color=color, label=f"{name} ({tag})")
        ax.set(title=f"{op} GB/s at p50 (solid: all rows, dashed: cross-GPU)", xlabel="tokens per rank", ylabel="GB/s")
    ax = axes[1][2]
    if len(sizes) > 1:
        tokens = max({e["num_tokens"] for e in entries})
        for name, es in series.items():
            pts = sorted((e["world_size"], e["ops"]["pair"]["p50_us"]) for e in es if e["num_tokens"] == tokens)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name)
        ax.set(title=f"dispatch+combine p50 vs EP size (T={tokens})", xlabel="EP size (ranks)", ylabel="µs")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    else:
        ax.axis("off")
        ax.text(0.5, 0.5, f"one EP size (R={sizes[0]}):\nmerge runs at other sizes\n(moe-ep-bench plot a.json b.json)",
                ha="center", va="center")
    for ax in list(axes[0]) + list(axes[1][:2]):
        if len({e["num_tokens"] for e in entries}) > 1:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(ScalarFormatter())
        if ax.lines:
            ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        if ax.lines:
            ax.legend(fontsize=7)
    c = docs[0]["config"]
    env = docs[0]["env"]
    fig.suptitle(title or f"moe-ep-bench: H={c['hidden']} K={c['topk']} E={c['num_experts']} "
                          f"dispatch={c['dispatch_dtype']} routing={c['routing']['kind']} · {env['device']} · "
                          f"{env.get('commit')}")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
