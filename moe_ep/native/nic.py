"""RDMA devices as sysfs describes them, and the choice of a rank's NIC.

``list_devices(root)`` reads ``<root>/class/infiniband``: every device with its driver, PCI
address and path (the chain of bridges from the host bridge down), NUMA node and ports (state,
link layer, rate, LID, GIDs with their type and address). ``choose_nic`` picks the device a rank
should use: for a GPU rank the one nearest the GPU (behind the same PCIe switch > on the same NUMA
node > any), for a CPU rank the first with an active port; ``MOE_EP_IB_DEVICE`` overrides it.
Several NICs per rank (``MOE_EP_IB_NICS=k``, or a list in ``MOE_EP_IB_DEVICE``): the k nearest.
EFA devices (driver ``efa``) serve the ``efa`` transport only (libfabric's efa provider, on the
domain ``efa_domain`` names; a GPU with several EFA devices behind its PCIe switch opens one
endpoint on each: ``efa_count``), the others ``verbs`` only.

Pure Python over files, no libibverbs: the sysfs root is a parameter (``MOE_EP_SYSFS_ROOT``, else
``/sys``) so tests build fake trees. ``moe_ep.tools.doctor`` reports what this module reads.
"""
from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

from ..core import settings

_BDF = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")
NVIDIA_VENDOR = "0x10de"


def sysfs_root(root: Optional[str] = None) -> str:
    """``root``, else ``MOE_EP_SYSFS_ROOT``, else ``/sys``."""
    return root or settings.sysfs_root()


def _read(path: str, default: str = "") -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return default


