"""The one reader of moe_ep's environment variables but the tuning ones: transport, NICs, node memory, trace, ...

``VARIABLES`` declares each variable moe_ep reads (outside ``moe_ep.core.tuning``, which reads the
tuning ones: ``Tuning.from_env``): its name, the values it takes, what unset means and what it
does. The functions below read one variable each, from ``env`` (default ``os.environ``) at the
time of the call, never cached: a variable set before a buffer is built counts for that buffer.
A value a variable does not take raises ``ValueError`` naming the variable.

The native library (csrc/proxy) reads some of these itself, at the time it opens a library or a
device; ``native=True`` marks them (``NATIVE``): ``MOE_EP_CUDA_LIB``, ``MOE_EP_IBVERBS_LIB``,
``MOE_EP_LIBFABRIC_LIB``, ``MOE_EP_IB_DEVICE``, ``MOE_EP_IB_NICS``, ``MOE_EP_IB_PORT``,
``MOE_EP_IB_GID_INDEX``, ``MOE_EP_IB_TIMEOUT``, ``MOE_EP_IB_RETRY_CNT``, ``MOE_EP_FI_PROVIDER``,
``FI_PROVIDER`` and ``MOE_EP_FI_DOMAIN``. Those with no function here are read only there.

    settings.transport()            # "auto" unless MOE_EP_TRANSPORT says otherwise
    settings.environment()          # {name: value} of every variable moe_ep reads that is set
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

from .tuning import ENV as _TUNING_ENV

Env = Optional[Mapping[str, str]]  # an environment to read; None: os.environ

TRANSPORTS = ("auto", "verbs", "tcp", "efa", "libfabric")  # what MOE_EP_TRANSPORT takes
NODE_MEMORY = ("symm", "ipc")  # what MOE_EP_NODE_MEMORY may force
LAUNCH_PATHS = ("native", "triton")  # what MOE_EP_LAUNCH takes
TRACE_LEVELS = ("off", "phases", "peers")  # what MOE_EP_PROXY_TRACE takes (moe_ep.native.proxy.Proxy checks it)
TCP_HELLO_TIMEOUT_S, TCP_MAX_PENDING = 10.0, 256  # the tcp defaults (csrc/proxy/tcp_transport.cc)


@dataclass(frozen=True)
class Variable:
    """One environment variable moe_ep reads."""

    name: str
    accepts: str          # the values it takes
    default: str          # what unset (or empty) means
    meaning: str          # what it does, in one line
    native: bool = False  # the native library (csrc/proxy) reads it itself


VARIABLES = (
    # transport and proxy
    Variable("MOE_EP_TRANSPORT", " | ".join(TRANSPORTS), "auto",
             "the transport between nodes (moe_ep.internode.session.select_transport)"),
    Variable("MOE_EP_TCP_HOST", "a host name or address", "loopback on one host, else this host's address",
             "tcp: the address to listen on and advertise; also keeps libfabric's tcp / udp providers off lo"),
    Variable("MOE_EP_TCP_HELLO_TIMEOUT", "a positive number of seconds", f"{TCP_HELLO_TIMEOUT_S:g}",
             "tcp: how long an accepted connection may take to send a valid hello"),
    Variable("MOE_EP_TCP_MAX_PENDING", "a positive integer", str(TCP_MAX_PENDING),
             "tcp: connections that may wait for their hello at once; one more closes the oldest"),
    Variable("MOE_EP_PROXY_TRACE", " | ".join(TRACE_LEVELS), "phases", "what the proxy's trace records"),
    # NICs
    Variable("MOE_EP_IB_DEVICE", "a device, or a list: 'a,b' or 'a:1,b:2'", "the NIC(s) nearest the GPU",
             "the RDMA device(s) (verbs or EFA) a rank opens; a name listed twice is opened twice", native=True),
    Variable("MOE_EP_IB_NICS", "an integer (anything else: unset)",
             "as many as MOE_EP_IB_DEVICE lists, else verbs 1 and efa every EFA device behind the GPU's switch",
             "how many NICs a rank opens (the nearest ones)", native=True),
    Variable("MOE_EP_IB_PORT", "a port number (anything else: unset)", "the device's first active port, else 1",
             "the port of a device MOE_EP_IB_DEVICE names without one", native=True),
    Variable("MOE_EP_IB_GID_INDEX", "a GID index", "RoCE: the first IPv4-mapped RoCE v2 GID; InfiniBand: 0",
             "verbs: the GID index", native=True),
    Variable("MOE_EP_IB_TIMEOUT", "1 to 31", "14 (about 67 ms)", "verbs: the RC ACK timeout exponent", native=True),
    Variable("MOE_EP_IB_RETRY_CNT", "0 to 7", "6", "verbs: the RC retry count", native=True),
    Variable("MOE_EP_SYSFS_ROOT", "a directory", "/sys", "where NIC selection and the doctor read sysfs"),
    # libfabric
    Variable("MOE_EP_FI_PROVIDER", "a libfabric provider ('tcp', 'tcp;ofi_rxm', 'efa', ...)",
             "FI_PROVIDER, else efa where it fits, else libfabric's first that reaches other hosts (never shm)", "libfabric: the provider", native=True),
    Variable("FI_PROVIDER", "a libfabric provider", "none", "libfabric's own variable: the provider when "
             "MOE_EP_FI_PROVIDER is unset", native=True),
    Variable("MOE_EP_FI_DOMAIN", "a domain, or a list 'a,b' (endpoint i on the i % n-th)",
             "efa: the EFA devices chosen; else the provider's first", "libfabric: the domain(s)", native=True),
    Variable("MOE_EP_FI_ENDPOINTS", "a positive integer", "libfabric 1, efa one per EFA device",
             "libfabric: the endpoints per rank"),
    # libraries
    Variable("MOE_EP_NATIVE_LIB", "a path", "the library built with the package (or from csrc/proxy)",
             "the native library to load"),
    Variable("MOE_EP_IBVERBS_LIB", "a library name or path", "libibverbs.so.1", "the libibverbs to open",
             native=True),
    Variable("MOE_EP_LIBFABRIC_LIB", "a library name or path", "libfabric.so.1", "the libfabric to open",
             native=True),
    Variable("MOE_EP_CUDA_LIB", "a library name or path", "libcuda.so.1",
             "the CUDA driver to open (dma-buf registration, native kernel launches)", native=True),
    # ranks and node memory
    Variable("MOE_EP_NODE_SIZE", "a divisor of the world size", "the ranks on this host (GPU: if all reach "
             "each other peer to peer, else 1)", "ranks per node (EPGroup's node_size)"),
    Variable("MOE_EP_DEVICE", "cuda | cuda:N | cpu", "cuda:<LOCAL_RANK> for NCCL, else cpu",
             "EPGroup's device ('cuda': cuda:<LOCAL_RANK % GPUs>)"),
    Variable("MOE_EP_NODE_MEMORY", " | ".join(NODE_MEMORY), "symm when every rank of a node has its own GPU "
             "and torch symmetric memory, else ipc", "how node peers map each other's memory (the same on every rank)"),
    # kernels and benchmarks
    Variable("MOE_EP_LAUNCH", " | ".join(LAUNCH_PATHS), "native",
             "how cached kernel launches go: the native library's or Triton's launcher"),
    Variable("MOE_EP_COMMIT", "a commit name", "git rev-parse in the tree",
             "the commit the benchmarks record (a tree without .git)"),
)
_DECLARED = {v.name: v for v in VARIABLES}
TUNING = tuple(var for var, _ in _TUNING_ENV.values())  # the tuning variables (moe_ep.core.tuning reads them)
NATIVE = tuple(v.name for v in VARIABLES if v.native)    # those the native library reads itself
NAMES = tuple(_DECLARED) + TUNING                        # every variable moe_ep reads


def variable(name: str) -> Variable:
    """The declaration of ``name``; ``KeyError`` for a variable moe_ep does not read (a tuning one:
    see ``moe_ep.core.tuning.ENV``)."""
    try:
        return _DECLARED[name]
    except KeyError:
        raise KeyError(f"{name}: not a variable moe_ep.core.settings declares") from None


def value(name: str, env: Env = None) -> str:
    """The text of the declared variable ``name`` in ``env`` (default ``os.environ``); "" when unset."""
    variable(name)
    return (os.environ if env is None else env).get(name, "")


def environment(names: Iterable[str] = NAMES, env: Env = None) -> dict[str, str]:
    """``{name: value}`` of those of ``names`` (default: every variable moe_ep reads) set in ``env``."""
    env = os.environ if env is None else env
    return {k: env[k] for k in names if k in env}


def _one_of(name: str, text: str, choices: tuple) -> str:
    if text not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(choices)}, got {text!r}")
    return text


def _positive(name: str, text: str, kind: type):
    """``text`` as a positive ``kind`` (``float``: finite), else ``ValueError`` naming ``name``."""
    try:
        v = kind(text)
    except ValueError:
        v = None
    if v is None or not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name}={text!r}: expected a positive {'number' if kind is float else 'integer'}")
    return v


def _lenient_int(text: str) -> int:
    """``text`` as an integer (Python's literal forms), 0 for anything else: how NIC counts and
    ports are read (the native library too takes a bad value as unset)."""
    try:
        return int(text, 0)
    except ValueError:
        return 0


# ----------------------------------------------------------------------------- transport and proxy

def transport(name: Optional[str] = None, env: Env = None) -> str:
    """``MOE_EP_TRANSPORT``: ``name`` when given (an argument standing for the variable), else the
    variable, else ``auto``; lower case, one of ``TRANSPORTS``."""
    want = (name or value("MOE_EP_TRANSPORT", env) or "auto").strip().lower()
    if want not in TRANSPORTS:
        raise ValueError(f"MOE_EP_TRANSPORT={want!r}: expected one of {', '.join(TRANSPORTS)}")
    return want


def tcp_host(env: Env = None) -> str:
    """``MOE_EP_TCP_HOST``: the address tcp listens on and advertises ("": the default)."""
    return value("MOE_EP_TCP_HOST", env)


def tcp_hello_timeout(env: Env = None) -> float:
    """``MOE_EP_TCP_HELLO_TIMEOUT``: seconds for a valid hello (a positive number, default 10)."""
    text = value("MOE_EP_TCP_HELLO_TIMEOUT", env).strip()
    return _positive("MOE_EP_TCP_HELLO_TIMEOUT", text, float) if text else TCP_HELLO_TIMEOUT_S


def tcp_max_pending(env: Env = None) -> int:
    """``MOE_EP_TCP_MAX_PENDING``: connections waiting for their hello (a positive integer, default 256)."""
    text = value("MOE_EP_TCP_MAX_PENDING", env).strip()
    return _positive("MOE_EP_TCP_MAX_PENDING", text, int) if text else TCP_MAX_PENDING


def proxy_trace(env: Env = None) -> str:
    """``MOE_EP_PROXY_TRACE``: the proxy's trace level, default ``phases`` (``Proxy`` checks it)."""
    return value("MOE_EP_PROXY_TRACE", env) or "phases"


# ----------------------------------------------------------------------------- NICs

def ib_devices(env: Env = None) -> list[str]:
    """``MOE_EP_IB_DEVICE``: its entries (``name`` or ``name:port``), [] when unset."""
    return [e for e in value("MOE_EP_IB_DEVICE", env).split(",") if e]


def ib_nics(env: Env = None) -> int:
    """``MOE_EP_IB_NICS``: NICs per rank; 0 (or less) when unset or not an integer."""
    return _lenient_int(value("MOE_EP_IB_NICS", env))


def ib_port(env: Env = None) -> int:
    """``MOE_EP_IB_PORT``: the port of a listed device without one; 0 when unset or not an integer."""
    return _lenient_int(value("MOE_EP_IB_PORT", env))


def sysfs_root(env: Env = None) -> str:
    """``MOE_EP_SYSFS_ROOT``: where sysfs is read, default ``/sys``."""
    return value("MOE_EP_SYSFS_ROOT", env) or "/sys"


# ----------------------------------------------------------------------------- libfabric

def fi_provider(env: Env = None) -> str:
    """``MOE_EP_FI_PROVIDER``, else ``FI_PROVIDER``; "" when neither is set (the native default)."""
    return value("MOE_EP_FI_PROVIDER", env) or value("FI_PROVIDER", env)


def fi_domain(env: Env = None) -> str:
    """``MOE_EP_FI_DOMAIN``: libfabric's domain(s); "" when unset (the native default)."""
    return value("MOE_EP_FI_DOMAIN", env)


def fi_endpoints(env: Env = None) -> Optional[int]:
    """``MOE_EP_FI_ENDPOINTS``: endpoints per rank (a positive integer); None when unset."""
    text = value("MOE_EP_FI_ENDPOINTS", env).strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"MOE_EP_FI_ENDPOINTS={text!r}: expected a positive integer")
    return int(text)


