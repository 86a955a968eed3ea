"""Scenario presets (router/config/presets.py): each expands to a policy the router accepts and that keeps the
promises its documentation makes; fields written beside `preset` override it by the documented rules; bad
names are errors naming the field; and, through a real router, each preset behaves as described.

The RoutingPolicy side (the CRD's schema and CEL rules, the controller's translation) is tested in
tests/test_routing_policy_crd.py.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.config import presets
from router.config.settings import ConfigError, PolicySpec, parse_settings
from router.server.app import apply_settings
from tests.conftest import MODEL

ROOT = Path(__file__).resolve().parent.parent
NAMES = presets.names()


def spec_of(preset: str, **fields: Any) -> PolicySpec:
    (spec,) = parse_settings({"policies": [{"name": "p", "preset": preset, **fields}]}).policies
    return spec


# ---- each preset is a valid policy that keeps its promises ------------------------------------------------

# What each preset promises in docs/policies.md ("Presets"), checked on the parsed policy: a preset edited
# against its documentation fails here.
PROMISES: dict[str, list[tuple[str, Callable[[PolicySpec], bool]]]] = {
    "realtime-chat": [
        ("prefix affinity with a load guard tighter than the default",
         lambda s: s.strategy == "prefix-aware" and s.params.max_imbalance is not None and s.params.max_imbalance < 8),
        ("sessions pinned by x-session-id, for minutes",
         lambda s: s.stickiness.enabled and s.stickiness.key.name == "x-session-id" and s.stickiness.ttl >= 60),
        ("timeouts that fail fast", lambda s: s.timeouts.connect <= 1 and s.timeouts.first_byte <= 15
         and s.timeouts.idle <= 15 and s.timeouts.total is not None),
        ("a retry onto another replica", lambda s: s.retries.attempts >= 2),
        ("admission on, with a small queue", lambda s: s.admission.max_concurrent_per_endpoint is not None
         and s.admission.max_queue <= 64),
        ("interactive by default, deadlines of seconds", lambda s: s.admission.default_class == "high"
         and all(c.deadline <= 10 for c in s.admission.classes)),
        ("429 with a short Retry-After", lambda s: s.admission.shed_status == 429 and s.admission.retry_after <= 1),
    ],
    "batch-generation": [
        ("least-connections in predicted tokens",
         lambda s: s.strategy == "least-connections" and s.params.load_unit == "tokens" and s.cost is not None),
        ("a large queue, shortest expected first", lambda s: s.admission.max_concurrent_per_endpoint is not None
         and s.admission.max_queue >= 1000 and s.admission.order == "shortest-expected-first"),
        ("low priority by default", lambda s: s.admission.default_class == s.admission.classes[-1].name),
        ("timeouts of minutes", lambda s: s.timeouts.first_byte >= 600 and s.timeouts.idle >= 60),
        ("503 with a long Retry-After", lambda s: s.admission.shed_status == 503 and s.admission.retry_after >= 10),
    ],
    "rag-search": [
        ("prefix affinity hashing more of the prompt than the default (16 KiB)",
         lambda s: s.strategy == "prefix-aware" and s.params.block_chars * s.params.max_blocks > 16 * 1024),
        ("bounded loads", lambda s: s.params.max_load_factor is not None and s.params.max_load_factor > 1),
        ("a concurrency cap", lambda s: s.admission.max_concurrent_per_endpoint is not None),
    ],
}


def test_the_promises_cover_every_preset() -> None:
    assert set(PROMISES) == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_preset_expands_to_a_policy_the_parser_accepts(name: str) -> None:
    spec = spec_of(name)
    assert spec.preset == name and spec.name == "p" and spec.models == ("*",)
    broken = [promise for promise, holds in PROMISES[name] if not holds(spec)]
    assert broken == []


@pytest.mark.parametrize("name", NAMES)
def test_every_value_of_a_preset_says_why(name: str) -> None:
    """Each line that sets a value carries a comment (a line that only opens a block need not): the preset is
    its own documentation."""
    text = presets.get(name).text
    for line in text.splitlines():
        opens_a_block = re.fullmatch(r"\s*[A-Za-z-]+:\s*", line)
        if line.strip() and not line.lstrip().startswith("#") and not opens_a_block:
            assert "#" in line, f"{name}: no reason given for `{line.strip()}`"
    assert text.startswith(f"# {name}: ")


@pytest.mark.parametrize("name", NAMES)
def test_a_preset_sets_neither_name_nor_models(name: str) -> None:
    """Those belong to the fleet: a preset fits any model."""
    policy = presets.get(name).policy()
    assert "name" not in policy and "models" not in policy and "preset" not in policy


def test_show_preset_prints_the_preset_as_written(tmp_path: Path) -> None:
    for name in NAMES:
        result = _cli("router", "--show-preset", name, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert result.stdout == presets.get(name).text
        assert yaml.safe_load(result.stdout) == presets.get(name).policy()
    result = _cli("router", "--show-preset", "realtime", cwd=tmp_path)
    assert result.returncode == 2
    assert "invalid choice: 'realtime' (choose from 'realtime-chat', 'batch-generation', 'rag-search')" in result.stderr


def test_help_lists_every_preset(tmp_path: Path) -> None:
    result = _cli("router", "--help", cwd=tmp_path)
    assert result.returncode == 0
    for name in NAMES:
        assert re.search(rf"^  {name} +\S", result.stdout, re.MULTILINE), name
    assert "--show-preset NAME" in result.stdout and "--show-policies" in result.stdout


def test_the_docs_describe_every_preset() -> None:
    policies_md = (ROOT / "docs" / "policies.md").read_text()
    for name in NAMES:
        assert f"### {name}" in policies_md, name
    assert "## Presets" in policies_md


def test_the_complete_example_of_the_configuration_reference_is_valid() -> None:
    """docs/configuration.md's example, a preset-based policy among its policies, is a config the router takes."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    example = text.split("## Complete example", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    settings = parse_settings(yaml.safe_load(example))
    batch = next(p for p in settings.policies if p.preset == "batch-generation")
    assert batch.admission.max_concurrent_per_endpoint == 128 and batch.admission.order == "shortest-expected-first"


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "router", *args], capture_output=True, text=True, timeout=30,
                          cwd=cwd)


