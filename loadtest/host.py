"""This machine's processes, as the benchmarks see them through /proc (Linux): free ports, process trees,
their CPU time, and pinning a whole tree to cores. One place, so every benchmark measures the same way."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A free 127.0.0.1 port (the OS picks it; the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def pgid(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[2]) if fields else None


def descendants(pid: int) -> list[int]:
    """`pid` and every live process below it."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))):
            parent[int(entry)] = int(fields[1])
    out, frontier = [pid], [pid]
    while frontier:
        frontier = [child for child, ppid in parent.items() if ppid in frontier]
        out.extend(frontier)
    return out


def cpu_seconds(pid: int) -> float:
    """utime+stime of `pid` and every live descendant (router workers, nginx workers), in seconds."""
    total = 0
    for p in descendants(pid):
        fields = _stat(p)
        if fields:
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / CLK_TCK


def busy_seconds() -> float:
    """CPU time spent by everything on the machine (user+nice+system+irq+softirq, all cores), in seconds."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / CLK_TCK


def pin_tree(pid: int, cpus: set[int]) -> bool:
    """Pin every thread of `pid` and of its descendants to `cpus`; False where the machine cannot (no such
    cores, or not Linux)."""
    if not hasattr(os, "sched_setaffinity") or not cpus or max(cpus) >= (os.cpu_count() or 1):
        return False
    for process in descendants(pid):
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{process}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), cpus)
    return True
