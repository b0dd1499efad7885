"""The scale model (moe_ep/bench/scale_model.py): bytes are exact counts of the drawn routing, trends
hold, the CLI writes its documented JSON, and --check compares against published numbers."""
import json

import numpy as np
import pytest

from moe_ep.bench import cli
from moe_ep.bench import scale_model as sm
from moe_ep.bench.workloads import Routing, Workload, make_routing


def _counts_by_hand(R: int, shape: sm.Shape) -> np.ndarray:
    """C[s, p] from the bench's generator, one set of destination ranks per token (no numpy tricks)."""
    wl = Workload(shape.tokens, 16, shape.topk, shape.experts, shape.dtype, "bf16", "masked", 1,
                  Routing(kind="uniform", holes=shape.holes if shape.routing == "holes" else 0.0), shape.seed)
    el = shape.experts // R
    C = np.zeros((R, R), np.int64)
    for s in range(R):
        for sel in make_routing(wl, s)[1].tolist():
            for p in {e // el for e in sel if e >= 0}:
                C[s, p] += 1
    return C


@pytest.mark.parametrize("routing", ["uniform", "holes"])
def test_bytes_are_exact_counts_of_the_draw(routing):
    R, G = 16, 4
    shape = sm.Shape(tokens=24, hidden=256, topk=4, experts=32, routing=routing, holes=0.3)
    C = _counts_by_hand(R, shape)
    assert (sm.count_matrix(R, shape) == C).all()
    p = sm.predict(R, G, "cx7", shape)
    node = np.arange(R) // G
    remote = node[:, None] != node[None, :]
    peer = ~remote & ~np.eye(R, dtype=bool)
    pay = 256 + 4 * 2                                            # fp8 payload + 2 float32 scales
    rb = -(-(pay + 4 * (1 + 3 * 4)) // 16) * 16                  # + token, lid[K], j[K], w[K]; 16-byte aligned
    hdr = -(-4 * (R + 32 // R) // 16) * 16
    d, c = p["dispatch"], p["combine"]
    assert d["row_bytes"] == rb
    assert d["bytes"]["nvlink_total"] == int(C[peer].sum()) * pay
    assert d["bytes"]["nic_total"] == int(C[remote].sum()) * rb + R * (R - 1) * hdr
    assert c["bytes"]["nvlink_total"] == int(C[peer].sum()) * 2 * 256
    assert c["bytes"]["nic_total"] == int(C[remote].sum()) * 2 * 256
    cap = d["private_capacity"]
    assert d["bytes"]["round2_total"] == int(np.maximum(C - cap, 0)[remote].sum()) * rb
    st = p["routing"]
    assert st["rows_total"] == int(C.sum())
    assert st["cross_node_fraction"] == pytest.approx(C[remote].sum() / C.sum())
    assert st["rows_sent_remote_max"] == int((C * remote).sum(axis=1).max())
    assert st["rows_recv_remote_max"] == int((C * remote).sum(axis=0).max())


def test_rows_per_rank_match_the_closed_form():
    """Uniform top-8 of 256 at EP64: mean rows per destination rank = T * (1 - C(E-EL, K) / C(E, K))
    (0.1199 * 128 = 15.35), within 3% for 4032 pairs; holes at 30% cut the rows."""
    shape = sm.Shape(tokens=128)
    st = sm.predict(64, 8, "cx7", shape)["routing"]
    p = sm.touch_probability(64, 8, 256)
    assert p == pytest.approx(0.1199, abs=1e-3)
    assert st["rows_per_dest_rank"] == pytest.approx(128 * p, rel=0.03)
    assert st["cross_node_fraction"] == pytest.approx(56 / 64, abs=0.01)
    assert st["rows_sent_remote_max"] > st["rows_sent_remote_mean"]
    holes = sm.predict(64, 8, "cx7", sm.Shape(tokens=128, routing="holes", holes=0.3))["routing"]
    assert holes["rows_total"] < 0.85 * st["rows_total"]


@pytest.mark.parametrize("nic", ["cx7", "efa"])
def test_latency_non_decreasing_in_ep(nic):
    eps = [8, 16, 32, 64, 128, 256]
    pts = [sm.predict(ep, 8, nic, sm.Shape(tokens=128)) for ep in eps]
    for op in ("dispatch", "combine"):
        lat = [p[op]["latency_us"] for p in pts]
        assert all(b >= a for a, b in zip(lat, lat[1:])), (op, lat)
        assert pts[0][op]["critical_path"] == ["kernel", "nvlink"]        # EP8: one node, no proxy
        assert pts[-1][op]["dominant"] in ("nic", "proxy", "slowest_source")


def test_latency_is_the_documented_composition():
    p = sm.predict(32, 8, "efa-p5en", sm.Shape(tokens=128))
    for op in ("dispatch", "combine"):
        ph = p[op]["phases_us"]
        want = ph["kernel"] + max(ph["nvlink"], ph["pack"] + ph["bells"] + max(ph["proxy"], ph["nic"] +
                                                                              ph["slowest_source"])) + ph["unpack"]
        assert p[op]["latency_us"] == pytest.approx(want, abs=0.02)
        assert set(ph) == set(sm.PHASES)
    # the NIC term is at least the mean rank's bytes at line rate
    d = p["dispatch"]
    assert d["phases_us"]["nic"] >= d["bytes"]["nic_per_rank"] / (sm.NICS["efa-p5en"].gbs * 1e3)


def test_zipf_is_bound_by_the_hot_rank():
    p = sm.predict(16, 8, "cx7", sm.Shape(tokens=128, routing="zipf"))
    assert p["dispatch"]["dominant"] == "slowest_source"
    assert p["dispatch"]["bytes"]["round2_total"] > 0


def test_cli_writes_the_documented_json(tmp_path, capsys):
    out = tmp_path / "model.json"
    assert cli.main(["model", "--ep", "8,16", "--nic", "efa", "--tokens", "64", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| 16 | dispatch |" in text and "dominant" in text
    doc = json.loads(out.read_text())
    assert set(doc) == {"meta", "config", "constants", "points"}
    assert doc["meta"]["hardware"] == "model (no hardware)"
    assert doc["config"]["nic"] == "efa" and doc["config"]["tokens"] == 64
    assert [p["ep"] for p in doc["points"]] == [8, 16]
    for p in doc["points"]:
        assert {"ep", "nodes", "gpus_per_node", "nic", "gpu", "routing", "dispatch", "combine"} <= set(p)
        for op in ("dispatch", "combine"):
            assert {"phases_us", "latency_us", "critical_path", "dominant", "bytes"} <= set(p[op])
            assert {"nvlink_per_rank", "nic_per_rank", "round2_total"} <= set(p[op]["bytes"])


def test_cli_refuses_an_ep_that_does_not_split_the_experts(capsys):
    with pytest.raises(SystemExit):
        cli.main(["model", "--ep", "24"])
    assert "divisor of --experts" in capsys.readouterr().err


def test_check_lists_published_points(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert cli.main(["model", "--check", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["check"]
    assert len(rows) >= 4 and len({r["system"] for r in rows}) >= 3
    assert {r["nic"] for r in rows} >= {"cx7", "efa-p5en"}
    for r in rows:
        assert r["source"].startswith("github.com/")
        for op in ("dispatch", "combine"):
            d = r[op]
            assert d["residual_pct"] == pytest.approx(100 * (d["predicted_us"] - d["published_us"]) / d["published_us"],
                                                      abs=0.1)
            assert d["miss"] == (abs(d["residual_pct"]) > sm.MISS_PCT)
        if r["dispatch"]["miss"] or r["combine"]["miss"]:
            assert r["why_apart"] and r["why_apart"] in text
    assert text.count("source: github.com/") == 3


def test_measured_costs_are_reproduced_at_their_points():
    """The kernel and proxy lines pass through the measured numbers (PERFORMANCE.md) and extend
    with the fitted slope per peer beyond EP128."""
    assert sm._kernel_us("dispatch", 128) == pytest.approx(7.4)
    assert sm._kernel_us("combine", 4096) == pytest.approx(135.2)
    assert sm._proxy_us("dispatch", 64) == pytest.approx(6.2)
    assert sm._proxy_us("combine", 128) == pytest.approx(3.7)
    assert sm._proxy_us("dispatch", 256) == pytest.approx(12.9 + 128 * 0.095)
    assert sm._proxy_us("dispatch", 48) == pytest.approx((2.9 + 6.2) / 2)
