"""The router's real policies over a simulated fleet in virtual time: a policy laboratory that runs in seconds.

The live harness (`loadtest.runner`) measures the whole system: processes, HTTP, streaming, telemetry
through Redis, on a time-scaled fleet, which takes minutes per run. This module keeps only what decides
where requests go and what each replica then does: the same `EngineCore`s the simulated replicas run, the
same pickers the router builds (from `router.routing.policies`, with their real configuration parsing), telemetry
sampled from the engines every `telemetry_interval` of simulated time and handed to the pickers only at
those ticks (the lag a real router lives with), in-flight counts that change the moment a request is
routed and the moment its last token is out, and the prefill book the router keeps for least-prefill
(router/routing/prefill.py: booked at the pick, closed and timed at the first token, as every lab request
streams). Time jumps from event to event, so an hour of traffic takes seconds and a seed makes a run
exactly repeatable.

What it leaves out: the network and HTTP costs, several router replicas, and everything around the picker in
the live router: session stickiness, admission and shedding, request-cost estimates (so `loadUnit: tokens`
counts requests), telemetry staleness, health checks, retries, faults, and the prefix index's background
upkeep (no sharing, no tuning). The lab's numbers are for the picker alone. Use it
to explore policies and parameters, then confirm with the live harness; docs/benchmarks.md says which
numbers come from which.

KV events (`kv_events`, a `KVEventFeed`): each engine's paged cache (worker/sim/kv_cache.py) records its `BlockStored`,
`BlockRemoved` and `AllBlocksCleared` events as the live simulator does, and after every engine step they go
through vLLM's wire format (worker/sim/kv_events.py `encode_events`, then the router's `decode_batch`) into
the router's own `KVBlockIndex`, which the pickers' prefix index reads for `prefixAware: {index: precise}`:
routing on engine truth, with the router's block keys. The live simulator publishes right after the step is
computed, so here too they are applied at the step's start; the network's milliseconds and lost messages are
not modelled (every engine is precise from sequence 0). The precise index needs the request's token ids:
the router knows them for a completions prompt (with a tokenizer: here the simulator's own); a chat request
it would send to the approximate index. With `kv_events`, chat requests are therefore shown to the picker
rendered with the engine's chat template, as a completions prompt (a router that applies the model's chat
template, or clients that send rendered prompts), for every policy of the run alike, so all of them see the
same requests; the engine serves the same tokens either way.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loadtest.client import PlannedRequest
from router.model import Endpoint, EndpointView, RequestInfo, Telemetry
from router.routing.policies.registry import PolicyRegistry
from router.routing.prefill import Prefill, PrefillBook
from router.routing.prefix.kv_block_index import KVBlockIndex
from router.routing.prefix.kv_events import decode_batch
from worker.sim.engine import EngineConfig, EngineCore, SimRequest
from worker.sim.gpu import BusyWindow
from worker.sim.kv_events import encode_events
from worker.sim.profiles import profile
from worker.sim.tokenizer import render_chat, tokenize


@dataclass
class SimOutcome:
    """One request's fate: where it went and its latencies (simulated seconds)."""

    planned: PlannedRequest
    endpoint: str
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_tokens: int = 0


