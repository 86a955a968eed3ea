"""Durations in configuration: a number of seconds or a string with a unit (`500ms`, `2s`, `1m`, `1h`).

Pure and dependency-free, so both the settings loader and policies parsing their own parameters read
durations the same way.
"""

from __future__ import annotations

import math
import re
from typing import Any

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: Any) -> float | None:
    """Seconds from `2`, `0.5`, `"500ms"`, `"2s"`, `"1m"`; None if not a (finite) duration."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match:
            return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    return None
