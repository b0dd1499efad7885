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
    """The floor of a dispatch (moe_ep_sim_floor): each part takes time, and the parts grow with R
    (twice the peers: more posts, more immediates, more header counts), also as another thread wrote them."""
    a, b = ps.floor(32, iters=200, reps=2), ps.floor(64, iters=200, reps=2)
    for f in (a, b):
        assert all(f[k] > 0 for k in ("posts_us", "immediates_us", "headers_us", "immediates_written_us",
                                      "headers_written_us")), f
        assert abs(f["sum_us"] - f["posts_us"] - f["immediates_us"] - f["headers_us"]) < 1e-9
        assert abs(f["sum_written_us"] - f["posts_us"] - f["immediates_written_us"] - f["headers_written_us"]) < 1e-9
    assert b["posts_us"] > a["posts_us"] and b["headers_us"] > a["headers_us"], (a, b)
    assert b["headers_written_us"] > a["headers_written_us"], (a, b)


def test_floor_of_one_shard():
    """--floor-shards: one of two proxy threads posts, takes and checks for half the peers (each
    header still R counts), so its posts and headers take less than one thread's for all; a shard
    count the ranks cannot deal out is refused."""
    one, half = ps.floor(64, iters=200, reps=3), ps.floor(64, iters=200, reps=3, shards=2)
    assert half["shards"] == 2 and one["shards"] == 1
    assert half["posts_us"] < one["posts_us"] and half["headers_us"] < one["headers_us"], (one, half)
    with pytest.raises(RuntimeError, match="sim_floor failed"):
        ps.floor(8, iters=1, reps=1, shards=8)
