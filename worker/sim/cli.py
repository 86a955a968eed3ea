"""`fleetroute sim` command line: parse, validate, build the engine, serve.

**vLLM's command line** (`--vllm ARGS...`): everything after `--vllm` is read as the arguments of vLLM's
OpenAI server (`vllm serve` / `python -m vllm.entrypoints.openai.api_server`), so the simulator can stand in
for the vLLM image wherever a vLLM command line is rendered (the Helm chart's worker pods; the
cluster-in-a-box test runs them this way). What the simulator models is used: the model (positional or
`--model`, shown as `root` in /v1/models), `--served-model-name` (one or more; answers carry the first, as
vLLM's do), `--host`, `--port`, `--max-model-len` (vLLM's `8k`/`8K` forms too), `--max-num-seqs`,
`--max-num-batched-tokens`, `--[no-]enable-prefix-caching`, `--seed`, `--kv-cache-dtype` (an FP8 cache
holds twice the tokens of the profile's 16-bit one), `--kv-events-config` (KV-cache events published as
vLLM's, worker/sim/kv_events.py) and `--enable-lora`, `--max-loras`, `--lora-modules` (adapters served and
scheduled as vLLM's: worker/sim/engine.py). `--tensor-parallel-size`, `--gpu-memory-utilization`,
`--[no-]enable-chunked-prefill`, `--speculative-config` and `--max-lora-rank` are validated as vLLM does but
not modelled (the GPU profile fixes the step times and the KV pool), and one log line says so. Any other
argument is ignored, with one log line naming them. The simulator's own options (`--gpu`, `--time-scale`,
...) go before `--vllm`.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
import sys

BATCHING = ("continuous", "dynamic", "static")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")  # vLLM 0.11's choices
VLLM_DEFAULT_PORT = 8000

log = logging.getLogger("fleetroute.sim")


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
    p.add_argument("--kv-events-endpoint", metavar="ZMQ_ADDRESS",
                   help="publish KV-cache events as vLLM does (its kv-events-config `endpoint`): tcp://*:PORT, ipc:// "
                        "or inproc:// binds, any other address (tcp://127.0.0.1:PORT) connects to a subscriber "
                        "that binds")
    p.add_argument("--kv-events-topic", default="", help="topic frame of each KV event message (default empty)")
    p.add_argument("--kv-events-replay-endpoint", metavar="ZMQ_ADDRESS",
                   help="bind a replay (ROUTER) socket here, as vLLM's `replay_endpoint`")
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (--lora-modules), as vLLM")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters served under NAME (requests name it as their model)")
    p.add_argument("--max-loras", type=int, default=1,
                   help="most distinct adapters in one batch, and GPU slots for adapters (default 1, as vLLM)")
    p.add_argument("--lora-load-ms", type=float, default=20.0,
                   help="simulated time to load an adapter into a GPU slot (default 20)")
    p.add_argument("--fault-injection", action="store_true",
                   help="enable POST/DELETE /sim/faults (slowdown, errors, hang, stalled streams, unhealthy)")
    p.add_argument("--vllm", nargs=argparse.REMAINDER, metavar="VLLM_ARG",
                   help="the rest of the command line is vLLM's OpenAI-server arguments (--model, "
                        "--served-model-name, --host, --port, --max-model-len, --enable-prefix-caching, "
                        "--kv-cache-dtype...): the simulator stands in for a vLLM command line; arguments it "
                        "does not model are logged and ignored")
    p.set_defaults(func=run)


def _human_int(text: str) -> int:
    """vLLM's `human_readable_int`: 8192, 8k (x1000), 8K (x1024), 1m, 1M, 25.6k."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"invalid integer: {text!r}")
    number, suffix = m.groups()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[suffix]
    value = float(number) * scale
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"not a whole number of tokens: {text!r}")
    return int(value)


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _json_object(text: str) -> dict:  # type: ignore[type-arg]
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _kv_events(args: argparse.Namespace) -> object:
    """The KV event publisher's settings from --kv-events-* (or vLLM's --kv-events-config), or None."""
    from worker.sim.kv_events import KVEventsConfig

    endpoint = getattr(args, "kv_events_endpoint", None)
    if endpoint is None:
        return None
    return KVEventsConfig(endpoint=endpoint, topic=args.kv_events_topic, replay_endpoint=args.kv_events_replay_endpoint)


