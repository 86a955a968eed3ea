"""Live configuration reload: a new policy set and endpoint list take effect without a restart and without
failing a request; an invalid or restart-only change is rejected and the running configuration kept."""

from __future__ import annotations

import asyncio
import json
import signal

import yaml

from router.config.settings import parse_settings
from router.server.app import apply_settings, reload_from
from tests.conftest import MODEL, router_config

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


async def test_a_policy_switch_under_load_fails_no_request(make_engine, make_router, http) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(3)]
    router = await make_router(engines, policies=[{"name": "main", "strategy": "round-robin"}])
    statuses: list[int] = []
    stop = asyncio.Event()

    async def traffic() -> None:
        while not stop.is_set():
            async with http.post(router.ingress_url + "/v1/chat/completions", json={**CHAT, "stream": True},
                                 headers={"x-session-id": "s1"}) as resp:
                await resp.read()
                statuses.append(resp.status)

    workers = [asyncio.create_task(traffic()) for _ in range(4)]
    while len(statuses) < 20:
        await asyncio.sleep(0)  # let traffic flow before the switch
    new = parse_settings(router_config(engines, policies=[{"name": "main", "strategy": "consistent-hash"}]))
    apply_settings(router.ctx, new)
    before = len(statuses)
    while len(statuses) < before + 20:
        await asyncio.sleep(0)
    stop.set()
    await asyncio.gather(*workers)
    assert set(statuses) == {200}
    served = set()
    for _ in range(5):  # hashed now: one session, one endpoint
        async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT,
                             headers={"x-session-id": "s1"}) as resp:
            served.add(resp.headers["x-fleetroute-endpoint"])
    assert len(served) == 1


async def test_invalid_or_restart_only_reloads_are_rejected(make_engine, make_router, http, tmp_path) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine], policies=[{"name": "main", "strategy": "round-robin"}])
    path = tmp_path / "router.yaml"
    path.write_text("policies:\n  - {name: main, strategy: fastest}\n")
    reload_from(router.ctx, str(path))
    moved = router_config([engine])
    moved["listen"] = {"host": "127.0.0.1", "port": 1}
    path.write_text(yaml.safe_dump(moved))
    reload_from(router.ctx, str(path))
    assert router.ctx.settings.policies[0].strategy == "round-robin"  # still the running configuration
    async with http.get(router.admin_url + "/metrics") as resp:
        assert 'fleetroute_config_reloads_total{result="rejected"} 2.0' in await resp.text()


async def test_sighup_reloads_the_config_file_of_a_running_router(make_engine, http, tmp_path) -> None:
    from tests.test_serve_process import start_process

    engines = [await make_engine(f"gpu-{i}") for i in range(2)]
    proc, url, admin, _ = await start_process(tmp_path, engines, workers=1)
    try:
        config = yaml.safe_load((tmp_path / "router.yaml").read_text())
        config["endpoints"] = config["endpoints"][:1]  # take gpu-1 out of the static list
        (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
        proc.send_signal(signal.SIGHUP)
        async with asyncio.timeout(10):
            while True:
                line = await proc.stderr.readline()
                assert line, "router exited"
                if json.loads(line).get("msg") == "configuration reloaded":
                    break
        async with http.get(admin + "/admin/endpoints") as resp:
            assert [e["id"] for e in (await resp.json())["endpoints"]] == ["gpu-0"]
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 15)
