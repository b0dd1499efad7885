"""libfabric transport (csrc/proxy/fabric_transport.cc) on CPU over loopback: engines in this
process and in a second process, over both ``tcp;ofi_rxm`` and ``udp;ofi_rxd`` (the latter
delivers out of order on its own), with the mr_mode bits EFA needs forced on; the §10 proxy
exchange over it; the ABI declarations checked against libfabric's headers.

Needs libfabric.so.1 (Debian: libfabric1; the ABI check: libfabric-dev); skipped with the reason
elsewhere. Like tests/test_verbs_transport.py these drive the native library through ctypes
without importing torch. EPBuffer end to end over libfabric: tests/test_fabric_epbuffer.py.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from engine_cases import (CLEAN_GOODBYE, GroupStandIn, assert_compiles, catch, connect_all as _connect_all,
                          goodbye_names_the_cause, proxy_two_nodes, registered_pair, wait_lost)
from native_hooks import light_import
from test_verbs_transport import (REGION, SRC, _check_received, _exchange, _plan, _send, errors, identity, library,
                                  probes, proxy, transports)

HERE = os.path.dirname(os.path.abspath(__file__))
nic = light_import("native.nic")
PROVIDERS = ["tcp;ofi_rxm", "udp;ofi_rxd"]
PROBES = {p: probes.fabric_probe(p, "lo") for p in PROVIDERS}
M = transports.FI_MR
# What each provider is run with besides its own mr_mode: descriptors, provider keys, allocated
# memory, endpoint-bound regions; virtual addresses on udp (rxd honours them; rxm's tcp domain
# keeps offset addressing, so tcp runs the offset path).
FORCED = {"tcp;ofi_rxm": M["local"] | M["prov_key"] | M["allocated"] | M["endpoint"] | M["hmem"],
          "udp;ofi_rxd": M["local"] | M["prov_key"] | M["allocated"] | M["endpoint"] | M["hmem"] | M["virt_addr"]}


def provider_params():
    return [pytest.param(p, marks=pytest.mark.skipif(not PROBES[p][0], reason=f"libfabric {p}: {PROBES[p][1]}"))
            for p in PROVIDERS]


def _engine(rank, world, prov, force=True, **kw):
    return transports.FabricTransport(rank, world, prov, "lo", force_mr_mode=FORCED[prov] if force else 0, **kw)


def _pair(prov, connect=True, force=True, **kw):
    return registered_pair(_engine(0, 2, prov, force, **kw), _engine(1, 2, prov, force, **kw), REGION, connect)


def _fields(ep: str) -> dict:
    return dict(f.split("=", 1) for f in ep.split(";")[1:])


# ---------------------------------------------------------------- CPU, no provider needed

_ABI_CHECK = r"""
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_errno.h>
#include <cstddef>
#include "fabric_abi.h"
namespace f = moe_ep::fi;
#define SAME(T, U) static_assert(sizeof(T) == sizeof(U), #T)
#define AT(T, m, U, n) static_assert(offsetof(T, m) == offsetof(U, n), #T "." #m)
#define EQ(a, b) static_assert((long long)(a) == (long long)(b), #a)
SAME(f::fid, fid); AT(f::fid, ops, fid, ops);
AT(f::fid_ops, close, fi_ops, close); AT(f::fid_ops, bind, fi_ops, bind); AT(f::fid_ops, control, fi_ops, control);
SAME(f::tx_attr, fi_tx_attr); AT(f::tx_attr, rma_iov_limit, fi_tx_attr, rma_iov_limit);
SAME(f::rx_attr, fi_rx_attr); AT(f::rx_attr, iov_limit, fi_rx_attr, iov_limit);
SAME(f::ep_attr, fi_ep_attr); AT(f::ep_attr, max_msg_size, fi_ep_attr, max_msg_size); AT(f::ep_attr, auth_key, fi_ep_attr, auth_key);
SAME(f::domain_attr, fi_domain_attr); AT(f::domain_attr, name, fi_domain_attr, name);
AT(f::domain_attr, threading_, fi_domain_attr, threading); AT(f::domain_attr, data_progress, fi_domain_attr, data_progress);
AT(f::domain_attr, av_type_, fi_domain_attr, av_type); AT(f::domain_attr, mr_mode, fi_domain_attr, mr_mode);
AT(f::domain_attr, cq_data_size, fi_domain_attr, cq_data_size); AT(f::domain_attr, caps, fi_domain_attr, caps);
AT(f::domain_attr, mr_cnt, fi_domain_attr, mr_cnt); AT(f::domain_attr, tclass, fi_domain_attr, tclass);
SAME(f::fabric_attr, fi_fabric_attr); AT(f::fabric_attr, prov_name, fi_fabric_attr, prov_name);
AT(f::fabric_attr, api_version, fi_fabric_attr, api_version);
SAME(f::info, fi_info); AT(f::info, caps, fi_info, caps); AT(f::info, mode, fi_info, mode);
AT(f::info, tx, fi_info, tx_attr); AT(f::info, rx, fi_info, rx_attr); AT(f::info, ep, fi_info, ep_attr);
AT(f::info, domain, fi_info, domain_attr); AT(f::info, fabric, fi_info, fabric_attr); AT(f::info, nic, fi_info, nic);
AT(f::ops_fabric, domain, fi_ops_fabric, domain); AT(f::fid_fabric, ops, fid_fabric, ops);
SAME(f::av_attr, fi_av_attr); AT(f::av_attr, count, fi_av_attr, count); AT(f::av_attr, flags, fi_av_attr, flags);
SAME(f::cq_attr, fi_cq_attr); AT(f::cq_attr, format, fi_cq_attr, format); AT(f::cq_attr, wait_obj_, fi_cq_attr, wait_obj);
AT(f::cq_attr, wait_set, fi_cq_attr, wait_set);
SAME(f::mr_attr, fi_mr_attr); AT(f::mr_attr, access, fi_mr_attr, access); AT(f::mr_attr, requested_key, fi_mr_attr, requested_key);
AT(f::mr_attr, iface, fi_mr_attr, iface); AT(f::mr_attr, device, fi_mr_attr, device);
AT(f::ops_domain, av_open, fi_ops_domain, av_open); AT(f::ops_domain, cq_open, fi_ops_domain, cq_open);
AT(f::ops_domain, endpoint, fi_ops_domain, endpoint); AT(f::ops_mr, regattr, fi_ops_mr, regattr);
AT(f::fid_domain, ops, fid_domain, ops); AT(f::fid_domain, mr, fid_domain, mr);
SAME(f::fid_mr, fid_mr); AT(f::fid_mr, mem_desc, fid_mr, mem_desc); AT(f::fid_mr, key, fid_mr, key);
AT(f::ops_av, insert, fi_ops_av, insert); AT(f::fid_av, ops, fid_av, ops);
AT(f::ops_cm, getname, fi_ops_cm, getname);
AT(f::ops_msg, recv, fi_ops_msg, recv); AT(f::ops_msg, send, fi_ops_msg, send);
AT(f::ops_rma, write, fi_ops_rma, write); AT(f::ops_rma, writedata, fi_ops_rma, writedata);
AT(f::ops_rma, writemsg, fi_ops_rma, writemsg); EQ(f::MORE, FI_MORE);
SAME(f::rma_iov, fi_rma_iov); AT(f::rma_iov, len, fi_rma_iov, len); AT(f::rma_iov, key, fi_rma_iov, key);
SAME(f::msg_rma, fi_msg_rma); AT(f::msg_rma, desc, fi_msg_rma, desc); AT(f::msg_rma, iov_count, fi_msg_rma, iov_count);
AT(f::msg_rma, addr, fi_msg_rma, addr); AT(f::msg_rma, rma_iov_, fi_msg_rma, rma_iov);
AT(f::msg_rma, rma_iov_count, fi_msg_rma, rma_iov_count); AT(f::msg_rma, context, fi_msg_rma, context);
AT(f::msg_rma, data, fi_msg_rma, data);
SAME(f::fid_ep, fid_ep); AT(f::fid_ep, cm, fid_ep, cm); AT(f::fid_ep, msg, fid_ep, msg); AT(f::fid_ep, rma, fid_ep, rma);
SAME(f::cq_data_entry, fi_cq_data_entry); AT(f::cq_data_entry, flags, fi_cq_data_entry, flags);
AT(f::cq_data_entry, len, fi_cq_data_entry, len); AT(f::cq_data_entry, data, fi_cq_data_entry, data);
SAME(f::cq_err_entry, fi_cq_err_entry); AT(f::cq_err_entry, err, fi_cq_err_entry, err);
AT(f::cq_err_entry, prov_errno, fi_cq_err_entry, prov_errno); AT(f::cq_err_entry, err_data, fi_cq_err_entry, err_data);
AT(f::ops_cq, read, fi_ops_cq, read); AT(f::ops_cq, readerr, fi_ops_cq, readerr); AT(f::ops_cq, strerror, fi_ops_cq, strerror);
AT(f::fid_cq, ops, fid_cq, ops);
EQ(f::MSG, FI_MSG); EQ(f::RMA, FI_RMA); EQ(f::WRITE, FI_WRITE); EQ(f::RECV, FI_RECV); EQ(f::SEND, FI_SEND);
EQ(f::TRANSMIT, FI_TRANSMIT); EQ(f::REMOTE_WRITE, FI_REMOTE_WRITE); EQ(f::REMOTE_CQ_DATA, FI_REMOTE_CQ_DATA);
EQ(f::HMEM, FI_HMEM); EQ(f::CONTEXT, FI_CONTEXT); EQ(f::CONTEXT2, FI_CONTEXT2);
EQ(f::MR_LOCAL, FI_MR_LOCAL); EQ(f::MR_VIRT_ADDR, FI_MR_VIRT_ADDR); EQ(f::MR_ALLOCATED, FI_MR_ALLOCATED);
EQ(f::MR_PROV_KEY, FI_MR_PROV_KEY); EQ(f::MR_ENDPOINT, FI_MR_ENDPOINT); EQ(f::MR_HMEM, FI_MR_HMEM);
EQ(f::MR_BASIC, FI_MR_BASIC); EQ(f::MR_SCALABLE, FI_MR_SCALABLE);
EQ(f::EP_RDM, FI_EP_RDM); EQ(f::EP_MSG, FI_EP_MSG); EQ(f::EP_DGRAM, FI_EP_DGRAM); EQ(f::AV_TABLE, FI_AV_TABLE);
EQ(f::PROGRESS_AUTO, FI_PROGRESS_AUTO); EQ(f::THREAD_SAFE, FI_THREAD_SAFE); EQ(f::CQ_FORMAT_DATA, FI_CQ_FORMAT_DATA);
EQ(f::WAIT_NONE, FI_WAIT_NONE); EQ(f::HMEM_CUDA, FI_HMEM_CUDA); EQ(f::CONTROL_ENABLE, FI_ENABLE);
EQ(f::EAGAIN_, FI_EAGAIN); EQ(f::ENODATA_, FI_ENODATA); EQ(f::ENOSYS_, FI_ENOSYS); EQ(f::EACCES_, FI_EACCES);
EQ(f::EAVAIL, FI_EAVAIL); EQ(f::version(1, 17), FI_VERSION(1, 17));
static_assert(FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION) >= FI_VERSION(1, 10), "headers of 1.10 or newer");
"""


@pytest.mark.skipif(not os.path.exists("/usr/include/rdma/fabric.h"),
                    reason="libfabric's headers (/usr/include/rdma/fabric.h, libfabric-dev) are not installed")
def test_abi_declarations_match_system_header(tmp_path):
    assert_compiles(tmp_path, "fabric_abi_check.cc", _ABI_CHECK, SRC)


def test_library_does_not_link_libfabric():
    """libfabric is opened at run time: no source includes its headers, the library has no
    dependency on it; a missing library makes creation fail naming it."""
    for name in os.listdir(SRC):
        text = open(os.path.join(SRC, name)).read()
        assert "#include <rdma/" not in text, name
    so = library.path()
    needed = subprocess.run(["readelf", "-d", so], capture_output=True, text=True).stdout
    assert "libfabric" not in needed, needed
    code = """
        from test_verbs_transport import errors, identity, library, probes, transports
        ok, why = probes.fabric_probe("tcp;ofi_rxm")
        assert not ok and "cannot load libmissing-fabric.so.1" in why, why
        try:
            transports.FabricTransport(0, 2, "tcp;ofi_rxm")
        except library.NativeError as e:
            assert "rank 0: libfabric transport not available: cannot load libmissing-fabric.so.1" in str(e), e
        else:
            raise AssertionError("created")
        assert probes.fabric_providers()["error"].startswith("cannot load libmissing-fabric.so.1")
        print("ok")
    """
    r = _run_py(code, MOE_EP_LIBFABRIC_LIB="libmissing-fabric.so.1")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def _run_py(code: str, **env) -> subprocess.CompletedProcess:
    pre = f"import sys; sys.path.insert(0, {HERE!r})\n"
    return subprocess.run([sys.executable, "-c", pre + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env}, cwd=os.path.dirname(HERE))


@pytest.mark.skipif(not any(ok for ok, _ in PROBES.values()), reason="no libfabric tcp or udp provider here")
def test_creation_errors_name_what_is_missing():
    with pytest.raises(library.NativeError, match="rank 0: libfabric transport not available: no libfabric provider "
                                            "'nosuch' offers FI_EP_RDM.*libfabric has no provider 'nosuch'"):
        transports.FabricTransport(0, 2, "nosuch")
    with pytest.raises(library.NativeError, match="on domain 'nosuch0'.*no entry on domain 'nosuch0' \\(domains: .*lo"):
        transports.FabricTransport(0, 2, "tcp;ofi_rxm", "nosuch0")
    with pytest.raises(library.NativeError, match="rank 1: libfabric: 17 endpoints asked for"):
        transports.FabricTransport(1, 2, "tcp;ofi_rxm", "lo", endpoints=17)
    with pytest.raises(library.NativeError, match="forced FI_MR_VIRT_ADDR is not honoured by rxm"):
        transports.FabricTransport(0, 2, "tcp;ofi_rxm", "lo", force_mr_mode=M["virt_addr"])
    listing = probes.fabric_providers("udp;ofi_rxd")
    lo = [e for e in listing["entries"] if e["domain"] == "lo"]
    assert lo and all(e["ep_type"] == "FI_EP_RDM" and e["rma"] and e["cq_data_size"] >= 4 and e["usable"] for e in lo)


def test_default_provider_reaches_other_hosts(monkeypatch):
    """With no provider named, the default is never a shared-memory provider: shm offers FI_HMEM
    (Debian's libfabric 1.17 lists it first with that cap, here and on the GPU machine), and was the
    default for that reason, though it connects nothing beyond its host. Named, it still opens."""
    for var in ("MOE_EP_FI_PROVIDER", "FI_PROVIDER", "MOE_EP_FI_DOMAIN"):
        monkeypatch.delenv(var, raising=False)
    hmem = [e["provider"] for e in probes.fabric_providers().get("entries", []) if e["hmem"] and e["usable"]]
    ok, what = probes.fabric_probe()
    if not ok:
        pytest.skip(f"no usable libfabric provider: {what}")
    assert not what.startswith(("provider shm", "provider sm2")), what
    if "shm" in hmem:  # the case that picked shm before
        assert probes.fabric_probe("shm")[1].startswith("provider shm")


# ---------------------------------------------------------------- engines in this process

@pytest.mark.parametrize("force", [False, True], ids=["own-mr-mode", "forced-mr-mode"])
@pytest.mark.parametrize("prov", provider_params())
def test_fabric_write_and_imm_both_directions(prov, force):
    """Both directions at once, byte for byte, exact counts (writes without an immediate not
    counted, zero-byte ones counted); forced: the mr_mode in use has the forced bits, and under
    FI_MR_VIRT_ADDR a region's advertised base is its address."""
    a, b, bufs = _pair(prov, force=force)
    try:
        d = a.describe()
        assert d["provider"] == prov and d["domain"] == "lo" and d["endpoints"] == 1
        assert d["mr_mode"] == d["provider_mr_mode"] | (FORCED[prov] if force else 0)
        f = _fields(a.endpoint)
        assert f["prov"] == prov.replace(";", "+") and f["eps"] == "1"
        bases = [int(m.split(":")[0]) for m in f["mr"].split(",")]
        if d["mr_mode"] & M["virt_addr"]:
            assert bases == [bufs[0][0].ctypes.data, bufs[0][1].ctypes.data]
        else:
            assert bases == [0, 0]
        _exchange(a, b, bufs, {0: _plan(1, 120), 1: _plan(2, 120)})
        for _ in range(5):
            a.post_write(1, bufs[0][2], REGION, bufs[1][3], REGION, 0, imm=0x7FFF_FFFF)
        a.wait_completions(5, 30)
        b.imm.wait(0x7FFF_FFFF, 5, 30)
        assert b.imm.value(0x7FFF_FFFF) == 0 and a.refused().total == 0 and b.refused().total == 0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("prov", provider_params())
def test_fabric_several_endpoints_and_count_mismatch(prov):
    """Three endpoints per rank: every write is three byte shards (a 1-byte minimum: rows really
    split), each with the immediate, so the receiver counts three per write, zero-byte writes
    too. Ranks with different endpoint counts are refused at connect, naming both."""
    a, b, bufs = _pair(prov, endpoints=3)
    try:
        assert a.imm_per_write == b.endpoints == 3 and len(_fields(a.endpoint)["addr"].split("/")) == 3
        for e in (a, b):
            e.set_min_shard_bytes(1)
        _exchange(a, b, bufs, {0: _plan(31, 60), 1: _plan(32, 60)})
        a.post_write(1, bufs[0][2], 0, bufs[1][3], REGION, 0, imm=0x7100)
        a.post_write(1, bufs[0][2], 0, bufs[1][3], 0, 3, imm=0x7101)
        a.wait_completions(2, 30)
        b.imm.wait(0x7100, 3, 30)
        b.imm.wait(0x7101, 3, 30)
        assert b.imm.value(0x7100) == b.imm.value(0x7101) == 0
    finally:
        a.close()
        b.close()
    c, d = _engine(0, 2, prov, endpoints=2), _engine(1, 2, prov)
    try:
        with pytest.raises(library.NativeError, match="rank 0: connect: peer 1 opened 1 libfabric endpoints, this rank 2"):
            c.connect([c.endpoint, d.endpoint], 5)
    finally:
        c.close()
        d.close()


def _second_domain(prov: str) -> str:
    """Another usable IPv4 domain of ``prov`` than lo (its own fabric), else lo again."""
    for e in probes.fabric_providers(prov).get("entries", []):
        if e["usable"] and e["domain"] != "lo" and "." in e["fabric"] and probes.fabric_probe(prov, e["domain"])[0]:
            return e["domain"]
    return "lo"


@pytest.mark.parametrize("prov", provider_params())
def test_fabric_endpoints_over_several_domains(prov):
    """A domain list (EFA: one domain per device near the GPU): endpoint i opens domain i % n,
    one endpoint per listed domain by default, a multiple of them when asked; a second interface
    (another fabric) when there is one. Writes shard over all of them; a count that is not a
    multiple, or a domain that does not fit, is refused naming it."""
    doms = ["lo", _second_domain(prov)]
    a, b, bufs = registered_pair(transports.FabricTransport(0, 2, prov, doms), transports.FabricTransport(1, 2, prov, ",".join(doms)),
                                 REGION)
    try:
        d = a.describe()
        assert d["domains"] == doms and d["domain"] == ",".join(doms) and d["endpoints"] == a.imm_per_write == 2
        for e in (a, b):
            e.set_min_shard_bytes(1)
        _exchange(a, b, bufs, {0: _plan(41, 60), 1: _plan(42, 60)})
    finally:
        a.close()
        b.close()
    c = transports.FabricTransport(0, 2, prov, doms, endpoints=4)
    assert c.describe()["endpoints"] == 4 and c.imm_per_write == 4
    c.close()
    with pytest.raises(library.NativeError, match="rank 0: libfabric: 3 endpoints over 2 domains: expected a multiple"):
        transports.FabricTransport(0, 2, prov, doms, endpoints=3)
    ok, why = probes.fabric_probe(prov, "lo,nosuch0")
    assert not ok and why.startswith("domain 2 of 2: ") and "'nosuch0'" in why, why
    ok, what = probes.fabric_probe(prov, ",".join(doms))
    assert ok and f"domains {','.join(doms)}" in what, what


@pytest.mark.parametrize("prov", provider_params())
def test_fabric_bad_remote_range_and_local_errors(prov):
    a, b, bufs = _pair(prov)
    try:
        src_key, dst_key = bufs[0][2], bufs[1][3]
        a.post_write(1, src_key, 0, 99, 0, 100, imm=43)  # a key the peer never advertised
        a.post_write(1, src_key, 0, dst_key, REGION - 10, 100, imm=43)  # past the peer's region
        comps = a.wait_completions(2, 30, check=False)
        assert [c.status for c in comps] == [transports.CQ_REMOTE_ACCESS] * 2
        with pytest.raises(library.NativeError, match="rank 0: post_write to peer 1: local key 77"):
            a.post_write(1, 77, 0, dst_key, 0, 10)
        with pytest.raises(library.NativeError, match="bad peer"):
            a.post_write(0, src_key, 0, dst_key, 0, 10)
        bufs[0][0][:4096] = 7
        _send(a, 1, src_key, dst_key, [(0, 4096, 44)])  # still healthy
        b.imm.wait(44, 1, 30)
        assert (bufs[1][1][:4096] == 7).all() and b.imm.value(43) == 0 and a.peer_error(1) == ""
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(not PROBES["udp;ofi_rxd"][0], reason="libfabric udp;ofi_rxd is not usable here")
def test_rxd_insert_racing_the_peers_first_packet():
    """Pairs on udp;ofi_rxd whose rank 1 connects up to 6 ms after rank 0, so rank 0's hello can land
    while rank 1 inserts rank 0's address: rxd inserts it itself on that packet, and the two
    inserts race (an insert of nothing, about 1 pair in 150 before the transport tried it again).
    Every pair connects, each hello delivered both ways (400 pairs, about 6 s). Without the second
    try, 1 pair in 150 failed with a busy core beside it (0 in 400 on an idle machine: the race
    needs the hello to land inside the insert)."""
    fails = []
    for it in range(400):
        a, b = _engine(0, 2, "udp;ofi_rxd"), _engine(1, 2, "udp;ofi_rxd")
        try:
            a.register(np.zeros(4096, np.uint8))
            b.register(np.zeros(4096, np.uint8))
            eps, errs = [a.endpoint, b.endpoint], []
            late = 0.0003 * (it % 20)
            ts = [threading.Thread(target=catch, args=(lambda: a.connect(eps, 5.0), errs)),
                  threading.Thread(target=catch, args=(lambda: (time.sleep(late), b.connect(eps, 5.0)), errs))]
            for t in ts:
                t.start()
            for t in ts:
                t.join(30)
            fails += [f"pair {it}: {e}" for e in errs]
        finally:
            a.close()
            b.close()
    assert not fails, fails[:5]


@pytest.mark.parametrize("prov", provider_params())
def test_fabric_strangers_refused_not_lost(prov):
    """Two ranks of a job connect while an engine of another job and one of an older session of
    this job (same secret) each send rank 0 a hello as its rank 1: both are refused, with a line
    naming what was wrong (never the secret), neither counts as a lost peer, the strangers time
    out naming the refusal, and the job's two ranks connect and write."""
    job = identity.JobIdentity(bytes([7]) * 16, 42)
    others = {"other job": identity.JobIdentity(bytes([8]) * 16, 42), "stale": identity.JobIdentity(bytes([7]) * 16, 41)}
    a, b = _engine(0, 2, prov, identity=job), _engine(1, 2, prov, identity=job)
    strangers = {k: _engine(1, 2, prov, identity=i) for k, i in others.items()}
    try:
        mem = [np.zeros(4096, np.uint8) for _ in range(2)]
        ka, kb = a.register(mem[0]), b.register(mem[1])
        for s in strangers.values():
            s.register(np.zeros(4096, np.uint8))
        errs: list = []
        ts = [threading.Thread(target=catch, args=(lambda s=s: s.connect([a.endpoint, s.endpoint], 3.0), errs))
              for s in strangers.values()]
        for t in ts:
            t.start()
        time.sleep(0.5)
        _connect_all([a, b])
        for t in ts:
            t.join(30)
        assert len(errs) == 2 and all(isinstance(x, errors.CommTimeoutError) and x.peer == 0 for x in errs), errs
        ref = a.refused()
        assert ref.total == 2, ref
        text = "\n".join(ref.recent)
        assert "refused a hello on libfabric" in text and "the job secret does not match" in text, text
        assert "session epoch 41 (this session: 42" in text, text
        assert all(i.secret.hex() not in text for i in [job, *others.values()])
        mem[0][:64] = 5
        _send(a, 1, ka, kb, [(0, 64, 3)])
        b.imm.wait(3, 1, 30)
        assert (mem[1][:64] == 5).all() and a.peer_error(1) == "" and b.peer_error(0) == ""
    finally:
        for e in (a, b, *strangers.values()):
            e.close()


@pytest.mark.parametrize("prov", provider_params())
def test_fabric_peer_never_connects(prov):
    a, b, _ = _pair(prov, connect=False)
    try:
        t0 = time.monotonic()
        with pytest.raises(errors.CommTimeoutError) as ei:
            a.connect([a.endpoint, b.endpoint], timeout_s=2.0)  # b never calls connect
        assert ei.value.peer == 1 and ei.value.phase == "connect" and time.monotonic() - t0 < 10
        msg = str(ei.value)
        assert "rank 0: connect: peer 1 never connected within 2" in msg and f"libfabric {prov} domain lo" in msg, msg
        assert "the peer's hello: not received" in msg, msg
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("prov", provider_params())
def test_fabric_goodbye_carries_the_cause(prov):
    """Rank 1 closes after an error naming rank 2: both others lose it at once, by its goodbye,
    hearing the cause. Rank 2 then closes cleanly: rank 0 only remembers that; the loss that
    follows (its keepalive fails or goes unanswered) names the clean goodbye."""
    es = [_engine(r, 3, prov) for r in range(3)]
    try:
        for e in es:
            e.register(np.zeros(4096, np.uint8))
            e.set_op_timeout(5.0)  # the keepalive window: a silent peer is lost within about that
        _connect_all(es)
        goodbye_names_the_cause(errors.CommTimeoutError, es, f"libfabric {prov}")
        msg = wait_lost(es[0], 2, 15.0)
        assert msg.endswith(CLEAN_GOODBYE), msg
    finally:
        for e in es:
            e.close()


# ---------------------------------------------------------------- a peer in another process

_CHILD = """
    import sys, numpy as np
    from test_verbs_transport import errors, identity, library, probes, transports, REGION, _plan
    prov, force, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    e = transports.FabricTransport(1, 2, prov, "lo", endpoints=k, force_mr_mode=force)
    src, dst = np.zeros(REGION, np.uint8), np.zeros(REGION, np.uint8)
    ks, kd = e.register(src), e.register(dst)
    print(e.endpoint, flush=True)
    e.connect([sys.stdin.readline().strip(), e.endpoint], 30)
    plan, payload = _plan(12, 80)
    src[:] = payload
    wrs = [e.post_write(0, ks, o, 4, o, s, imm=i) for o, s, i in plan]
    e.wait_completions(len(wrs), 60)
    theirs, want = _plan(11, 80)
    imms = [i for *_, i in theirs if i is not None]
    for imm in sorted(set(imms)):
        e.imm.wait(imm, imms.count(imm) * k, 60)
    end = max(o + s for o, s, _ in theirs)
    print("child ok" if (dst[:end] == want[:end]).all() else "child bad data", flush=True)
    sys.stdin.readline()  # until killed
"""


@pytest.mark.parametrize("k", [1, 2], ids=["1ep", "2eps"])
@pytest.mark.parametrize("prov", provider_params())
def test_fabric_two_processes_then_killed_peer(prov, k):
    """Rank 1 in its own process: both directions checked byte for byte with exact counts; then it
    is SIGKILLed while rank 0 writes nothing to it: rank 0's wait for its immediates ends with
    PeerLostError naming it long before the wait's deadline (the keepalive fails on tcp, goes
    unanswered on udp), and a later write to it completes as lost at once."""
    a = _engine(0, 2, prov, endpoints=k)
    a.set_op_timeout(5.0)  # the keepalive window: a silent peer is lost within about that
    # keys: 1 the source; 2 and 3 written by nobody; 4 where the child writes (_CHILD)
    src, dst, dst2 = (np.zeros(REGION, np.uint8) for _ in range(3))
    assert [a.register(src), a.register(dst), a.register(np.zeros(8, np.uint8)), a.register(dst2)] == [1, 2, 3, 4]
    child = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {HERE!r})\n" + textwrap.dedent(_CHILD),
                              prov, str(FORCED[prov]), str(k)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, cwd=os.path.dirname(HERE))
    try:
        ep = child.stdout.readline().strip()
        assert ep.startswith("fabric1;rank=1"), ep
        child.stdin.write(a.endpoint + "\n")
        child.stdin.flush()
        a.connect([a.endpoint, ep], 30)
        plan, payload = _plan(11, 80)
        src[:] = payload
        _send(a, 1, 1, 2, plan)
        _check_received(a, dst2, *_plan(12, 80))
        assert child.stdout.readline().strip() == "child ok"
        assert a.peer_error(1) == "" and dst.sum() == 0
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        t0 = time.monotonic()
        with pytest.raises(library.PeerLostError) as ei:
            a.imm.wait(0x99, 1, 60)
        dt = time.monotonic() - t0
        assert ei.value.peer == 1 and dt < 15, (dt, str(ei.value))
        assert "keepalive" in a.peer_error(1) and "rank 0: connection with peer 1 lost" in a.peer_error(1)
        a.post_write(1, 1, 0, 2, 0, 10, imm=1)
        (c,) = a.wait_completions(1, 5, check=False)
        assert c.status == transports.CQ_PEER_LOST
    finally:
        if child.poll() is None:
            child.kill()
        a.close()


