"""consistent-hash: requests with the same key go to the same endpoint while membership is stable.

Intent: affinity. A session, user or tenant keeps hitting one engine, so its KV/prefix cache stays warm;
when an endpoint joins or leaves only ~1/n of the keys move (an md5 hash ring from `uhashring`, 160
virtual nodes per endpoint).

The key comes from a configurable source: `header:<name>` (e.g. `header:x-session-id`) or
`body:<field>` (e.g. `body:user`; dots walk nested objects, `body:metadata.tenant`). A request without
the key has no affinity to preserve, so it falls back to least-connections (counted as the
`hash_key_missing` policy event). When the key's endpoint is excluded (it just failed) the ring is walked
to the next endpoint, which is where the key would move if that endpoint left.

With `maxLoadFactor: c` (e.g. 1.25) it becomes consistent hashing with bounded loads: an endpoint holding
`ceil(c * (total in flight + 1) / n)` requests or more takes no new ones, and the key walks the ring to the
next endpoint under the bound (counted as `load_bound_overflow`). Hot keys then spill over instead of
piling onto one GPU, while every other key keeps its endpoint. `total` counts requests in flight at all
router replicas when they share Redis (`LoadView.cluster_in_flight`), this router's alone otherwise.

The ring walk past a full owner is capped at MAX_BOUNDED_WALK endpoints, then the least-loaded endpoint
(from the pool's load index, router/routing/policies/load_index.py) takes the request; the pool's total in flight
comes from that index too, so a bounded pick costs the same at 10 or 1,000 endpoints.

The ring is built once per membership and kept in the pool state: rebuilds that keep the membership reuse
it, and a telemetry round keeps the whole picker (the vLLM production-stack router rebuilt its ring per
request; we do not).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from uhashring import HashRing

from router.model import EndpointView, RequestInfo
from router.routing.policies.base import (
    DecisionTrace,
    EventSink,
    Explained,
    LoadView,
    PolicyConfigError,
    Sentence,
    least_loaded,
    least_loaded_sentence,
    pool_index,
    reject_unknown,
)

KEY_SOURCES = ("header", "body")
MAX_WALK_NOTES = 16  # ring-walk steps an explanation lists (a walk past many full endpoints stays bounded)
# Distinct endpoints a bounded-load walk tries past the key's owner before it takes the least-loaded endpoint
# instead: with c = 1.25 up to 80% of a pool may be at the bound, and walking all of a 1,000-endpoint ring
# (160,000 points) per request is what made bounded picks cost 0.6-0.8 ms.
MAX_BOUNDED_WALK = 32


@dataclass(frozen=True)
class HashKey:
    source: str  # "header" | "body"
    name: str  # header name (lower-case) or dotted body path

    def describe(self) -> str:
        """The key's source as configured: `header:x-session-id`, `body:user`."""
        return f"{self.source}:{self.name}"

    def extract(self, req: RequestInfo) -> str | None:
        if self.source == "header":
            value = req.headers.get(self.name)
            return value or None
        node: Any = req.body
        for part in self.name.split("."):
            if not isinstance(node, Mapping):
                return None
            node = node.get(part)
        if node is None or isinstance(node, (dict, list)) or node == "":
            return None
        return str(node)


@dataclass(frozen=True)
class ConsistentHashConfig:
    key: HashKey
    # Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018; as in Envoy and HAProxy):
    # no endpoint takes a new request while it holds ceil(c * (total + 1) / n) or more, where total counts
    # in-flight requests across all router replicas. None: plain consistent hashing.
    max_load_factor: float | None = None


def parse_key(raw: Any) -> HashKey:
    if not isinstance(raw, str) or ":" not in raw:
        raise PolicyConfigError("key", f"must look like 'header:<name>' or 'body:<field>', got {raw!r}")
    source, _, name = raw.partition(":")
    if source not in KEY_SOURCES or not name.strip():
        raise PolicyConfigError("key", f"must look like 'header:<name>' or 'body:<field>', got {raw!r}")
    name = name.strip()
    return HashKey(source, name.lower() if source == "header" else name)


