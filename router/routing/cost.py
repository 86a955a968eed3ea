"""Request cost: a fast prompt-token estimate plus an output length learned online, as load in tokens.

Why. Requests differ hugely in cost: a 20-token question and a 30k-token document are one request each to
a request counter. A policy that knows each request's expected cost can balance the *work* in flight
(`loadUnit: tokens`, router/routing/policies/) and admission can serve short requests first
(router/traffic/admission.py).

**The cost of one request**, in decode-token equivalents:

    cost = prefillWeight * prompt_tokens + output_tokens

Decode tokens dominate an engine's load: each occupies a batch slot for a whole engine step, and a request
keeps its slot and its KV cache until its last token. Prompt tokens are processed many at a time in a few
large, compute-bound steps. `prefillWeight` is the price of a prompt token in decode tokens: the engine's
time per prefill token divided by its time per decode token at a typical batch size, i.e. about
`rate(vllm:generation_tokens_total) / rate(vllm:prompt_tokens_total)` when each is what saturates the
engine. The simulator's calibrated profiles (worker/sim/profiles.py, 8B model, chunks of 8192 prompt
tokens vs decode batches of 64-256 at 1k-4k context) give 0.07-0.25 on an H100 and L4 and 0.13-0.41 on an
A100; the default 0.2 sits in that range. Set it from your own engines' metrics when it matters.

**Prompt tokens.** No tokenizer runs here. The estimate is `chars / charsPerToken` over the text the chat
template renders (messages' text content, a completion's prompt), plus 4 tokens per chat message for the
template's role markers, plus 576 per non-text content part (an image: LLaVA-1.5's patch count; models
differ), while token-id prompts count exactly. Only lengths are summed (`len` of each piece, O(1) each): no
string is built and no text is scanned, so the estimate costs microseconds whatever the prompt's size.
`charsPerToken` (default 4, English prose) is then calibrated per model from the engine's own counts
(`usage.prompt_tokens`, when a response carries it): the ratio of an EWMA of the text's characters to an
EWMA of its tokens, clamped to [1, 8], so code, CJK text or another tokenizer correct it within a few dozen
requests. `tools` definitions are not counted.

**Output tokens.** Predicted per choice, then multiplied by `n` (and by the number of prompts of a batched
completion), and never above the request's `max_completion_tokens` / `max_tokens`. The predictor is a
hierarchy of running means, each shrunk towards its parent while it has few observations:

    est_0 = priorOutputTokens                                    (no observation yet)
    est_1 = the model's mean for the endpoint path               (chat or completions)
    est_2 = ... for (path, max_tokens bucket)                    (bucket = bit length: 1, 2-3, 4-7, ...)
    est_3 = ... for (path, max_tokens bucket, prompt bucket)     (the prompt estimate's bit length)
    est_4 = the session's mean                                   (`sessionKey`, else `fallbackKey`)
    est_l = (m_l * mean_l + K_l * est_{l-1}) / (m_l + K_l),   m_l = min(observations, window),
    K_l = 2 for the bucket levels, 0.5 for the session (its own first observation already outweighs the shape)

A level nobody has seen is skipped. Each mean is a plain average for its first `window` observations and an
EWMA with weight 1/window after that, so it converges fast and then follows drift. Means, not medians:
load adds up, and the expected work in flight is the sum of the expected costs (a median would
under-count skewed length distributions). Sessions matter because one client's answers resemble each
other (a summariser's are long, a classifier's short) far more than requests of the same shape do.

Learning: a completed response (status 200, body ended normally) teaches its actual output token count
(router/routing/output_tokens.py: `usage.completion_tokens` when present, else the stream's token events, or,
when vLLM merged steps into fewer events than tokens, the stream's text bytes over the model's bytes per
output token, learned from streams that carry usage; `observed_output`). Requests
cut short (client gone, timeouts, errors) teach nothing: their counts are lower bounds that would bias the
means down. Embeddings produce no output tokens and cost their prompt only.

**Memory** is bounded per served model: at most about 1,400 bucket means (2 paths x 26 x 26 buckets, plus
the coarser levels), and an LRU of at most `maxSessions` session means keyed by the hash of the session key
(about 210 bytes each, whatever the key's length; a hash collision only merges two sessions' statistics).

Everything here is pure (no I/O, no clock, no metrics); the handler calls `CostModel.estimate` before
routing and `CostModel.learn` after the response, and reports the errors (router/server/handlers.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.model import RequestCost, RequestInfo
from router.routing.output_tokens import OutputCount
from router.routing.policies.consistent_hash import HashKey

MESSAGE_TOKENS = 4  # chat template tokens per message (role header and end marker; Llama 3 uses 5, Qwen 4)
PART_TOKENS = 576  # a non-text content part (an image)
SHRINK = 2.0  # K: the observations a level needs before its own mean outweighs its parent's estimate
# A session's own mean outweighs the request-shape estimate from its first observation on: clients differ
# far more from each other than one client's requests do. On tests/test_cost.py's synthetic stream (clients
# 30x apart, ~5 observations each) K = 0.5 is 13% above an oracle knowing each client's mean, K = 2 34%;
# K = 0.25 gains 3% more there but gives one noisy observation of a new client even more weight.
SESSION_SHRINK = 0.5
MAX_CHOICES = 128
MAX_BUCKET = 25  # bit lengths above this (33M tokens) share one bucket
CALIBRATION_WINDOW = 64
MIN_CALIBRATION_CHARS = 64  # shorter prompts are dominated by template tokens: they teach nothing
CHARS_PER_TOKEN_RANGE = (1.0, 8.0)
# Output text, as stream bytes (JSON-escaped UTF-8) per token: English before calibration, then learned from
# streams that also carry usage. A stream whose text holds more tokens than it has events had some of its
# steps merged by vLLM, and the text is the better count: by any margin above rounding once the model's
# bytes per token are calibrated (measured on real vLLM: 36 events for 40 tokens), by 2x before (8 bytes
# per token is rare for real text, and an uncalibrated guess must not turn long tokens into merges).
OUTPUT_BYTES_PER_TOKEN = 4.0
OUTPUT_BYTES_PER_TOKEN_RANGE = (1.0, 16.0)
MERGED_STEPS = {True: 1.05, False: 2.0}  # by whether the bytes per token are calibrated
PATH_KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}


@dataclass(frozen=True)
class CostSettings:
    """A policy's `cost:` block (parsed by settings.py; docs/configuration.md). A policy without one estimates
    nothing, unless its strategy or its admission order needs estimates, which turns the defaults on."""

    prefill_weight: float = 0.2
    chars_per_token: float = 4.0  # the starting point; calibrated per model from the engines' usage
    prior_output_tokens: float = 256.0
    session_key: HashKey | None = HashKey("header", "x-session-id")
    fallback_key: HashKey | None = HashKey("body", "user")
    max_sessions: int = 10_000  # per served model; 0: no per-session learning
    window: int = 32

    def session(self, req: RequestInfo) -> str | None:
        for key in (self.session_key, self.fallback_key):
            if key is not None:
                value = key.extract(req)
                if value is not None:
                    return value
        return None


class _Mean:
    """A running mean: exact for the first `window` values, then an EWMA with weight 1/window."""

    __slots__ = ("n", "mean")

    def __init__(self) -> None:
        self.n = 0
        self.mean = 0.0

    def add(self, value: float, window: int) -> None:
        n = self.n + 1 if self.n < window else window
        self.n = n
        self.mean += (value - self.mean) / n


def _shrink(estimate: float, level: _Mean | None, k: float) -> float:
    if level is None:
        return estimate
    return (level.n * level.mean + k * estimate) / (level.n + k)


def _bucket(tokens: float) -> int:
    return min(int(tokens).bit_length(), MAX_BUCKET)


class OutputPredictor:
    """The learned state of one served model: bucket means, session means (LRU), chars-per-token."""

    def __init__(self) -> None:
        self.levels: dict[tuple[Any, ...], _Mean] = {}
        self.sessions: OrderedDict[int, _Mean] = OrderedDict()
        self._chars = _Mean()  # text characters of calibration prompts
        self._tokens = _Mean()  # and their tokens, by the engine's count
        self.chars_per_token: float | None = None  # None: not calibrated yet, use the configured one
        self._out_bytes = _Mean()  # stream text bytes of answers with usage
        self._out_tokens = _Mean()  # and their output tokens
        self.output_bytes_per_token: float | None = None

    def predict(self, kind: str, cap_bucket: int, prompt_bucket: int, session: int | None, prior: float) -> float:
        levels = self.levels
        estimate = _shrink(prior, levels.get((kind,)), SHRINK)
        estimate = _shrink(estimate, levels.get((kind, cap_bucket)), SHRINK)
        estimate = _shrink(estimate, levels.get((kind, cap_bucket, prompt_bucket)), SHRINK)
        if session is not None:
            estimate = _shrink(estimate, self.sessions.get(session), SESSION_SHRINK)
        return estimate

    def learn(self, kind: str, cap_bucket: int, prompt_bucket: int, session: int | None, per_choice: float,
              settings: CostSettings) -> None:
        window = settings.window
        levels = self.levels
        for key in ((kind,), (kind, cap_bucket), (kind, cap_bucket, prompt_bucket)):
            level = levels.get(key)
            if level is None:
                level = levels[key] = _Mean()
            level.add(per_choice, window)
        if session is None or settings.max_sessions <= 0:
            return
        sessions = self.sessions
        mean = sessions.get(session)
        if mean is None:
            mean = sessions[session] = _Mean()
            while len(sessions) > settings.max_sessions:
                sessions.popitem(last=False)  # the least recently taught session
        else:
            sessions.move_to_end(session)
        mean.add(per_choice, window)

    def calibrate(self, chars: int, tokens: int) -> None:
        """One prompt's text characters and the engine's token count for that text."""
        self._chars.add(chars, CALIBRATION_WINDOW)
        self._tokens.add(tokens, CALIBRATION_WINDOW)
        low, high = CHARS_PER_TOKEN_RANGE
        self.chars_per_token = min(high, max(low, self._chars.mean / self._tokens.mean))

    def calibrate_output(self, text_bytes: int, tokens: int) -> None:
        """One streamed answer's text bytes and the engine's output token count for it."""
        self._out_bytes.add(text_bytes, CALIBRATION_WINDOW)
        self._out_tokens.add(tokens, CALIBRATION_WINDOW)
        low, high = OUTPUT_BYTES_PER_TOKEN_RANGE
        self.output_bytes_per_token = min(high, max(low, self._out_bytes.mean / self._out_tokens.mean))


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs microseconds, and this is per request
class CostEstimate:
    """A request's cost, plus what learning from its outcome needs (treat as read-only)."""

    cost: RequestCost
    model: str
    kind: str
    cap_bucket: int
    prompt_bucket: int
    session: int | None
    choices: int  # output sequences: n, times the prompts of a batched completion
    prompt_chars: int  # text characters (calibration)
    fixed_prompt_tokens: int  # tokens counted without the ratio: token ids, images, template markers
    calibrates: bool  # the prompt is text only and long enough to calibrate chars-per-token

    @property
    def learns(self) -> bool:
        return self.kind != "embeddings"


