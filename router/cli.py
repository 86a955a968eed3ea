"""`fleetroute`: one console command, one subcommand per component."""

from __future__ import annotations

import argparse
import sys

ROUTER_EPILOG = """\
configuration (YAML; every field optional except endpoints' id/url/models and policies' name):
  listen:   {host: 0.0.0.0, port: 8080, maxConnections: auto, maxConnectionsPerClient: 0,
             trustedProxies: []}               OpenAI-compatible ingress (/v1/...); auto: from the descriptor
                                               limit, leaving room for admin and engines; per client: 0 = no
                                               cap; X-Forwarded-* believed only from trustedProxies (CIDRs)
  admin:    {host: 127.0.0.1, port: 9090, tokenEnv: FLEETROUTE_ADMIN_TOKEN, maxConnections: 64,
             maxConnectionsPerClient: 16}      /metrics, /healthz, /readyz, /admin/*, /status (a live page
                                               in a browser); a set token guards all but the first three
                                               (/status: log in with it); its own connection budget, of
                                               which one client address may hold 16
  endpoints:                                   static discovery
    - {id: gpu-0, url: http://10.0.0.5:8000, models: [llama-3-8b], weight: 1}
                                               weight: relative capacity (H100 beside A100: ~1.8)
  discovery: {kubernetes: {services: [vllm-a, vllm-b], port: http}}
                                               only the named Services' pods join the static endpoints
                                               (EndpointSlice watch; labelSelector: the older form, which
                                               any Service with the labels joins; docs/kubernetes.md)
             {kubernetes: {inferencePool: NAME, weightLabel: fleetroute.io/weight}}
                                               or the Ready Pods a Gateway API Inference Extension
                                               InferencePool selects, one endpoint per target port
  policies:                                    first policy whose models match a request's model wins;
    - name: chat                               others use the built-in "builtin-fallback" (adaptive, all
                                               defaults; the name is reserved)
      models: ["*"]                            names or shell-style patterns
      preset: realtime-chat                    optional: a tuned policy that the fields below adjust
                                               (see presets)
      strategy: adaptive                       {strategies}
      adaptive: {weights: {gpu: 0.6, memory: 0.3, queue: 0.1}, maxQueue: 32, choices: 2,
                 signals: {gpu: gpu_util, memory: kv_cache_usage, queue: num_waiting}, loadUnit: requests,
                 selection: least-load}        or best-score; choices: all scans every endpoint
      roundRobin: {}                           no parameters
      leastConnections: {loadUnit: requests}   or tokens: in-flight load as predicted cost (see cost)
      consistentHash: {key: "header:x-session-id", maxLoadFactor: null}   or key: body:<field>
      prefixAware: {selection: longest-match, blockChars: 256, maxBlocks: 64, maxBlocksPerEndpoint: auto,
                    minMatchShare: 0.2, maxImbalance: 8, maxInFlight: null, maxLoadFactor: null, sigmaK: null,
                    sharing: {enabled: true, ttl: 10m, maxStreamEntries: 8192},
                    tuning: {enabled: true, window: 30s, tolerance: 0.1}, index: approximate}
                                               selection: or least-prefill, the soonest expected
                                               first token (queued + uncached prefill / measured
                                               speed; no imbalance guard unless set);
                                               auto: sized from the engine's KV capacity; sharing
                                               through Redis when configured; tuned against the
                                               engine's prefix-cache hit rate; index: precise reads the
                                               engines' KV events (see kvEvents)
      composite: {scorers: {gpu: 0.4, memory: {weight: 0.2, signal: kv_cache_usage}, queue: {weight: 0.1,
                  maxQueue: 32}, load: 0.1, prefix: 0.2}, pick: least-load, choices: 2, loadUnit: requests,
                  loadGuard: {maxInFlight, maxImbalance, maxLoadFactor, sigmaK}, prefix: {blockChars: 256, ...}}
                                               your own mix: filter -> weighted scorers -> pick
      aliases: [{name: llama-3-8b, sticky: false, targets: [{model: llama-3-8b-v1, weight: 90},
                                                            {model: llama-3-8b-v2, weight: 10}]}]
                                               model aliases: a request for the name goes to a target by
                                               weight (by session when sticky), its model rewritten
      lora: {spillover: 8}                     the policy's models are LoRA adapters: sent where the
                                               adapter is active, else to a free adapter slot
      timeouts: {connect: 5s, firstByte: 300s, idle: 60s, total: null}
      retries: {attempts: 2, budgetPercent: 20, minRetriesPerSecond: 10}
                                               only before any byte reached the client: connect failures,
                                               first-byte timeouts and 5xx (when another endpoint exists)
      stickiness: {key: "header:x-session-id", fallbackKey: "body:user", ttl: 10m, maxLoadFactor: 2.0}
                                               off by default; on when the block has any field
      health: {enabled: true, interval: 5s, timeout: 2s, path: /health, healthyThreshold: 2,
               unhealthyThreshold: 3, probeRequest: false, gpu: true}
      outlierDetection: {enabled: true, consecutiveFailures: 5, baseEjectionTime: 30s,
                         maxEjectionTime: 300s, maxEjectionPercent: 50}
      circuitBreaker: {enabled: true, window: 10s, minRequests: 20, failureRatio: 0.5,
                       openDuration: 30s, halfOpenRequests: 3}
      slowStart: {enabled: true, window: 30s, aggression: 1.0, minWeight: 0.1}
      panicThreshold: 50                       below this % healthy, a pool routes to all its endpoints
      admission: {maxConcurrentPerEndpoint: null, maxQueue: 256, priorityHeader: x-priority,
                  classes: {high: {priority: 2, deadline: 30s}, normal: {priority: 1, deadline: 60s},
                            low: {priority: 0, deadline: 120s}},      the higher priority first
                  defaultClass: normal, agingSeconds: 10, shedStatus: 429, retryAfter: 1s,
                  order: fifo}                 or shortest-expected-first (agingTokensPerSecond: 1000)
                                               off unless maxConcurrentPerEndpoint is set
      cost: {prefillWeight: 0.2, charsPerToken: 4, priorOutputTokens: 256, sessionKey: "header:x-session-id",
             fallbackKey: "body:user", maxSessions: 10000, window: 32}
                                               request cost = prefillWeight * prompt + predicted output
                                               tokens; on when present or used by loadUnit/order
  limits: {maxBodyBytes: 16777216, maxHeaderBytes: 8190, headerTimeout: 30s, bodyTimeout: 60s,
           keepAliveTimeout: 75s, writeTimeout: 60s}
                                               client connections: request head, each body read, idle
                                               between requests (both listeners), each response write
                                               to a client that stopped reading (ingress)
  telemetry: {enabled: true, interval: 1s, staleAfter: 5s, timeout: 500ms, gpuSource: none}
  redis: {url: redis://redis:6379/0}           default $REDIS_URL; url: null turns Redis off. With Redis:
                                               agents' telemetry, shared session pins, in-flight
                                               counts and prefix indexes. Without: the router
                                               scrapes engines itself
                                               (gpuSource: sim adds a simulator's /sim/gpu)
         {..., cluster: true}                  url is any node of a Redis Cluster
         {sentinel: {masterName: NAME, addresses: ["HOST:PORT", ...], db: 0, tls: false,
                     passwordEnv: VAR}}        a Sentinel-watched master, instead of url; the
                                               sentinels' own password: sentinel.passwordEnv or
                                               sentinel.passwordFile (the master's: below)
         {..., username: NAME, passwordEnv: VAR}   or passwordFile: FILE; never the password itself
  logging: {level: info, accessLog: true}
  auth: {apiKeysFile: FILE, apiKeysEnv: VAR, upstreamApiKeyEnv: VAR}
                                               client API keys ("KEY explain" may ask for routing
                                               explanations, "KEY tenant=NAME" is that tenant's);
                                               the key sent to the engines
  tenancy: {header: x-tenant-id, fairness: true, budgetFailMode: open, budgetTimeout: 100ms,
            tenants: [{name: NAME, weight: 1, requestsPerMinute: N, tokensPerMinute: N}]}
                                               tenants: the key's, else the header's (listed names
                                               only, else default); weighted fair queueing in tokens
                                               within each saturated admission class; budgets per
                                               minute shared through Redis (429 + x-ratelimit-*);
                                               open or closed while Redis is down
  explain: {sampleRate: 0, recent: 256, headerCandidates: 8}
                                               routing decisions recorded and logged unasked (a share),
                                               kept for /admin/decisions. Ask on one request with
                                               x-fleetroute-explain: <admin token> (or 1 with an explain
                                               key): the answer carries x-fleetroute-explanation
  control: {kubernetes: {namespace: inference, allowedModels: [], maxPriority: 1000,
                        overrideFilePolicies: false}}
                                               RoutingPolicy resources applied live, but only within
                                               what is delegated: models inside allowedModels (none by
                                               default), priority <= maxPriority, and the file's
                                               policies matched first unless overrideFilePolicies;
                                               others are refused in their status (docs/kubernetes.md)
  tracing: {enabled: false, endpoint: "http://127.0.0.1:4318/v1/traces", serviceName: fleetroute,
            sampleRatio: 1, timeout: 10s, headersEnv: VAR}
                                               OpenTelemetry spans per request over OTLP/HTTP; the
                                               engine gets the attempt's traceparent
  kvEvents: {endpoints: [{endpoint: ID, address: "tcp://HOST:5557", bind: false, replay: ADDRESS}], port: null,
             topic: "", maxBlocksPerEndpoint: 262144, warmup: 30s, silentAfter: 60s, replayTimeout: 1s}
                                               vLLM's KV-cache events (ZMQ) for prefixAware.index: precise
  stallDetection: {enabled: true, minSilence: 5s, silenceFactor: 4, probeTimeout: 3s}
                                               wedged engines: requests outstanding, no head or chunk for
                                               max(minSilence, silenceFactor x p99 time to first byte),
                                               and a 1-token probe fails: ejected, waiting requests sent
                                               elsewhere, started streams ended with an error event
  workers: 1                                   processes sharing the ports (use one per core)
  shutdownGrace: 30s                           time for in-flight requests on SIGTERM
  drainConnections: 15s                        of which open client connections are still served, each
                                               answer with Connection: close, before idle ones close

presets (`preset: NAME` in a policy or a RoutingPolicy spec; --show-preset NAME prints one):
{presets}
  Fields written beside `preset` adjust it: mappings merge field by field (timeouts: {firstByte: 5s}
  changes only that), any other value replaces the preset's (null included), admission.classes is
  replaced whole, and a strategy written replaces the preset's (keeping the preset's block for it, if any).
  --show-policies prints the config's policies with their presets expanded.

environment:
  FLEETROUTE_CONFIG                            config path when --config is not given
  REDIS_URL                                    Redis when the config has no redis.url or redis.sentinel
  FLEETROUTE_ADMIN_TOKEN                       the admin token (unless admin.tokenEnv names another)
  FLEETROUTE_LISTEN_HOST, FLEETROUTE_LISTEN_PORT, FLEETROUTE_ADMIN_HOST, FLEETROUTE_ADMIN_PORT
                                               override listen/admin addresses

exit codes: 0 clean shutdown, 1 runtime failure, 2 bad command line or configuration.
See docs/configuration.md, docs/policies.md and docs/operations.md.
"""


