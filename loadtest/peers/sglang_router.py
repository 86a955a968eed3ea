"""SGLang's Rust router (`sglang-router` on PyPI; now the "smg" gateway), HTTP regular mode.

Command line: `python -m sglang_router.launch_router --host 127.0.0.1 --port P --worker-urls U1 U2 ...
--policy POLICY --prometheus-host 127.0.0.1 --prometheus-port Q --worker-startup-check-interval 1`; the rest
is the shipped default (`--backend sglang`: HTTP pass-through of /v1/*; 5 retries; circuit breaker; request
log at INFO, two lines a request). Its defaults bind 0.0.0.0 for both the API and the metrics: both are
pinned to loopback here. `--prometheus-port` must be set (29000 collides between instances).

What it asks of the workers (seen with a logging proxy in front of `fleetroute sim`):
- at registration, first an HTTP/2 prior-knowledge probe (the gRPC connection mode; aiohttp, like vLLM's
  uvicorn, rejects it and the router falls back to HTTP/1.1), then `GET /server_info`, `/get_server_info`,
  `/model_info`, `/get_model_info`: SGLang-runtime endpoints. vLLM serves `/server_info` only with
  VLLM_SERVER_DEV_MODE=1 and none of the others, so the worker registers with model id "unknown" and
  `/v1/models` on the router lists "unknown"; requests are routed whatever their `model` (non-IGW mode);
- `GET /health` (health checks), `GET /get_load` every 30 s (SGLang-only, 404: "No loads fetched from
  workers"; power_of_two then compares the router's own in-flight counts).

Registration runs in the background after the port opens, so readiness is `GET /readiness` reporting every
worker healthy, not the port answering. `manual` (sticky routing on the `x-smg-routing-key` header) is left
out: the comparison's affinity workload sends `x-session-id`, which this router does not read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from loadtest.host import free_port
from loadtest.peers.base import (
    LaunchPlan,
    PeerInfo,
    PipInstall,
    ReadyProbe,
    check_backends,
)

INFO = PeerInfo(
    name="sglang-router",
    policies=("cache_aware", "power_of_two", "round_robin", "random"),
    summary="SGLang's Rust router (PyPI sglang-router, the smg gateway), HTTP mode",
    install="loadtest/peers/install-sglang-router.sh",
    policy_notes={
        "cache_aware": "approximate radix tree of the request text routed to each worker; best match above "
                       "cache-threshold 0.3, else the worker with the smallest tree; least-load when imbalance "
                       "exceeds 64 requests and 1.5x",
        "power_of_two": "two random workers, the one with fewer of the router's in-flight requests "
                        "(/get_load is polled but vLLM does not serve it)",
        "round_robin": "each request to the next worker in turn",
        "random": "a uniformly random worker",
    },
    min_backends={"power_of_two": 2},
)
INSTALL = PipInstall(INFO, dist="sglang-router", program="python")
unavailable_reason = INSTALL.unavailable_reason
version = INSTALL.version
python = INSTALL.executable


def all_workers_healthy(count: int) -> Callable[[int, bytes], str | None]:
    def check(status: int, body: bytes) -> str | None:
        try:
            state = json.loads(body)
        except ValueError:
            return f"answered {status} {body[:200]!r}"
        healthy = state.get("healthy_workers") if isinstance(state, dict) else None
        if status == 200 and healthy == count:
            return None
        return f"answered {status}, {healthy} of {count} workers healthy"

    return check


def plan(policy: str, backends: Sequence[tuple[str, str]], model: str, *, port: int, root: Path,
         workdir: Path, workers: int | None = None) -> LaunchPlan:
    check_backends(INFO, policy, backends)
    argv = (
        str(python(root)), "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *(url.rstrip("/") for _, url in backends),
        "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--worker-startup-check-interval", "1",
    )
    env = {"TOKIO_WORKER_THREADS": str(workers)} if workers else {}
    return LaunchPlan(argv=argv, port=port, env=env, probe=ReadyProbe("/readiness", all_workers_healthy(len(backends))))
