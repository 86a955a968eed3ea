"""What the router reads from Redis crosses a trust boundary: it is bounded and validated before it reaches
routing, and a bad value is counted and dropped, never raised into a request or a background round.

Whoever can write to the router's Redis can put anything under fleetroute's keys (docs/telemetry.md,
"Trust"). Each kind of value enters through one validating function in the module that uses it:

    telemetry record      router.telemetry.feed.admit_record         fleetroute_telemetry_rejected_records_total{reason}
    session pin           router.routing.sticky.pinned_endpoint      fleetroute_redis_rejected_values_total{data,reason}
    replica list, counts  router.routing.shared_loads.live_replicas, (same)
                          replica_counts
    prefix stream entry   router.routing.prefix.sharing.entry_blocks (same)
    budget check's reply  router.traffic.budgets.check_reply         (same)

Each reads bytes (every client is binary, router/runtime/redis_client.py), checks the size before decoding, then the
type and the range, and raises `Rejected(reason, detail)`. The caller passes that to a `RejectionLog`, which
counts it and writes at most one log line per reason per minute (a hostile writer must not flood the logs).
Reasons: oversize, malformed, out_of_range, future, wrong_type (a key of another Redis type where ours
belongs); telemetry also has schema and wrong_endpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

# How far a reporter's clock may run ahead of this router's before its timestamps are refused (NTP keeps
# hosts within milliseconds; a few seconds covers a host that has just started syncing).
MAX_CLOCK_SKEW = 2.0
LOG_EVERY = 60.0


class Rejected(ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class RejectionLog:
    """Counts each dropped value and logs a line per reason at most every LOG_EVERY seconds, saying how many
    were dropped since the last line."""

    def __init__(self, *, what: str, logger: logging.Logger, count: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic, every: float = LOG_EVERY) -> None:
        self._what = what
        self._log = logger
        self._count = count
        self._clock = clock
        self._every = every
        self._logged_at: dict[str, float] = {}
        self._since: dict[str, int] = {}

    def __call__(self, rejected: Rejected, **extra: object) -> None:
        reason = rejected.reason
        self._count(reason)
        self._since[reason] = self._since.get(reason, 0) + 1
        now = self._clock()
        last = self._logged_at.get(reason)
        if last is not None and now - last < self._every:
            return
        self._logged_at[reason] = now
        self._log.warning(f"{self._what} read from Redis dropped: {reason}",
                          extra={"reason": reason, "detail": rejected.detail, "dropped": self._since.pop(reason),
                                 **extra})


def text(raw: bytes, *, max_bytes: int, what: str) -> str:
    """Printable UTF-8 of at most `max_bytes`, checked before it is decoded."""
    if len(raw) > max_bytes:
        raise Rejected("oversize", f"{what} is {len(raw)} bytes, at most {max_bytes} expected")
    try:
        value = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise Rejected("malformed", f"{what} is not UTF-8") from None
    if not value.isprintable():
        raise Rejected("malformed", f"{what} has control characters")
    return value


def bounded_int(raw: bytes, *, high: int, what: str) -> int:
    """A decimal count in [0, high]. Only ASCII digits: int() would also take '٣', '1_000' and spaces, and
    it is called only once the length shows the number cannot be absurd (a 5,000-digit string makes int()
    raise, a 4,000-digit one makes later float arithmetic overflow)."""
    if len(raw) > len(str(high)):
        raise Rejected("out_of_range" if raw.isdigit() else "oversize",
                       f"{what} is {len(raw)} characters long, at most {high} expected")
    if not raw or not raw.isdigit():  # bytes.isdigit: ASCII digits only
        raise Rejected("malformed", f"{what} is not a decimal count: {raw[:20]!r}")
    value = int(raw)
    if value > high:
        raise Rejected("out_of_range", f"{what} is {value}, at most {high} expected")
    return value
