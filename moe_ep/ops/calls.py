"""What one EPBuffer's dispatch and combine share: the buffer as they read it (``Parts``), what they
keep from one call to the next (``CallState``, its ``Replays``), and the machinery of a call: input
checks, the launch halves, receive hooks, the host-side error check. ``moe_ep.ops.dispatch`` and
``moe_ep.ops.combine`` hold what is each op's own (its validation, arguments and constexprs)."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Callable, Iterator, NoReturn, Optional

import torch

from ..core.errors import BufferBrokenError, CapacityError, CommTimeoutError, ErrorCode, Phase
from ..kernels.args import Remote, constexprs, node_groups
from ..kernels.launch import Launcher, compile_options
from .replay import Replay

if TYPE_CHECKING:
    from .buffer_memory import BufferMemory
    from .sizing import BufferShape
    from ..core.tuning import ResolvedTuning


class Weights(Enum):
    """The combine-time weights a combine call takes: none, pushed to the owners (masked and packed:
    ``[T, K]``) or the rows layout's per received row (``[rows of expert_x, K]``)."""

    NONE = "none"
    PUSHED = "pushed"
    ROWS = "rows"


class Replays:
    """The ``Replay`` of each set of inputs one buffer's calls take (``moe_ep.ops.replay``), by name;
    each set's tensors in the order written beside it, ``T`` the token count's dimension
    (``Replay.token_dims``). Attributes, not a lookup: the eager fast paths read them on every call."""

    __slots__ = ("dispatch", "dispatch_scales", "combine", "combine_out", "pushed", "pushed_out", "rows_weights",
                 "rows_weights_out")

    def __init__(self, graph: bool = False):
        """``graph``: entries of several launches launch them as one CUDA graph (``Replay(graph=)``)."""
        g = graph  # (short: it closes every line below)
        self.dispatch = Replay((0, 0, 0), g)             # x [T, H], topk_idx [T, K], topk_weights [T, K]
        self.dispatch_scales = Replay((0, 0, 0, 0), g)   # the same and x_scales [T, NB]
        self.combine = Replay((None,), g)                # expert_y (the buffer's shape)
        self.combine_out = Replay((None, 0), g)          # expert_y, out [T, H]
        self.pushed = Replay((None, 0), g)               # expert_y, pushed weights [T, K]
        self.pushed_out = Replay((None, 0, 0), g)        # expert_y, pushed weights, out
        self.rows_weights = Replay((None, None), g)      # expert_y, the rows layout's weights [rows, K]
        self.rows_weights_out = Replay((None, None, 0), g)  # expert_y, the rows layout's weights, out

    def of_dispatch(self, scales: bool) -> Replay:
        """The dispatch's, without or with ``x_scales``."""
        return self.dispatch_scales if scales else self.dispatch

    def of_combine(self, weights: Weights, out: bool) -> Replay:
        """The combine's with ``weights``, without or with the caller's ``out``."""
        if weights is Weights.NONE:
            return self.combine_out if out else self.combine
        if weights is Weights.PUSHED:
            return self.pushed_out if out else self.pushed
        return self.rows_weights_out if out else self.rows_weights

    def __iter__(self) -> Iterator[Replay]:
        return (getattr(self, name) for name in self.__slots__)


