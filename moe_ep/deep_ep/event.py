"""``EventOverlap``: DeepEP's event wrapper, over a ``torch.cuda.Event`` (or, on CPU, an event that
is always complete: every CPU call has finished when it returns)."""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch


class CpuEvent:
    """The event of a call on CPU ranks: the work is done when the call returns."""

    def current_stream_wait(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""


def record_event(device: torch.device, stream=None):
    """An event recorded now on ``stream`` (default: the current stream of ``device``); a
    ``CpuEvent`` on CPU."""
    if device.type != "cuda":
        return CpuEvent()
    ev = torch.cuda.Event()
    ev.record(stream if stream is not None else torch.cuda.current_stream(device))
    return ev


class EventOverlap:
    """An event to overlap work with (DeepEP's ``EventOverlap``).

    Args:
        event: a ``torch.cuda.Event`` (or ``CpuEvent``); None when the call was not
            ``async_finish`` (DeepEP's event is "valid only if async_finish is set").
        extra_tensors: tensors kept alive until the event is waited for (DeepEP's stand-in for
            ``record_stream``).
    """

    def __init__(self, event: Optional[Any] = None, extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self._release_handle_by_call = False
        self.hook_after_wait: Optional[Callable[[], None]] = None

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """The current stream waits for the event (a no-op on CPU)."""
        if self.event is None:
            raise RuntimeError("EventOverlap.current_stream_wait: no event (the call was not async_finish=True)")
        if isinstance(self.event, torch.cuda.Event):
            torch.cuda.current_stream().wait_event(self.event)
        else:
            self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            hook, self.hook_after_wait = self.hook_after_wait, None
            hook()
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable[[], None]) -> None:
        """``hook_after_wait()`` runs once, after the next ``current_stream_wait()``."""
        if self.hook_after_wait is not None:
            raise RuntimeError("EventOverlap.register_hook_after_wait: a hook is already registered")
        self.hook_after_wait = hook_after_wait

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        self._release_handle_by_call = release_handle
        return self

    def __enter__(self) -> "EventOverlap":
        """``with event:`` runs the block, then the current stream waits for the event."""
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release_handle_by_call)
        self._release_handle_by_call = False
