"""Command-line argument types the bench commands share."""
from __future__ import annotations

import argparse
from typing import Callable


def int_list(flag: str, zero_ok: bool = False, pow2_only: bool = False) -> Callable[[str], list[int]]:
    """An argparse ``type`` for ``flag``: a comma-separated list of integers, each >= 1 (>= 0 with
    ``zero_ok``; a power of two with ``pow2_only``); anything else is an error naming ``flag``."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or any(v < (0 if zero_ok else 1) for v in values) or \
                (pow2_only and any(v & (v - 1) for v in values)):
            kind = "powers of two" if pow2_only else "non-negative integers" if zero_ok else "positive integers"
            raise argparse.ArgumentTypeError(f"{flag}: expected a comma-separated list of {kind} "
                                             f"(e.g. 128 or 64,128,256), got {text!r}")
        return values
    return parse
