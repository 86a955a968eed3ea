"""Synthetic workloads, seeded: a plan of timed requests for `client.run_open_loop`.

`chat_sessions`: multi-turn chat. Arrivals are a Poisson process; each arrival continues a live session
(with probability `continue_p`) or opens a new one. A session sends `x-session-id` and its whole history
each turn, so turns of a session share a growing prompt prefix, as real chat does; every session starts
with the same system prompt. Message and answer lengths are lognormal (long tails, like ShareGPT).
"""

from __future__ import annotations

import math
import random

from loadtest.client import PlannedRequest

WORDS = (
    "route gpu token cache batch queue model request latency tail prefix stream engine replica fleet "
    "policy weight score memory kernel decode prefill session window budget drain probe health load"
).split()
SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly and precisely. " * 8


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, int(math.exp(rng.gauss(math.log(median), sigma)))))


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def chat_sessions(
    *,
    model: str,
    rate: float,
    duration: float,
    seed: int = 0,
    continue_p: float = 0.5,
    user_words_median: float = 120,
    output_median: float = 48,
    output_max: int = 160,
    max_turns: int = 6,
) -> list[PlannedRequest]:
    rng = random.Random(seed)
    plan: list[PlannedRequest] = []
    sessions: list[tuple[str, list[dict[str, str]]]] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return plan
        live = [s for s in sessions if len(s[1]) < 2 * max_turns]
        if live and rng.random() < continue_p:
            session_id, history = rng.choice(live)
        else:
            session_id, history = f"session-{seed}-{len(sessions)}", [{"role": "system", "content": SYSTEM_PROMPT}]
            sessions.append((session_id, history))
        history.append({"role": "user", "content": _text(rng, _lognormal(rng, user_words_median, 0.9, 4, 1500))})
        max_tokens = _lognormal(rng, output_median, 0.7, 4, output_max)
        plan.append(PlannedRequest(
            at=t,
            path="/v1/chat/completions",
            body={"model": model, "messages": list(history), "max_tokens": max_tokens},
            headers={"x-session-id": session_id},
        ))
        # The answer joins the history for the next turn (filler of the planned length).
        history.append({"role": "assistant", "content": _text(rng, max_tokens)})
