"""``python -m moe_ep.doctor``: runs anywhere (no GPU, no RDMA device, no pyverbs), prints a
report or JSON with the documented keys; RDMA parsing on a fake sysfs tree (tests/test_nic.py's
``make_sysfs``); pyverbs cross-check with a stand-in module; on a real device (``-m rdma``, e.g.
the Soft-RoCE VM) it sees rxe0, and sysfs, libibverbs and pyverbs agree.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from native_hooks import light_import
from test_nic import make_sysfs
from test_verbs_transport import AVAILABLE, ROOT, WHY, rdma_test

doctor = light_import("tools.doctor")
KEYS = {"host", "gpus", "rdma", "nic", "transport", "node_memory", "env", "deep_ep"}


def _run(*args, **env):
    return subprocess.run([sys.executable, "-m", "moe_ep.tools.doctor", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, **env})


def test_cli_text_and_json():
    r = _run()
    assert r.returncode == 0, r.stderr
    for head in ("moe_ep doctor:", "GPUs (", "RDMA devices (sysfs", "NIC per rank", "Transport: auto -> ",
                 "import deep_ep: "):
        assert head in r.stdout, r.stdout
    r = _run("--json", "--no-pyverbs")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert set(rep) == KEYS
    assert {"source", "devices"} <= set(rep["gpus"]) and {"sysfs_root", "devices"} <= set(rep["rdma"])
    assert rep["transport"]["auto"]["kind"] in ("tcp", "verbs", "efa") and rep["transport"]["auto"]["why"]
    assert rep["nic"][-1]["rank"] == "CPU"
    assert rep["deep_ep"]["active"] is False and rep["deep_ep"]["what"].startswith("inactive")  # no alias here


def test_report_says_what_is_installed():
    """The version, where moe_ep comes from and how the native library was built (its flags)."""
    h = doctor.report(use_torch=False, use_pyverbs=False)["host"]
    with open(os.path.join(ROOT, "moe_ep", "__init__.py")) as f:
        assert f'__version__ = "{h["moe_ep"]}"' in f.read()
    assert os.path.samefile(h["moe_ep_path"], os.path.join(ROOT, "moe_ep")), h["moe_ep_path"]
    n = h["native"]
    assert os.path.isfile(n["library"]), n
    assert n["build"].startswith("compiler ") and "; C++ 201703L; flags " in n["build"] and "-std=c++17" in n["build"], n
    text = doctor.render(doctor.report(use_torch=False, use_pyverbs=False))
    assert f"  native library: {n['library']}  ({n['build']})" in text.splitlines()[2]


def test_cli_reports_requested_transport_error():
    """MOE_EP_TRANSPORT=efa without libfabric: the error names the missing library (EFA runs
    through libfabric's efa provider only), and there are no efadv rows."""
    r = _run("--json", "--no-torch", "--no-pyverbs", MOE_EP_TRANSPORT="efa", MOE_EP_LIBFABRIC_LIB="libmissing-fabric.so.1")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    q = rep["transport"]["requested"]
    assert q["name"] == "efa" and "MOE_EP_TRANSPORT=efa, but no EFA device (libfabric provider efa) is usable: " \
        "cannot load libmissing-fabric.so.1" in q["error"], q
    assert rep["env"]["MOE_EP_TRANSPORT"] == "efa"
    assert rep["rdma"]["libfabric"]["error"].startswith("cannot load libmissing-fabric.so.1")
    assert "efadv" not in r.stdout and "efa_library" not in r.stdout


def test_report_on_fake_sysfs(tmp_path):
    root = make_sysfs(str(tmp_path / "sys"))
    rep = doctor.report(root, use_torch=False, use_pyverbs=False)
    assert set(rep) == KEYS and rep["rdma"]["sysfs_root"] == root
    devs = {d["name"]: d for d in rep["rdma"]["devices"]}
    assert sorted(devs) == ["efa_0", "mlx5_0", "mlx5_1", "mlx5_2", "rxe0"]
    assert devs["efa_0"]["kind"] == "efa" and devs["mlx5_0"]["pci"] == "0000:04:00.0"
    port = devs["rxe0"]["ports"][0]
    assert port["active"] and port["link_layer"] == "Ethernet" and port["default_gid_index"] == 1
    assert port["gids"][1] == {"index": 1, "address": "::ffff:127.0.0.1", "type": "RoCE v2", "ndev": "lo"}
    if not os.path.exists("/usr/bin/nvidia-smi"):
        assert rep["gpus"]["source"] == "sysfs" and [g["pci"] for g in rep["gpus"]["devices"]] == [
            "0000:03:00.0", "0000:07:00.0", "0000:41:00.0"]
        rows = {r["rank"]: r for r in rep["nic"]}
        assert rows["GPU0"]["verbs"].startswith("mlx5_0 port 1 (behind the same PCIe switch")
        assert rows["GPU2"]["verbs"].startswith("mlx5_1 port 1 (on NUMA node 1")
        assert rows["CPU"]["efa"].startswith("efa_0 port 1") and rows["CPU"]["efa_domains"] == ["efa_0-rdm"]
    text = doctor.render(rep)
    assert "efa:   efa_0 port 1 (" in text and "-> libfabric domains efa_0-rdm" in text and "efadv" not in text
    assert "GID 3   RoCE v2  ::ffff:10.0.0.1  (eth0)  <- default" in text
    assert "mlx5_2  [verbs]" in text and "port 1  DOWN" in text and "efa_0  [efa]  driver efa" in text
    json.dumps(rep)  # JSON-able


def test_libfabric_rows_say_whether_each_entry_is_used():
    """Each libfabric entry: its caps, and whether auto / MOE_EP_TRANSPORT=efa / =libfabric would
    use it and why; the report lists them (each once) next to the verbs and efa probes."""
    efa = {"provider": "efa", "fabric": "efa", "domain": "rdmap16s27-rdm", "ep_type": "FI_EP_RDM", "rma": True,
           "msg": True, "hmem": True, "mr_mode": "FI_MR_LOCAL|FI_MR_HMEM", "cq_data_size": 4, "usable": True}
    default = {"ok": True, "what": "provider tcp;ofi_rxm domain lo (mr_mode none, cq_data_size 8)"}
    assert doctor.fabric_use(efa, default, {"rdmap16s27-rdm"}).startswith("used by auto and MOE_EP_TRANSPORT=efa")
    assert "not an EFA device sysfs lists" in doctor.fabric_use(efa, default, {"rdmap99s0-rdm"})
    tcp = {**efa, "provider": "tcp;ofi_rxm", "fabric": "127.0.0.1/32", "domain": "lo", "cq_data_size": 8}
    assert doctor.fabric_use(tcp, default, set()) == ("used by MOE_EP_TRANSPORT=libfabric (its default choice); "
                                                       "not by auto (efa only)")
    assert "MOE_EP_FI_DOMAIN=eth0" in doctor.fabric_use({**tcp, "domain": "eth0"}, default, set())
    dgram = {**tcp, "provider": "udp", "ep_type": "FI_EP_DGRAM", "rma": False, "cq_data_size": 0, "usable": False}
    assert doctor.fabric_use(dgram, default, set()) == ("not used: lacks FI_EP_RDM, FI_RMA, remote CQ data of 4 "
                                                        "bytes")
    rep = doctor.report(use_torch=False, use_pyverbs=False)
    r = rep["rdma"]
    if "native_error" in r:
        pytest.skip(r["native_error"])
    assert {"verbs_probe", "efa_probe", "fabric_probe", "libfabric"} <= set(r)
    text = doctor.render(rep)
    assert "  efa (libfabric provider efa) probe: " in text and "  libfabric (default provider) probe: " in text
    if "error" not in r["libfabric"]:
        assert all("use" in e for e in r["libfabric"]["entries"])
        assert f"libfabric {r['libfabric']['library_version']} (API " in text
        if r["fabric_probe"]["ok"]:
            assert "(its default choice)" in text


def test_dmabuf_support_detection(tmp_path, monkeypatch):
    """GPU memory registration support: ibv_reg_dmabuf_mr in libibverbs, the CUDA driver's dma-buf
    export, nvidia-peermem (sysfs), and what the transport would use from them."""
    from stand_in_cuda import fake_cuda_lib

    root = make_sysfs(str(tmp_path / "sys"))
    monkeypatch.setenv("MOE_EP_IBVERBS_LIB", "libmissing-ibverbs.so.1")
    monkeypatch.setenv("MOE_EP_CUDA_LIB", "libmissing-cuda.so.1")
    d = doctor.dmabuf(root)
    assert d["ibv_reg_dmabuf_mr"]["ok"] is False and "cannot load libmissing-ibverbs.so.1" in d["ibv_reg_dmabuf_mr"]["what"]
    assert d["cuda_dmabuf_export"]["ok"] is False and "cannot load libmissing-cuda.so.1" in d["cuda_dmabuf_export"]["what"]
    assert d["nvidia_peermem"] is False and d["gpu_memory"] == "none (host memory only)"
    os.makedirs(os.path.join(root, "module", "nvidia_peermem"))
    assert doctor.dmabuf(root)["gpu_memory"] == "GPU address (nvidia-peermem)"
    lib = fake_cuda_lib(tmp_path)
    monkeypatch.setenv("MOE_EP_CUDA_LIB", lib)
    monkeypatch.setenv("MOE_EP_IBVERBS_LIB", lib)  # a library without ibv_reg_dmabuf_mr
    d = doctor.dmabuf(root)
    assert d["cuda_dmabuf_export"] == {"ok": True, "what": f"{lib} exports cuMemGetHandleForAddressRange"}
    assert d["ibv_reg_dmabuf_mr"] == {"ok": False, "what": f"{lib} has no ibv_reg_dmabuf_mr"}
    rep = doctor.report(root, use_torch=False, use_pyverbs=False)
    assert rep["rdma"]["dmabuf"]["nvidia_peermem"] is True
    assert "GPU memory registration: GPU address (nvidia-peermem)" in doctor.render(rep)


def test_parse_topo():
    text = """\tGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV18\tSYS\tPIX\t0-55\t0
GPU1\tNV18\t X \tNV18\tSYS\t0-55\t0
GPU2\tSYS\tNV18\t X \tSYS\t56-111\t1
NIC0\tPIX\tSYS\tSYS\t X
"""
    t = doctor.parse_topo(text)
    assert t == {0: {1: "NV18", 2: "SYS"}, 1: {0: "NV18", 2: "NV18"}, 2: {0: "SYS", 1: "NV18"}}


def test_cross_check_names_differences():
    sysfs = [{"name": "mlx5_0", "ports": [{"num": 1, "state": "ACTIVE", "active": True,
                                            "gids": [{"index": 0, "address": "fe80::1"}]}]},
             {"name": "only_sysfs0", "ports": []}]
    other = [{"name": "mlx5_0", "ports": [{"port": 1, "active": False,
                                            "gids": [{"index": 0, "gid": "fe80:0000:0000:0000:0000:0000:0000:0002"}]}]}]
    d = doctor.cross_check(sysfs, other, "pyverbs")
    assert d == ["only_sysfs0: only in sysfs", "mlx5_0 port 1: sysfs says ACTIVE, pyverbs not active",
                 "mlx5_0 port 1 GID 0: sysfs fe80::1, pyverbs fe80::2"]
    same = [{"name": "mlx5_0", "ports": [{"port": 1, "active": True, "gids": [{"index": 0, "gid": "fe80::1"}]}]}]
    assert doctor.cross_check(sysfs[:1], same, "libibverbs") == []


def test_pyverbs_cross_check_with_stand_in(monkeypatch, tmp_path):
    """pyverbs' calls as the doctor makes them (get_device_list, Context, query_device/port/gid)."""
    class Ctx:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def query_device(self):
            return types.SimpleNamespace(phys_port_cnt=1, fw_version=b"1.0", max_qp=64)

        def query_port(self, port):
            return types.SimpleNamespace(state=4, link_layer=2, gid_tbl_len=3)

        def query_gid(self, port, k):
            return ["fe80:0000:0000:0000:0000:0000:0000:0000", "0000:0000:0000:0000:0000:ffff:7f00:0001",
                    "0000:0000:0000:0000:0000:0000:0000:0000"][k]

    dev = types.ModuleType("pyverbs.device")
    dev.get_device_list = lambda: [types.SimpleNamespace(name=b"rxe0")]
    dev.Context = lambda name: Ctx(name)
    pkg = types.ModuleType("pyverbs")
    pkg.device = dev
    monkeypatch.setitem(sys.modules, "pyverbs", pkg)
    monkeypatch.setitem(sys.modules, "pyverbs.device", dev)
    pv, why = doctor.pyverbs_devices()
    assert why == "ok" and pv[0]["name"] == "rxe0" and [g["index"] for g in pv[0]["ports"][0]["gids"]] == [0, 1]
    root = make_sysfs(str(tmp_path / "sys"), devices=("rxe0",))
    r = doctor.rdma(root)
    assert r["pyverbs"]["available"] and r["pyverbs"]["vs_sysfs"] == []


@rdma_test
def test_doctor_sees_the_verbs_device():
    """On a machine with a verbs device (the Soft-RoCE VM: rxe0, GID 1 = ::ffff:127.0.0.1): sysfs,
    libibverbs and (where importable) pyverbs agree, and auto picks verbs."""
    rep = doctor.report(use_torch=False)
    devs = {d["name"]: d for d in rep["rdma"]["devices"]}
    assert AVAILABLE, WHY
    name = WHY.split()[1]  # "device rxe0 port 1 ..."
    assert name in devs, (WHY, list(devs))
    port = devs[name]["ports"][0]
    assert port["active"] and port["state"] == "ACTIVE"
    assert f"GID index {port['default_gid_index']}" in WHY
    if name.startswith("rxe"):
        assert port["link_layer"] == "Ethernet"
        assert {"index": 1, "type": "RoCE v2", "address": "::ffff:127.0.0.1"}.items() <= port["gids"][1].items()
    assert rep["rdma"]["verbs_probe"]["ok"], rep["rdma"]["verbs_probe"]
    assert rep["rdma"]["libibverbs_vs_sysfs"] == []
    lv = {d["name"]: d for d in rep["rdma"]["libibverbs"]["devices"]}
    assert lv[name]["max_qp"] > 0 and lv[name]["ports"][0]["active"]
    # rdma-core 34+ (Debian 12 has 44) exports the dma-buf registration; no GPU driver here
    assert rep["rdma"]["dmabuf"]["ibv_reg_dmabuf_mr"]["ok"], rep["rdma"]["dmabuf"]
    pv = rep["rdma"]["pyverbs"]
    if pv["available"]:
        assert pv["vs_sysfs"] == [], pv
    assert rep["transport"]["auto"]["kind"] in ("verbs", "efa")
    cpu = rep["nic"][-1]
    assert cpu["rank"] == "CPU" and cpu["verbs"].startswith(name)
    print(doctor.render(rep))


def test_node_memory_report(monkeypatch):
    """The doctor says which node memory a job would use: IPC whenever ranks share a GPU, and what
    MOE_EP_NODE_MEMORY forces (the text names both)."""
    from moe_ep.tools import doctor

    monkeypatch.delenv("MOE_EP_NODE_MEMORY", raising=False)
    m = doctor.node_memory(num_gpus=0, use_torch=False)
    assert m["ranks_share_gpus"] == "ipc" and m["a_gpu_per_rank"] is None and m["forced"] is None
    monkeypatch.setenv("MOE_EP_NODE_MEMORY", "ipc")
    m = doctor.node_memory(num_gpus=2, use_torch=False)
    assert m["a_gpu_per_rank"] == "ipc" and m["forced"] == "ipc"
    rep = doctor.report(use_torch=False, use_pyverbs=False)
    text = doctor.render(rep)
    assert "Node memory: a GPU per rank -> " in text and "MOE_EP_NODE_MEMORY=ipc" in text


def test_no_torch_report_loads_no_torch():
    """``moe_ep.tools.doctor --no-torch`` (and the torch-free rdma tests) must not import torch: ``import
    moe_ep`` loads its classes lazily, and the node-memory row needs no torch without it."""
    import subprocess
    import sys

    code = ("import sys; from moe_ep.tools import doctor; doctor.render(doctor.report(use_torch=False, use_pyverbs=False)); "
            "import moe_ep; assert moe_ep.__version__; print('torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "False", "torch was imported"