def _entries(path: str, numeric: bool = False) -> list[str]:
    """The names in a directory, sorted (by number when ``numeric``); [] when it cannot be read."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    return sorted(names, key=lambda s: _int(s, 1 << 30)) if numeric else sorted(names)


def _int(s: str, default: int = -1) -> int:
    try:
        return int(s, 0)
    except (TypeError, ValueError):
        return default


@dataclass
class Gid:
    index: int
    address: str  # IPv6 text form: "::ffff:10.0.0.1", "fe80::..."
    type: str     # "RoCE v2", "RoCE v1" or "IB"
    ndev: str = ""  # the network interface of a RoCE GID

    @property
    def ipv4_mapped(self) -> bool:
        try:
            return ipaddress.IPv6Address(self.address).ipv4_mapped is not None
        except ValueError:
            return False


@dataclass
class Port:
    num: int
    state: str            # "ACTIVE", "DOWN", ...
    phys_state: str = ""  # "LinkUp", ...
    link_layer: str = ""  # "Ethernet" (RoCE), "InfiniBand", "" (EFA: unspecified)
    rate: str = ""
    lid: int = 0
    gids: list[Gid] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.state.upper() == "ACTIVE"

    def default_gid_index(self) -> Optional[int]:
        """The GID index the verbs transport takes unless ``MOE_EP_IB_GID_INDEX`` says otherwise
        (the rule of verbs_transport.cc): InfiniBand (and EFA) the first GID; RoCE the first
        IPv4-mapped RoCE v2 GID, else the first RoCE v2 one. None: no usable GID."""
        if not self.gids:
            return None
        if self.link_layer != "Ethernet":
            return self.gids[0].index
        v2 = [g for g in self.gids if g.type == "RoCE v2"]
        pick = [g for g in v2 if g.ipv4_mapped] or v2
        return pick[0].index if pick else None


@dataclass
class RdmaDevice:
    name: str
    driver: str = ""       # kernel driver of the PCI function ("mlx5_core", "efa", ...); "" for soft devices
    node_type: str = ""
    fw_ver: str = ""
    hca_type: str = ""
    board_id: str = ""
    node_guid: str = ""
    parent: str = ""       # soft devices (rxe, siw): the network interface they sit on
    pci: str = ""          # PCI address ("0000:17:00.0"); "" when not a PCI function
    pci_path: tuple[str, ...] = ()  # host bridge, then every PCI function from the root port down to the device
    numa_node: int = -1
    ports: list[Port] = field(default_factory=list)

    @property
    def is_efa(self) -> bool:
        return self.driver == "efa" or self.name.startswith("efa")

    @property
    def kind(self) -> str:
        """The transport this device serves: "efa" or "verbs"."""
        return "efa" if self.is_efa else "verbs"

    def active_port(self) -> Optional[Port]:
        return next((p for p in self.ports if p.active), None)

    def to_json(self) -> dict:
        d = asdict(self)
        d["kind"] = self.kind
        for p, pd in zip(self.ports, d["ports"]):
            pd["active"] = p.active
            pd["default_gid_index"] = p.default_gid_index()
        return d


def gid_text(gid: str) -> str:
    """A GID in IPv6 text form, IPv4-mapped ones dotted ("::ffff:10.0.0.1"); unparsable: as given."""
    try:
        a = ipaddress.IPv6Address(gid)
    except ValueError:
        return gid
    return f"::ffff:{a.ipv4_mapped}" if a.ipv4_mapped else str(a)


def _gid_type(raw: str, link_layer: str) -> str:
    if link_layer == "InfiniBand":
        return "IB"
    if "v2" in raw:
        return "RoCE v2"
    if link_layer == "Ethernet":
        return "RoCE v1"
    return raw or "IB"


def _gids(port_dir: str, link_layer: str) -> list[Gid]:
    out = []
    gdir = os.path.join(port_dir, "gids")
    for n in _entries(gdir, numeric=True):
        raw = _read(os.path.join(gdir, n))
        try:
            addr = ipaddress.IPv6Address(raw)
        except ValueError:
            continue
        if addr.packed == bytes(16):
            continue  # an empty table entry
        # Reading the type of an empty entry fails (EINVAL), so only valid entries are asked.
        typ = _read(os.path.join(port_dir, "gid_attrs", "types", n))
        ndev = _read(os.path.join(port_dir, "gid_attrs", "ndevs", n))
        out.append(Gid(_int(n), gid_text(raw), _gid_type(typ, link_layer), ndev))
    return out


def _state(s: str) -> str:
    """"4: ACTIVE" -> "ACTIVE"."""
    return s.split(":", 1)[1].strip() if ":" in s else s


def pci_path(root: str, sys_dir: str) -> tuple[str, ...]:
    """The chain of a PCI function's ancestors from its resolved sysfs directory: the host bridge
    ("pci0000:00"), then every PCI function from the root port down to the device itself."""
    real = os.path.realpath(sys_dir)
    base = os.path.realpath(os.path.join(root, "devices"))
    rel = os.path.relpath(real, base)
    if rel.startswith(".."):
        return ()
    parts = rel.split(os.sep)
    out = [parts[0]] if parts and parts[0].startswith("pci") else []
    out += [p for p in parts if _BDF.match(p)]
    return tuple(out) if len(out) >= 2 else ()


def list_devices(root: Optional[str] = None) -> list[RdmaDevice]:
    """Every device under ``<root>/class/infiniband``, sorted by name ([] when there is none)."""
    root = sysfs_root(root)
    cls = os.path.join(root, "class", "infiniband")
    out = []
    for name in _entries(cls):
        d = os.path.join(cls, name)
        dev = os.path.join(d, "device")
        drv = os.path.join(dev, "driver")
        path = pci_path(root, dev) if os.path.exists(dev) else ()
        r = RdmaDevice(
            name=name,
            driver=os.path.basename(os.path.realpath(drv)) if os.path.exists(drv) else "",
            node_type=_read(os.path.join(d, "node_type")),
            fw_ver=_read(os.path.join(d, "fw_ver")),
            hca_type=_read(os.path.join(d, "hca_type")),
            board_id=_read(os.path.join(d, "board_id")),
            node_guid=_read(os.path.join(d, "node_guid")),
            parent=_read(os.path.join(d, "parent")),
            pci=path[-1] if path else "",
            pci_path=path,
            numa_node=_int(_read(os.path.join(dev, "numa_node")), -1) if path else -1,
        )
        pdir = os.path.join(d, "ports")
        for p in _entries(pdir, numeric=True):
            pp = os.path.join(pdir, p)
            ll = _read(os.path.join(pp, "link_layer"))
            r.ports.append(Port(num=_int(p), state=_state(_read(os.path.join(pp, "state"))),
                                phys_state=_state(_read(os.path.join(pp, "phys_state"))), link_layer=ll,
                                rate=_read(os.path.join(pp, "rate")), lid=max(0, _int(_read(os.path.join(pp, "lid")), 0)),
                                gids=_gids(pp, ll)))
        out.append(r)
    return out


@dataclass
class GpuPci:
    """A GPU as a PCI function: address, path (see ``pci_path``), NUMA node."""
    pci: str
    pci_path: tuple[str, ...] = ()
    numa_node: int = -1


def normalize_bdf(bdf: str) -> str:
    """"00000000:17:00.0" (nvidia-smi, CUDA) or "17:00.0" -> "0000:17:00.0"."""
    bdf = bdf.strip().lower()
    parts = bdf.split(":")
    if len(parts) == 2:
        parts = ["0000", *parts]
    if len(parts) == 3:
        parts[0] = f"{int(parts[0], 16):04x}" if parts[0] else "0000"
    return ":".join(parts)


def gpu_pci(bdf: str, root: Optional[str] = None) -> GpuPci:
    """The GPU at PCI address ``bdf`` as sysfs places it (path and NUMA node empty if unknown)."""
    root = sysfs_root(root)
    bdf = normalize_bdf(bdf)
    d = os.path.join(root, "bus", "pci", "devices", bdf)
    if not os.path.exists(d):
        return GpuPci(bdf)
    return GpuPci(bdf, pci_path(root, d), _int(_read(os.path.join(d, "numa_node")), -1))


def list_gpus_sysfs(root: Optional[str] = None) -> list[GpuPci]:
    """NVIDIA display/3D controllers on the PCI bus (no driver or CUDA needed), by address."""
    root = sysfs_root(root)
    bus = os.path.join(root, "bus", "pci", "devices")
    out = []
    for n in _entries(bus):
        d = os.path.join(bus, n)
        if _read(os.path.join(d, "vendor")).lower() == NVIDIA_VENDOR and _read(os.path.join(d, "class")).startswith("0x03"):
            out.append(gpu_pci(n, root))
    return out


def torch_gpu_bdf(index: int) -> Optional[str]:
    """The PCI address of CUDA device ``index`` from torch's device properties (None if unknown)."""
    try:
        import torch

        p = torch.cuda.get_device_properties(index)
        return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
    except Exception:  # noqa: BLE001 - no torch, no CUDA, an older torch without the fields
        return None


