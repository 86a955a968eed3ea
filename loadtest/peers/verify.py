"""Check every peer router for real against a small `fleetroute sim` fleet, as the benchmarks will use it.

    python -m loadtest.peers.verify                                  # every installed peer, every policy
    python -m loadtest.peers.verify --peers vllm-router:cache_aware,nginx:least_conn

For each `peer:policy`: start it (`start_peer`, readiness from its own health URL) in front of `--sims`
simulated replicas, then check that

1. streaming `/v1/chat/completions` and `/v1/completions` through it reach a backend and arrive token by
   token: the first content event must come before `--incremental` (60%) of the time to the last one (a
   proxy that buffers the stream delivers them all at the end), with one event per token;
2. a non-streaming chat completion answers 200 with the requested number of tokens;
3. load spreads: `--requests` requests with distinct prompts and session ids, 4 at a time, must reach every
   replica (each replica's `vllm:request_success_total` before and after);
4. affinity, for the policies that promise it (consistent_hash, cache_aware): six requests with one session
   id and one prompt must all reach one replica.

A streamed chat and a streamed completion per replica go first, unmeasured (one-time costs of the first
requests; their times are recorded). A policy that does not promise to spread a light load (LiteLLM's
latency-based-routing) gets its spread recorded as a note instead of a failure.

Prints one row per peer:policy and writes loadtest/results/peers-verify-<UTC time>.json (versions, argv,
readiness time, the measurements). Exits 1 if any check failed. About 1 minute for everything (LiteLLM's
start-up is 12 s per policy); the replicas run at `--time-scale 2` so tokens are 10-20 ms apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.peers import PEERS, PeerSpec, StartedPeer, parse_peer_specs, start_peer, stop_peer, unavailable_reason
from loadtest.processes import ChildFailed, ProcessGroup

ROOT = Path(__file__).resolve().parents[2]
AFFINITY_POLICIES = {"consistent_hash", "cache_aware"}
# Policies that do not promise to spread a light load over identical replicas, and why (the spread is still
# measured and recorded, as a note instead of a failure).
SPREAD_NOT_PROMISED = {
    ("litellm", "latency-based-routing"): "routes to the deployment with the lowest mean recent latency, and a "
    "deployment whose samples are slow (its first, cold request) is not tried again while they last (1 h)",
}
SUCCESS = re.compile(r"^vllm:request_success_total\{[^}]*\}\s+([0-9.e+]+)", re.MULTILINE)


async def served(session: aiohttp.ClientSession, sims: dict[str, str]) -> dict[str, int]:
    out = {}
    for rid, url in sims.items():
        async with session.get(url + "/metrics") as r:
            out[rid] = int(sum(float(v) for v in SUCCESS.findall(await r.text())))
    return out


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {rid: after[rid] - before[rid] for rid in after}


async def stream_once(session: aiohttp.ClientSession, peer: StartedPeer, path: str, body: dict[str, Any],
                      tokens: int) -> dict[str, Any]:
    sent = time.perf_counter()
    arrivals: list[float] = []
    async with session.post(peer.url + path, json={**body, "stream": True, "max_tokens": tokens},
                            headers=peer.headers) as r:
        if r.status != 200:
            return {"ok": False, "error": f"answered {r.status}: {(await r.text())[:300]}"}
        async for line in r.content:
            if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            choice = (event.get("choices") or [{}])[0]
            if (choice.get("delta") or {}).get("content") or choice.get("text"):
                arrivals.append(time.perf_counter() - sent)
    if not arrivals:
        return {"ok": False, "error": "no content events"}
    return {"ok": True, "content_events": len(arrivals), "first_ms": arrivals[0] * 1000,
            "last_ms": arrivals[-1] * 1000, "first_over_last": arrivals[0] / arrivals[-1]}


async def spread(session: aiohttp.ClientSession, peer: StartedPeer, sims: dict[str, str], model: str,
                 count: int) -> dict[str, int]:
    before = await served(session, sims)
    queue = list(range(count))

    async def worker() -> None:
        while queue:
            i = queue.pop()
            body = {"model": model, "max_tokens": 4,
                    "messages": [{"role": "user", "content": f"Question {i}: {'why ' * (i % 7)}is the sky blue?"}]}
            async with session.post(peer.url + "/v1/chat/completions", json=body,
                                    headers={**peer.headers, "x-session-id": f"spread-{i}"}) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"request {i} answered {r.status}")

    await asyncio.gather(*(worker() for _ in range(4)))
    return delta(before, await served(session, sims))


async def affinity(session: aiohttp.ClientSession, peer: StartedPeer, sims: dict[str, str],
                   model: str) -> dict[str, int]:
    before = await served(session, sims)
    body = {"model": model, "max_tokens": 4, "messages": [
        {"role": "system", "content": "You are a patient tutor who explains physics with everyday examples. " * 4},
        {"role": "user", "content": "Why does ice float on water?"}]}
    for _ in range(6):
        async with session.post(peer.url + "/v1/chat/completions", json=body,
                                headers={**peer.headers, "x-session-id": "affinity-session"}) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"affinity request answered {r.status}")
    return delta(before, await served(session, sims))


async def verify_one(group: ProcessGroup, spec: PeerSpec, sims: dict[str, str],
                     args: argparse.Namespace) -> dict[str, Any]:
    record: dict[str, Any] = {"peer": spec.peer, "policy": spec.policy, "checks": {}, "failures": []}
    started = time.perf_counter()
    peer = await start_peer(group, spec.peer, spec.policy, list(sims.items()), args.model, timeout=90)
    record.update(version=peer.version, argv=list(peer.argv), ready_s=round(time.perf_counter() - started, 2))
    fail = record["failures"].append
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            # Warm-up, not measured: first requests pay one-time costs (LiteLLM initialises its token
            # counting on the first stream, about 1 s, holding it). Recorded, since users see it too.
            warm = []
            for _ in sims:
                for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Warm up."}]}),
                                   ("/v1/completions", {"prompt": "Warm up."})):
                    w = await stream_once(session, peer, path, {"model": args.model, **body}, 2)
                    warm.append(round(w.get("last_ms", 0.0)))
            record["checks"]["warmup_stream_ms"] = warm
            for name, path, body in (
                ("stream_chat", "/v1/chat/completions",
                 {"model": args.model, "messages": [{"role": "user", "content": "Count slowly."}]}),
                ("stream_completions", "/v1/completions", {"model": args.model, "prompt": "Once upon a time"}),
            ):
                r = await stream_once(session, peer, path, body, args.tokens)
                record["checks"][name] = r
                if not r["ok"]:
                    fail(f"{name}: {r['error']}")
                elif r["content_events"] != args.tokens:
                    fail(f"{name}: {r['content_events']} content events for {args.tokens} tokens")
                elif r["first_over_last"] > args.incremental:
                    fail(f"{name}: buffered? first token at {r['first_ms']:.0f} ms, last at {r['last_ms']:.0f} ms")
            body = {"model": args.model, "max_tokens": 5, "messages": [{"role": "user", "content": "Hello"}]}
            async with session.post(peer.url + "/v1/chat/completions", json=body, headers=peer.headers) as r:
                reply = await r.json(content_type=None)
                tokens = (reply.get("usage") or {}).get("completion_tokens") if isinstance(reply, dict) else None
                record["checks"]["chat"] = {"status": r.status, "completion_tokens": tokens}
                if r.status != 200 or tokens != 5:
                    fail(f"chat: answered {r.status} with {tokens} tokens: {str(reply)[:200]}")
            dist = await spread(session, peer, sims, args.model, args.requests)
            record["checks"]["spread"] = dist
            if sum(dist.values()) != args.requests:
                fail(f"spread: {dist} for {args.requests} requests")
            elif min(dist.values()) == 0:
                if note := SPREAD_NOT_PROMISED.get((spec.peer, spec.policy)):
                    record["notes"] = [f"spread {dist}: {note}"]
                else:
                    fail(f"spread: {dist} for {args.requests} requests")
            if spec.policy in AFFINITY_POLICIES:
                aff = await affinity(session, peer, sims, args.model)
                record["checks"]["affinity"] = aff
                if sorted(aff.values())[-1] != 6:
                    fail(f"affinity: one session and prompt went to {aff}")
    finally:
        await stop_peer(group, peer)
    return record


def row(r: dict[str, Any]) -> str:
    c = r.get("checks", {})

    def ratio(name: str) -> str:
        x = c.get(name, {})
        return f"{x['first_ms']:.0f}/{x['last_ms']:.0f}ms" if x.get("ok") else "-"

    dist = "/".join(str(v) for v in c.get("spread", {}).values()) or "-"
    aff = "/".join(str(v) for v in c.get("affinity", {}).values()) or "n/a"
    status = "ok" if not r["failures"] else "FAIL: " + "; ".join(r["failures"])
    if r.get("notes") and not r["failures"]:
        status = "ok (note: " + "; ".join(r["notes"]) + ")"
    return (f"{r['peer'] + ':' + r['policy']:<36} {r.get('version', '-'):<9} {r.get('ready_s', 0):>6.1f}s "
            f"{ratio('stream_chat'):>12} {ratio('stream_completions'):>12} {dist:>9} {aff:>7}  {status}")


async def run(args: argparse.Namespace) -> int:
    if args.peers == "all":
        specs = [PeerSpec(p, pol) for p, info in PEERS.items() for pol in info.policies]
    else:
        specs = list(parse_peer_specs(args.peers))
    group = ProcessGroup()
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    try:
        sims: dict[str, str] = {}
        for i in range(args.sims):
            child = await group.start(f"sim-{i}", ["sim", "--port", "0", "--gpu", args.gpu, "--model", args.model,
                                                   "--seed", str(i), "--time-scale", str(args.time_scale)],
                                      "sim listening")
            sims[f"{args.gpu}-{i}"] = child.ready["url"]
        print(f"{len(sims)} simulated {args.gpu} replicas: {', '.join(sims.values())}", flush=True)
        print(f"{'peer:policy':<36} {'version':<9} {'ready':>7} {'chat 1st/last':>12} {'cmpl 1st/last':>12} "
              f"{'spread':>9} {'affin.':>7}  result", flush=True)
        for spec in specs:
            if reason := unavailable_reason(spec.peer):
                skipped[str(spec)] = reason
                continue
            try:
                record = await verify_one(group, spec, sims, args)
            except (ChildFailed, RuntimeError, aiohttp.ClientError, TimeoutError) as exc:
                record = {"peer": spec.peer, "policy": spec.policy, "failures": [f"{type(exc).__name__}: {exc}"]}
            results.append(record)
            print(row(record), flush=True)
    finally:
        await group.stop_all()
    for spec_text, reason in skipped.items():
        print(f"skipped {spec_text}: {reason}")
    out = args.out / f"peers-verify-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()}, "results": results,
                               "skipped": skipped}, indent=2) + "\n")
    print(f"wrote {out}")
    return 1 if any(r["failures"] for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default="all", help="peer:policy list, or all (default)")
    parser.add_argument("--sims", type=int, default=2, help="simulated replicas (default 2)")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--time-scale", type=float, default=2.0)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per streamed completion (default 16)")
    parser.add_argument("--requests", type=int, default=24, help="requests in the spread check (default 24)")
    parser.add_argument("--incremental", type=float, default=0.6,
                        help="first content event must arrive before this share of the last one's time")
    parser.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results")
    args = parser.parse_args(argv)
    if args.sims < 2:
        parser.error("--sims must be at least 2 (spread and power_of_two need two backends)")
    try:
        return asyncio.run(run(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
