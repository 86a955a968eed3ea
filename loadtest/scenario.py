"""Load-test scenarios as YAML files: the fleet, the workload, the load sweep, the policies, the SLO.

    name: seed-table
    seed: 1
    fleet:
      model: llama-3-8b
      replicas: [{gpu: h100, count: 8}, {gpu: a100-80g, count: 8}]
      timeScale: 40              # every simulated second lasts 40 wall seconds (fits 2 cores)
      telemetry: redis           # agents publish to a Redis the harness starts; or `embedded`
      telemetryInterval: 1s      # simulated: the agents sample every timeScale x this, in wall time
      faults: [{replica: h100-0, slowdown: 3}]     # optional: the degraded-node run
    workload: {kind: sessions, outputMedian: 120}  # chat | sessions | shared-prefix | trace (loadtest.workload)
    arrivals: {process: gamma, cv: 3}              # poisson | gamma | constant | trace
    load:
      capacityFractions: [0.4, 0.6, 0.8, 1.0]      # of the modelled capacity; or rates: [...] in req/s
      fixed: 0.8                                   # the point of the fixed-load table
      requests: 1200                               # per point (or duration: 30s, simulated)
      warmup: 2s                                   # simulated seconds left out of the statistics
      stopPastCapacity: true                       # a policy stops at the first point its P99 TTFT misses
    policies: [round-robin, least-connections, consistent-hash, adaptive, "vllm-router:cache_aware"]
    slo: {ttft: 1s, itl: 100ms}

`extends: other.yaml` starts from another scenario file (relative to this one) and overrides it: mappings
merge field by field, anything else (lists included) is replaced.

Rates and durations are in simulated time. A policy is a fleetroute strategy name, a mapping with the fields
of one entry of the router's `policies:` list (validated by the router's own parser, so errors read the same),
or a peer router spelled `peer:policy` (loadtest/peers). Every error names the field by its path in the file.
A fleetroute mapping may add `gateway: envoy`: that policy then runs as `fleetroute epp` behind real Envoy
(loadtest/envoy.py) instead of as `fleetroute router`, with the same routing config; its label defaults to
`<strategy> via envoy`, so `[round-robin, {strategy: round-robin, gateway: envoy}]` compares the two data
paths on the same arrivals (`fleetroute loadtest --gateway both` does that for every policy of a scenario).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from loadtest.arrivals import PROCESSES
from loadtest.stats import Slo
from loadtest.workload import APIS, KINDS
from router.config.presets import merge
from router.config.settings import ConfigError, Fields, _show, parse_settings

TELEMETRY_MODES = ("redis", "embedded")
MODES = ("open", "closed")
# Where `workload.trace` names are looked up when they are not paths: $FLEETROUTE_TRACE_DIR, then the
# workplace's shared calibration data beside the checkout.
TRACE_DIRS = ("{env}", "{repo}/../shared/calibration/traces")


@dataclass(frozen=True)
class ReplicaGroup:
    gpu: str
    count: int
    weight: float = 1.0  # the router's endpoints[].weight for these replicas (relative capacity)


@dataclass(frozen=True)
class Fault:
    replica: str  # replica id, e.g. h100-0
    slowdown: float


@dataclass(frozen=True)
class FleetSpec:
    model: str = "llama-3-8b"
    replicas: tuple[ReplicaGroup, ...] = (ReplicaGroup("h100", 2), ReplicaGroup("a100-80g", 2))
    time_scale: float = 10.0
    telemetry: str = "redis"
    telemetry_interval: float = 1.0  # simulated seconds
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    prefix_caching: bool = True
    faults: tuple[Fault, ...] = ()

    def weights(self) -> dict[str, float]:
        return {f"{g.gpu}-{i}": g.weight for g in self.replicas for i in range(g.count)}

    def replica_ids(self) -> list[tuple[str, str]]:
        """(replica id, gpu profile) in start order: h100-0, h100-1, ..., a100-80g-0, ..."""
        out = []
        for group in self.replicas:
            out += [(f"{group.gpu}-{i}", group.gpu) for i in range(group.count)]
        return out


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str
    params: Mapping[str, Any]  # constructor arguments of the workload class (snake_case)
    trace_path: Path | None = None
    priorities: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ArrivalSpec:
    process: str = "poisson"
    cv: float = 1.0


@dataclass(frozen=True)
class LoadSpec:
    rates: tuple[float, ...] = ()  # simulated req/s
    capacity_fractions: tuple[float, ...] = ()
    fixed: float | None = None  # a rate (with `rates`) or a fraction (with `capacityFractions`)
    requests: int | None = None
    duration: float | None = None  # simulated seconds of arrivals per point
    warmup: float = 0.0
    mode: str = "open"
    concurrency: tuple[int, ...] = ()  # closed loop: virtual users per point
    timeout: float = 120.0  # simulated seconds a request may take before the client gives up
    # Open loop: no runs of a policy above a point where its P99 TTFT missed the SLO (its capacity is found),
    # except at the `fixed` point
    stop_past_capacity: bool = False

    @property
    def points(self) -> tuple[float, ...]:
        if self.mode == "closed":
            return tuple(float(c) for c in self.concurrency)
        return self.rates or self.capacity_fractions


@dataclass(frozen=True)
class PolicyEntry:
    label: str  # as reports name it
    peer: str | None = None  # "vllm-router:cache_aware"; None: fleetroute
    config: Mapping[str, Any] = field(default_factory=dict)  # fleetroute: one router `policies:` entry
    gateway: str = "router"  # fleetroute's data path: `router` (the aiohttp proxy) or `envoy` (Envoy + the EPP)


GATEWAYS = ("router", "envoy")
ENVOY_SUFFIX = " via envoy"


def with_gateway(entries: tuple[PolicyEntry, ...], mode: str) -> tuple[PolicyEntry, ...]:
    """`fleetroute loadtest --gateway`: `router` leaves the entries as they are, `envoy` runs every fleetroute
    policy through Envoy + the EPP, `both` follows each fleetroute policy with its Envoy twin (same config,
    label + " via envoy"), so both data paths see the same arrivals. Peers are left as they are."""
    if mode not in (*GATEWAYS, "both"):
        raise ConfigError("--gateway", f"must be router, envoy or both, got {mode!r}")
    out: list[PolicyEntry] = []
    for entry in entries:
        if entry.peer is not None or entry.gateway == "envoy" or mode == "router":
            out.append(entry)
            continue
        twin = replace(entry, label=entry.label + ENVOY_SUFFIX, gateway="envoy")
        out += [entry, twin] if mode == "both" else [twin]
    labels = [e.label for e in out]
    if len(set(labels)) != len(labels):
        raise ConfigError("--gateway", "a policy and its Envoy twin would share a label: "
                          + ", ".join(sorted({x for x in labels if labels.count(x) > 1})))
    return tuple(out)


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    seed: int
    fleet: FleetSpec
    workload: WorkloadSpec
    arrivals: ArrivalSpec
    load: LoadSpec
    policies: tuple[PolicyEntry, ...]
    slo: Slo
    router: Mapping[str, Any] = field(default_factory=dict)  # extra top-level router config (advanced)
    path: Path | None = None


_WORKLOAD_FIELDS: dict[str, dict[str, str]] = {
    # YAML field -> constructor argument, per kind (loadtest.workload)
    "chat": {"promptMedian": "prompt_median", "promptSigma": "prompt_sigma", "outputMedian": "output_median",
             "outputSigma": "output_sigma", "promptMax": "prompt_max", "outputMax": "output_max"},
    "sessions": {"continueProbability": "continue_p", "userWordsMedian": "user_words_median",
                 "outputMedian": "output_median", "outputMax": "output_max", "maxTurns": "max_turns",
                 "thinkTime": "think_time"},
    "shared-prefix": {"groups": "groups", "prefixTokens": "prefix_tokens", "questionTokens": "question_tokens",
                      "outputTokens": "output_tokens", "skew": "skew"},
    "trace": {"lengthScale": "length_scale", "promptMax": "prompt_max", "outputMax": "output_max", "api": "api"},
}


def _number_list(f: Fields, key: str, *, minimum: float, integer: bool = False) -> tuple[float, ...]:
    raw = f.get(key)
    if raw is None:
        return ()
    kind = int if integer else (int, float)
    if (not isinstance(raw, list) or not raw
            or not all(isinstance(v, kind) and not isinstance(v, bool) and v > minimum for v in raw)):
        what = "integers" if integer else "numbers"
        raise ConfigError(f.at(key), f"must be a non-empty list of {what} > {minimum}, got {_show(raw)}")
    if len(raw) > 32:
        raise ConfigError(f.at(key), f"at most 32 points, got {len(raw)}")
    return tuple(sorted(raw))


def _fleet(f: Fields) -> FleetSpec:
    from worker.sim.profiles import profile

    d = FleetSpec()
    groups = []
    for path, item in f.items("replicas") or []:
        g = Fields(item, path)
        gpu = g.string("gpu")
        try:
            profile(gpu)
        except ValueError as exc:
            raise ConfigError(g.at("gpu"), str(exc)) from None
        groups.append(ReplicaGroup(gpu, g.integer("count", 1, minimum=1, maximum=1000),
                                   g.number("weight", 1.0, minimum=0.0, maximum=1000.0, exclusive_minimum=True)))
        g.done()
    if not f.has("replicas"):
        groups = list(d.replicas)
    if not groups:
        raise ConfigError(f.at("replicas"), "must list at least one replica group")
    if len({g.gpu for g in groups}) != len(groups):
        raise ConfigError(f.at("replicas"), "each GPU profile may appear once (use count)")
    spec = FleetSpec(
        model=f.string("model", d.model),
        replicas=tuple(groups),
        time_scale=f.number("timeScale", d.time_scale, minimum=0.5, maximum=1000),
        telemetry=f.choice("telemetry", d.telemetry, TELEMETRY_MODES),
        telemetry_interval=f.duration("telemetryInterval", d.telemetry_interval),
        max_num_seqs=f.integer("maxNumSeqs", d.max_num_seqs, minimum=1, maximum=4096),
        max_num_batched_tokens=f.integer("maxNumBatchedTokens", d.max_num_batched_tokens, minimum=16),
        max_model_len=f.integer("maxModelLen", d.max_model_len, minimum=16),
        prefix_caching=f.boolean("prefixCaching", d.prefix_caching),
    )
    ids = {rid for rid, _ in spec.replica_ids()}
    faults = []
    for path, item in f.items("faults"):
        g = Fields(item, path)
        replica = g.string("replica")
        if replica not in ids:
            raise ConfigError(g.at("replica"), f"no such replica {replica!r} (replicas: {', '.join(sorted(ids))})")
        faults.append(Fault(replica, g.number("slowdown", 1.0, minimum=1.0, maximum=100.0)))
        g.done()
    f.done()
    return FleetSpec(**{**spec.__dict__, "faults": tuple(faults)})


def _trace_path(value: str, where: str, base: Path | None) -> Path:
    import os

    candidate = Path(value).expanduser()
    tried = []
    if candidate.is_absolute():
        tried.append(candidate)
    else:
        if base is not None:
            tried.append(base / candidate)
        tried.append(Path.cwd() / candidate)
        repo = Path(__file__).resolve().parent.parent
        for pattern in TRACE_DIRS:
            env = os.environ.get("FLEETROUTE_TRACE_DIR")
            if pattern == "{env}" and not env:
                continue
            tried.append(Path(pattern.format(env=env, repo=repo)) / candidate)
    for path in tried:
        if path.is_file():
            return path.resolve()
    raise ConfigError(where, f"trace file {value!r} not found (looked in: {', '.join(str(p.parent) for p in tried)}; "
                             "set FLEETROUTE_TRACE_DIR)")


def _workload(f: Fields, model: str, base: Path | None) -> WorkloadSpec:
    kind = f.choice("kind", "sessions", KINDS)
    fields = _WORKLOAD_FIELDS[kind]
    params: dict[str, Any] = {}
    for key, arg in fields.items():
        if not f.has(key):
            continue
        value = f.get(key)
        if key == "api":
            params[arg] = f.choice(key, "completions", APIS)
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ConfigError(f.at(key), f"must be a number >= 0, got {_show(value)}")
        else:
            params[arg] = value
    trace_path = None
    if kind == "trace":
        trace_path = _trace_path(f.string("trace"), f.at("trace"), base)
    priorities: dict[str, float] = {}
    raw = f.get("priorities")
    if raw is not None:
        if not isinstance(raw, Mapping) or not raw or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                for k, v in raw.items()):
            raise ConfigError(f.at("priorities"), f"must map class names to positive weights, got {_show(raw)}")
        priorities = dict(raw)
    f.done()
    spec = WorkloadSpec(kind=kind, params=params, trace_path=trace_path, priorities=priorities)
    try:
        build_workload(spec, model)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f.path, str(exc)) from None
    return spec


def build_workload(spec: WorkloadSpec, model: str) -> Any:
    from loadtest import workload

    if spec.kind == "chat":
        return workload.ChatWorkload(model=model, **spec.params)
    if spec.kind == "sessions":
        return workload.SessionsWorkload(model=model, **spec.params)
    if spec.kind == "shared-prefix":
        return workload.SharedPrefixWorkload(model=model, **spec.params)
    assert spec.trace_path is not None
    return workload.TraceWorkload(model=model, records=tuple(workload.read_trace(spec.trace_path)), **spec.params)


def _load(f: Fields) -> LoadSpec:
    mode = f.choice("mode", "open", MODES)
    rates = _number_list(f, "rates", minimum=0)
    fractions = _number_list(f, "capacityFractions", minimum=0)
    concurrency = tuple(int(c) for c in _number_list(f, "concurrency", minimum=0, integer=True))
    if mode == "open" and bool(rates) == bool(fractions):
        raise ConfigError(f.at("rates"), "set exactly one of rates or capacityFractions")
    if mode == "closed" and not concurrency:
        raise ConfigError(f.at("concurrency"), "is required in closed-loop mode (virtual users per point)")
    requests = f.integer("requests", 0, minimum=1, maximum=1_000_000) if f.get("requests") is not None else None
    duration = f.duration("duration", 1.0) if f.get("duration") is not None else None
    if (requests is None) == (duration is None):
        raise ConfigError(f.at("requests"), "set exactly one of requests (per point) or duration (simulated)")
    fixed = None
    if f.get("fixed") is not None:
        fixed = f.number("fixed", 0.0, minimum=0, exclusive_minimum=True)
    spec = LoadSpec(
        rates=rates, capacity_fractions=fractions, fixed=fixed, requests=requests, duration=duration,
        warmup=f.duration("warmup", 1.0) if f.get("warmup") is not None else 0.0,
        mode=mode, concurrency=concurrency, timeout=f.duration("timeout", LoadSpec.timeout),
        stop_past_capacity=f.boolean("stopPastCapacity", False),
    )
    if fixed is not None and mode == "open" and fixed not in spec.points:
        spec = LoadSpec(**{**spec.__dict__, ("rates" if rates else "capacity_fractions"):
                           tuple(sorted({*spec.points, fixed}))})
    f.done()
    return spec


def _policies(f: Fields, fleet: FleetSpec) -> tuple[PolicyEntry, ...]:
    entries: list[PolicyEntry] = []
    for path, item in f.items("policies"):
        if isinstance(item, str) and ":" in item:
            entries.append(_peer_entry(path, item))
            continue
        if isinstance(item, str):
            item = {"strategy": item}
        if not isinstance(item, Mapping):
            raise ConfigError(path, f"must be a strategy name, peer:policy or a mapping, got {_show(item)}")
        item = dict(item)
        if "peer" in item:
            extra = set(item) - {"peer", "label"}  # no `gateway:` either: a peer is its own data path
            if extra:
                raise ConfigError(f"{path}.{sorted(extra)[0]}", "unknown field for a peer (expected peer, label)")
            entries.append(_peer_entry(path, item["peer"], item.get("label")))
            continue
        gateway = item.pop("gateway", "router")
        if gateway not in GATEWAYS:
            raise ConfigError(f"{path}.gateway", f"must be one of {', '.join(GATEWAYS)}, got {_show(gateway)}")
        label = item.pop("label", None) or str(item.get("name") or item.get("strategy", "adaptive")) + (
            ENVOY_SUFFIX if gateway == "envoy" else "")
        config = {"name": _policy_name(str(label)), "models": ["*"], **item}
        try:  # the router's own parser: the same messages an operator would get from the router
            parse_settings({"endpoints": [{"id": "x", "url": "http://127.0.0.1:1", "models": [fleet.model]}],
                            "policies": [config], "redis": {"url": None}})
        except ConfigError as exc:  # its paths are those of a router config with this policy first
            message = str(exc).removeprefix(f"{exc.path}: ")
            raise ConfigError(exc.path.replace("policies[0]", path, 1), message) from None
        entries.append(PolicyEntry(label=str(label), config=config, gateway=gateway))
    if not entries:
        raise ConfigError(f.at("policies"), "must list at least one policy to compare")
    labels = [e.label for e in entries]
    dupes = sorted({lbl for lbl in labels if labels.count(lbl) > 1})
    if dupes:
        raise ConfigError(f.at("policies"), f"labels must be unique (give a label:), repeated: {', '.join(dupes)}")
    return tuple(entries)


def _policy_name(label: str) -> str:
    import re

    name = re.sub(r"[^a-z0-9-]+", "-", label.lower()).strip("-")[:63].strip("-")
    return name or "policy"


def _peer_entry(path: str, spelling: Any, label: str | None = None) -> PolicyEntry:
    from loadtest.peers import PeerError, parse_peer_spec  # only when a scenario compares peers

    if not isinstance(spelling, str):
        raise ConfigError(path, f"a peer is spelled peer:policy, got {_show(spelling)}")
    try:
        parse_peer_spec(spelling)
    except PeerError as exc:
        raise ConfigError(path, str(exc)) from None
    return PolicyEntry(label=label or spelling, peer=spelling)


def parse_scenario(raw: Any, *, path: Path | None = None) -> Scenario:
    top = Fields(raw, "")
    base = path.parent if path is not None else None
    fleet = _fleet(top.sub("fleet"))
    workload = _workload(top.sub("workload"), fleet.model, base)
    a = top.sub("arrivals")
    arrivals = ArrivalSpec(process=a.choice("process", "poisson", PROCESSES),
                           cv=a.number("cv", 1.0, minimum=0, exclusive_minimum=True))
    a.done()
    if arrivals.process == "trace" and workload.kind != "trace":
        raise ConfigError("arrivals.process", "trace arrivals need a trace workload (workload.kind: trace)")
    load = _load(top.sub("load"))
    s = top.sub("slo")
    slo = Slo(ttft=s.duration("ttft", Slo.ttft), itl=s.duration("itl", Slo.itl))
    s.done()
    router = top.get("router", {}) or {}
    if not isinstance(router, Mapping):
        raise ConfigError("router", f"must be a mapping of router config fields, got {_show(router)}")
    scenario = Scenario(
        name=top.string("name", path.stem if path else "scenario"),
        description=str(top.get("description", "") or ""),
        seed=top.integer("seed", 1, minimum=0),
        fleet=fleet,
        workload=workload,
        arrivals=arrivals,
        load=load,
        policies=_policies(top, fleet),
        slo=slo,
        router=dict(router),
        path=path,
    )
    top.done()
    return scenario


def _read(p: Path, chain: tuple[Path, ...] = ()) -> Any:
    if p.resolve() in chain:
        raise ConfigError(str(p), "extends itself (through " + " -> ".join(c.name for c in chain) + ")")
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(str(p), "scenario file not found") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(str(p), f"invalid YAML{where}: {getattr(exc, 'problem', None) or exc}") from None
    if isinstance(raw, Mapping) and "extends" in raw:
        raw = dict(raw)
        parent = raw.pop("extends")
        if not isinstance(parent, str) or not parent:
            raise ConfigError(f"{p}: extends", f"must be a scenario file name, got {_show(parent)}")
        base = _read(p.parent / parent, (*chain, p.resolve()))
        raw = merge(base, raw) if isinstance(base, Mapping) else raw
    return raw


def load_scenario(path: str | Path) -> Scenario:
    p = Path(path)
    return parse_scenario(_read(p), path=p)
