"""The event loop every `fleetroute` process runs on: the router, its worker processes, the agents and the
simulator (worker/ imports it from here, not from router.cli, which imports worker/ for its subcommands)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def run_event_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run on uvloop where installed (faster sockets), the standard loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
