"""The proxy cost bench (moe_ep/bench/proxy_cost.py): its phase part at real row sizes."""
import math

import pytest

from moe_ep.bench import proxy_cost as pc


def test_phase_time_moves_rows_of_the_size_asked():
    """Two ranks over TCP loopback, 3 rows of 64 bytes (combine: 32) to the peer an epoch: each
    rank checks that the last epoch's rows landed whole in round 1 (inside the rank), and every
    phase time is a number."""
    r = pc.phase_time(2, 1, epochs=5, warmup=2, private_capacity=3, rows=3, row_bytes=(64, 32))
    assert (r["row_bytes"], r["comb_row_bytes"], r["rows"]) == (64, 32, 3), r
    for k in ("proxy_dispatch_p50_us", "proxy_combine_p50_us", "kernel_dispatch_p50_us"):
        assert math.isfinite(r[k]) and r[k] > 0, (k, r)


def test_phase_time_at_four_ranks_with_round_one_slots():
    """Four ranks, one 16-byte row to every peer, 2 round-1 rows a peer (the defaults): the
    combine send region is as large as the proxy needs (round-1 slots of 3 peers, then the
    overflow), and the last epoch's rows landed."""
    r = pc.phase_time(4, 1, epochs=3, warmup=1)
    assert r["ranks"] == 4 and math.isfinite(r["proxy_combine_p50_us"]), r


def test_row_bytes_option_checked():
    with pytest.raises(SystemExit):
        pc.main(["--part", "phase", "--ranks", "2", "--row-bytes", "7500,14336"])
