"""Progress lines for long data preparation (a 70k-user synthetic set, partition caches, downloads)."""

from __future__ import annotations

import sys
import time


class Progress:
    """Prints `label: done/total (pct) elapsed, eta` to stderr at most every `every` seconds.

    Silent for work that finishes within `every` seconds, so small datasets and tests stay quiet.
    """

    def __init__(self, total: int, label: str, every: float = 5.0, stream=None):
        self.total, self.label, self.every = max(int(total), 1), label, every
        self.stream = stream or sys.stderr
        self.start = self.last = time.time()
        self.done = 0
        self.printed = False

    def update(self, n: int = 1) -> None:
        """Count `n` more units; print a line if `every` seconds passed since the last one."""
        self.done += n
        now = time.time()
        if now - self.last >= self.every:
            self.last = now
            self._line(now)

    def _line(self, now: float) -> None:
        elapsed = now - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        print(f"{self.label}: {self.done}/{self.total} ({100 * self.done / self.total:.0f}%) "
              f"{elapsed:.0f}s elapsed, ~{eta:.0f}s left", file=self.stream, flush=True)
        self.printed = True

    def close(self) -> None:
        """Print the final line if any progress was shown."""
        if self.printed:
            self.done = self.total
            self._line(time.time())
