"""A fault-injecting TCP proxy for the path to one engine: added delay, and packet loss as TCP shows it.

    proxy = await FaultProxy.start(target_port)     # listens on 127.0.0.1:proxy.port
    proxy.delay, proxy.loss = 0.1, 0.05             # from now on, in both directions
    proxy.delay = proxy.loss = 0.0                  # cleared
    await proxy.close()

It forwards bytes both ways, one task per direction per connection, in order. `delay` seconds are added
before each piece of data is passed on (a longer round trip). `loss` is the chance that a piece is "lost":
on a real network TCP retransmits it, so the application sees no error, only a pause of one retransmission
timeout (Linux's minimum RTO is 200 ms, its initial one 1 s); the proxy holds that piece for `rto` seconds
(1 s by default) before passing it on. Bytes are never dropped or reordered: what a user-space proxy can
model honestly is the latency that loss causes, not the loss itself (that needs a network namespace with
`tc netem`, which needs privileges this harness does not assume).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any


class FaultProxy:
    def __init__(self, target_port: int, *, rng: random.Random | None = None, rto: float = 1.0) -> None:
        self.target_port = target_port
        self.delay = 0.0
        self.loss = 0.0
        self.rto = rto
        self.port = 0
        self._rng = rng or random.Random(0)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # the pipes
        self._handlers: set[asyncio.Task[Any]] = set()  # one per connection, closing its two sockets

    @classmethod
    async def start(cls, target_port: int, **kwargs: float | random.Random) -> FaultProxy:
        proxy = cls(target_port, **kwargs)  # type: ignore[arg-type]
        proxy._server = await asyncio.start_server(proxy._accept, "127.0.0.1", 0)
        proxy.port = proxy._server.sockets[0].getsockname()[1]
        return proxy

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        writers = [client_writer]
        pipes: list[asyncio.Task[None]] = []
        try:
            engine_reader, engine_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            writers.append(engine_writer)
            pipes = [asyncio.create_task(self._pipe(client_reader, engine_writer)),
                     asyncio.create_task(self._pipe(engine_reader, client_writer))]
            self._tasks.update(pipes)
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        except OSError:
            pass  # the engine is down: so is the path to it
        finally:
            for task in pipes:  # one side closed: close both (as a connection through a middlebox does)
                task.cancel()
            for task in pipes:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                self._tasks.discard(task)
            for writer in writers:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
            self._handlers.discard(handler)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                wait = self.delay + (self.rto if self.loss and self._rng.random() < self.loss else 0.0)
                if wait:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        # Each connection's handler closes its sockets once its pipes have ended.
        await asyncio.gather(*list(self._handlers), return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
