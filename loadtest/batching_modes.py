"""Batching-mode benchmark: one workload through continuous, dynamic and static batching, in virtual time.

    python -m loadtest.batching_modes                 # H100, 3000 requests per rate, ~12 s
    python -m loadtest.batching_modes --gpu a10g --requests 500 --rates 1,4,16

The workload is ShareGPT-like chat (vLLM's benchmark sampler: ~230 prompt / ~200 output tokens on
average): lognormal prompt and output lengths (sigma 0.8, long tails, clipped) and Poisson arrivals at
each offered rate, from light load to well past every mode's capacity. Prompts share no prefix, so prefix
caching plays no part. Every mode sees the identical request list and the same engine seed; the only
difference is `EngineConfig.batching` (defaults otherwise: max_num_seqs 256, max_num_batched_tokens 8192,
static batches of 32 with a 50 ms window, dynamic batches up to 256).

Everything runs in the simulator's virtual time (worker.sim.virtual), so the numbers are exactly
repeatable for a seed and owe nothing to this machine's speed. Throughput is counted while requests are
still arriving (output tokens emitted and requests completed between the first and the last arrival, per
second of simulated time): the drain afterwards, when the last long answers decode in ever smaller
batches, would otherwise dilute every mode's number with a tail that says nothing about its capacity. A
mode that keeps up shows about the offered load; one that does not shows its capacity. TTFT is first token
minus arrival (so it includes queueing); ITL pools every inter-token gap of every request.
docs/benchmarks.md has the committed run's table (docs/results/batching-modes.json).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from dataclasses import asdict, dataclass

from worker.sim.engine import BATCHING_MODES, EngineConfig, EngineCore, SimRequest
from worker.sim.profiles import profile
from worker.sim.virtual import run_virtual

PROMPT_MEAN, OUTPUT_MEAN, SIGMA = 230, 200, 0.8


@dataclass(frozen=True)
class Shape:
    arrival: float
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Result:
    gpu: str
    mode: str
    rate: str
    requests: int
    window_s: float
    drain_s: float  # from the last arrival to the last completion
    output_tok_s: float
    req_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_ms: float
    preemptions: int


def lognormal_len(rng: random.Random, mean: float, high: int) -> int:
    # mean = median * exp(sigma^2 / 2) for a lognormal
    return max(1, min(high, round(rng.lognormvariate(math.log(mean) - SIGMA**2 / 2, SIGMA))))


def workload(n: int, rate: float, seed: int) -> list[Shape]:
    """`n` chat-like requests, Poisson at `rate` per second."""
    rng = random.Random(seed)
    t, shapes = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        shapes.append(Shape(t, lognormal_len(rng, PROMPT_MEAN, 4096), lognormal_len(rng, OUTPUT_MEAN, 2048)))
    return shapes


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def run_mode(gpu: str, mode: str, rate_label: str, shapes: list[Shape], seed: int) -> Result:
    engine = EngineCore(profile(gpu), EngineConfig(batching=mode), random.Random(seed))
    # Distinct token ids per request: no accidental prefix-cache hits.
    reqs = [
        SimRequest(f"r{i}", list(range(i * 10_000, i * 10_000 + s.prompt_len)), s.output_len, s.arrival)
        for i, s in enumerate(shapes)
    ]
    run_virtual(engine, reqs)
    start, end = reqs[0].arrival, reqs[-1].arrival  # run_virtual returns them in arrival order
    window = end - start
    tokens = sum(1 for r in reqs for t in r.token_times if t <= end)
    completed = sum(1 for r in reqs if r.finished_at is not None and r.finished_at <= end)
    ttfts = [(r.first_token_at or 0.0) - r.arrival for r in reqs]
    gaps = [b - a for r in reqs for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    return Result(
        gpu=gpu,
        mode=mode,
        rate=rate_label,
        requests=len(reqs),
        window_s=window,
        drain_s=max(r.finished_at or 0.0 for r in reqs) - end,
        output_tok_s=tokens / window,
        req_s=completed / window,
        ttft_p50_s=percentile(ttfts, 0.50),
        ttft_p99_s=percentile(ttfts, 0.99),
        itl_p50_ms=percentile(gaps, 0.50) * 1000,
        preemptions=engine.num_preemptions,
    )


def markdown(results: list[Result]) -> str:
    lines = [
        "| offered rate | mode | output tok/s | req/s | TTFT p50 | TTFT p99 | ITL p50 "
        "| continuous ÷ this mode (tok/s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by_rate: dict[str, dict[str, Result]] = {}
    for r in results:
        by_rate.setdefault(r.rate, {})[r.mode] = r
    for rate, modes in by_rate.items():
        cont = modes.get("continuous")
        for mode, r in modes.items():
            ratio = "" if cont is None or mode == "continuous" else f"{cont.output_tok_s / r.output_tok_s:.2f}x"
            lines.append(
                f"| {rate} | {mode} | {r.output_tok_s:,.0f} | {r.req_s:.1f} | {seconds(r.ttft_p50_s)} | "
                f"{seconds(r.ttft_p99_s)} | {r.itl_p50_ms:.1f} ms | {ratio} |"
            )
    return "\n".join(lines)


def render_record(record: dict) -> str:
    """A `--json` run as docs/benchmarks.md shows it: the settings and means it ran with, then the table."""
    s = record["settings"]
    return (f"{s['gpu'].upper()} profile, {s['requests']:,} requests per offered rate, seed {s['seed']} "
            f"(this run's means: {s['mean_prompt']:.0f} prompt and {s['mean_output']:.0f} output tokens); "
            f"commit {record['machine']['commit']}.\n\n" + markdown([Result(**r) for r in record["results"]]) + "\n")


def seconds(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.1f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.batching_modes", description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", default="h100", help="GPU profile (default h100)")
    parser.add_argument("--requests", type=int, default=3000, help="requests per offered rate (default 3000)")
    parser.add_argument("--rates", default="2,8,24,48,96", help="offered req/s, comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH",
                        help="also write the run (settings, machine, results) as JSON: what loadtest.publish renders")
    args = parser.parse_args(argv)

    from loadtest.router_overhead import machine

    results: list[Result] = []
    settings: dict = {"gpu": args.gpu, "requests": args.requests, "rates": args.rates, "seed": args.seed}
    for label in args.rates.split(","):
        rate = float(label)
        shapes = workload(args.requests, rate, args.seed)
        if not results:
            settings["mean_prompt"] = statistics.mean(s.prompt_len for s in shapes)
            settings["mean_output"] = statistics.mean(s.output_len for s in shapes)
            print(f"# {args.gpu}, {args.requests} requests per rate, seed {args.seed}: "
                  f"mean prompt {settings['mean_prompt']:.0f}, mean output {settings['mean_output']:.0f} tokens",
                  file=sys.stderr)
        for mode in BATCHING_MODES:
            results.append(run_mode(args.gpu, mode, f"{label} req/s", shapes, args.seed))
            print(f"# {results[-1].rate} {mode}: done", file=sys.stderr)
    record = {"settings": settings, "machine": machine(), "results": [asdict(r) for r in results]}
    print(render_record(record))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(record, fh, indent=1)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
