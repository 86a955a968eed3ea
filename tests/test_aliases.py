"""Model aliases with weighted targets (router/routing/aliases.py): the config's checks, the split, stickiness, and a
request for an alias through the real router to simulated engines, streamed and not."""

from __future__ import annotations

import asyncio
import io
import json
import math
import random
from collections import Counter
from typing import Any

import aiohttp
import pytest

from router.config.settings import ConfigError, _policy, parse_settings
from router.kube.control import KubernetesControlSettings
from router.kube.control.delegation import MODELS_NOT_DELEGATED, check
from router.routing.aliases import Alias, Target, choose, session_point, weighted
from router.routing.policies.registry import PolicyRegistry
from router.routing.sticky import session_digest
from router.server.access_log import AccessLog

ALIAS, V1, V2 = "llama-3-8b", "llama-3-8b-v1", "llama-3-8b-v2"
SPLIT = [{"name": ALIAS, "targets": [{"model": V1, "weight": 90}, {"model": V2, "weight": 10}]}]
CANARY = Alias(ALIAS, (Target(V1, 90.0), Target(V2, 10.0)))


def config(aliases: Any, *, models: tuple[str, ...] = (V1, V2), **extra: Any) -> dict[str, Any]:
    return {
        "endpoints": [{"id": f"e-{m}", "url": "http://127.0.0.1:9", "models": [m]} for m in models],
        "policies": [{"name": "llama", "models": ["llama-*"], "aliases": aliases}],
        **extra,
    }


