"""Request-cost prediction (router/routing/cost.py, router/routing/output_tokens.py): the prompt estimate, the online
output-length predictor (convergence on a seeded synthetic stream, bounded memory, the max_tokens cap), the
output-token count read off real answers, the configuration, and the whole loop through a real router and
fake engines, with the prediction error in /metrics and in the access log.
"""

from __future__ import annotations

import asyncio
import io
import math
import random
import re
from typing import Any

import orjson
import pytest

from router.config.settings import ConfigError, parse_settings
from router.model import RequestInfo
from router.routing.cost import PART_TOKENS, CostModel, CostSettings, max_output_tokens, prompt_size
from router.routing.output_tokens import OutputCounter
from router.server.access_log import AccessLog
from tests.conftest import MODEL

CHAT_PATH = "/v1/chat/completions"


def info(body: dict[str, Any], session: str | None = None) -> RequestInfo:
    headers = {"x-session-id": session} if session is not None else {}
    return RequestInfo(model=MODEL, request_id="r", headers=headers, body={"model": MODEL, **body})


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], **extra}


# ---- the prompt estimate -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, body, expected",
    [
        pytest.param("chat", chat("a" * 400), (400, 4, 1, True), id="chat text is characters plus 4 tokens per message"),
        pytest.param("chat", {"messages": [{"role": "system", "content": "ab"}, {"role": "user", "content": "cde"}]},
                     (5, 8, 1, True), id="every message's text counts"),
        pytest.param("chat", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": "data:" + "A" * 10**6}}]}]},
                     (8, 4 + PART_TOKENS, 1, False), id="an image part costs a fixed count, not its base64 length"),
        pytest.param("chat", {"messages": "hi"}, (0, 0, 1, True), id="malformed messages count nothing"),
        pytest.param("completions", {"prompt": "x" * 37}, (37, 0, 1, True), id="a completion prompt is its characters"),
        pytest.param("completions", {"prompt": list(range(30_000))}, (0, 30_000, 1, False),
                     id="token-id prompts count exactly"),
        pytest.param("completions", {"prompt": ["abc", "de"]}, (5, 0, 2, True), id="a batch of prompts is that many outputs"),
        pytest.param("completions", {"prompt": [[1, 2, 3], [4]]}, (0, 4, 2, False), id="a batch of token-id prompts"),
        pytest.param("embeddings", {"input": "hello"}, (5, 0, 1, True), id="embeddings read input"),
    ],
)
def test_prompt_size_sums_lengths(kind: str, body: dict[str, Any], expected: tuple[int, int, int, bool]) -> None:
    assert prompt_size(body, kind) == expected


@pytest.mark.parametrize(
    "body, cap",
    [
        pytest.param({"max_tokens": 100}, 100, id="max_tokens"),
        pytest.param({"max_completion_tokens": 50, "max_tokens": 100}, 50, id="max_completion_tokens wins"),
        pytest.param({"max_tokens": 0}, None, id="zero is no cap"),
        pytest.param({"max_tokens": True}, None, id="a boolean is no cap"),
        pytest.param({"max_tokens": "100"}, None, id="a string is no cap"),
        pytest.param({}, None, id="absent"),
    ],
)
def test_max_output_tokens(body: dict[str, Any], cap: int | None) -> None:
    assert max_output_tokens(body) == cap


def test_the_estimate_is_prefill_weighted_prompt_plus_predicted_output() -> None:
    model = CostModel()
    settings = CostSettings(prefill_weight=0.25, prior_output_tokens=100)
    cost = model.estimate(info(chat("a" * 400)), CHAT_PATH, settings).cost
    assert cost.prompt_tokens == 104  # 400 chars / 4 + 4 template tokens
    assert cost.output_tokens == 100  # the prior, before anything was learned
    assert cost.total == pytest.approx(0.25 * 104 + 100)
    embedding = model.estimate(info({"input": "a" * 400}), "/v1/embeddings", settings).cost
    assert (embedding.prompt_tokens, embedding.output_tokens, embedding.total) == (100, 0.0, 25.0)


