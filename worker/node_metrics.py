"""Every Prometheus collector of the node agent (`fleetroute node-agent`), served on its own `/metrics`.

The node agent is a process of its own (a DaemonSet pod per GPU node), so its collectors live in their own
registry, not in the router's (router/runtime/metrics.py). No label carries a pod or GPU name: per-GPU numbers are
dcgm-exporter's job; these say whether the agent itself works.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

ROUND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class NodeAgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.rounds = Counter(
            "fleetroute_node_agent_rounds",
            "Sampling rounds, by result: ok (records published), source_error (the GPU source or the kubelet's "
            "PodResources could not be read: nothing published), redis_error (the records could not be written).",
            ["result"],
            registry=r,
        )
        self.source_errors = Counter(
            "fleetroute_node_agent_source_errors",
            "Rounds whose source failed, by the part that failed: nvml, pod_resources, dcgm.",
            ["stage"],
            registry=r,
        )
        self.source_up = Gauge(
            "fleetroute_node_agent_source_up", "1 if the last round read its GPU source (and PodResources), else 0.",
            registry=r,
        )
        self.redis_up = Gauge(
            "fleetroute_node_agent_redis_up", "1 if the last round's records reached Redis, else 0.", registry=r,
        )
        self.gpus = Gauge(
            "fleetroute_node_agent_gpus", "GPUs the source shows on this node (held by fleet pods or not).", registry=r,
        )
        self.endpoints = Gauge(
            "fleetroute_node_agent_endpoints", "Endpoints (fleet pods holding GPUs) the last round published.",
            registry=r,
        )
        self.dcgm_other_node_gpus = Counter(
            "fleetroute_node_agent_dcgm_other_node_gpus",
            "GPU readings from dcgm-exporter left out because their Hostname label names another node (one per "
            "GPU per round): --dcgm-url reaches another node's exporter, or the exporter does not set NODE_NAME.",
            registry=r,
        )
        self.endpoints_gpu_lost = Gauge(
            "fleetroute_node_agent_endpoints_gpu_lost",
            "Endpoints the last round published with a lost GPU (fallen off the bus).",
            registry=r,
        )
        self.round_duration = Histogram(
            "fleetroute_node_agent_round_duration_seconds",
            "Time one round took: reading the source (and PodResources) and writing the records.",
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self.last_round = Gauge(
            "fleetroute_node_agent_last_round_timestamp_seconds",
            "Unix time the last round ended (whatever its result): a stalled agent stops advancing it.",
            registry=r,
        )