def config_error(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_settings(raw)
    return str(info.value)


# ---- the config -----------------------------------------------------------------------------------------


def test_an_alias_parses_into_its_policy() -> None:
    settings = parse_settings(config(SPLIT))
    (alias,) = settings.policies[0].aliases
    assert alias == CANARY and alias.share(V2) == pytest.approx(0.1)


@pytest.mark.parametrize(("aliases", "message"), [
    ("llama", "policies[0].aliases: must be a list of at most 16 aliases, got 'llama'"),
    ([{"targets": [{"model": V1, "weight": 1}]}], "policies[0].aliases[0].name: is required"),
    ([{"name": "llama-*", "targets": [{"model": V1, "weight": 1}]}],
     "policies[0].aliases[0].name: must be a model name, not a pattern (no *, ? or [) and without spaces"),
    ([{"name": ALIAS}], "policies[0].aliases[0].targets: must be a list of 1 to 8 targets ({model, weight}): "
                        "is required"),
    ([{"name": ALIAS, "targets": []}], "policies[0].aliases[0].targets: must be a list of 1 to 8 targets"),
    ([{"name": ALIAS, "targets": [{"model": V1}]}], "policies[0].aliases[0].targets[0].weight: is required"),
    ([{"name": ALIAS, "targets": [{"model": V1, "weight": 0}]}],
     "policies[0].aliases[0].targets[0].weight: must be a number > 0 and <= 1000000, got 0"),
    ([{"name": ALIAS, "targets": [{"model": V1, "weight": -5}]}], "targets[0].weight: must be a number > 0"),
    ([{"name": ALIAS, "targets": [{"model": V1, "weight": True}]}], "targets[0].weight: must be a number > 0"),
    ([{"name": ALIAS, "targets": [{"model": V1, "weight": 1}, {"model": V1, "weight": 2}]}],
     "policies[0].aliases[0].targets[1].model: duplicate target 'llama-3-8b-v1' (give it one weight)"),
    ([{"name": ALIAS, "targets": [{"model": V1, "weight": 1, "share": 3}]}],
     "policies[0].aliases[0].targets[0].share: unknown field (expected one of: model, weight)"),
    ([{"name": ALIAS, "sticky": "yes", "targets": [{"model": V1, "weight": 1}]}],
     "policies[0].aliases[0].sticky: must be true or false, got 'yes'"),
    ([{"name": ALIAS, "targets": [{"model": V1, "weight": 1}]}, {"name": ALIAS, "targets": [{"model": V2, "weight": 1}]}],
     "policies[0].aliases[1].name: duplicate alias 'llama-3-8b'"),
    ([{"name": ALIAS, "targets": [{"model": "canary", "weight": 1}]},
      {"name": "canary", "targets": [{"model": V2, "weight": 1}]}],
     "policies[0].aliases[0].targets[0].model: 'canary' is an alias itself (in this list); aliases resolve once"),
    # The endpoints are all known (static, no discovery): a target none serves is a typo, caught at load.
    ([{"name": ALIAS, "targets": [{"model": V1, "weight": 9}, {"model": "llama-3-8b-v3", "weight": 1}]}],
     "policies[0].aliases[0].targets[1].model: no endpoint serves 'llama-3-8b-v3' (the endpoints serve: "
     "llama-3-8b-v1, llama-3-8b-v2)"),
], ids=lambda v: v if isinstance(v, str) and ":" not in v else None)
def test_a_bad_alias_is_a_config_error_naming_the_field(aliases: Any, message: str) -> None:
    assert message in config_error(config(aliases))


def test_aliases_are_checked_across_policies() -> None:
    raw = config(SPLIT)
    raw["policies"].append({"name": "other", "models": ["qwen"], "aliases": SPLIT})
    assert config_error(raw) == "policies[1].aliases[0].name: alias 'llama-3-8b' is already defined at " \
                                "policies[0].aliases[0]"
    raw["policies"][1]["aliases"] = [{"name": "canary", "targets": [{"model": ALIAS, "weight": 1}]}]
    assert "policies[1].aliases[0].targets[0].model: 'llama-3-8b' is an alias itself (policies[0].aliases[0])" \
        in config_error(raw)


def test_an_alias_may_name_itself_and_discovered_targets_are_not_judged_at_load() -> None:
    # The canary case: the fleet serves `llama-3-8b`; 10% of it goes to v2 (resolution is one step).
    itself = [{"name": ALIAS, "targets": [{"model": ALIAS, "weight": 9}, {"model": V2, "weight": 1}]}]
    assert parse_settings(config(itself, models=(ALIAS, V2))).policies[0].aliases[0].targets[0].model == ALIAS
    # With discovery the endpoints are not known yet: an unserved target is handled per request instead.
    unknown = [{"name": ALIAS, "targets": [{"model": "llama-3-8b-v9", "weight": 1}]}]
    discovery = {"kubernetes": {"services": ["vllm"], "kubeconfig": "/nonexistent"}}
    assert parse_settings(config(unknown, discovery=discovery)).policies[0].aliases[0].targets[0].model \
        == "llama-3-8b-v9"


def test_a_routing_policy_may_alias_only_delegated_models() -> None:
    spec = _policy("spec", {"name": "p", "models": ["team-a-*"], "aliases": [
        {"name": "gpt-4", "targets": [{"model": "team-a-llama", "weight": 1}]}]}, PolicyRegistry())
    refusal = check(spec, 0, KubernetesControlSettings(allowed_models=("team-a-*",)))
    assert refusal is not None and refusal.reason == MODELS_NOT_DELEGATED
    assert "aliases name models 'gpt-4' that are not delegated" in refusal.message
    assert check(spec, 0, KubernetesControlSettings(allowed_models=("team-a-*", "gpt-4"))) is None


# ---- the choice -----------------------------------------------------------------------------------------


def test_a_seeded_simulation_of_100k_picks_matches_the_weights() -> None:
    # Random draws: Binomial(100k, p) per target, sd at most 0.16 points; 0.5 points is over 3 sd.
    rng = random.Random(1)
    alias = Alias(ALIAS, (Target("a", 60.0), Target("b", 30.0), Target("c", 10.0)))
    counts = Counter(choose(alias, session=None, rng=rng, serves=lambda m: True).target for _ in range(100_000))
    for target in alias.targets:
        assert counts[target.model] / 100_000 == pytest.approx(alias.share(target.model), abs=0.005), counts


def test_sticky_sessions_keep_their_target_and_split_by_weight() -> None:
    sticky = Alias(ALIAS, CANARY.targets, sticky=True)
    sessions = [session_digest(f"user-{i}") for i in range(1000)]

    def target(alias: Alias, session: str) -> str | None:
        # A random source that would change the answer if it were used: a sticky choice must not use it.
        return choose(alias, session=session, rng=random.Random(), serves=lambda m: True).target

    first = {s: target(sticky, s) for s in sessions}
    assert all(target(sticky, s) == first[s] for s in sessions)  # every request of a session: one target
    # 1,000 sessions at 90/10: Binomial(1000, 0.1), sd 0.95 points; 3 points is over 3 sd.
    assert sum(t == V2 for t in first.values()) / 1000 == pytest.approx(0.1, abs=0.03)
    # Moving the split to 80/20 moves only sessions from v1 to v2: none on v2 goes back.
    wider = Alias(ALIAS, (Target(V1, 80.0), Target(V2, 20.0)), sticky=True)
    moved = {s: target(wider, s) for s in sessions}
    assert all(moved[s] == V2 for s in sessions if first[s] == V2)
    assert sum(t == V2 for t in moved.values()) / 1000 == pytest.approx(0.2, abs=0.04)
    # Points are independent across aliases: the same sessions split afresh for another alias.
    other = [session_point("qwen", s) < 0.1 for s in sessions]
    assert sum(a and b == V2 for a, b in zip(other, first.values(), strict=True)) < 30  # ~10 expected


def test_an_unserved_target_is_drawn_again_among_the_served_ones() -> None:
    rng = random.Random(3)
    picks = [choose(CANARY, session=None, rng=rng, serves=lambda m: m == V1) for _ in range(1000)]
    assert {p.target for p in picks} == {V1}
    assert 60 <= sum(p.unserved == V2 for p in picks) <= 140  # the 10% that drew v2 are counted as such
    nothing = choose(CANARY, session=None, rng=rng, serves=lambda m: False)
    assert nothing.target is None and nothing.unserved in (V1, V2)
    assert weighted(CANARY.targets, math.nextafter(1.0, 0.0)).model == V2  # the top of the range is the last's


# ---- through the router -----------------------------------------------------------------------------------


async def ask(http: aiohttp.ClientSession, router: Any, *, stream: bool = False, model: str = ALIAS,
              headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any] | list[dict[str, Any]]]:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    async with http.post(router.ingress_url + "/v1/chat/completions", json=body, headers=headers or {}) as resp:
        text = await resp.text()
    if not stream or resp.status != 200:
        return resp.status, json.loads(text)
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return resp.status, [json.loads(e) for e in events[:-1]]


