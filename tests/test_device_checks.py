"""The device-side checks GPUs rely on, exercised in the interpreter (R=1, one process).

On GPU nothing in dispatch may sync with the host, so out-of-range expert ids are found by the
kernels (the routing histogram at prefill sizes, the send kernel at decode sizes), treated as -1
and reported at the next host check. On CPU the host checks first; here that is switched off.
"""
import os

import pytest
import torch

import moe_ep
import moe_ep.ops.dispatch as D

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                reason="CPU tests run the kernels in the Triton interpreter (TRITON_INTERPRET=1)")


@pytest.mark.parametrize("T", [8, 300], ids=["decode-direct", "prefill-histogram"])
def test_bad_expert_ids_reported_by_kernels(monkeypatch, T):
    monkeypatch.setattr(D, "check_ids_on_host", lambda topk_idx, num_experts: None)  # the kernels' check alone
    E, H, K = 8, 128, 8
    buf = moe_ep.EPBuffer(moe_ep.EPGroup(), E, H, T, K, layout="packed")
    x = torch.arange(T * H, dtype=torch.float32).reshape(T, H).remainder(7).to(torch.bfloat16)
    idx = torch.randint(0, E, (T, K))
    idx[1, 3] = E + 5     # out of range high
    idx[2, 0] = -7        # out of range low
    w = torch.ones(T, K)
    with pytest.raises(ValueError, match="topk_idx"):
        buf.dispatch(x, idx, w)
    # The bad selections were dropped, the rest delivered: counts are those of the valid ids.
    valid = idx[(idx >= 0) & (idx < E)]
    assert buf.parts.memory.expert_counts.tolist() == torch.bincount(valid, minlength=E).tolist()
    with pytest.raises(moe_ep.BufferBrokenError):
        buf.dispatch(x, idx, w)
    buf.close()