def _strategies_help() -> str:
    """The registered strategies (router/routing/policies/registry.py), wrapped in the help's right-hand column."""
    import textwrap

    from router.routing.policies.registry import BUILTIN

    column = " " * 47
    return textwrap.fill(" | ".join(policy.name for policy in BUILTIN), 108, initial_indent=column,
                         subsequent_indent=column, break_on_hyphens=False).lstrip()


def _presets_help() -> str:
    """One entry per preset, its summary wrapped in the help's right-hand column."""
    import textwrap

    from router.config import presets

    width = max(len(name) for name in presets.names())
    out = []
    for preset in presets.PRESETS.values():
        head = f"  {preset.name.ljust(width)}  "
        out.append(textwrap.fill(preset.summary, 108, initial_indent=head, subsequent_indent=" " * len(head),
                                 break_on_hyphens=False))
    return "\n".join(out)


def _show_policies(path: str) -> str:
    """The config file's `policies:` as YAML, each preset expanded into the entry the router parses."""
    import yaml

    from router.config.settings import expand_policy
    from router.routing.policies.registry import PolicyRegistry

    with open(path, encoding="utf-8") as fh:
        raw = yaml.safe_load(fh) or {}
    registry = PolicyRegistry()
    out = [f"# The policies of {path}, with their presets expanded (fleetroute router --show-policies).", "policies:"]
    for i, entry in enumerate(raw.get("policies") or []):
        expanded, preset = expand_policy(f"policies[{i}]", entry, registry)
        if preset is not None:
            first = {k: expanded[k] for k in ("name", "models") if k in expanded}  # the entry's identity first
            expanded = {**first, **expanded}
            out.append(f"  # policies[{i}]: preset {preset}, with the file's fields merged on top")
        text = yaml.safe_dump([expanded], sort_keys=False, default_flow_style=False, width=120)
        out.append("\n".join(f"  {line}" for line in text.rstrip().splitlines()))
    return "\n".join(out) + "\n"


