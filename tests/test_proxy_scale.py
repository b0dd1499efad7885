"""The null-transport scale bench (moe_ep/bench/proxy_scale.py) runs at R=64 with exact counts."""
import numpy as np
import pytest

from moe_ep.bench import proxy_scale as ps


def test_scale_run_r64_exact_counts():
    """A few decode epochs (spread arrivals) and a few early ones: the proxy raises every ready word
    (run_point raises otherwise), its posts match the count matrices (checked inside), and it saw
    every doorbell the kernels rang."""
    for arrival in ("spread", "early"):
        r = ps.run_point(ps.Point(64, ps.SHAPES["decode"], arrival, epochs=6, warmup=2, draws=3))
        for op in ("dispatch", "combine"):
            d = r[op]
            assert d["bells_per_op"] == d["bells_expected"], r
            assert np.isfinite(d["cpu_p50_us"]) and d["cpu_p50_us"] > 0, r
        assert r["dispatch"]["posts_per_op"] >= 63, r  # a header to every other rank, rows to remote ones


def test_posts_go_to_the_transport_in_batches():
    """The proxy hands its writes to the transport a batch at a time (Transport::post_writes): with
    every immediate in before the bells, a dispatch posts its 63 headers in one call and its rows
    in another, a combine its rows in one, so an epoch's 119 + 56 writes take a few calls."""
    r = ps.run_point(ps.Point(64, ps.SHAPES["decode"], "early", epochs=8, warmup=2, draws=2))
    posts = r["dispatch"]["posts_per_op"] + r["combine"]["posts_per_op"]
    assert posts >= 63 + 56, r
    assert 2 <= r["post_calls_per_epoch"] <= 6, r


def test_pinned_run_gives_the_cpus_back():
    """--cpus: the simulator and the proxy thread run where asked (here one CPU for both), and the
    calling thread gets its CPUs back afterwards."""
    import os
    mask = os.sched_getaffinity(0)
    cpu = min(mask)
    r = ps.run_point(ps.Point(16, ps.SHAPES["decode"], "early", epochs=4, warmup=1, draws=2, cpus=(cpu, cpu)))
    assert r["cpus"] == [cpu, cpu] and r["dispatch"]["cpu_p50_us"] > 0, r
    assert os.sched_getaffinity(0) == mask


def test_count_matrix_and_expected():
    rng = np.random.default_rng(0)
    C = ps.count_matrix(16, ps.Shape("t", 32, topk=4, num_experts=32), rng)
    assert C.shape == (16, 16) and (C >= 0).all() and (C <= 32).all()
    e = ps.expected(C, 0, 8, cap=2)
    assert e["D0"] == 15 and e["dispatch_bells"] == 9
    assert e["D1"] == int((C[0, 8:] > 0).sum()) and e["C"] == int((C[8:, 0] > 0).sum())


def test_floor_parts_at_r64():
    """The floor of a dispatch (moe_ep_sim_floor) at R = 32 and 64: each part took time, alone and as
    another thread wrote them, and the sums are their sums. How the parts grow with R is a timing:
    the bench reports it (docs/performance-log/proxy.md), a test on a shared CPU cannot judge it."""
    for R in (32, 64):
        f = ps.floor(R, iters=200, reps=2)
        assert f["ranks"] == R and f["shards"] == 1, f
        assert all(f[k] > 0 for k in ("posts_us", "immediates_us", "headers_us", "immediates_written_us",
                                      "headers_written_us")), f
        assert abs(f["sum_us"] - f["posts_us"] - f["immediates_us"] - f["headers_us"]) < 1e-9
        assert abs(f["sum_written_us"] - f["posts_us"] - f["immediates_written_us"] - f["headers_written_us"]) < 1e-9


def test_floor_of_one_shard():
    """--floor-shards: the floor of one of two proxy threads (half the peers each) is measured and
    labelled so; a shard count the ranks cannot deal out is refused. (That a shard's parts take
    less than one thread's is a timing, for the bench.)"""
    half = ps.floor(64, iters=200, reps=2, shards=2)
    assert half["shards"] == 2 and half["ranks"] == 64, half
    assert all(half[k] > 0 for k in ("posts_us", "immediates_us", "headers_us", "headers_written_us")), half
    with pytest.raises(RuntimeError, match="sim_floor failed"):
        ps.floor(8, iters=1, reps=1, shards=8)