class _VllmArgsError(Exception):
    pass


class _VllmParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _VllmArgsError(message)


def vllm_parser() -> argparse.ArgumentParser:
    """The part of vLLM's OpenAI-server command line the simulator reads (names, forms and defaults as vLLM's)."""
    p = _VllmParser(prog="vllm serve", add_help=False, allow_abbrev=False)
    p.add_argument("--model", default=None)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=VLLM_DEFAULT_PORT)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=_human_int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=_human_int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    p.add_argument("--kv-events-config", type=_json_object, default=None)
    p.add_argument("--enable-lora", action="store_true", default=False)
    p.add_argument("--max-loras", type=int, default=None)
    p.add_argument("--lora-modules", nargs="+", default=None)
    # Validated, not modelled:
    p.add_argument("--max-lora-rank", type=int, default=None)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=None)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--speculative-config", type=_json_object, default=None)
    return p


NOT_MODELLED = ("tensor_parallel_size", "gpu_memory_utilization", "enable_chunked_prefill", "speculative_config",
                "max_lora_rank")


def apply_vllm_args(args: argparse.Namespace, argv: list[str]) -> tuple[list[str], list[str]]:
    """Read vLLM's arguments `argv` into the sim's `args` (in place). Returns (the vLLM options given that
    are not modelled, the arguments ignored as unknown). Raises ValueError on a value vLLM would refuse."""
    # `vllm serve MODEL [options]`: the model comes first. Read only there, an unknown option's value
    # (`--dtype bfloat16`) is never taken for a model.
    model_tag = argv[0] if argv and not argv[0].startswith("-") else None
    try:
        vllm, unknown = vllm_parser().parse_known_args(argv[1:] if model_tag else argv)
    except _VllmArgsError as exc:
        raise ValueError(f"vLLM arguments: {exc}") from None
    if model_tag and vllm.model and model_tag != vllm.model:
        raise ValueError(f"vLLM arguments: two models: {model_tag!r} and --model {vllm.model!r}")
    model = model_tag or vllm.model or "Qwen/Qwen3-0.6B"  # vLLM's default --model
    names = vllm.served_model_name or [model]
    args.model, args.aliases, args.model_path = names[0], tuple(names[1:]), model
    args.host = vllm.host or "0.0.0.0"  # vLLM binds every interface unless --host is given
    args.port = vllm.port
    args.seed = vllm.seed
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(vllm, name) is not None:
            setattr(args, name, getattr(vllm, name))
    if vllm.enable_prefix_caching is not None:
        args.no_prefix_caching = not vllm.enable_prefix_caching
    args.kv_cache_dtype = vllm.kv_cache_dtype
    args.enable_lora = vllm.enable_lora
    if vllm.max_loras is not None:
        args.max_loras = vllm.max_loras
    args.lora_modules = vllm.lora_modules or []
    events = vllm.kv_events_config
    if events is not None and events.get("enable_kv_cache_events") and events.get("publisher", "zmq") == "zmq":
        # vLLM's KVEventsConfig: its default endpoint is tcp://*:5557; topic and replay_endpoint are optional.
        args.kv_events_endpoint = events.get("endpoint", "tcp://*:5557")
        args.kv_events_topic = events.get("topic", "")
        args.kv_events_replay_endpoint = events.get("replay_endpoint")
    if vllm.tensor_parallel_size is not None and vllm.tensor_parallel_size < 1:
        raise ValueError(f"vLLM arguments: --tensor-parallel-size must be >= 1, got {vllm.tensor_parallel_size}")
    not_modelled = [f"--{n.replace('_', '-')}" for n in NOT_MODELLED if getattr(vllm, n) is not None]
    return not_modelled, unknown