def _router(args: argparse.Namespace) -> int:
    import os

    from router.config.settings import ConfigError, load_settings
    from router.runtime.logs import HeldRecords, configure_logging

    if args.show_preset is not None:
        from router.config import presets

        preset = presets.get(args.show_preset)
        assert preset is not None  # argparse's choices
        sys.stdout.write(preset.text)
        return 0
    path = args.config or os.environ.get("FLEETROUTE_CONFIG")
    if not path:
        print("fleetroute router: error: --config is required (or set FLEETROUTE_CONFIG)", file=sys.stderr)
        return 2
    held = HeldRecords()  # what parsing logs (a deprecated form) waits for the file's logging settings
    try:
        settings = load_settings(path)
    except ConfigError as exc:
        held.close()
        print(f"fleetroute router: config error: {exc}", file=sys.stderr)
        return 2
    if args.show_policies:
        held.close()
        sys.stdout.write(_show_policies(path))  # the file is valid: load_settings read it
        return 0
    if args.workers is not None:
        from dataclasses import replace

        settings = replace(settings, workers=args.workers)
    configure_logging(settings.log_level)
    held.replay()
    if settings.workers > 1:
        from router.server.supervisor import run_workers

        return run_workers(settings, path)
    from router.runtime.loop import run_event_loop
    from router.server.app import serve

    try:
        run_event_loop(serve(settings, config_path=path))
    except ConfigError as exc:  # found at start-up, e.g. an unusable kubeconfig for Kubernetes discovery
        print(f"fleetroute router: config error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"fleetroute router: cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetroute", description="Load balancer and router for GPU inference fleets."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from router.config import presets

    router = sub.add_parser(
        "router",
        help="run the OpenAI-compatible routing proxy",
        description="Run the OpenAI-compatible routing proxy.",
        epilog=ROUTER_EPILOG.replace("{presets}", _presets_help()).replace("{strategies}", _strategies_help()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    router.add_argument("--config", "-c", metavar="FILE", help="router YAML configuration")
    router.add_argument(
        "--workers", type=int, metavar="N", help="processes sharing the ports (overrides `workers:`)"
    )
    router.add_argument(
        "--show-preset", metavar="NAME", choices=presets.names(),
        help=f"print a scenario preset's policy, with the reason for each value, and exit "
             f"({', '.join(presets.names())})",
    )
    router.add_argument(
        "--show-policies", action="store_true",
        help="validate the config, print its policies with their presets expanded, and exit",
    )
    router.set_defaults(func=_router)

    # The CLI is the composition root: the one place where router and worker commands meet.
    from loadtest.cli import add_parser as add_loadtest_parser
    from loadtest.demo import add_parser as add_demo_parser
    from router.gateway.cli import add_parser as add_epp_parser
    from worker.agent import add_parser as add_agent_parser
    from worker.node_agent import add_parser as add_node_agent_parser
    from worker.sim.cli import add_parser as add_sim_parser

    add_epp_parser(sub)
    add_sim_parser(sub)
    add_agent_parser(sub)
    add_node_agent_parser(sub)
    add_demo_parser(sub)
    add_loadtest_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "workers", None) is not None and not 1 <= args.workers <= 256:
        parser.error("--workers must be between 1 and 256")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
