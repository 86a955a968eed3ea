"""Child processes of a local fleet (`fleetroute sim` replicas, `fleetroute router`), started and always
stopped by PID.

Readiness is the child's own structured start-up log line (`sim listening`, `router listening`), not a
timed wait; after that a task keeps draining the child's stderr so it can never block on a full pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Any


class ChildFailed(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    process: asyncio.subprocess.Process
    ready: dict[str, Any]
    log_tail: list[str] = field(default_factory=list)
    drain: asyncio.Task[None] | None = None


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
                        raise ChildFailed(f"{name} exited during start-up: {' | '.join(child.log_tail[-5:])}")
                    text = line.decode(errors="replace").rstrip()
                    child.log_tail.append(text)
                    with contextlib.suppress(ValueError):
                        record = json.loads(text)
                        if record.get("msg") == ready_msg:
                            child.ready = record
                            break
        except TimeoutError:
            raise ChildFailed(f"{name} did not start within {timeout:g}s") from None
        child.drain = asyncio.create_task(self._drain(child))
        return child

    async def _drain(self, child: Child) -> None:
        assert child.process.stderr is not None
        while line := await child.process.stderr.readline():
            child.log_tail = [*child.log_tail[-20:], line.decode(errors="replace").rstrip()]

    async def stop(self, child: Child, *, grace: float = 10.0) -> None:
        if child.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(child.process.wait(), grace)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    child.process.kill()
                await child.process.wait()
        if child.drain is not None:
            child.drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await child.drain
        if child in self.children:
            self.children.remove(child)

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop(c) for c in list(self.children)), return_exceptions=True)
