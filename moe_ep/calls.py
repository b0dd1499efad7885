"""CallState: what one EPBuffer's dispatch and combine calls keep from one call to the next (the
buffer's memory and launch shapes are ``EPBuffer``'s, ``moe_ep/buffer.py``)."""
from __future__ import annotations

import ctypes
from enum import Enum
from typing import Callable, Iterator, NoReturn, Optional

import torch

from .kernels.launch import Launcher
from .replay import Replay


class Weights(Enum):
    """The combine-time weights a combine call takes: none, pushed to the owners (masked and packed:
    ``[T, K]``) or the rows layout's per received row (``[R*max_tokens, K]``)."""

    NONE = "none"
    PUSHED = "pushed"
    ROWS = "rows"


class Replays:
    """The ``Replay`` of each set of inputs one buffer's calls take (``moe_ep.replay``), by name;
    each set's tensors in this order, the token count's dimension in brackets (``Replay.token_dims``).
    Attributes, not a lookup: the eager fast paths read them on every call."""

    __slots__ = ("dispatch", "dispatch_scales", "combine", "combine_out", "pushed", "pushed_out", "rows_weights",
                 "rows_weights_out")

    def __init__(self):
        self.dispatch = Replay((0, 0, 0))             # x [T, H], topk_idx [T, K], topk_weights [T, K]
        self.dispatch_scales = Replay((0, 0, 0, 0))   # the same and x_scales [T, NB]
        self.combine = Replay((None,))                # expert_y (the buffer's shape)
        self.combine_out = Replay((None, 0))          # expert_y, out [T, H]
        self.pushed = Replay((None, 0))               # expert_y, pushed weights [T, K]
        self.pushed_out = Replay((None, 0, 0))        # expert_y, pushed weights, out
        self.rows_weights = Replay((None, None))      # expert_y, the rows layout's weights [R*M, K]
        self.rows_weights_out = Replay((None, None, 0))  # expert_y, the rows layout's weights, out

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
    """The state ``moe_ep.dispatch`` and ``moe_ep.combine`` read and advance on every call of one
    buffer (``EPBuffer.calls``); host-side only, nothing here is read by a kernel but the
    addresses and the deadline passed as launch arguments.

    Attributes:
        launch: the buffer's ``Launcher`` (its launch plans by key).
        replays: the ``Replay`` of each set of inputs (``Replays``: dispatch without and with
            ``x_scales``; combine without and with ``out``, each without weights, with pushed
            weights or with the rows layout's).
        hooked: the same for calls with ``return_recv_hook`` (their entries' ``later`` steps: the
            receive half the hook launches).
        token_shapes: ``moe_ep.dispatch.token_shape`` per token count (at most ``max_tokens + 1``).
        out_one, out_like: one bfloat16 element on the device and its ``[T, H]`` views per T
            (``moe_ep.combine.new_output``).
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
                 result_fields: dict, proxy_err: Optional[int] = None):
        """``err``: the buffer's int64 error record (host memory: its word 0 is read per call);
        ``workspace``: this rank's workspace bytes; ``proxy_err``: with peers on other nodes, the
        address of the proxy's error code (its mailbox word, host memory), else None."""
        self.launch = Launcher(device)
        self.replays = Replays()
        self.hooked = Replays()
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