# ---- overrides ---------------------------------------------------------------------------------------------

OVERRIDES = [
    pytest.param("realtime-chat", {"timeouts": {"firstByte": "5s"}},
                 lambda s: (s.timeouts.connect, s.timeouts.first_byte, s.timeouts.idle, s.timeouts.total),
                 (1.0, 5.0, 10.0, 120.0), id="a mapping merges field by field: only firstByte changes"),
    pytest.param("realtime-chat", {"timeouts": {"total": None}}, lambda s: s.timeouts.total, None,
                 id="null replaces the preset's value and keeps its meaning: no total limit"),
    pytest.param("realtime-chat", {"prefixAware": {"maxImbalance": None, "maxBlocks": 32}},
                 lambda s: (s.params.max_imbalance, s.params.max_blocks, s.params.block_chars), (None, 32, 256),
                 id="a null guard is off, not back to the default"),
    pytest.param("realtime-chat", {"admission": None}, lambda s: s.admission.max_concurrent_per_endpoint, None,
                 id="a null block drops the preset's: admission off"),
    pytest.param("realtime-chat", {"admission": {"maxConcurrentPerEndpoint": 8}},
                 lambda s: (s.admission.max_concurrent_per_endpoint, s.admission.max_queue, s.admission.default_class),
                 (8, 32, "high"), id="a new cap keeps the rest of the preset's admission"),
    pytest.param("realtime-chat", {"admission": {"classes": {"gold": {"deadline": "1s"}, "silver": {}},
                                                 "defaultClass": "silver"}},
                 lambda s: [(c.name, c.rank, c.deadline) for c in s.admission.classes],
                 [("gold", 0, 1.0), ("silver", 1, 60.0)], id="classes are replaced whole, in the order written"),
    pytest.param("realtime-chat", {"stickiness": {"enabled": False}}, lambda s: s.stickiness.enabled, False,
                 id="stickiness turned off by its switch"),
    pytest.param("realtime-chat", {"strategy": "adaptive"},
                 lambda s: (s.strategy, type(s.params).__name__, s.stickiness.enabled, s.timeouts.first_byte),
                 ("adaptive", "AdaptiveConfig", True, 10.0),
                 id="another strategy: its defaults, the preset's prefixAware dropped, the rest kept"),
    pytest.param("rag-search", {"strategy": "consistent-hash"},
                 lambda s: (s.params.key.source, s.params.key.name, s.params.max_load_factor),
                 ("header", "x-tenant-id", 1.25), id="switching to a strategy the preset has a block for uses it"),
    pytest.param("rag-search", {"strategy": "consistent-hash", "consistentHash": {"key": "body:user"}},
                 lambda s: (s.params.key.name, s.params.max_load_factor), ("user", 1.25),
                 id="the operator's block for it merges with the preset's"),
    pytest.param("rag-search", {"strategy": "prefix-aware"}, lambda s: s.params.block_chars, 512,
                 id="the preset's own strategy written again changes nothing"),
    pytest.param("batch-generation", {"cost": {"prefillWeight": 0.5}},
                 lambda s: (s.cost.prefill_weight, s.cost.session_key.name), (0.5, "x-batch-id"),
                 id="cost merges: the preset's session key stays"),
    pytest.param("batch-generation", {"models": ["batch-*"], "retries": {"attempts": 1}},
                 lambda s: (s.models, s.retries.attempts, s.retries.budget_percent), (("batch-*",), 1, 10.0),
                 id="models are the operator's; retries merge"),
    pytest.param("batch-generation", {"admission": {"order": "fifo", "agingTokensPerSecond": None}},
                 lambda s: (s.admission.order, s.admission.max_queue), ("fifo", 10000),
                 id="back to fifo: null unsets the preset's agingTokensPerSecond"),
    pytest.param("batch-generation", {"admission": {"order": "fifo"}}, None,
                 "policies[0] (preset batch-generation).admission.agingTokensPerSecond: applies only with order: "
                 "shortest-expected-first (null unsets it)",
                 id="back to fifo with the preset's rate left in: the error says how to unset it"),
]


