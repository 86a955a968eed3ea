"""`fleetroute`: one console command, one subcommand per component."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Coroutine
from typing import Any

ROUTER_EPILOG = """\
configuration (YAML; every field optional except endpoints' id/url/models and policies' name):
  listen:   {host: 0.0.0.0, port: 8080}        OpenAI-compatible ingress (/v1/...)
  admin:    {host: 127.0.0.1, port: 9090, tokenEnv: FLEETROUTE_ADMIN_TOKEN}
                                               /metrics, /healthz, /readyz, /admin/*; a set token guards
                                               all but the first three
  endpoints:                                   static discovery
    - {id: gpu-0, url: http://10.0.0.5:8000, models: [llama-3-8b]}
  discovery: {kubernetes: {service: vllm, port: http}}   or labelSelector; pods join the static endpoints
                                               (EndpointSlice watch; models, RBAC: docs/kubernetes.md)
  policies:                                    first policy whose models match a request's model wins;
    - name: chat                               others use the built-in "default" (adaptive, all defaults)
      models: ["*"]                            names or shell-style patterns
      strategy: adaptive                       round-robin | least-connections | consistent-hash |
                                               adaptive | prefix-aware
      adaptive: {weights: {gpu: 0.6, memory: 0.3, queue: 0.1}, maxQueue: 32, choices: 2,
                 signals: {gpu: gpu_util, memory: kv_cache_usage, queue: num_waiting}}
      consistentHash: {key: "header:x-session-id", maxLoadFactor: null}   or key: body:<field>
      prefixAware: {blockChars: 256, maxBlocks: 64, maxBlocksPerEndpoint: 32768, maxImbalance: 8,
                    maxInFlight: null}
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
                  classes: {high: {deadline: 30s}, normal: {deadline: 60s}, low: {deadline: 120s}},
                  defaultClass: normal, agingSeconds: 10, shedStatus: 429, retryAfter: 1s}
                                               off unless maxConcurrentPerEndpoint is set
  limits: {maxBodyBytes: 16777216, maxHeaderBytes: 8190}
  telemetry: {enabled: true, interval: 1s, staleAfter: 5s, timeout: 500ms, gpuSource: none}
  redis: {url: redis://redis:6379/0}           default $REDIS_URL; url: null turns Redis off. With Redis:
                                               agents' telemetry, shared session pins and in-flight
                                               counts. Without: the router scrapes engines itself
                                               (gpuSource: sim adds a simulator's /sim/gpu)
  logging: {level: info, accessLog: true}
  auth: {apiKeysFile: FILE, apiKeysEnv: VAR, upstreamApiKeyEnv: VAR}
                                               client API keys; the key sent to the engines
  workers: 1                                   processes sharing the ports (use one per core)
  shutdownGrace: 30s                           time for in-flight requests on SIGTERM

environment:
  FLEETROUTE_CONFIG                            config path when --config is not given
  REDIS_URL                                    Redis when the config has no redis.url key
  FLEETROUTE_ADMIN_TOKEN                       the admin token (unless admin.tokenEnv names another)
  FLEETROUTE_LISTEN_HOST, FLEETROUTE_LISTEN_PORT, FLEETROUTE_ADMIN_HOST, FLEETROUTE_ADMIN_PORT
                                               override listen/admin addresses

exit codes: 0 clean shutdown, 1 runtime failure, 2 bad command line or configuration.
See docs/configuration.md, docs/policies.md and docs/operations.md.
"""


def run_event_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run on uvloop where installed (faster sockets), the standard loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _router(args: argparse.Namespace) -> int:
    import os

    from router.logs import configure_logging
    from router.settings import ConfigError, load_settings

    path = args.config or os.environ.get("FLEETROUTE_CONFIG")
    if not path:
        print("fleetroute router: error: --config is required (or set FLEETROUTE_CONFIG)", file=sys.stderr)
        return 2
    try:
        settings = load_settings(path)
    except ConfigError as exc:
        print(f"fleetroute router: config error: {exc}", file=sys.stderr)
        return 2
    if args.workers is not None:
        from dataclasses import replace

        settings = replace(settings, workers=args.workers)
    configure_logging(settings.log_level)
    if settings.workers > 1:
        from router.workers import run_workers

        return run_workers(settings, path)
    from router.app import serve

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
    router = sub.add_parser(
        "router",
        help="run the OpenAI-compatible routing proxy",
        description="Run the OpenAI-compatible routing proxy.",
        epilog=ROUTER_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    router.add_argument("--config", "-c", metavar="FILE", help="router YAML configuration")
    router.add_argument(
        "--workers", type=int, metavar="N", help="processes sharing the ports (overrides `workers:`)"
    )
    router.set_defaults(func=_router)

    # The CLI is the composition root: the one place where router and worker commands meet.
    from loadtest.demo import add_parser as add_demo_parser
    from worker.agent import add_parser as add_agent_parser
    from worker.sim.cli import add_parser as add_sim_parser

    add_sim_parser(sub)
    add_agent_parser(sub)
    add_demo_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "workers", None) is not None and not 1 <= args.workers <= 256:
        parser.error("--workers must be between 1 and 256")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
