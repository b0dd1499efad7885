"""verbs transport (csrc/proxy/verbs_transport.cc): libibverbs RC queue pairs behind the
Transport interface.

The ``rdma`` tests need a usable verbs device (any IB/RoCE NIC, or Soft-RoCE ``rxe``) and are
skipped with the reason otherwise. They drive the native library through ctypes without
importing ``moe_ep`` itself (whose ``__init__`` imports torch, slow on an emulated machine), so
they also run with ``--noconftest``. The CPU tests check that the library builds, imports and
runs without rdma-core, and that asking for verbs where it cannot work says what is missing.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time

import numpy as np
import pytest

import native_hooks as hooks
from engine_cases import assert_compiles, catch, connect_all as _connect_all, proxy_two_nodes, registered_pair
from native_hooks import light_import
from stand_in_cuda import fake_cuda_lib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SRC = os.path.join(ROOT, "csrc", "proxy")
LAUNCH_SRC = os.path.join(ROOT, "csrc", "launch")  # the kernel launcher, in the same library


errors = light_import("core.errors")
identity = light_import("native.identity")
library = light_import("native.library")
probes = light_import("native.probes")
proxy = light_import("native.proxy")
transports = light_import("native.transports")
AVAILABLE, WHY = probes.verbs_probe()


# MOE_EP_REQUIRE_RDMA=1 (CI's VM run): no skipping; without a device the tests fail, saying why.
REQUIRE = os.environ.get("MOE_EP_REQUIRE_RDMA") == "1"


def rdma_test(f):
    """An rdma-marked test, skipped (with the probe's reason) where no verbs device is usable."""
    return pytest.mark.rdma(pytest.mark.skipif(not AVAILABLE and not REQUIRE, reason=f"no usable RDMA device: {WHY}")(f))


REGION = 1 << 20


# ---------------------------------------------------------------- helpers

def _plan(seed: int, n: int, region: int = REGION):
    """(offset, size, imm or None): disjoint ranges, 0-byte writes, writes without immediate."""
    rng = np.random.default_rng(seed)
    sizes = rng.choice([0, 1, 7, 64, 1000, 4093, 20000, 65537], size=n, p=[.15, .1, .1, .1, .15, .15, .2, .05])
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    assert offs[-1] + sizes[-1] <= region
    imms = [None if rng.random() < 0.2 else int(0x5000 + rng.integers(0, 3)) for _ in range(n)]
    payload = rng.integers(0, 256, size=region, dtype=np.uint8)
    return [(int(o), int(s), i) for o, s, i in zip(offs, sizes, imms)], payload


def _send(eng, peer, src_key, dst_key, plan, timeout_s=60.0):
    wrs = [eng.post_write(peer, src_key, o, dst_key, o, s, imm=i) for o, s, i in plan]
    comps = eng.wait_completions(len(wrs), timeout_s)
    assert sorted(c.wr_id for c in comps) == sorted(wrs)
    assert all(c.status == transports.CQ_OK and c.peer == peer for c in comps)


def _check_received(eng, dst, plan, payload, timeout_s=60.0):
    imms = [i for *_, i in plan if i is not None]
    for imm in sorted(set(imms)):
        eng.imm.wait(imm, imms.count(imm) * eng.imm_per_write, timeout_s)  # several NICs: one per shard
        assert eng.imm.value(imm) == 0  # exact: nothing extra was counted
    end = max(o + s for o, s, _ in plan)
    np.testing.assert_array_equal(dst[:end], payload[:end])
    assert not dst[end:].any()


def _exchange(a, b, bufs, plans, timeout_s=60.0):
    """Both engines send their plan to each other at once; each receiver checks bytes and counts."""
    for r in (0, 1):
        bufs[r][0][:] = plans[r][1]
    errs: list = []

    def send(e):
        try:
            _send(e, 1 - e.rank, bufs[e.rank][2], bufs[1 - e.rank][3], plans[e.rank][0], timeout_s)
        except BaseException as ex:  # noqa: BLE001 - reported below
            errs.append(ex)

    ts = [threading.Thread(target=send, args=(e,)) for e in (a, b)]
    for t in ts:
        t.start()
    _check_received(b, bufs[1][1], *plans[0], timeout_s=timeout_s)
    _check_received(a, bufs[0][1], *plans[1], timeout_s=timeout_s)
    for t in ts:
        t.join(timeout_s)
    assert not errs, errs
    assert a.peer_error(1) == "" and b.peer_error(0) == ""


def _pair(connect=True, **kw):
    return registered_pair(transports.VerbsTransport(0, 2, **kw), transports.VerbsTransport(1, 2, **kw), REGION, connect)


def _run_py(code: str, **env) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter (its own libibverbs state) with the native modules (and the
    test hooks) by name."""
    pre = (f"import sys; sys.path.insert(0, {HERE!r})\n"
           "from test_verbs_transport import errors, hooks, identity, library, probes, proxy, transports\n")
    return subprocess.run([sys.executable, "-c", pre + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env}, cwd=ROOT)


# ---------------------------------------------------------------- CPU: no rdma-core needed

def test_library_does_not_need_rdma_core():
    """No source includes rdma-core headers, the library links neither libibverbs nor libefa, and
    without libibverbs it still imports and runs the TCP transport. The sources libibverbs is
    opened from compile without warnings."""
    for f in ("verbs_transport.cc", "rdma_probe.cc"):
        r = subprocess.run([os.environ.get("CXX", "c++"), "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
                            os.path.join(SRC, f)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    srcs = sorted(os.path.join(d, f) for d in (SRC, LAUNCH_SRC) for f in os.listdir(d) if f.endswith(".cc"))
    py = "-I" + sysconfig.get_paths()["include"]  # (launch.cc's Python function)
    deps = subprocess.run([os.environ.get("CXX", "c++"), "-std=c++17", py, "-M", *srcs], capture_output=True, text=True)
    assert deps.returncode == 0, deps.stderr
    assert "infiniband/" not in deps.stdout and "/rdma/" not in deps.stdout  # rdma-core's header directories
    lib_path = library.path()
    needed = subprocess.run(["readelf", "-d", lib_path], capture_output=True, text=True).stdout
    assert "NEEDED" in needed and "ibverbs" not in needed and "efa" not in needed and "cuda" not in needed
    assert "libpython" not in needed  # launch.cc uses Python's stable ABI from the process that loads it
    r = _run_py("""
        import numpy as np
        ok, why = probes.verbs_probe()
        assert not ok and "libmissing-ibverbs.so.1" in why, why
        a, b = transports.TcpTransport(0, 2, streams=2), transports.TcpTransport(1, 2, streams=2)
        s, d = np.arange(256, dtype=np.uint8), np.zeros(256, np.uint8)
        ks, _ = a.register(s), a.register(np.zeros(1, np.uint8))
        b.register(np.zeros(1, np.uint8)); kd = b.register(d)
        a.connect([a.endpoint, b.endpoint], 10); b.connect([a.endpoint, b.endpoint], 10)
        a.post_write(1, ks, 0, kd, 0, 256, imm=9); a.wait_completions(1, 10); b.imm.wait(9, 1, 10)
        assert (d == s).all()
        print("tcp ok")
    """, MOE_EP_IBVERBS_LIB="libmissing-ibverbs.so.1")
    assert r.returncode == 0 and "tcp ok" in r.stdout, r.stdout + r.stderr


def test_verbs_unavailable_errors_name_what_is_missing():
    r = _run_py("""
        for kw in ({}, {"device": "mlx5_9"}):
            try:
                transports.VerbsTransport(0, 2, **kw)
            except library.NativeError as e:
                print("ERR", e)
            else:
                raise SystemExit("no error")
        try:
            transports.Engine(1, 2, transport="verbs")
        except library.NativeError as e:
            print("ERR", e)
    """, MOE_EP_IBVERBS_LIB="libmissing-ibverbs.so.1")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("ERR")]
    assert len(lines) == 3, r.stdout
    for ln in lines[:2]:
        assert "rank 0" in ln and "verbs transport not available" in ln and "libmissing-ibverbs.so.1" in ln, ln
    assert "rank 1" in lines[2] and "verbs transport not available" in lines[2] and "libmissing-ibverbs.so.1" in lines[2]


def test_verbs_missing_device_names_it():
    """A device name that does not exist: the error names it (and the devices there are), or,
    without libibverbs, the missing library."""
    r = _run_py("""
        try:
            transports.VerbsTransport(0, 2)
        except library.NativeError as e:
            print("ERR", e)
        else:
            print("created")
    """, MOE_EP_IB_DEVICE="nosuchdev0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ERR rank 0: verbs"), r.stdout
    if AVAILABLE:
        assert "'nosuchdev0'" in r.stdout and "not found" in r.stdout
    else:
        assert WHY in r.stdout


def test_select_transport():
    from moe_ep.internode.session import select_transport

    assert select_transport("tcp") == ("tcp", "MOE_EP_TRANSPORT=tcp")
    efa_ok, efa_why = probes.fabric_probe("efa")
    kind, why = select_transport("auto")
    assert kind == ("efa" if efa_ok else "verbs" if AVAILABLE else "tcp") and why.startswith("auto: ")
    if not efa_ok and not AVAILABLE:
        assert WHY in why and f"efa (libfabric provider efa) not usable: {efa_why}" in why
    with pytest.raises(ValueError, match="expected one of auto, verbs, tcp, efa"):
        select_transport("ucx")
    if not AVAILABLE:
        with pytest.raises(RuntimeError, match="MOE_EP_TRANSPORT=verbs, but no verbs device is usable: " + WHY[:20]):
            select_transport("verbs")
    else:
        assert select_transport("verbs")[0] == "verbs"


@rdma_test
def test_auto_takes_verbs_where_efa_is_not_usable():
    """On a non-EFA verbs device (the Soft-RoCE VM): libfabric's efa provider is not usable, so
    auto takes verbs, and asking for efa (on the device's would-be efa domain too) names why."""
    ok, efa_why = probes.fabric_probe("efa")
    if ok:
        pytest.skip("libfabric's efa provider is usable here")
    assert AVAILABLE, WHY
    S = light_import("internode.session")
    assert S.select_transport("auto")[0] == "verbs"
    with pytest.raises(RuntimeError, match=r"MOE_EP_TRANSPORT=efa, but no EFA device \(libfabric provider efa\) "
                                           r"is usable: "):
        S.select_transport("efa")
    name = WHY.split()[1]  # "device rxe0 port 1 ..."
    with pytest.raises(library.NativeError, match="rank 0: libfabric transport not available: "):
        transports.FabricTransport(0, 2, "efa", light_import("native.nic").efa_domain(name))


def _shards_ref(n: int, k: int, min_shard: int, align: int) -> list[int]:
    """The rule of shard_bounds (transport_common.h), written out independently."""
    align = max(align, 1)
    chunk = max(-(-n // k), max(min_shard, 1))
    chunk = -(-chunk // align) * align
    return [min(i * chunk, n) for i in range(k + 1)]


def test_shard_bounds_arithmetic():
    """The verbs transport's byte shards (native shard_bounds) against the rule written out, and
    its properties: k contiguous shards covering the write, starts aligned, none but the last
    non-empty one short of the minimum, empty shards only at the end."""
    assert transports.shard_bounds(0, 3) == [0, 0, 0, 0]  # a 0-byte write: k empty shards
    assert transports.shard_bounds(100, 2) == [0, 100, 100]  # under the 16 KiB minimum: one shard, one empty
    assert transports.shard_bounds(1000, 2, 1) == [0, 512, 1000]  # halves, rounded up to 64 bytes
    assert transports.shard_bounds(100000, 3) == [0, 33344, 66688, 100000]
    assert transports.shard_bounds(65, 4, 1) == [0, 64, 65, 65, 65]
    assert transports.shard_bounds(10, 1, 1) == [0, 10]
    assert transports.shard_bounds(7, 2, 1, 1) == [0, 4, 7]  # no alignment
    with pytest.raises(library.NativeError, match="k must be"):
        transports.shard_bounds(10, 0)
    rng = np.random.default_rng(5)
    for _ in range(3000):
        n = int(rng.choice([0, 1, 63, 64, 65, 4096, 16384, 16385, 1 << 20, 3 << 30]) + rng.integers(0, 3) * rng.integers(0, 1000))
        k, ms, al = int(rng.integers(1, 9)), int(rng.choice([0, 1, 100, 4096, 16384])), int(rng.choice([0, 1, 8, 64, 4096]))
        b = transports.shard_bounds(n, k, ms, al)
        assert b == _shards_ref(n, k, ms, al), (n, k, ms, al)
        sizes = [y - x for x, y in zip(b, b[1:])]
        assert b[0] == 0 and b[-1] == n and all(x >= 0 for x in sizes) and len(sizes) == k
        full = [x for x in sizes if x]
        assert all(x % max(al, 1) == 0 and x >= ms for x in full[:-1]), (n, k, ms, al, sizes)
        assert sizes == full + [0] * (k - len(full))  # the empty shards come last
        assert all(x % max(al, 1) == 0 for x in b[:len(full)])


# ---------------------------------------------------------------- GPU memory: the CUDA driver's part, with a stand-in driver

def test_gpu_memory_selection_with_a_stand_in_driver(tmp_path):
    """Which memory registration takes for device memory: host unless the CUDA driver (only if
    this process has loaded it: it is never loaded just to ask) says device; the dma-buf request
    covers the page-aligned range with the DMA_BUF_FD handle type and returns ptr's offset in
    it; a driver without dma-buf export, or no driver at all, is an error naming it."""
    lib_path = fake_cuda_lib(tmp_path)
    log = tmp_path / "cuda.log"
    r = _run_py(f"""
        import ctypes, mmap, os
        import numpy as np
        buf = np.zeros(5 * mmap.PAGESIZE, np.uint8)
        p = buf.ctypes.data
        os.environ["FAKE_CUDA_DEVICE"] = "%d:%d" % (p, buf.nbytes)  # this buffer plays device memory
        def maps(): return open("/proc/self/maps").read()
        assert probes.memory_type(p) == "host" and "libfakecuda" not in maps()  # not loaded to ask
        ctypes.CDLL({lib_path!r})  # the process "uses CUDA" now
        assert probes.memory_type(p) == "device" and probes.memory_type(p + buf.nbytes) == "host"
        assert probes.memory_type(p - 1) == "host"
        ptr, n = p + mmap.PAGESIZE + 100, 2 * mmap.PAGESIZE
        fd, off = probes.cuda_dmabuf_fd(ptr, n)
        os.close(fd)
        PG = mmap.PAGESIZE
        base, end = ptr // PG * PG, (ptr + n + PG - 1) // PG * PG
        assert off == ptr - base
        got = open({str(log)!r}).read().split()
        assert got == [str(base), str(end - base), "1", "0"], got  # the page-aligned range, DMA_BUF_FD, flags 0
        os.environ["FAKE_CUDA_DMABUF_FAIL"] = "1"
        try:
            probes.cuda_dmabuf_fd(ptr, n)
        except library.NativeError as e:
            print("ERR1", e)
        hooks.set_memory_type("host")
        assert probes.memory_type(p) == "host"
        hooks.set_memory_type(None)
        assert probes.memory_type(p) == "device"
        os.environ["MOE_EP_CUDA_LIB"] = "libmissing-cuda.so.1"
        assert probes.memory_type(p) == "host"  # that driver is not loaded: host
        try:
            probes.cuda_dmabuf_fd(ptr, n)
        except library.NativeError as e:
            print("ERR2", e)
    """, MOE_EP_CUDA_LIB=lib_path, FAKE_CUDA_LOG=str(log))
    assert r.returncode == 0, r.stdout + r.stderr
    err = dict(ln.split(" ", 1) for ln in r.stdout.splitlines() if ln.startswith("ERR"))
    assert err["ERR1"] == ("cuMemGetHandleForAddressRange(DMA_BUF_FD) failed: operation not supported (CUresult 801)"
                           " (dma-buf export needs CUDA 11.7+, Linux 5.12+ and NVIDIA's open GPU kernel modules)"), err
    assert err["ERR2"].startswith("cannot load libmissing-cuda.so.1 (no CUDA driver?): "), err


# ---------------------------------------------------------------- ABI declarations vs. the system header

# Our declarations (csrc/proxy/verbs_abi.h) against the system header, compiled: per struct, the
# system struct, how the sizes compare ("==", ">=": port_attr may be larger, the driver writes more
# than older headers declare; "": a prefix we only read through pointers), and the fields whose
# offsets must be equal ("ours", or "ours=theirs" where the names differ).
_ABI_STRUCTS = {
    "gid": ("ibv_gid", "==", ""),
    "context": ("ibv_context", "==", "ops"),
    "context_ops": ("ibv_context_ops", "==", "poll_cq req_notify_cq post_send post_recv"),
    "comp_channel": ("ibv_comp_channel", "", "fd"),
    "cq": ("ibv_cq", "==", "ctx=context"),
    "qp": ("ibv_qp", "==", "ctx=context qp_num"),
    "mr": ("ibv_mr", "", "lkey rkey"),
    "port_attr": ("ibv_port_attr", ">=", "state active_mtu gid_tbl_len lid link_layer"),
    "wc": ("ibv_wc", "==", "status opcode vendor_err imm_data"),
    "sge": ("ibv_sge", "==", ""),
    "device_attr": ("ibv_device_attr", "==", "max_qp max_cqe max_ah phys_port_cnt"),
    "send_wr": ("ibv_send_wr", "==", "sg_list num_sge opcode send_flags imm_data wr.rdma.remote_addr wr.rdma.rkey"),
    "recv_wr": ("ibv_recv_wr", "==", ""),
    "qp_cap": ("ibv_qp_cap", "==", ""),
    "qp_init_attr": ("ibv_qp_init_attr", "==", "cap qp_type"),
    "ah_attr": ("ibv_ah_attr", "==", "dlid is_global port_num"),
    "global_route": ("ibv_global_route", "", "sgid_index hop_limit"),
    "qp_attr": ("ibv_qp_attr", "==", "path_mtu rq_psn sq_psn dest_qp_num qp_access_flags ah=ah_attr pkey_index "
                "max_rd_atomic max_dest_rd_atomic min_rnr_timer port_num timeout retry_cnt rnr_retry"),
}
_ABI_VALUES = """QPS_RESET QPS_INIT QPS_RTR QPS_RTS QPS_ERR QPT_RC PORT_ACTIVE LINK_LAYER_INFINIBAND
LINK_LAYER_ETHERNET WR_RDMA_WRITE WR_RDMA_WRITE_WITH_IMM WR_SEND SEND_SIGNALED WC_SUCCESS
WC_WR_FLUSH_ERR WC_REM_ACCESS_ERR WC_RECV WC_RECV_RDMA_WITH_IMM ACCESS_LOCAL_WRITE
ACCESS_REMOTE_WRITE ACCESS_REMOTE_READ QP_STATE QP_ACCESS_FLAGS QP_PKEY_INDEX QP_PORT QP_AV
QP_PATH_MTU QP_TIMEOUT QP_RETRY_CNT QP_RNR_RETRY QP_RQ_PSN QP_MAX_QP_RD_ATOMIC QP_MIN_RNR_TIMER
QP_SQ_PSN QP_MAX_DEST_RD_ATOMIC QP_DEST_QPN""".split()  # enum values: v::NAME == IBV_NAME


def _abi_check_source() -> str:
    """The C++ that static_asserts every size, offset and value above against <infiniband/verbs.h>."""
    out = ["#include <infiniband/verbs.h>", "#include <cstddef>", "#include <type_traits>", '#include "verbs_abi.h"',
           "namespace v = moe_ep::ibv;"]
    for ours, (theirs, size_op, fields) in _ABI_STRUCTS.items():
        if size_op:
            out.append(f'static_assert(sizeof(v::{ours}) {size_op} sizeof({theirs}), "{ours}");')
        for f in fields.split():
            a, _, b = f.partition("=")
            out.append(f'static_assert(offsetof(v::{ours}, {a}) == offsetof({theirs}, {b or a}), "{ours}.{a}");')
    out += [f'static_assert(int(v::{n}) == int(IBV_{n}), "{n}");' for n in _ABI_VALUES]
    # the optional dma-buf registration: the signature Api::reg_dmabuf_mr assumes (rdma-core 34+)
    out.append("static_assert(std::is_same<decltype(&ibv_reg_dmabuf_mr), "
               'ibv_mr* (*)(ibv_pd*, uint64_t, size_t, uint64_t, int, int)>::value, "ibv_reg_dmabuf_mr");')
    out.append("int main() { return 0; }")
    return "\n".join(out) + "\n"


def _system_header():
    r = subprocess.run([os.environ.get("CXX", "c++"), "-x", "c++", "-fsyntax-only", "-"],
                       input="#include <infiniband/verbs.h>\n", capture_output=True, text=True)
    return r.returncode == 0


@pytest.mark.rdma
@pytest.mark.skipif(not _system_header(), reason="infiniband/verbs.h (rdma-core headers) not installed")
def test_abi_declarations_match_system_header(tmp_path):
    assert_compiles(tmp_path, "abi_check.cc", _abi_check_source(), SRC)


# ---------------------------------------------------------------- on a verbs device

@rdma_test
def test_verbs_probe_names_device():
    assert WHY.startswith("device ") and " port " in WHY and "GID index" in WHY


@rdma_test
def test_verbs_write_and_imm_both_directions():
    a, b, bufs = _pair()
    try:
        assert a.endpoint.startswith("verbs1;rank=0;world=2;nics=1;dev=") and ";mr=" in a.endpoint
        _exchange(a, b, bufs, {0: _plan(1, 100), 1: _plan(2, 100)})
        # zero-byte writes at the very end of the region still carry their immediate
        for _ in range(5):
            a.post_write(1, bufs[0][2], REGION, bufs[1][3], REGION, 0, imm=0x7FFF_FFFF)
        a.wait_completions(5, 30)
        b.imm.wait(0x7FFF_FFFF, 5, 30)
        assert b.imm.value(0x7FFF_FFFF) == 0
    finally:
        a.close()
        b.close()


@rdma_test
def test_verbs_bad_remote_range_and_local_errors():
    a, b, bufs = _pair()
    try:
        src_key, dst_key = bufs[0][2], bufs[1][3]
        a.post_write(1, src_key, 0, 99, 0, 100, imm=43)  # key the peer never advertised
        a.post_write(1, src_key, 0, dst_key, REGION - 10, 100, imm=43)  # past the peer's region
        comps = a.wait_completions(2, 30, check=False)
        assert [c.status for c in comps] == [transports.CQ_REMOTE_ACCESS] * 2
        assert b.imm.value(43) == 0 and a.peer_error(1) == ""
        with pytest.raises(library.NativeError, match="rank 0.*peer 1.*local key"):
            a.post_write(1, 77, 0, dst_key, 0, 10)
        with pytest.raises(library.NativeError, match="bad peer"):
            a.post_write(0, src_key, 0, dst_key, 0, 10)
        bufs[0][0][:4096] = 7
        _send(a, 1, src_key, dst_key, [(0, 4096, 44)])  # the queue pair is still healthy
        b.imm.wait(44, 1, 30)
        assert (bufs[1][1][:4096] == 7).all()
    finally:
        a.close()
        b.close()


@rdma_test
@pytest.mark.parametrize("how", ["destroy_qp", "close"])
def test_verbs_destroyed_peer_qp_errors_within_deadline(how):
    a, b, bufs = _pair()
    try:
        _send(a, 1, bufs[0][2], bufs[1][3], [(0, 1000, 5)])
        b.imm.wait(5, 1, 30)
        errs: list = []
        w = threading.Thread(target=lambda: catch(lambda: a.imm.wait(6, 1, 60), errs))
        w.start()
        hooks.destroy_qp(b, 0) if how == "destroy_qp" else b.close()
        t0 = time.monotonic()
        a.post_write(1, bufs[0][2], 0, bufs[1][3], 0, 1000, imm=6)
        (c,) = a.wait_completions(1, 60, check=False)
        dt = time.monotonic() - t0
        assert c.status == transports.CQ_PEER_LOST and c.peer == 1
        msg = a.peer_error(1)
        dev = WHY.split()[1]
        assert msg.startswith("rank 0: connection with peer 1 lost") and f"device {dev}" in msg, msg
        assert "failed: " in msg and "wc status" in msg, msg  # the verbs status string and number
        w.join(30)
        assert len(errs) == 1 and isinstance(errs[0], library.PeerLostError) and errs[0].peer == 1
        assert dt < 30, dt
        a.post_write(1, bufs[0][2], 0, bufs[1][3], 0, 10)  # later writes fail at once
        (c,) = a.wait_completions(1, 5, check=False)
        assert c.status == transports.CQ_PEER_LOST
    finally:
        a.close()
        b.close()


@rdma_test
def test_verbs_silent_dead_peer_lost_by_keepalive():
    """A peer whose queue pair is gone while this rank writes nothing to it (a survivor waiting
    for a killed rank's rows): RC tells nothing until a write, so the completion thread's
    keepalive write is what fails, and the wait ends with PeerLostError long before its deadline."""
    a, b, bufs = _pair()
    try:
        _send(b, 0, bufs[1][2], bufs[0][3], [(0, 100, 5)])
        a.imm.wait(5, 1, 30)
        hooks.destroy_qp(b, 0)  # no goodbye, no write from a after this
        t0 = time.monotonic()
        with pytest.raises(library.PeerLostError) as ei:
            a.imm.wait(6, 1, 120)
        dt = time.monotonic() - t0
        assert ei.value.peer == 1 and dt < 30, (dt, str(ei.value))
        assert "keepalive write failed" in a.peer_error(1), a.peer_error(1)
    finally:
        a.close()
        b.close()


@rdma_test
def test_verbs_peer_never_connects():
    a, b, _ = _pair(connect=False)
    try:
        t0 = time.monotonic()
        with pytest.raises(errors.CommTimeoutError) as ei:
            a.connect([a.endpoint, b.endpoint], timeout_s=2.0)  # b never calls connect
        assert ei.value.peer == 1 and ei.value.phase == "connect"
        assert time.monotonic() - t0 < 15
        msg = str(ei.value)
        assert "rank 0: connect: peer 1 never connected within 2" in msg and f"device {WHY.split()[1]}" in msg, msg
        # the hello's retries ran out (the peer's queue pair never left INIT), the queue pair was
        # reset and the hello sent again, until the deadline
        attempts = int(msg.split("(attempt ")[1].split(")")[0])
        assert attempts >= 2, msg
    finally:
        a.close()
        b.close()


@rdma_test
def test_verbs_late_peer_and_cut():
    """A peer connecting seconds later (the first hellos exhaust their retries, the queue pair is
    reset and the hello resent); then a cut by fault injection fails the writes on both sides."""
    a, b, bufs = _pair(connect=False)
    try:
        _connect_all([a, b], delays=[0.0, 3.0])
        bufs[1][0][:100] = 3
        _send(b, 0, bufs[1][2], bufs[0][3], [(0, 100, 8)])
        a.imm.wait(8, 1, 30)
        assert (bufs[0][1][:100] == 3).all()
        hooks.set_fault(a, cut_peer=1, cut_after=2)
        _send(a, 1, bufs[0][2], bufs[1][3], [(0, 10, 9), (10, 10, 9)])
        b.imm.wait(9, 2, 30)
        a.post_write(1, bufs[0][2], 0, bufs[1][3], 0, 10, imm=9)
        with pytest.raises(library.PeerLostError, match="rank 0: connection with peer 1 lost.*cut by fault injection"):
            a.wait_completions(1, 30)
        # the peer finds out at its next write (RC has no keepalive)
        b.post_write(0, bufs[1][2], 0, bufs[0][3], 0, 10, imm=10)
        (c,) = b.wait_completions(1, 60, check=False)
        assert c.status == transports.CQ_PEER_LOST and "rank 1: connection with peer 0 lost" in b.peer_error(0)
    finally:
        a.close()
        b.close()


@rdma_test
def test_verbs_hello_of_another_job_refused():
    """Engines of two jobs (different secrets) on one device: each refuses the other's hello, with
    one line naming the queue pair and what was wrong (never the secret), so neither connects:
    both time out, naming the refusal."""
    ids = [identity.JobIdentity(bytes([7]) * 16, 42), identity.JobIdentity(bytes([8]) * 16, 42)]
    a, b = transports.VerbsTransport(0, 2, identity=ids[0]), transports.VerbsTransport(1, 2, identity=ids[1])
    try:
        for e in (a, b):
            e.register(np.zeros(4096, np.uint8))
        eps, errs = [a.endpoint, b.endpoint], []
        ts = [threading.Thread(target=catch, args=(lambda e=e: e.connect(eps, 3.0), errs)) for e in (a, b)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        assert len(errs) == 2 and all(isinstance(x, errors.CommTimeoutError) for x in errs), errs
        for x in errs:
            assert "the peer's hello: refused: the job secret does not match" in str(x), x
        for e, other in ((a, 1), (b, 0)):
            ref = e.refused()
            assert ref.total >= 1 and f"refused the hello on the queue pair of peer {other}" in ref.recent[0], ref
            assert all(i.secret.hex() not in line for line in ref.recent for i in ids)
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------- several NICs (one device opened k times)

def _dev():
    return WHY.split()[1]


@rdma_test
@pytest.mark.parametrize("nics,min_shard", [(2, 1), (3, 1), (2, None)], ids=["2nics", "3nics", "2nics-16k"])
def test_verbs_several_nics_integrity_and_counts(nics, min_shard):
    """The device opened k times as k NICs: every write is cut into k byte shards, one per NIC,
    each with the write's immediate (empty shards included), so the receiver counts exactly k
    per write; both directions at once, byte for byte, writes without immediate not counted."""
    dev = _dev()
    a, b, bufs = _pair(device=",".join([dev] * nics))
    try:
        assert a.nics == b.nics == a.imm_per_write == nics
        f = _ep_fields(a.endpoint)
        assert f["nics"] == str(nics) and f["dev"] == "/".join([dev] * nics)
        assert all(len(q.split("/")) == nics for q in f["qpn"].split(","))
        assert all(len(m.split(":")[2].split("/")) == nics for m in f["mr"].split(","))
        if min_shard:
            for e in (a, b):
                e.set_min_shard_bytes(min_shard)
        _exchange(a, b, bufs, {0: _plan(31, 60), 1: _plan(32, 60)})  # counts: nics per write
        # a 0-byte write: k empty shards, k immediates; a small one: 1 shard with bytes and k - 1 empty
        a.post_write(1, bufs[0][2], 0, bufs[1][3], REGION, 0, imm=0x7100)
        a.post_write(1, bufs[0][2], 0, bufs[1][3], 0, 3, imm=0x7101)
        a.wait_completions(2, 30)
        b.imm.wait(0x7100, nics, 30)
        b.imm.wait(0x7101, nics, 30)
        assert b.imm.value(0x7100) == b.imm.value(0x7101) == 0 and a.peer_error(1) == ""
    finally:
        a.close()
        b.close()


@rdma_test
def test_verbs_nic_count_mismatch_refused():
    """Ranks that open different numbers of NICs are refused at connect, on both sides, naming
    both counts (a receiver would wait for the wrong number of shards)."""
    dev = _dev()
    a, b = transports.VerbsTransport(0, 2, device=f"{dev},{dev}"), transports.VerbsTransport(1, 2, device=dev)
    try:
        eps = [a.endpoint, b.endpoint]
        errs: dict = {}

        def run(e):
            try:
                e.connect(eps, 10)
            except library.NativeError as ex:
                errs[e.rank] = str(ex)

        ts = [threading.Thread(target=run, args=(e,)) for e in (a, b)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        assert "rank 0: connect: peer 1 opened 1 NICs" in errs[0] and "this rank 2" in errs[0], errs
        assert "rank 1: connect: peer 0 opened 2 NICs" in errs[1] and "this rank 1" in errs[1], errs
        assert "same number of NICs" in errs[0] and "MOE_EP_IB_NICS" in errs[1]
    finally:
        a.close()
        b.close()


@rdma_test
def test_verbs_nic_lists_and_counts(monkeypatch):
    """NIC lists and counts: the probe of a list, MOE_EP_IB_DEVICE with a device three times,
    and the errors of a count the list or the machine cannot give, or a name not there."""
    dev = _dev()
    ok, what = probes.verbs_probe(f"{dev},{dev}:1")
    assert ok and what.startswith(f"2 NICs: device {dev} port 1") and what.count("GID index") == 2, what
    verbs_devs = [d.name for d in light_import("native.nic").list_devices() if d.kind == "verbs"]
    errs = []
    for kw in ({"nics": 2}, {"device": dev, "nics": 2}, {"device": f"{dev},nosuch9"}):
        try:
            transports.VerbsTransport(0, 2, **kw).close()
            errs.append("")
        except library.NativeError as ex:
            errs.append(str(ex))
    if len(verbs_devs) == 1:  # automatic choice: distinct devices only
        assert errs[0].startswith("rank 0: verbs: NIC 1 of 2:") and "list a device twice" in errs[0], errs
    assert "2 NICs asked for (MOE_EP_IB_NICS) but 1 listed" in errs[1], errs
    assert errs[2].startswith("rank 0: verbs: NIC 1 of 2: RDMA device 'nosuch9' not found"), errs
    monkeypatch.setenv("MOE_EP_IB_DEVICE", f"{dev},{dev},{dev}")
    e = transports.VerbsTransport(0, 2)
    try:
        assert e.nics == 3 and e.endpoint.split(";")[3:5] == ["nics=3", f"dev={dev}/{dev}/{dev}"]
    finally:
        e.close()


@rdma_test
def test_verbs_gpu_memory_registration(tmp_path, monkeypatch):
    """Registration of GPU memory on a real device without a GPU: a buffer the stand-in CUDA
    driver calls device memory takes the dma-buf path (one fd for the region, asked for its
    page-aligned range, offered to every NIC; the NIC refuses a memfd, so ibv_reg_mr on the
    address takes over) and peers write into it through both NICs; with the device type forced
    and no CUDA driver, an unmapped pointer is an error naming rank, device and both failures,
    a mapped one falls back to ibv_reg_mr. Host memory stays ibv_reg_mr."""
    import ctypes

    dev, lib_path, log = _dev(), fake_cuda_lib(tmp_path), tmp_path / "cuda.log"
    a, b = transports.VerbsTransport(0, 2, device=f"{dev},{dev}"), transports.VerbsTransport(1, 2, device=f"{dev},{dev}")
    src, gpu = np.arange(1 << 16, dtype=np.int64).view(np.uint8)[: 1 << 16].copy(), np.zeros(1 << 16, np.uint8)
    monkeypatch.setenv("MOE_EP_CUDA_LIB", lib_path)
    monkeypatch.setenv("FAKE_CUDA_LOG", str(log))
    monkeypatch.setenv("FAKE_CUDA_DEVICE", f"{gpu.ctypes.data}:{gpu.nbytes}")
    ctypes.CDLL(lib_path)  # the process "uses CUDA"
    try:
        assert b.try_register(gpu) == (True, "gpu address/gpu address")  # tried, released, no key used
        ks, kd = a.register(src), b.register(gpu)
        assert a.region_how(ks) == "host/host" and b.region_how(kd) == "gpu address/gpu address"
        assert (ks, kd) == (1, 1)
        tried, call = log.read_text().splitlines()  # one dma-buf for both NICs, per registration (the try's too)
        assert tried == call
        base, size, kind, flags = map(int, call.split())
        pg = os.sysconf("SC_PAGE_SIZE")
        assert base % pg == 0 and size % pg == 0 and base <= gpu.ctypes.data and base + size >= gpu.ctypes.data + gpu.nbytes
        assert (kind, flags) == (1, 0)  # CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
        _connect_all([a, b])
        _send(a, 1, ks, kd, [(0, 1 << 16, 0x6001)])
        b.imm.wait(0x6001, 2, 30)  # two NICs: two shards
        np.testing.assert_array_equal(gpu, src)
        monkeypatch.setenv("MOE_EP_CUDA_LIB", "libmissing-cuda.so.1")
        hooks.set_memory_type("device")
        with pytest.raises(library.NativeError) as ei:
            b.register_ptr(4096, 1 << 20)  # below mmap_min_addr: never mapped
        msg = str(ei.value)
        assert msg.startswith(f"rank 1: verbs device {dev} port 1 GID index") and "(NIC 0 of 2)" in msg, msg
        assert "registering 1048576 bytes of GPU memory at 0x1000 failed: dma-buf: cannot load libmissing-cuda.so.1" in msg
        assert "; ibv_reg_mr on the GPU address: " in msg and msg.endswith("(needs nvidia-peermem)"), msg
        assert b.region_how(b.register(np.zeros(4096, np.uint8))) == "gpu address/gpu address"
    finally:
        hooks.set_memory_type(None)
        a.close()
        b.close()


# ---------------------------------------------------------------- interop with pyverbs

def _ep_fields(ep: str) -> dict:
    return dict(f.split("=", 1) for f in ep.split(";")[1:])


@rdma_test
def test_verbs_interop_with_pyverbs_peer():
    """An independent verbs client (pyverbs, rdma-core's own bindings) as rank 1: its hello with a
    wrong secret is refused, the right one (the layout of docs/ARCHITECTURE.md §9, packed by the
    test) accepted; it gets our hello, writes with immediates into memory our engine registered
    (counted by our ImmCounter), and receives our writes with immediates on its own queue pair."""
    pv = pytest.importorskip("pyverbs.device", reason="pyverbs (python3-pyverbs) not importable")
    import ipaddress
    import socket

    import pyverbs.enums as E
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, RecvWR, SendWR

    import proxy_wire as W

    ident = identity.JobIdentity(bytes(range(100, 116)), 77)
    e = transports.VerbsTransport(0, 2, identity=ident)
    src, dst = np.zeros(1 << 16, np.uint8), np.zeros(1 << 16, np.uint8)
    ks, kd = e.register(src), e.register(dst)
    mine = _ep_fields(e.endpoint)
    dev, port, gidx = WHY.split()[1], 1, int(WHY.split("GID index ")[1].split()[0])
    ctx = pv.Context(name=dev)
    pd = PD(ctx)
    cq = CQ(ctx, 256)
    qp = QP(pd, QPInitAttr(qp_type=E.IBV_QPT_RC, scq=cq, rcq=cq,
                           cap=QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=1, max_recv_sge=1)))
    size = 1 << 16
    mr = MR(pd, size, E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE)
    my_gid = ctx.query_gid(port, gidx)
    psn = 4242
    theirs = (f"verbs1;rank=1;world=2;dev={dev};port={port};lid=0;gid={ipaddress.IPv6Address(str(my_gid)).packed.hex()};"
              f"mtu={ctx.query_port(port).active_mtu};psn={psn};qpn={qp.qp_num},0;mr={mr.buf}:{size}:{mr.rkey}")
    try:
        attr = QPAttr(port_num=port)
        attr.dest_qp_num = int(mine["qpn"].split(",")[1])
        attr.path_mtu = min(int(mine["mtu"]), ctx.query_port(port).active_mtu)
        attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.rq_psn = int(mine["psn"])
        attr.sq_psn = psn
        attr.timeout, attr.retry_cnt, attr.rnr_retry = 14, 6, 7
        attr.qp_access_flags = E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_WRITE
        g = mine["gid"]
        attr.ah_attr = AHAttr(port_num=port, is_global=1, dlid=0,
                              gr=GlobalRoute(dgid=GID(":".join(g[i:i + 4] for i in range(0, 32, 4))), sgid_index=gidx))
        qp.to_init(attr)
        for _ in range(8):
            qp.post_recv(RecvWR(wr_id=1, num_sge=1, sg=[SGE(mr.buf + size - 64, 64, mr.lkey)]))  # pyverbs wants an SGE
        qp.to_rts(attr)
        errs: list = []
        t = threading.Thread(target=lambda: catch(lambda: e.connect([e.endpoint, theirs], 60), errs))
        t.start()
        time.sleep(0.3)  # our queue pair reaches RTR first (else this hello is retried)
        hello_at = size - 256  # its hellos, 48 bytes each, sent from its MR
        mr.write(W.hello(1, 0, 2, 0, ident.session, bytes(16)) + W.hello(1, 0, 2, 0, ident.session, ident.secret),
                 2 * W.HELLO.size, hello_at)
        qp.post_send(SendWR(wr_id=7, opcode=E.IBV_WR_SEND, num_sge=1, sg=[SGE(mr.buf + hello_at, 48, mr.lkey)],
                            send_flags=E.IBV_SEND_SIGNALED))  # a hello with the wrong secret
        deadline = time.monotonic() + 10
        while e.refused().total == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "refused the hello on the queue pair of peer 1" in e.refused().recent[0], e.refused()
        assert "the job secret does not match" in e.refused().recent[0] and t.is_alive()
        qp.post_send(SendWR(wr_id=8, opcode=E.IBV_WR_SEND, num_sge=1, sg=[SGE(mr.buf + hello_at + 48, 48, mr.lkey)],
                            send_flags=E.IBV_SEND_SIGNALED))  # its hello

        def wait_wcs(n, timeout=60):
            got, deadline = [], time.monotonic() + timeout
            while len(got) < n and time.monotonic() < deadline:
                k, wcs = cq.poll(n - len(got))
                got += wcs[:k] if k > 0 else []
                time.sleep(0.001)
            assert len(got) == n, f"pyverbs peer: {len(got)} of {n} completions"
            assert all(w.status == E.IBV_WC_SUCCESS for w in got), [w.status for w in got]
            return got

        wcs = wait_wcs(3)  # its two hellos sent, ours received
        assert sorted(w.opcode for w in wcs) == sorted([E.IBV_WC_SEND, E.IBV_WC_SEND, E.IBV_WC_RECV])
        (ours,) = [w for w in wcs if w.opcode == E.IBV_WC_RECV]
        assert ours.byte_len == 48 and mr.read(48, size - 64) == W.hello(0, 1, 2, 0, ident.session, ident.secret)
        t.join(60)
        assert not errs and not t.is_alive(), errs
        # pyverbs -> our engine: 5 writes with immediates (network byte order on the wire)
        payload = bytes(range(256)) * 16
        mr.write(payload, len(payload))
        for i in range(5):
            wr = SendWR(wr_id=10 + i, opcode=E.IBV_WR_RDMA_WRITE_WITH_IMM, num_sge=1,
                        sg=[SGE(mr.buf + i * 512, 512, mr.lkey)], send_flags=E.IBV_SEND_SIGNALED,
                        imm_data=socket.htonl(0x4000 + i % 2))
            wr.set_wr_rdma(int(mine["mr"].split(",")[kd - 1].split(":")[2]),
                           int(mine["mr"].split(",")[kd - 1].split(":")[0]) + i * 512)
            qp.post_send(wr)
        wait_wcs(5)
        e.imm.wait(0x4000, 3, 30)
        e.imm.wait(0x4001, 2, 30)
        assert bytes(dst[:2560]) == payload[:2560] and not dst[2560:].any()
        # our engine -> pyverbs: a write with an immediate lands in its MR and its receive
        src[:1000] = 9
        e.post_write(1, ks, 0, 1, 100, 1000, imm=0x1234)
        e.wait_completions(1, 30)
        (w,) = wait_wcs(1)
        assert w.opcode == E.IBV_WC_RECV_RDMA_WITH_IMM and socket.ntohl(w.imm_data) == 0x1234
        assert mr.read(1000, 100) == b"\x09" * 1000
    finally:
        e.close()
        for o in (qp, mr, cq, pd, ctx):
            o.close()


# ---------------------------------------------------------------- the §10 proxy over verbs

@rdma_test
@pytest.mark.parametrize("cap,nics,min_shard", [(2, 1, None), (0, 1, None), (2, 2, None), (0, 3, 1)],
                         ids=["cap2", "cap0", "cap2-2nics", "cap0-3nics-sharded"])
def test_verbs_proxy_dispatch_combine_two_nodes(cap, nics, min_shard):
    """Two ranks as two nodes in one process, each with its §10 proxy on a verbs engine: three
    epochs of dispatch (round 1, and round 2 for rows over the private capacity) and combine,
    every header and row checked where §10 puts it. With k NICs (the device opened k times)
    every write is k shards (with a 1-byte minimum, rows really split over the NICs; with the
    16 KiB default, one shard and k - 1 empty ones) and each phase waits for k per source."""
    engines = [transports.VerbsTransport(r, 2, device=",".join([_dev()] * nics)) for r in range(2)]
    for e in engines:
        assert e.imm_per_write == nics
        if min_shard:
            e.set_min_shard_bytes(min_shard)
    proxy_two_nodes(proxy.Proxy, engines, cap)


@rdma_test
def test_verbs_proxy_silent_peer_over_two_nics():
    """A peer that never rings its dispatch doorbell, over 2 NICs: the waiting proxy times out
    naming it and how many of its 2 shards landed (none)."""
    R = 2
    engines = [transports.VerbsTransport(r, R, device=f"{_dev()},{_dev()}") for r in range(R)]
    pxs = [proxy.Proxy(e, node_size=1, num_local_experts=2, row_bytes=32, comb_row_bytes=16, private_capacity=2,
                   overflow_capacity=8, max_send_rows=8, timeout_s=2) for e in engines]
    try:
        _connect_all(engines)
        for px in pxs:
            px.start()
        pxs[0].ring("dispatch", 1)  # rank 1 stays silent
        with pytest.raises(errors.CommTimeoutError) as ei:
            pxs[0].wait_ready("dispatch", 1, 30)
        msg = str(ei.value)
        assert ei.value.peer == 1 and "no immediate from peer 1 within 2 s" in msg, msg
        assert "0 of its 2 shards landed" in msg, msg
    finally:
        for px in pxs:
            px.close()
        for e in engines:
            e.close()


# ---------------------------------------------------------------- two processes

def _worker(rank: int) -> None:
    e = transports.VerbsTransport(rank, 2)
    src, dst = np.zeros(REGION, np.uint8), np.zeros(REGION, np.uint8)
    ks, kd = e.register(src), e.register(dst)
    print(e.endpoint, flush=True)
    eps = json.loads(sys.stdin.readline())
    e.connect(eps, 60)
    plan, payload = _plan(20 + rank, 100)
    src[:] = payload
    _send(e, 1 - rank, ks, kd, plan, 120)
    _check_received(e, dst, *_plan(20 + 1 - rank, 100), timeout_s=120)
    print("ok", flush=True)
    sys.stdin.readline()  # both done before either closes
    e.close()


@rdma_test
def test_verbs_two_processes():
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "worker", str(r)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) for r in (0, 1)]
    try:
        eps = [p.stdout.readline().strip() for p in procs]
        assert all(ep.startswith("verbs1;") for ep in eps), (eps, [p.stderr.read() for p in procs if p.poll()])
        for p in procs:
            p.stdin.write(json.dumps(eps) + "\n")
            p.stdin.flush()
        for p in procs:
            line = p.stdout.readline().strip()
            assert line == "ok", line + (p.stderr.read() if p.poll() is not None else "")
        for p in procs:
            p.stdin.write("close\n")
            p.stdin.flush()
        for p in procs:
            assert p.wait(60) == 0, p.stderr.read()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "worker":
    _worker(int(sys.argv[2]))