async def test_the_engine_gets_the_target_and_the_client_the_engines_model(make_engine, make_router, http) -> None:
    v1, v2 = await make_engine("gpu-v1", models=(V1,)), await make_engine("gpu-v2", models=(V2,))
    only_v2 = [{"name": ALIAS, "targets": [{"model": V2, "weight": 1}]}]
    router = await make_router([v1, v2], policies=[{"name": "llama", "models": ["*"], "aliases": only_v2}])
    router.ctx.access_log = AccessLog(log := io.BytesIO())
    status, answer = await ask(http, router)
    assert status == 200 and answer["model"] == V2  # as the engine wrote it: the client learns what served it
    assert v2.requests[-1]["body"]["model"] == V2 and not v1.requests
    status, chunks = await ask(http, router, stream=True)
    assert status == 200 and chunks and {c["model"] for c in chunks} == {V2}
    assert v2.requests[-1]["body"] == {"model": V2, "messages": [{"role": "user", "content": "hi"}],
                                                   "stream": True}  # only the model changed
    router.ctx.access_log.flush()
    entries = [json.loads(line) for line in log.getvalue().splitlines()]
    assert [(e["model"], e["alias_target"], e["endpoint"]) for e in entries] == [(ALIAS, V2, "gpu-v2")] * 2
    async with http.get(router.admin_url + "/metrics") as resp:
        text = await resp.text()
    assert f'fleetroute_alias_requests_total{{alias="{ALIAS}",target="{V2}"}} 2.0' in text
    assert f'fleetroute_requests_total{{endpoint="gpu-v2",model="{V2}",status="200"}} 2.0' in text
    async with http.get(router.ingress_url + "/v1/models") as resp:
        listed = await resp.json()
    assert [m["id"] for m in listed["data"]] == [V1, V2, ALIAS]  # a client may ask for the alias too
    assert all(m["object"] == "model" and m["owned_by"] == "fleetroute" for m in listed["data"])


