"""Workloads: what each request of a load test asks for. Seeded, so every policy gets the same requests.

A workload turns arrival times (`loadtest.arrivals`) into `PlannedRequest`s. The kinds:

- `chat`: single-turn chat with lognormal prompt and output lengths (long tails, like ShareGPT), every
  prompt behind the same short system prompt.
- `sessions`: multi-turn chat. Each arrival continues a live session (with probability `continue_p`; only
  sessions whose previous turn is at least `think_time` old) or opens a new one; a session sends
  `x-session-id` and its whole history each turn, so turns share a growing prompt prefix, as real chat
  does. The assistant turns in the history are filler of the planned length, not what the engine
  generated, so an engine's prefix cache matches each turn up to the end of the previous prompt (a real
  conversation would match its previous answer too: affinity is worth a little more than measured here).
- `shared-prefix`: `groups` groups of prompts, each group behind its own long shared context (a RAG
  document, a long system prompt), then a short question (shared/calibration/README.md's "good synthetic
  prefix workload": 64 groups x 16 prompts, 2048-token context, 128-token question, 256-token output).
  Group popularity is Zipf-like with exponent `skew` (0: uniform). The group rides in `x-session-id`, the
  key a consistent-hash policy would use for a tenant's shared context.
- `trace`: a production trace's prompt and output lengths, in order: the Azure 2023 conversation and code
  traces (CSV: arrived_at, num_prefill_tokens, num_decode_tokens) or Mooncake's conversation trace (JSONL:
  timestamp ms, input_length, output_length, hash_ids). Mooncake's `hash_ids` name 512-token blocks, equal
  ids meaning an equal prefix: each id is rendered as its own fixed block of text, so requests that share
  ids share exactly that prompt prefix. `length_scale` shrinks every length (blocks too) to fit a small
  machine or a short context window. With `arrivals: trace` the trace's own timestamps are used
  (`TraceWorkload.timestamps`, rescaled to the target rate).

Any kind can mix priorities: `priorities: {high: 0.2, normal: 0.8}` puts an `x-priority` header on each
request, drawn with those weights.

Prompt lengths are in tokens of the simulator's tokenizer (worker/sim/tokenizer.py): generated text is
words of four lower-case letters, one token each there (a real BPE tokenizer would count them as one or
two). The workload records each request's intended prompt and output tokens, so reports can state them.
"""

from __future__ import annotations

import csv
import json
import math
import random
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from loadtest.client import PlannedRequest

KINDS = ("chat", "sessions", "shared-prefix", "trace")
APIS = ("chat", "completions")
SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly and precisely. " * 8
WORDS = (
    "route gpu token cache batch queue model request latency tail prefix stream engine replica fleet "
    "policy weight score memory kernel decode prefill session window budget drain probe health load"
).split()
MOONCAKE_BLOCK_TOKENS = 512


class Workload(Protocol):
    def requests(self, times: Sequence[float], rng: random.Random) -> list[PlannedRequest]: ...


def lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, int(math.exp(rng.gauss(math.log(median), sigma)))))


# 8,192 distinct four-letter words: one token each for the simulator, 13 bits of entropy each, so two
# generated blocks of a few words already never collide.
_VOCABULARY = tuple(random.Random("fleetroute-words").sample(
    [a + b + c + d for a in string.ascii_lowercase for b in string.ascii_lowercase
     for c in string.ascii_lowercase[:12] for d in string.ascii_lowercase[:12]], 8192))


def token_text(rng: random.Random, tokens: int) -> str:
    """Text of `tokens` tokens for the simulator's tokenizer: four-letter words, one token each."""
    return " ".join(rng.choices(_VOCABULARY, k=tokens))


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _chat_body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": max_tokens}


