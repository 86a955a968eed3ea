"""Fault injection for the simulated engine, so tests and demos can break a replica the ways GPUs break.

Enabled only with `fleetroute sim --fault-injection`; then `GET/POST/DELETE /sim/faults` reads, merges or
clears the active faults:

    slowdown             every engine step takes this many times longer (a throttling or sick GPU)
    error_rate           fraction of inference requests answered with `error_status` at once
    error_status         the status of those errors (default 500)
    hang                 inference requests get no answer at all (not even headers) until cleared
    stall_after_tokens   streams stop after this many tokens, connection left open (a wedged engine)
    unhealthy            `/health` answers 503
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


class FaultError(ValueError):
    pass


@dataclass
class Faults:
    slowdown: float = 1.0
    error_rate: float = 0.0
    error_status: int = 500
    hang: bool = False
    stall_after_tokens: int | None = None
    unhealthy: bool = False
    # Set whenever `hang` or `stall_after_tokens` is lifted, so held requests resume.
    cleared: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "cleared"}

    def update(self, changes: Mapping[str, Any]) -> None:
        """Validate every field first, then apply them all (a bad request changes nothing)."""
        checked: dict[str, Any] = {}
        for key, value in changes.items():
            checked[key] = _check(key, value)
        for key, value in checked.items():
            setattr(self, key, value)
        if not self.hang and self.stall_after_tokens is None:
            self.release()

    def reset(self) -> None:
        for f in fields(self):
            if f.name != "cleared":
                setattr(self, f.name, f.default)
        self.release()

    def release(self) -> None:
        self.cleared.set()
        self.cleared = asyncio.Event()


def _check(key: str, value: Any) -> Any:
    if key == "slowdown":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise FaultError(f"slowdown must be a positive number, got {value!r}")
        return float(value)
    if key == "error_rate":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise FaultError(f"error_rate must be between 0 and 1, got {value!r}")
        return float(value)
    if key == "error_status":
        if isinstance(value, bool) or not isinstance(value, int) or not 400 <= value <= 599:
            raise FaultError(f"error_status must be an HTTP error status (400-599), got {value!r}")
        return value
    if key in ("hang", "unhealthy"):
        if not isinstance(value, bool):
            raise FaultError(f"{key} must be true or false, got {value!r}")
        return value
    if key == "stall_after_tokens":
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise FaultError(f"stall_after_tokens must be a non-negative integer or null, got {value!r}")
        return value
    known = ", ".join(f.name for f in fields(Faults) if f.name != "cleared")
    raise FaultError(f"unknown fault {key!r} (known: {known})")
