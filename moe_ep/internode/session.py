"""Starting a rank's proxy from an ``EPGroup``: engine, regions, endpoint exchange, thread.

The endpoints travel through the group's process group (``all_gather_object``), so a job needs
nothing beyond what ``torch.distributed`` already set up. The transport comes from
``MOE_EP_TRANSPORT`` (``auto`` | ``efa`` | ``verbs`` | ``tcp`` | ``libfabric``). ``efa`` is the
libfabric transport with libfabric's ``efa`` provider (``FabricTransport(provider="efa")``; there is
no other EFA transport). ``auto`` takes efa when every rank's libfabric finds a usable efa provider
on its EFA devices, else verbs when every rank has a usable (non-EFA) verbs device, else tcp;
``libfabric`` with another provider only when asked for (provider ``MOE_EP_FI_PROVIDER``, endpoints
per rank ``MOE_EP_FI_ENDPOINTS``, default 1; tcp and udp providers stay on ``lo`` when every rank
shares this host, else ``MOE_EP_FI_DOMAIN`` or the provider's first interface). Each rank's NIC is
the one nearest its GPU (``moe_ep.native.nic``; ``MOE_EP_IB_DEVICE`` overrides it;
``MOE_EP_IB_NICS=k``: the k nearest, over which verbs shards every write; every rank must open as
many). For efa, every EFA device behind the GPU's PCIe switch (p5: 4) is opened as its libfabric
domain (``<device>-rdm``), one endpoint each, writes sharded over them; ranks that found different
numbers all open the smallest. Rank 0 logs the choice, why, and its NIC(s) in one line.

Each session gets a new ``JobIdentity`` (``identity.agree_identity``: rank 0 draws a 128-bit
secret and a session epoch, every rank gets them through the process group); the engines check
it in every hello, so only this session's ranks get in (docs/ARCHITECTURE.md §9, "Who gets in").
"""
from __future__ import annotations

import logging
import socket
from typing import TYPE_CHECKING, Callable, Optional

from ..core import settings
from ..native import nic as _nic
from ..native.identity import agree_identity
from ..native.library import NativeError
from ..native.probes import fabric_probe, verbs_probe
from ..native.proxy import Proxy
from ..native.transports import Engine, FabricTransport, TcpTransport, VerbsTransport

if TYPE_CHECKING:  # not at run time: moe_ep.tools.doctor uses this module without torch
    from ..core.group import EPGroup

TRANSPORTS = settings.TRANSPORTS
_log = logging.getLogger(__name__)
Probe = Callable[[], "tuple[bool, str]"]


def _bind_host(group: EPGroup) -> str:
    host = settings.tcp_host()
    if host:
        return host
    hosts = group.all_gather_object(socket.gethostname())
    if len(set(hosts)) == 1:
        return "127.0.0.1"  # one host: stay on loopback
    return socket.gethostbyname(socket.gethostname())


def efa_probe(domain: Optional[str] = None) -> tuple[bool, str]:
    """Whether the efa transport can start here: libfabric's ``efa`` provider on ``domain`` (the
    EFA devices' domains, ``"a-rdm,b-rdm"``; default ``MOE_EP_FI_DOMAIN``, else its first)."""
    return fabric_probe("efa", domain)


def select_transport(name: Optional[str] = None, *, probes: Optional[dict[str, Probe]] = None) -> tuple[str, str]:
    """This rank's transport and why: ``name`` (default ``MOE_EP_TRANSPORT``, else ``auto``).

    ``auto``: efa (libfabric, provider efa) when libfabric's efa provider is usable here, else
    verbs when a verbs device is, else tcp. Asking for ``efa``, ``verbs`` or ``libfabric`` where
    none is usable raises ``NativeError`` naming what is missing; an unknown name raises
    ``ValueError``. ``probes`` (``{"efa": f, "verbs": f, "libfabric": f}``, each
    ``() -> (ok, what)``) replace ``efa_probe`` / ``verbs_probe`` / ``fabric_probe``: the devices a
    rank will use (``nic_probes``), or fakes in tests.
    """
    want = settings.transport(name)
    if want == "tcp":
        return "tcp", "MOE_EP_TRANSPORT=tcp"
    probe = {"efa": efa_probe, "verbs": verbs_probe, "libfabric": fabric_probe, **(probes or {})}
    if want != "auto":
        ok, what = probe[want]()
        if not ok:
            dev = {"efa": "EFA device (libfabric provider efa)", "verbs": "verbs device",
                   "libfabric": "libfabric provider"}[want]
            raise NativeError(f"MOE_EP_TRANSPORT={want}, but no {dev} is usable: {what}")
        return want, f"MOE_EP_TRANSPORT={want}: {what}"
    ok, efa_what = probe["efa"]()
    if ok:
        return "efa", f"auto: efa (libfabric) {efa_what}"
    ok, what = probe["verbs"]()
    if ok:
        return "verbs", f"auto: verbs {what}"
    return "tcp", f"auto: efa (libfabric provider efa) not usable: {efa_what}; verbs not usable: {what}"


