"""`fleetroute demo`, the README's first command, run as a user would: it prints the comparison table and
leaves no process behind, also when interrupted."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys

import aiohttp


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:  # a zombie is dead for our purposes
        return fh.read().split()[2] != "Z"


async def _start_demo(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "demo", "--fleet", "h100:1,a100-80g:1", "--time-scale", "2", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )


async def _until(proc: asyncio.subprocess.Process, prefix: str) -> tuple[str, list[str]]:
    """The first stderr line starting with `prefix`, and the lines before it."""
    before = []
    async with asyncio.timeout(60):
        while True:
            line = (await proc.stderr.readline()).decode()
            assert line, f"demo exited before printing {prefix!r}"
            if line.startswith(prefix):
                return line, before
            before.append(line)


async def _child_pids(proc: asyncio.subprocess.Process) -> list[int]:
    line, _ = await _until(proc, "fleet ready")
    return [int(p) for p in re.search(r"pids ([\d ]+)", line).group(1).split()]


async def test_demo_prints_a_row_per_policy_and_cleans_up() -> None:
    proc = await _start_demo("--duration", "2", "--policies", "round-robin,adaptive")
    line, before = await _until(proc, "fleet ready")
    pids = [int(p) for p in re.search(r"pids ([\d ]+)", line).group(1).split()]
    assert len(pids) == 2
    # The status page's URL comes first; each policy's router serves it there, naming the policy.
    url = re.search(r"status page: (http://127\.0\.0\.1:\d+/status)", before[0]).group(1)
    line, _ = await _until(proc, "routing with round-robin: status page ")
    assert line.split()[-1] == url
    async with aiohttp.ClientSession() as http, http.get(url + "/feed") as resp:
        feed = await resp.json()
    (model,) = feed["models"]
    assert model["policy"]["strategy"] == "round-robin" and len(model["endpoints"]) == 2
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0
    table = out.decode()
    for policy in ("round-robin", "adaptive"):
        row = next(line for line in table.splitlines() if line.startswith(policy))
        fields = row.split()
        assert float(fields[1]) > 0  # requests/s
        assert "h100-0=" in row and "a100-80g-0=" in row  # per-replica utilisation
    assert "TTFT p50" in table and "util CV" in table
    assert not [pid for pid in pids if _alive(pid)]


async def test_interrupted_demo_stops_every_child() -> None:
    proc = await _start_demo("--duration", "30")
    pids = await _child_pids(proc)
    proc.send_signal(signal.SIGINT)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 130
    assert b"interrupted" in err and b"Traceback" not in err
    assert not [pid for pid in pids if _alive(pid)]
