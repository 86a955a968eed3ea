"""Arrival processes for open-loop load: when each request leaves, in seconds from the start of a run.

- `poisson`: exponential gaps, the memoryless baseline (coefficient of variation of the gaps, CV, is 1).
- `gamma`: a Gamma renewal process with the same mean rate and a chosen CV. CV > 1 is bursty: many short
  gaps and a few long ones, so requests bunch up. The shape is k = 1/CV^2 and the scale 1/(rate*k), which keeps
  the mean gap at 1/rate (CV 1 is Poisson again). Production LLM traces sit between CV 1 (Azure conversation)
  and CV 3-13 (Mooncake, Azure code); shared/calibration/README.md suggests CV 2-4 for "bursty".
- `constant`: evenly spaced, for fixed-rate runs where only the service should vary.
- `rescaled`: a trace's own timestamps, stretched or squeezed to a target mean rate. The burst structure
  (the CV and the order of gaps) is kept, only the time axis changes, so one trace can drive a rate sweep.

Every process takes its own `random.Random`, so the same seed gives the same arrivals for every policy a
scenario compares.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

PROCESSES = ("poisson", "gamma", "constant", "trace")


def poisson(rate: float, duration: float, rng: random.Random) -> list[float]:
    return gamma(rate, 1.0, duration, rng)


def gamma(rate: float, cv: float, duration: float, rng: random.Random) -> list[float]:
    """Arrival times in [0, duration) of a Gamma renewal process with mean rate `rate` and gap CV `cv`."""
    _check(rate, duration)
    if not cv > 0:
        raise ValueError(f"cv must be > 0, got {cv}")
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    times: list[float] = []
    t = 0.0
    while True:
        t += rng.gammavariate(shape, scale)
        if t >= duration:
            return times
        times.append(t)


def constant(rate: float, duration: float) -> list[float]:
    _check(rate, duration)
    n = int(duration * rate)
    return [i / rate for i in range(n) if i / rate < duration]


def rescaled(timestamps: Sequence[float], rate: float, duration: float) -> list[float]:
    """The trace's arrival pattern at mean rate `rate`, cut at `duration`; the trace repeats if too short."""
    _check(rate, duration)
    if len(timestamps) < 2:
        raise ValueError("a trace needs at least two arrivals to have a rate")
    base = sorted(timestamps)
    span = base[-1] - base[0]
    if span <= 0:
        raise ValueError("the trace's arrivals all share one timestamp")
    # The trace's own mean rate counts the gap that wraps around to the next repetition as one more gap.
    period = span * len(base) / (len(base) - 1)
    factor = (len(base) / period) / rate  # trace seconds -> run seconds
    times: list[float] = []
    offset = 0.0
    while True:
        for ts in base:
            t = (offset + ts - base[0]) * factor
            if t >= duration:
                return times
            times.append(t)
        offset += period


def gap_cv(times: Sequence[float]) -> float:
    """The coefficient of variation of the gaps between consecutive arrivals (1 for Poisson)."""
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    if len(gaps) < 2:
        return 0.0
    mean = sum(gaps) / len(gaps)
    var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    return (var ** 0.5) / mean if mean > 0 else 0.0


def _check(rate: float, duration: float) -> None:
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if not duration > 0:
        raise ValueError(f"duration must be > 0, got {duration}")
