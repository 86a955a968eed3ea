"""An in-process `fleetroute sim` replica on a free 127.0.0.1 port, as a fixture (`make_sim`)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from worker.sim.engine import EngineConfig, EngineCore
from worker.sim.profiles import profile
from worker.sim.server import SimServer, SimSettings

MODEL = "sim-model"


class RunningSim:
    def __init__(self, server: SimServer, runner: web.AppRunner, url: str) -> None:
        self.server, self.runner, self.url = server, runner, url


@pytest.fixture
async def make_sim() -> AsyncIterator[Callable[..., Awaitable[RunningSim]]]:
    started: list[RunningSim] = []

    async def make(*, gpu: str = "h100", time_scale: float = 0.05, fault_injection: bool = True,
                   lora_modules: tuple[tuple[str, str], ...] = (), **engine: Any) -> RunningSim:
        config = EngineConfig(**engine)
        settings = SimSettings(model=MODEL, profile=profile(gpu), engine=config, time_scale=time_scale,
                               max_model_len=2048, fault_injection=fault_injection, lora_modules=lora_modules)
        server = SimServer(settings, EngineCore(profile(gpu), config, random.Random(0)))
        runner = web.AppRunner(server.build_app(), handler_cancellation=True, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        sim = RunningSim(server, runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        started.append(sim)
        return sim

    yield make
    for sim in started:
        await sim.runner.cleanup()
