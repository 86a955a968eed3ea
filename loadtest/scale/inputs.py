"""Realistic inputs for the micro-benchmarks: a fleet of n endpoints behind a real `Balancer`.

Every endpoint has fresh telemetry (a full agent record, encoded and decoded with the wire format and
converted by the router's own `to_telemetry`), a non-zero, varied number of requests in flight held open
through the real `LoadTracker`, and the fleet carries some health state: about 1% of the endpoints ejected
by the outlier detector after five failures, about 1% ramping up after slow start, every other endpoint
with a success in its breaker window. Requests are chat completions of a few KiB: a handful of shared
system prompts, multi-turn histories, an `x-session-id` header (the consistent-hash key).

Time is frozen (an injected clock, as the router's tests do): reports never go stale and ramps never end
during a measurement, so every round of a benchmark sees the same state.

The balancer is built with a `CapturingRegistry`, a registry whose policies are the registered ones,
each wrapped to remember the picker it built last: the micro-benchmark times that very picker (the one
`Balancer.pick` uses, with the same warm prefix index or ring) without reaching into the balancer.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from router.config.settings import PolicySpec
from router.model import Endpoint, RequestInfo
from router.routing.balancer import Balancer
from router.routing.loads import LoadTracker
from router.routing.policies.base import EventSink, Picker, Policy
from router.routing.policies.registry import PolicyRegistry
from router.runtime.metrics import RouterMetrics
from router.telemetry.feed import to_telemetry
from worker.protocol import EngineSample, GpuSample, TelemetryRecord, decode, encode

MODEL = "llama-3-8b"
STALE_AFTER = 5.0  # the router's default `telemetry.staleAfter`

WORDS = (
    "route gpu token cache batch queue model request latency tail prefix stream engine replica fleet policy "
    "weight score memory kernel decode prefill session window budget drain probe health load answer context "
    "document summary customer invoice contract clause section table figure result error retry timeout"
).split()


# ---- requests --------------------------------------------------------------------------------------------


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, int(math.exp(rng.gauss(math.log(median), sigma)))))


def system_prompts(count: int, rng: random.Random) -> list[str]:
    """Distinct system prompts of about 1.5 KiB each (one per product or tenant, shared by its sessions)."""
    return [f"You are assistant {i} of tenant {rng.randrange(10**6)}. " + _words(rng, 240) for i in range(count)]


@dataclass
class Conversation:
    session_id: str
    turns: list[dict[str, Any]]  # the request body of each turn; turn k+1's prompt starts with turn k's


def conversations(count: int, rng: random.Random, *, prompts: int = 4, max_turns: int = 6) -> list[Conversation]:
    """Chat sessions of 2 to `max_turns` turns; each turn resends the whole history (as chat clients do), so
    prompts grow from ~1.5 KiB (the system prompt) to several KiB."""
    shared = system_prompts(prompts, rng)
    out = []
    for i in range(count):
        history: list[dict[str, str]] = [{"role": "system", "content": rng.choice(shared)}]
        turns = []
        for _ in range(rng.randint(2, max_turns)):
            history.append({"role": "user", "content": _words(rng, _lognormal(rng, 60, 0.8, 4, 400))})
            turns.append({"model": MODEL, "messages": list(history), "max_tokens": 256, "stream": True})
            history.append({"role": "assistant", "content": _words(rng, _lognormal(rng, 80, 0.7, 4, 400))})
        out.append(Conversation(f"session-{i}", turns))
    return out


def request(conversation: Conversation, turn: int, number: int) -> RequestInfo:
    headers = {"content-type": "application/json", "x-session-id": conversation.session_id}
    return RequestInfo(model=MODEL, request_id=f"req-{number}", headers=headers, body=conversation.turns[turn])


# ---- telemetry -------------------------------------------------------------------------------------------


def agent_record(endpoint_id: str, rng: random.Random, *, reported_at: float, seq: int) -> TelemetryRecord:
    """What a worker agent on an 80 GB GPU publishes: NVML readings and the engine's /metrics, every field set."""
    total = 80 * 2**30
    running = rng.randint(1, 48)
    queries = float(rng.randint(10**5, 10**7))
    return TelemetryRecord(
        endpoint_id=endpoint_id,
        reported_at=reported_at,
        seq=seq,
        interval=1.0,
        gpu_source="nvml",
        gpu=GpuSample(
            util=rng.uniform(0.2, 1.0), util_kind="utilization", mem_used_bytes=int(total * rng.uniform(0.88, 0.92)),
            mem_total_bytes=total, temperature_c=float(rng.randint(40, 80)), power_w=rng.uniform(150, 700),
            throttle_reasons=0, xid_errors=0, ecc_uncorrected=0, retired_pages=0,
        ),
        engine=EngineSample(
            up=True, kv_cache_usage=rng.uniform(0.05, 0.95), num_waiting=float(rng.randint(0, 12)),
            num_running=float(running), prefix_cache_queries=queries,
            prefix_cache_hits=queries * rng.uniform(0.2, 0.8), preemptions_total=float(rng.randint(0, 50)),
        ),
        prefix_cache_hit_rate=rng.uniform(0.2, 0.8),
    )