async def test_1000_requests_split_90_10_within_3_points(make_engine, make_router, http) -> None:
    v1, v2 = await make_engine("gpu-v1", models=(V1,)), await make_engine("gpu-v2", models=(V2,))
    router = await make_router([v1, v2], policies=[{"name": "llama", "models": ["*"], "aliases": SPLIT}])
    served: Counter[str] = Counter()
    for _ in range(20):  # 20 rounds of 50 concurrent requests
        for status, answer in await asyncio.gather(*(ask(http, router) for _ in range(50))):
            assert status == 200
            served[answer["model"]] += 1  # type: ignore[call-overload]
    # Binomial(1000, 0.1): mean 100, sd 9.5. ±30 is 3.2 sd, so a correct split leaves the bound with a
    # probability of 0.16% (and never with this seeded RNG), while 80/20 or 50/50 lie 10 sd and more away.
    assert served[V1] + served[V2] == 1000 and 70 <= served[V2] <= 130, served
    assert len(v2.requests) == served[V2]
    async with http.get(router.admin_url + "/metrics") as resp:
        text = await resp.text()
    assert f'fleetroute_alias_requests_total{{alias="{ALIAS}",target="{V2}"}} {served[V2]}.0' in text


async def test_a_sticky_alias_keeps_each_session_on_its_target(make_engine, make_router, http) -> None:
    v1, v2 = await make_engine("gpu-v1", models=(V1,)), await make_engine("gpu-v2", models=(V2,))
    sticky = [{**SPLIT[0], "sticky": True}]
    router = await make_router([v1, v2], policies=[{"name": "llama", "models": ["*"], "aliases": sticky}])
    targets: dict[str, set[str]] = {}
    for i in range(40):
        for _ in range(5):
            _, answer = await ask(http, router, headers={"x-session-id": f"s{i}"})
            targets.setdefault(f"s{i}", set()).add(answer["model"])  # type: ignore[call-overload]
    assert all(len(t) == 1 for t in targets.values())
    assert {next(iter(t)) for t in targets.values()} == {V1, V2}  # 40 sessions at 90/10: both (p > 98%)


async def test_an_unserved_target_is_drawn_again_counted_and_explained(make_engine, make_router, http) -> None:
    v1, v2 = await make_engine("gpu-v1", models=(V1,)), await make_engine("gpu-v2", models=(V2,))
    canary = [{"name": ALIAS, "targets": [{"model": V1, "weight": 1}, {"model": V2, "weight": 99}]}]
    router = await make_router([v1, v2], policies=[{"name": "llama", "models": ["*"], "aliases": canary}],
                               explain={"sampleRate": 1})
    balancer = router.ctx.balancer
    # v2's endpoints leave (as discovered pods do): its draws go to v1, counted as unserved.
    balancer.set_endpoints([e for e in balancer.endpoints() if e.id == "gpu-v1"])
    for _ in range(5):
        status, answer = await ask(http, router)
        assert status == 200 and answer["model"] == V1
    (decision,) = router.ctx.decisions.recent(limit=1)
    assert decision.to_dict()["alias"] == {"name": ALIAS, "target": V1, "how": "random",
                                           "shares": {V1: 0.01, V2: 0.99}, "unserved": V2}
    assert decision.model == V1 and not v2.requests
    async with http.get(router.admin_url + "/metrics") as resp:
        text = await resp.text()
    assert f'fleetroute_alias_unserved_total{{alias="{ALIAS}",target="{V2}"}}' in text
    async with http.get(router.ingress_url + "/v1/models") as resp:
        assert [m["id"] for m in (await resp.json())["data"]] == [V1, ALIAS]
    # No target served at all: the alias is answered as a model without endpoints.
    balancer.set_endpoints([])
    status, answer = await ask(http, router)
    assert status == 503 and answer["error"]["code"] == "no_endpoint"  # type: ignore[call-overload]
    assert f"`{ALIAS}`" in answer["error"]["message"]  # type: ignore[call-overload]
    async with http.get(router.ingress_url + "/v1/models") as resp:
        assert (await resp.json())["data"] == []