@pytest.mark.parametrize(("preset", "fields", "read", "expected"), OVERRIDES)
def test_fields_beside_a_preset_override_it(preset: str, fields: dict[str, Any],
                                            read: Callable[[PolicySpec], Any] | None, expected: Any) -> None:
    if read is None:
        with pytest.raises(ConfigError) as error:
            spec_of(preset, **fields)
        assert str(error.value).startswith(expected)
        return
    assert read(spec_of(preset, **fields)) == expected


def test_an_override_leaves_the_preset_itself_unchanged() -> None:
    before = presets.get("realtime-chat").policy()
    spec_of("realtime-chat", timeouts={"firstByte": "5s"}, admission={"classes": {"x": {}}, "defaultClass": "x"})
    assert presets.get("realtime-chat").policy() == before
    assert spec_of("realtime-chat").timeouts.first_byte == 10.0


def test_a_strategy_block_the_operator_writes_is_validated_even_when_unused() -> None:
    with pytest.raises(ConfigError, match=r"^policies\[0\] \(preset realtime-chat\)\.adaptive\.choices: "):
        spec_of("realtime-chat", adaptive={"choices": 0})


def test_a_spec_from_a_preset_equals_the_same_policy_written_out() -> None:
    """The preset is where the settings came from, not a setting: the expanded entry routes the same."""
    for name in NAMES:
        expanded, _ = presets.expand({"preset": name}, strategy_blocks=_blocks())
        (written,) = parse_settings({"policies": [{"name": "p", **expanded}]}).policies
        assert written == spec_of(name) and written.preset is None


def _blocks() -> dict[str, str]:
    from router.routing.policies.registry import PolicyRegistry

    return {p.name: p.config_key for p in PolicyRegistry().all()}


