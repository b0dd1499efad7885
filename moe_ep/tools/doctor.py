"""``python -m moe_ep.doctor``: what this machine offers moe_ep's inter-node path.

What is installed: moe_ep's version and where it is imported from, the native library's path
and build (compiler, C++ standard, flags), so a bug report says it.
GPUs and their peer-to-peer / NVLink peers (torch.cuda when it sees GPUs; ``nvidia-smi topo -m``
when present; NVIDIA functions on the PCI bus otherwise), RDMA devices with their ports, GIDs
(index, type, address), link layer and state from sysfs (EFA devices among them), their attributes
as libibverbs reports them (through the native library), a cross-check with pyverbs where it is
importable, whether GPU memory can be registered (dma-buf: ``ibv_reg_dmabuf_mr`` and the CUDA
driver's export; or nvidia-peermem), libfabric's providers (fabric, domain, endpoint type, RMA,
remote CQ data size, HMEM, mr_mode) and whether each would be used and why (EFA runs through the
``efa`` provider), the NIC each GPU (or a CPU rank) would use, and which transport
``MOE_EP_TRANSPORT=auto`` picks and why; whether ``import deep_ep`` loads moe_ep. Needs no process
group, no GPU and no rdma-core: what is missing is reported, not fatal. ``--json`` prints the same as one JSON document.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from typing import Optional

from ..core import settings
from ..native import nic as _nic

# The variables the report shows when set: every one moe_ep reads (moe_ep.core.settings), and the GPUs visible.
ENV_VARS = settings.NAMES + ("CUDA_VISIBLE_DEVICES",)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------- GPUs

_NV = re.compile(r"^NV(\d+)$")


def parse_topo(text: str) -> dict[int, dict[int, str]]:
    """``nvidia-smi topo -m``: for each GPU row, its link to every other GPU (``NV18``, ``PIX``,
    ``SYS``, ...), keyed by GPU index."""
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return {}
    head = lines[0].split()
    gpu_cols = [i for i, h in enumerate(head) if re.fullmatch(r"GPU\d+", h)]
    out: dict[int, dict[int, str]] = {}
    for ln in lines[1:]:
        cells = ln.split()
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            continue
        row = int(cells[0][3:])
        links = {}
        for i in gpu_cols:
            if i + 1 < len(cells):
                col = int(head[i][3:])
                if col != row:
                    links[col] = cells[i + 1]
        out[row] = links
    return out


def _nvidia_smi(*args: str) -> Optional[str]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        r = subprocess.run([exe, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def gpus(use_torch: bool = True, root: Optional[str] = None) -> dict:
    """The GPUs: from torch.cuda (name, PCI address, memory, P2P peers) when it sees any, else
    from nvidia-smi, else NVIDIA functions in sysfs; NVLink peers from ``nvidia-smi topo -m``."""
    out: dict = {"source": "none", "devices": [], "nvidia_smi_topo": None}
    if use_torch:
        try:
            import torch

            out["torch"] = torch.__version__
            if torch.cuda.is_available():
                n = torch.cuda.device_count()
                for i in range(n):
                    p = torch.cuda.get_device_properties(i)
                    out["devices"].append({
                        "index": i, "name": p.name, "pci": _nic.torch_gpu_bdf(i), "memory_bytes": int(p.total_memory),
                        "capability": f"{p.major}.{p.minor}",
                        "p2p": [j for j in range(n) if j != i and torch.cuda.can_device_access_peer(i, j)]})
                out["source"] = "torch"
            else:
                out["torch_cuda"] = "torch.cuda.is_available() is False"
        except Exception as e:  # noqa: BLE001 - no torch, a broken driver: reported
            out["torch_error"] = _err(e)
    if not out["devices"]:
        q = _nvidia_smi("--query-gpu=index,name,pci.bus_id,memory.total", "--format=csv,noheader,nounits")
        for ln in (q or "").splitlines():
            f = [x.strip() for x in ln.split(",")]
            if len(f) == 4 and f[0].isdigit():
                out["devices"].append({"index": int(f[0]), "name": f[1], "pci": _nic.normalize_bdf(f[2]),
                                       "memory_bytes": int(float(f[3]) * 2**20) if f[3].replace(".", "").isdigit() else None})
        if out["devices"]:
            out["source"] = "nvidia-smi"
    if not out["devices"]:
        for i, g in enumerate(_nic.list_gpus_sysfs(root)):
            out["devices"].append({"index": i, "name": "NVIDIA GPU (PCI)", "pci": g.pci})
        if out["devices"]:
            out["source"] = "sysfs"
    topo = _nvidia_smi("topo", "-m")
    if topo:
        out["nvidia_smi_topo"] = topo
        links = parse_topo(topo)
        for d in out["devices"]:
            row = links.get(d["index"], {})
            d["nvlink"] = {str(j): l for j, l in sorted(row.items()) if _NV.match(l)}
    for d in out["devices"]:
        if d.get("pci"):
            g = _nic.gpu_pci(d["pci"], root)
            d["numa_node"], d["pci_path"] = g.numa_node, list(g.pci_path)
    return out


# ---------------------------------------------------------------- RDMA

def cross_check(sysfs: list[dict], other: list[dict], what: str) -> list[str]:
    """Differences between the sysfs view and another one (libibverbs through the native library,
    or pyverbs): device names, port activity, GIDs. Each ``other`` device: ``{"name", "ports":
    [{"port", "active", "gids": [{"index", "gid"}]}]}``."""
    diffs = []
    a, b = {d["name"]: d for d in sysfs}, {d["name"]: d for d in other}
    for n in sorted(set(a) ^ set(b)):
        diffs.append(f"{n}: only in {'sysfs' if n in a else what}")
    for n in sorted(set(a) & set(b)):
        pa = {p["num"]: p for p in a[n].get("ports", [])}
        pb = {p["port"]: p for p in b[n].get("ports", []) if "port" in p}
        for num in sorted(set(pa) & set(pb)):
            if bool(pa[num]["active"]) != bool(pb[num].get("active")):
                diffs.append(f"{n} port {num}: sysfs says {pa[num]['state']}, {what} "
                             f"{'active' if pb[num].get('active') else 'not active'}")
            ga = {g["index"]: _nic.gid_text(g["address"]) for g in pa[num].get("gids", [])}
            gb = {g["index"]: _nic.gid_text(g["gid"]) for g in pb[num].get("gids", [])}
            for k in sorted(set(ga) | set(gb)):
                if k < 64 and ga.get(k) != gb.get(k):
                    diffs.append(f"{n} port {num} GID {k}: sysfs {ga.get(k)}, {what} {gb.get(k)}")
        for num in sorted(set(pa) ^ set(pb)):
            diffs.append(f"{n} port {num}: only in {'sysfs' if num in pa else what}")
    return diffs


def pyverbs_devices() -> tuple[Optional[list[dict]], str]:
    """The devices as rdma-core's own Python bindings see them, or (None, why not)."""
    try:
        from pyverbs import device as pd
    except Exception as e:  # noqa: BLE001 - not installed, or built for another libibverbs
        return None, f"pyverbs not importable ({_err(e)})"
    out = []
    try:
        for dev in pd.get_device_list():
            name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
            d: dict = {"name": name, "ports": []}
            with pd.Context(name=name) as ctx:
                attr = ctx.query_device()
                d["fw_ver"] = getattr(attr, "fw_version", b"")
                d["fw_ver"] = d["fw_ver"].decode() if isinstance(d["fw_ver"], bytes) else str(d["fw_ver"])
                d["max_qp"] = int(getattr(attr, "max_qp", -1))
                for port in range(1, int(attr.phys_port_cnt) + 1):
                    pa = ctx.query_port(port)
                    gids = []
                    for k in range(min(int(pa.gid_tbl_len), 64)):
                        try:
                            g = str(ctx.query_gid(port, k))
                        except Exception:  # noqa: BLE001 - empty entries fail on some providers
                            continue
                        if _nic.gid_text(g) != "::":
                            gids.append({"index": k, "gid": g})
                    d["ports"].append({"port": port, "active": int(pa.state) == 4, "state": int(pa.state),
                                       "link_layer": int(pa.link_layer), "gids": gids})
            out.append(d)
    except Exception as e:  # noqa: BLE001
        return None, f"pyverbs failed: {_err(e)}"
    return out, "ok"