class CostModel:
    """The output predictors of one router process, one per served model (the handler's only entry)."""

    def __init__(self) -> None:
        self._predictors: dict[str, OutputPredictor] = {}

    def predictor(self, model: str) -> OutputPredictor:
        found = self._predictors.get(model)
        if found is None:
            found = self._predictors[model] = OutputPredictor()
        return found

    def sessions(self, model: str) -> int:
        found = self._predictors.get(model)
        return len(found.sessions) if found is not None else 0

    def estimate(self, req: RequestInfo, path: str, settings: CostSettings) -> CostEstimate:
        body = req.body
        kind = PATH_KINDS.get(path, "chat")
        predictor = self.predictor(req.model)
        chars, fixed, prompts, text_only = prompt_size(body, kind)
        cpt = predictor.chars_per_token or settings.chars_per_token
        prompt_tokens = fixed + int(chars / cpt + 0.5)
        prompt_bucket = _bucket(prompt_tokens)
        calibrates = text_only and chars >= MIN_CALIBRATION_CHARS
        if kind == "embeddings":
            cost = RequestCost(prompt_tokens, 0.0, settings.prefill_weight * prompt_tokens)
            return CostEstimate(cost, req.model, kind, 0, prompt_bucket, None, prompts, chars, fixed, calibrates)
        cap = max_output_tokens(body)
        cap_bucket = _bucket(cap) if cap is not None else 0
        session_key = settings.session(req) if settings.max_sessions > 0 else None
        session = hash(session_key) if session_key is not None else None
        per_choice = predictor.predict(kind, cap_bucket, prompt_bucket, session, settings.prior_output_tokens)
        if cap is not None and per_choice > cap:
            per_choice = float(cap)
        choices = prompts * _choices(body)
        output = per_choice * choices
        cost = RequestCost(prompt_tokens, output, settings.prefill_weight * prompt_tokens + output)
        return CostEstimate(cost, req.model, kind, cap_bucket, prompt_bucket, session, choices, chars, fixed,
                            calibrates)

    def observed_output(self, model: str, count: OutputCount) -> tuple[int | None, str]:
        """The output tokens of a complete answer, and how they were known: `usage` (the engine said),
        `stream` (token events) or `stream_text` (vLLM merged steps, so the events undercount: the text's
        bytes over the model's learned bytes per token), or (None, `unknown`)."""
        tokens = count.output_tokens
        if tokens is None:
            return None, "unknown"
        predictor = self.predictor(model)
        if count.source == "usage":
            if count.text_bytes and tokens > 0:
                predictor.calibrate_output(count.text_bytes, tokens)
            return tokens, "usage"
        if count.text_bytes:
            calibrated = predictor.output_bytes_per_token is not None
            by_text = count.text_bytes / (predictor.output_bytes_per_token or OUTPUT_BYTES_PER_TOKEN)
            if by_text > MERGED_STEPS[calibrated] * max(tokens, 1):
                return round(by_text), "stream_text"
        return tokens, count.source

    def learn(self, estimate: CostEstimate, output_tokens: int, usage_prompt_tokens: int | None,
              settings: CostSettings) -> None:
        """Teach a completed request's actual counts (`usage_prompt_tokens`: the engine's, when it said)."""
        predictor = self.predictor(estimate.model)
        if estimate.learns:
            predictor.learn(estimate.kind, estimate.cap_bucket, estimate.prompt_bucket, estimate.session,
                            output_tokens / estimate.choices, settings)
        if usage_prompt_tokens is not None and estimate.calibrates:
            text_tokens = usage_prompt_tokens - estimate.fixed_prompt_tokens
            if text_tokens > 0:
                predictor.calibrate(estimate.prompt_chars, text_tokens)