@dataclass(frozen=True)
class ChatWorkload:
    model: str
    prompt_median: float = 200
    prompt_sigma: float = 0.9
    output_median: float = 120
    output_sigma: float = 0.7
    prompt_max: int = 4000
    output_max: int = 1024

    def requests(self, times: Sequence[float], rng: random.Random) -> list[PlannedRequest]:
        plan = []
        for i, at in enumerate(times):
            prompt = lognormal(rng, self.prompt_median, self.prompt_sigma, 4, self.prompt_max)
            output = lognormal(rng, self.output_median, self.output_sigma, 1, self.output_max)
            messages = [{"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": token_text(rng, prompt)}]
            plan.append(PlannedRequest(at=at, path="/v1/chat/completions",
                                       body=_chat_body(self.model, messages, output),
                                       headers={"x-session-id": f"chat-{i}"}, prompt_tokens=prompt,
                                       output_tokens=output))
        return plan


@dataclass(frozen=True)
class SessionsWorkload:
    model: str
    continue_p: float = 0.5
    user_words_median: float = 120
    output_median: float = 48
    output_max: int = 160
    max_turns: int = 6
    # A user reads the answer before the next turn: a session is continued only this long (simulated
    # seconds) after its previous turn was sent, so one user never has two turns in flight at once.
    think_time: float = 3.0

    def requests(self, times: Sequence[float], rng: random.Random) -> list[PlannedRequest]:
        plan: list[PlannedRequest] = []
        sessions: list[tuple[str, list[dict[str, str]]]] = []
        last_turn: dict[str, float] = {}
        for at in times:
            live = [s for s in sessions
                    if len(s[1]) < 2 * self.max_turns and at - last_turn[s[0]] >= self.think_time]
            if live and rng.random() < self.continue_p:
                session_id, history = rng.choice(live)
            else:
                session_id = f"session-{len(sessions)}"
                history = [{"role": "system", "content": SYSTEM_PROMPT}]
                sessions.append((session_id, history))
            last_turn[session_id] = at
            user_words = lognormal(rng, self.user_words_median, 0.9, 4, 1500)
            history.append({"role": "user", "content": _words(rng, user_words)})
            max_tokens = lognormal(rng, self.output_median, 0.7, 4, self.output_max)
            plan.append(PlannedRequest(at=at, path="/v1/chat/completions",
                                       body=_chat_body(self.model, list(history), max_tokens),
                                       headers={"x-session-id": session_id}, output_tokens=max_tokens))
            # The answer joins the history for the next turn (filler of the planned length).
            history.append({"role": "assistant", "content": _words(rng, max_tokens)})
        return plan


@dataclass(frozen=True)
class SharedPrefixWorkload:
    model: str
    groups: int = 64
    prefix_tokens: int = 2048
    question_tokens: int = 128
    output_tokens: int = 256
    skew: float = 0.0  # Zipf exponent of group popularity; 0 = uniform

    def requests(self, times: Sequence[float], rng: random.Random) -> list[PlannedRequest]:
        # Each group's context is fixed by the group number alone, so it is the same text for every policy
        # and every run of a sweep.
        contexts = [token_text(random.Random(f"group-{g}"), self.prefix_tokens) for g in range(self.groups)]
        weights = [1.0 / (g + 1) ** self.skew for g in range(self.groups)]
        plan = []
        for at in times:
            g = rng.choices(range(self.groups), weights)[0]
            messages = [{"role": "system", "content": contexts[g]},
                        {"role": "user", "content": token_text(rng, self.question_tokens)}]
            plan.append(PlannedRequest(at=at, path="/v1/chat/completions",
                                       body=_chat_body(self.model, messages, self.output_tokens),
                                       headers={"x-session-id": f"group-{g}"},
                                       prompt_tokens=self.prefix_tokens + self.question_tokens,
                                       output_tokens=self.output_tokens))
        return plan


@dataclass(frozen=True)
class TraceRecord:
    at: float  # seconds from the trace's start
    prompt_tokens: int
    output_tokens: int
    blocks: tuple[int, ...] = ()  # Mooncake prefix block ids