def _shared_bridges(a: Sequence[str], b: Sequence[str]) -> int:
    """PCI functions above both devices (their common path below the host bridge, the devices
    themselves excluded). A root port has one link, so >= 1 means both sit behind one switch."""
    if not a or not b or a[0] != b[0]:
        return 0
    n = 0
    for x, y in zip(a[1:-1], b[1:-1]):
        if x != y:
            break
        n += 1
    return n


@dataclass
class NicChoice:
    device: Optional[str]  # None: nothing to choose from (the native default applies); several: "mlx5_0,mlx5_1"
    port: Optional[int]    # several NICs: the first one's (``ports`` has each one's)
    reason: str
    ports: tuple[int, ...] = ()  # each NIC's port, in ``devices`` order
    nics: int = 1          # how many NICs the engine opens (every rank must open as many)

    @property
    def devices(self) -> list[str]:
        return self.device.split(",") if self.device else []

    @property
    def spec(self) -> str:
        """The engine's ``device`` argument: "mlx5_0" for one NIC, "mlx5_0:1,mlx5_1:1" for several."""
        if not self.device or len(self.devices) == 1:
            return self.device or ""
        ports = self.ports or (self.port or 0,) * len(self.devices)
        return ",".join(f"{d}:{p}" if p else d for d, p in zip(self.devices, ports))

    def __str__(self) -> str:
        if not self.device:
            return f"native default ({self.reason})"
        if len(self.devices) == 1:
            return f"{self.device} port {self.port} ({self.reason})"
        ports = self.ports or (self.port,) * len(self.devices)
        return ", ".join(f"{d} port {p}" for d, p in zip(self.devices, ports)) + f" ({self.reason})"


EFA_DOMAIN_SUFFIX = "-rdm"  # the efa provider's FI_EP_RDM domain: "<ibv device name>-rdm"


def efa_domain(device: str) -> str:
    """The libfabric efa provider's FI_EP_RDM domain of EFA device ``device`` ("rdmap16s27" ->
    "rdmap16s27-rdm"; a name that already is a domain is kept)."""
    return device if device.endswith(EFA_DOMAIN_SUFFIX) else device + EFA_DOMAIN_SUFFIX


def efa_count(devices: Sequence[RdmaDevice], gpu: Optional[GpuPci] = None, env: Optional[dict] = None) -> int:
    """How many EFA devices a rank opens (one libfabric endpoint each): ``MOE_EP_IB_NICS`` or a
    list in ``MOE_EP_IB_DEVICE`` when set in ``env`` (default ``os.environ``; ``nic_count``); else,
    for a GPU rank, every EFA device with an active port behind the same PCIe switch as the GPU
    (p5: 4), at least 1; else 1."""
    if settings.ib_nics(env) > 0 or settings.ib_devices(env):
        return nic_count(env)
    if gpu is None or not gpu.pci_path:
        return 1
    shared = [_shared_bridges(gpu.pci_path, d.pci_path) for d in devices if d.kind == "efa" and d.active_port()]
    best = max(shared, default=0)
    return max(1, sum(1 for n in shared if n == best)) if best else 1


