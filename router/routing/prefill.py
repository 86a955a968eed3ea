"""Prefill in flight, per endpoint: the prompt tokens routed there that have not produced a first token yet,
and how fast the endpoint has been getting through such work (measured, in tokens per second).

A request's time to first token is mostly the prefill queued ahead of it plus its own (vLLM schedules
prefill first come, first served, in chunks of `max_num_batched_tokens`), and a request that hits the prefix
cache brings only its uncached tokens. So `(pending + own uncached tokens) / speed` estimates the wait on
each endpoint; prefix-aware's `selection: least-prefill` picks the smallest (router/routing/policies/prefix_aware.py).

What a request adds is what its picker expected the endpoint to compute (`RequestInfo.note`); only pickers
that estimate it set it, so with other policies nothing is booked. It leaves at the first byte of the body:
for a stream (SSE) that is the first token, and its wait teaches the endpoint's speed, `work ahead / wait`,
where work ahead is the pending prefill at send time plus its own. A non-streamed answer's first byte
comes at its end, so it leaves then and teaches nothing (its wait includes the whole decode).

The speed is a ratio of running means (work over seconds, exact over the first requests, then an EWMA over
about `SPEED_WINDOW`): robust to a mix of tiny and huge prompts, and low by the fixed per-request costs
(network, one engine step), which every endpoint pays alike, so comparisons between endpoints hold.

Pure bookkeeping: no I/O, no clock (callers pass `now`); the router's LoadTracker and the policy lab
(loadtest/fleetsim.py) both use it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

SPEED_WINDOW = 32  # first tokens


@dataclass(slots=True)
class Prefill:
    """One request's booked prefill: handed back by `PrefillBook.start`, closed once."""

    endpoint_id: str
    tokens: float
    ahead: float  # the endpoint's pending prefill when it was sent, its own tokens included
    started: float
    streamed: bool
    open: bool = True


class PrefillBook:
    def __init__(self) -> None:
        self._pending: defaultdict[str, float] = defaultdict(float)
        self._work: dict[str, float] = {}  # running mean of work ahead, tokens
        self._seconds: dict[str, float] = {}  # running mean of the waits, seconds
        self._seen: dict[str, int] = {}

    def pending(self, endpoint_id: str) -> float:
        return self._pending.get(endpoint_id, 0.0)

    def speed(self, endpoint_id: str) -> float | None:
        """Measured prefill speed in tokens/s, None before the endpoint's first streamed first token."""
        seconds = self._seconds.get(endpoint_id)
        return self._work[endpoint_id] / seconds if seconds else None

    def start(self, endpoint_id: str, tokens: float, now: float, *, streamed: bool) -> Prefill:
        pending = self._pending[endpoint_id] = self._pending[endpoint_id] + tokens
        return Prefill(endpoint_id, tokens, pending, now, streamed)

    def first_token(self, prefill: Prefill, now: float) -> None:
        """The first byte of the answer arrived: the prefill is done; a streamed one times the endpoint."""
        if not prefill.open:
            return
        self.end(prefill)
        wait = now - prefill.started
        if prefill.streamed and wait > 0.0 and prefill.ahead > 0.0:
            e = prefill.endpoint_id
            n = self._seen[e] = min(self._seen.get(e, 0) + 1, SPEED_WINDOW)
            work, seconds = self._work.get(e, 0.0), self._seconds.get(e, 0.0)
            self._work[e] = work + (prefill.ahead - work) / n
            self._seconds[e] = seconds + (wait - seconds) / n

    def forget_endpoints(self, gone: frozenset[str]) -> None:
        """Drop the pending prefill and measured speed of endpoints that left (nothing in flight there)."""
        for endpoint_id in gone:
            for table in (self._pending, self._work, self._seconds, self._seen):
                table.pop(endpoint_id, None)

    def end(self, prefill: Prefill) -> None:
        """The request ended (or failed) without a first byte, or its first byte came: no longer pending."""
        if not prefill.open:
            return
        prefill.open = False
        e = prefill.endpoint_id
        left = self._pending[e] - prefill.tokens
        if left <= 1e-6:  # float residue of many adds and subtracts: an idle endpoint holds exactly 0
            del self._pending[e]
        else:
            self._pending[e] = left