def read_trace(path: Path) -> list[TraceRecord]:
    """The records of an Azure/vidur CSV or a Mooncake JSONL trace, in arrival order."""
    records: list[TraceRecord] = []
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    records.append(TraceRecord(row["timestamp"] / 1000.0, int(row["input_length"]),
                                               int(row["output_length"]), tuple(row.get("hash_ids", ()))))
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{n}: not a Mooncake trace record ({exc})") from None
    else:
        with path.open(encoding="utf-8", newline="") as fh:
            reader = csv.DictReader(fh)
            missing = {"num_prefill_tokens", "num_decode_tokens"} - set(reader.fieldnames or ())
            if missing:
                raise ValueError(f"{path}: missing CSV columns {sorted(missing)} (an Azure/vidur trace has "
                                 "arrived_at, num_prefill_tokens, num_decode_tokens)")
            for n, row in enumerate(reader, 2):
                try:
                    at = float(row["arrived_at"]) if row.get("arrived_at") not in (None, "") else float(n)
                    records.append(TraceRecord(at, int(row["num_prefill_tokens"]), int(row["num_decode_tokens"])))
                except ValueError as exc:
                    raise ValueError(f"{path}:{n}: {exc}") from None
    if not records:
        raise ValueError(f"{path}: the trace has no records")
    records.sort(key=lambda r: r.at)
    return records


@dataclass(frozen=True)
class TraceWorkload:
    model: str
    records: tuple[TraceRecord, ...]
    length_scale: float = 1.0
    prompt_max: int = 7000
    output_max: int = 1024
    api: str = "completions"

    @property
    def timestamps(self) -> list[float]:
        return [r.at for r in self.records]

    def requests(self, times: Sequence[float], rng: random.Random) -> list[PlannedRequest]:
        block_tokens = max(1, round(MOONCAKE_BLOCK_TOKENS * self.length_scale))
        blocks: dict[int, str] = {}
        plan = []
        for i, at in enumerate(times):
            record = self.records[i % len(self.records)]  # the trace repeats if the run outlasts it
            prompt_tokens = max(1, min(self.prompt_max, round(record.prompt_tokens * self.length_scale)))
            output = max(1, min(self.output_max, round(record.output_tokens * self.length_scale)))
            parts: list[str] = []
            remaining = prompt_tokens
            for block_id in record.blocks:
                if remaining <= 0:
                    break
                if block_id not in blocks:
                    blocks[block_id] = token_text(random.Random(f"block-{block_id}"), block_tokens)
                text = blocks[block_id]
                if remaining < block_tokens:  # the prompt's last, partial block is its own
                    text = token_text(rng, remaining)
                parts.append(text)
                remaining -= block_tokens
            if remaining > 0:
                parts.append(token_text(rng, remaining))
            prompt = " ".join(parts)
            if self.api == "chat":
                path = "/v1/chat/completions"
                body = _chat_body(self.model, [{"role": "user", "content": prompt}], output)
            else:
                path = "/v1/completions"
                body = {"model": self.model, "prompt": prompt, "max_tokens": output}
            plan.append(PlannedRequest(at=at, path=path, body=body, headers={"x-session-id": f"trace-{i}"},
                                       prompt_tokens=prompt_tokens, output_tokens=output))
        return plan


@dataclass(frozen=True)
class Priorities:
    """Weights of priority classes; each request gets one in an `x-priority` header."""

    weights: Mapping[str, float] = field(default_factory=dict)
    header: str = "x-priority"

    def apply(self, plan: list[PlannedRequest], rng: random.Random) -> list[PlannedRequest]:
        if not self.weights:
            return plan
        names, weights = list(self.weights), list(self.weights.values())
        out = []
        for planned in plan:
            cls = rng.choices(names, weights)[0]
            out.append(planned.with_priority(cls, self.header))
        return out


def chat_sessions(*, model: str, rate: float, duration: float, seed: int = 0, continue_p: float = 0.5,
                  user_words_median: float = 120, output_median: float = 48, output_max: int = 160,
                  max_turns: int = 6) -> list[PlannedRequest]:
    """Multi-turn chat at Poisson arrivals (the demo's and the soak's workload)."""
    from loadtest.arrivals import poisson

    rng = random.Random(seed)
    times = poisson(rate, duration, rng)
    workload = SessionsWorkload(model=model, continue_p=continue_p, user_words_median=user_words_median,
                                output_median=output_median, output_max=output_max, max_turns=max_turns)
    return workload.requests(times, rng)
