"""Keyword arguments of DeepEP's branches and forks on the low-latency pair: accepted where they ask
for nothing, ``NotImplementedError`` naming the option and where it comes from otherwise."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

# option -> (where it comes from, what moe_ep lacks)
NVFP4 = "DeepEP's hybrid-ep branch (NVFP4 low-latency dispatch; vLLM and SGLang pass it)"
SBO_BLACKWELL = ("the DeepEP fork SGLang's single-batch overlap uses on Blackwell (combine waits for per-expert "
                 "GEMM signals)")
SBO_HOPPER = ("DeepEP's antgroup-opt branch (SGLang's single-batch overlap on Hopper: combine waits for "
              "per-block GEMM signals)")

DISPATCH_OPTIONS: Dict[str, str] = {"use_nvfp4": NVFP4, "x_global_scale": NVFP4}
COMBINE_OPTIONS: Dict[str, str] = {
    "overlap": SBO_BLACKWELL + " / " + SBO_HOPPER, "src_signals": SBO_BLACKWELL,
    "src_signal_expect_value": SBO_BLACKWELL, "packed_recv_count": SBO_HOPPER, "comp_signal": SBO_HOPPER,
    "block_m": SBO_HOPPER, "threshold": SBO_HOPPER, "num_sms": SBO_HOPPER}


def _refuse(name: str, value: Any, where: str) -> None:
    shown = f"<tensor {list(value.shape)}>" if isinstance(value, torch.Tensor) else repr(value)
    raise NotImplementedError(f"{name}={shown}: not implemented by moe_ep.deep_ep (an option of {where}; pass "
                              f"the default, or run that DeepEP build)")


def _unknown(call: str, extra: Dict[str, Any], known: Dict[str, str]) -> None:
    bad = sorted(set(extra) - set(known))
    if bad:
        raise TypeError(f"{call}() got unexpected keyword argument(s) {', '.join(bad)} (neither DeepEP's nor a "
                        f"known branch's: {', '.join(sorted(known))})")


def check_dispatch(extra: Dict[str, Any]) -> None:
    """``low_latency_dispatch``'s branch options: ``use_nvfp4`` falsy, ``x_global_scale`` None."""
    _unknown("low_latency_dispatch", extra, DISPATCH_OPTIONS)
    if extra.get("use_nvfp4"):
        _refuse("use_nvfp4", extra["use_nvfp4"], NVFP4)
    if extra.get("x_global_scale") is not None:
        _refuse("x_global_scale", extra["x_global_scale"], NVFP4)


def check_combine(extra: Dict[str, Any]) -> Tuple[()]:
    """``low_latency_combine``'s fork options. Asking for nothing: ``overlap`` falsy, no
    ``src_signals`` and no ``comp_signal`` (then ``src_signal_expect_value``, ``packed_recv_count``,
    ``block_m`` and ``threshold`` have nothing to act on and are ignored); ``num_sms`` is an SM
    count for the combine, tuning only (an int >= 0)."""
    _unknown("low_latency_combine", extra, COMBINE_OPTIONS)
    ov = extra.get("overlap")
    if isinstance(ov, torch.Tensor) or (ov is not None and ov is not False):
        _refuse("overlap", ov, COMBINE_OPTIONS["overlap"])
    for name in ("src_signals", "comp_signal"):
        if extra.get(name) is not None:
            _refuse(name, extra[name], COMBINE_OPTIONS[name])
    n = extra.get("num_sms")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise ValueError(f"num_sms: expected an int >= 0 (an SM count: tuning only on moe_ep), got {n!r}")
    return ()