def fabric_lacks(e: dict) -> list[str]:
    """What a libfabric entry lacks for the libfabric transport (FI_EP_RDM, FI_MSG, FI_RMA, remote
    CQ data of 4 bytes); [] when it fits."""
    need = [(e.get("ep_type") == "FI_EP_RDM", "FI_EP_RDM"), (e.get("msg"), "FI_MSG"), (e.get("rma"), "FI_RMA"),
            (e.get("cq_data_size", 0) >= 4, "remote CQ data of 4 bytes")]
    return [what for ok, what in need if not ok]


def fabric_use(e: dict, default: dict, efa_domains: set[str]) -> str:
    """Whether a libfabric entry would be used, and why: efa entries by ``auto`` and
    ``MOE_EP_TRANSPORT=efa`` (on the EFA devices each rank chooses: ``efa_domains`` are those of
    the EFA devices in sysfs); any other fitting one only by ``MOE_EP_TRANSPORT=libfabric``
    (``default``: the native default choice, ``fabric_probe()``)."""
    lacks = fabric_lacks(e)
    if lacks:
        return "not used: lacks " + ", ".join(lacks)
    if not e.get("usable", True):
        return "not used: refused the transport's hints"
    if e["provider"] == "efa":
        near = "" if not efa_domains or e["domain"] in efa_domains else " (not an EFA device sysfs lists)"
        return f"used by auto and MOE_EP_TRANSPORT=efa on the ranks whose GPU it is nearest{near}"
    picked = default.get("ok") and default.get("what", "").startswith(f"provider {e['provider']} domain {e['domain']} ")
    return ("used by MOE_EP_TRANSPORT=libfabric (its default choice)" if picked else
            f"used by MOE_EP_TRANSPORT=libfabric with MOE_EP_FI_PROVIDER='{e['provider']}' "
            f"MOE_EP_FI_DOMAIN={e['domain']}") + "; not by auto (efa only)"