class CallState:
    """The state ``moe_ep.ops.dispatch`` and ``moe_ep.ops.combine`` read and advance on every call of one
    buffer (``Parts.calls``); host-side only, nothing here is read by a kernel but the
    addresses and the deadline passed as launch arguments.

    Attributes:
        launch: the buffer's ``Launcher`` (its launch plans by key).
        replays: the ``Replay`` of each set of inputs (``Replays``: dispatch without and with
            ``x_scales``; combine without and with ``out``, each without weights, with pushed
            weights or with the rows layout's).
        hooked: the same for calls with ``return_recv_hook`` (their entries' ``later`` steps: the
            receive half the hook launches).
        token_shapes: ``moe_ep.ops.dispatch.token_shape`` per token count (at most ``max_tokens + 1``).
        out_one, out_like: one bfloat16 element on the device and its ``[T, H]`` views per T
            (``moe_ep.ops.combine.new_output``).
        result_fields: the fields every ``DispatchResult`` of the buffer shares (no reference to
            the buffer: a deleted buffer frees its device memory at once).
        err_ptr, ws_ptr: addresses of the error record and of this rank's workspace.
        timeout_ns: the deadline of every wait, in nanoseconds.
        serial: dispatches issued (a ``DispatchResult`` carries the serial of its dispatch).
        epochs: ``[dispatch, combine]``: host mirror of the device's epochs (for error messages and
            the interpreter's host waits).
        pending: ``"dispatch"`` / ``"combine"`` issued with a receive hook not yet called, or None.
        closed: ``EPBuffer.close`` ran.
        broken: the error that made the buffer unusable, or None.
    """

    def __init__(self, device: torch.device, err: torch.Tensor, workspace: torch.Tensor, timeout_s: float,
                 result_fields: dict, proxy_err: Optional[int] = None, graph_launch: bool = False):
        """``err``: the buffer's int64 error record (host memory: its word 0 is read per call);
        ``workspace``: this rank's workspace bytes; ``proxy_err``: with peers on other nodes, the
        address of the proxy's error code (its mailbox word, host memory), else None;
        ``graph_launch``: replayed calls without a receive hook launch as one CUDA graph
        (``Tuning.graph_launch``, on a GPU)."""
        self.launch = Launcher(device)
        self.replays = Replays(graph_launch)
        self.hooked = Replays()  # (a hook's receive half is launched by the hook: never in a graph)
        self.token_shapes: dict = {}
        self.out_one = torch.empty(1, 1, dtype=torch.bfloat16, device=device)
        self.out_like: dict = {}
        self.result_fields = result_fields
        self.err_ptr, self.ws_ptr = err.data_ptr(), workspace.data_ptr()
        self.timeout_ns = int(timeout_s * 1e9)
        self.serial = 0
        self.epochs = [0, 0]
        self.pending: Optional[str] = None
        self.closed = False
        self.broken: Optional[BaseException] = None
        self.remote = proxy_err is not None  # (its calls' entries launch their receive half at the call too)
        # The proxy's error code, or the record's again (what ready() reads, ~50 ns each)
        self._proxy_code = ctypes.c_int64.from_address(proxy_err if proxy_err is not None else err.data_ptr())
        self._err_code = ctypes.c_int64.from_address(err.data_ptr())  # the record's word 0 (~50 ns a read)

    def error_code(self) -> int:
        """The error code a kernel recorded (0: none), read without a device sync."""
        return self._err_code.value

    def ready(self) -> bool:
        """Whether an eager call may take the replay fast path: the buffer is open, not broken, no
        kernel or proxy recorded an error and no receive hook is pending (what
        ``EPBuffer.check_usable`` and ``check_no_pending`` would pass without a word); else the
        full path raises what they raise."""
        return (not self.closed and self.broken is None and self.pending is None and not self._err_code.value
                and not self._proxy_code.value)

    def check_no_pending(self, op: str) -> None:
        """``ValueError`` where a receive hook of this buffer is still to be called (``op``: the call refused)."""
        if self.pending is not None:
            raise ValueError(f"{op}: this buffer's {self.pending} was issued with return_recv_hook=True and its "
                             f"receive hook has not been called yet (call it first)")

    def make_hook(self, op: str, recv: Callable[[], None], check_usable: Callable[[], None],
                  interp: bool) -> Callable[[], None]:
        """The receive hook of an ``op`` whose send half was just issued: calls ``check_usable``,
        issues ``recv`` once (then checks again under the interpreter, where the waits ran on the host)."""
        self.pending = op
        called = []

        def hook() -> None:
            if called:
                raise RuntimeError(f"{op} receive hook: already called")
            called.append(True)
            self.pending = None
            check_usable()
            recv()
            if interp:
                check_usable()
        return hook

    def fail(self, exc: BaseException) -> NoReturn:
        """Marks the buffer unusable by ``exc``, and raises it."""
        self.broken = exc
        raise exc


