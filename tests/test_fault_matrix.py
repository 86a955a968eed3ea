"""The fault-matrix soak (loadtest/faults.py), run tiny: an engine killed and an engine hung (SIGSTOP) under
mixed load through two routers lose no request that had not started streaming; and the fault-injecting proxy
(loadtest/faultproxy.py) delays what it forwards and loses nothing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest.faultproxy import FaultProxy

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(240)
def test_a_killed_and_a_hung_engine_lose_no_request_that_had_not_started_streaming(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.faults", "--faults", "kill,hang", "--hold", "2", "--settle", "2",
         "--warmup", "1.5", "--rate", "8", "--tail", "0", "--json", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=220, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["fault"]: row for row in json.loads(out.read_text())["faults"]}
    assert set(rows) == {"kill", "hang"}
    for fault, row in rows.items():
        assert row["requests"] >= 20, (fault, row)  # the load went on through the fault
        # Non-streamed requests and streams without a token yet are retried on another replica: none lost.
        assert row["lost_non_streaming"] == 0, (fault, row)
        assert row["lost"] == 0, (fault, row)


async def test_the_fault_proxy_adds_its_delay_and_forwards_every_byte_in_order() -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    proxy = await FaultProxy.start(server.sockets[0].getsockname()[1])
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        payload = bytes(range(256)) * 64
        proxy.delay = 0.1
        began = time.monotonic()
        writer.write(payload)
        async with asyncio.timeout(10):
            assert await reader.readexactly(len(payload)) == payload
        assert time.monotonic() - began >= 0.2  # 100 ms each way
        proxy.delay, proxy.loss, proxy.rto = 0.0, 1.0, 0.05  # every piece "lost" once: retransmitted, late
        writer.write(b"again")
        async with asyncio.timeout(10):
            assert await reader.readexactly(5) == b"again"
        writer.close()
        await writer.wait_closed()
    finally:
        await proxy.close()
        server.close()
        await server.wait_closed()
