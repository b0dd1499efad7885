"""efa transport (csrc/proxy/efa_transport.cc) and transport selection, without an EFA device.

What can be checked here is checked: the sources build without rdma-core headers, the ABI
declarations match the system headers where they are installed, the probe and the engine say
what is missing (library, device, capability), the start-up capability check names each missing
capability, and ``auto`` selection follows its rules (injected probes; ranks agree). The SRD data
path itself needs an EFA device. ``-m rdma``: on a non-EFA verbs device (the Soft-RoCE VM), efa
refuses it by name and auto takes verbs.
"""
from __future__ import annotations

import os
import subprocess
import types

import pytest

from test_verbs_transport import SRC, WHY, _run_py, _system_header, light_import, rdma_test

N = light_import()
CXX = os.environ.get("CXX", "c++")
RDMA_WRITE, RNR_RETRY, UNSOLICITED = N.EFA_CAPS["rdma write"], N.EFA_CAPS["rnr retry"], N.EFA_CAPS["unsolicited write recv"]


def test_efa_sources_compile_cleanly():
    for f in ("efa_transport.cc", "rdma_probe.cc"):
        r = subprocess.run([CXX, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", os.path.join(SRC, f)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def _efadv_header() -> bool:
    r = subprocess.run([CXX, "-x", "c++", "-fsyntax-only", "-"], input="#include <infiniband/efadv.h>\n",
                       capture_output=True, text=True)
    return r.returncode == 0


_ABI_CHECK = r"""
#include <infiniband/verbs.h>
#include <infiniband/efadv.h>
#include <cstddef>
#include "efa_abi.h"
namespace v = moe_ep::ibv;
namespace e = moe_ep::efadv;
#define SAME_SIZE(a, b) static_assert(sizeof(a) == sizeof(b), #a)
#define SAME_OFF(a, b, f) static_assert(offsetof(a, f) == offsetof(b, f), #a "." #f)
SAME_SIZE(v::device_attr, ibv_device_attr);
SAME_OFF(v::device_attr, ibv_device_attr, max_qp);
SAME_OFF(v::device_attr, ibv_device_attr, max_cqe);
SAME_OFF(v::device_attr, ibv_device_attr, max_ah);
SAME_OFF(v::device_attr, ibv_device_attr, phys_port_cnt);
SAME_SIZE(v::qp_init_attr_ex, ibv_qp_init_attr_ex);
SAME_OFF(v::qp_init_attr_ex, ibv_qp_init_attr_ex, cap);
SAME_OFF(v::qp_init_attr_ex, ibv_qp_init_attr_ex, qp_type);
SAME_OFF(v::qp_init_attr_ex, ibv_qp_init_attr_ex, comp_mask);
static_assert(offsetof(v::qp_init_attr_ex, pd_) == offsetof(ibv_qp_init_attr_ex, pd), "pd");
SAME_OFF(v::qp_init_attr_ex, ibv_qp_init_attr_ex, send_ops_flags);
SAME_OFF(v::qp_ex, ibv_qp_ex, wr_id);
SAME_OFF(v::qp_ex, ibv_qp_ex, wr_flags);
SAME_OFF(v::qp_ex, ibv_qp_ex, wr_rdma_write);
SAME_OFF(v::qp_ex, ibv_qp_ex, wr_rdma_write_imm);
SAME_OFF(v::qp_ex, ibv_qp_ex, wr_send_imm);
SAME_OFF(v::qp_ex, ibv_qp_ex, wr_set_ud_addr);
SAME_OFF(v::qp_ex, ibv_qp_ex, wr_set_sge);
SAME_OFF(v::qp_ex, ibv_qp_ex, wr_set_sge_list);
SAME_OFF(v::qp_ex, ibv_qp_ex, wr_start);
SAME_OFF(v::qp_ex, ibv_qp_ex, wr_complete);
SAME_OFF(v::qp_ex, ibv_qp_ex, wr_abort);
static_assert(offsetof(v::qp, qp_num) == offsetof(ibv_qp, qp_num), "qp_num");
static_assert(offsetof(v::qp_attr, qkey) == offsetof(ibv_qp_attr, qkey), "qkey");
static_assert(int(v::QPT_DRIVER) == int(IBV_QPT_DRIVER), "QPT_DRIVER");
static_assert(v::QP_INIT_ATTR_PD == IBV_QP_INIT_ATTR_PD, "PD");
static_assert(v::QP_INIT_ATTR_SEND_OPS_FLAGS == IBV_QP_INIT_ATTR_SEND_OPS_FLAGS, "SEND_OPS_FLAGS");
static_assert(v::QP_EX_WITH_RDMA_WRITE == IBV_QP_EX_WITH_RDMA_WRITE, "WRITE");
static_assert(v::QP_EX_WITH_RDMA_WRITE_WITH_IMM == IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM, "WRITE_IMM");
static_assert(v::QP_EX_WITH_SEND == IBV_QP_EX_WITH_SEND, "SEND");
static_assert(v::QP_EX_WITH_SEND_WITH_IMM == IBV_QP_EX_WITH_SEND_WITH_IMM, "SEND_IMM");
static_assert(int(v::QP_QKEY) == int(IBV_QP_QKEY), "QKEY");
static_assert(v::WC_WITH_IMM == IBV_WC_WITH_IMM, "WC_WITH_IMM");
SAME_SIZE(e::device_attr, efadv_device_attr);
SAME_OFF(e::device_attr, efadv_device_attr, max_sq_wr);
SAME_OFF(e::device_attr, efadv_device_attr, max_rq_wr);
SAME_OFF(e::device_attr, efadv_device_attr, inline_buf_size);
SAME_OFF(e::device_attr, efadv_device_attr, device_caps);
SAME_OFF(e::device_attr, efadv_device_attr, max_rdma_size);
SAME_SIZE(e::qp_init_attr, efadv_qp_init_attr);  // flags and sl were reserved bytes in older headers
SAME_OFF(e::qp_init_attr, efadv_qp_init_attr, driver_qp_type);
static_assert(e::QP_DRIVER_TYPE_SRD == EFADV_QP_DRIVER_TYPE_SRD, "SRD");
static_assert(e::CAPS_RDMA_READ == EFADV_DEVICE_ATTR_CAPS_RDMA_READ, "RDMA_READ");
static_assert(e::CAPS_RNR_RETRY == EFADV_DEVICE_ATTR_CAPS_RNR_RETRY, "RNR_RETRY");
static_assert(e::CAPS_CQ_WITH_SGID == EFADV_DEVICE_ATTR_CAPS_CQ_WITH_SGID, "CQ_WITH_SGID");
int main() { return 0; }
"""


@pytest.mark.skipif(not (_system_header() and _efadv_header()),
                    reason="infiniband/verbs.h and efadv.h (rdma-core headers) not installed")
def test_efa_abi_declarations_match_system_headers(tmp_path):
    """Layouts and values used by efa_transport.cc against rdma-core's headers (the newer efadv
    bits, RDMA write and unsolicited write receive, are newer than some headers: from the man
    page, efadv_query_device(3))."""
    src = tmp_path / "efa_abi_check.cc"
    src.write_text(_ABI_CHECK)
    r = subprocess.run([CXX, "-std=c++17", "-fsyntax-only", f"-I{SRC}", str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_capability_check_names_each_missing_one():
    ok, what = N.efa_check_caps(0)
    assert not ok and "RDMA write (EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE)" in what and "RNR retry" in what
    ok, what = N.efa_check_caps(RDMA_WRITE)
    assert not ok and "unsolicited write receive or RNR retry" in what and "RDMA write (" not in what
    ok, what = N.efa_check_caps(RNR_RETRY | UNSOLICITED | N.EFA_CAPS["rdma read"])
    assert not ok and what.startswith("RDMA write") and "RNR" not in what
    assert N.efa_check_caps(RDMA_WRITE | RNR_RETRY) == (True, "rnr retry, rdma write")
    assert N.efa_check_caps(RDMA_WRITE | UNSOLICITED) == (True, "rdma write, unsolicited write recv")


def test_probe_and_engine_say_what_is_missing():
    ok, why = N.efa_probe()
    assert not ok or why.startswith("device ")
    if not ok:
        assert why and ("EFA" in why or "libefa" in why or "libibverbs" in why), why
        with pytest.raises(N.NativeError, match="rank 0: efa"):
            N.EfaTransport(0, 2)
    r = _run_py("""
        print("PROBE", N.efa_probe())
        for make in (lambda: N.EfaTransport(0, 2), lambda: N.Engine(1, 2, transport="efa")):
            try:
                make()
            except N.NativeError as e:
                print("ERR", e)
    """, MOE_EP_EFA_LIB="libmissing-efa.so.1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    if "cannot load libibverbs" not in r.stdout and "libibverbs.so.1" not in WHY:
        assert "cannot load libmissing-efa.so.1" in lines[0], r.stdout  # libibverbs loads: libefa is named
    errs = [ln for ln in lines if ln.startswith("ERR")]
    assert len(errs) == 2 and "rank 0: efa transport not available" in errs[0] and "rank 1:" in errs[1], r.stdout
    r = _run_py("""
        print(N.efa_probe())
        try:
            N.EfaTransport(0, 2)
        except N.NativeError as e:
            print("ERR", e)
    """, MOE_EP_IBVERBS_LIB="libmissing-ibverbs.so.1")
    assert r.returncode == 0 and "libmissing-ibverbs.so.1" in r.stdout and "ERR rank 0: efa" in r.stdout, r.stdout


def test_requested_efa_names_what_is_missing(monkeypatch):
    S = light_import("internode.session")
    ok, why = N.efa_probe()
    if ok:
        pytest.skip("an EFA device is usable here")
    with pytest.raises(RuntimeError, match="MOE_EP_TRANSPORT=efa, but no EFA device is usable: "):
        S.select_transport("efa")
    monkeypatch.setenv("MOE_EP_TRANSPORT", "efa")
    with pytest.raises(RuntimeError) as e:
        S.select_transport()
    assert why in str(e.value)


def _p(ok, what):
    return lambda: (ok, what)


def test_auto_selection_rules():
    S = light_import("internode.session")
    efa, verbs = _p(True, "device efa_0 port 1"), _p(True, "device mlx5_0 port 1")
    no_efa, no_verbs = _p(False, "no EFA device"), _p(False, "no RDMA device found")
    assert S.select_transport("auto", probes={"efa": efa, "verbs": verbs}) == ("efa", "auto: efa device efa_0 port 1")
    assert S.select_transport("auto", probes={"efa": no_efa, "verbs": verbs}) == (
        "verbs", "auto: verbs device mlx5_0 port 1")
    assert S.select_transport("auto", probes={"efa": no_efa, "verbs": no_verbs}) == (
        "tcp", "auto: efa not usable: no EFA device; verbs not usable: no RDMA device found")
    assert S.select_transport("verbs", probes={"efa": efa, "verbs": verbs})[0] == "verbs"
    assert S.select_transport("efa", probes={"efa": efa, "verbs": no_verbs}) == (
        "efa", "MOE_EP_TRANSPORT=efa: device efa_0 port 1")
    assert S.select_transport("tcp", probes={"efa": efa, "verbs": verbs})[0] == "tcp"
    with pytest.raises(RuntimeError, match="MOE_EP_TRANSPORT=efa, but no EFA device is usable: no EFA device"):
        S.select_transport("efa", probes={"efa": no_efa, "verbs": verbs})
    with pytest.raises(RuntimeError, match="MOE_EP_TRANSPORT=verbs, but no verbs device is usable: no RDMA"):
        S.select_transport("verbs", probes={"efa": efa, "verbs": no_verbs})


class _Group:
    """A stand-in EPGroup: all_gather_object returns the given choices of the other ranks."""

    def __init__(self, rank, others):
        self.rank, self.world_size, self.device = rank, len(others) + 1, types.SimpleNamespace(type="cpu", index=None)
        self._others = others

    def all_gather_object(self, obj):
        out = list(self._others)
        out.insert(self.rank, obj)
        return out


def test_ranks_agree_on_one_transport(monkeypatch, caplog):
    S = light_import("internode.session")
    monkeypatch.setattr(S, "efa_probe", lambda device=None: (True, "device efa_0 port 1"))
    monkeypatch.setattr(S, "verbs_probe", lambda device=None, port=0: (True, "device mlx5_0 port 1"))
    monkeypatch.delenv("MOE_EP_TRANSPORT", raising=False)
    with caplog.at_level("INFO", logger=S.__name__):
        kind, nic = S._agreed_transport(_Group(0, [("efa", "auto: efa device efa_0 port 1")]), None)
    assert kind == "efa" and isinstance(nic, S._nic.NicChoice)
    assert caplog.records and caplog.records[-1].getMessage().startswith("moe_ep proxy transport: efa (auto: efa ")
    assert "; NIC " in caplog.records[-1].getMessage()
    kind, nic = S._agreed_transport(_Group(0, [("verbs", "auto: verbs device mlx5_0 port 1")]), None)
    assert kind == "tcp" and nic is None  # one rank has only a verbs device: no common RDMA transport
    with pytest.raises(RuntimeError, match="rank 1 cannot start its transport: MOE_EP_TRANSPORT=efa, but"):
        S._agreed_transport(_Group(0, [("", "MOE_EP_TRANSPORT=efa, but no EFA device is usable: x")]), "efa")
    monkeypatch.setattr(S, "efa_probe", lambda device=None: (False, "no EFA device"))
    with pytest.raises(RuntimeError, match="MOE_EP_TRANSPORT=efa, but no EFA device is usable: no EFA device"):
        S._agreed_transport(_Group(1, [("efa", "ok")]), "efa")


@rdma_test
def test_efa_refuses_a_verbs_device_by_name():
    ok, why = N.efa_probe()
    if ok:
        pytest.skip("this machine has an EFA device")
    assert N.verbs_probe()[0], WHY
    name = WHY.split()[1]
    assert f"{name} is not an EFA device" in why or "libefa" in why, why
    with pytest.raises(N.NativeError, match=f"rank 0: efa.*{name}"):
        N.EfaTransport(0, 2, device=name)
    S = light_import("internode.session")
    assert S.select_transport("auto")[0] == "verbs"
