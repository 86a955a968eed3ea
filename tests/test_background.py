"""Background loops (router/runtime/background.py `contained`): a failed step is counted and the loop goes on,
and a cancellation ends the loop even when a library turned it into an error or swallowed it."""

from __future__ import annotations

import asyncio

from router.runtime.background import contained
from router.runtime.metrics import RouterMetrics


async def _loop(step, metrics: RouterMetrics, steps: list[int]) -> None:
    while True:
        with contained("test", metrics):
            await step()
        steps.append(1)
        await asyncio.sleep(0)


async def test_a_failed_step_is_counted_and_the_loop_goes_on() -> None:
    metrics, steps = RouterMetrics(), []

    async def fails() -> None:
        raise ValueError("a bug")

    task = asyncio.create_task(_loop(fails, metrics, steps))
    while len(steps) < 3:
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()
    assert (metrics.registry.get_sample_value("fleetroute_background_errors_total", {"task": "test"}) or 0) >= 3


async def test_a_cancellation_a_library_turned_into_an_error_or_swallowed_still_ends_the_loop() -> None:
    # redis-py, cancelled while it waits on a socket, may raise a connection error instead, or return normally;
    # the loop used to log it, sleep, and go on forever (a router's shutdown hung on its housekeeping task).
    for swallow in ("as_error", "silently"):
        metrics, steps = RouterMetrics(), []
        started = asyncio.Event()

        async def library_call(swallow: str = swallow, started: asyncio.Event = started) -> None:
            started.set()
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if swallow == "as_error":
                    raise ConnectionError("connection reset while reading") from None

        task = asyncio.create_task(_loop(library_call, metrics, steps))
        await started.wait()
        task.cancel()
        async with asyncio.timeout(5):
            await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled(), swallow
        assert steps == [], swallow  # the step after the cancelled one never ran
