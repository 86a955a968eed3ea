"""The prefix-aware policy's background work, so that its pickers stay free of I/O and clocks.

Every `UPKEEP_INTERVAL` (250 ms), for each pool with a prefix index (the prefix-aware strategy, or a composite
with a prefix scorer):

1. the index clock (`PrefixIndex.now`, the stamp of recorded blocks) is set;
2. tuning (router/routing/prefix/tuning.py) compares, per endpoint, the hit rate the index claimed with the
   engine's own (telemetry) over the last window and moves the endpoint's bound; each change is logged and
   counted, and both hit rates are exported (`fleetroute_prefix_cache_hit_rate{source}`);
3. with Redis, the index is exchanged with the other replicas (router/routing/prefix/sharing.py);
4. index sizes and bounds are exported per endpoint (series of endpoints that left are removed).

Endpoints that leave the fleet are forgotten by each index (`PrefixIndex.forget_endpoints`, from the balancer)
and here (`forget_endpoints`); blocks shared for them that arrive later are ignored (`ServingNow`).

A round holds a lock, so a test or tool calling `round()` never interleaves with the loop's own round.
`round_done` is replaced after each round: waiters learn a round has completed without sleeping.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from router.config.settings import PolicySpec
from router.routing.balancer import Balancer
from router.routing.policies.prefix_aware import PrefixAwareConfig
from router.routing.prefix.index import PrefixIndex
from router.routing.prefix.kv_block_index import KVBlockIndex
from router.routing.prefix.sharing import PrefixSharing, SharedPool, stream_key
from router.routing.prefix.tuning import WindowResult, tune
from router.runtime.background import contained
from router.runtime.metrics import RouterMetrics

log = logging.getLogger("fleetroute.prefix")

UPKEEP_INTERVAL = 0.25


def prefix_settings(params: object) -> PrefixAwareConfig | None:
    """The prefix index settings of a pool's policy: prefix-aware's own, or a composite's prefix scorer's."""
    if isinstance(params, PrefixAwareConfig):
        return params
    prefix = getattr(params, "prefix", None)
    return prefix if isinstance(prefix, PrefixAwareConfig) else None
_LOGGED_REASONS = {"kv_capacity", "shrink", "grow"}  # initial sizing (config, fallback) is logged at debug


@dataclass(frozen=True)
class ServingNow:
    """The endpoints serving a model, whatever their health, checked when shared blocks arrive: an endpoint that
    left during the Redis round trip is not brought back into the index (an ejected one comes back warm)."""

    balancer: Balancer
    model: str

    def __contains__(self, endpoint_id: object) -> bool:
        view = self.balancer.snapshot.by_id.get(endpoint_id) if isinstance(endpoint_id, str) else None
        return view is not None and self.model in view.endpoint.models


class PrefixUpkeep:
    def __init__(
        self,
        *,
        balancer: Balancer,
        metrics: RouterMetrics,
        sharing: PrefixSharing | None = None,
        clock: Callable[[], float] = time.monotonic,
        kv_index: KVBlockIndex | None = None,
    ) -> None:
        self._balancer = balancer
        self._kv_index = kv_index
        self._metrics = metrics
        self.sharing = sharing
        self._clock = clock
        self._lock = asyncio.Lock()
        self.round_done = asyncio.Event()
        self._sized: set[tuple[str, str, str]] = set()
        self._pools_shown: set[tuple[str, str]] = set()  # (policy, model) of fleetroute_prefix_index_distinct_blocks
        self._rated: set[tuple[str, str, str, str]] = set()

    def _pools(self) -> list[tuple[PolicySpec, str, PrefixIndex, PrefixAwareConfig]]:
        return [(spec, model, state, config) for spec, model, state in self._balancer.pool_states()
                if isinstance(state, PrefixIndex) and (config := prefix_settings(spec.params)) is not None]

    async def round(self) -> None:
        async with self._lock:
            now = self._clock()
            pools = self._pools()
            shared: list[SharedPool] = []
            for spec, model, index, config in pools:
                index.now = now
                index.engine_blocks = self._kv_index
                views = self._balancer.candidates(model)
                results = tune(index, {v.id: v.telemetry for v in views}, now, config.tuning)
                self._report(spec.name, model, index, results)
                if self.sharing is not None and config.sharing.enabled:
                    shared.append(SharedPool(
                        key=stream_key(spec.name, model, config.block_chars), index=index, ttl=config.sharing.ttl,
                        max_entries=config.sharing.max_stream_entries, endpoints=ServingNow(self._balancer, model),
                    ))
            if self.sharing is not None and shared:
                await self.sharing.exchange(shared)
            self._export(pools)
        done, self.round_done = self.round_done, asyncio.Event()
        done.set()

    def forget_endpoints(self, gone: frozenset[str]) -> None:
        """Endpoints left: no series of theirs is tracked any more (router/routing/departures.py removes them)."""
        self._sized = {labels for labels in self._sized if labels[2] not in gone}
        self._rated = {labels for labels in self._rated if labels[2] not in gone}

    def _report(self, policy: str, model: str, index: PrefixIndex, results: list[WindowResult]) -> None:
        by_endpoint = {r.endpoint_id: r for r in results}
        for r in results:
            for source, rate in (("estimated", r.estimated), ("engine", r.engine)):
                if rate is not None:
                    self._metrics.prefix_hit_rate.labels(policy, model, r.endpoint_id, source).set(rate)
                    self._rated.add((policy, model, r.endpoint_id, source))
        while index.changes:
            change = index.changes.popleft()
            self._metrics.prefix_bound_changes.labels(policy, change.reason).inc()
            extra: dict[str, object] = {"policy": policy, "model": model, "endpoint": change.endpoint_id,
                                        "old_bound": change.old, "new_bound": change.new, "reason": change.reason}
            result = by_endpoint.get(change.endpoint_id)
            if change.reason in ("shrink", "grow") and result is not None:
                extra.update(estimated_hit_rate=round(result.estimated or 0.0, 4),
                             engine_hit_rate=round(result.engine or 0.0, 4), factor=round(result.factor, 4),
                             window_requests=result.requests)
            (log.info if change.reason in _LOGGED_REASONS else log.debug)("prefix index bound changed", extra=extra)

    def _export(self, pools: list[tuple[PolicySpec, str, PrefixIndex, PrefixAwareConfig]]) -> None:
        sized: set[tuple[str, str, str]] = set()
        shown = {(spec.name, model) for spec, model, _, _ in pools}
        for gone_pool in self._pools_shown - shown:
            self._metrics.prefix_index_distinct.remove(*gone_pool)
        self._pools_shown = shown
        for spec, model, index, _ in pools:
            self._metrics.prefix_index_distinct.labels(spec.name, model).set(index.blocks_indexed())
            for view in self._balancer.candidates(model):
                labels = (spec.name, model, view.id)
                self._metrics.prefix_index_blocks.labels(*labels).set(index.size(view.id))
                self._metrics.prefix_index_bound.labels(*labels).set(index.bound(view.id))
                sized.add(labels)
        for gone in self._sized - sized:
            self._metrics.prefix_index_blocks.remove(*gone)
            self._metrics.prefix_index_bound.remove(*gone)
        self._sized = sized
        for labels in [r for r in self._rated if r[:3] not in sized]:
            self._metrics.prefix_hit_rate.remove(*labels)
            self._rated.discard(labels)


async def run_upkeep(upkeep: PrefixUpkeep, metrics: RouterMetrics, interval: float = UPKEEP_INTERVAL) -> None:
    while True:
        with contained("prefix_upkeep", metrics):
            await upkeep.round()
        await asyncio.sleep(interval)
