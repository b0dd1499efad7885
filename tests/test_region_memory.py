"""Where the proxy's row regions live on a GPU rank (moe_ep/internode/path.py, §9-§10): an engine
says, without using a key, whether it would register a buffer (``Engine.try_register``); tcp
refuses GPU memory (its CPU moves the bytes), libfabric asks for FI_HMEM, and the buffer takes
GPU memory only where its engine can. On CPU the device type is forced with the registration
test hook, so these run everywhere; the GPU cases run with ``-m gpu``."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import native_hooks as hooks
from moe_ep.native import library, probes, transports
from moe_ep.internode.path import row_region_memory
from moe_ep.internode.spec import ROW_REGIONS


@pytest.fixture
def as_device():
    hooks.set_memory_type("device")
    yield
    hooks.set_memory_type(None)


def test_tcp_refuses_gpu_memory(as_device):
    e = transports.TcpTransport(0, 2, streams=1)
    try:
        ok, why = e.try_register(np.zeros(64, np.uint8))
        assert not ok and why == "the tcp transport moves bytes with the CPU, which cannot reach GPU memory", why
        with pytest.raises(library.NativeError, match="rank 0: register: the tcp transport moves bytes with the CPU"):
            e.register(np.zeros(64, np.uint8))
        hooks.set_memory_type("host")
        assert e.try_register(np.zeros(64, np.uint8)) == (True, "host")
        assert e.register(np.zeros(64, np.uint8)) == 1  # the refused one took no key, nor did the tries
    finally:
        e.close()


def test_libfabric_gpu_memory_needs_hmem():
    ok, why = probes.fabric_probe("tcp;ofi_rxm")
    if not ok:
        pytest.skip(f"libfabric tcp;ofi_rxm: {why}")
    e = transports.FabricTransport(0, 2, provider="tcp;ofi_rxm", domain="lo")  # (its own buffers: host memory)
    try:
        hooks.set_memory_type("device")
        ok, why = e.try_register(np.zeros(4096, np.uint8))
        assert not ok and "registering GPU memory needs FI_HMEM, which tcp;ofi_rxm does not offer" in why, why
        hooks.set_memory_type("host")
        assert e.try_register(np.zeros(4096, np.uint8)) == (True, "host")
        assert e.register(np.zeros(4096, np.uint8)) == 1
    finally:
        hooks.set_memory_type(None)
        e.close()


class _Engine:
    """An engine stand-in: ``try_register`` answers ``answer``."""

    def __init__(self, answer):
        self.answer, self.rank, self.transport, self.tried = answer, 3, "verbs", []

    def try_register(self, obj):
        self.tried.append(obj)
        return self.answer


def test_row_regions_take_gpu_memory_where_the_engine_can():
    sizes = {n: 32 * (i + 1) for i, n in enumerate(ROW_REGIONS)}
    eng = _Engine((True, "dma-buf/dma-buf"))
    rows, kind, how = row_region_memory(eng, sizes, torch.device("cpu"), "auto")  # (cpu stands for the GPU)
    assert (kind, how) == ("gpu", "dma-buf/dma-buf") and list(rows) == list(ROW_REGIONS)
    assert all(rows[n].numel() == sizes[n] and rows[n].dtype == torch.uint8 for n in ROW_REGIONS)
    assert eng.tried == [rows["round1"]]
    with pytest.raises(library.NativeError, match="rank 3: proxy_memory='gpu', but the verbs engine cannot register GPU "
                                            "memory here: no dma-buf, no nvidia-peermem"):
        row_region_memory(_Engine((False, "no dma-buf, no nvidia-peermem")), sizes, torch.device("cpu"), "gpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_row_regions_fall_back_to_pinned_host_gpu():
    sizes = {n: 4096 for n in ROW_REGIONS}
    dev = torch.device("cuda", torch.cuda.current_device())
    rows, kind, why = row_region_memory(_Engine((False, "tcp cannot")), sizes, dev, "auto")
    assert (kind, why) == ("host", "tcp cannot") and all(r.is_pinned() and r.device.type == "cpu" for r in rows.values())
    eng = transports.TcpTransport(0, 2, streams=1)
    try:  # a real engine and real GPU memory: tcp says no, without the test hook
        ok, why = eng.try_register(torch.zeros(4096, dtype=torch.uint8, device=dev))
        assert not ok and "cannot reach GPU memory" in why
        rows, kind, _ = row_region_memory(eng, sizes, dev, "host")
        assert kind == "host" and all(r.is_pinned() for r in rows.values())
    finally:
        eng.close()
