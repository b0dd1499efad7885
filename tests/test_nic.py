"""moe_ep.native.nic: RDMA devices read from a sysfs tree, and the NIC a rank chooses.

``make_sysfs`` builds a fake ``/sys`` (the files and links ``nic`` reads) for a machine with two
host bridges: GPU0 and mlx5_0 behind one PCIe switch, GPU1 behind another switch of the same root
port's host bridge with no NIC of its own, GPU2 on NUMA node 1 with mlx5_1 (another host bridge),
an EFA device, a port that is down, and Soft-RoCE rxe0 on loopback (no PCI function).
"""
from __future__ import annotations

import os

import pytest

from engine_cases import GroupStandIn
from native_hooks import light_import

nic = light_import("native.nic")

ZERO = "0000:0000:0000:0000:0000:0000:0000:0000"
PCI = {  # name -> (path below devices/, numa node)
    "gpu0": ("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0", 0),
    "mlx5_0": ("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0", 0),
    "gpu1": ("pci0000:00/0000:00:02.0/0000:05:00.0/0000:06:00.0/0000:07:00.0", 0),
    "gpu2": ("pci0000:40/0000:40:01.0/0000:41:00.0", 1),
    "mlx5_1": ("pci0000:80/0000:80:01.0/0000:81:00.0", 1),
    "efa_0": ("pci0000:00/0000:00:03.0/0000:09:00.0", 0),
    "mlx5_2": ("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:02.0/0000:0a:00.0", 0),
}


