"""`fleetroute epp`: the router's routing core behind a gRPC ext_proc server, for a gateway to ask where each
inference request goes (the Gateway API Inference Extension's endpoint picker).

The process is the router without its HTTP ingress: the same configuration file and `build_context`, the same
lifecycles (discovery, health checks, telemetry, shared state, housekeeping: the ingress app's cleanup
contexts, started without a listener), the same admin listener (/metrics, /readyz, /admin/endpoints,
/status), and a gRPC server that answers `envoy.service.ext_proc.v3.ExternalProcessor` and the standard gRPC
health service (overall and for the ext_proc service: SERVING once started, NOT_SERVING while draining).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router.gateway.envoy_api.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from router.gateway.ext_proc import EndpointPicker
from router.gateway.protocol import SERVICE_NAME
from router.server.app import build_apps
from router.server.context import RouterContext

log = logging.getLogger("fleetroute.epp")




@dataclass
class RunningPicker:
    ctx: RouterContext
    grpc_port: int
    admin_url: str
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    lifecycle: web.AppRunner
    admin: web.AppRunner

    async def close(self, grace: float | None = None) -> None:
        """Health says NOT_SERVING, open streams get `grace` seconds, then the lifecycles stop."""
        self.ctx.draining = True
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace)
        await self.lifecycle.cleanup()
        await self.admin.cleanup()


async def start_picker(ctx: RouterContext, *, host: str = "127.0.0.1", port: int = 0, fallbacks: int = 0,
                       tls: tuple[bytes, bytes] | None = None, test_hooks: bool = False) -> RunningPicker:
    """`tls`: (PEM private key, PEM certificate chain) to serve gRPC over TLS; plaintext (h2c) without."""
    lifecycle_app, admin_app = build_apps(ctx)
    # The ingress app carries the lifecycles; it gets no listener (Envoy is the ingress).
    lifecycle = web.AppRunner(lifecycle_app, access_log=None)
    await lifecycle.setup()
    admin = web.AppRunner(admin_app, access_log=None, shutdown_timeout=1.0)
    await admin.setup()
    site = web.TCPSite(admin, ctx.settings.admin.host, ctx.settings.admin.port)
    # A request body is one ext_proc message (BUFFERED): room for the largest the router accepts, plus framing.
    limit = ctx.settings.max_body_bytes + (1 << 16)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit)])
    try:
        await site.start()
        picker = EndpointPicker(ctx, fallbacks=fallbacks, test_hooks=test_hooks)
        ext_proc_grpc.add_ExternalProcessorServicer_to_server(picker, server)
        checks = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(checks, server)
        where = f"{host}:{port}"
        bound = (server.add_secure_port(where, grpc.ssl_server_credentials([tls])) if tls is not None
                 else server.add_insecure_port(where))
        if bound == 0:
            raise OSError(f"cannot listen on {host}:{port} for gRPC")
        await server.start()
    except BaseException:
        await server.stop(None)
        await lifecycle.cleanup()
        await admin.cleanup()
        raise
    for service in ("", SERVICE_NAME):
        await checks.set(service, health_pb2.HealthCheckResponse.SERVING)
    admin_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    admin_host = "127.0.0.1" if ctx.settings.admin.host in ("0.0.0.0", "::") else ctx.settings.admin.host
    return RunningPicker(ctx, bound, f"http://{admin_host}:{admin_port}", server, checks, lifecycle, admin)


async def serve(ctx: RouterContext, *, host: str, port: int, fallbacks: int,
                tls: tuple[bytes, bytes] | None = None, test_hooks: bool = False) -> None:
    """Run until SIGTERM or SIGINT, then stop: health NOT_SERVING, `shutdownGrace` for open streams."""
    running = await start_picker(ctx, host=host, port=port, fallbacks=fallbacks, tls=tls, test_hooks=test_hooks)
    if test_hooks:
        log.warning("conformance test hooks on: any client can choose its endpoint with test-epp-endpoint-selection")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("endpoint picker listening", extra={
        "grpc": f"{host}:{running.grpc_port}", "admin": running.admin_url,
        "endpoints": len(ctx.balancer.endpoints()), "models": list(ctx.balancer.models()),
        "policies": [p.name for p in ctx.settings.policies] or ["default"], "fallbacks": fallbacks,
        "tls": tls is not None})
    try:
        await stop.wait()
    finally:
        log.info("shutting down the endpoint picker", extra={"in_flight": ctx.loads.total()})
        await running.close(ctx.settings.shutdown_grace)