@dataclass(eq=False)
class Parts:
    """One ``EPBuffer`` as its dispatch and combine read it (``EPBuffer.parts``). No reference back
    to the ``EPBuffer``: a deleted buffer frees its memory at once, without the garbage collector.

    Attributes:
        shape: the arguments that size memory, checked (``moe_ep.ops.sizing.BufferShape``).
        tuning: the launch shape (``moe_ep.core.tuning.ResolvedTuning``).
        memory: every tensor, and across nodes the proxy (``moe_ep.ops.buffer_memory.BufferMemory``).
        calls: what the calls keep from one to the next (``CallState``).
        rank: this rank (global).
        timeout_s: the deadline of every wait for a peer, in seconds.
        interp: the kernels run in Triton's interpreter (CPU ranks): a call's send and receive
            halves are two launches with the host's wait for the peers' flags between them.
    """

    shape: "BufferShape"
    tuning: "ResolvedTuning"
    memory: "BufferMemory"
    calls: CallState
    rank: int
    timeout_s: float
    interp: bool

    @property
    def node0(self) -> int:
        """The first rank of this rank's node."""
        return self.rank - self.rank % self.shape.node_size

    def launch_options(self, kernel: str) -> dict:
        """The compile options of the ``kernel`` launch ("dispatch" or "combine"): ``num_warps``, and
        ``maxnreg`` where it has a register budget (not under the interpreter)."""
        t = self.tuning
        if kernel == "dispatch":
            warps, maxnreg = t.num_warps, t.dispatch_maxnreg
        elif kernel == "combine":
            warps, maxnreg = t.combine_warps or t.num_warps, t.combine_maxnreg
        else:
            raise ValueError(f"kernel: expected 'dispatch' or 'combine', got {kernel!r}")
        return compile_options(warps, "" if self.interp else maxnreg)

    def check_usable(self) -> None:
        """Raises where the buffer can take no call: closed (``RuntimeError``), broken by an earlier
        error (``BufferBrokenError``), or with an error a kernel or the proxy recorded since
        (``recorded_error``), which then breaks it. Host memory only: no device sync."""
        calls, remote = self.calls, self.memory.remote
        if calls.closed:
            raise RuntimeError("EPBuffer is closed")
        if calls.broken is not None:
            raise BufferBrokenError(f"this buffer is unusable after an earlier error: {calls.broken}")
        if calls.error_code():
            calls.broken = self.recorded_error()
            raise calls.broken
        if remote is not None:
            try:
                remote.check()  # the proxy's record and the remote kernels' (host memory, no sync)
            except Exception as exc:  # noqa: BLE001
                calls.fail(exc)

    def recorded_error(self) -> BaseException:
        """The error the kernels recorded (``BufferMemory.error_record``), as the host raises it:
        ``CommTimeoutError`` naming rank, peer, phase and epoch; ``ValueError`` for expert ids out
        of range; ``CapacityError`` naming the expert and the rank it overflowed on; the proxy's own
        error."""
        code, peer, phase, epoch, detail = self.memory.error_record()
        phase_name = Phase.text_of(phase)
        if code == ErrorCode.TIMEOUT:
            return CommTimeoutError(self.rank, peer, phase_name, epoch, self.timeout_s)
        if code == ErrorCode.BAD_EXPERT:
            return ValueError(f"topk_idx: {detail} expert ids outside [-1, {self.shape.num_experts}) in {phase_name} "
                              f"epoch {epoch} (treated as -1; nothing was written out of bounds)")
        if code == ErrorCode.CAPACITY:  # peer: the rank that overflowed (this one, or a node peer); detail: expert << 32 | rows
            where = "this rank" if peer == self.rank else f"rank {peer}"
            named = dict(rank=self.rank, peer=peer, phase=phase_name, epoch=epoch)  # (what a goodbye tells)
            if self.shape.layout == "rows":  # detail: the rows needed
                return CapacityError(f"rank {self.rank}: {where} needs {detail & 0xFFFFFFFF} rows in {phase_name} "
                                     f"epoch {epoch}, more than max_recv_rows={self.shape.capacity} (nothing was "
                                     f"written past it). Pass a larger max_recv_rows, or None to size the received "
                                     f"tensors per call.", **named)
            if self.shape.layout == "packed":  # detail: the first expert past the cap << 32 | the rows needed
                return CapacityError(f"rank {self.rank}: expert {detail >> 32} on {where} is past the packed layout's "
                                     f"cap: {where} needs {detail & 0xFFFFFFFF} rows in {phase_name} epoch {epoch}, "
                                     f"more than max_recv_rows={self.shape.capacity} (nothing was written past it). "
                                     f"Pass a larger max_recv_rows, or None to size expert_x per call.", **named)
            return CapacityError(f"rank {self.rank}: expert {detail >> 32} on {where} received {detail & 0xFFFFFFFF} "
                                 f"rows in {phase_name} epoch {epoch}, more than the masked layout holds "
                                 f"({self.shape.capacity} per expert); with the default capacity only possible when "
                                 f"tokens list an expert more than once. Use layout='packed' or a larger expert_capacity.",
                                 **named)
        if code == ErrorCode.PROXY and self.memory.remote is not None:  # the wait kernel saw the proxy's record
            try:
                self.memory.remote.check()
            except Exception as exc:  # noqa: BLE001
                return exc
        # (ERR_PROXY with no proxy record: the kernel saw an error word the proxy had not raised)
        return RuntimeError(f"rank {self.rank}: a kernel recorded error code {code} "
                            f"naming peer {peer} in {phase_name} epoch {epoch}, detail {detail}, with no matching "
                            f"record of its own on the host")


# ----------------------------------------------------------------------------- input checks

def on_device(t: torch.Tensor, device: torch.device) -> bool:
    """Whether tensor ``t`` is on ``device``: cheaper than comparing torch.device objects (this
    runs on every eager call)."""
    return t.is_cuda and t.get_device() == device.index if device.type == "cuda" else t.device == device