@pytest.mark.parametrize(
    "body, expected",
    [
        pytest.param({"max_tokens": 10}, 10, id="the prediction never exceeds max_tokens"),
        pytest.param({"max_completion_tokens": 10}, 10, id="nor max_completion_tokens"),
        pytest.param({"max_tokens": 10, "n": 3}, 30, id="n choices each capped"),
        pytest.param({"max_tokens": 5000}, 500, id="a cap above the prediction changes nothing"),
    ],
)
def test_the_prediction_is_capped_at_max_tokens(body: dict[str, Any], expected: float) -> None:
    model = CostModel()
    settings = CostSettings(prior_output_tokens=500)
    assert model.estimate(info(chat("q", **body)), CHAT_PATH, settings).cost.output_tokens == expected


def test_learning_moves_the_prediction_towards_what_the_session_produces() -> None:
    model = CostModel()
    settings = CostSettings(prior_output_tokens=256)
    first = model.estimate(info(chat("q"), session="s"), CHAT_PATH, settings)
    assert first.cost.output_tokens == 256
    model.learn(first, 40, None, settings)
    second = model.estimate(info(chat("q"), session="s"), CHAT_PATH, settings).cost.output_tokens
    other = model.estimate(info(chat("q"), session="t"), CHAT_PATH, settings).cost.output_tokens
    # The request shape learned from one observation (each bucket level weighs it 1 against K = 2 for its
    # parent), and session s's own mean outweighs that (1 against 0.5).
    assert 40 < second < other < 256
    for _ in range(20):
        model.learn(model.estimate(info(chat("q"), session="s"), CHAT_PATH, settings), 40, None, settings)
    assert model.estimate(info(chat("q"), session="s"), CHAT_PATH, settings).cost.output_tokens == pytest.approx(40, abs=1)


def test_n_choices_are_learned_per_choice() -> None:
    model = CostModel()
    settings = CostSettings()
    estimate = model.estimate(info(chat("q", n=4), session="s"), CHAT_PATH, settings)
    for _ in range(40):
        model.learn(estimate, 400, None, settings)  # 4 choices of 100 tokens
    assert model.estimate(info(chat("q"), session="s"), CHAT_PATH, settings).cost.output_tokens == pytest.approx(100, rel=1e-3)
    assert model.estimate(info(chat("q", n=2), session="s"), CHAT_PATH, settings).cost.output_tokens == pytest.approx(200, rel=1e-3)


# ---- convergence on a synthetic stream -------------------------------------------------------------------


def _synthetic_stream(seed: int, requests: int, sessions: int) -> list[tuple[dict[str, Any], str, int, int]]:
    """(body, session, class mean, actual output tokens): three kinds of client whose answers are 30x apart
    (a classifier's 40 tokens, a chat's 300, a writer's 1200), each answer lognormal around its client's
    mean (sigma 0.35, so one client's answers still vary by a factor of two), prompts of 50 to 20k chars,
    max_tokens 2048 (which clips a few writer answers)."""
    rng = random.Random(seed)
    means = (40, 300, 1200)
    out = []
    for _ in range(requests):
        s = rng.randrange(sessions)
        mean = means[s % 3]
        text = "x" * int(min(20_000, rng.lognormvariate(6, 1.2)))
        actual = min(2048, int(rng.lognormvariate(math.log(mean) - 0.35 ** 2 / 2, 0.35)))
        out.append((chat(text, max_tokens=2048), f"client-{s}", mean, actual))
    return out


def test_the_predictor_converges_on_a_synthetic_stream_and_reports_its_error() -> None:
    stream = _synthetic_stream(seed=7, requests=6000, sessions=600)
    model = CostModel()
    settings = CostSettings()
    learned, oracle, no_learning, predicted_sum, actual_sum = [], [], [], 0.0, 0
    for i, (body, session, mean, actual) in enumerate(stream):
        estimate = model.estimate(info(body, session=session), CHAT_PATH, settings)
        if i >= 3000:  # after warm-up: every client has been seen about 5 times
            learned.append(abs(estimate.cost.output_tokens - actual))
            oracle.append(abs(mean - actual))  # knows each client's true mean
            no_learning.append(abs(settings.prior_output_tokens - actual))
            predicted_sum += estimate.cost.output_tokens
            actual_sum += actual
        model.learn(estimate, actual, None, settings)
    mae, oracle_mae, baseline_mae = (sum(x) / len(x) for x in (learned, oracle, no_learning))
    # The oracle's error is the clients' own noise, which no predictor can remove; five observations per
    # client leave the mean estimate ~1/sqrt(5) of that noise away, so within 25% of the oracle.
    assert mae <= 1.25 * oracle_mae, (mae, oracle_mae)
    assert mae <= 0.45 * baseline_mae, (mae, baseline_mae)  # the prior alone is off by ~425 tokens
    assert predicted_sum / actual_sum == pytest.approx(1.0, abs=0.03)  # no bias: load in tokens adds up