def choose_nics(gpu_index: Optional[int] = None, root: Optional[str] = None) -> dict[str, _nic.NicChoice]:
    """This rank's NIC for each RDMA transport (``moe_ep.native.nic.choose_nic`` over sysfs):
    nearest the CUDA device ``gpu_index``, or, for a CPU rank (None), the first active one."""
    devices = _nic.list_devices(root)
    gpu = None
    if gpu_index is not None:
        bdf = _nic.torch_gpu_bdf(gpu_index)
        gpu = _nic.gpu_pci(bdf, root) if bdf else _nic.GpuPci("")
    # verbs: MOE_EP_IB_NICS (else 1) NICs; efa: every EFA device behind the GPU's switch (efa_count).
    return {"verbs": _nic.choose_nic(devices, "verbs", gpu, gpu_index or 0),
            "efa": _nic.choose_nic(devices, "efa", gpu, gpu_index or 0, count=_nic.efa_count(devices, gpu))}


def efa_domains(nic: Optional[_nic.NicChoice]) -> Optional[str]:
    """The libfabric domains of the EFA devices ``nic`` chose (``"rdmap16s27-rdm,..."``), or None
    (the native default: ``MOE_EP_FI_DOMAIN``, else the efa provider's first) when
    ``MOE_EP_FI_DOMAIN`` is set or sysfs offered no EFA device."""
    if settings.fi_domain() or nic is None or not nic.devices:
        return None
    return ",".join(_nic.efa_domain(d) for d in nic.devices)


def nic_probes(nics: dict[str, _nic.NicChoice]) -> dict[str, Probe]:
    """``select_transport`` probes that check the devices ``nics`` chose (the native default
    where sysfs offered none)."""
    return {"efa": lambda: efa_probe(efa_domains(nics["efa"])),
            "verbs": lambda: verbs_probe(nics["verbs"].spec, nics["verbs"].port or 0)}


def _agreed_transport(group: EPGroup, name: Optional[str]) -> tuple[str, Optional[_nic.NicChoice]]:
    """Every rank's choice, gathered: auto falls back to tcp unless every rank can use the same
    RDMA transport; a rank that cannot start the transport it was asked for fails every rank
    (none waits alone). Returns the transport and this rank's NIC for it (None for tcp)."""
    dev = getattr(group, "device", None)
    nics = choose_nics(dev.index if getattr(dev, "type", "") == "cuda" else None)
    try:
        kind, why = select_transport(name, probes=nic_probes(nics))
        err: Optional[Exception] = None
    except (NativeError, ValueError) as e:
        kind, why, err = "", str(e), e
    choices = group.all_gather_object((kind, why))
    failed = [r for r, (k, _) in enumerate(choices) if not k]
    if failed:
        if err is not None:
            raise err
        raise NativeError(f"rank {group.rank}: rank {failed[0]} cannot start its transport: {choices[failed[0]][1]}")
    kinds = [k for k, _ in choices]
    if len(set(kinds)) > 1:
        bad = next(r for r, k in enumerate(kinds) if k != kinds[0])
        kind, why = "tcp", f"auto: rank 0 has {kinds[0]}, rank {bad} {kinds[bad]} ({choices[bad][1]})"
    nic = nics.get(kind)
    if kind == "verbs":  # writes are sharded over the NICs: every rank must open as many
        counts = group.all_gather_object(nic.nics)
        if len(set(counts)) > 1:
            bad = next(r for r, n in enumerate(counts) if n != counts[0])
            raise NativeError(f"rank {group.rank}: ranks open different numbers of NICs (rank 0: {counts[0]}, "
                              f"rank {bad}: {counts[bad]}); set MOE_EP_IB_NICS (or MOE_EP_IB_DEVICE) alike on every rank")
    if kind == "efa" and settings.fi_endpoints() is None:  # one endpoint per EFA device
        counts = group.all_gather_object(max(1, len(nic.devices)))
        least = min(counts)
        if least < counts[group.rank] and nic.devices:  # every rank opens the smallest number
            nic = _nic.NicChoice(",".join(nic.devices[:least]), nic.port, f"{nic.reason}; {least} of "
                                 f"{counts[group.rank]} (a rank found only {least})", nic.ports[:least], least)
    elif kind in ("libfabric", "efa"):  # writes are sharded over the endpoints: every rank must open as many
        counts = group.all_gather_object(fabric_endpoints())
        if len(set(counts)) > 1:
            bad = next(r for r, n in enumerate(counts) if n != counts[0])
            raise NativeError(f"rank {group.rank}: ranks open different numbers of libfabric endpoints (rank 0: "
                              f"{counts[0]}, rank {bad}: {counts[bad]}); set MOE_EP_FI_ENDPOINTS alike on every rank")
    if group.rank == 0:
        _log.info("moe_ep proxy transport: %s (%s)%s", kind, why, f"; NIC {nic}" if nic else "")
    return kind, nic