class RingState:
    """The ring and the membership it was built for."""

    __slots__ = ("members", "ring")

    def __init__(self) -> None:
        self.members: tuple[str, ...] = ()
        self.ring: HashRing | None = None

    def forget_endpoints(self, gone: frozenset[str]) -> None:
        """Endpoints left the fleet: a ring that holds one is rebuilt at the next build (keys move as they would)."""
        if not gone.isdisjoint(self.members):
            self.members, self.ring = (), None

    def ring_for(self, members: tuple[str, ...]) -> HashRing | None:
        if members != self.members or self.ring is None:
            self.members = members
            self.ring = HashRing(nodes=list(members)) if members else None
        return self.ring


def load_bound(views: tuple[EndpointView, ...], loads: LoadView, factor: float) -> int:
    """The most requests an endpoint may hold before new keys overflow to the next one on the ring."""
    index = pool_index(loads, views)
    others = getattr(loads, "others", None)
    if index is not None and others is not None:  # the pool's total kept as counts move: no sum per pick
        total = index.cluster_total(others)
    else:
        total = sum(loads.cluster_in_flight(v.id) for v in views)
    return max(1, math.ceil(factor * (total + 1) / max(len(views), 1)))


class ConsistentHashPicker:
    __slots__ = ("_views", "_by_id", "_ring", "_key", "_factor", "_rng", "_events")

    def __init__(
        self,
        views: tuple[EndpointView, ...],
        ring: HashRing | None,
        config: ConsistentHashConfig,
        rng: random.Random,
        events: EventSink,
    ) -> None:
        self._views = views
        self._by_id = {v.id: v for v in views}
        self._ring = ring
        self._key = config.key
        self._factor = config.max_load_factor
        self._rng = rng
        self._events = events

    def pick(
        self, req: RequestInfo, loads: LoadView, exclude: frozenset[str], trace: DecisionTrace | None = None
    ) -> EndpointView | None:
        key = self._key.extract(req)
        if key is None or self._ring is None:
            if key is None:
                self._events("hash_key_missing")
            view = least_loaded(self._views, loads, exclude, self._rng, trace)
            if trace is not None:
                trace.detail["key"] = self._key.describe()
                trace.detail["key_present"] = key is not None
                if key is None:  # no affinity to keep: least-connections instead (a pool without a ring is empty)
                    trace.reason = "hash_key_missing"
                    trace.detail["fallback"] = "least_loaded"
            return view
        if trace is not None:
            # The key's position on the ring (md5, as uhashring places it), not the key: a session id or user
            # name stays out of logs and admin pages, while two requests that hashed alike still show it.
            trace.detail.update(key=self._key.describe(), key_present=True, key_hash=self._ring.get_key(key))
        if self._factor is not None:
            return self._pick_bounded(key, loads, exclude, self._factor, trace)
        node = self._ring.get_node(key)
        if node not in exclude:
            if trace is not None:
                trace.reason = "ring"
                trace.detail["owner"] = node
                trace.note(node, ring_step=0)
            return self._by_id[node]
        walk = 0
        for node in ring_walk(self._ring, key):  # ring order from the key's position, each node once
            if node not in exclude:
                if trace is not None:
                    trace.reason = "ring_walk"  # the owner is excluded (it failed this request): the next one
                    trace.detail["owner"] = self._ring.get_node(key)
                    trace.detail["walked"] = walk
                    trace.note(node, ring_step=walk)
                return self._by_id[node]
            walk += 1
        return None

    def _pick_bounded(
        self, key: str, loads: LoadView, exclude: frozenset[str], factor: float, trace: DecisionTrace | None
    ) -> EndpointView | None:
        assert self._ring is not None
        bound = load_bound(self._views, loads, factor)
        owner = self._ring.get_node(key)
        if trace is not None:
            trace.detail.update(owner=owner, bound=bound, max_load_factor=factor,
                                total_in_flight=sum(loads.cluster_in_flight(v.id) for v in self._views))
        if owner not in exclude and loads.cluster_in_flight(owner) < bound:
            if trace is not None:
                trace.reason = "ring"
                trace.note(owner, ring_step=0, cluster_in_flight=loads.cluster_in_flight(owner))
            return self._by_id[owner]  # the common case: no ring walk (uhashring copies the ring to walk it)
        walk = 0
        capped = False
        for node in ring_walk(self._ring, key):
            if walk >= MAX_BOUNDED_WALK:
                capped = True
                self._events("load_bound_walk_capped")
                break
            held = loads.cluster_in_flight(node)
            if node not in exclude and held < bound:
                if trace is not None:
                    # The owner was full (not merely excluded after a failure): a load-bound overflow.
                    trace.reason = "load_bound_overflow" if owner not in exclude else "ring_walk"
                    trace.detail["walked"] = walk
                    trace.note(node, ring_step=walk, cluster_in_flight=held)
                if owner not in exclude:  # the owner was full (not merely excluded after a failure)
                    self._events("load_bound_overflow")
                return self._by_id[node]
            if trace is not None and node not in exclude and walk < MAX_WALK_NOTES:
                trace.note(node, ring_step=walk, cluster_in_flight=held, at_bound=True)
            walk += 1
        # Every endpoint is at the bound (only possible with exclusions), or the capped walk found none under it:
        # the least loaded one (under the bound: the least loaded holds at most the mean).
        view = least_loaded(self._views, loads, exclude, self._rng, trace)
        if trace is not None and view is not None:
            trace.reason = "load_bound_walk_capped" if capped else "all_at_bound"
            trace.detail["fallback"] = "least_loaded"
            if capped:
                trace.detail["walked"] = walk
        return view