def test_without_sessions_the_request_shape_still_learns_the_mean() -> None:
    # With the session keys off, clients are indistinguishable: the best a predictor can do is their mean.
    stream = _synthetic_stream(seed=11, requests=3000, sessions=600)
    model = CostModel()
    settings = CostSettings(session_key=None, fallback_key=None)
    errors = []
    for i, (body, session, _, actual) in enumerate(stream):
        estimate = model.estimate(info(body, session=session), CHAT_PATH, settings)
        assert estimate.session is None
        if i >= 1000:
            errors.append(estimate.cost.output_tokens - actual)
        model.learn(estimate, actual, None, settings)
    assert abs(sum(errors) / len(errors)) < 60  # centred on the overall mean (about 510): little bias


def test_session_memory_stays_bounded_under_100k_distinct_sessions() -> None:
    model = CostModel()
    settings = CostSettings(max_sessions=1000)
    for i in range(100_000):
        model.learn(model.estimate(info(chat("q"), session=f"s{i}"), CHAT_PATH, settings), 10, None, settings)
    predictor = model.predictor(MODEL)
    assert len(predictor.sessions) == 1000  # the LRU's cap holds
    assert hash("s99999") in predictor.sessions and hash("s0") not in predictor.sessions  # the newest are kept
    assert len(predictor.levels) <= 3  # one request shape: three bucket levels, whatever the sessions
    long_key = "k" * 8000  # a key's length never matters: sessions are kept by hash
    model.learn(model.estimate(info(chat("q"), session=long_key), CHAT_PATH, settings), 10, None, settings)
    assert all(isinstance(key, int) for key in predictor.sessions)


def test_prompt_tokens_calibrate_to_the_engines_count() -> None:
    model = CostModel()
    settings = CostSettings()  # charsPerToken 4 until the engine says otherwise
    body = chat("字" * 600)  # CJK text: about 1.5 characters per token, not 4
    for _ in range(50):
        estimate = model.estimate(info(body), CHAT_PATH, settings)
        model.learn(estimate, 10, 400 + 4, settings)  # 600 chars are 400 tokens, plus the template's 4
    assert model.predictor(MODEL).chars_per_token == pytest.approx(1.5)
    assert model.estimate(info(body), CHAT_PATH, settings).cost.prompt_tokens == 404


# ---- counting output tokens ----------------------------------------------------------------------------------


def _sse(*events: Any) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else orjson.dumps(e)) + b"\n\n" for e in events)