def rdma(root: Optional[str] = None, use_pyverbs: bool = True) -> dict:
    """RDMA devices: sysfs, the native library's probes and listing, pyverbs, their differences."""
    root = _nic.sysfs_root(root)
    devs = _nic.list_devices(root)
    out: dict = {"sysfs_root": root, "devices": [d.to_json() for d in devs]}
    try:
        from ..native import library, probes

        library.lib()
        ok, what = probes.verbs_probe()
        out["verbs_probe"] = {"ok": ok, "what": what}
        out["libibverbs"] = probes.rdma_devices()
        ok, what = probes.fabric_probe()
        out["fabric_probe"] = {"ok": ok, "what": what}
        ok, what = probes.fabric_probe("efa")
        out["efa_probe"] = {"ok": ok, "what": what}
        out["libfabric"] = probes.fabric_providers()
        efa_doms = {_nic.efa_domain(d.name) for d in devs if d.kind == "efa"}
        out["libfabric"]["entries"] = [{**e, "use": fabric_use(e, out["fabric_probe"], efa_doms)}
                                       for e in out["libfabric"].get("entries", [])]
    except Exception as e:  # noqa: BLE001 - no compiler for the native library, ...
        out["native_error"] = _err(e)
    out["dmabuf"] = dmabuf(root)
    lv = out.get("libibverbs", {})
    if "devices" in lv:
        out["libibverbs_vs_sysfs"] = cross_check(out["devices"], lv["devices"], "libibverbs")
    if use_pyverbs:
        pv, why = pyverbs_devices()
        out["pyverbs"] = {"available": pv is not None, "why": why, "devices": pv}
        if pv is not None:
            out["pyverbs"]["vs_sysfs"] = cross_check(out["devices"], pv, "pyverbs")
    return out


