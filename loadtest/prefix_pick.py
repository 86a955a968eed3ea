"""Micro-benchmark of one prefix-aware pick (hashing, matching, guards, recording), in-process, no I/O.

    python -m loadtest.prefix_pick [--endpoints 8] [--picks 20000] [--sharing]

A pool of `--endpoints` endpoints; requests are multi-turn chats over 64 system prompts (1 KiB each) with a
growing history (up to ~6 KiB), so most picks hash 4-24 blocks and find a long match. Prints microseconds
per pick (best of 5 runs). `--sharing` also queues recorded blocks for the Redis exchange, as a router with
Redis does (and empties the queue every 1000 picks, as the background flush would). Short by design (a few
seconds): the lead's measured runs are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import random
import timeit
from collections import Counter
from typing import Any

from router.model import Endpoint, EndpointView, RequestInfo
from router.routing.policies.prefix_aware import PrefixAwarePolicy


class _Loads:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def in_flight(self, endpoint_id: str) -> int:
        return self.counts[endpoint_id]

    def cluster_in_flight(self, endpoint_id: str) -> int:
        return self.counts[endpoint_id]


def _text(rng: random.Random, chars: int) -> str:
    words = "route gpu token cache batch queue model request latency prefix stream engine".split()
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(words)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]


def requests(n: int, seed: int = 1) -> list[RequestInfo]:
    rng = random.Random(seed)
    systems = [_text(rng, 1024) for _ in range(64)]
    turns = [_text(rng, 300) for _ in range(64)]
    out = []
    for i in range(n):
        history: list[dict[str, Any]] = [{"role": "system", "content": rng.choice(systems)}]
        for t in range(rng.randrange(1, 16)):
            history.append({"role": ("user", "assistant")[t % 2], "content": turns[(i + t) % 64]})
        out.append(RequestInfo(model="m", request_id=str(i), headers={}, body={"model": "m", "messages": history}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoints", type=int, default=8)
    parser.add_argument("--picks", type=int, default=20000)
    parser.add_argument("--sharing", action="store_true")
    args = parser.parse_args()
    policy = PrefixAwarePolicy()
    views = tuple(EndpointView(Endpoint(f"e{i}", f"http://e{i}", ("m",))) for i in range(args.endpoints))
    state = policy.new_state()
    if args.sharing:
        state.start_sharing()
    picker = policy.build(views, policy.parse({}), state, random.Random(1), lambda _e: None)
    loads = _Loads()
    reqs = requests(args.picks)

    def run() -> None:
        for i, req in enumerate(reqs):
            picker.pick(req, loads, frozenset())
            if args.sharing and i % 1000 == 999:  # what the background flush does every 250 ms
                state.sent(state.pending(1 << 30))

    run()  # warm the index: the timed runs are the steady state
    best = min(timeit.repeat(run, number=1, repeat=5))
    print(f"{best / args.picks * 1e6:.1f} us per pick ({args.endpoints} endpoints, {args.picks} picks, "
          f"sharing={'on' if args.sharing else 'off'})")


if __name__ == "__main__":
    main()