# ----------------------------------------------------------------------------- libraries

def native_lib(env: Env = None) -> str:
    """``MOE_EP_NATIVE_LIB``: the native library's path; "" when unset (the package's own)."""
    return value("MOE_EP_NATIVE_LIB", env)


def ibverbs_lib(env: Env = None) -> str:
    """``MOE_EP_IBVERBS_LIB``: the libibverbs to open, default ``libibverbs.so.1``."""
    return value("MOE_EP_IBVERBS_LIB", env) or "libibverbs.so.1"


def cuda_lib(env: Env = None) -> str:
    """``MOE_EP_CUDA_LIB``: the CUDA driver library to open, default ``libcuda.so.1``."""
    return value("MOE_EP_CUDA_LIB", env) or "libcuda.so.1"


# ----------------------------------------------------------------------------- ranks and node memory

def node_size(env: Env = None) -> Optional[int]:
    """``MOE_EP_NODE_SIZE``: ranks per node; None when unset (``EPGroup`` checks it divides R)."""
    text = value("MOE_EP_NODE_SIZE", env)
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"MOE_EP_NODE_SIZE: expected an integer, got {text!r}") from None


def device(env: Env = None) -> str:
    """``MOE_EP_DEVICE``: ``cuda``, ``cuda:N`` or ``cpu`` ("": unset), as ``moe_ep.core.group.env_device``
    reads it."""
    return value("MOE_EP_DEVICE", env)


def set_device(name: str) -> None:
    """Sets ``MOE_EP_DEVICE`` in this process (``init_distributed``: ranks sharing GPUs)."""
    variable("MOE_EP_DEVICE")
    os.environ["MOE_EP_DEVICE"] = name


def node_memory(env: Env = None) -> Optional[str]:
    """``MOE_EP_NODE_MEMORY``: ``symm`` or ``ipc`` (lower-cased), None when unset."""
    forced = value("MOE_EP_NODE_MEMORY", env).strip().lower() or None
    return None if forced is None else _one_of("MOE_EP_NODE_MEMORY", forced, NODE_MEMORY)


# ----------------------------------------------------------------------------- kernels and benchmarks

def launch_path(env: Env = None) -> str:
    """``MOE_EP_LAUNCH``: ``native`` (default) or ``triton``."""
    return _one_of("MOE_EP_LAUNCH", value("MOE_EP_LAUNCH", env) or "native", LAUNCH_PATHS)


def commit(env: Env = None) -> str:
    """``MOE_EP_COMMIT``: the commit a benchmark records ("": ask git)."""
    return value("MOE_EP_COMMIT", env)
