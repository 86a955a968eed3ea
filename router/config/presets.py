"""Scenario presets: named policy entries for common workloads, which an operator can adjust.

Tuning a policy means choosing a strategy and then a dozen knobs across timeouts, stickiness, health and
admission. Those choices follow from the workload. This module holds one tuned answer for each of three
common workloads. A preset is written the way an operator writes a `policies:` entry (without `name` and
`models`, which belong to the fleet), with a comment on every value that says why the value suits the
workload. `fleetroute router --show-preset NAME` prints the preset exactly as written here, comments
included: the preset is its own documentation.

**Expansion.** A policy entry (a router config entry or a RoutingPolicy spec) that says `preset: NAME` is
replaced by the preset's entry with the operator's fields merged on top, before the entry is parsed. So
every check and error message is the one the parser gives for a hand-written entry:

- Mappings merge field by field, at every depth: `preset: realtime-chat` plus
  `timeouts: {firstByte: 5s}` changes only `timeouts.firstByte`.
- Any other value the operator writes replaces the preset's. That includes lists, scalars and `null`, and
  `null` keeps the meaning the parser gives it: `timeouts: {total: null}` means no total limit, and
  `admission: null` drops the preset's admission block, so admission is off.
- `admission.classes` is replaced whole, never merged: merging two sets of classes would mix priorities that
  were each chosen relative to their own set.
- Strategy. An operator's `strategy` wins over the preset's. A preset may carry tuned parameter blocks for
  more than one strategy (rag-search has `prefixAware` and `consistentHash`). The expansion keeps only the
  block of the strategy in effect, merged with the operator's block for it, and drops the others. When you
  switch strategy, the preset's tuning for the old strategy cannot linger unused, and its tuning for the
  new one (if it has any) still applies. Blocks the operator writes are never dropped: they are validated
  as always.

This module is pure data and pure functions: no I/O, no clock, no state. router/config/settings.py calls
`expand` for each policy entry and reports a `PresetError` with the entry's path.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

# Replaced whole by an operator's value, never merged: ordered keys whose order is meaning.
_REPLACED_WHOLE = frozenset({("admission", "classes")})


@dataclass(frozen=True)
class Preset:
    name: str
    summary: str  # one line: what it is for (CLI help, the CRD's description)
    text: str  # the policy entry, as YAML with a comment on every value

    def policy(self) -> dict[str, Any]:
        """The entry as data, a fresh copy each call (callers may change it)."""
        return yaml.safe_load(self.text)


class PresetError(ValueError):
    """`field` is the field of the policy entry that is wrong (here always `preset`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


REALTIME_CHAT = Preset(
    name="realtime-chat",
    summary="interactive chat: conversation affinity with a tight load guard, session pins, fail-fast timeouts, "
            "a small high-priority queue",
    text="""\
# realtime-chat: interactive chat, where a user watches every token arrive. Keep each conversation on the
# engine that holds its KV cache, but never let that affinity queue a user behind a hot engine. Fail fast
# onto another replica, and when the fleet is full, shed requests quickly instead of queueing them.
strategy: prefix-aware          # turn n+1 starts with the text of turn n: route it to the engine that caches
                                # that prefix (and a shared system prompt), whatever the client sends
prefixAware:
  maxImbalance: 4               # a tight load guard (default 8): affinity may place a turn at most 4 requests
                                # above the least-loaded engine. Beyond that, re-prefilling the history
                                # elsewhere (tens of ms) costs the user less than a slower, fuller batch
stickiness:                     # keeps a session on the engine of its last turn, even while its prompt is too
                                # short to hash (under one 256-char block); pins are shared through Redis
  key: header:x-session-id      # the client's conversation id...
  fallbackKey: body:user        # ...else the OpenAI `user` field
  ttl: 10m                      # users pause for minutes between turns; after 10 minutes a busy engine has
                                # evicted the conversation's KV blocks anyway
  maxLoadFactor: 1.5            # a pinned engine above 1.5x the mean load loses the session (default 2):
                                # here latency beats cache affinity
timeouts:
  connect: 1s                   # an engine in the cluster accepts a connection in milliseconds: after 1 s,
                                # try another one
  firstByte: 10s                # vLLM sends a stream's headers at once: 10 s without them means a stuck engine,
                                # and the request is retried elsewhere. It also bounds a non-streaming answer
                                # (chat UIs stream; raise it for non-streaming clients with long answers)
  idle: 10s                     # silence inside a stream, the wait for the first token included: the engine
                                # has stalled, so end the stream and let the client retry
  total: 2m                     # a runaway generation never holds a user, or a batch slot, for longer
retries:
  attempts: 2                   # one retry on another engine, made only before any byte reached the user:
                                # waiting through one more timeout beats getting an error
outlierDetection:
  consecutiveFailures: 3        # eject an engine after 3 failures in a row (default 5)...
  baseEjectionTime: 10s         # ...briefly at first (default 30s), so its capacity comes back soon...
  maxEjectionTime: 2m           # ...and for longer each time it is ejected again, up to 2 minutes
admission:
  maxConcurrentPerEndpoint: 64  # requests per engine from each router process; tune it to the concurrency at
                                # which the engine still meets your inter-token latency target (at most its
                                # --max-num-seqs), divided by the number of router processes
  maxQueue: 32                  # small: a request that would wait longer than a short deadline should get its
                                # 429 now
  defaultClass: high            # chat traffic is interactive unless the client says otherwise
  classes:                      # the higher priority first; clients mark background work with x-priority: normal
                                # or low
    high: {priority: 2, deadline: 2s}    # a user who sees nothing for 2 s gives up: shed, so the client can retry
    normal: {priority: 1, deadline: 5s}  # interactive, but not urgent
    low: {priority: 0, deadline: 10s}    # background work such as chat titles and summaries
  shedStatus: 429               # "retry shortly": chat clients and the OpenAI SDKs back off and retry on it
  retryAfter: 1s                # slots free up within seconds, as streams end
""",
)

BATCH_GENERATION = Preset(
    name="batch-generation",
    summary="offline and bulk generation: least-connections in predicted tokens, a large shortest-expected-first "
            "queue at low priority, long timeouts, 503 with a long Retry-After",
    text="""\
# batch-generation: offline and bulk generation (evaluations, synthetic data, summarising a corpus), where
# throughput matters and latency does not. Fill every engine's batch, spread the predicted work rather than
# the number of requests, serve the shortest waiting jobs first, wait minutes rather than fail, and tell
# clients to come back later only when even the queue is full.
strategy: least-connections        # batch work needs no cache affinity: balance the load
leastConnections:
  loadUnit: tokens                 # weigh each request by its predicted cost: a 30k-token document counts for
                                   # what it is, not as one request
cost:
  sessionKey: header:x-batch-id    # jobs of one batch share a template and produce similar output lengths:
                                   # learn the length per batch...
  fallbackKey: body:user           # ...else per client
timeouts:
  connect: 5s                      # the default: slow connections are rare, and a long job is worth the wait
  firstByte: 30m                   # a non-streaming answer's headers come only when it is complete: minutes,
                                   # for long generations in a full batch
  idle: 5m                         # a stream may pause for minutes while the engine preempts and recomputes it
  total: null                      # no overall limit: firstByte and idle bound each phase
retries:
  attempts: 3                      # a failed job gets two more tries (made only before any byte arrived)...
  budgetPercent: 10                # ...but retries add at most 10% load (default 20): long jobs, retried in
                                   # bulk, would bury a struggling fleet
circuitBreaker:
  window: 60s                      # batch requests are few and long: judge failure ratios over a minute...
  minRequests: 50                  # ...and over enough requests (the defaults, 20 in 10s, rarely fill)
admission:
  maxConcurrentPerEndpoint: 256    # fill the batch: tune it to the engine's --max-num-seqs, divided by the
                                   # number of router processes. Beyond it, jobs wait here, in the order below,
                                   # not in vLLM's first-come queue
  maxQueue: 10000                  # large: a bulk client submits thousands of jobs at once, and they should wait,
                                   # not fail
  order: shortest-expected-first   # within a class, the job with the least predicted work goes first: the lowest
                                   # mean completion time, and the most jobs finished per minute
  agingTokensPerSecond: 100        # shorter jobs overtake a long one for at most cost / 100 seconds (a 30k-token
                                   # job: 5 minutes): long jobs are delayed, never starved
  defaultClass: low                # batch work yields: a request without x-priority ranks below those marked
                                   # normal or high
  classes:                         # the higher priority first
    high: {priority: 2, deadline: 5m}     # a job someone is waiting for
    normal: {priority: 1, deadline: 15m}  # a job wanted soon
    low: {priority: 0, deadline: 1h}      # bulk work may wait an hour for capacity before it is shed
  agingSeconds: 5m                 # a low job rises one class per 5 minutes waited, so bulk work still progresses
                                   # under a steady stream of higher-priority jobs
  shedStatus: 503                  # "the service is saturated, come back later", not a client-rate 429
  retryAfter: 30s                  # when even this queue is full, capacity will not free up within seconds
""",
)

RAG_SEARCH = Preset(
    name="rag-search",
    summary="retrieval-augmented generation over shared documents: prefix affinity over long contexts with "
            "bounded loads (or consistent hashing on a tenant), a KV-sized concurrency cap",
    text="""\
# rag-search: retrieval-augmented generation and search. Prompts are long (instructions plus retrieved
# passages, often thousands of tokens), prefill dominates their cost, and many requests share a leading
# context. Route by that content, so an engine computes each context's KV blocks once, with bounded loads,
# so that a popular document cannot overload its engine.
strategy: prefix-aware             # affinity by prompt content: it needs no client header, and it finds sharing
                                   # across tenants and sessions (popular passages, common instructions)
prefixAware:
  blockChars: 512                  # the shared spans are long: blocks of ~128 tokens cover a context with half
                                   # the hashes and index entries of the default, losing at most a block of match
  maxBlocks: 128                   # hash up to 64 KiB (~16k tokens), not the default 16 KiB. Past common
                                   # instructions, the retrieved passages that tell contexts apart are hashed too.
                                   # Measured about 0.3 ms per pick on a 64 KiB prompt, as the default on 16 KiB
  maxImbalance: null               # replaced by the relative guard below, which scales with the load...
  maxLoadFactor: 1.5               # ...a hit saves seconds of prefill, so an engine may hold up to 1.5x the mean
                                   # load before load wins (the bounded loads of consistent hashing)
consistentHash:                    # used only with `strategy: consistent-hash`, the alternative when a tenant's
                                   # requests share its context and the router replicas share no index (no Redis)
  key: header:x-tenant-id          # each tenant's requests go to its engine on the hash ring
  maxLoadFactor: 1.25              # a tenant spills to the next engine on the ring above 1.25x the mean load
timeouts:
  connect: 2s                      # an engine that accepts nothing for 2 s is down: another one serves the
                                   # request, at the price of one prefill
  firstByte: 60s                   # a non-streaming answer includes a long prefill and queueing behind others
  idle: 30s                        # the first token of a stream follows a prefill of up to ~16k tokens, behind
                                   # other long prefills
admission:
  maxConcurrentPerEndpoint: 32     # few long contexts at a time, so that they and the cached prefixes fit in the
                                   # KV cache and are not evicted. Tune it to the engine's KV capacity in tokens
                                   # (vllm:cache_config_info) divided by a typical prompt plus answer (436k /
                                   # 12k = 36 for an 8B model on an 80 GB GPU), and by the router processes
  maxQueue: 256                    # the default: searches wait for a slot, within their class's deadline
""",
)

PRESETS: Mapping[str, Preset] = {p.name: p for p in (REALTIME_CHAT, BATCH_GENERATION, RAG_SEARCH)}


def names() -> tuple[str, ...]:
    return tuple(PRESETS)


def get(name: str) -> Preset | None:
    return PRESETS.get(name)


def unknown_preset(value: Any) -> str:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return f"unknown preset {shown} (presets: {', '.join(names())})"


def expand(entry: Mapping[str, Any], *, strategy_blocks: Mapping[str, str]) -> tuple[dict[str, Any], str]:
    """The policy entry `entry` (it has a `preset` key) with its preset expanded, and the preset's name.

    `strategy_blocks` maps each strategy name to the key of its parameter block (the policy registry's
    `config_key`s). Raises PresetError for an unknown preset.
    """
    name = entry["preset"]
    preset = PRESETS.get(name) if isinstance(name, str) else None
    if preset is None:
        raise PresetError("preset", unknown_preset(name))
    base = preset.policy()
    own = {k: v for k, v in entry.items() if k != "preset"}
    strategy = own.get("strategy", base.get("strategy"))
    kept = strategy_blocks.get(strategy) if isinstance(strategy, str) else None
    blocks = set(strategy_blocks.values())
    base = {k: v for k, v in base.items() if k not in blocks or k == kept}
    return merge(base, own), preset.name


def merge(base: Mapping[str, Any], override: Mapping[str, Any], _at: tuple[str, ...] = ()) -> dict[str, Any]:
    """`base` with `override` on top: mappings merged field by field, everything else replaced (see above)."""
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        here = (*_at, key)
        if isinstance(out.get(key), Mapping) and isinstance(value, Mapping) and here not in _REPLACED_WHOLE:
            out[key] = merge(out[key], value, here)
        else:
            out[key] = copy.deepcopy(value)
    return out