def ring_walk(ring: HashRing, key: str) -> Iterator[str]:
    """The ring's nodes from the key's position clockwise, each once: `HashRing.iterate_nodes`' order, without
    its copy of the ring's points from that position (a copy per call: 160 points per endpoint)."""
    runtime = ring.runtime
    points, owners = runtime._keys, runtime._ring  # uhashring's sorted points and point -> node
    if not points:
        return
    start = ring._get_pos(key)
    seen: set[str] = set()
    everyone = len(runtime._nodes)
    for i in itertools.chain(range(start, len(points)), range(start)):
        node = owners[points[i]]
        if node in seen:
            continue
        seen.add(node)
        yield node
        if len(seen) == everyone:
            return


def _ring(e: Explained) -> str:
    bound = e.detail.get("bound")
    return "the key's owner on the hash ring" + (
        f", under the load bound ({e.chosen.get('cluster_in_flight')} < {bound})" if "bound" in e.detail else "")


REASONS: dict[str, Sentence] = {
    "ring": _ring,
    "ring_walk": lambda e: f"the key's owner {e.detail.get('owner')} is excluded; the next endpoint on the ring",
    "load_bound_overflow": lambda e: (f"the key's owner {e.detail.get('owner')} is at the load bound "
                                      f"({e.detail.get('bound')}); the next endpoint on the ring under it"),
    # Falling back to the least loaded endpoint, and why:
    "hash_key_missing": lambda e: (f"no hash key ({e.detail.get('key')}) in the request, so no affinity to keep: "
                                   + least_loaded_sentence(e)),
    "all_at_bound": lambda e: (f"every candidate at the load bound ({e.detail.get('bound')}): "
                               + least_loaded_sentence(e)),
    "load_bound_walk_capped": lambda e: (
        f"the key's owner {e.detail.get('owner')} and the next {e.detail.get('walked')} endpoints on the ring are "
        f"at the load bound ({e.detail.get('bound')}): " + least_loaded_sentence(e)),
}


class ConsistentHashPolicy:
    name = "consistent-hash"
    config_key = "consistentHash"
    reasons = REASONS
    # Neither its build nor its picks read telemetry: a telemetry round keeps its picker (balancer.py).
    reads_telemetry = False

    def parse(self, params: Mapping[str, Any]) -> ConsistentHashConfig:
        reject_unknown(params, {"key", "maxLoadFactor"})
        factor = params.get("maxLoadFactor")
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                                   or not 1 < factor < math.inf):  # nan fails this too
            raise PolicyConfigError("maxLoadFactor", f"must be a number > 1 (e.g. 1.25) or null, got {factor!r}")
        return ConsistentHashConfig(
            key=parse_key(params.get("key", "header:x-session-id")),
            max_load_factor=float(factor) if factor is not None else None,
        )

    def new_state(self) -> RingState:
        return RingState()

    def build(
        self,
        views: tuple[EndpointView, ...],
        config: ConsistentHashConfig,
        state: RingState,
        rng: random.Random,
        events: EventSink,
    ) -> ConsistentHashPicker:
        members = tuple(sorted(v.id for v in views))
        return ConsistentHashPicker(views, state.ring_for(members), config, rng, events)