def nic_count(env: Optional[dict] = None) -> int:
    """How many NICs a rank opens: ``MOE_EP_IB_NICS``, else as many as ``MOE_EP_IB_DEVICE``
    lists, else 1 (the native engine's rule); in ``env``, default ``os.environ``."""
    n = settings.ib_nics(env)
    if n > 0:
        return n
    return len(settings.ib_devices(env)) or 1


def choose_nic(devices: Sequence[RdmaDevice], kind: str = "verbs", gpu: Optional[GpuPci] = None,
               gpu_index: int = 0, env: Optional[dict] = None, count: Optional[int] = None) -> NicChoice:
    """The devices (and each one's first active port) a rank of transport ``kind`` should use:
    ``count`` of them (default ``nic_count(env)``: ``MOE_EP_IB_NICS``, else as many as
    ``MOE_EP_IB_DEVICE`` lists, else 1).

    ``MOE_EP_IB_DEVICE`` (in ``env``, default ``os.environ``; ``"a,b"`` or ``"a:1,b:2"`` for
    several, a name listed twice is opened twice) wins. Else only devices of ``kind`` with an
    active port count. A GPU rank (``gpu``) takes the nearest: behind the same PCIe switch as the
    GPU (the deepest shared bridge first) > on the GPU's NUMA node > any; GPUs with several
    equally near devices spread over them by ``gpu_index``; several NICs are the ``count``
    nearest in that order. A CPU rank takes the first ``count``. Fewer usable devices than asked
    for: all of them, and the reason says so (the engine then refuses to start).
    """
    count = count if count and count > 0 else nic_count(env)
    listed = settings.ib_devices(env)
    if listed:
        entries = listed[:count]
        names, ports = [], []
        for e in entries:
            name, _, p = e.partition(":")
            dev = next((d for d in devices if d.name == name), None)
            port = _int(p, 0) or settings.ib_port(env) or ((dev.active_port() or Port(1, "")).num if dev else 1)
            names.append(name)
            ports.append(port)
        why = "MOE_EP_IB_DEVICE"
        if count > len(names):
            why += f" (lists {len(names)}, {count} NICs asked for)"
        return NicChoice(",".join(names), ports[0], why, tuple(ports), count)
    cands = [d for d in devices if d.kind == kind and d.active_port() is not None]
    if not cands:
        others = [d.name for d in devices if d.kind == kind]
        why = f"no {kind} device with an active port in sysfs" + (f" ({', '.join(others)} have none)" if others else "")
        return NicChoice(None, None, why, (), count)

    def pick(order: list[RdmaDevice], why: str) -> NicChoice:
        chosen = order[:count]
        if count > 1:
            why += f"; {count} NICs" + (f", only {len(chosen)} usable" if len(chosen) < count else "")
        ports = tuple(d.active_port().num for d in chosen)
        return NicChoice(",".join(d.name for d in chosen), ports[0], why, ports, count)

    if gpu is None:
        return pick(cands, "CPU rank: first device with an active port")
    scored = []
    for d in cands:
        shared = _shared_bridges(gpu.pci_path, d.pci_path)
        same_numa = gpu.numa_node >= 0 and gpu.numa_node == d.numa_node
        scored.append(((1 if shared else 0, shared, 1 if same_numa else 0), d))
    order: list[RdmaDevice] = []
    tiers = sorted({sc for sc, _ in scored}, reverse=True)
    for t in tiers:  # nearest first; within a tier, rotated by GPU index (GPUs spread over equals)
        tied = [d for sc, d in scored if sc == t]
        r = gpu_index % len(tied)
        order += tied[r:] + tied[:r]
    best = tiers[0]
    n_best = sum(1 for sc, _ in scored if sc == best)
    if best[0]:
        why = f"behind the same PCIe switch as GPU {gpu.pci}"
    elif best[2]:
        why = f"on NUMA node {gpu.numa_node} with GPU {gpu.pci}"
    else:
        why = f"no device near GPU {gpu.pci or '?'} (PCIe/NUMA unknown or far): any"
    if n_best > 1:
        why += f"; {n_best} equally near, GPU index {gpu_index} takes #{gpu_index % n_best}"
    return pick(order, why)