# ---- errors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("entry", "message"), [
    ({"name": "p", "preset": "realtime"},
     "policies[0].preset: unknown preset 'realtime' (presets: realtime-chat, batch-generation, rag-search)"),
    ({"name": "p", "preset": 5}, "policies[0].preset: unknown preset 5 (presets: realtime-chat,"),
    ({"name": "p", "preset": None}, "policies[0].preset: unknown preset None"),
    ({"name": "p", "preset": "rag-search", "timeouts": {"idle": "soon"}},
     "policies[0] (preset rag-search).timeouts.idle: must be a positive duration like 2s, 500ms or 1.5, got 'soon'"),
    ({"name": "p", "preset": "batch-generation", "admission": {"maxQueue": -1}},
     "policies[0] (preset batch-generation).admission.maxQueue: must be between 0 and 1000000, got -1"),
    ({"name": "p", "preset": "realtime-chat", "admission": {"classes": {"gold": {}}}},
     "policies[0] (preset realtime-chat).admission.defaultClass: must be one of the classes (gold); got 'high'"),
    ({"name": "p", "preset": "realtime-chat", "timeout": {}},
     "policies[0] (preset realtime-chat).timeout: unknown field (expected one of: adaptive, admission,"),
    ({"preset": "realtime-chat"}, "policies[0] (preset realtime-chat).name: is required"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_preset_errors_name_the_field(entry: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        parse_settings({"policies": [entry]})
    assert str(error.value).startswith(message), str(error.value)


def test_an_unknown_field_error_lists_preset_among_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"expected one of: .*\bpreset\b"):
        parse_settings({"policies": [{"name": "p", "presets": "realtime-chat"}]})


def test_the_cli_reports_a_bad_preset_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("policies:\n  - {name: chat, preset: realtime-chatt}\n")
    result = _cli("router", "--config", str(path), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr == ("fleetroute router: config error: policies[0].preset: unknown preset 'realtime-chatt' "
                             "(presets: realtime-chat, batch-generation, rag-search)\n")


def test_show_policies_prints_the_expanded_entries(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({"policies": [
        {"name": "chat", "models": ["llama-*"], "preset": "realtime-chat", "timeouts": {"firstByte": "5s"}},
        {"name": "rag", "preset": "rag-search", "strategy": "consistent-hash"},
        {"name": "rest", "strategy": "round-robin"},
    ]}, sort_keys=False))
    result = _cli("router", "--config", str(path), "--show-policies", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "# policies[0]: preset realtime-chat, with the file's fields merged on top" in result.stdout
    printed = yaml.safe_load(result.stdout)["policies"]
    assert list(printed[0])[:3] == ["name", "models", "strategy"]
    assert printed[0]["timeouts"] == {"connect": "1s", "firstByte": "5s", "idle": "10s", "total": "2m"}
    assert printed[1]["strategy"] == "consistent-hash" and "prefixAware" not in printed[1]
    assert printed[2] == {"name": "rest", "strategy": "round-robin"}
    # What it prints is a config the router accepts, and routes the same as the original.
    assert parse_settings({"policies": printed}).policies == parse_settings(yaml.safe_load(path.read_text())).policies
    path.write_text("policies:\n  - {name: chat, preset: nope}\n")  # an invalid file prints nothing but the error
    result = _cli("router", "--config", str(path), "--show-policies", cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == "" and "unknown preset 'nope'" in result.stderr


# ---- through a real router ---------------------------------------------------------------------------------


def _info(router: Any, **labels: str) -> float | None:
    return router.ctx.metrics.registry.get_sample_value("fleetroute_policy_info", labels)


async def test_realtime_chat_pins_a_session_through_a_real_router(make_engine, make_router, http) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(3)]
    router = await make_router(engines, policies=[{"name": "chat", "models": [MODEL], "preset": "realtime-chat"}])
    url = router.ingress_url + "/v1/chat/completions"

    async def chat(session: str, turn: int) -> str:
        # Turns too short to hash (under one 256-char block): only the session pin can keep them together.
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"turn {turn}"}]}
        async with http.post(url, json=body, headers={"x-session-id": session}) as resp:
            assert resp.status == 200, await resp.text()
            return resp.headers["x-fleetroute-endpoint"]

    homes = {}
    for session in ("alice", "bob", "carol", "dave", "erin", "frank"):
        served = {await chat(session, turn) for turn in range(5)}
        assert len(served) == 1, (session, served)  # every turn of a session on one engine
        homes[session] = served.pop()
    assert len(set(homes.values())) > 1  # sessions themselves spread by load
    registry = router.ctx.metrics.registry
    assert registry.get_sample_value("fleetroute_sticky_decisions_total", {"policy": "chat", "outcome": "hit"}) == 24
    assert registry.get_sample_value("fleetroute_sticky_decisions_total", {"policy": "chat", "outcome": "new"}) == 6
    assert _info(router, policy="chat", strategy="prefix-aware", preset="realtime-chat") == 1.0


