"""Stall detection: an engine that stops making progress while requests wait on it.

A vLLM server can keep answering `/health` with 200 while its engine loop is wedged. Requests sent there then
get no response head (non-streaming: vLLM sends it with the finished answer) or no first token (streams:
the head comes at once, then nothing), and would wait for `timeouts.firstByte` (300 s by default); active
checks see nothing wrong, and outlier detection counts a failure only when that timeout ends. This module
watches what each endpoint does with the requests this router has sent it:

- **Progress** is a response head or a body chunk from the endpoint, for any request. An endpoint's
  **silence** is the time since its last progress, or since it was given work while it had none; it is 0
  while nothing is outstanding there.
- The **threshold** is `max(minSilence, silenceFactor x p99)`, where p99 is the larger of the endpoint's own
  99th percentile time to first byte (its last 64 requests) and the median of its peers' (endpoints sharing
  a model): "far beyond its own recent history and its peers'". A non-streamed answer's first byte comes
  when it is complete, so a fleet serving long generations has long first-byte times and a high threshold.
- Silence past the threshold makes the endpoint a **suspect**, not yet a verdict: a healthy engine busy with
  long non-streamed generations is silent too. router/server/rescue.py probes each suspect with a 1-token
  completion; only a probe that fails (no answer within `probeTimeout`, a 5xx, no connection) while the
  endpoint stays silent makes it **stalled**. A probe that answers counts as progress.

Each request is a `Waiter` from sending to the end of its answer. The proxy tells it which timer guards its
current wait (`arm`), and whether a byte has reached the client yet (`streaming`). `release` ends the wait at
once by expiring that timer: a request that sent nothing to its client is then sent elsewhere (the proxy
raises `UpstreamRescued`), a started stream ends with an error event. Nothing here does I/O; the clock is
injected.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

SAMPLES = 64  # first-byte times kept per endpoint: its recent history


@dataclass(frozen=True)
class StallSettings:
    enabled: bool = True
    # Silence shorter than this never makes a suspect, whatever the history: a healthy interactive engine
    # rarely leaves requests without a first token or a chunk for 5 s, and with no history (a router that just
    # started) this is the threshold.
    min_silence: float = 5.0
    # How far beyond the recent 99th percentile time to first byte the silence must go.
    silence_factor: float = 4.0
    # The confirming probe's limit: a live engine answers a 1-token completion within a scheduler step or
    # two unless its queue is long, and a long queue has already raised the threshold through the history.
    probe_timeout: float = 3.0


class Timer(Protocol):
    """What guards a wait: an `asyncio.Timeout` (reschedule to a past time expires it at once)."""

    def reschedule(self, when: float | None) -> None: ...


class Activity:
    """One endpoint: this router's requests outstanding there, its last progress, its first-byte times."""

    __slots__ = ("endpoint_id", "waiters", "quiet_since", "samples", "_p99", "probing")

    def __init__(self, endpoint_id: str) -> None:
        self.endpoint_id = endpoint_id
        self.waiters: set[Waiter] = set()
        self.quiet_since = 0.0
        self.samples: deque[float] = deque(maxlen=SAMPLES)
        self._p99: float | None = None  # cached until the next sample
        self.probing = False

    def sample(self, seconds: float) -> None:
        self.samples.append(seconds)
        self._p99 = None

    def p99(self) -> float | None:
        if self._p99 is None and self.samples:
            ordered = sorted(self.samples)
            self._p99 = ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]
        return self._p99


class Waiter:
    """One request at one endpoint, from sending until its answer ends."""

    __slots__ = ("activity", "policy", "sent_at", "timer", "released", "streaming", "_clock")

    def __init__(self, activity: Activity, policy: str, now: float, clock: Callable[[], float]) -> None:
        self.activity = activity
        self.policy = policy
        self.sent_at = now
        self.timer: Timer | None = None
        self.released: str | None = None  # why the router took the request off the endpoint
        self.streaming = False  # a byte has reached the client: the request can no longer be sent elsewhere
        self._clock = clock

    def arm(self, timer: Timer | None) -> None:
        """`timer` now guards the request's wait (None: nothing does). Released already: it expires at once."""
        self.timer = timer
        if timer is not None and self.released is not None:
            timer.reschedule(0.0)

    def progress(self) -> None:
        """A response head or a body chunk came from the endpoint."""
        self.activity.quiet_since = self._clock()

    def first_byte(self) -> None:
        """The answer's first body chunk: progress, and a sample of the endpoint's time to first byte."""
        now = self._clock()
        self.activity.quiet_since = now
        self.activity.sample(now - self.sent_at)

    def release(self, reason: str) -> None:
        self.released = reason
        if self.timer is not None:
            try:
                self.timer.reschedule(0.0)  # in the past: the wait ends at the loop's next turn
            except RuntimeError:
                pass  # the timer has already fired or been left: the request is past that wait anyway


