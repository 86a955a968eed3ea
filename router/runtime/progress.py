"""A condition that waiters can re-check whenever a background loop makes observable progress.

`notify()` wakes everyone waiting; `wait_for(predicate)` returns once the predicate holds, re-checking it
after each notification. Tests and start-up code use it to wait for a watch to apply an event instead of
sleeping.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Progress:
    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        done, self._event = self._event, asyncio.Event()
        done.set()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        while True:
            event = self._event  # taken before the check, so a notify in between is not missed
            if predicate():
                return
            await event.wait()
