"""A one-line progress bar on stderr for load runs: redrawn in place on a terminal, one line per finished
run otherwise (CI logs stay short)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total_runs: int, *, stream=None) -> None:  # noqa: ANN001 - a text stream
        self.total_runs = total_runs
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._last = 0.0

    def show(self, index: int, label: str, done: int, total: int, started: float, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < 0.2:
            return
        self._last = now
        width = 24
        filled = int(width * done / max(total, 1))
        line = (f"[{index}/{self.total_runs}] {label:<34} |{'#' * filled}{'.' * (width - filled)}| "
                f"{done}/{total} requests  {now - started:6.1f}s")
        if self.tty:
            print("\r" + line, end="", file=self.stream, flush=True)
        elif force:
            print(line, file=self.stream, flush=True)

    def finish(self) -> None:
        if self.tty:
            print(file=self.stream)
