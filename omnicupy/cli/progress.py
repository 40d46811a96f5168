"""The progress line of long commands: counts per outcome, elapsed time and an ETA. Knows terminals,
not what is being done (``update`` takes a status word and a label)."""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

from .common import human_duration


class Progress:
    """One line on stderr: rewritten in place on a terminal, every tenth of the way otherwise."""

    WIDTH = 24
    STATUSES = ("built", "cached", "failed")

    def __init__(self, total: int, stream: Optional[TextIO] = None, enabled: bool = True) -> None:
        self.total, self.stream, self.enabled = total, stream or sys.stderr, enabled and total > 0
        self.tty = self.enabled and self.stream.isatty()
        self.start = time.perf_counter()
        self.counts = {status: 0 for status in self.STATUSES}
        self.done = 0
        self._shown_tenths = -1
        self._width = 0

    def eta(self, now: Optional[float] = None) -> Optional[float]:
        """Seconds left at the average pace so far (None before the first item)."""
        if not self.done:
            return None
        elapsed = (time.perf_counter() if now is None else now) - self.start
        return elapsed / self.done * (self.total - self.done)

    def line(self, label: str) -> str:
        filled = self.WIDTH * self.done // self.total
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        c = self.counts
        left = self.eta()
        eta = "done" if self.done == self.total else f"eta {human_duration(left)}" if left is not None else "eta ?"
        return (f"[{bar}] {self.done:{len(str(self.total))}d}/{self.total}  built {c['built']}  cached {c['cached']}  "
                f"failed {c['failed']}  {human_duration(time.perf_counter() - self.start)}, {eta}  {label}")

    def update(self, status: str, label: str) -> None:
        self.done += 1
        self.counts[status] += 1
        if not self.enabled:
            return
        line = self.line(label)
        if self.tty:
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        elif self.done * 10 // self.total > self._shown_tenths:
            self._shown_tenths = self.done * 10 // self.total
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, message: str) -> None:
        """A line of its own (a failure), above the progress line."""
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(message + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
