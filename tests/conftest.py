"""Shared test set-up: rank pools are started on first use and shut down at the end of the session."""
from __future__ import annotations

import os

import pytest

# Kernels that run in this process (none by default; rank processes set their own environment)
# must use the interpreter on a machine without a GPU. Set before anything imports triton.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except Exception:  # noqa: BLE001
    pass

import dist_util  # noqa: E402
import native_hooks  # noqa: E402,F401  (the tests' build of the native library, before anything loads one)


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    yield
    dist_util.shutdown()
