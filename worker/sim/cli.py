"""`fleetroute sim` command line: parse, validate, build the engine, serve."""

from __future__ import annotations

import argparse
import random
import sys

BATCHING = ("continuous", "dynamic", "static")


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "sim",
        help="run one simulated vLLM replica (calibrated GPU timing, OpenAI-compatible API)",
        description="Run one simulated vLLM replica: OpenAI-compatible API, vLLM /metrics, GPU telemetry at "
        "/sim/gpu. Timing follows the calibrated step-time model of the chosen GPU (docs/simulator.md).",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000; 0 picks a free one)")
    p.add_argument("--gpu", default="h100", help="GPU profile: h100, a100-80g, a10g, l4, or one from --profiles")
    p.add_argument("--profiles", metavar="FILE", help="YAML file with custom GPU profiles")
    p.add_argument("--model", default="llama-3-8b", help="served model name (any string)")
    p.add_argument("--seed", type=int, default=0, help="seed for step jitter and sampled output lengths")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one batch (default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="token budget per engine step, chunked prefill (default 8192)")
    p.add_argument("--max-model-len", type=int, default=8192, help="context length limit (default 8192)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every simulated duration by this (10 = ten times slower; default 1)")
    p.add_argument("--batching", choices=BATCHING, default="continuous",
                   help="continuous (vLLM), or the older dynamic/static batching for comparison")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")
    p.add_argument("--fault-injection", action="store_true",
                   help="enable POST/DELETE /sim/faults (slowdown, errors, hang, stalled streams, unhealthy)")
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"fleetroute sim: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from router.cli import run_event_loop
    from router.logs import configure_logging
    from worker.sim.engine import EngineConfig, EngineCore
    from worker.sim.profiles import load_profiles, profile
    from worker.sim.server import SimSettings, run_sim

    if not 0 <= args.port <= 65535:
        return _fail(f"--port must be between 0 and 65535, got {args.port}")
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        if getattr(args, name) < 1:
            return _fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.time_scale > 0:
        return _fail(f"--time-scale must be > 0, got {args.time_scale}")
    try:
        custom = load_profiles(args.profiles) if args.profiles else None
        gpu = profile(args.gpu, custom)
    except (ValueError, OSError) as exc:
        return _fail(str(exc))
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        batching=args.batching,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    settings = SimSettings(
        model=args.model, profile=gpu, engine=config, host=args.host, port=args.port, seed=args.seed,
        time_scale=args.time_scale, max_model_len=args.max_model_len, fault_injection=args.fault_injection,
    )
    configure_logging("info")
    try:
        run_event_loop(run_sim(settings, EngineCore(gpu, config, random.Random(args.seed))))
    except OSError as exc:
        return _fail(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
    return 0
