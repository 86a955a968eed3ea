"""The `fleetroute router` process itself: graceful drain on SIGTERM, and multi-process mode sharing ports."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from pathlib import Path

import yaml

from tests.conftest import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def start_process(tmp_path: Path, engines, workers: int,
                        **extra) -> tuple[asyncio.subprocess.Process, str, str, list[dict]]:
    port, admin = free_port(), free_port()
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "admin": {"host": "127.0.0.1", "port": admin},
        "endpoints": [{"id": e.name, "url": e.url, "models": list(e.models)} for e in engines],
        "telemetry": {"enabled": False},
        "workers": workers,
        "shutdownGrace": "10s",
        # The test's client keeps its connection once its stream ends: it is closed idle when the drain ends.
        "drainConnections": "1s",
        **extra,
    }
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "router", "--config", str(path),
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    # Wait for every worker's start-up log line (structured JSON), not for a fixed time.
    lines: list[dict] = []
    async with asyncio.timeout(30):
        while sum(1 for line in lines if line.get("msg") == "router listening") < workers:
            raw = await proc.stderr.readline()
            assert raw, "router exited during start-up"
            lines.append(json.loads(raw))
    for line in lines:  # the log names the addresses the sockets are bound to
        if line.get("msg") == "router listening":
            assert (line["ingress"], line["admin"]) == ([f"127.0.0.1:{port}"], [f"127.0.0.1:{admin}"])
            assert line["policies"] == ["builtin-fallback"]  # no policies configured: the built-in one, by its name
    return proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}", lines


async def test_sigterm_drains_in_flight_streams_then_exits_0(tmp_path, make_engine, http) -> None:
    engine = await make_engine("gpu-0", gate=asyncio.Event())
    proc, url, admin, _ = await start_process(tmp_path, [engine], workers=1)
    try:
        resp = await http.post(url + "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 3})
        await resp.content.readuntil(b"\n\n")  # the stream is in flight
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):  # shutdown starts: the router logs how much it is draining
            while b"shutting down" not in (line := await proc.stderr.readline()):
                assert line
        assert json.loads(line)["in_flight"] == 1
        engine.gate.set()
        rest = await resp.content.read()
        assert rest.endswith(b"data: [DONE]\n\n")  # the in-flight stream finished whole
        resp.close()
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_multi_process_mode_shares_ports_and_aggregates_metrics(tmp_path, make_engine, http) -> None:
    engine = await make_engine("gpu-0")
    proc, url, admin, lines = await start_process(tmp_path, [engine], workers=2)
    try:
        worker_pids = next(line["pids"] for line in lines if line.get("msg") == "router workers started")
        assert len(worker_pids) == 2
        for _ in range(20):
            # A new connection each time, so the kernel can hand requests to either worker.
            async with http.post(url + "/v1/chat/completions", json=CHAT, headers={"Connection": "close"}) as resp:
                assert resp.status == 200
        async with http.get(admin + "/metrics") as resp:
            text = await resp.text()
        total = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith('fleetroute_requests_total{endpoint="gpu-0"')
        )
        assert total == 20  # whichever worker answered the scrape, it counted all workers' requests
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
        for pid in worker_pids:  # no worker left behind
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                continue
            raise AssertionError(f"worker {pid} still running")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
