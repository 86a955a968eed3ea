"""Active health checks: probe each endpoint on an interval, independent of traffic.

A probe is `GET /health` (vLLM answers 200 once the model is loaded); with `probeRequest: true` it is also
a 1-token completion, which catches an engine whose HTTP server answers while its engine loop is wedged.
`unhealthyThreshold` failed probes in a row mark the endpoint unhealthy, `healthyThreshold` passing probes
in a row mark it healthy again (then it ramps up through slow start). Endpoints start healthy: a router
restart must not empty a working fleet while the first probes run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp

from router.model import Endpoint


@dataclass(frozen=True)
class ActiveHealthSettings:
    enabled: bool = True
    interval: float = 5.0
    timeout: float = 2.0
    path: str = "/health"
    healthy_threshold: int = 2
    unhealthy_threshold: int = 3
    probe_request: bool = False


@dataclass
class _Track:
    healthy: bool = True
    passes: int = 0
    fails: int = 0
    last_error: str = ""


class ActiveHealth:
    def __init__(self, settings: ActiveHealthSettings) -> None:
        self.settings = settings
        self._tracks: dict[str, _Track] = {}

    def healthy(self, endpoint_id: str) -> bool:
        track = self._tracks.get(endpoint_id)
        return track is None or track.healthy

    def last_error(self, endpoint_id: str) -> str:
        track = self._tracks.get(endpoint_id)
        return track.last_error if track is not None else ""

    def observe(self, endpoint_id: str, ok: bool, error: str = "") -> bool | None:
        """Count one probe result; returns the new health if it flipped."""
        track = self._tracks.setdefault(endpoint_id, _Track())
        s = self.settings
        if ok:
            track.passes, track.fails = track.passes + 1, 0
            if not track.healthy and track.passes >= s.healthy_threshold:
                track.healthy = True
                return True
        else:
            track.passes, track.fails, track.last_error = 0, track.fails + 1, error
            if track.healthy and track.fails >= s.unhealthy_threshold:
                track.healthy = False
                return False
        return None

    def forget(self, endpoint_id: str) -> None:
        self._tracks.pop(endpoint_id, None)

    async def probe(self, session: aiohttp.ClientSession, endpoint: Endpoint,
                    headers: Mapping[str, str] | None = None) -> tuple[bool, str]:
        """`headers` go with the probe request (e.g. the engines' API key)."""
        s = self.settings
        timeout = aiohttp.ClientTimeout(total=s.timeout)
        try:
            async with session.get(endpoint.url + s.path, timeout=timeout) as resp:
                await resp.read()
                if resp.status != 200:
                    return False, f"{s.path} answered {resp.status}"
            if s.probe_request:
                status = await probe_completion(session, endpoint, s.timeout, headers)
                if status != 200:
                    return False, f"probe completion answered {status}"
        except (TimeoutError, aiohttp.ClientError) as exc:
            return False, describe(exc)
        return True, ""


async def probe_completion(session: aiohttp.ClientSession, endpoint: Endpoint, timeout: float,
                           headers: Mapping[str, str] | None = None) -> int:
    """A 1-token completion (`prompt: "ping"`, the endpoint's first model), which only an engine whose loop runs
    can answer; returns its status. Raises TimeoutError or aiohttp.ClientError."""
    body = {"model": endpoint.models[0], "prompt": "ping", "max_tokens": 1}
    async with session.post(endpoint.url + "/v1/completions", json=body, headers=headers,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        await resp.read()
        return resp.status


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