async def test_realtime_chat_sheds_fast_with_429_when_the_fleet_is_full(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0", gate=asyncio.Event())
    router = await make_router([engine], policies=[{"name": "chat", "preset": "realtime-chat",
                                                    "admission": {"maxConcurrentPerEndpoint": 1, "maxQueue": 0}}])
    url = router.ingress_url + "/v1/chat/completions"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    holder = await http.post(url, json={**chat, "stream": True})
    try:
        await holder.content.readuntil(b"\n\n")  # the only slot is taken
        async with http.post(url, json=chat) as resp:
            assert resp.status == 429 and resp.headers["Retry-After"] == "1"
            assert (await resp.json())["error"]["code"] == "queue_full"
    finally:
        engine.gate.set()
        await holder.read()
        holder.release()


async def test_batch_generation_queues_shortest_expected_first_at_the_cap(make_engine, make_router, http) -> None:
    """The preset with one override, the cap: queueing, order, status and Retry-After are the preset's."""
    engine = await make_engine("gpu-0", gate=asyncio.Event())
    router = await make_router([engine], policies=[{
        "name": "batch", "models": [MODEL], "preset": "batch-generation",
        "admission": {"maxConcurrentPerEndpoint": 1, "maxQueue": 2}}])
    url = router.ingress_url + "/v1/chat/completions"
    admission = router.ctx.admission
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    holder = await http.post(url, json={**chat, "stream": True})
    await holder.content.readuntil(b"\n\n")  # the engine is at its cap
    # Both at the default class (low). The long job (40k characters, max_tokens 2000) arrives first.
    long = asyncio.create_task(http.post(url, json={**chat, "max_tokens": 2000,
                                                    "messages": [{"role": "user", "content": "x" * 40_000}]}))
    await _until(lambda: admission.queued(MODEL) == 1)
    short = asyncio.create_task(http.post(url, json={**chat, "max_tokens": 10}))
    await _until(lambda: admission.queued(MODEL) == 2)
    async with http.post(url, json=chat) as resp:  # the queue is full: the preset's 503 and Retry-After
        assert resp.status == 503 and resp.headers["Retry-After"] == "30"
        assert (await resp.json())["error"]["code"] == "queue_full"
    engine.gate.set()
    await holder.read()
    holder.release()
    for task in (long, short):
        resp = await asyncio.wait_for(task, 10)
        assert resp.status == 200
        await resp.read()
        resp.release()
    contents = [r["body"]["messages"][0]["content"] for r in engine.requests[1:]]
    assert [len(c) for c in contents] == [2, 40_000]  # the short job went first
    registry = router.ctx.metrics.registry
    assert registry.get_sample_value("fleetroute_admission_shed_total",
                                     {"model": MODEL, "priority": "low", "reason": "queue_full"}) == 1.0
    assert _info(router, policy="batch", strategy="least-connections", preset="batch-generation") == 1.0


async def test_rag_search_keeps_a_shared_context_on_one_engine(make_engine, make_router, http) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(3)]
    router = await make_router(engines, policies=[{"name": "rag", "preset": "rag-search"}])
    url = router.ingress_url + "/v1/chat/completions"
    contexts = {doc: f"[document {doc}] " + " ".join(f"passage {doc}.{i}" for i in range(600)) for doc in "ABCD"}

    async def ask(doc: str, question: int) -> str:
        body = {"model": MODEL, "messages": [{"role": "system", "content": contexts[doc]},
                                             {"role": "user", "content": f"question {question}?"}]}
        async with http.post(url, json=body) as resp:
            assert resp.status == 200, await resp.text()
            return resp.headers["x-fleetroute-endpoint"]

    for doc in "ABCD":
        assert len({await ask(doc, q) for q in range(4)}) == 1, doc  # every question about a document on one engine
    events = router.ctx.metrics.registry.get_sample_value
    assert events("fleetroute_policy_events_total", {"policy": "rag", "event": "prefix_hit"}) == 12
    assert events("fleetroute_policy_events_total", {"policy": "rag", "event": "prefix_miss"}) == 4


async def test_the_policy_info_metric_follows_a_reload(make_engine, make_router) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine], policies=[{"name": "p", "preset": "rag-search"}])
    assert _info(router, policy="p", strategy="prefix-aware", preset="rag-search") == 1.0
    changed = parse_settings({"policies": [{"name": "p", "preset": "rag-search", "strategy": "consistent-hash"}]})
    apply_settings(router.ctx, replace(router.ctx.settings, policies=changed.policies))
    assert _info(router, policy="p", strategy="consistent-hash", preset="rag-search") == 1.0
    assert _info(router, policy="p", strategy="prefix-aware", preset="rag-search") == 0.0


async def _until(condition: Callable[[], bool]) -> None:
    """Yield to the event loop until `condition()` holds (bounded; no timed sleep)."""
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0)
