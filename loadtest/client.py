"""A load client for OpenAI-compatible servers, open loop or closed loop.

Open loop (`run_open_loop`): requests leave at their planned times whether or not earlier ones have finished.
This is how independent users behave, and it is the only way to see a server's queueing: a closed loop slows
down with the server and hides it. The client notes how late it fired each request (`lateness`), so an
overloaded generator shows up in the results instead of passing for a slow server.

Closed loop (`run_closed_loop`): `concurrency` virtual users, each sending its next request as soon as its
previous one ends (a saturation test: what throughput does the server sustain at that concurrency).

Each request streams (SSE) and is timed: time to first token (the first event carrying text, not vLLM's
role-only opening chunk), the gaps between later text events (inter-token latency: one event is one token
for the simulator; a real vLLM that falls behind merges tokens into one event, so there it is per event),
end-to-end latency, output tokens (the server's final usage, which the client asks for, else the events
counted), the endpoint that served it (`x-fleetroute-endpoint`, where the router says), and the kind of error
if it failed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import orjson


@dataclass(frozen=True)
class PlannedRequest:
    at: float  # seconds after the start of the run
    path: str  # "/v1/chat/completions" or "/v1/completions"
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    prompt_tokens: int | None = None  # as the workload meant it (simulator tokens), for reports
    output_tokens: int | None = None
    priority: str | None = None

    def with_priority(self, cls: str, header: str = "x-priority") -> PlannedRequest:
        return replace(self, headers={**self.headers, header: cls}, priority=cls)


@dataclass
class Result:
    planned: PlannedRequest
    status: int = 0
    sent_at: float = 0.0  # seconds after the start of the run
    lateness: float = 0.0  # how much later than planned the client sent it (open loop)
    ttft: float | None = None
    e2e: float | None = None
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)  # gaps between consecutive tokens after the first
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
    # The final usage chunk (OpenAI's stream_options) gives the true output token count: a real vLLM merges
    # several tokens into one event when its API server falls behind, so counting events undercounts.
    body = {**planned.body, "stream": True, "stream_options": {"include_usage": True}}
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
                last_token = start
                reported: int | None = None  # usage.completion_tokens, when the server sends it
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
                        usage = event.get("usage")
                        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                            reported = usage["completion_tokens"]
                        if _has_text(event):
                            now = time.perf_counter()
                            if result.ttft is None:
                                result.ttft = now - start
                            else:
                                result.itl.append(now - last_token)
                            last_token = now
                            result.output_tokens += 1
                if not done:
                    result.error = "truncated"
                    return result
                result.e2e = time.perf_counter() - start
                if reported is not None:
                    result.output_tokens = reported
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
    # No session-wide timeout (aiohttp defaults to 5 minutes): each request has its own `timeout`.
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def fire(planned: PlannedRequest) -> Result:
            delay = t0 + planned.at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            sent = loop.time() - t0
            result = await send_one(session, base_url, planned, timeout)
            result.sent_at, result.lateness = sent, max(0.0, sent - planned.at)
            if on_done is not None:
                on_done(result)
            return result

        return list(await asyncio.gather(*(fire(p) for p in plan)))


async def run_closed_loop(
    base_url: str,
    plan: Sequence[PlannedRequest],
    *,
    concurrency: int,
    timeout: float = 120.0,
    on_done: Callable[[Result], None] | None = None,
) -> list[Result]:
    """`concurrency` users send the plan's requests in order, each as soon as its previous one ended
    (planned times are ignored); returns the results in plan order."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    results: list[Result | None] = [None] * len(plan)
    next_index = 0
    connector = aiohttp.TCPConnector(limit=0)
    # No session-wide timeout (aiohttp defaults to 5 minutes): each request has its own `timeout`.
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def user() -> None:
            nonlocal next_index
            while next_index < len(plan):
                index, next_index = next_index, next_index + 1
                sent = loop.time() - t0
                result = await send_one(session, base_url, plan[index], timeout)
                result.sent_at = sent
                results[index] = result
                if on_done is not None:
                    on_done(result)

        await asyncio.gather(*(user() for _ in range(min(concurrency, len(plan)))))
    return [r for r in results if r is not None]
