"""Shared fixtures: fake engines and routers on 127.0.0.1 free ports, shut down after each test."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from router.config.settings import parse_settings
from router.server.app import RunningRouter, build_context, start_router
from tests.fake_engine import FakeEngine
from tests.sim_server import make_sim  # noqa: F401 - a fixture for every test module

# Fixture modules imported by several test modules: rewritten for assertions before any of them imports one
# (a module's `pytest_plugins` comes too late when another module imported it first).
pytest.register_assert_rewrite("tests.nvml_fixtures")

MODEL = "llama-3-8b"


@pytest.fixture
async def make_engine() -> AsyncIterator[Callable[..., Awaitable[FakeEngine]]]:
    started: list[FakeEngine] = []

    async def make(name: str, models: tuple[str, ...] = (MODEL,), **kwargs: Any) -> FakeEngine:
        engine = await FakeEngine(name=name, models=models, **kwargs).start()
        started.append(engine)
        return engine

    yield make
    for engine in started:
        await engine.stop()


def router_config(engines: list[FakeEngine], **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "endpoints": [{"id": e.name, "url": e.url, "models": list(e.models)} for e in engines],
        "policies": [{"name": "default", "models": ["*"], "strategy": "least-connections"}],
        "telemetry": {"enabled": False},
        "redis": {"url": None},
        "logging": {"accessLog": True},
        "shutdownGrace": 1,
    }
    config.update(overrides)
    return config


@pytest.fixture
async def make_router() -> AsyncIterator[Callable[..., Awaitable[RunningRouter]]]:
    started: list[RunningRouter] = []

    async def make(
        engines: list[FakeEngine], *, seed: int = 7, clock: Callable[[], float] | None = None, **overrides: Any
    ) -> RunningRouter:
        settings = parse_settings(router_config(engines, **overrides))
        extra = {"clock": clock} if clock is not None else {}
        running = await start_router(build_context(settings, rng=random.Random(seed), **extra))
        started.append(running)
        return running

    yield make
    for running in started:
        await running.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
