"""What this host offers the transports, asked of the native library: whether a verbs or libfabric
engine can be created here (``verbs_probe``, ``fabric_probe``), the RDMA devices and libfabric
providers (``rdma_devices``, ``fabric_providers``: ``python -m moe_ep.doctor`` reports them), and
GPU memory as registration sees it (``memory_type``, ``cuda_dmabuf_fd``).
"""
from __future__ import annotations

import ctypes
import json

from .library import CP, I32, SZ, U64, VP, Functions, check, text

_native = Functions(
    moe_ep_verbs_probe=(I32, CP, SZ), moe_ep_verbs_probe_device=(I32, CP, I32, CP, SZ),
    moe_ep_rdma_devices=(I32, CP, SZ), moe_ep_fabric_probe=(I32, CP, CP, CP, SZ),
    moe_ep_fabric_providers=(I32, CP, CP, SZ), moe_ep_memory_type=(I32, VP),
    moe_ep_cuda_dmabuf_fd=(I32, VP, U64, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(U64)))


def verbs_probe(device: str | None = None, port: int = 0) -> tuple[bool, str]:
    """(True, "device rxe0 port 1 GID index 1 (RoCE)") when a verbs engine can be created here
    (on ``device`` and ``port``, default the transport's own choice), else (False, why not:
    libibverbs missing, no device, no active port, no usable GID)."""
    buf = ctypes.create_string_buffer(2048)
    ok = (_native().moe_ep_verbs_probe_device(device.encode(), port, buf, len(buf)) if device or port
          else _native().moe_ep_verbs_probe(buf, len(buf)))
    return ok == 1, buf.value.decode(errors="replace")


def memory_type(ptr: int) -> str:
    """``"device"`` when registration treats ``ptr`` as GPU memory (the CUDA driver, if this process
    has loaded it, says ``CU_MEMORYTYPE_DEVICE``), else ``"host"``."""
    return "device" if _native().moe_ep_memory_type(ptr) == 1 else "host"


def cuda_dmabuf_fd(ptr: int, nbytes: int) -> tuple[int, int]:
    """(fd, offset of ptr in it): the dma-buf the verbs transport would register for GPU memory
    at ``[ptr, ptr + nbytes)`` (the caller closes the fd). Raises ``NativeError`` naming what is
    missing (the CUDA driver, its dma-buf export, the driver's error)."""
    fd, off = ctypes.c_int32(-1), ctypes.c_uint64()
    check(_native().moe_ep_cuda_dmabuf_fd(ptr, nbytes, ctypes.byref(fd), ctypes.byref(off)))
    return fd.value, off.value


def rdma_devices() -> dict:
    """What libibverbs reports of every RDMA device, EFA devices included (device and port
    attributes, GIDs): ``{"devices": [...]}``, or ``{"error": why}``."""
    return json.loads(text(_native().moe_ep_rdma_devices))


def fabric_probe(provider: str | None = None, domain: str | None = None) -> tuple[bool, str]:
    """(True, "provider tcp;ofi_rxm domain lo (mr_mode ..., cq_data_size 8)") when a libfabric
    engine can be created here (``provider`` / ``domain``, default the transport's own choice;
    ``domain`` may list several, ``"a,b"``: each must fit),
    else (False, why not: libfabric missing, no provider with FI_EP_RDM + FI_RMA + remote CQ data)."""
    buf = ctypes.create_string_buffer(4096)
    ok = _native().moe_ep_fabric_probe((provider or "").encode(), (domain or "").encode(), buf, len(buf))
    return ok == 1, buf.value.decode(errors="replace")


def fabric_providers(provider: str | None = None) -> dict:
    """What libfabric offers (every fi_info entry of ``provider``, default all): provider, fabric,
    domain, endpoint type, RMA / MSG / HMEM caps, mr_mode, cq_data_size, progress, max message size
    and whether the libfabric transport can use it: ``{"library_version", "api_version",
    "entries": [...]}``, or ``{"error": why}``."""
    return json.loads(text(lambda buf, n: _native().moe_ep_fabric_providers((provider or "").encode(), buf, n)))

