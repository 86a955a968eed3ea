"""The access log: one JSON line per proxied request, written in batches.

It is on the request path of every request, so it skips the `logging` machinery (record objects,
formatters, a flush per line) and serialises with orjson into a buffer flushed every `flush_interval` or
when the buffer reaches `max_buffer` bytes: measured, this took the access log's cost from about 0.065 ms
to about 0.01 ms of router CPU per request. Lines have the same shape as every other log line
(`router/runtime/logs.py`): ts, level, logger, msg, then the request's fields.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import IO, Any

import orjson

LOGGER = "fleetroute.access"


class AccessLog:
    def __init__(self, stream: IO[bytes] | None = None, *, flush_interval: float = 0.2,
                 max_buffer: int = 64 * 1024) -> None:
        self._stream = stream if stream is not None else sys.stderr.buffer
        self._flush_interval = flush_interval
        self._max_buffer = max_buffer
        self._lines: list[bytes] = []
        self._size = 0
        self._timer: asyncio.TimerHandle | None = None

    def write(self, fields: dict[str, Any]) -> None:
        now = time.time()
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z",
            "level": "info",
            "logger": LOGGER,
            "msg": "request",
            **fields,
        }
        line = orjson.dumps(entry, default=str) + b"\n"
        self._lines.append(line)
        self._size += len(line)
        if self._size >= self._max_buffer:
            self.flush()
        elif self._timer is None:
            try:
                self._timer = asyncio.get_running_loop().call_later(self._flush_interval, self.flush)
            except RuntimeError:  # no loop (a test calling directly): write at once
                self.flush()

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._lines:
            self._stream.write(b"".join(self._lines))
            self._stream.flush()
            self._lines.clear()
            self._size = 0
