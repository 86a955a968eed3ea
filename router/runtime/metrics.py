"""Every Prometheus collector the router exports, in one place, with a description each.

Collectors live in a per-application `CollectorRegistry` (no module-level state: tests build many routers
in one process). In multi-process mode (`workers > 1`) prometheus-client writes every value to files in
`PROMETHEUS_MULTIPROC_DIR` and the admin endpoint aggregates all processes (`render`); gauges declare how
they are merged across processes.

Every family with an `endpoint` label loses that endpoint's series when the endpoint has left and no request
is in flight there any more (`forget_endpoints`, called by router/routing/departures.py), so endpoint churn (pod
names, with Kubernetes discovery) does not grow the exposition for the life of the process. prometheus-client
cannot remove a series in multi-process mode (its value lives in the worker's file and would linger with its
last value), so there the series stay until the workers restart.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector

# Time to first byte spans a cached short answer (ms) to a long queue (minutes).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)
# Output-length prediction errors: a few tokens (a good session estimate) to tens of thousands (a runaway).
TOKEN_ERROR_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000)
RELATIVE_ERROR_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)


TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry
        self.requests = Counter(
            "fleetroute_requests",
            "Requests answered, by model, serving endpoint ('' when none was chosen) and HTTP status.",
            ["model", "endpoint", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            "fleetroute_request_duration_seconds",
            "Time from receiving a proxied request to the end of its response body.",
            ["model", "endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.time_to_first_byte = Histogram(
            "fleetroute_time_to_first_byte_seconds",
            "Time from receiving a proxied request to the first body byte from the endpoint "
            "(for streams: time to first token).",
            ["model", "endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tracing_requests = Counter(
            "fleetroute_tracing_requests",
            "Inference requests seen with tracing on, by whether their trace was sampled (router/server/tracing.py).",
            ["sampled"],
            registry=r,
        )
        self.tracing_spans_exported = Counter(
            "fleetroute_tracing_spans_exported",
            "Spans handed to the trace exporter, by result (success, failure: the collector refused or was "
            "unreachable; failed spans are dropped).",
            ["result"],
            registry=r,
        )
        self.in_flight = Gauge(
            "fleetroute_endpoint_in_flight_requests",
            "Requests this router has sent to an endpoint whose response body has not ended.",
            ["endpoint"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.in_flight_cost = Gauge(
            "fleetroute_endpoint_in_flight_cost_tokens",
            "Predicted cost in tokens (prefillWeight * prompt + predicted output) of the requests this router has "
            "in flight at an endpoint; only requests of policies that estimate costs count.",
            ["endpoint"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.pending_prefill = Gauge(
            "fleetroute_endpoint_pending_prefill_tokens",
            "Prompt tokens this router expects an endpoint still to compute (uncached, sent, no first byte yet); "
            "only requests placed by prefix-aware's least-prefill selection count.",
            ["endpoint"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.prefill_speed = Gauge(
            "fleetroute_endpoint_prefill_speed_tokens_per_second",
            "Measured speed at which an endpoint works through the prefill routed to it (work ahead of a streamed "
            "request over its wait for the first token, running mean); what least-prefill divides by.",
            ["endpoint"],
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.decisions = Counter(
            "fleetroute_policy_decisions",
            "Endpoints chosen by routing policies, by policy name, strategy and endpoint.",
            ["policy", "strategy", "endpoint"],
            registry=r,
        )
        self.explain_requests = Counter(
            "fleetroute_explain_requests",
            "Requests carrying x-fleetroute-explain, by outcome: explained (the sender may ask: admin token or an "
            "API key marked explain) or denied (served normally, without an explanation).",
            ["outcome"],
            registry=r,
        )
        self.decisions_sampled = Counter(
            "fleetroute_decisions_sampled",
            "Routing decisions recorded and logged because explain.sampleRate drew them.",
            registry=r,
        )
        self.decisions_kept = Gauge(
            "fleetroute_decisions_kept",
            "Recent routing decisions held for /admin/decisions (at most explain.recent per process).",
            multiprocess_mode="livesum",
            registry=r,
        )
        self.policy_events = Counter(
            "fleetroute_policy_events",
            "Noteworthy policy decisions: hash_key_missing (consistent-hash fell back to least-connections), "
            "telemetry_unknown (adaptive picked an endpoint without fresh telemetry), load_bound_overflow "
            "(a key walked the ring past an endpoint at its load bound), load_bound_walk_capped (that walk met "
            "32 endpoints at the bound and took the least-loaded one), prefix_hit / prefix_miss / prefix_short "
            "(prefix-aware found / found no endpoint holding the prompt's leading blocks / found one holding less "
            "than minMatchShare of them), prefix_outweighed (least-prefill sent a request away from its prefix's "
            "holder, whose queued prefill or speed made its first token later), load_guard_in_flight / "
            "load_guard_imbalance / load_guard_load_factor / load_guard_sigma (prefix-aware left the best prefix "
            "match because it tripped that load guard: maxInFlight, maxImbalance, maxLoadFactor, sigmaK), "
            "index_precise / index_approximate (with prefixAware.index precise: the pick matched every candidate "
            "on the KV-event index / fell back to the approximate one for some or all).",
            ["policy", "event"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "fleetroute_upstream_errors",
            "Failures talking to endpoints, by kind: connect, connect_timeout, timeout (no response headers within "
            "firstByte), http_5xx, total_timeout, stalled (the endpoint was found stalled while the request "
            "waited or streamed), "
            "idle_timeout (a stream stalled), disconnect (endpoint closed mid-response), invalid_response (its "
            "response was not valid HTTP: an oversized header, a malformed chunk), client_disconnect.",
            ["endpoint", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "fleetroute_retries",
            "Requests retried on another endpoint after a failure that proves the first never received them.",
            ["model"],
            registry=r,
        )
        self.rejected = Counter(
            "fleetroute_rejected_requests",
            "Requests refused by the router itself, by reason (invalid_json, missing_model, "
            "model_not_found, body_too_large, method_not_allowed, not_found, no_endpoint, invalid_api_key, "
            "invalid_admin_token, request_timeout, invalid_body, invalid_body_encoding, "
            "unsupported_content_encoding, expectation_failed, invalid_header_value).",
            ["reason"],
            registry=r,
        )
        self.endpoints = Gauge(
            "fleetroute_endpoints",
            "Endpoints known to the router, by state (serving, draining).",
            ["state"],
            multiprocess_mode="max",
            registry=r,
        )
        self.telemetry_age = Gauge(
            "fleetroute_telemetry_age_seconds",
            "Age of the newest load report per endpoint when the router last applied it: when it arrived, when it went "
            "stale, and at every full rebuild.",
            ["endpoint"],
            multiprocess_mode="min",
            registry=r,
        )
        self.telemetry_unknown = Gauge(
            "fleetroute_telemetry_unknown_endpoints",
            "Endpoints whose load telemetry is missing or stale (policies give them a neutral score).",
            multiprocess_mode="max",
            registry=r,
        )
        self.scrape_errors = Counter(
            "fleetroute_engine_scrape_errors",
            "Failed scrapes of an endpoint's /metrics by the router's embedded telemetry collector (no Redis).",
            ["endpoint"],
            registry=r,
        )
        self.store_up = Gauge(
            "fleetroute_telemetry_store_up",
            "1 if the last read of the telemetry store (Redis, or the embedded store) succeeded, else 0.",
            multiprocess_mode="min",
            registry=r,
        )
        self.telemetry_reads = Counter(
            "fleetroute_telemetry_reads",
            "Telemetry rounds, by kind: full (every endpoint's record read) or changed (only the records agents "
            "announced since the last round, and new endpoints').",
            ["kind"],
            registry=r,
        )
        self.telemetry_subscription_restarts = Counter(
            "fleetroute_telemetry_subscription_restarts",
            "Telemetry announcement subscriptions made again, by reason: error (Redis failed or closed it) or "
            "silent (no message and no answer to a ping for two telemetry intervals: a hung connection).",
            ["reason"],
            registry=r,
        )
        self.telemetry_records_read = Counter(
            "fleetroute_telemetry_records_read",
            "Endpoint records read from the telemetry store (Redis) or the embedded collection.",
            registry=r,
        )
        self.store_errors = Counter(
            "fleetroute_telemetry_store_errors",
            "Failed reads of the telemetry store (Redis unreachable or timing out).",
            registry=r,
        )
        self.telemetry_rejected = Counter(
            "fleetroute_telemetry_rejected_records",
            "Telemetry records ignored, by reason: schema (another schema version), malformed, wrong_endpoint, "
            "oversize (a value over 256 bytes), out_of_range (a value no agent reports: negative, a ratio over 1, "
            "an absurd count), future (reported_at ahead of this router's clock), wrong_type (the key is no hash).",
            ["reason"],
            registry=r,
        )
        self.sticky_sessions = Gauge(
            "fleetroute_sticky_sessions",
            "Sessions pinned to each endpoint in this router's table (live, within their TTL).",
            ["policy", "endpoint"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.sticky_decisions = Counter(
            "fleetroute_sticky_decisions",
            "Requests with a session key, by outcome: hit (kept its endpoint), new (first pin), gone "
            "(pinned endpoint removed, draining or unhealthy: re-pinned), overloaded (over maxLoadFactor: re-pinned).",
            ["policy", "outcome"],
            registry=r,
        )
        self.lora_picks = Counter(
            "fleetroute_lora_picks",
            "Picks for a LoRA adapter (a model of a policy with a lora: block), by policy and where the adapter "
            "stood on the chosen engine: active, free_slot, full or unknown.",
            ["policy", "tier"],
            registry=r,
        )
        self.alias_requests = Counter(
            "fleetroute_alias_requests",
            "Requests for a model alias, by alias and the target they were sent to (both from configuration).",
            ["alias", "target"],
            registry=r,
        )
        self.alias_unserved = Counter(
            "fleetroute_alias_unserved",
            "Requests for a model alias whose drawn target no endpoint served, so another target was drawn "
            "(or, with none served, the request was refused), by alias and the unserved target.",
            ["alias", "target"],
            registry=r,
        )
        self.sticky_store_errors = Counter(
            "fleetroute_sticky_store_errors",
            "Failed reads or writes of session pins in Redis (stickiness then uses this router's table).",
            registry=r,
        )
        self.redis_rejected = Counter(
            "fleetroute_redis_rejected_values",
            "Values read from Redis and dropped, by data (sticky_pin, in_flight, replica, prefix_entry, budget) and "
            "reason (oversize, malformed, out_of_range, future, wrong_type).",
            ["data", "reason"],
            registry=r,
        )
        self.shared_state_errors = Counter(
            "fleetroute_shared_loads_errors",
            "Failed exchanges of in-flight counts with other router replicas through Redis.",
            registry=r,
        )
        self.router_replicas = Gauge(
            "fleetroute_router_replicas",
            "Router replicas sharing in-flight counts through Redis (this one included).",
            multiprocess_mode="max",
            registry=r,
        )
        self.panic = Gauge(
            "fleetroute_panic_mode",
            "1 while a policy's pool for a model has too few healthy endpoints and routes to all of them.",
            ["policy", "model"],
            multiprocess_mode="max",
            registry=r,
        )
        self.slow_start_weight = Gauge(
            "fleetroute_slow_start_weight",
            "An endpoint's slow-start weight factor (ramps from minWeight to 1 after it joins or recovers).",
            ["policy", "endpoint"],
            multiprocess_mode="min",
            registry=r,
        )
        self.excluded = Gauge(
            "fleetroute_endpoint_excluded",
            "1 while an endpoint takes no requests of a policy, by reason: health_check, gpu_lost, "
            "thermal_throttling, xid_errors, ecc_errors, ejected, breaker_open.",
            ["policy", "endpoint", "reason"],
            multiprocess_mode="max",
            registry=r,
        )
        self.ejections = Counter(
            "fleetroute_outlier_ejections",
            "Endpoints ejected by passive outlier detection, by the kind of the failure that tipped it.",
            ["policy", "endpoint", "reason"],
            registry=r,
        )
        self.stalls = Counter(
            "fleetroute_endpoint_stalls",
            "Endpoints found stalled: requests outstanding, no response head or body chunk for longer than the "
            "stall threshold, and the confirming probe failed. Each is ejected (reason stalled) and its requests "
            "released.",
            ["endpoint"],
            registry=r,
        )
        self.stall_probes = Counter(
            "fleetroute_stall_probes",
            "Probes (a 1-token completion) sent to an endpoint silent past its stall threshold, by result: pass "
            "(it answered: busy, not stalled) or fail.",
            ["endpoint", "result"],
            registry=r,
        )
        self.rescued = Counter(
            "fleetroute_rescued_requests",
            "Requests taken off their endpoint before any byte reached the client, to be sent to another, by "
            "reason: stalled, or the endpoint left the pool while they waited (ejected, health_check, gpu_lost).",
            ["model", "reason"],
            registry=r,
        )
        self.breaker_transitions = Counter(
            "fleetroute_breaker_transitions",
            "Circuit breaker state changes, by the state entered (open, half_open, closed).",
            ["policy", "endpoint", "state"],
            registry=r,
        )
        self.breaker_state = Gauge(
            "fleetroute_breaker_state",
            "Circuit breaker state per endpoint: 0 closed, 1 half-open, 2 open.",
            ["policy", "endpoint"],
            multiprocess_mode="max",
            registry=r,
        )
        self.health_checks = Counter(
            "fleetroute_health_checks",
            "Active health check probes, by result (pass, fail).",
            ["policy", "endpoint", "result"],
            registry=r,
        )
        self.retry_budget_exhausted = Counter(
            "fleetroute_retry_budget_exhausted",
            "Attempts whose failure could not be retried because the retry budget (over 10 s, a share of the "
            "requests started plus a floor per second) was used up.",
            ["model"],
            registry=r,
        )
        self.background_errors = Counter(
            "fleetroute_background_errors",
            "Unexpected errors in a step of a background loop (telemetry, telemetry_pubsub, housekeeping, "
            "health_checks, prefix_upkeep, stall_checks); the loop goes on. Any increase is a bug worth reporting.",
            ["task"],
            registry=r,
        )
        self.config_reloads = Counter(
            "fleetroute_config_reloads",
            "Configuration reloads (SIGHUP), by result: applied, rejected (invalid, or a change needing a restart).",
            ["result"],
            registry=r,
        )
        self.policy_info = Gauge(
            "fleetroute_policy_info",
            "1 for each routing policy in effect (file or RoutingPolicy), with its strategy and the scenario preset "
            "it builds on (empty: none); 0 for a policy replaced or removed since the process started.",
            ["policy", "strategy", "preset"],
            multiprocess_mode="max",
            registry=r,
        )
        self._policy_info: set[tuple[str, str, str]] = set()
        self.rebuilds = Counter(
            "fleetroute_snapshot_rebuilds",
            "Routing snapshots (and pickers) rebuilt after endpoint, state or health changes (and telemetry rounds "
            "that changed GPU health); telemetry rounds that changed only telemetry values count in "
            "fleetroute_snapshot_refreshes_total instead.",
            registry=r,
        )
        self.refreshes = Counter(
            "fleetroute_snapshot_refreshes",
            "Telemetry rounds applied without a full rebuild: only the endpoints that reported or went stale get "
            "new views, and only the pickers of pools holding them that read telemetry are refreshed.",
            registry=r,
        )
        self.refreshed_endpoints = Counter(
            "fleetroute_snapshot_refreshed_endpoints",
            "Endpoint views replaced by telemetry refreshes (new telemetry, or a report gone stale); divided by "
            "fleetroute_snapshot_refreshes_total, the endpoints a round updated on average.",
            registry=r,
        )
        self.picker_refreshes = Counter(
            "fleetroute_picker_refreshes",
            "Pickers brought up to date by telemetry refreshes, by strategy and how: patched (the policy's refresh "
            "hook updated the changed endpoints only) or built (no hook: a build over the patched pool).",
            ["strategy", "how"],
            registry=r,
        )
        self.telemetry_out_of_order = Counter(
            "fleetroute_telemetry_out_of_order",
            "Load reports dropped because they were older than the report already held for their endpoint "
            "(delivered out of order).",
            registry=r,
        )
        # Admission control (router/traffic/admission.py): only policies with admission.maxConcurrentPerEndpoint.
        self.admission_queue_depth = Gauge(
            "fleetroute_admission_queue_depth",
            "Requests waiting in a model's admission queue for a free endpoint slot, by model and priority class.",
            ["model", "priority"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.admission_admitted = Counter(
            "fleetroute_admission_admitted",
            "Requests let through a capped pool's admission, at once or after waiting, by model and priority class.",
            ["model", "priority"],
            registry=r,
        )
        self.admission_shed = Counter(
            "fleetroute_admission_shed",
            "Requests shed by admission control, by reason: deadline (waited past its deadline), queue_full (the "
            "queue was full of requests of the same or higher priority), evicted (dropped from a full queue for a "
            "higher-priority request).",
            ["model", "priority", "reason"],
            registry=r,
        )
        self.admission_wait = Histogram(
            "fleetroute_admission_queue_wait_seconds",
            "Time requests waited in an admission queue before being admitted (only those that had to wait).",
            ["model", "priority"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # Tenants (router/traffic/tenants.py, fair_queue.py, budgets.py): only with a `tenancy:` block. The
        # tenant label holds names from the configuration only, never a client's string.
        self.tenant_admitted = Counter(
            "fleetroute_tenant_admitted",
            "Requests of a tenant let on to routing: past its budgets and, for capped pools, admission.",
            ["tenant", "model"],
            registry=r,
        )
        self.tenant_shed = Counter(
            "fleetroute_tenant_shed",
            "Requests of a tenant refused before routing, by reason: requests or tokens (its budget per minute "
            "was spent), too_large (its prompt alone exceeds its tokens per minute), budget_unavailable (Redis "
            "unreachable with budgetFailMode: closed), and the admission reasons deadline, queue_full, evicted.",
            ["tenant", "model", "reason"],
            registry=r,
        )
        self.tenant_queue_depth = Gauge(
            "fleetroute_tenant_queue_depth",
            "Requests of a tenant waiting in a model's admission queue.",
            ["tenant", "model"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.tenant_wait = Histogram(
            "fleetroute_tenant_queue_wait_seconds",
            "Time a tenant's requests waited in an admission queue before being admitted (only those that waited).",
            ["tenant", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tenant_tokens = Counter(
            "fleetroute_tenant_tokens",
            "Tokens of a tenant's requests, by kind: prompt (estimated when the request was let on: what its "
            "token budget is charged) and completion (counted from the answer; a cut stream counts the tokens it "
            "carried).",
            ["tenant", "kind"],
            registry=r,
        )
        self.tenant_budget_limit = Gauge(
            "fleetroute_tenant_budget_limit",
            "A tenant's budget per minute, by kind (requests, tokens), as configured.",
            ["tenant", "kind"],
            multiprocess_mode="max",
            registry=r,
        )
        self.tenant_budget_remaining = Gauge(
            "fleetroute_tenant_budget_remaining",
            "What a tenant's budget had left over the last minute at this process's latest check, by kind "
            "(requests, tokens); shared by all replicas through Redis.",
            ["tenant", "kind"],
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.budget_errors = Counter(
            "fleetroute_tenant_budget_errors",
            "Budget operations that could not reach Redis (or got an answer that was no budget), by what became of "
            "them: allowed (a check, let through: budgetFailMode open), refused (a check, answered 503: closed), "
            "charge_lost (completion tokens or a refund not recorded).",
            ["outcome"],
            registry=r,
        )
        # Request cost prediction (router/routing/cost.py): only policies that estimate costs.
        self.cost_outcomes = Counter(
            "fleetroute_cost_outcomes",
            "Requests with a cost estimate sent to an endpoint, by what the answer taught the output-length "
            "predictor: usage (the engine's usage.completion_tokens), stream (counted stream events), stream_text "
            "(a stream whose steps vLLM merged: its text bytes over learned bytes per token), unknown (a complete "
            "response without any: not learned), incomplete (cut short, failed or not a 200: not learned).",
            ["model", "outcome"],
            registry=r,
        )
        self.cost_abs_error = Histogram(
            "fleetroute_cost_output_tokens_abs_error",
            "Absolute error of the predicted output tokens of requests that completed, in tokens "
            "(|predicted - actual|, all choices).",
            ["model"],
            buckets=TOKEN_ERROR_BUCKETS,
            registry=r,
        )
        self.cost_relative_error = Histogram(
            "fleetroute_cost_output_tokens_relative_error",
            "Relative error of the predicted output tokens of requests that completed: |predicted - actual| / "
            "max(actual, 1).",
            ["model"],
            buckets=RELATIVE_ERROR_BUCKETS,
            registry=r,
        )
        self.cost_predicted_tokens = Counter(
            "fleetroute_cost_predicted_output_tokens",
            "Predicted output tokens of the requests counted in fleetroute_cost_actual_output_tokens_total; the "
            "ratio of the two is the predictor's bias.",
            ["model"],
            registry=r,
        )
        self.cost_actual_tokens = Counter(
            "fleetroute_cost_actual_output_tokens",
            "Actual output tokens of completed requests with a cost estimate (what the predictor learned).",
            ["model"],
            registry=r,
        )
        self.cost_sessions = Gauge(
            "fleetroute_cost_predictor_sessions",
            "Sessions whose output lengths the predictor keeps (bounded by cost.maxSessions per model).",
            ["model"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.cost_chars_per_token = Gauge(
            "fleetroute_cost_chars_per_token",
            "Characters per prompt token, as calibrated from the engines' usage.prompt_tokens (the prompt "
            "estimate's divisor; cost.charsPerToken until a response reports its prompt tokens).",
            ["model"],
            multiprocess_mode="max",
            registry=r,
        )
        # Endpoint discovery (router/kube/discovery/): the source is `kubernetes` (EndpointSlice watch) or
        # `inferencepool` (the Pods of an InferencePool).
        self.discovery_up = Gauge(
            "fleetroute_discovery_up",
            "1 while endpoint discovery is in sync with its source (the Kubernetes API answers and is watched), "
            "0 while it is not (the last known endpoints are kept).",
            ["source"],
            multiprocess_mode="min",
            registry=r,
        )
        self.discovery_errors = Counter(
            "fleetroute_discovery_errors",
            "Failed discovery requests, by source and kind: list, watch (opening or reading a watch failed), "
            "pod (reading a Pod for its models annotation failed), pool (listing or watching the InferencePool).",
            ["source", "kind"],
            registry=r,
        )
        self.discovery_relists = Counter(
            "fleetroute_discovery_relists",
            "Full lists of the discovered objects, by reason: initial, expired (410 Gone: the watch's "
            "resourceVersion is older than the API server keeps), pool (the InferencePool), pool-changed (its "
            "selector or ports changed).",
            ["source", "reason"],
            registry=r,
        )
        self.discovery_updates = Counter(
            "fleetroute_discovery_updates",
            "Changed endpoint sets handed to the balancer by discovery (a burst of changes counts once).",
            ["source"],
            registry=r,
        )
        # Endpoints leaving the endpoint set (router/routing/departures.py).
        self.endpoints_forgotten = Counter(
            "fleetroute_endpoints_forgotten",
            "Endpoints that left the endpoint set (discovery or a config reload) and whose state and series were "
            "freed: at once, or when the last request this router had in flight there ended.",
            registry=r,
        )
        self.endpoints_leaving = Gauge(
            "fleetroute_endpoints_leaving",
            "Endpoints that left the endpoint set while this router still had requests in flight there: their "
            "in-flight counts and series are kept until the last of those requests ends.",
            multiprocess_mode="livesum",
            registry=r,
        )

        # KV-cache events from the engines (router/routing/prefix/kv_events.py) and the precise prefix index they feed.
        self.kv_events = Counter(
            "fleetroute_kv_events",
            "KV-cache events applied per endpoint, by type: stored / removed (blocks), cleared (AllBlocksCleared), "
            "orphan (a stored block whose parent the index never saw: not indexed), evicted (dropped at the "
            "kvEvents.maxBlocksPerEndpoint cap).",
            ["endpoint", "type"],
            registry=r,
        )
        self.kv_events_rejected = Counter(
            "fleetroute_kv_events_rejected",
            "KV event messages that were not (topic, 8-byte sequence, EventBatch): skipped, and a resync follows.",
            ["endpoint"],
            registry=r,
        )
        self.kv_event_resyncs = Counter(
            "fleetroute_kv_event_resyncs",
            "Times an endpoint's precise index was reset or set aside, by reason: gap (sequence numbers lost and "
            "not replayed), replayed (a gap filled from the engine's replay socket), restart (the sequence went "
            "back: the engine restarted), joined_mid_stream, rejected, silent (no event for silentAfter).",
            ["endpoint", "reason"],
            registry=r,
        )
        self.kv_index_blocks = Gauge(
            "fleetroute_kv_index_blocks",
            "KV blocks the precise prefix index holds per endpoint, as its KV events reported them.",
            ["endpoint"],
            multiprocess_mode="max",
            registry=r,
        )
        self.kv_index_precise = Gauge(
            "fleetroute_kv_index_precise",
            "1 while an endpoint's KV events are complete (picks use the precise index for it), 0 while it warms "
            "up after a gap or is silent (the approximate index answers for it).",
            ["endpoint"],
            multiprocess_mode="max",
            registry=r,
        )

        # The prefix-aware index (router/routing/prefix/index.py), its tuning and its sharing through Redis.
        self.prefix_index_blocks = Gauge(
            "fleetroute_prefix_index_blocks",
            "Prompt blocks the prefix-aware index holds per endpoint (routed by this router or shared by others).",
            ["policy", "model", "endpoint"],
            multiprocess_mode="max",
            registry=r,
        )
        self.prefix_index_distinct = Gauge(
            "fleetroute_prefix_index_distinct_blocks",
            "Distinct prompt blocks in a pool's prefix index: the entries of its inverted index (block -> the "
            "endpoints holding it), at most the sum of fleetroute_prefix_index_blocks over the pool.",
            ["policy", "model"],
            multiprocess_mode="max",
            registry=r,
        )
        self.prefix_index_bound = Gauge(
            "fleetroute_prefix_index_bound_blocks",
            "The prefix index's LRU bound per endpoint: maxBlocksPerEndpoint (auto: the engine's KV capacity in "
            "router blocks) times the tuner's factor.",
            ["policy", "model", "endpoint"],
            multiprocess_mode="max",
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "fleetroute_prefix_cache_hit_rate",
            "Prefix-cache hit rate per endpoint over the last tuning window, by source: estimated (the share of "
            "routed prompt text the index said was cached) and engine (the engine's own token counters).",
            ["policy", "model", "endpoint", "source"],
            multiprocess_mode="mostrecent",
            registry=r,
        )
        self.prefix_bound_changes = Counter(
            "fleetroute_prefix_index_bound_changes",
            "Changes of an endpoint's prefix-index bound, by reason: config (maxBlocksPerEndpoint set), kv_capacity "
            "(the engine reported its KV capacity), fallback (no capacity known yet), shrink (the index claimed more "
            "hits than the engine delivered), grow (they agreed again).",
            ["policy", "reason"],
            registry=r,
        )
        self.prefix_shared_blocks = Counter(
            "fleetroute_prefix_shared_blocks",
            "Prefix blocks exchanged with other router replicas through Redis, by outcome: published, received, "
            "expired (older than the sharing TTL when read), ignored (an endpoint this router does not know), "
            "dropped (not queued: the outbox was full).",
            ["outcome"],
            registry=r,
        )
        self.prefix_sharing_up = Gauge(
            "fleetroute_prefix_sharing_up",
            "1 if the last exchange of prefix blocks through Redis succeeded, else 0 (the index is then local).",
            multiprocess_mode="min",
            registry=r,
        )
        self.prefix_sharing_errors = Counter(
            "fleetroute_prefix_sharing_errors",
            "Failed exchanges of prefix blocks through Redis (retried with backoff; routing goes on locally).",
            registry=r,
        )
        self.event_loop_lag = Histogram(
            "fleetroute_event_loop_lag_seconds",
            "How much later than asked the event loop woke a probe timer, sampled every 100 ms "
            "(router/server/loop_lag.py): "
            "the delay every request, chunk and probe of this process saw at that moment. Over 0.1 s is a stall "
            "streaming clients notice.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        # Client connections on the two listeners (router/server/connections.py): caps and read timeouts.
        self.client_connections = Gauge(
            "fleetroute_client_connections",
            "Client connections open, by listener (ingress, admin).",
            ["listener"],
            multiprocess_mode="livesum",
            registry=r,
        )
        self.client_connections_rejected = Counter(
            "fleetroute_client_connections_rejected",
            "Client connections refused at once (503 or 429, then closed), by listener and reason: total (the "
            "listener held maxConnections) or per_client (the client address held maxConnectionsPerClient).",
            ["listener", "reason"],
            registry=r,
        )
        self.client_connections_drained = Counter(
            "fleetroute_client_connections_drained",
            "Client connections closed during a shutdown drain (router/server/drain.py), by listener and how: "
            "connection_close (answered with Connection: close: the client was told), client (the client closed "
            "it), timeout (a client timeout), idle (still idle when drainConnections ran out, or idle again after "
            "a request begun before the drain: closed unannounced, which a client sending at that instant sees "
            "fail), cut (still busy when shutdownGrace ran out: its request was cancelled).",
            ["listener", "how"],
            registry=r,
        )
        self.client_timeouts = Counter(
            "fleetroute_client_timeouts",
            "Client connections closed, or requests refused with 408, for taking too long, by listener and phase: "
            "header (the request head was not complete within limits.headerTimeout), body (a read of the request "
            "body waited limits.bodyTimeout), keepalive (idle for limits.keepAliveTimeout between requests: the "
            "normal end of a keep-alive connection), write (a response write waited limits.writeTimeout for a "
            "client that stopped reading: the connection was cut and the engine's request cancelled).",
            ["listener", "phase"],
            registry=r,
        )
        self.status_logins = Counter(
            "fleetroute_status_logins",
            "Status page logins (POST /status/login on the admin listener), by result: success (a session cookie "
            "was issued) or failure (a wrong or missing admin token).",
            ["result"],
            registry=r,
        )
        self.status_feed_requests = Counter(
            "fleetroute_status_feed_requests",
            "Status page data feed requests answered (GET /status/feed): about one per second per open page.",
            registry=r,
        )
        # The ext_proc endpoint picker (router/gateway/): Envoy forwards, the router only decides.
        self.epp_decisions = Counter(
            "fleetroute_epp_decisions",
            "Endpoint-picker decisions answered to the gateway over ext_proc, by model ('' when the request named "
            "none the fleet serves) and outcome: routed (a destination was set), no_endpoint (503), shed (admission "
            "refused it: 429 or 503), invalid (the request was refused: 4xx), error (an unexpected failure: 500).",
            ["model", "outcome"],
            registry=r,
        )
        self.epp_decision_seconds = Histogram(
            "fleetroute_epp_decision_seconds",
            "Time from the request body's arrival at the endpoint picker to its answer (parse, admission wait "
            "included, and pick).",
            buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.1, 1.0, 10.0),
            registry=r,
        )
        self.epp_served_elsewhere = Counter(
            "fleetroute_epp_served_elsewhere",
            "Responses the gateway reports as served by another endpoint than the picked one (a fallback of the "
            "list taken on a retry): the request's in-flight count moved there.",
            registry=r,
        )
        self.epp_streams = Gauge(
            "fleetroute_epp_streams",
            "ext_proc streams open (one per request the gateway is processing).",
            multiprocess_mode="livesum",
            registry=r,
        )
        # The families whose series name an endpoint, with the position of that label. prometheus-client has no
        # public accessor for a family's label names and series (`_labelnames`, `_metrics`). Its
        # `remove_by_labels` (0.24+) would scan every series once per endpoint that left: 1.5 s for 100 of them
        # on a 1,000-endpoint fleet, against 10 ms in one pass (`forget_endpoints`).
        self._endpoint_families = tuple(
            (m, m._labelnames.index("endpoint"))
            for m in vars(self).values() if isinstance(m, MetricWrapperBase) and "endpoint" in m._labelnames
        )

    def child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, cached: labels() costs microseconds, and the request path calls it for
        every request. Label values here are bounded (served models, endpoints, statuses)."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def set_policies(self, policies: Iterable[Any]) -> None:
        """Publish the policies in effect (PolicySpecs) in `fleetroute_policy_info`: 1 each, 0 for those gone.
        A series set to 0 rather than removed: in multi-process mode a removed series would linger in the
        files with its last value, 1."""
        current = {(p.name, p.strategy, p.preset or "") for p in policies}
        for labels in self._policy_info - current:
            self.policy_info.labels(*labels).set(0)
        for labels in current:
            self.policy_info.labels(*labels).set(1)
        self._policy_info = current

    def forget_endpoints(self, gone: frozenset[str]) -> None:
        """Remove every series labelled with one of these endpoints (they left, and nothing is in flight there
        any more), in every family, whatever its other labels, and drop the cached children. An id that comes
        back later starts new series."""
        self._children = {k: v for k, v in self._children.items() if gone.isdisjoint(k[1])}
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return  # not possible there (see the module docstring); prometheus-client would only warn
        for family, at in self._endpoint_families:  # one pass over each family, however many endpoints left
            for labels in [labels for labels in family._metrics if labels[at] in gone]:
                family.remove(*labels)

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition (body, content type): this process's registry, or every worker process's in
        multi-process mode. OpenMetrics when the scraper's Accept asks for it: only that format carries the
        TTFT histogram's exemplars (trace ids, router/server/tracing.py); else the classic text format."""
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        registry = self.registry
        if directory:  # no exemplars there: prometheus-client does not keep them across processes
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=directory)
        if "application/openmetrics-text" in accept:
            encoder, content_type = choose_encoder(accept)
            return encoder(registry), content_type
        return generate_latest(registry), TEXT_CONTENT_TYPE