class _Loads:
    """The `LoadView` the pickers read: requests routed to each endpoint and not yet finished, and the
    prefill booked there."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.prefill = PrefillBook()

    def pending_prefill(self, endpoint_id: str) -> float:
        return self.prefill.pending(endpoint_id)

    def prefill_speed(self, endpoint_id: str) -> float | None:
        return self.prefill.speed(endpoint_id)

    def in_flight(self, endpoint_id: str) -> int:
        return self.counts.get(endpoint_id, 0)

    def cluster_in_flight(self, endpoint_id: str) -> int:
        return self.counts.get(endpoint_id, 0)


class _Replica:
    def __init__(self, rid: str, gpu: str, config: EngineConfig, seed: int, weight: float) -> None:
        self.endpoint = Endpoint(id=rid, url=f"sim://{rid}", models=("m",), weight=weight)
        self.engine = EngineCore(profile(gpu), config, random.Random(seed))
        self.stepping = False
        self.busy = BusyWindow(0.0)  # the GPU utilisation an agent would read, as the live simulator reports it

    def telemetry(self, now: float) -> Telemetry:
        e = self.engine
        return Telemetry(reported_at=now, gpu_util=self.busy.fraction(now), gpu_mem_util=0.9, kv_cache_usage=e.kv_usage,
                         num_waiting=float(e.num_waiting), num_running=float(e.num_running), source="fleetsim")


def prompt_tokens(planned: PlannedRequest) -> list[int]:
    body = planned.body
    return tokenize(render_chat(body["messages"]) if "messages" in body else body["prompt"])


def as_completion(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """A chat body as the completions prompt the engine renders from it (see the module docstring)."""
    if "messages" not in body:
        return body
    out = {k: v for k, v in body.items() if k != "messages"}
    out["prompt"] = render_chat(body["messages"])
    return out


class KVEventFeed:
    """The engines' KV events into the router's precise index, through the wire format, after every step."""

    def __init__(self) -> None:
        self.index = KVBlockIndex(tokenize=tokenize)
        self.batches = 0
        self.replicas: Mapping[str, _Replica] = {}

    def attach(self, replicas: Mapping[str, _Replica]) -> None:
        self.replicas = replicas
        for rid, replica in replicas.items():
            replica.engine.kv_cache.events = []
            engine = self.index.engine(rid)
            engine.precise = True  # heard from sequence 0, and nothing is lost in virtual time

    def publish(self, rid: str, replica: _Replica, now: float) -> None:
        kv = replica.engine.kv_cache
        if not kv.events:
            return
        engine = self.index.engine(rid)
        engine.last_seq = 0 if engine.last_seq is None else engine.last_seq + 1
        self.index.apply(rid, decode_batch(encode_events(kv.events, kv.block_size, now)))
        self.batches += 1
        kv.events = []


def simulate(
    plan: Sequence[PlannedRequest],
    replicas: Sequence[tuple[str, str]],
    *,
    strategy: str,
    params: Mapping[str, Any] | None = None,
    telemetry_interval: float = 1.0,
    engine: EngineConfig | None = None,
    weights: Mapping[str, float] | None = None,
    seed: int = 0,
    kv_events: KVEventFeed | None = None,
    policy_events: Counter[str] | None = None,
) -> list[SimOutcome]:
    """Route `plan` (arrival times in simulated seconds) over `replicas` ((id, gpu profile), ...) with the
    router's `strategy` and run every request to completion; outcomes in plan order. `kv_events` (a fresh
    `KVEventFeed`): feed the engines' KV events to the precise prefix index (module docstring).
    `policy_events`: counts the pickers' events (what the router's fleetroute_policy_events_total counts)."""
    registry = PolicyRegistry()
    policy = registry.get(strategy)
    if policy is None:
        raise ValueError(f"unknown strategy {strategy!r} (known: {', '.join(registry.names())})")
    config = policy.parse(params or {})
    state = policy.new_state()
    rng = random.Random(seed)
    fleet = {rid: _Replica(rid, gpu, engine or EngineConfig(), seed * 1000 + i, (weights or {}).get(rid, 1.0))
             for i, (rid, gpu) in enumerate(replicas)}
    def sink(event: str) -> None:
        if policy_events is not None:
            policy_events[event] += 1

    feed = kv_events
    if feed is not None:
        feed.attach(fleet)
    if feed is not None and hasattr(state, "engine_blocks"):  # a prefix index (prefix-aware, composite)
        state.engine_blocks = feed.index
    loads = _Loads()
    outcomes: list[SimOutcome] = []
    by_request: dict[str, tuple[SimOutcome, SimRequest, _Replica]] = {}
    booked: dict[str, Prefill] = {}  # least-prefill's booking of each request still before its first token
    # Events: (time, order, kind, payload); the order breaks ties deterministically.
    queue: list[tuple[float, int, str, Any]] = []
    order = itertools.count()
    # The first telemetry tick before any arrival (ties go by push order), so a t=0 arrival has a picker.
    heapq.heappush(queue, (min(0.0, *(p.at for p in plan[:1])), next(order), "telemetry", None))
    for i, planned in enumerate(plan):
        heapq.heappush(queue, (planned.at, next(order), "arrival", i))
    picker = None
    pending_arrivals = len(plan)

    def start_step(replica: _Replica, now: float) -> None:
        if replica.stepping or not replica.engine.has_work():
            return
        result = replica.engine.step(now)
        if feed is not None:
            feed.publish(replica.endpoint.id, replica, now)
        if result.idle:  # batch modes waiting for a window; continuous batching is never idle with work
            heapq.heappush(queue, (now + max(result.duration, 1e-6), next(order), "step_end", replica))
            replica.stepping = True
            return
        replica.stepping = True
        replica.busy.busy(now, result.duration)
        heapq.heappush(queue, (now + result.duration, next(order), "step_end", (replica, result)))

    while queue:
        now, _, kind, payload = heapq.heappop(queue)
        if kind == "telemetry":
            views = tuple(EndpointView(endpoint=r.endpoint, telemetry=r.telemetry(now)) for r in fleet.values())
            picker = policy.build(views, config, state, rng, sink)
            if pending_arrivals or by_request:
                heapq.heappush(queue, (now + telemetry_interval, next(order), "telemetry", None))
            continue
        if kind == "arrival":
            pending_arrivals -= 1
            planned = plan[payload]
            assert picker is not None
            body = as_completion(planned.body) if feed is not None else planned.body
            info = RequestInfo(model="m", request_id=f"r{payload}", headers=planned.headers, body=body)
            view = picker.pick(info, loads, frozenset())
            assert view is not None
            replica = fleet[view.id]
            tokens = prompt_tokens(planned)
            req = SimRequest(f"r{payload}", tokens, int(planned.body.get("max_tokens") or 16), now)
            outcome = SimOutcome(planned, view.id, prompt_tokens=len(tokens))
            outcomes.append(outcome)
            by_request[req.request_id] = (outcome, req, replica)
            loads.counts[view.id] = loads.counts.get(view.id, 0) + 1
            if info.note.prefill_tokens > 0.0:
                booked[req.request_id] = loads.prefill.start(view.id, info.note.prefill_tokens, now, streamed=True)
            replica.engine.add_request(req)
            start_step(replica, now)
            continue
        # step_end
        if isinstance(payload, _Replica):  # an idle wait ended
            payload.stepping = False
            start_step(payload, now)
            continue
        replica, result = payload
        replica.stepping = False
        for req in result.emitted:
            if len(req.token_times) == 1 and req.request_id in booked:
                loads.prefill.first_token(booked.pop(req.request_id), req.token_times[0])
        for req in result.finished:
            outcome, _, _ = by_request.pop(req.request_id)
            times = req.token_times
            outcome.ttft = times[0] - req.arrival if times else None
            outcome.e2e = req.finished_at - req.arrival if req.finished_at is not None else None
            outcome.itl = [b - a for a, b in zip(times, times[1:], strict=False)]
            outcome.cached_tokens = req.cached_tokens
            loads.counts[outcome.endpoint] -= 1
        start_step(replica, now)
    order_of = {id(p): i for i, p in enumerate(plan)}
    outcomes.sort(key=lambda o: order_of[id(o.planned)])
    return outcomes