_SILENT_CHILD = """
    import sys
    from test_verbs_transport import errors, identity, library, probes, transports
    e = transports.FabricTransport(2, 3, sys.argv[1], "lo", force_mr_mode=int(sys.argv[2]))
    print(e.endpoint, flush=True)
    e.connect(sys.stdin.readline().split(), 30)
    print("connected", flush=True)
    sys.stdin.readline()  # until stopped, then killed
"""


@pytest.mark.parametrize("prov", [p for p in provider_params() if p.values[0] == "udp;ofi_rxd"])
def test_fabric_liveness_is_the_op_timeout(prov):
    """Rank 2 in its own process goes silent (SIGSTOP: alive, but nothing of it runs, so rxd
    acknowledges none of the keepalives sent to it): rank 0, with an op timeout of 3 s, loses it
    within about 3 s, saying so; rank 1, with 9 s, still has it after 7 s (past the fixed 5 s
    window of before) and loses it within about 9 s. Ranks 0 and 1 keep each other. (3 s, not
    less: on a machine loaded 10-30 deep, ranks 0 and 1, healthy, missed a 1.5 s window.)"""
    a, b = _engine(0, 3, prov), _engine(1, 3, prov)
    a.set_op_timeout(3.0)
    b.set_op_timeout(9.0)
    child = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {HERE!r})\n" +
                              textwrap.dedent(_SILENT_CHILD), prov, str(FORCED[prov])], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(HERE))
    try:
        eps = [a.endpoint, b.endpoint, child.stdout.readline().strip()]
        assert eps[2].startswith("fabric1;rank=2"), eps[2]
        child.stdin.write(" ".join(eps) + "\n")
        child.stdin.flush()
        errs: list = []
        ts = [threading.Thread(target=catch, args=(lambda e=e: e.connect(eps, 30), errs)) for e in (a, b)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
        assert not errs, errs
        assert child.stdout.readline().strip() == "connected"
        time.sleep(0.5)  # keepalives delivered both ways
        assert a.peer_error(2) == b.peer_error(2) == ""
        os.kill(child.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        msg = wait_lost(a, 2, 10.0)
        dt = time.monotonic() - t0
        assert "no keepalive message reached it for 3 s, the op timeout" in msg and dt < 6.0, (dt, msg)
        time.sleep(max(0.0, 7.0 - (time.monotonic() - t0)))
        assert b.peer_error(2) == "", b.peer_error(2)
        msg = wait_lost(b, 2, 10.0)
        dt = time.monotonic() - t0
        assert "no keepalive message reached it for 9 s, the op timeout" in msg and dt < 12.0, (dt, msg)
        assert a.peer_error(1) == b.peer_error(0) == ""
    finally:
        child.kill()
        child.wait(10)
        a.close()
        b.close()


# ---------------------------------------------------------------- the §10 proxy over libfabric

@pytest.mark.parametrize("cap,eps", [(2, 1), (0, 2)], ids=["cap2", "cap0-2eps"])
@pytest.mark.parametrize("prov", provider_params())
def test_fabric_proxy_dispatch_combine_two_nodes(prov, cap, eps):
    """Two ranks as two nodes in one process, each with its §10 proxy on a libfabric engine:
    three epochs of dispatch (round 1, and round 2 for rows over the private capacity) and
    combine, every header and row checked where §10 puts it."""
    engines = [_engine(r, 2, prov, endpoints=eps) for r in range(2)]
    for e in engines:
        e.set_min_shard_bytes(1)
    proxy_two_nodes(proxy.Proxy, engines, cap)


def test_select_transport_libfabric():
    """``MOE_EP_TRANSPORT=libfabric`` is taken only when asked for, and fails naming why where no
    provider fits; ``auto`` never picks it."""
    S = light_import("internode.session")
    assert "libfabric" in S.TRANSPORTS
    yes = {"libfabric": lambda: (True, "provider tcp;ofi_rxm domain lo"), "efa": lambda: (False, "no efa"),
           "verbs": lambda: (False, "no verbs")}
    assert S.select_transport("libfabric", probes=yes) == ("libfabric", "MOE_EP_TRANSPORT=libfabric: provider tcp;ofi_rxm domain lo")
    assert S.select_transport("auto", probes=yes)[0] == "tcp"
    with pytest.raises(S.NativeError, match="MOE_EP_TRANSPORT=libfabric, but no libfabric provider is usable: nope"):
        S.select_transport("libfabric", probes={"libfabric": lambda: (False, "nope")})


# ---------------------------------------------------------------- EFA through libfabric's efa provider

def _p(ok, what):
    return lambda: (ok, what)


def test_auto_selection_rules():
    """auto: efa (libfabric, provider efa) where its probe passes, else verbs, else tcp; asking
    for one names what is missing; tcp always works (injected probes)."""
    S = light_import("internode.session")
    efa, verbs = _p(True, "provider efa domain rdmap16s27-rdm"), _p(True, "device mlx5_0 port 1")
    no_efa, no_verbs = _p(False, "libfabric has no provider 'efa'"), _p(False, "no RDMA device found")
    assert S.select_transport("auto", probes={"efa": efa, "verbs": verbs}) == (
        "efa", "auto: efa (libfabric) provider efa domain rdmap16s27-rdm")
    assert S.select_transport("auto", probes={"efa": no_efa, "verbs": verbs}) == (
        "verbs", "auto: verbs device mlx5_0 port 1")
    assert S.select_transport("auto", probes={"efa": no_efa, "verbs": no_verbs}) == (
        "tcp", "auto: efa (libfabric provider efa) not usable: libfabric has no provider 'efa'; "
               "verbs not usable: no RDMA device found")
    assert S.select_transport("verbs", probes={"efa": efa, "verbs": verbs})[0] == "verbs"
    assert S.select_transport("efa", probes={"efa": efa, "verbs": no_verbs}) == (
        "efa", "MOE_EP_TRANSPORT=efa: provider efa domain rdmap16s27-rdm")
    assert S.select_transport("tcp", probes={"efa": efa, "verbs": verbs})[0] == "tcp"
    with pytest.raises(RuntimeError, match=r"MOE_EP_TRANSPORT=efa, but no EFA device \(libfabric provider efa\) is "
                                           r"usable: libfabric has no provider 'efa'"):
        S.select_transport("efa", probes={"efa": no_efa, "verbs": verbs})
    with pytest.raises(RuntimeError, match="MOE_EP_TRANSPORT=verbs, but no verbs device is usable: no RDMA"):
        S.select_transport("verbs", probes={"efa": efa, "verbs": no_verbs})


def test_requested_efa_names_what_is_missing(monkeypatch):
    """Without an EFA device: MOE_EP_TRANSPORT=efa fails with libfabric's own reason, and an
    engine of transport "efa" (the C entry's name for libfabric with provider efa) too."""
    S = light_import("internode.session")
    ok, why = probes.fabric_probe("efa")
    if ok:
        pytest.skip("libfabric's efa provider is usable here")
    assert S.efa_probe() == (ok, why)
    with pytest.raises(RuntimeError, match=r"MOE_EP_TRANSPORT=efa, but no EFA device \(libfabric provider efa\) "
                                           r"is usable: "):
        S.select_transport("efa")
    monkeypatch.setenv("MOE_EP_TRANSPORT", "efa")
    with pytest.raises(RuntimeError) as e:
        S.select_transport()
    assert why in str(e.value)
    for make in (lambda: transports.Engine(1, 2, transport="efa"), lambda: transports.FabricTransport(1, 2, "efa")):
        with pytest.raises(library.NativeError, match="rank 1: libfabric transport not available: "):
            make()


def test_ranks_agree_on_efa_and_its_endpoints(monkeypatch, caplog):
    """Every rank takes efa or none does (tcp); each opens one endpoint per EFA device near its
    GPU, all the smallest number any rank found; its engine is FabricTransport(provider="efa")
    on those devices' domains."""
    S = light_import("internode.session")
    four = nic.NicChoice("rdmap10,rdmap11,rdmap12,rdmap13", 1, "behind the same PCIe switch as GPU x",
                         (1, 1, 1, 1), 4)
    monkeypatch.setattr(S, "choose_nics", lambda gpu_index=None: {"efa": four, "verbs": nic.NicChoice(None, None, "")})
    monkeypatch.setattr(S, "efa_probe", lambda domain=None: (True, f"provider efa domains {domain}"))
    monkeypatch.setattr(S, "verbs_probe", lambda device=None, port=0: (False, "no verbs device"))
    for k in ("MOE_EP_TRANSPORT", "MOE_EP_FI_ENDPOINTS", "MOE_EP_FI_DOMAIN"):
        monkeypatch.delenv(k, raising=False)
    ok = ("efa", "auto: efa (libfabric) provider efa domains ...")
    with caplog.at_level("INFO", logger=S.__name__):
        kind, c = S._agreed_transport(GroupStandIn(0, [[ok], [4]]), None)
    assert kind == "efa" and c.devices == four.devices
    msg = caplog.records[-1].getMessage()
    assert msg.startswith("moe_ep proxy transport: efa (auto: efa (libfabric) provider efa domains rdmap10-rdm,") and "; NIC " in msg
    kind, c = S._agreed_transport(GroupStandIn(1, [[ok], [2]]), None)
    assert kind == "efa" and c.devices == ["rdmap10", "rdmap11"] and c.nics == 2 and "a rank found only 2" in c.reason
    kind, c = S._agreed_transport(GroupStandIn(0, [[("verbs", "auto: verbs device mlx5_0 port 1")]]), None)
    assert kind == "tcp" and c is None  # one rank has only a verbs device: no common RDMA transport
    with pytest.raises(RuntimeError, match="rank 1 cannot start its transport: MOE_EP_TRANSPORT=efa, but"):
        S._agreed_transport(GroupStandIn(0, [[("", "MOE_EP_TRANSPORT=efa, but no EFA device is usable: x")]]), "efa")
    monkeypatch.setattr(S, "efa_probe", lambda domain=None: (False, "libfabric has no provider 'efa'"))
    with pytest.raises(RuntimeError, match="MOE_EP_TRANSPORT=efa, but no EFA device .* libfabric has no provider"):
        S._agreed_transport(GroupStandIn(1, [[("efa", "ok")]]), "efa")
    made = []
    monkeypatch.setattr(S, "FabricTransport", lambda *a, **kw: made.append((a, kw)) or "engine")
    assert S.make_engine(GroupStandIn(0, [[None]]), "efa", four, None) == "engine"
    assert made[-1] == ((0, 2), {"provider": "efa", "domain": "rdmap10-rdm,rdmap11-rdm,rdmap12-rdm,rdmap13-rdm",
                                 "endpoints": 0, "identity": None})
    monkeypatch.setenv("MOE_EP_FI_ENDPOINTS", "8")
    S.make_engine(GroupStandIn(0, [[None]]), "efa", four, None)
    assert made[-1][1]["endpoints"] == 8