@dataclass(frozen=True)
class Suspect:
    endpoint_id: str
    silence: float
    threshold: float
    quiet_since: float


class StallDetector:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._activity: dict[str, Activity] = {}

    @contextmanager
    def track(self, endpoint_id: str, policy: str = "") -> Iterator[Waiter]:
        """A request sent to the endpoint, for the body of the `with`."""
        activity = self._activity.get(endpoint_id)
        if activity is None:
            activity = self._activity[endpoint_id] = Activity(endpoint_id)
        now = self._clock()
        if not activity.waiters:
            activity.quiet_since = now  # silence counts from the moment an idle endpoint is given work
        waiter = Waiter(activity, policy, now, self._clock)
        activity.waiters.add(waiter)
        try:
            yield waiter
        finally:
            waiter.timer = None
            activity.waiters.discard(waiter)

    # ---- detection ----------------------------------------------------------------------------------------

    def activity(self, endpoint_id: str) -> Activity | None:
        return self._activity.get(endpoint_id)

    def silence(self, endpoint_id: str) -> float:
        activity = self._activity.get(endpoint_id)
        if activity is None or not activity.waiters:
            return 0.0
        return max(0.0, self._clock() - activity.quiet_since)

    def threshold(self, endpoint_id: str, peers: Iterable[str], settings: StallSettings) -> float:
        """max(minSilence, silenceFactor x the larger of its own p99 first-byte time and its peers' median p99)."""
        own = self._activity.get(endpoint_id)
        own_p99 = (own.p99() if own is not None else None) or 0.0
        peer_p99s = [p for p in (self._p99_of(peer) for peer in peers if peer != endpoint_id) if p is not None]
        peers_p99 = statistics.median(peer_p99s) if peer_p99s else 0.0
        return max(settings.min_silence, settings.silence_factor * max(own_p99, peers_p99))

    def _p99_of(self, endpoint_id: str) -> float | None:
        activity = self._activity.get(endpoint_id)
        return activity.p99() if activity is not None else None

    def suspects(self, settings: StallSettings, peers_of: Callable[[str], Iterable[str]]) -> list[Suspect]:
        """Endpoints with requests outstanding and silent past their threshold (and not being probed)."""
        now = self._clock()
        found = []
        for endpoint_id, activity in self._activity.items():
            if activity.probing or not any(w.released is None for w in activity.waiters):
                continue
            silence = now - activity.quiet_since
            if silence < settings.min_silence:  # below every threshold: no percentile to compute
                continue
            limit = self.threshold(endpoint_id, peers_of(endpoint_id), settings)
            if silence >= limit:
                found.append(Suspect(endpoint_id, silence, limit, activity.quiet_since))
        return found

    # ---- rescue -------------------------------------------------------------------------------------------

    def release(self, endpoint_id: str, reason: str, *, policy: str | None = None,
                streams: bool = False) -> tuple[int, int]:
        """End the waits of the endpoint's requests (of one policy, or all): those that sent nothing to their
        client, and with `streams` those that did. Returns (waiting, streaming) released."""
        activity = self._activity.get(endpoint_id)
        waiting = streaming = 0
        if activity is None:
            return 0, 0
        for waiter in list(activity.waiters):
            if waiter.released is not None or (policy is not None and waiter.policy != policy):
                continue
            if waiter.streaming and not streams:
                continue
            waiter.release(reason)
            if waiter.streaming:
                streaming += 1
            else:
                waiting += 1
        return waiting, streaming

    def forget_endpoints(self, gone: frozenset[str]) -> None:
        """Endpoints that left (health/departures.py). A request still in flight there keeps its own reference."""
        for endpoint_id in gone:
            self._activity.pop(endpoint_id, None)
