"""``EventHandle`` and ``EventOverlap``: DeepEP's event types (``deep_ep.utils``), over a
``torch.cuda.Event`` on a GPU, or on CPU ranks an event that is always complete (every CPU call
has finished when it returns)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch

from ..core.interpret import interpreting


class CpuEvent:
    """The event of a call on CPU ranks: the work is done when the call returns."""

    def current_stream_wait(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""


def _gpu_now() -> bool:
    """True when the current stream is a CUDA stream (a GPU is there and kernels run on it, not in
    the CPU interpreter)."""
    return torch.cuda.is_available() and not interpreting()


class EventHandle:
    """DeepEP's ``EventHandle`` (its C++ extension's): an event recorded on the current stream when
    made (``EventHandle()``) or on ``stream``; ``current_stream_wait()`` makes the then current
    stream wait for it. On CPU ranks it is complete from the start.

    Attributes:
        event: the ``torch.cuda.Event`` recorded, or a ``CpuEvent``.
    """

    def __init__(self, stream: Optional[Any] = None) -> None:
        if stream is None and not _gpu_now():
            self.event: Any = CpuEvent()
            return
        self.event = torch.cuda.Event()
        self.event.record(stream if stream is not None else torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        """The current stream waits for the event (nothing on CPU)."""
        stream_wait(None, self)

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()


def stream_wait(stream: Optional[Any], event: Any) -> None:
    """``stream`` (None: the current stream) waits for ``event``: a ``torch.cuda.Event``, an
    ``EventHandle``, an ``EventOverlap`` (its event) or a ``CpuEvent`` (nothing to wait for)."""
    if isinstance(event, EventOverlap):
        event = event.event
    if isinstance(event, EventHandle):
        event = event.event
    if event is None or isinstance(event, CpuEvent):
        return
    if not isinstance(event, torch.cuda.Event):
        raise TypeError(f"event: expected an EventHandle, EventOverlap or torch.cuda.Event, got {type(event).__name__}")
    (stream if stream is not None else torch.cuda.current_stream()).wait_event(event)


def record_event(device: torch.device, stream=None) -> EventHandle:
    """An ``EventHandle`` recorded now on ``stream`` (default: the current stream of ``device``);
    complete on CPU."""
    if device.type != "cuda":
        h = EventHandle.__new__(EventHandle)
        h.event = CpuEvent()
        return h
    return EventHandle(stream if stream is not None else torch.cuda.current_stream(device))


class EventOverlap:
    """An event to overlap work with (DeepEP's ``deep_ep.utils.EventOverlap``, V1 and V2).

    Args:
        event: an ``EventHandle`` (or a ``torch.cuda.Event`` / ``CpuEvent``); None when the call was
            not asynchronous (DeepEP's event is "valid only if async_finish is set").
        extra_tensors: tensors kept alive until the event is waited for (DeepEP's stand-in for
            ``record_stream``).

    ``EventOverlap(EventHandle())`` is DeepEP's idiom for "the current stream so far", passed as
    ``previous_event``.
    """

    def __init__(self, event: Optional[Any] = None, extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self._release_handle_by_call = False
        self.hook_after_wait: Optional[Callable[[], Any]] = None

    def current_stream_wait(self, release_handle: bool = False) -> Any:
        """The current stream waits for the event (a no-op on CPU); then the hook registered with
        ``register_hook_after_wait`` runs once. Returns the hook's result (None without one)."""
        if self.event is None:
            raise RuntimeError("EventOverlap.current_stream_wait: no event (the call was not async_finish=True / "
                               "async_with_compute_stream=True)")
        stream_wait(None, self.event)
        result = None
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            result = hook()
        if release_handle:
            self.event = None
        return result

    def wait(self) -> Any:
        """``current_stream_wait()`` (DeepEP V2's name)."""
        return self.current_stream_wait()

    def register_hook_after_wait(self, hook_after_wait: Callable[[], Any]) -> None:
        """``hook_after_wait()`` runs once, after the next ``current_stream_wait()``."""
        if self.hook_after_wait is not None:
            raise RuntimeError("EventOverlap.register_hook_after_wait: a hook is already registered")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        """``with event(release_handle=True):``: as ``with event:``, dropping the event after."""
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> "EventOverlap":
        """``with event:`` runs the block, then the current stream waits for the event."""
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False
