"""vLLM's Rust router (`vllm-router` on PyPI; github.com/vllm-project/router, forked from SGLang's router).

Command line: `vllm-router --host 127.0.0.1 --port P --worker-urls U1 U2 ... --policy POLICY
--prometheus-host 127.0.0.1 --prometheus-port Q --worker-startup-check-interval 1`. Everything else is the
shipped default (5 retries, circuit breaker, health checks every 60 s, request log at INFO).

What it asks of the workers (seen with a logging proxy in front of `fleetroute sim`, which vLLM itself also
serves, or answers the same way):
- `GET /health` at start (it listens only once every worker answers 200) and every 60 s;
- `GET /get_load` every 5 s for power_of_two: an SGLang-runtime endpoint that vLLM does not have (404), so
  power_of_two compares the router's own in-flight counts, as the simulator's 404 makes it do too;
- cache_aware, before every request: `POST /v1/completions/render` (or `/v1/chat/completions/render`; a
  stock `vllm serve` answers 403, the endpoints need `--enable-scale-out`), then `POST /tokenize` (served by
  vLLM, and by the simulator). It builds its prefix tree from those token ids, so cache_aware costs two extra
  round trips to a worker per request; the other policies none.

`--prometheus-port` must be set: its default (29000) collides as soon as two routers run. consistent_hash
hashes the `x-session-id` header first (then x-user-id, x-tenant-id, x-correlation-id, x-request-id,
x-trace-id, then the body's session_params.session_id, user, session_id, user_id, then the request text).
Tokio's worker threads follow the CPU affinity (`taskset -c 0`: one worker thread); TOKIO_WORKER_THREADS is
set to the pinned core count as well, to say so explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from loadtest.host import free_port
from loadtest.peers.base import (
    LaunchPlan,
    PeerInfo,
    PipInstall,
    ReadyProbe,
    check_backends,
    lists_model,
)

INFO = PeerInfo(
    name="vllm-router",
    policies=("round_robin", "random", "power_of_two", "cache_aware", "consistent_hash"),
    summary="vLLM's Rust router (PyPI vllm-router), HTTP mode in front of OpenAI-compatible workers",
    install="loadtest/peers/install-vllm-router.sh",
    policy_notes={
        "round_robin": "each request to the next worker in turn",
        "random": "a uniformly random worker",
        "power_of_two": "two random workers, the one with fewer of the router's in-flight requests "
                        "(/get_load is polled but vLLM does not serve it)",
        "cache_aware": "approximate radix tree of the token ids (via the worker's /tokenize) routed to each "
                       "worker; best match above cache-threshold 0.3, else the least loaded; plain least-load "
                       "when imbalance exceeds 64 requests and 1.5x",
        "consistent_hash": "hash ring (160 virtual nodes) on x-session-id (then other id headers, the body's "
                           "user/session fields, the request text)",
    },
    min_backends={"power_of_two": 2},
)
INSTALL = PipInstall(INFO, dist="vllm-router", program="vllm-router")
SESSION_HEADER = "x-session-id"
unavailable_reason = INSTALL.unavailable_reason
version = INSTALL.version
executable = INSTALL.executable


def plan(policy: str, backends: Sequence[tuple[str, str]], model: str, *, port: int, root: Path,
         workdir: Path, workers: int | None = None) -> LaunchPlan:
    check_backends(INFO, policy, backends)
    argv = (
        str(executable(root)), "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *(url.rstrip("/") for _, url in backends),
        "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--worker-startup-check-interval", "1",
    )
    env = {"TOKIO_WORKER_THREADS": str(workers)} if workers else {}
    # It listens only after every worker passed its health check; /v1/models is then answered by a worker.
    return LaunchPlan(argv=argv, port=port, env=env, probe=ReadyProbe("/v1/models", lists_model(model)))
