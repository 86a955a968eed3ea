"""Multi-process mode: N router processes sharing the listen and admin ports (SO_REUSEPORT).

One Python process uses one core; a router pod with several cores runs `workers: N` processes, and the
kernel spreads incoming connections across them. Each worker is a complete router (its own upstream pool,
telemetry and in-flight counts); `/metrics` on the admin port aggregates all workers through
prometheus-client's multi-process mode, whichever worker answers the scrape.

The supervisor forwards SIGTERM/SIGINT to the workers and waits for them to drain. If a worker dies on
its own, the supervisor stops the others and exits non-zero, so Kubernetes restarts the pod rather than
running on with fewer cores than it was sized for.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from multiprocessing.connection import wait

from router.config.settings import Settings

log = logging.getLogger("fleetroute.workers")


def _worker_main(settings: Settings, index: int, config_path: str | None) -> None:
    from router.runtime.logs import configure_logging
    from router.runtime.loop import run_event_loop
    from router.server.app import serve

    configure_logging(settings.log_level)
    logging.getLogger().handlers[0].addFilter(_WorkerTag(index))
    run_event_loop(serve(settings, reuse_port=True, config_path=config_path))


class _WorkerTag(logging.Filter):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.index
        return True


def run_workers(settings: Settings, config_path: str | None = None) -> int:
    metrics_dir = tempfile.mkdtemp(prefix="fleetroute-metrics-")
    # Must be in the environment before a worker imports prometheus_client (spawned workers start fresh).
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    spawn = multiprocessing.get_context("spawn")
    procs = [
        spawn.Process(target=_worker_main, args=(settings, i, config_path), name=f"fleetroute-worker-{i}")
        for i in range(settings.workers)
    ]
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    def forward_reload(signum: int, _frame: object) -> None:
        for p in procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signal.SIGHUP)  # each worker re-reads the config file itself

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGHUP, forward_reload)
    try:
        for p in procs:
            p.start()
        log.info("router workers started", extra={"workers": settings.workers, "pids": [p.pid for p in procs]})
        failed = False
        alive = {p.sentinel: p for p in procs}
        while alive:
            for sentinel in wait(list(alive)):
                p = alive.pop(sentinel)
                p.join()
                if p.exitcode != 0 and not stopping and not failed:
                    failed = True
                    log.error("router worker died; stopping the others", extra={"pid": p.pid, "exitcode": p.exitcode})
                    forward(signal.SIGTERM, None)
        return 1 if failed else 0
    finally:
        deadline = time.monotonic() + settings.shutdown_grace + 5
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
        shutil.rmtree(metrics_dir, ignore_errors=True)
