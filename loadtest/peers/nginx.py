"""nginx as a plain HTTP load balancer in front of the fleet: the baseline with no LLM knowledge at all.

It runs in the foreground from a configuration generated into a temporary directory (`render_config`):
`nginx -p DIR -c DIR/nginx.conf -e stderr -g "daemon off;"`, master process plus `worker_processes` workers
(1 unless pinned to more cores, nginx's own default; Debian's packaged config would say `auto`), every
temp/pid/log path inside DIR, listening on 127.0.0.1 only.

Streaming: `proxy_buffering off` (each chunk the backend writes is passed on at once, so SSE arrives token by
token), `proxy_request_buffering off`, `proxy_http_version 1.1` with `Connection ""` and an upstream
`keepalive` pool (connections to the backends are reused as every other router here reuses them), long read
timeouts for long generations. The access log is on, buffered (64 KiB, flushed every second), as an
operator would run it. A failed connect moves to the next server (`proxy_next_upstream error timeout`, the
default; POSTs are never retried once sent, nginx's rule for non-idempotent requests).

Policies:
- round_robin: nginx's default (weighted round robin, equal weights);
- least_conn: fewest active connections of this worker process (each worker counts its own unless a
  `zone` is shared; with one worker that is the whole proxy's view);
- random_two: `random two least_conn`, power of two choices on active connections;
- consistent_hash: `hash $http_x_session_id consistent` (ketama: 160 points per server). A request without
  the header would hash the empty string onto one server, so those go to a second upstream group with
  least_conn instead (a `map` picks the group), which is what fleetroute's consistent-hash does with keyless
  requests.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from loadtest.peers.base import LaunchPlan, PeerInfo, ReadyProbe, check_backends, host_port, lists_model

INFO = PeerInfo(
    name="nginx",
    policies=("round_robin", "least_conn", "random_two", "consistent_hash"),
    summary="nginx (Debian package) as an HTTP reverse proxy with an upstream group, no LLM awareness",
    install="loadtest/peers/install-nginx.sh",
    policy_notes={
        "round_robin": "each request to the next server in turn (nginx's default balancing)",
        "least_conn": "the server with the fewest active connections",
        "random_two": "two random servers, the one with fewer active connections (random two least_conn)",
        "consistent_hash": "ketama ring on the x-session-id header; requests without it: least_conn",
    },
)
SESSION_HEADER = "x-session-id"
BALANCING = {
    "round_robin": None,
    "least_conn": "least_conn;",
    "random_two": "random two least_conn;",
    "consistent_hash": "hash $http_x_session_id consistent;",
}


def executable() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)


def version(binary: str | None = None) -> str:
    binary = binary or executable()
    if binary is None:
        return "unknown"
    out = subprocess.run([binary, "-v"], capture_output=True, text=True, timeout=10)
    m = re.search(r"nginx/(\S+)", out.stderr + out.stdout)
    return m.group(1) if m else "unknown"


def unavailable_reason(pinned: str) -> str | None:
    binary = executable()
    if binary is None:
        return "nginx is not installed (no nginx on PATH or in /usr/sbin); install it with " \
               f"{INFO.install} (apt-get install nginx={pinned}-*, as root)"
    installed = version(binary)
    if installed != pinned:
        return f"nginx {installed} is installed at {binary}, {pinned} is pinned; install it with {INFO.install}"
    return None


def _upstream(name: str, balancing: str | None, backends: Sequence[tuple[str, str]], keepalive: int) -> str:
    lines = [f"    upstream {name} {{"]
    if balancing:
        lines.append(f"        {balancing}")
    for endpoint_id, url in backends:
        # max_fails=0: no passive ejection, as the Rust routers' circuit breakers do not trip on a healthy
        # fleet either; ids in a comment so a rendered config says which server is which endpoint.
        lines.append(f"        server {host_port(url)} max_fails=0;  # {endpoint_id}")
    lines += [f"        keepalive {keepalive};", "    }"]
    return "\n".join(lines)


def render_config(policy: str, backends: Sequence[tuple[str, str]], *, port: int, workdir: Path,
                  workers: int = 1, keepalive: int = 256) -> str:
    if policy not in BALANCING:
        raise ValueError(f"unknown nginx policy {policy!r}")
    upstreams = [_upstream("fleet", BALANCING[policy], backends, keepalive)]
    target = "http://fleet"
    route_map = ""
    if policy == "consistent_hash":
        upstreams.append(_upstream("fleet_unkeyed", BALANCING["least_conn"], backends, keepalive))
        route_map = (
            "    map $http_x_session_id $fleet_group {\n"
            '        ""      fleet_unkeyed;\n'
            "        default fleet;\n"
            "    }\n"
        )
        target = "http://$fleet_group"
    d = workdir
    return f"""# Generated by loadtest/peers/nginx.py for {policy}; run with -p {d} -c {d}/nginx.conf.
worker_processes {workers};
pid {d}/nginx.pid;
error_log stderr notice;
events {{
    worker_connections 8192;
}}
http {{
    access_log {d}/access.log combined buffer=64k flush=1s;
    client_body_temp_path {d}/client_body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    client_max_body_size 64m;
    client_body_buffer_size 1m;
    keepalive_requests 100000;
    keepalive_timeout 75s;
{route_map}{chr(10).join(upstreams)}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass {target};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_cache off;
            proxy_read_timeout 3600s;
            proxy_send_timeout 3600s;
            proxy_next_upstream error timeout;
        }}
    }}
}}
"""


def plan(policy: str, backends: Sequence[tuple[str, str]], model: str, *, port: int, root: Path,
         workdir: Path, workers: int | None = None) -> LaunchPlan:
    check_backends(INFO, policy, backends)
    binary = executable() or "nginx"
    conf = render_config(policy, backends, port=port, workdir=workdir, workers=workers or 1)
    argv = (binary, "-p", str(workdir), "-c", str(workdir / "nginx.conf"), "-e", "stderr", "-g", "daemon off;")
    # /v1/models through the proxy: ready means nginx listens *and* reaches a backend.
    return LaunchPlan(argv=argv, port=port, files={"nginx.conf": conf},
                      probe=ReadyProbe("/v1/models", lists_model(model)))