def fabric_endpoints() -> int:
    """The libfabric endpoints per rank: ``MOE_EP_FI_ENDPOINTS`` (a positive integer), else 1."""
    return settings.fi_endpoints() or 1


def _fabric_domain(group: EPGroup) -> Optional[str]:
    """``"lo"`` for a tcp or udp provider when every rank shares this host (and neither
    ``MOE_EP_FI_DOMAIN`` nor ``MOE_EP_TCP_HOST`` says otherwise); else None (the native default)."""
    if settings.fi_domain() or settings.tcp_host():
        return None
    prov = settings.fi_provider()
    one_host = len(set(group.all_gather_object(socket.gethostname()))) == 1
    return "lo" if one_host and prov.split(";")[0] in ("tcp", "udp") else None


def make_engine(group: EPGroup, kind: str, nic: Optional[_nic.NicChoice], identity, *, streams: int = 4,
                bind_host: Optional[str] = None) -> Engine:
    """This rank's engine of transport ``kind`` on ``nic`` (``_agreed_transport``'s choice): verbs on
    its NICs; efa as libfabric's efa provider on its EFA devices' domains, one endpoint each (or
    ``MOE_EP_FI_ENDPOINTS``); libfabric on ``MOE_EP_FI_PROVIDER``; else tcp."""
    if kind == "verbs":
        return VerbsTransport(group.rank, group.world_size, device=nic.spec, port=nic.port or 0, nics=nic.nics,
                              identity=identity)
    if kind == "efa":
        endpoints = settings.fi_endpoints() or 0
        return FabricTransport(group.rank, group.world_size, provider="efa", domain=efa_domains(nic),
                               endpoints=endpoints, identity=identity)
    if kind == "libfabric":
        return FabricTransport(group.rank, group.world_size, domain=_fabric_domain(group),
                               endpoints=fabric_endpoints(), identity=identity)
    return TcpTransport(group.rank, group.world_size, streams=streams, bind_host=bind_host or _bind_host(group),
                        identity=identity)


CPU_IDLE_SLEEP_US = 500.0  # an idle proxy's poll interval on CPU ranks (GPU ranks: Proxy's 20 us)


def start_proxy(group: EPGroup, *, num_local_experts: int, row_bytes: int, comb_row_bytes: int,
                private_capacity: int, overflow_capacity: int, max_send_rows: int, timeout_s: float = 30.0,
                streams: int = 4, bind_host: Optional[str] = None, transport: Optional[str] = None,
                regions: Optional[dict] = None, mailbox=None, trace: Optional[str] = None) -> Proxy:
    """Creates this rank's engine (``transport``, default ``MOE_EP_TRANSPORT``: see
    ``select_transport``) and §10 proxy, exchanges endpoints over ``group`` (collective:
    every rank calls it with the same sizes), connects, and starts the proxy thread.

    ``bind_host``: the address peers reach this rank at (default ``MOE_EP_TCP_HOST``, else loopback
    when every rank shares this host, else this host's address). ``regions`` / ``mailbox``: the
    memory to use (``Proxy``'s arguments; default: numpy arrays it allocates); ``regions`` may be
    a function of the engine, called once it exists (to choose what it can register). The engine gets
    this session's ``JobIdentity`` (drawn by rank 0); tcp takes ``MOE_EP_TCP_HELLO_TIMEOUT`` and
    ``MOE_EP_TCP_MAX_PENDING`` (``TcpTransport``). ``trace``: the proxy's trace level (``Proxy``'s
    ``trace``; default ``MOE_EP_PROXY_TRACE``, else ``"phases"``).
    """
    kind, nic = _agreed_transport(group, transport)
    identity = agree_identity(group)
    engine = make_engine(group, kind, nic, identity, streams=streams, bind_host=bind_host)
    # A write not acknowledged within the phase deadline fails the phase anyway; libfabric's
    # liveness window is the op timeout too, so a silent peer is lost within timeout_s.
    engine.set_op_timeout(timeout_s)
    # CPU ranks (kernels in the interpreter, milliseconds each) poll their idle proxy every
    # CPU_IDLE_SLEEP_US: at the GPU's 20 us, each idle proxy woke 50,000 times a second, and a
    # few ranks' proxies on a 2-core machine took the cores from the ranks themselves.
    sleep_us = CPU_IDLE_SLEEP_US if group.device.type == "cpu" else 20.0
    if callable(regions):  # chosen for this engine (what it can register)
        regions = regions(engine)
    proxy = Proxy(engine, node_size=group.node_size, num_local_experts=num_local_experts, row_bytes=row_bytes,
                  comb_row_bytes=comb_row_bytes, private_capacity=private_capacity,
                  overflow_capacity=overflow_capacity, max_send_rows=max_send_rows, timeout_s=timeout_s,
                  sleep_us=sleep_us, trace=trace or settings.proxy_trace(),
                  regions=regions, mailbox=mailbox)
    engine.connect(group.all_gather_object(engine.endpoint), timeout_s)
    proxy.start()
    return proxy