def check_tensor(name: str, t, dtypes: tuple, shape: tuple, device: torch.device) -> None:
    """``TypeError`` / ``ValueError`` naming input ``name`` unless ``t`` is a contiguous tensor of
    one of ``dtypes`` on ``device`` with ``shape`` (None: any size there)."""
    if (isinstance(t, torch.Tensor) and t.dtype in dtypes and len(t.shape) == len(shape)
            and all(s is None or a == s for a, s in zip(t.shape, shape)) and on_device(t, device) and t.is_contiguous()):
        return  # the common case, checked cheaply; below, the same checks one by one for the message
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and a != s for a, s in zip(t.shape, shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if not on_device(t, device):
        raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


def aligned(t: torch.Tensor) -> bool:
    """Whether ``t``'s data starts at a multiple of 16 bytes (a launch key: vector loads)."""
    return (t.data_ptr() & 15) == 0


# ----------------------------------------------------------------------------- launches and hooks

def node_dims(parts: Parts) -> dict:
    """The buffer's sizes as the node kernels name them: the fields of ``moe_ep.kernels.args.Dims``
    (the dispatch and combine kernels' ``DIM``), by name."""
    s = parts.shape
    return dict(RANK=parts.rank - parts.node0, NODE0=parts.node0, R=s.world_size, N=s.node_size, M=s.max_tokens,
                K=s.topk, E=s.num_experts, EL=s.num_local_experts, H=s.hidden, W=s.hidden * (1 if s.fp8 else 2) // 4,
                NB=max(1, s.num_scale_blocks), RB=s.workspace.RB, HDR=s.workspace.HDR, CMAX=s.chunks,
                ALIGN=s.expert_alignment, CAP=s.capacity)


def internode_consts(parts: Parts, consts: dict, remote: dict) -> dict:
    """An inter-node kernel's constexprs (``moe_ep.internode``): the node kernel's ``consts`` (as
    ``_dispatch_consts`` / ``_combine_consts`` give them, launch options included) with its groups
    as one ``NODE`` and the inter-node sizes ``remote`` (fields of ``Remote``) as ``REM``."""
    compiled = not parts.interp
    return dict(consts, NODE=node_groups(consts, compiled), REM=constexprs(Remote, remote, compiled))


def launch_halves(parts: Parts, key: tuple, kernel, args: tuple, dynamic: tuple, consts, host_wait,
                  fused: bool) -> list:
    """One launch doing both halves (``SEND`` and ``RECV``) where ``fused`` (the node kernels:
    ``tuning.fused``; the inter-node ones: ``tuning.fused_internode``); else the send half,
    ``host_wait()`` under the interpreter (which cannot spin in a kernel), then the receive half.
    ``consts()`` gives the constexprs without SEND/RECV; ``key`` names what can change them;
    ``dynamic``: positions in ``args`` that may differ between calls (the rest is the buffer's).
    Returns ``(plan, args)`` of each launch (``moe_ep.ops.replay``)."""
    if fused:
        return [(launch_half(parts, key, kernel, args, dynamic, consts, True, True), args)]
    first = launch_half(parts, key, kernel, args, dynamic, consts, True, False)
    if parts.interp:
        host_wait()
    return [(first, args), (launch_half(parts, key, kernel, args, dynamic, consts, False, True), args)]


def launch_half(parts: Parts, key: tuple, kernel, args: tuple, dynamic: tuple, consts, send: bool, recv: bool):
    """One half's launch on ``shape.num_programs`` programs; returns its plan (``Launcher``)."""
    return parts.calls.launch(key + (send, recv), kernel, parts.shape.num_programs, args,
                              lambda: dict(consts(), SEND=send, RECV=recv), dynamic)


def planned_half(parts: Parts, key: tuple, send: bool, recv: bool):
    """The plan of a half ``launch_half`` launched before with these arguments, or None."""
    return parts.calls.launch.planned(key + (send, recv))


def replayed_recv(parts: Parts, entry, inputs: tuple, wait, *wait_args) -> Callable[[], None]:
    """The receive half of a replayed call with a hook: ``entry``'s later launches with the call's
    ``inputs``, on the stream current when the hook runs (under the interpreter after
    ``wait(parts, *wait_args)``, the host's wait for the peers' flags)."""
    def recv() -> None:
        if parts.interp:
            wait(parts, *wait_args)
        entry.run_later(parts.calls.launch.stream(), inputs)
    return recv


def finish(parts: Parts, op: str, result, recv: Optional[Callable[[], None]]):
    """The end of an ``op`` just issued (its epoch counted): ``(result, hook)`` where ``recv`` is
    its receive half (a call with a hook), else ``result``, checked first under the interpreter
    (whose host waits may have seen a peer's error)."""
    if recv is not None:
        return result, parts.calls.make_hook(op, recv, parts.check_usable, parts.interp)
    if parts.interp:
        parts.check_usable()
    return result