def lora_module_specs(specs: list[str], *, enabled: bool) -> tuple[tuple[str, str], ...]:
    """(name, path) of each `--lora-modules` entry: `NAME=PATH`, or vLLM's JSON form with `name` and `path`."""
    if specs and not enabled:
        raise ValueError("--lora-modules needs --enable-lora")
    out: list[tuple[str, str]] = []
    for spec in specs:
        if spec.startswith("{"):
            try:
                entry = json.loads(spec)
                name, path = entry["name"], entry["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules: {spec!r} is not a JSON object with name and path") from None
        else:
            name, sep, path = spec.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules: {spec!r} is not NAME=PATH")
        if not isinstance(name, str) or not name or not isinstance(path, str) or any(n == name for n, _ in out):
            raise ValueError(f"--lora-modules: {spec!r}: the name must be a non-empty string, given once")
        out.append((name, path))
    return tuple(out)


def _fail(message: str) -> int:
    print(f"fleetroute sim: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from router.runtime.logs import configure_logging
    from router.runtime.loop import run_event_loop
    from worker.sim.engine import EngineConfig, EngineCore
    from worker.sim.profiles import load_profiles, profile
    from worker.sim.server import SimSettings, run_sim

    not_modelled: list[str] = []
    ignored: list[str] = []
    args.aliases, args.model_path, args.kv_cache_dtype = (), None, "auto"
    if args.vllm is not None:
        try:
            not_modelled, ignored = apply_vllm_args(args, args.vllm)
        except ValueError as exc:
            return _fail(str(exc))
    if not 0 <= args.port <= 65535:
        return _fail(f"--port must be between 0 and 65535, got {args.port}")
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        if getattr(args, name) < 1:
            return _fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.time_scale > 0:
        return _fail(f"--time-scale must be > 0, got {args.time_scale}")
    try:
        lora_modules = lora_module_specs(args.lora_modules, enabled=args.enable_lora)
    except ValueError as exc:
        return _fail(str(exc))
    if args.max_loras < 1 or not args.lora_load_ms >= 0:
        return _fail(f"--max-loras must be >= 1 and --lora-load-ms >= 0, got {args.max_loras}, {args.lora_load_ms}")
    try:
        custom = load_profiles(args.profiles) if args.profiles else None
        gpu = profile(args.gpu, custom)
    except (ValueError, OSError) as exc:
        return _fail(str(exc))
    if args.kv_cache_dtype.startswith("fp8"):  # one byte per KV element instead of the profile's two
        from dataclasses import replace

        gpu = replace(gpu, kv_pool_tokens=gpu.kv_pool_tokens * 2)
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        batching=args.batching,
        enable_prefix_caching=not args.no_prefix_caching,
        max_loras=args.max_loras if args.enable_lora else 0,
        lora_load_s=args.lora_load_ms / 1000,
    )
    settings = SimSettings(
        model=args.model, profile=gpu, engine=config, host=args.host, port=args.port, seed=args.seed,
        time_scale=args.time_scale, max_model_len=args.max_model_len, fault_injection=args.fault_injection,
        aliases=args.aliases, model_path=args.model_path, kv_events=_kv_events(args), lora_modules=lora_modules,
    )
    configure_logging("info")
    if not_modelled:
        log.info("vLLM arguments accepted but not modelled by the simulator", extra={"arguments": not_modelled})
    if ignored:
        log.warning("vLLM arguments ignored: the simulator does not know them", extra={"arguments": ignored})
    try:
        run_event_loop(run_sim(settings, EngineCore(gpu, config, random.Random(args.seed))))
    except OSError as exc:
        return _fail(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
    return 0
