"""How late the event loop runs what it was asked to run: the router's one shared resource.

Every request, stream chunk, health probe and telemetry read runs on one event loop per process. When a
callback hogs it (a large JSON body parsed, thousands of streams each writing a chunk in the same instant),
everything else waits, and no per-request latency metric says why. A probe task sleeps `interval` seconds
again and again; each wake-up later than asked is the loop's scheduling delay at that moment (Node.js's
`monitorEventLoopDelay` and Envoy's watchdog "mega-miss" measure the same thing).

`fleetroute_event_loop_lag_seconds` (histogram) holds every sample; a sample above 100 ms is a stall a
streaming client notices as a pause between tokens. The probe itself costs one timer wake-up every 100 ms.
"""

from __future__ import annotations

import asyncio

from router.runtime.metrics import RouterMetrics

INTERVAL = 0.1  # seconds between two samples


async def watch_loop_lag(metrics: RouterMetrics, interval: float = INTERVAL) -> None:
    """Sample the loop's scheduling delay forever (a cleanup_ctx task; cancelled at shutdown)."""
    loop = asyncio.get_running_loop()
    histogram = metrics.event_loop_lag
    while True:
        asked = loop.time() + interval
        await asyncio.sleep(interval)
        histogram.observe(max(0.0, loop.time() - asked))
