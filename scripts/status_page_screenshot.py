"""Regenerate docs/img/status-page.png (the whole page, in docs/operations.md) and status-page-overview.png (its
top: the endpoints and the admission queue, in the README): the router's status page in front of a
`fleetroute demo` fleet.

    python scripts/status_page_screenshot.py            # about 2 minutes; needs Chromium (scripts/install-chromium.sh)
    python scripts/status_page_screenshot.py --out /tmp/page.png --seconds 60

What it shows, and how: the demo's fleet (2 x H100 and 2 x A100-80G simulated vLLM replicas, time scale 4, the
router collecting telemetry itself) behind one router with the realtime-chat preset (prefix-aware routing,
stickiness, admission with priority classes and a cap of 64 requests per replica), recording 5% of its routing
decisions. The demo's multi-turn chat workload arrives at 75% of the fleet's modelled capacity. 20 s before the
shot one A100 starts failing every request: outlier detection ejects it, and the three left run near their
capacity (admission queues, now and then sheds). Then headless Chromium opens the page (no admin token: the
demo's loopback setup), opens the newest explained pick, and saves a full-page screenshot. Every process it
starts is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest.client import run_open_loop  # noqa: E402
from loadtest.demo import DEFAULT_FLEET, DemoOptions, demo_scenario, free_port, parse_fleet, status_extra  # noqa: E402
from loadtest.fleet import Fleet, start_router, wait_for_telemetry  # noqa: E402
from loadtest.processes import ProcessGroup  # noqa: E402
from loadtest.runner import build_plan, modelled_capacity  # noqa: E402
from loadtest.scenario import Fault  # noqa: E402

FAULTY = "a100-80g-1"
POLICY = {"name": "realtime-chat", "models": ["*"], "preset": "realtime-chat"}
# As tests/browser.py launches it: root needs --no-sandbox; nothing may reach the network.
ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def overview(out: Path) -> Path:
    return out.with_name(out.stem + "-overview" + out.suffix)


async def shoot(url: str, out: Path) -> None:
    from playwright.async_api import async_playwright, expect

    executable = os.environ.get("FLEETROUTE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=executable, args=ARGS)
        page = await browser.new_page(viewport={"width": 1560, "height": 900})
        await page.goto(url)
        await expect(page.locator("tr[data-endpoint]")).to_have_count(4)
        await expect(page.locator(f'tr[data-endpoint="{FAULTY}"]')).to_have_attribute("data-state", "ejected")
        first = page.locator("#decisions details").filter(has=page.locator(".reason", has_text="prefix")).first
        await first.locator("summary").click()
        await expect(first.locator(".record table")).to_be_visible()
        await page.wait_for_timeout(1200)  # one more poll, so the sparklines end at the same second
        out.parent.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(out), full_page=True)
        model = await page.locator("section.model").bounding_box()
        width = await page.evaluate("document.documentElement.scrollWidth")
        assert model is not None
        await page.screenshot(path=str(overview(out)), full_page=True,
                              clip={"x": 0, "y": 0, "width": width, "height": model["y"] + model["height"] + 12})
        await browser.close()


async def main(out: Path, seconds: float) -> None:
    opts = DemoOptions(fleet=parse_fleet(DEFAULT_FLEET), duration=seconds + 30, load=0.75, policies=("adaptive",))
    scenario = demo_scenario(opts)
    spec = replace(scenario.fleet, faults=(Fault(FAULTY, 1.0),))  # a no-op fault: its /sim/faults is enabled
    rate = opts.load * modelled_capacity(scenario)
    plan = [replace(p, at=p.at * opts.time_scale) for p in build_plan(scenario, rate)]
    group = ProcessGroup()
    try:
        fleet = Fleet(spec, group, seed=opts.seed)
        await fleet.start()
        _, ingress, admin = await start_router(fleet, POLICY, status_extra(free_port()))
        await wait_for_telemetry(admin, len(fleet.urls), timeout=30)
        print(f"status page: {admin}/status; {rate / opts.time_scale:.1f} req/s for {seconds:g} s", file=sys.stderr)
        load = asyncio.create_task(run_open_loop(ingress, plan, timeout=60 * opts.time_scale))
        try:
            await asyncio.sleep(seconds - 20)
            async with aiohttp.ClientSession() as http, http.post(fleet.urls[FAULTY] + "/sim/faults",
                                                                  json={"error_rate": 1.0}) as resp:
                resp.raise_for_status()
            await asyncio.sleep(20)
            await shoot(admin + "/status", out)
        finally:
            load.cancel()
            await asyncio.gather(load, return_exceptions=True)
    finally:
        await group.stop_all()
    print(f"wrote {out} and {overview(out)}", file=sys.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "status-page.png")
    parser.add_argument("--seconds", type=float, default=75.0, help="seconds of load before the shot (default 75)")
    args = parser.parse_args()
    asyncio.run(main(args.out, args.seconds))