def _exports(name: str, symbol: str) -> tuple[bool, str]:
    """(whether the shared library ``name`` loads and exports ``symbol``, what was found)."""
    import ctypes

    try:
        lib = ctypes.CDLL(name)
    except OSError as e:
        return False, f"cannot load {name}: {e}"
    return (True, f"{name} exports {symbol}") if hasattr(lib, symbol) else (False, f"{name} has no {symbol}")


def dmabuf(root: Optional[str] = None) -> dict:
    """How the verbs transport could register GPU memory here (§9): through dma-buf when
    libibverbs exports ``ibv_reg_dmabuf_mr`` (rdma-core 34+) and the CUDA driver loads and exports
    ``cuMemGetHandleForAddressRange`` (CUDA 11.7+), else by ``ibv_reg_mr`` on the GPU address
    when the nvidia-peermem module is loaded. (Whether the GPU's driver really exports dma-bufs
    shows only when registering.)"""
    root = _nic.sysfs_root(root)
    ok_v, why_v = _exports(settings.ibverbs_lib(), "ibv_reg_dmabuf_mr")
    ok_c, why_c = _exports(settings.cuda_lib(), "cuMemGetHandleForAddressRange")
    peermem = os.path.isdir(os.path.join(root, "module", "nvidia_peermem"))
    via = ("dma-buf" if ok_v and ok_c else "GPU address (nvidia-peermem)" if peermem
           else "none (host memory only)")
    return {"ibv_reg_dmabuf_mr": {"ok": ok_v, "what": why_v}, "cuda_dmabuf_export": {"ok": ok_c, "what": why_c},
            "nvidia_peermem": peermem, "gpu_memory": via}


# ---------------------------------------------------------------- NIC choice and transport

def nic_choices(devs: list[_nic.RdmaDevice], gpu_list: list[dict], root: Optional[str] = None) -> list[dict]:
    """The NIC each GPU (and a CPU rank) would use, for each RDMA transport, as ``start_proxy``
    chooses them: verbs ``MOE_EP_IB_NICS`` of them; efa every EFA device behind the GPU's switch,
    with the libfabric domains (``efa_domains``) its endpoints open."""
    rows = []
    for g in gpu_list + [None]:
        gp = (_nic.gpu_pci(g["pci"], root) if g.get("pci") else _nic.GpuPci("")) if g else None
        idx = g["index"] if g else 0
        efa = _nic.choose_nic(devs, "efa", gp, idx, count=_nic.efa_count(devs, gp))
        rows.append({"rank": f"GPU{idx}" if g else "CPU", "verbs": str(_nic.choose_nic(devs, "verbs", gp, idx)),
                     "efa": str(efa), "efa_domains": [_nic.efa_domain(d) for d in efa.devices]})
    return rows


def transport(native_ok: bool) -> dict:
    """What ``auto`` picks here and why; and what ``MOE_EP_TRANSPORT``, if set, gives."""
    out: dict = {}
    if not native_ok:
        out["auto"] = {"kind": "tcp", "why": "the native library is not available (see rdma.native_error)"}
        return out
    from ..internode.session import select_transport

    kind, why = select_transport("auto")
    out["auto"] = {"kind": kind, "why": why}
    env = settings.value("MOE_EP_TRANSPORT")  # as set: a bad value is reported, not raised
    if env and env.strip().lower() != "auto":
        try:
            k, w = select_transport(env)
            out["requested"] = {"name": env, "kind": k, "why": w}
        except Exception as e:  # noqa: BLE001 - the error a job would see
            out["requested"] = {"name": env, "error": str(e)}
    out["note"] = ("a job agrees over its ranks: auto uses an RDMA transport only when every rank "
                   "can; otherwise tcp")
    return out


