"""An open-loop load client for OpenAI-compatible servers: requests leave at their planned times whether or
not earlier ones have finished (a closed loop would slow down with the server and hide its queueing).

Each request streams (SSE) and is timed: time to first token (the first event carrying text, not vLLM's
role-only opening chunk), end-to-end latency, output tokens, the endpoint that served it
(`x-fleetroute-endpoint`), and the kind of error if it failed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson


@dataclass(frozen=True)
class PlannedRequest:
    at: float  # seconds after the start of the run
    path: str  # "/v1/chat/completions" or "/v1/completions"
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Result:
    planned: PlannedRequest
    status: int = 0
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    endpoint: str = ""
    # None on success; else http_<status>, connect, timeout, truncated (cut without [DONE]) or stream_error
    # (an error event after some tokens: the stream broke midway, which no router may retry)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _has_text(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def send_one(session: aiohttp.ClientSession, base_url: str, planned: PlannedRequest,
                   timeout: float) -> Result:
    result = Result(planned)
    body = {**planned.body, "stream": True}
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with session.post(base_url + planned.path, data=orjson.dumps(body),
                                    headers={"Content-Type": "application/json", **planned.headers}) as resp:
                result.status = resp.status
                result.endpoint = resp.headers.get("x-fleetroute-endpoint", "")
                if resp.status != 200:
                    await resp.read()
                    result.error = f"http_{resp.status}"
                    return result
                done = False
                buffer = b""
                async for chunk in resp.content.iter_any():
                    buffer += chunk
                    while b"\n\n" in buffer:
                        raw, buffer = buffer.split(b"\n\n", 1)
                        if not raw.startswith(b"data: "):
                            continue
                        data = raw[6:]
                        if data == b"[DONE]":
                            done = True
                            continue
                        event = orjson.loads(data)
                        if "error" in event:  # the router ended a broken stream with an error event
                            result.error = "stream_error"
                            return result
                        if _has_text(event):
                            if result.ttft is None:
                                result.ttft = time.perf_counter() - start
                            result.output_tokens += 1
                if not done:
                    result.error = "truncated"
                    return result
                result.e2e = time.perf_counter() - start
    except TimeoutError:
        result.error = "timeout"
    except aiohttp.ClientConnectorError:
        result.error = "connect"
    except (aiohttp.ClientError, orjson.JSONDecodeError) as exc:
        result.error = type(exc).__name__
    return result


async def run_open_loop(
    base_url: str,
    plan: Sequence[PlannedRequest],
    *,
    timeout: float = 120.0,
    on_done: Callable[[Result], None] | None = None,
) -> list[Result]:
    """Send every planned request at its time; return the results in plan order."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def fire(planned: PlannedRequest) -> Result:
            delay = t0 + planned.at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            result = await send_one(session, base_url, planned, timeout)
            if on_done is not None:
                on_done(result)
            return result

        return list(await asyncio.gather(*(fire(p) for p in plan)))