def _chunk(delta: dict[str, Any] | None = None, text: str | None = None, finish: str | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if text is not None:
        choice["text"] = text
    else:
        choice["delta"] = delta
    return {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [choice]}


USAGE = {"id": "c", "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}}
VLLM_CHAT = _sse(_chunk({"role": "assistant", "content": ""}), _chunk({"content": "a"}), _chunk({"content": "b"}),
                 _chunk({"content": ""}, finish="stop"), b"[DONE]")  # an EOS step: empty text, still a token
OPENAI_CHAT = _sse(_chunk({"role": "assistant", "content": "a"}), _chunk({"content": "b"}), _chunk({}, finish="stop"),
                   b"[DONE]")


@pytest.mark.parametrize(
    "body, event_stream, expected",
    [
        pytest.param(VLLM_CHAT, True, (3, None, "stream"), id="vLLM chat stream: role announcement and DONE excluded"),
        pytest.param(OPENAI_CHAT, True, (2, None, "stream"), id="OpenAI chat stream: empty closing delta excluded"),
        pytest.param(_sse(_chunk(text="a"), _chunk(text="b"), _chunk(text="c", finish="length"), b"[DONE]"), True,
                     (3, None, "stream"), id="completion stream"),
        pytest.param(VLLM_CHAT[:-len(b"data: [DONE]\n\n")] + _sse(USAGE, b"[DONE]"), True, (3, 12, "usage"),
                     id="a stream with include_usage: usage wins"),
        pytest.param(_sse(_chunk({"content": "data: not an event\n\ndata: x"}), b"[DONE]"), True, (1, None, "stream"),
                     id="newlines and data: inside the text are not events"),
        pytest.param(_sse(_chunk({"content": "a"}), {"error": {"message": "boom"}}), True, (None, None, "unknown"),
                     id="a stream ending in an error teaches nothing"),
        pytest.param(_sse(_chunk({"role": "assistant", "content": ""}), b"[DONE]"), True, (0, None, "stream"),
                     id="an empty answer is zero tokens"),
        pytest.param(orjson.dumps({"usage": {"prompt_tokens": 7, "completion_tokens": 42},
                                   "choices": [{"message": {"content": '"completion_tokens": 99'}}]}), False,
                     (42, 7, "usage"), id="a JSON answer's usage, not text that looks like it"),
        pytest.param(b'{"usage": {"prompt_tokens": 7, "completion_tokens": 42}}', False, (42, 7, "usage"),
                     id="usage with a space after the colon"),
        pytest.param(b'{"choices": []}', False, (None, None, "unknown"), id="a JSON answer without usage"),
    ],
)
def test_output_tokens_are_counted_whatever_the_chunking(
    body: bytes, event_stream: bool, expected: tuple[int | None, int | None, str]
) -> None:
    # Every split of the body into two chunks, and one event per chunk (how vLLM writes them): an event or
    # a usage field split between chunks still counts once.
    events = [e + b"\n\n" for e in body.split(b"\n\n") if e]
    splits = [[body[:i], body[i:]] for i in range(1, len(body))] + [events]
    for chunks in splits:
        counter = OutputCounter()
        for chunk in chunks:
            counter.feed(chunk)
        count = counter.finish(event_stream=event_stream)
        assert (count.output_tokens, count.prompt_tokens, count.source) == expected, chunks


def _vllm_stream(tokens: list[str], per_event: int, usage: bool = False) -> bytes:
    pieces = ["".join(tokens[i:i + per_event]) for i in range(0, len(tokens), per_event)]
    events: list[Any] = [_chunk({"role": "assistant", "content": ""})]
    events += [_chunk({"content": p}, finish="length" if i + 1 == len(pieces) else None) for i, p in enumerate(pieces)]
    if usage:
        events.append({"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": len(tokens)}})
    return _sse(*events, b"[DONE]")


def _observe(model: CostModel, body: bytes) -> tuple[int | None, str]:
    counter = OutputCounter()
    for event in body.split(b"\n\n"):  # one event per chunk, as vLLM writes them
        if event:
            counter.feed(event + b"\n\n")
    return model.observed_output(MODEL, counter.finish(event_stream=True))


@pytest.mark.parametrize(
    "token, per_event, calibrate, expected",
    [
        pytest.param(" the", 1, False, (24, "stream"), id="one token per event: the events are the count"),
        pytest.param(" the", 4, False, (24, "stream_text"),
                     id="steps merged 4 to an event: the text counts, at the default 4 bytes per token"),
        pytest.param(" thermo", 1, False, (24, "stream"), id="long tokens in single events are not mistaken for merges"),
        pytest.param(" thermo", 3, False, (24 * 7 // 4, "stream_text"),
                     id="merged long tokens before calibration: 4 bytes per token is assumed, not 7"),
        pytest.param(" thermo", 3, True, (24, "stream_text"),
                     id="merged long tokens after a stream with usage calibrated the bytes per token"),
        pytest.param(" thermo", 1, True, (24, "stream"), id="after calibration, single events are still the count"),
    ],
)
def test_merged_steps_are_counted_by_their_text(token: str, per_event: int, calibrate: bool,
                                               expected: tuple[int, str]) -> None:
    # vLLM merges engine steps into one event when its API server falls behind: the events then undercount.
    model = CostModel()
    tokens = [token] * 24
    if calibrate:
        assert _observe(model, _vllm_stream(tokens, 1, usage=True)) == (24, "usage")
        assert model.predictor(MODEL).output_bytes_per_token == pytest.approx(len(token), abs=0.25)
    counted, source = _observe(model, _vllm_stream(tokens, per_event))
    assert source == expected[1]
    assert counted == pytest.approx(expected[0], abs=1)  # the final event's extra fields: a byte or two


# ---- configuration ---------------------------------------------------------------------------------------------


def _policy(**fields: Any) -> dict[str, Any]:
    return {"endpoints": [{"id": "gpu-0", "url": "http://127.0.0.1:9", "models": [MODEL]}],
            "policies": [{"name": "default", "strategy": "least-connections", **fields}],
            "telemetry": {"enabled": False}, "redis": {"url": None}}


def test_cost_estimation_is_off_unless_something_uses_it() -> None:
    (spec,) = parse_settings(_policy()).policies
    assert spec.cost is None
    (spec,) = parse_settings(_policy(admission={"order": "shortest-expected-first"})).policies
    assert spec.cost is None  # the order of a queue that never forms (no cap) needs no estimates


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"cost": {}}, id="an empty cost block"),
        pytest.param({"leastConnections": {"loadUnit": "tokens"}}, id="least-connections in tokens"),
        pytest.param({"strategy": "adaptive", "adaptive": {"loadUnit": "tokens"}}, id="adaptive in tokens"),
        pytest.param({"admission": {"maxConcurrentPerEndpoint": 2, "order": "shortest-expected-first"}},
                     id="shortest-expected-first admission"),
    ],
)
def test_cost_estimation_turns_on_with_its_defaults(fields: dict[str, Any]) -> None:
    (spec,) = parse_settings(_policy(**fields)).policies
    assert spec.cost == CostSettings()


