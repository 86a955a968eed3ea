"""The endpoint picker's CPU per decision, version against version, through real Envoy (issue #18's target:
at or below 0.15 ms).

    python -m loadtest.epp_cpu --baseline /tmp/epp-base --runs 6          # the baseline tree vs this one
    python -m loadtest.epp_cpu --baseline /tmp/epp-base --profile /tmp/prof --runs 1   # each picker under cProfile

Each variant is a `fleetroute epp` (from its own source tree: `--baseline DIR` is another checkout, e.g.
`git archive <commit> router | tar -x -C DIR`) behind its own Envoy (this tree's loadtest/envoy.py bootstrap,
`--concurrency 1`), with the router-overhead benchmark's config, backend and closed-loop load
(loadtest/router_overhead.py: 2 zero-latency endpoints, `--concurrency` clients, short non-streamed
completions). The variants are measured in turn within each run, so a slow spell of a shared machine hits
them alike, and each run whose foreign CPU passed `--foreign-limit` is repeated (within a budget) or flagged.
Per run and variant: requests, req/s, the picker's CPU per request (utime+stime from /proc: every decision is
one request) and Envoy's. The JSON (raw runs and medians) goes to `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest import envoy
from loadtest.host import cpu_seconds, free_port
from loadtest.router_overhead import (
    ROOT,
    Meter,
    Proc,
    RouterConfig,
    http_ok,
    pinned,
    start_backend,
    throughput,
    write_router_config,
)


@dataclass
class Variant:
    label: str
    root: Path  # the source tree whose `router` package the picker runs
    epp: Proc
    envoy: Proc
    url: str


@contextlib.contextmanager
def variant(label: str, root: Path, ports: list[int], workdir: Path, cpus: str | None,
            profile: Path | None = None) -> Iterator[Variant]:
    grpc_port, admin = free_port(), free_port()
    config = write_router_config(RouterConfig(label, cpus=cpus), ports, workdir, free_port(), admin)
    run = ["-m", "cProfile", "-o", str(profile)] if profile is not None else []
    cmd = [sys.executable, *run, "-m", "router", "epp", "--config", str(config), "--host", "127.0.0.1",
           "--port", str(grpc_port)]
    log = workdir / f"epp-{label}.log"
    env = {**os.environ, "PYTHONPATH": str(root)}
    with log.open("wb") as err:
        epp = Proc(f"epp-{label}", subprocess.Popen(pinned(cmd, cpus), stdout=subprocess.DEVNULL, stderr=err,
                                                    cwd=root, env=env, start_new_session=True))
    procs = [epp]
    try:
        deadline = time.monotonic() + 60
        while not ('"endpoint picker listening"' in log.read_text() and http_ok(f"http://127.0.0.1:{admin}/readyz")):
            if epp.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"fleetroute epp ({label}) did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        binary = envoy.envoy_binary()
        if binary is None:
            raise RuntimeError(envoy.MISSING)
        path, admin_path = envoy.write_config(envoy.bootstrap(grpc_port, [envoy.Listener("main", port=free_port())]),
                                              workdir, f"envoy-{label}")
        out = workdir / f"envoy-{label}.log"
        with out.open("wb") as f:
            proxy = Proc(f"envoy-{label}", subprocess.Popen(envoy.command(binary, path, admin_path, cpus=cpus),
                                                            stdout=f, stderr=subprocess.STDOUT, cwd=workdir,
                                                            start_new_session=True))
        procs.append(proxy)
        state = envoy.wait_ready_blocking(proxy.popen, admin_path, out)
        yield Variant(label, root, epp, proxy, state["listeners"]["main"])
    finally:
        for p in reversed(procs):  # Envoy first: the picker's streams end with it
            p.stop()


def profile_path(folder: Path | None, label: str) -> Path | None:
    if folder is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{label.replace(' ', '-')}.prof"


def git_commit(root: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "router"], capture_output=True, text=True, cwd=root)
    if done.returncode != 0:
        return "not a git checkout"
    return done.stdout.strip() + ("+dirty router/" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="another source tree: its picker is measured beside this one")
    parser.add_argument("--baseline-label", default="baseline")
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per throughput run")
    parser.add_argument("--concurrency", type=int, default=16, help="closed-loop clients")
    parser.add_argument("--router-cpus", default=None, help="taskset list for the pickers and Envoys (default 0)")
    parser.add_argument("--load-cpus", default=None, help="taskset list for the backend and the load (default 1)")
    parser.add_argument("--foreign-limit", type=float, default=0.25)
    parser.add_argument("--profile", type=Path, help="a folder: each picker runs under cProfile, writing <label>.prof "
                        "there (profiled CPU is inflated: compare profiles with profiles)")
    parser.add_argument("--out", type=Path, help="the JSON (default loadtest/results/epp-cpu-<time>.json)")
    args = parser.parse_args(argv)
    n = os.cpu_count() or 1
    args.router_cpus = args.router_cpus or ("0" if n >= 2 else None)
    args.load_cpus = args.load_cpus or ("1" if n >= 2 else None)
    args.client = "wrk" if subprocess.run(["sh", "-c", "command -v wrk"], capture_output=True).returncode == 0 \
        else "python"
    say = print
    meter = Meter(retry_budget=30.0, wait_budget=60.0)
    raw: dict[str, list[dict[str, Any]]] = {}
    trees = [(args.label, ROOT)] + ([(args.baseline_label, args.baseline.resolve())] if args.baseline else [])
    with tempfile.TemporaryDirectory(prefix="epp-cpu-") as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        backend, ports = start_backend(args.load_cpus, 16, 1.0)
        stack.callback(backend.stop)
        variants = [stack.enter_context(variant(label, root, ports, workdir, args.router_cpus,
                                                profile_path(args.profile, label)))
                    for label, root in trees]
        meter.pids = [backend.pid, *(p for v in variants for p in (v.epp.pid, v.envoy.pid))]
        warm = argparse.Namespace(**{**vars(args), "duration": 1.0})
        for v in variants:
            throughput(v.url, warm, workdir)
        for i in range(args.runs):
            order = variants if i % 2 == 0 else list(reversed(variants))  # alternate who goes first
            for v in order:
                r = meter.measure(lambda v=v: throughput(v.url, args, workdir, cpu_of=(v.epp.pid, v.envoy.pid),
                                                         parts={"epp": v.epp.pid, "envoy": v.envoy.pid}),
                                  2, args.foreign_limit, say)
                raw.setdefault(v.label, []).append({**r, "run": i})
                say(f"run {i + 1} {v.label}: {r['rps']:.0f} req/s, picker {r['epp_cpu_ms_per_req']:.3f} ms/decision, "
                    f"Envoy {r['envoy_cpu_ms_per_req']:.3f} ms/req, foreign {r['foreign_cpu_util']:.0%}")
        epp_cpu = {v.label: cpu_seconds(v.epp.pid) for v in variants}
    summary = {label: {key: statistics.median(x[key] for x in runs)
                       for key in ("rps", "epp_cpu_ms_per_req", "envoy_cpu_ms_per_req", "foreign_cpu_util")}
               | {"epp_cpu_ms_per_req_min": min(x["epp_cpu_ms_per_req"] for x in runs),
                  "epp_cpu_ms_per_req_max": max(x["epp_cpu_ms_per_req"] for x in runs)}
               for label, runs in raw.items()}
    out = {"command": "python -m loadtest.epp_cpu " + " ".join(argv if argv is not None else sys.argv[1:]),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "trees": {label: {"path": str(root), "commit": git_commit(root)} for label, root in trees},
           "envoy": envoy.envoy_version(envoy.envoy_binary() or Path("envoy")),
           "client": args.client, "concurrency": args.concurrency, "duration_s": args.duration,
           "router_cpus": args.router_cpus, "load_cpus": args.load_cpus, "nproc": n,
           "picker_total_cpu_s": epp_cpu, "summary": summary, "runs": raw}
    path = args.out or ROOT / "loadtest" / "results" / f"epp-cpu-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    for label, s in summary.items():
        say(f"{label}: median picker CPU {s['epp_cpu_ms_per_req']:.3f} ms per decision "
            f"({s['epp_cpu_ms_per_req_min']:.3f}-{s['epp_cpu_ms_per_req_max']:.3f}), Envoy "
            f"{s['envoy_cpu_ms_per_req']:.3f} ms/req, {s['rps']:.0f} req/s")
    say(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
