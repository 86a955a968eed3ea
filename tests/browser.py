"""A real headless browser for tests: the operating system's Chromium, driven by Playwright for Python.

Playwright's own browser download (`playwright install`) is never used: the tests launch the Chromium the OS
packages (Debian's `chromium`, which `scripts/install-chromium.sh` installs, as CI does), or the one
`FLEETROUTE_CHROMIUM` names. If neither Playwright nor a Chromium can be had the tests FAIL with what to do,
rather than skip: a status page nobody has seen load in a browser is not tested (like tests/helm_binary.py).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from playwright.async_api import Browser, Page

CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome")
# Root needs --no-sandbox; the rest keep a headless run quiet and local (no update checks, no sync, no GPU).
ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium_executable() -> str:
    named = os.environ.get("FLEETROUTE_CHROMIUM")
    if named:
        if not os.access(named, os.X_OK):
            pytest.fail(f"FLEETROUTE_CHROMIUM={named} is not an executable file")
        return named
    for candidate in CANDIDATES:
        found = shutil.which(candidate)
        if found:
            return found
    pytest.fail("no Chromium found (looked for /usr/bin/chromium, chromium, chromium-browser, google-chrome): run "
                "scripts/install-chromium.sh (as root it installs Debian's chromium package), or set "
                "FLEETROUTE_CHROMIUM to a Chromium or Chrome executable")


@asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        pytest.fail("Playwright for Python is not installed: pip install -e '.[test]' (no `playwright install`: "
                    "the tests use the OS's Chromium)")
    executable = chromium_executable()
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=executable, args=ARGS)
        try:
            yield browser
        finally:
            await browser.close()


class Watch:
    """What a page did: console errors and uncaught exceptions, and the URL of every request it made."""

    def __init__(self, page: Page) -> None:
        self.errors: list[str] = []
        self.requests: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda exc: self.errors.append(f"uncaught: {exc}"))
        page.on("request", lambda request: self.requests.append(request.url))

    def _console(self, message: Any) -> None:
        if message.type == "error":
            self.errors.append(message.text)