class FrozenClock:
    """The balancer's monotonic clock, standing still."""

    def __init__(self, now: float = 10_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---- the fleet -------------------------------------------------------------------------------------------


class _Capturing:
    """A registered policy, unchanged, except that it remembers the picker it built last."""

    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self.name = policy.name
        self.config_key = policy.config_key
        self.reads_telemetry = getattr(policy, "reads_telemetry", True)  # a telemetry round keeps its pickers
        self.last: Picker | None = None

    def parse(self, params: Mapping[str, Any]) -> Any:
        return self._policy.parse(params)

    def new_state(self) -> Any:
        return self._policy.new_state()

    def build(self, views: Any, config: Any, state: Any, rng: random.Random, events: EventSink) -> Picker:
        self.last = self._policy.build(views, config, state, rng, events)
        return self.last

    def __getattr__(self, name: str) -> Any:
        # Optional hooks (`refresh`: a telemetry round's incremental update) are the policy's own; a picker
        # refreshed through one is the one `Balancer.pick` uses from then on, so it is the one remembered.
        if name != "refresh":
            raise AttributeError(name)
        refresh = self._policy.refresh  # AttributeError where the policy has no hook

        def remembered(picker: Any, views: Any, changed: Any) -> Any:
            new = refresh(picker, views, changed)
            if new is not None:
                self.last = new
            return new
        return remembered


class CapturingRegistry(PolicyRegistry):
    def __init__(self, policies: list[Policy] | None = None) -> None:
        self.captured = {p.name: _Capturing(p) for p in (policies or PolicyRegistry().all())}
        super().__init__(self.captured.values())  # type: ignore[arg-type]


def endpoint_ids(n: int) -> list[str]:
    return [f"gpu-{i:04d}" for i in range(n)]


@dataclass
class Fleet:
    n: int
    strategy: str
    balancer: Balancer
    registry: CapturingRegistry
    metrics: RouterMetrics
    loads: LoadTracker
    spec: PolicySpec
    clock: FrozenClock
    ids: frozenset[str]
    warm: list[RequestInfo]  # every turn but each conversation's last, in order (to warm indices)
    requests: list[RequestInfo]  # each conversation's last turn: what is measured
    records: dict[str, TelemetryRecord]
    ejected: list[str]
    ramping: list[str]
    _held: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def picker(self) -> Picker:
        picker = self.registry.captured[self.strategy].last
        assert picker is not None, "no picker built yet"
        return picker

    def events(self) -> dict[str, float]:
        """Policy events (`fleetroute_policy_events_total`) counted so far, by event."""
        out: dict[str, float] = {}
        for metric in self.metrics.registry.collect():
            if metric.name == "fleetroute_policy_events":
                for sample in metric.samples:
                    if sample.name.endswith("_total"):
                        out[sample.labels["event"]] = out.get(sample.labels["event"], 0) + sample.value
        return out

    def rebuilds(self) -> float:
        return self.metrics.registry.get_sample_value("fleetroute_snapshot_rebuilds_total") or 0.0

    def close(self) -> None:
        self._held.close()


def build_fleet(n: int, strategy: str, params: Mapping[str, Any] | None = None, *, seed: int = 0,
                sessions: int | None = None, policies: PolicyRegistry | None = None) -> Fleet:
    """n endpoints serving one model under one policy of the given strategy (from `policies`, the built-in
    registry by default), in the state described above."""
    rng = random.Random(seed)
    registry = CapturingRegistry(policies.all() if policies is not None else None)
    policy = registry.get(strategy)
    if policy is None:
        raise ValueError(f"unknown strategy {strategy!r} (registered: {', '.join(registry.names())})")
    spec = PolicySpec(name="bench", models=("*",), strategy=strategy, params=policy.parse(dict(params or {})))
    metrics = RouterMetrics()
    loads = LoadTracker(metrics)
    clock = FrozenClock()
    balancer = Balancer(policies=[spec], registry=registry, metrics=metrics, loads=loads, stale_after=STALE_AFTER,
                        rng=random.Random(seed + 1), clock=clock)
    ids = endpoint_ids(n)
    endpoints = [Endpoint(i, f"http://10.{k // 65536}.{k // 256 % 256}.{k % 256}:8000", (MODEL,))
                 for k, i in enumerate(ids)]
    late = max(1, n // 100) if n >= 4 else 0
    balancer.set_endpoints(endpoints[: n - late])  # outside an event loop: rebuilds at once
    balancer.set_endpoints(endpoints)  # the last ones join later: they ramp up (slow start)
    records = {}
    wall = 1.9e9  # any wall-clock time: to_telemetry only keeps the age
    for seq, endpoint_id in enumerate(ids):
        age = rng.uniform(0.0, 1.0)  # agents report every second, at their own phase
        records[endpoint_id] = record = agent_record(endpoint_id, rng, reported_at=wall - age, seq=seq)
        balancer.report_telemetry(endpoint_id, to_telemetry(decode(encode(record)), wall_now=wall,
                                                            mono_now=clock.now))
    held = contextlib.ExitStack()
    for endpoint_id in ids:
        for _ in range(1 + min(11, int(rng.expovariate(1 / 3)))):  # 1..12 in flight, mean ~4
            held.enter_context(loads.track(endpoint_id))
    ejected = ids[: max(1, n // 100)] if n >= 4 else []
    for endpoint_id in ids:
        for _ in range(5 if endpoint_id in ejected else 1):  # 5 consecutive failures eject (the default)
            balancer.report_outcome(spec, MODEL, endpoint_id, endpoint_id not in ejected, "http_5xx", probe=False)
    balancer.rebuild()
    talks = conversations(sessions if sessions is not None else min(1000, max(64, n)), rng)
    warm, measured = [], []
    for c in talks:
        for turn in range(len(c.turns) - 1):
            warm.append(request(c, turn, len(warm)))
        measured.append(request(c, len(c.turns) - 1, len(measured)))
    return Fleet(n=n, strategy=strategy, balancer=balancer, registry=registry, metrics=metrics, loads=loads, spec=spec,
                 clock=clock, ids=frozenset(ids), warm=warm, requests=measured, records=records,
                 ejected=list(ejected), ramping=ids[n - late:], _held=held)
