"""Child processes of a local fleet (`fleetroute sim` replicas, `fleetroute router`, peer routers), started
and always stopped by PID.

`start` runs `python -m router ...` and takes the child's own structured start-up log line (`sim listening`,
`router listening`) as readiness. `start_command` runs any argv (a peer router: a Rust binary, nginx, the
LiteLLM proxy) whose readiness is an awaitable probe the caller supplies (usually an HTTP poll of its health
URL), raced against the child exiting and bounded by a timeout. Neither is a timed wait. Either way a task
keeps draining the child's output so it can never block on a full pipe; the last lines stay in `log_tail`
for error messages and, with `log_path`, every line also goes to a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

TAIL_LINES = 20


class ChildFailed(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    process: asyncio.subprocess.Process
    ready: dict[str, Any]
    log_tail: list[str] = field(default_factory=list)
    drain: asyncio.Task[None] | None = None
    log_file: IO[str] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def tail(self, lines: int = 5) -> str:
        return " | ".join(self.log_tail[-lines:])


def listener_url(child: Child, listener: str) -> str:
    """A URL for a router child's listener (`ingress`, `admin`), from its `router listening` line, which names
    the addresses each listener's sockets are bound to (`127.0.0.1:PORT`; a wildcard is reached over loopback)."""
    bound = child.ready[listener]
    address = bound[0] if isinstance(bound, list) else bound
    if address.startswith("http"):
        return address
    host, port = address.rsplit(":", 1)
    host = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]"}.get(host, host)
    return f"http://{host}:{port}"


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class ProcessGroup:
    def __init__(self) -> None:
        self.children: list[Child] = []

    async def start(self, name: str, args: list[str], ready_msg: str, *, timeout: float = 30.0) -> Child:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router", *args,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            # Own session: a terminal's Ctrl-C reaches only the parent, which then stops children in order.
            start_new_session=True,
        )
        child = Child(name, process, {})
        self.children.append(child)
        assert process.stderr is not None
        try:
            async with asyncio.timeout(timeout):
                while True:
                    line = await process.stderr.readline()
                    if not line:
                        raise ChildFailed(f"{name} exited during start-up: {child.tail()}")
                    text = line.decode(errors="replace").rstrip()
                    child.log_tail.append(text)
                    with contextlib.suppress(ValueError):
                        record = json.loads(text)
                        if record.get("msg") == ready_msg:
                            child.ready = record
                            break
        except TimeoutError:
            raise ChildFailed(f"{name} did not start within {timeout:g}s") from None
        child.drain = asyncio.create_task(self._drain(child, process.stderr))
        return child

    async def start_command(
        self,
        name: str,
        argv: Sequence[str],
        ready: Callable[[Child], Awaitable[dict[str, Any] | None]],
        *,
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        log_path: Path | None = None,
    ) -> Child:
        """Start `argv` (stdout and stderr merged and drained) and wait until `ready(child)` returns.

        `ready` polls whatever says the child works (its health URL); what it returns becomes `child.ready`.
        The child exiting first, or `timeout` passing, raises ChildFailed with the last lines it printed; the
        caller still stops it (it is in `children` from the moment it exists).
        """
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                env=dict(os.environ if env is None else env), cwd=cwd, start_new_session=True,
            )
        except OSError as exc:  # no such binary, not executable
            raise ChildFailed(f"{name} could not be started ({argv[0]}): {exc}") from None
        child = Child(name, process, {}, log_file=log_path.open("a") if log_path is not None else None)
        self.children.append(child)
        assert process.stdout is not None
        child.drain = asyncio.create_task(self._drain(child, process.stdout))
        probe = asyncio.ensure_future(ready(child))
        exited = asyncio.ensure_future(process.wait())
        try:
            done, _ = await asyncio.wait({probe, exited}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (probe, exited):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if probe in done and probe.exception() is None:
            child.ready = probe.result() or {}
            return child
        if exited in done:
            with contextlib.suppress(TimeoutError):  # the last lines it printed, up to the pipe's end
                await asyncio.wait_for(asyncio.shield(child.drain), 1.0)
            raise ChildFailed(f"{name} exited with {process.returncode} during start-up: {child.tail()}")
        if probe in done:
            raise ChildFailed(f"{name} failed its readiness check: {probe.exception()}; log: {child.tail()}")
        waiting = f" ({child.ready['waiting_for']})" if "waiting_for" in child.ready else ""
        raise ChildFailed(f"{name} was not ready within {timeout:g}s{waiting}; log: {child.tail()}")

    async def _drain(self, child: Child, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            text = line.decode(errors="replace").rstrip()
            child.log_tail = [*child.log_tail[-TAIL_LINES:], text]
            if child.log_file is not None:
                child.log_file.write(text + "\n")

    async def stop(self, child: Child, *, grace: float = 10.0) -> None:
        """SIGTERM to the child's whole process group (each child leads its own session, so its workers, such
        as nginx's or a multi-worker router's, are in it), SIGKILL after `grace`; then reap it."""
        pid = child.process.pid
        if child.process.returncode is None:
            _signal_group(pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(child.process.wait(), grace)
            except TimeoutError:
                _signal_group(pid, signal.SIGKILL)
                await child.process.wait()
        _signal_group(pid, signal.SIGKILL)  # workers the leader left behind, if any (the group outlives it)
        if child.drain is not None:
            child.drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await child.drain
        if child.log_file is not None:
            child.log_file.close()
            child.log_file = None
        if child in self.children:
            self.children.remove(child)

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(c) for c in list(self.children)), return_exceptions=True)