def test_a_full_cost_block_is_parsed() -> None:
    (spec,) = parse_settings(_policy(cost={
        "prefillWeight": 0.5, "charsPerToken": 3, "priorOutputTokens": 100, "sessionKey": "header:X-User",
        "fallbackKey": None, "maxSessions": 5, "window": 8})).policies
    c = spec.cost
    assert (c.prefill_weight, c.chars_per_token, c.prior_output_tokens, c.max_sessions, c.window) == (0.5, 3, 100, 5, 8)
    assert (c.session_key.source, c.session_key.name, c.fallback_key) == ("header", "x-user", None)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"cost": {"prefillWeight": -1}}, "policies[0].cost.prefillWeight: must be >= 0"),
        ({"cost": {"charsPerToken": 0.5}}, "policies[0].cost.charsPerToken: must be >= 1.0 and <= 8.0, got 0.5"),
        ({"cost": {"maxSessions": 2_000_000}}, "policies[0].cost.maxSessions: must be between 0 and 1000000"),
        ({"cost": {"window": 0}}, "policies[0].cost.window: must be between 1 and 100000, got 0"),
        ({"cost": {"sessionKey": "cookie:x"}}, "policies[0].cost.sessionKey: must look like 'header:<name>'"),
        ({"cost": {"prefilWeight": 1}}, "policies[0].cost.prefilWeight: unknown field (expected one of: "),
        ({"cost": {"enabled": False}, "leastConnections": {"loadUnit": "tokens"}},
         "policies[0].cost.enabled: cannot be false: strategy least-connections with loadUnit: tokens needs cost"),
        ({"leastConnections": {"loadUnit": "bytes"}},
         "policies[0].leastConnections.loadUnit: must be one of requests, tokens, got 'bytes'"),
        ({"leastConnections": {"unit": "tokens"}},
         "policies[0].leastConnections.unit: unknown parameter (expected one of: loadUnit)"),
        ({"strategy": "adaptive", "adaptive": {"loadUnit": 1}}, "policies[0].adaptive.loadUnit: must be one of"),
        ({"admission": {"order": "sjf"}}, "policies[0].admission.order: must be one of fifo, shortest-expected-first"),
        ({"admission": {"agingTokensPerSecond": 10}},
         "policies[0].admission.agingTokensPerSecond: applies only with order: shortest-expected-first"),
        ({"admission": {"order": "shortest-expected-first", "agingTokensPerSecond": 0}},
         "policies[0].admission.agingTokensPerSecond: must be > 0"),
    ],
    ids=lambda v: str(v)[:60],
)
def test_bad_cost_fields_are_named(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_settings(_policy(**fields))
    assert message in str(exc.value)


# ---- end to end ------------------------------------------------------------------------------------------------


def _metric(router: Any, name: str, **labels: str) -> float | None:
    return router.ctx.metrics.registry.get_sample_value(name, labels)


BOTH_PATHS = (CHAT_PATH, "/v1/completions")


@pytest.mark.parametrize(
    "stream, engine_options, body_extra, paths, source",
    [
        pytest.param(False, {}, {}, BOTH_PATHS, "usage", id="non-streaming: usage.completion_tokens"),
        pytest.param(True, {"vllm_stream": True}, {}, BOTH_PATHS, "stream",
                     id="a vLLM-shaped stream without usage: events counted"),
        # (An OpenAI-shaped completion stream's empty closing `text` event is counted as a token, like vLLM's
        # end-of-sequence step; router/routing/output_tokens.py.)
        pytest.param(True, {}, {}, (CHAT_PATH,), "stream", id="an OpenAI-shaped chat stream without usage: events counted"),
        pytest.param(True, {"vllm_stream": True}, {"stream_options": {"include_usage": True}}, BOTH_PATHS, "usage",
                     id="a stream with include_usage: usage"),
    ],
)
async def test_actual_output_tokens_are_learned_through_a_real_router(
    make_engine, make_router, http, stream: bool, engine_options: dict[str, Any], body_extra: dict[str, Any],
    paths: tuple[str, ...], source: str,
) -> None:
    engine = await make_engine("gpu-0", output_length=lambda body: 7, **engine_options)
    router = await make_router([engine], policies=[{"name": "default", "strategy": "least-connections",
                                                    "leastConnections": {"loadUnit": "tokens"}}])
    router.ctx.access_log = AccessLog(log := io.BytesIO())
    for path in paths:
        body = chat("hello") if path == CHAT_PATH else {"prompt": "hello"}
        async with http.post(router.ingress_url + path, json={"model": MODEL, "stream": stream, **body,
                                                               **body_extra}) as resp:
            assert resp.status == 200
            raw = await resp.read()
        if stream:  # what the client receives is untouched: every token event and [DONE]
            assert len(re.findall(rb"tok\d", raw)) == 7 and raw.endswith(b"data: [DONE]\n\n")
    router.ctx.access_log.flush()
    entries = [orjson.loads(line) for line in log.getvalue().splitlines()]
    assert [(e["output_tokens"], e["output_tokens_source"]) for e in entries] == [(7, source)] * len(paths)
    assert _metric(router, "fleetroute_cost_outcomes_total", model=MODEL, outcome=source) == len(paths)
    assert _metric(router, "fleetroute_cost_actual_output_tokens_total", model=MODEL) == 7 * len(paths)


async def test_merged_stream_steps_are_counted_through_a_real_router(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0", output_length=lambda body: 30, vllm_stream=True)
    router = await make_router([engine], policies=[{"name": "default", "strategy": "least-connections", "cost": {}}])
    router.ctx.access_log = AccessLog(log := io.BytesIO())
    for include_usage, per_event in ((True, 1), (False, 5)):  # usage first: it calibrates bytes per token
        engine.tokens_per_event = per_event
        body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": include_usage}, **chat("hi")}
        async with http.post(router.ingress_url + CHAT_PATH, json=body) as resp:
            assert resp.status == 200
            await resp.read()
    router.ctx.access_log.flush()
    entries = [orjson.loads(line) for line in log.getvalue().splitlines()]
    assert [e["output_tokens_source"] for e in entries] == ["usage", "stream_text"]
    assert entries[1]["output_tokens"] == pytest.approx(30, abs=1)  # 6 events, 30 tokens


async def test_prediction_error_converges_and_appears_in_metrics(make_engine, make_router, http) -> None:
    # Two clients whose answers differ 10x; after a few requests each, their predictions follow them.
    lengths = {"short": 20, "long": 200}
    engine = await make_engine("gpu-0", output_length=lambda body: lengths[body["user"]], vllm_stream=True)
    router = await make_router([engine], policies=[{"name": "default", "strategy": "least-connections",
                                                    "cost": {"priorOutputTokens": 100}}])
    router.ctx.access_log = AccessLog(log := io.BytesIO())
    for _ in range(16):
        for user in lengths:
            body = {"model": MODEL, "user": user, "stream": True, **chat("hi")}
            async with http.post(router.ingress_url + CHAT_PATH, json=body) as resp:
                assert resp.status == 200
                await resp.read()
    router.ctx.access_log.flush()
    last = [orjson.loads(line) for line in log.getvalue().splitlines()][-2:]
    for entry, user in zip(last, lengths, strict=True):
        # 15 answers of its own against K = 0.5 for the shared estimate (about 110): within 15%.
        assert entry["predicted_output_tokens"] == pytest.approx(lengths[user], rel=0.15)
    async with http.get(router.admin_url + "/metrics") as resp:
        text = await resp.text()
    assert f'fleetroute_cost_output_tokens_abs_error_count{{model="{MODEL}"}} 32.0' in text
    assert f'fleetroute_cost_output_tokens_relative_error_bucket{{le="0.1",model="{MODEL}"}}' in text
    assert f'fleetroute_cost_predictor_sessions{{model="{MODEL}"}} 2.0' in text
    # The error histogram's mean over all 32 requests (the first ones at the prior of 100) is far below
    # the prior's own error (80 tokens for each short answer, 100 for each long one).
    total = _metric(router, "fleetroute_cost_output_tokens_abs_error_sum", model=MODEL)
    assert total is not None and total / 32 < 25


async def test_in_flight_cost_is_tracked_per_endpoint_while_a_stream_lasts(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0", gate=asyncio.Event())
    router = await make_router([engine], policies=[{"name": "default", "strategy": "least-connections",
                                                    "cost": {"priorOutputTokens": 50, "prefillWeight": 0.5}}])
    body = {"model": MODEL, "stream": True, "max_tokens": 5, **chat("a" * 400)}
    async with http.post(router.ingress_url + CHAT_PATH, json=body) as resp:
        await resp.content.readuntil(b"\n\n")  # the engine is holding the stream after its first token
        expected = 0.5 * 104 + 5  # prompt 400/4 + 4; the prior of 50 capped at max_tokens
        assert router.ctx.loads.in_flight_cost("gpu-0") == pytest.approx(expected)
        assert _metric(router, "fleetroute_endpoint_in_flight_cost_tokens", endpoint="gpu-0") == pytest.approx(expected)
        async with http.get(router.admin_url + "/admin/endpoints") as admin:
            (endpoint,) = (await admin.json())["endpoints"]
        assert endpoint["in_flight_cost_tokens"] == pytest.approx(expected, abs=0.1)
        engine.gate.set()
        await resp.read()
    assert router.ctx.loads.in_flight_cost("gpu-0") == 0.0
    assert _metric(router, "fleetroute_endpoint_in_flight_cost_tokens", endpoint="gpu-0") == 0.0


async def test_a_request_cut_short_teaches_nothing(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0", gate=asyncio.Event())
    router = await make_router([engine], policies=[{"name": "default", "strategy": "least-connections", "cost": {}}])
    async with http.post(router.ingress_url + CHAT_PATH, json={"model": MODEL, "stream": True, **chat("x")}) as resp:
        await resp.content.readuntil(b"\n\n")
    await asyncio.wait_for(engine.stream_aborted.wait(), 5)  # the client left mid-stream
    async with asyncio.timeout(5):
        while _metric(router, "fleetroute_cost_outcomes_total", model=MODEL, outcome="incomplete") != 1:
            await asyncio.sleep(0.01)
    assert router.ctx.cost.predictor(MODEL).levels == {}


async def test_with_cost_features_unused_nothing_is_estimated(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    seen: list[RequestInfo] = []
    pick = router.ctx.balancer.pick
    router.ctx.balancer.pick = lambda req, exclude=frozenset(): seen.append(req) or pick(req, exclude)  # type: ignore[method-assign]
    router.ctx.access_log = AccessLog(log := io.BytesIO())
    async with http.post(router.ingress_url + CHAT_PATH, json={"model": MODEL, **chat("x")}) as resp:
        assert resp.status == 200
    router.ctx.access_log.flush()
    assert seen[0].cost is None
    assert "predicted_output_tokens" not in orjson.loads(log.getvalue())
    async with http.get(router.admin_url + "/metrics") as resp:
        text = await resp.text()
    assert "fleetroute_cost_outcomes_total{" not in text and "fleetroute_endpoint_in_flight_cost_tokens{" not in text