def _w(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")


def _port(d: str, state: str, link_layer: str, gids: list[tuple[str, str, str]]) -> None:
    p = os.path.join(d, "ports", "1")
    _w(os.path.join(p, "state"), state)
    _w(os.path.join(p, "phys_state"), "5: LinkUp" if "ACTIVE" in state else "3: Disabled")
    _w(os.path.join(p, "link_layer"), link_layer)
    _w(os.path.join(p, "rate"), "400 Gb/sec (4X NDR)")
    _w(os.path.join(p, "lid"), "0x0")
    for i, (gid, typ, ndev) in enumerate(gids):
        _w(os.path.join(p, "gids", str(i)), gid)
        if gid != ZERO:
            _w(os.path.join(p, "gid_attrs", "types", str(i)), typ)
            _w(os.path.join(p, "gid_attrs", "ndevs", str(i)), ndev)


def make_sysfs(root: str, devices=("mlx5_0", "mlx5_1", "efa_0", "mlx5_2", "rxe0")) -> str:
    for name, (path, numa) in PCI.items():
        d = os.path.join(root, "devices", path)
        _w(os.path.join(d, "numa_node"), str(numa))
        is_gpu = name.startswith("gpu")
        _w(os.path.join(d, "vendor"), "0x10de" if is_gpu else "0x15b3")
        _w(os.path.join(d, "class"), "0x030200" if is_gpu else "0x020000")
        bus = os.path.join(root, "bus", "pci", "devices")
        os.makedirs(bus, exist_ok=True)
        os.symlink(os.path.relpath(d, bus), os.path.join(bus, path.rsplit("/", 1)[1]))
        if not is_gpu:
            drv = os.path.join(root, "bus", "pci", "drivers", "efa" if name.startswith("efa") else "mlx5_core")
            os.makedirs(drv, exist_ok=True)
            os.symlink(os.path.relpath(drv, d), os.path.join(d, "driver"))
    cls = os.path.join(root, "class", "infiniband")
    roce = [("fe80:0000:0000:0000:0a00:27ff:fe00:0001", "IB/RoCE v1", "eth0"),
            ("fe80:0000:0000:0000:0a00:27ff:fe00:0001", "RoCE v2", "eth0"),
            ("0000:0000:0000:0000:0000:ffff:0a00:0001", "IB/RoCE v1", "eth0"),
            ("0000:0000:0000:0000:0000:ffff:0a00:0001", "RoCE v2", "eth0"), (ZERO, "", "")]
    for name in devices:
        d = os.path.join(cls, name)
        os.makedirs(d)
        _w(os.path.join(d, "node_type"), "1: CA")
        _w(os.path.join(d, "fw_ver"), "28.39.1002")
        if name in PCI:
            os.symlink(os.path.relpath(os.path.join(root, "devices", PCI[name][0]), d), os.path.join(d, "device"))
        if name == "rxe0":
            _w(os.path.join(d, "parent"), "lo")
            _port(d, "4: ACTIVE", "Ethernet", [("fe80:0000:0000:0000:0000:0000:0000:0000", "RoCE v2", "lo"),
                                                ("0000:0000:0000:0000:0000:ffff:7f00:0001", "RoCE v2", "lo")])
        elif name == "efa_0":
            _port(d, "4: ACTIVE", "InfiniBand", [("fe80:0000:0000:0000:0488:8fff:fe12:3456", "", "")])
        elif name == "mlx5_2":
            _port(d, "1: DOWN", "Ethernet", roce)
        else:
            _port(d, "4: ACTIVE", "Ethernet", roce)
    return root


@pytest.fixture
def sysfs(tmp_path):
    return make_sysfs(str(tmp_path / "sys"))


def test_list_devices_reads_ports_gids_and_pci(sysfs):
    devs = {d.name: d for d in nic.list_devices(sysfs)}
    assert sorted(devs) == ["efa_0", "mlx5_0", "mlx5_1", "mlx5_2", "rxe0"]
    m = devs["mlx5_0"]
    assert m.driver == "mlx5_core" and m.kind == "verbs" and m.numa_node == 0 and m.fw_ver == "28.39.1002"
    assert m.pci == "0000:04:00.0"
    assert m.pci_path == ("pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:02:01.0", "0000:04:00.0")
    p = m.ports[0]
    assert (p.num, p.state, p.phys_state, p.link_layer, p.active) == (1, "ACTIVE", "LinkUp", "Ethernet", True)
    assert [(g.index, g.type, g.address, g.ndev) for g in p.gids] == [
        (0, "RoCE v1", "fe80::a00:27ff:fe00:1", "eth0"), (1, "RoCE v2", "fe80::a00:27ff:fe00:1", "eth0"),
        (2, "RoCE v1", "::ffff:10.0.0.1", "eth0"), (3, "RoCE v2", "::ffff:10.0.0.1", "eth0")]  # empty entry 4 skipped
    assert p.default_gid_index() == 3  # IPv4-mapped RoCE v2
    assert devs["mlx5_2"].active_port() is None and devs["mlx5_2"].ports[0].state == "DOWN"
    e = devs["efa_0"]
    assert e.is_efa and e.kind == "efa" and e.driver == "efa"
    assert e.ports[0].gids[0].type == "IB" and e.ports[0].default_gid_index() == 0
    r = devs["rxe0"]
    assert (r.pci, r.pci_path, r.numa_node, r.parent, r.driver) == ("", (), -1, "lo", "")
    assert r.ports[0].default_gid_index() == 1  # ::ffff:127.0.0.1, as the rdma VM says
    j = r.to_json()
    assert j["kind"] == "verbs" and j["ports"][0]["active"] and j["ports"][0]["default_gid_index"] == 1


def test_default_gid_without_ipv4_mapped_takes_first_v2():
    p = nic.Port(1, "ACTIVE", link_layer="Ethernet", gids=[nic.Gid(0, "fe80::1", "RoCE v1"), nic.Gid(1, "fe80::1", "RoCE v2")])
    assert p.default_gid_index() == 1
    assert nic.Port(1, "ACTIVE", link_layer="Ethernet", gids=[nic.Gid(0, "fe80::1", "RoCE v1")]).default_gid_index() is None
    assert nic.Port(1, "ACTIVE").default_gid_index() is None


def test_missing_sysfs_is_empty(tmp_path):
    assert nic.list_devices(str(tmp_path)) == [] and nic.list_gpus_sysfs(str(tmp_path)) == []
    assert nic.gpu_pci("0000:17:00.0", str(tmp_path)) == nic.GpuPci("0000:17:00.0")


def test_gpus_from_sysfs_and_bdf_forms(sysfs):
    assert [g.pci for g in nic.list_gpus_sysfs(sysfs)] == ["0000:03:00.0", "0000:07:00.0", "0000:41:00.0"]
    assert nic.normalize_bdf("00000000:03:00.0") == nic.normalize_bdf("03:00.0") == "0000:03:00.0"
    g = nic.gpu_pci("00000000:41:00.0", sysfs)
    assert g.numa_node == 1 and g.pci_path == ("pci0000:40", "0000:40:01.0", "0000:41:00.0")


@pytest.mark.parametrize("gpu, want, why", [
    ("0000:03:00.0", "mlx5_0", "behind the same PCIe switch"),  # mlx5_2 shares the switch too, but its port is down
    ("0000:07:00.0", "mlx5_0", "on NUMA node 0"),  # same host bridge, other root port: NUMA tier
    ("0000:41:00.0", "mlx5_1", "on NUMA node 1"),
])
def test_gpu_takes_nearest_nic(sysfs, gpu, want, why):
    c = nic.choose_nic(nic.list_devices(sysfs), "verbs", nic.gpu_pci(gpu, sysfs), env={})
    assert (c.device, c.port) == (want, 1) and why in c.reason, c


def test_switch_beats_numa_and_ties_spread_by_gpu_index(sysfs):
    devs = nic.list_devices(sysfs)
    twin = [d for d in devs if d.name == "mlx5_0"][0]
    other = nic.RdmaDevice(**{**twin.__dict__, "name": "mlx5_9", "ports": twin.ports})
    gpu = nic.gpu_pci("0000:03:00.0", sysfs)
    picks = {nic.choose_nic([*devs, other], "verbs", gpu, i, env={}).device for i in range(4)}
    assert picks == {"mlx5_0", "mlx5_9"}  # two equally near NICs: GPUs alternate
    assert "2 equally near" in nic.choose_nic([*devs, other], "verbs", gpu, 1, env={}).reason
    # nothing near at all: any active device
    far = nic.choose_nic([d for d in devs if d.name == "rxe0"], "verbs", gpu, env={})
    assert far.device == "rxe0" and "any" in far.reason


def test_cpu_rank_takes_first_active_and_kinds_are_separate(sysfs):
    devs = nic.list_devices(sysfs)
    c = nic.choose_nic(devs, "verbs", env={})
    assert (c.device, c.port) == ("mlx5_0", 1) and "CPU rank" in c.reason
    assert nic.choose_nic(devs, "efa", env={}).device == "efa_0"
    assert nic.choose_nic(devs, "efa", nic.gpu_pci("0000:41:00.0", sysfs), env={}).device == "efa_0"  # the only one
    none = nic.choose_nic([d for d in devs if d.name == "mlx5_2"], "verbs", env={})
    assert none.device is None and "mlx5_2 have none" in none.reason and "native default" in str(none)


def test_env_overrides(sysfs):
    devs = nic.list_devices(sysfs)
    c = nic.choose_nic(devs, "verbs", nic.gpu_pci("0000:03:00.0", sysfs), env={"MOE_EP_IB_DEVICE": "mlx5_1"})
    assert (c.device, c.port, c.reason) == ("mlx5_1", 1, "MOE_EP_IB_DEVICE")
    c = nic.choose_nic(devs, "verbs", env={"MOE_EP_IB_DEVICE": "nosuch0", "MOE_EP_IB_PORT": "2"})
    assert (c.device, c.port) == ("nosuch0", 2)  # the native side reports a device that does not exist


def test_sysfs_root_from_env(sysfs, monkeypatch):
    monkeypatch.setenv("MOE_EP_SYSFS_ROOT", sysfs)
    assert nic.sysfs_root() == sysfs and len(nic.list_devices()) == 5


def test_several_nics_nearest_first(sysfs):
    """MOE_EP_IB_NICS=k: the k nearest devices in the order of the single choice (switch > NUMA >
    any, ties rotated by GPU index); a CPU rank the first k; fewer usable than asked: all, said."""
    devs = nic.list_devices(sysfs)
    gpu0 = nic.gpu_pci("0000:03:00.0", sysfs)
    c = nic.choose_nic(devs, "verbs", gpu0, env={"MOE_EP_IB_NICS": "2"})
    assert c.devices == ["mlx5_0", "mlx5_1"] and c.ports == (1, 1) and c.nics == 2, c
    assert c.spec == "mlx5_0:1,mlx5_1:1" and "behind the same PCIe switch" in c.reason and "2 NICs" in c.reason
    assert str(c).startswith("mlx5_0 port 1, mlx5_1 port 1 (")
    gpu2 = nic.gpu_pci("0000:41:00.0", sysfs)
    assert nic.choose_nic(devs, "verbs", gpu2, count=2, env={}).devices == ["mlx5_1", "mlx5_0"]  # NUMA first
    cpu = nic.choose_nic(devs, "verbs", count=3, env={})
    assert cpu.devices == ["mlx5_0", "mlx5_1", "rxe0"] and cpu.nics == 3
    short = nic.choose_nic(devs, "verbs", count=4, env={})
    assert len(short.devices) == 3 and short.nics == 4 and "only 3 usable" in short.reason
    # a single NIC is the choice it always was
    one = nic.choose_nic(devs, "verbs", gpu0, env={})
    assert (one.device, one.port, one.nics, one.spec) == ("mlx5_0", 1, 1, "mlx5_0")
    # equally near devices: each GPU index starts at another one, the rest follow
    twin = [d for d in devs if d.name == "mlx5_0"][0]
    other = nic.RdmaDevice(**{**twin.__dict__, "name": "mlx5_9", "ports": twin.ports})
    firsts = {tuple(nic.choose_nic([*devs, other], "verbs", gpu0, i, count=2, env={}).devices) for i in range(2)}
    assert firsts == {("mlx5_0", "mlx5_9"), ("mlx5_9", "mlx5_0")}


def test_several_nics_from_env(sysfs):
    devs = nic.list_devices(sysfs)
    c = nic.choose_nic(devs, "verbs", env={"MOE_EP_IB_DEVICE": "rxe0,rxe0"})
    assert c.devices == ["rxe0", "rxe0"] and c.nics == 2 and c.reason == "MOE_EP_IB_DEVICE"
    c = nic.choose_nic(devs, "verbs", env={"MOE_EP_IB_DEVICE": "mlx5_0:2,mlx5_1", "MOE_EP_IB_NICS": "1"})
    assert (c.device, c.port, c.nics) == ("mlx5_0", 2, 1)
    c = nic.choose_nic(devs, "verbs", env={"MOE_EP_IB_DEVICE": "mlx5_0:2,mlx5_1"})
    assert c.spec == "mlx5_0:2,mlx5_1:1" and c.ports == (2, 1)
    c = nic.choose_nic(devs, "verbs", env={"MOE_EP_IB_DEVICE": "mlx5_0", "MOE_EP_IB_NICS": "2"})
    assert c.nics == 2 and "lists 1, 2 NICs asked for" in c.reason  # the engine refuses it, saying so
    assert nic.nic_count({}) == 1 and nic.nic_count({"MOE_EP_IB_DEVICE": "a,b,c"}) == 3
    assert nic.nic_count({"MOE_EP_IB_DEVICE": "a,b", "MOE_EP_IB_NICS": "4"}) == 4


def test_ranks_must_open_as_many_nics(monkeypatch):
    S = light_import("internode.session")
    monkeypatch.setattr(S, "efa_probe", lambda device=None: (False, "no EFA device"))
    monkeypatch.setattr(S, "verbs_probe", lambda device=None, port=0: (True, f"device {device}"))
    monkeypatch.setattr(S, "choose_nics", lambda gpu_index=None: {
        "efa": nic.NicChoice(None, None, "none"),
        "verbs": nic.NicChoice("rxe0,rxe0", 1, "MOE_EP_IB_DEVICE", (1, 1), 2)})
    kind, c = S._agreed_transport(GroupStandIn(0, [[("verbs", "auto: verbs")], [2]]), "verbs")
    assert kind == "verbs" and c.nics == 2 and c.spec == "rxe0:1,rxe0:1"
    with pytest.raises(RuntimeError, match=r"rank 1: ranks open different numbers of NICs \(rank 0: 1, rank 1: 2\)"):
        S._agreed_transport(GroupStandIn(1, [[("verbs", "auto: verbs")], [1]]), "verbs")


def _efa(name: str, switch: str, numa: int = 0) -> "nic.RdmaDevice":
    """An EFA device with an active port behind PCIe switch ``switch`` (a p5-like layout)."""
    return nic.RdmaDevice(name=name, driver="efa", pci=f"0000:{name[-2:]}:00.0", numa_node=numa,
                          pci_path=("pci0000:00", "0000:00:01.0", switch, f"0000:{name[-2:]}:00.0"),
                          ports=[nic.Port(1, "ACTIVE")])


def test_efa_devices_near_a_gpu_become_libfabric_domains():
    """The efa transport opens every EFA device behind its GPU's PCIe switch (p5: 4 per GPU), each
    as the efa provider's domain "<device>-rdm"; MOE_EP_IB_NICS / MOE_EP_IB_DEVICE override the
    count; a CPU rank or a GPU with no EFA device behind its switch opens one."""
    devs = [_efa(f"rdmap{i}", "0000:01:00.0" if i < 14 else "0000:02:00.0") for i in range(10, 18)]
    gpu = nic.GpuPci("0000:05:00.0", ("pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:05:00.0"), 0)
    assert nic.efa_count(devs, gpu, env={}) == 4
    c = nic.choose_nic(devs, "efa", gpu, 0, env={}, count=nic.efa_count(devs, gpu, env={}))
    assert c.devices == ["rdmap10", "rdmap11", "rdmap12", "rdmap13"] and "behind the same PCIe switch" in c.reason
    assert [nic.efa_domain(d) for d in c.devices] == ["rdmap10-rdm", "rdmap11-rdm", "rdmap12-rdm", "rdmap13-rdm"]
    assert nic.efa_domain("rdmap10-rdm") == "rdmap10-rdm"
    assert nic.efa_count(devs, gpu, env={"MOE_EP_IB_NICS": "2"}) == 2
    assert nic.efa_count(devs, gpu, env={"MOE_EP_IB_DEVICE": "rdmap16"}) == 1
    assert nic.efa_count(devs, None, env={}) == 1  # CPU rank
    far = nic.GpuPci("0000:41:00.0", ("pci0000:40", "0000:40:01.0", "0000:41:00.0"), 1)
    assert nic.efa_count(devs, far, env={}) == 1
    assert nic.efa_count([d for d in devs if d.name != "rdmap10"] + [nic.RdmaDevice("mlx5_0", "mlx5_core")],
                         gpu, env={}) == 3


def test_choose_nics_gives_efa_every_device_behind_the_switch(monkeypatch):
    S = light_import("internode.session")
    devs = [_efa(f"rdmap{i}", "0000:01:00.0") for i in range(10, 14)]
    gpu = nic.GpuPci("0000:05:00.0", ("pci0000:00", "0000:00:01.0", "0000:01:00.0", "0000:05:00.0"), 0)
    monkeypatch.setattr(S._nic, "list_devices", lambda root=None: devs)
    monkeypatch.setattr(S._nic, "torch_gpu_bdf", lambda i: "0000:05:00.0")
    monkeypatch.setattr(S._nic, "gpu_pci", lambda bdf, root=None: gpu)
    monkeypatch.delenv("MOE_EP_IB_NICS", raising=False)
    monkeypatch.delenv("MOE_EP_IB_DEVICE", raising=False)
    monkeypatch.delenv("MOE_EP_FI_DOMAIN", raising=False)
    nics = S.choose_nics(0)
    assert nics["efa"].devices == ["rdmap10", "rdmap11", "rdmap12", "rdmap13"] and nics["verbs"].device is None
    assert S.efa_domains(nics["efa"]) == "rdmap10-rdm,rdmap11-rdm,rdmap12-rdm,rdmap13-rdm"
    seen = []
    monkeypatch.setattr(S, "fabric_probe", lambda prov=None, dom=None: (seen.append((prov, dom)), (True, "ok"))[1])
    assert S.nic_probes(nics)["efa"]() == (True, "ok")
    assert seen == [("efa", "rdmap10-rdm,rdmap11-rdm,rdmap12-rdm,rdmap13-rdm")]
    monkeypatch.setenv("MOE_EP_FI_DOMAIN", "rdmap99-rdm")  # the domains named: the native side takes them
    assert S.efa_domains(nics["efa"]) is None
