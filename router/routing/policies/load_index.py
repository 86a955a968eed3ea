"""A pool's endpoints ordered by in-flight load, kept up to date as requests start and end: least-load picks
that do not scan the pool.

`least_loaded` (policies/base.py) wants the endpoint of least `scaled_load` (in-flight requests per unit of
capacity), ties broken at random. Scanning a 1,000-endpoint pool for it costs about 0.8 ms per pick. Here
the pool's endpoints sit in buckets keyed by their in-flight count, one bucket set per capacity scale (slow
start x configured weight: all 1 usually, so one set), with the lowest non-empty count of each set kept as
counts move. In-flight counts move by one per request start or end (router/routing/loads.py tells every index that
holds the endpoint), so keeping the lowest count costs O(1); a pick looks at the lowest bucket of each scale
set, so its cost depends on the number of distinct scales, not on the pool's size. A pool with more than
MAX_SCALES distinct scales (many endpoints ramping up at once) gets no index and is scanned, exactly as
before.

Exactness: the scaled load of a bucket is computed with `scaled_load` itself, so equal loads tie exactly as
they do in the scan, and the choice is uniform over the tied endpoints outside `exclude` (exclude sets are a
retry's few failed endpoints: sampled around, or filtered when they fill the bucket). The random stream
differs from the scan's (same distribution, other draws).

The index also keeps the pool's total in-flight count, which bounded-load consistent hashing needs per pick.
It also answers, without a scan, the most loaded endpoint's count and the endpoints in increasing order of
load (`highest`, `ascending`): composite's indexed pick reads both (router/routing/policies/composite.py).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator, Mapping

from router.model import EndpointView

# More distinct capacity scales than this in one pool: no index (a pick costs one look per scale; past this
# many, a rollout ramping most of a small pool, the scan is as cheap).
MAX_SCALES = 32


class _ScaleSet:
    """The endpoints of one capacity scale, bucketed by in-flight count."""

    __slots__ = ("scale", "buckets", "slot", "lowest")

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.buckets: dict[int, list[str]] = {}
        self.slot: dict[str, int] = {}  # endpoint id -> its position in its bucket's list
        self.lowest = 0

    def add(self, endpoint_id: str, count: int) -> None:
        bucket = self.buckets.get(count)
        if bucket is None:
            bucket = self.buckets[count] = []
            if len(self.buckets) == 1 or count < self.lowest:
                self.lowest = count
        self.slot[endpoint_id] = len(bucket)
        bucket.append(endpoint_id)

    def remove(self, endpoint_id: str, count: int) -> None:
        bucket = self.buckets[count]
        i = self.slot.pop(endpoint_id)
        last = bucket.pop()
        if last != endpoint_id:  # swap the last one into the hole: O(1)
            bucket[i] = last
            self.slot[last] = i
        if not bucket:
            del self.buckets[count]
            if count == self.lowest and self.buckets:
                # Counts move by one, so the next count up holds the one that left; min() covers any other jump.
                self.lowest = count + 1 if count + 1 in self.buckets else min(self.buckets)


class LoadIndex:
    """The endpoints of one pool (`views`) by in-flight count, from `counts` (the tracker's, at creation)."""

    __slots__ = ("views", "_by_id", "_sets", "_set_of", "_counts", "total", "_others", "_others_total")

    def __init__(self, views: tuple[EndpointView, ...], counts: Mapping[str, int]) -> None:
        self.views = views
        self._by_id = {v.id: v for v in views}
        self._sets: list[_ScaleSet] = []
        self._set_of: dict[str, _ScaleSet] = {}
        self._counts: dict[str, int] = {}
        by_scale: dict[float, _ScaleSet] = {}
        for view in views:
            if view.id in self._set_of:
                continue  # listed twice: the scan would count it once per listing, but pools list each once
            scale = view.weight_factor * view.endpoint.weight
            group = by_scale.get(scale)
            if group is None:
                group = by_scale[scale] = _ScaleSet(scale)
                self._sets.append(group)
            count = counts.get(view.id, 0)
            group.add(view.id, count)
            self._set_of[view.id] = group
            self._counts[view.id] = count
        self.total = sum(self._counts.values())
        self._others: Mapping[str, int] | None = None
        self._others_total = 0

    @staticmethod
    def fits(views: tuple[EndpointView, ...]) -> bool:
        """Does the pool have few enough distinct capacity scales to be indexed?"""
        scales: set[float] = set()
        for view in views:
            scales.add(view.weight_factor * view.endpoint.weight)
            if len(scales) > MAX_SCALES:
                return False
        return True

    def rebind(self, views: tuple[EndpointView, ...]) -> bool:
        """Take `views` as this pool's if they are the same endpoints at the same capacity scales (new telemetry,
        as a telemetry round makes them): the buckets stay, only the views returned change. False if not."""
        old = self.views
        if len(views) != len(old) or any(
                a.id != b.id or a.weight_factor != b.weight_factor or a.endpoint.weight != b.endpoint.weight
                for a, b in zip(views, old, strict=True)):
            return False
        self.views = views
        self._by_id = {v.id: v for v in views}
        self._others = None  # recount the others' share against the new tuple's members (the same ids)
        return True

    def patch(self, views: tuple[EndpointView, ...], changed: Mapping[str, EndpointView]) -> None:
        """Take `views` as this pool's where it differs from the current tuple only by `changed` (new telemetry
        for the same endpoints at the same scales, as a telemetry round's refresh makes it): O(changed)."""
        self.views = views
        by_id = dict(self._by_id)  # a copy: a reader of the old tuple's index keeps its views
        by_id.update(changed)
        self._by_id = by_id

    def __contains__(self, endpoint_id: str) -> bool:
        return endpoint_id in self._set_of

    def moved(self, endpoint_id: str, count: int) -> None:
        """The endpoint's in-flight count is now `count`."""
        group = self._set_of.get(endpoint_id)
        if group is None:
            return
        old = self._counts[endpoint_id]
        if old == count:
            return
        group.remove(endpoint_id, old)
        group.add(endpoint_id, count)
        self._counts[endpoint_id] = count
        self.total += count - old

    def count(self, endpoint_id: str) -> int:
        return self._counts.get(endpoint_id, 0)

    def cluster_total(self, others: Mapping[str, int]) -> int:
        """The pool's in-flight count here plus the other replicas' (`LoadTracker.others`, replaced whole
        at each sharing round, so its sum over the pool is cached until the next one)."""
        if others is not self._others:
            self._others = others
            self._others_total = sum(n for i, n in others.items() if i in self._set_of)
        return self.total + self._others_total

    def least(self, exclude: frozenset[str], rng: random.Random) -> tuple[EndpointView | None, float, int]:
        """The endpoint of least scaled load outside `exclude`, ties broken at random; with that load and the
        number of endpoints tied at it."""
        best_load = 0.0
        tied: list[tuple[list[str], int]] = []  # (bucket, how many of it are excluded)
        tied_n = 0
        for group in self._sets:
            found = self._lowest_open(group, exclude)
            if found is None:
                continue
            count, bucket, closed = found
            load = float(count) if group.scale == 1.0 else (count + 1.0) / group.scale - 1.0  # = scaled_load
            if not tied or load < best_load:
                best_load, tied, tied_n = load, [(bucket, closed)], len(bucket) - closed
            elif load == best_load:
                tied.append((bucket, closed))
                tied_n += len(bucket) - closed
        if not tied:
            return None, 0.0, 0
        if tied_n == 1 and len(tied) == 1 and not tied[0][1]:
            return self._by_id[tied[0][0][0]], best_load, 1
        r = rng.randrange(tied_n)
        for bucket, closed in tied:
            n = len(bucket) - closed
            if r < n:
                return self._by_id[_nth_open(bucket, closed, r, exclude, rng)], best_load, tied_n
            r -= n
        raise AssertionError("unreachable: r < tied_n")

    def ascending(self) -> Iterator[tuple[int, str]]:
        """Every endpoint with its in-flight count, least loaded first (composite's indexed pick walks it: it stops
        after a few). Lazy: each scale set's counts are sorted (there are as many as distinct counts, not endpoints)
        and merged. Read within one synchronous pick: counts do not move while it runs."""
        walks = [_ascending(group) for group in self._sets]
        return walks[0] if len(walks) == 1 else heapq.merge(*walks)

    def highest(self, exclude: frozenset[str]) -> int:
        """The most in-flight requests at one endpoint outside `exclude` (0 when all are excluded)."""
        most = 0
        for group in self._sets:
            for count in sorted(group.buckets, reverse=True):
                if count <= most:
                    break
                bucket = group.buckets[count]
                if not exclude or _closed(group, bucket, exclude) < len(bucket):
                    most = count
                    break
        return most

    @staticmethod
    def _lowest_open(group: _ScaleSet, exclude: frozenset[str]) -> tuple[int, list[str], int] | None:
        """The group's lowest count with an endpoint outside `exclude`: (count, its bucket, excluded in it)."""
        if not group.buckets:
            return None
        count = group.lowest
        bucket = group.buckets[count]
        if not exclude:
            return count, bucket, 0
        closed = _closed(group, bucket, exclude)
        if closed < len(bucket):
            return count, bucket, closed
        # The lowest bucket is all excluded (a retry on a tiny pool): the next counts up, in order. There are as
        # many buckets as distinct in-flight counts, not endpoints.
        for count in sorted(group.buckets)[1:]:
            bucket = group.buckets[count]
            closed = _closed(group, bucket, exclude)
            if closed < len(bucket):
                return count, bucket, closed
        return None


def _ascending(group: _ScaleSet) -> Iterator[tuple[int, str]]:
    for count in sorted(group.buckets):
        for endpoint_id in group.buckets[count]:
            yield count, endpoint_id


def _closed(group: _ScaleSet, bucket: list[str], exclude: frozenset[str]) -> int:
    """How many of `bucket`'s members are in `exclude` (cost: the size of `exclude`)."""
    return sum(1 for e in exclude if _in(bucket, group.slot.get(e), e))


def _in(bucket: list[str], slot: int | None, endpoint_id: str) -> bool:
    return slot is not None and slot < len(bucket) and bucket[slot] == endpoint_id


def _nth_open(bucket: list[str], closed: int, r: int, exclude: frozenset[str], rng: random.Random) -> str:
    """A uniformly chosen member of `bucket` outside `exclude` (`r`: a draw below the open count)."""
    if not closed:
        return bucket[r]
    if len(bucket) <= 2 * closed:  # mostly excluded: list the open ones (short, since exclude sets are)
        return [e for e in bucket if e not in exclude][r]
    while True:  # rejection sampling: at least half the bucket is open, so two tries expected at most
        candidate = bucket[rng.randrange(len(bucket))]
        if candidate not in exclude:
            return candidate
