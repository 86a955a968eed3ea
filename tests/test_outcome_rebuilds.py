"""A request outcome that ejects an endpoint takes effect for the very next pick, without the reporting request
paying for a rebuild; the pools it touched are rebuilt once, on the next turn of the event loop, however many
outcomes arrived before then (router/routing/balancer.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from router.config.settings import parse_settings
from router.model import RequestInfo
from router.server.app import build_context
from router.server.context import RouterContext

MODELS = ("m-a", "m-b")


def _context(endpoints: int = 4, panic_threshold: int = 0) -> RouterContext:
    config: dict[str, Any] = {
        "endpoints": [{"id": f"gpu-{i}", "url": f"http://127.0.0.1:{9 + i}", "models": list(MODELS)}
                      for i in range(endpoints)],
        # maxEjectionPercent 100: every ejection this test asks for is allowed.
        "policies": [{"name": "default", "strategy": "round-robin",
                      "outlierDetection": {"consecutiveFailures": 1, "maxEjectionPercent": 100},
                      "panicThreshold": panic_threshold}],
        "telemetry": {"enabled": False},
        "redis": {"url": None},
    }
    return build_context(parse_settings(config))


def _picks(ctx: RouterContext, model: str, n: int) -> set[str]:
    out = set()
    for i in range(n):
        view = ctx.balancer.pick(RequestInfo(model=model, request_id=str(i), headers={}, body={}))
        assert view is not None
        out.add(view.id)
    return out


def _fail(ctx: RouterContext, endpoint_id: str, model: str = "m-a") -> None:
    spec = ctx.balancer.policy_for(model)
    ctx.balancer.report_outcome(spec, model, endpoint_id, False, "connect", probe=False)


def _rebuilds(ctx: RouterContext) -> float:
    return ctx.metrics.rebuilds._value.get()


async def test_an_ejection_is_avoided_at_once_and_its_pools_rebuilt_once_on_the_next_loop_turn() -> None:
    ctx = _context()
    before = _rebuilds(ctx)
    # A correlated outage: three outcomes in the same turn of the loop eject three endpoints.
    for endpoint_id in ("gpu-0", "gpu-1", "gpu-2"):
        _fail(ctx, endpoint_id)
    assert _rebuilds(ctx) == before  # none of the three requests rebuilt anything
    # ...yet no pick, for either model the policy routes, chooses an ejected endpoint.
    assert _picks(ctx, "m-a", 8) == {"gpu-3"}
    assert _picks(ctx, "m-b", 8) == {"gpu-3"}
    assert {v.id for v in ctx.balancer.candidates("m-a")} == {"gpu-3"}
    assert not ctx.balancer.has_alternative("m-a", frozenset({"gpu-3"}))
    await asyncio.sleep(0)  # one turn of the loop: the coalesced rebuild runs
    assert _rebuilds(ctx) == before + 1
    assert _picks(ctx, "m-a", 8) == {"gpu-3"}  # and the rebuilt pools leave them out for good
    assert ctx.balancer.pool_report("m-a")["left_out"] == {"gpu-0": "ejected", "gpu-1": "ejected",
                                                           "gpu-2": "ejected"}


async def test_an_ejection_that_would_start_panic_mode_is_left_to_the_panic_rule() -> None:
    # Panic at under 50% healthy: ejecting 2 of 4 is held out at once, a third is not (the rebuild then routes
    # to all four, as panic mode does for any exclusion).
    ctx = _context(endpoints=4, panic_threshold=50)
    _fail(ctx, "gpu-0")
    _fail(ctx, "gpu-1")
    assert _picks(ctx, "m-a", 8) == {"gpu-2", "gpu-3"}
    _fail(ctx, "gpu-2")
    await asyncio.sleep(0)
    assert ctx.balancer.pool_report("m-a")["panic"] is True
    assert _picks(ctx, "m-a", 8) == {"gpu-0", "gpu-1", "gpu-2", "gpu-3"}


async def test_the_last_routable_endpoint_is_never_held_out() -> None:
    ctx = _context(endpoints=2)
    _fail(ctx, "gpu-0")
    _fail(ctx, "gpu-1")
    assert _picks(ctx, "m-a", 4) == {"gpu-1"}


def test_without_a_running_loop_the_rebuild_happens_at_once() -> None:
    ctx = _context()
    before = _rebuilds(ctx)
    _fail(ctx, "gpu-0")
    assert _rebuilds(ctx) == before + 1
    assert "gpu-0" not in _picks(ctx, "m-a", 8)
