"""`fleetroute`: one console command, one subcommand per component."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Coroutine
from typing import Any

ROUTER_EPILOG = """\
configuration (YAML; every field optional except endpoints' id/url/models):
  listen:   {host: 0.0.0.0, port: 8080}        OpenAI-compatible ingress (/v1/...)
  admin:    {host: 127.0.0.1, port: 9090}      /metrics, /healthz, /readyz, /admin/endpoints
  endpoints:                                   static discovery
    - {id: gpu-0, url: http://10.0.0.5:8000, models: [llama-3-8b]}
  policies:                                    first policy whose models match a request's model wins
    - name: default
      models: ["*"]                            names or shell-style patterns
      strategy: adaptive                       round-robin | least-connections | consistent-hash | adaptive
      adaptive: {weights: {gpu: 0.6, memory: 0.3, queue: 0.1}, maxQueue: 32, choices: 2,
                 signals: {gpu: gpu_util, memory: kv_cache_usage, queue: num_waiting}}
      consistentHash: {key: "header:x-session-id"}   or body:<field>, e.g. body:user
      timeouts: {connect: 5s, firstByte: 300s, idle: 60s}
      retries: {attempts: 2}                   connection failures only, on another endpoint
  limits: {maxBodyBytes: 16777216}
  telemetry: {enabled: true, interval: 1s, staleAfter: 5s, timeout: 500ms, gpuSource: none}
  redis: {url: redis://127.0.0.1:6379/0}     agents publish telemetry there; without it the router
                                               scrapes engines itself (gpuSource: sim adds /sim/gpu)
  logging: {level: info, accessLog: true}
  workers: 1                                   processes sharing the ports (use one per core)
  shutdownGrace: 30s                           time for in-flight requests on SIGTERM

environment:
  FLEETROUTE_CONFIG                            config path when --config is not given
  REDIS_URL                                    Redis for telemetry when the config has no redis.url
  FLEETROUTE_LISTEN_HOST, FLEETROUTE_LISTEN_PORT, FLEETROUTE_ADMIN_HOST, FLEETROUTE_ADMIN_PORT
                                               override listen/admin addresses

exit codes: 0 clean shutdown, 1 runtime failure, 2 bad command line or configuration.
See docs/policies.md and docs/architecture.md.
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
