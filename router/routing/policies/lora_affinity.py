"""LoRA-adapter affinity: a request naming an adapter goes where that adapter is already active, else where an
adapter slot is free, and stays away from engines whose slots other adapters hold.

vLLM runs at most `max_loras` distinct adapters in a batch (its V1 scheduler skips a request whose adapter
would exceed that) and keeps adapters in as many GPU slots, loading one into a slot on first use. So an
engine with the adapter active (running or waiting: `vllm:lora_requests_info`) serves the request at no
load cost; one with a free slot loads it once; one whose slots are all taken makes the request wait until a
batch without another adapter comes. This filter, applied before the policy's own choice for the models of a
policy with a `lora:` block, keeps the best group of candidates:

1. **active**: the adapter is among the engine's running or waiting adapters;
2. otherwise **free_slot**: fewer adapters active than its `max_lora` (engines that report no LoRA state,
   `unknown`, count as this group: nothing says they are full);
3. otherwise every candidate (all are full: one of them must swap, and the policy picks which by load).

A hot adapter must not pile onto the engines where it happens to be active: when the least busy active
engine has `spillover` more requests in flight (this router's count) than the least busy engine of the next
group, that group joins, and the adapter spreads. The policy then chooses by load among what is kept, so
affinity decides where an adapter runs and the policy how the load spreads over those engines. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from router.model import Telemetry

ACTIVE, FREE_SLOT, FULL, UNKNOWN = "active", "free_slot", "full", "unknown"
TIERS = (ACTIVE, FREE_SLOT, FULL, UNKNOWN)


class LoraConfigError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


@dataclass(frozen=True)
class LoraAffinity:
    """A policy's `lora:` block: its models are LoRA adapters, routed with adapter affinity."""

    spillover: int = 8  # in-flight requests an active engine may have beyond the next group's least busy


def parse_lora(block: Any) -> LoraAffinity | None:
    """`lora:` of a policy: absent or null -> None (no affinity); a mapping -> the settings."""
    if block is None:
        return None
    if not isinstance(block, Mapping):
        raise LoraConfigError("", f"must be a mapping (its models are LoRA adapters), got {type(block).__name__}")
    unknown = sorted(str(key) for key in block if key != "spillover")
    if unknown:
        raise LoraConfigError(f".{unknown[0]}", "unknown field (expected one of: spillover)")
    spillover = block.get("spillover", LoraAffinity.spillover)
    if isinstance(spillover, bool) or not isinstance(spillover, int) or not 1 <= spillover <= 100_000:
        raise LoraConfigError(".spillover", f"must be an integer from 1 to 100000, got {spillover!r}")
    return LoraAffinity(spillover=spillover)


def tier(telemetry: Telemetry | None, adapter: str) -> str:
    """Where `adapter` stands on an engine, from its last report."""
    if telemetry is None or telemetry.max_lora is None or telemetry.lora_running is None:
        return UNKNOWN
    waiting = telemetry.lora_waiting or frozenset()
    if adapter in telemetry.lora_running or adapter in waiting:
        return ACTIVE
    return FREE_SLOT if len(telemetry.lora_running | waiting) < telemetry.max_lora else FULL


def keep_out(candidates: Iterable[tuple[str, Telemetry | None]], adapter: str, settings: LoraAffinity,
             in_flight: Callable[[str], int]) -> tuple[frozenset[str], dict[str, str]]:
    """The candidates to leave out for a request naming `adapter`, and every candidate's tier."""
    tiers = {endpoint_id: tier(t, adapter) for endpoint_id, t in candidates}
    active = [e for e, t in tiers.items() if t == ACTIVE]
    free = [e for e, t in tiers.items() if t in (FREE_SLOT, UNKNOWN)]
    if active:
        keep = set(active)
        if free and min(map(in_flight, active)) >= min(map(in_flight, free)) + settings.spillover:
            keep.update(free)  # the adapter is hot: let it spread to engines with room for it
    elif free:
        keep = set(free)
    else:
        return frozenset(), tiers  # all full: any of them must swap
    return frozenset(e for e in tiers if e not in keep), tiers