def max_output_tokens(body: Mapping[str, Any]) -> int | None:
    """The request's cap on output tokens per choice (`max_completion_tokens`, else `max_tokens`)."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _choices(body: Mapping[str, Any]) -> int:
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        return min(n, MAX_CHOICES)
    return 1


def prompt_size(body: Mapping[str, Any], kind: str) -> tuple[int, int, int, bool]:
    """(text characters, tokens counted exactly, prompts, text only) of a request's prompt.

    Walks the same structure as router/routing/prefix/prompt.py renders, but sums lengths instead of building text.
    Token-id lists are measured by `len` after looking at their first element only.
    """
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return 0, 0, 1, True
        chars = 0
        fixed = 0
        text_only = True
        for msg in messages:
            if not isinstance(msg, Mapping):
                continue
            fixed += MESSAGE_TOKENS
            content = msg.get("content")
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                for part in content:
                    text = part.get("text") if isinstance(part, Mapping) else None
                    if isinstance(text, str):
                        chars += len(text)
                    else:
                        fixed += PART_TOKENS
                        text_only = False
        return chars, fixed, 1, text_only
    prompt = body.get("input" if kind == "embeddings" else "prompt")
    if isinstance(prompt, str):
        return len(prompt), 0, 1, True
    if not isinstance(prompt, list) or not prompt:
        return 0, 0, 1, True
    first = prompt[0]
    if isinstance(first, int):  # one prompt of token ids
        return 0, len(prompt), 1, False
    chars = 0
    fixed = 0
    for item in prompt:  # a batch: strings or token-id lists
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, list):
            fixed += len(item)
    return chars, fixed, len(prompt), fixed == 0


def relative_error(predicted: float, actual: int) -> float:
    """|predicted - actual| / actual, with an actual of 0 counted as 1 (an empty answer predicted as 5
    tokens is off by 5x, not infinitely)."""
    return abs(predicted - actual) / max(actual, 1)