def ipc_binding() -> Optional[str]:
    """``"cupy <version>"`` when cupy's CUDA runtime binding (what ``moe_ep.core.node_memory``'s IPC backend
    calls) imports, else None. Here, not in ``moe_ep.core.node_memory``, so that ``--no-torch`` loads no torch."""
    try:
        import cupy
        import cupy.cuda.runtime  # noqa: F401
    except Exception:  # noqa: BLE001
        return None
    return f"cupy {cupy.__version__}"


def node_memory(num_gpus: int, use_torch: bool = True) -> dict:
    """How a job's node peers would map each other's memory here (``moe_ep.core.node_memory``): symmetric memory
    when every rank of a node has its own GPU and torch has it, CUDA IPC (cupy) when ranks share a GPU
    or it does not; ``MOE_EP_NODE_MEMORY`` forces one."""
    symm = None
    if use_torch:
        from ..core.node_memory import symm_available

        symm = symm_available()
    ipc = ipc_binding()
    forced = settings.value("MOE_EP_NODE_MEMORY") or None  # as set, unchecked
    own = "symm" if symm else "ipc"
    return {"symm_available": symm, "ipc_binding": ipc, "forced": forced,
            "a_gpu_per_rank": forced or (own if num_gpus else None), "ranks_share_gpus": forced or "ipc",
            "note": "ranks sharing a GPU time-slice it (or share its SMs under MPS): correct, but not NVLink "
                    "timings" + ("" if ipc else "; CUDA IPC needs cupy (cupy-cuda12x / cupy-cuda13x)")}


def install() -> dict:
    """What is installed, so a bug report says it: where moe_ep is imported from, and the native
    library's path and build (compiler, C++ standard, flags), or why it does not load."""
    out: dict = {"moe_ep_path": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}  # moe_ep/, above tools/
    try:
        from ..native import library

        out["native"] = {"library": library.path(), "build": library.build_info()}
    except Exception as e:  # noqa: BLE001 - no compiler for the native library, ...
        out["native"] = {"error": _err(e)}
    return out


def deep_ep_alias() -> dict:
    """Whether ``import deep_ep`` loads moe_ep here (``python -m moe_ep.deep_ep.install``), or a real
    DeepEP, or nothing (``moe_ep.deep_ep_alias.status``; imports neither)."""
    try:
        from ..deep_ep_alias import status

        return status()
    except Exception as e:  # noqa: BLE001 - a broken sys.path entry, ...
        return {"active": False, "what": f"unknown ({_err(e)})"}


def report(root: Optional[str] = None, use_torch: bool = True, use_pyverbs: bool = True) -> dict:
    """Everything, as one JSON-able dict (the keys of ``--json``)."""
    root = _nic.sysfs_root(root)
    try:
        from .. import __version__ as version
    except Exception:  # noqa: BLE001 - loaded without the package's __init__: the installed metadata
        try:
            from importlib.metadata import version as _v

            version = _v("moe_ep")
        except Exception:  # noqa: BLE001
            version = None
    g = gpus(use_torch, root)
    r = rdma(root, use_pyverbs)
    devs = _nic.list_devices(root)
    return {
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(), "python": sys.version.split()[0],
                 "moe_ep": version, **install()},
        "gpus": g,
        "rdma": r,
        "nic": nic_choices(devs, g["devices"], root),
        "transport": transport("native_error" not in r),
        "node_memory": node_memory(len(g["devices"]), use_torch),
        "env": settings.environment(ENV_VARS),
        "deep_ep": deep_ep_alias(),
    }


# ---------------------------------------------------------------- text

