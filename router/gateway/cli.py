"""`fleetroute epp`: the command line of the endpoint picker. The gRPC and Envoy modules are imported only when
the command runs, so the `fleetroute` command works without the `epp` extra (`pip install 'fleetroute[epp]'`)."""

from __future__ import annotations

import argparse

DEFAULT_PORT = 9002  # the port GIE's reference picker and its InferencePool examples use

EPILOG = """\
The configuration file is the router's (fleetroute router --help): endpoints (static, or Kubernetes
discovery), policies, health, stickiness, admission, cost, telemetry, Redis, the admin listener. The
router's `listen:` block is unused: the gateway (Envoy) is the ingress.

Envoy: an ext_proc HTTP filter pointing at this server (gRPC, HTTP/2), processing mode request headers
SEND, request body BUFFERED, response headers SEND, response body NONE or STREAMED (STREAMED ends each
request's in-flight count at its last byte; NONE at the end of the HTTP stream); a cluster that sends each
request where x-gateway-destination-endpoint says (ORIGINAL_DST with use_http_header, or the override_host
load-balancing policy for a fallback list). See docs/gateway.md for a complete bootstrap.

exit codes: 0 clean shutdown, 1 runtime failure, 2 bad command line or configuration.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    epp = sub.add_parser(
        "epp",
        help="run the endpoint picker (Envoy ext_proc) for a gateway",
        description="Run fleetroute as a Gateway API Inference Extension endpoint picker: a gRPC ext_proc\n"
                    "server that tells Envoy where each inference request goes, with the router's policies,\n"
                    "health, stickiness and admission.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    epp.add_argument("--config", "-c", metavar="FILE", help="router YAML configuration ($FLEETROUTE_CONFIG)")
    epp.add_argument("--host", default="0.0.0.0", help="gRPC listen address (default 0.0.0.0)")
    epp.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"gRPC port (default {DEFAULT_PORT})")
    epp.add_argument("--fallbacks", type=int, default=0, metavar="N",
                     help="endpoints after the pick in the destination list, for a gateway that retries down it "
                          "(default 0: the pick alone, as an ORIGINAL_DST cluster needs)")
    epp.add_argument("--tls-cert", metavar="FILE", help="PEM certificate chain: serve gRPC over TLS (with --tls-key)")
    epp.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    epp.add_argument("--conformance-test-hooks", action="store_true",
                     help="the GIE conformance suite's hooks: the test-epp-endpoint-selection request header names the "
                          "candidates, x-conformance-test-served-endpoint echoes the gateway's served endpoint. Test "
                          "clusters only: any client could choose its endpoint")
    epp.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import asyncio
    import os
    import sys

    from router.config.settings import ConfigError, load_settings
    from router.runtime.logs import configure_logging
    from router.server.app import build_context

    try:
        from router.gateway.server import serve
    except ImportError as exc:
        print(f"fleetroute epp: {exc.name or exc} is missing: pip install 'fleetroute[epp]'", file=sys.stderr)
        return 2

    path = args.config or os.environ.get("FLEETROUTE_CONFIG")
    if not path:
        print("fleetroute epp: error: --config is required (or set FLEETROUTE_CONFIG)", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535 or not 0 <= args.fallbacks <= 16:
        print("fleetroute epp: error: --port must be 0-65535 and --fallbacks 0-16", file=sys.stderr)
        return 2
    if (args.tls_cert is None) != (args.tls_key is None):
        print("fleetroute epp: error: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    tls = None
    if args.tls_cert is not None:
        try:
            with open(args.tls_key, "rb") as key, open(args.tls_cert, "rb") as cert:
                tls = (key.read(), cert.read())
        except OSError as exc:
            print(f"fleetroute epp: error: cannot read the TLS files: {exc}", file=sys.stderr)
            return 2
    try:
        settings = load_settings(path)
    except ConfigError as exc:
        print(f"fleetroute epp: config error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    try:
        # The standard loop: grpc.aio drives its own completion queue on it (uvloop is not supported there).
        asyncio.run(serve(build_context(settings), host=args.host, port=args.port, fallbacks=args.fallbacks,
                          tls=tls, test_hooks=args.conformance_test_hooks))
    except ConfigError as exc:
        print(f"fleetroute epp: config error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"fleetroute epp: cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0
