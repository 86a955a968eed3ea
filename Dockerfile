# fleetroute: one image for every component: the router (`fleetroute router`), the telemetry sidecar beside
# each engine (`fleetroute agent`) and the GPU node agent (`fleetroute node-agent`, a DaemonSet).
# The Helm chart (helm/fleetroute) runs it read-only with every capability dropped, as user 10001; the one
# exception is the node agent with the nvml source, which runs as root (uid 0: the kubelet's PodResources
# socket is root's), still read-only and without capabilities (privileged only with gpuTelemetry.nvml.privileged).
#
#   docker build -t fleetroute/fleetroute:0.1.0 .
#
# Not built in this repository's CI (no container engine there); keep it simple.
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY router ./router
COPY worker ./worker
COPY loadtest ./loadtest
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=build /wheels /wheels
RUN pip install --no-index --find-links=/wheels fleetroute && rm -rf /wheels \
    && groupadd --gid 10001 fleetroute \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin fleetroute
USER 10001:10001
# 8080: OpenAI-compatible ingress; 9090: admin (/metrics, /healthz, /readyz, /admin/*). The node agent serves
# its /metrics and /healthz on 9402 (--metrics-port).
EXPOSE 8080 9090
ENTRYPOINT ["fleetroute"]
CMD ["router", "--help"]
