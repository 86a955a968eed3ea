"""Structured logging: one JSON object per line on stderr, with the fields passed in `extra=`."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Hashable
from typing import Any

import orjson

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # aiohttp's own access log is replaced by ours (richer, JSON); its errors still show.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


class HeldRecords(logging.Handler):
    """Log records emitted before logging is configured, held until it is: parsing the config file may warn
    (a deprecated form), and the level and the JSON format come from that file. `replay` hands them to the
    configured handlers, through the configured level; `close` alone drops them (the config was invalid)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        root = logging.getLogger()
        self._saved = (root.handlers[:], root.level)
        root.handlers[:] = [self]
        root.setLevel(logging.DEBUG)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def close(self) -> None:
        root = logging.getLogger()
        if self in root.handlers:  # configure_logging replaced the handlers already: keep what it set
            root.handlers[:], level = self._saved
            root.setLevel(level)
        super().close()

    def replay(self) -> None:
        """Emit the held records through the logging configured since, then stop holding."""
        self.close()
        for record in self.records:
            logger = logging.getLogger(record.name)
            if logger.isEnabledFor(record.levelno):
                logger.handle(record)
        self.records.clear()


class RateLimitedLog:
    """At most one line per key every `interval` seconds, for events a client or a failing endpoint can
    repeat at will (refused connections, timeouts, unreachable endpoints). The next line after a quiet spell
    says how many were left out (`suppressed`); the metrics count every one."""

    def __init__(self, logger: logging.Logger, *, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = 1024) -> None:
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self._max_keys = max_keys
        self._last: dict[Hashable, float] = {}
        self._suppressed: dict[Hashable, int] = {}

    def warning(self, key: Hashable, msg: str, **fields: Any) -> None:
        self.log(logging.WARNING, key, msg, **fields)

    def log(self, level: int, key: Hashable, msg: str, **fields: Any) -> None:
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        if last is None and len(self._last) >= self._max_keys:  # bounded, whatever the keys
            self._last.clear()
            self._suppressed.clear()
        self._last[key] = now
        suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            fields["suppressed"] = suppressed
        self._logger.log(level, msg, extra=fields)