def _gib(n) -> str:
    return f"{n / 2**30:.0f} GiB" if n else "?"


def render(rep: dict) -> str:
    h, g, r, t = rep["host"], rep["gpus"], rep["rdma"], rep["transport"]
    n = h["native"]
    L = [f"moe_ep doctor: {h['hostname']}, {h['platform']}, Python {h['python']}, moe_ep {h['moe_ep'] or '?'}",
         f"  moe_ep from {h['moe_ep_path']}",
         f"  native library: {n['library']}  ({n['build']})" if "build" in n else f"  native library: {n['error']}", ""]
    L.append(f"GPUs ({g['source']}): {len(g['devices'])}")
    for why in ("torch_error", "torch_cuda"):
        if g.get(why):
            L.append(f"  torch: {g[why]}")
    for d in g["devices"]:
        bits = [f"  GPU{d['index']}  {d.get('name', '?')}  {d.get('pci') or '?'}",
                f"NUMA {d.get('numa_node', -1)}", _gib(d.get("memory_bytes"))]
        if "p2p" in d:
            bits.append("P2P: " + (", ".join(f"GPU{j}" for j in d["p2p"]) or "none"))
        if "nvlink" in d:
            bits.append("NVLink: " + (", ".join(f"GPU{j} ({l})" for j, l in d["nvlink"].items()) or "none"))
        L.append("  ".join(bits))
    if g.get("nvidia_smi_topo"):
        L.append("  nvidia-smi topo -m:")
        L += ["    " + ln for ln in g["nvidia_smi_topo"].rstrip().splitlines()]
    L += ["", f"RDMA devices (sysfs {r['sysfs_root']}/class/infiniband): {len(r['devices'])}"]
    lv = {d["name"]: d for d in r.get("libibverbs", {}).get("devices", [])}
    for d in r["devices"]:
        where = d["pci"] or (f"on {d['parent']}" if d["parent"] else "no PCI function")
        L.append(f"  {d['name']}  [{d['kind']}]  driver {d['driver'] or '-'}  {where}  NUMA {d['numa_node']}"
                 f"  fw {d['fw_ver'] or '-'}  {d['node_type']}")
        n = lv.get(d["name"], {})
        if "max_qp" in n:
            L.append(f"    libibverbs: max_qp {n['max_qp']}, max_qp_wr {n['max_qp_wr']}, max_cqe {n['max_cqe']}, "
                     f"max_mr_size {n['max_mr_size']}, max_sge {n['max_sge']}, ports {n['phys_port_cnt']}")
        for p in d["ports"]:
            L.append(f"    port {p['num']}  {p['state']} ({p['phys_state'] or '?'})  {p['link_layer'] or 'unspecified'}"
                     f"  {p['rate'] or ''}  lid {p['lid']}")
            for gid in p["gids"]:
                mark = "  <- default" if gid["index"] == p["default_gid_index"] else ""
                L.append(f"      GID {gid['index']:<3} {gid['type']:<8} {gid['address']}"
                         + (f"  ({gid['ndev']})" if gid["ndev"] else "") + mark)
    if "native_error" in r:
        L.append(f"  native library: {r['native_error']}")
    else:
        for k, name in (("verbs_probe", "verbs"), ("efa_probe", "efa (libfabric provider efa)"),
                        ("fabric_probe", "libfabric (default provider)")):
            p = r[k]
            L.append(f"  {name} probe: {'usable: ' if p['ok'] else 'not usable: '}{p['what']}")
        if r.get("libibverbs", {}).get("error"):
            L.append(f"  libibverbs: {r['libibverbs']['error']}")
        diffs = r.get("libibverbs_vs_sysfs", [])
        L.append("  libibverbs vs sysfs: " + ("agree" if not diffs else "; ".join(diffs)))
    db = r.get("dmabuf")
    if db:
        L.append(f"  GPU memory registration: {db['gpu_memory']}  (ibv_reg_dmabuf_mr: {db['ibv_reg_dmabuf_mr']['what']}; "
                 f"CUDA: {db['cuda_dmabuf_export']['what']}; nvidia-peermem {'loaded' if db['nvidia_peermem'] else 'not loaded'})")
    pv = r.get("pyverbs")
    if pv is not None:
        if not pv["available"]:
            L.append(f"  pyverbs: {pv['why']}")
        else:
            L.append("  pyverbs vs sysfs: " + ("agree" if not pv["vs_sysfs"] else "; ".join(pv["vs_sysfs"])))
    lf = r.get("libfabric")
    if lf is not None:
        L += [""]
        if lf.get("error"):
            L.append(f"libfabric: {lf['error']}")
        else:
            rows = list(dict.fromkeys(  # fi_getinfo repeats entries (one per API level): each once
                f"  {e['provider']}  fabric {e['fabric']}  domain {e['domain']}  {e['ep_type']}  "
                f"RMA {'yes' if e['rma'] else 'no'}  cq_data_size {e['cq_data_size']}  HMEM {'yes' if e['hmem'] else 'no'}"
                f"  mr_mode {e['mr_mode']}\n      -> {e['use']}" for e in lf.get("entries", [])))
            L.append(f"libfabric {lf.get('library_version')} (API {lf.get('api_version')}): {len(rows)} provider "
                     f"entries" + (f"; fi_getinfo: {lf['getinfo_error']}" if lf.get("getinfo_error") else ""))
            L += [ln for row in rows for ln in row.split("\n")]
    L += ["", "NIC per rank (MOE_EP_IB_DEVICE overrides):"]
    for row in rep["nic"]:
        L.append(f"  {row['rank']:<6} verbs: {row['verbs']}")
        L.append(f"  {'':<6} efa:   {row['efa']}" + (f"  -> libfabric domains {', '.join(row['efa_domains'])}"
                                                       if row["efa_domains"] else ""))
    L += ["", f"Transport: auto -> {t['auto']['kind']}  ({t['auto']['why']})"]
    if "requested" in t:
        q = t["requested"]
        L.append(f"  MOE_EP_TRANSPORT={q['name']} -> " + (q["kind"] + f"  ({q['why']})" if "kind" in q else f"error: {q['error']}"))
    if t.get("note"):
        L.append(f"  ({t['note']})")
    m = rep["node_memory"]
    L += ["", f"Node memory: a GPU per rank -> {m['a_gpu_per_rank'] or '-'}; ranks sharing a GPU -> "
              f"{m['ranks_share_gpus']}  (torch symmetric memory: "
              f"{'?' if m['symm_available'] is None else ('yes' if m['symm_available'] else 'no')}; "
              f"CUDA IPC binding: {m['ipc_binding'] or 'none'}"
              + (f"; MOE_EP_NODE_MEMORY={m['forced']}" if m["forced"] else "") + ")", f"  ({m['note']})"]
    if "deep_ep" in rep:
        L += ["", f"import deep_ep: {rep['deep_ep']['what']}"]
    if rep["env"]:
        L += ["", "Environment: " + ", ".join(f"{k}={v}" for k, v in rep["env"].items())]
    return "\n".join(L)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_ep.doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON document instead of the report")
    ap.add_argument("--sysfs-root", default=None, help="read sysfs from here (default MOE_EP_SYSFS_ROOT, else /sys)")
    ap.add_argument("--no-torch", action="store_true", help="do not import torch (GPUs from nvidia-smi or sysfs)")
    ap.add_argument("--no-pyverbs", action="store_true", help="skip the pyverbs cross-check")
    a = ap.parse_args(argv)
    rep = report(a.sysfs_root, use_torch=not a.no_torch, use_pyverbs=not a.no_pyverbs)
    print(json.dumps(rep, indent=2, default=str) if a.json else render(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
