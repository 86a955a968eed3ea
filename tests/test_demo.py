"""`fleetroute demo`, the README's first command, run as a user would: it prints the comparison table and
leaves no process behind, also when interrupted."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys


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


async def _child_pids(proc: asyncio.subprocess.Process) -> list[int]:
    async with asyncio.timeout(60):
        while True:
            line = (await proc.stderr.readline()).decode()
            assert line, "demo exited before its fleet was ready"
            if line.startswith("fleet ready"):
                return [int(p) for p in re.search(r"pids ([\d ]+)", line).group(1).split()]


async def test_demo_prints_a_row_per_policy_and_cleans_up() -> None:
    proc = await _start_demo("--duration", "2", "--policies", "round-robin,adaptive")
    pids = await _child_pids(proc)
    assert len(pids) == 2
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
