"""A progress bar for sweeps on stderr (rank 0 only; one line per step when stderr is not a terminal)."""
from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, enabled: bool, stream: TextIO = sys.stderr, width: int = 24):
        self.total, self.enabled, self.stream, self.width = max(1, total), enabled, stream, width
        self.done = 0
        self.t0 = time.monotonic()
        self.tty = enabled and getattr(stream, "isatty", lambda: False)()

    def step(self, what: str) -> None:
        """Announces the step about to run (``what``)."""
        if not self.enabled:
            return
        fill = self.width * self.done // self.total
        bar = "#" * fill + "." * (self.width - fill)
        line = f"[{bar}] {self.done + 1}/{self.total} {time.monotonic() - self.t0:6.1f}s {what}"
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.done += 1

    def finish(self) -> None:
        if self.enabled:
            end = f"[{'#' * self.width}] {self.total}/{self.total} {time.monotonic() - self.t0:6.1f}s done"
            self.stream.write(("\r\033[K" if self.tty else "") + end + "\n")
            self.stream.flush()
