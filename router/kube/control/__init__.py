"""Control plane: routing policies from outside the config file, applied live.

- `kubernetes` (router.kube.control.routing_policies): `RoutingPolicy` custom resources (`fleetroute.io/v1alpha1`),
  listed and watched through the Kubernetes API, merged with the file's `policies:`, with status written by
  the one replica that holds a Lease. A RoutingPolicy governs only what the config delegates to it
  (`allowedModels`, `maxPriority`, `overrideFilePolicies`: router.kube.control.delegation).

Configured under `control: {kubernetes: {...}}` (parsed here, without importing the Kubernetes client: the
router imports it only when the block is present). docs/kubernetes.md is the reference, its "Trust model"
section the why of the delegation.
"""

from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.config.fields import ConfigError

if TYPE_CHECKING:
    from router.config.fields import Fields

MAX_PRIORITY = 1000  # the CRD's bounds of spec.priority
MIN_PRIORITY = -1000
MAX_ALLOWED_MODELS = 256

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass(frozen=True)
class KubernetesControlSettings:
    """`control.kubernetes`: watch the RoutingPolicies of one namespace."""

    namespace: str | None = None  # None: the pod's own (in-cluster), the kubeconfig context's, or "default"
    label_selector: str | None = None  # only RoutingPolicies with these labels (several router fleets, one namespace)
    kubeconfig: str | None = None
    context: str | None = None
    lease_name: str = "fleetroute-routing-policy-status"
    lease_duration: float = 15.0  # a holder that has not renewed for this long is replaced
    identity: str | None = None  # the Lease holder name; None: $POD_NAME or $HOSTNAME, plus a random suffix
    status: bool = True  # false: never write status (no Lease, no status RBAC)
    # What RoutingPolicy authors may do (router.kube.control.delegation). The defaults delegate nothing: whoever may
    # create RoutingPolicies in the namespace routes no model until the operator says which.
    allowed_models: tuple[str, ...] = ()  # model names or patterns a RoutingPolicy's `models` must stay inside
    max_priority: int = MAX_PRIORITY  # the highest spec.priority accepted
    override_file_policies: bool = False  # false: the file's policies match first, and keep their names
    sync_timeout: float = 10.0
    watch_timeout: float = 300.0
    initial_backoff: float = 0.5
    max_backoff: float = 30.0

    def holder(self) -> str:
        if self.identity is not None:
            return self.identity
        base = os.environ.get("POD_NAME") or os.environ.get("HOSTNAME") or "fleetroute"
        return f"{base}_{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class ControlSettings:
    kubernetes: KubernetesControlSettings | None = None


def parse_control(top: Fields) -> ControlSettings | None:
    """`control: {kubernetes: {...}}`; absent or null: no control plane."""
    if top.get("control") is None:
        return None
    c = top.sub("control")
    raw = c.get("kubernetes")
    kubernetes = _kubernetes(c.sub("kubernetes")) if raw is not None else None
    c.done()
    return ControlSettings(kubernetes=kubernetes) if kubernetes is not None else None


def _kubernetes(f: Fields) -> KubernetesControlSettings:
    from router.config.fields import _label_selector_problem, _show

    d = KubernetesControlSettings()

    def optional(key: str) -> str | None:
        return f.string(key) if f.get(key) is not None else None

    namespace = optional("namespace")
    if namespace is not None and not _DNS_LABEL.match(namespace):
        raise ConfigError(f.at("namespace"), f"must be a namespace name (a lower-case DNS label), got {namespace!r}")
    selector = optional("labelSelector")
    if selector is not None and (problem := _label_selector_problem(selector)):
        raise ConfigError(f.at("labelSelector"), problem)
    lease_name = f.string("leaseName", d.lease_name)
    if len(lease_name) > 253 or not _DNS_SUBDOMAIN.match(lease_name):
        raise ConfigError(f.at("leaseName"), f"must be a Kubernetes object name, got {lease_name!r}")
    allowed = f.get("allowedModels", [])
    if not isinstance(allowed, list) or len(allowed) > MAX_ALLOWED_MODELS \
            or not all(isinstance(m, str) and m.strip() for m in allowed):
        raise ConfigError(f.at("allowedModels"), f"must be a list of at most {MAX_ALLOWED_MODELS} model names or "
                                                 f"patterns, got {_show(allowed)}")
    settings = KubernetesControlSettings(
        namespace=namespace,
        label_selector=selector,
        kubeconfig=optional("kubeconfig"),
        context=optional("context"),
        lease_name=lease_name,
        lease_duration=f.duration("leaseDuration", d.lease_duration),
        identity=optional("identity"),
        status=f.boolean("status", d.status),
        sync_timeout=f.duration("syncTimeout", d.sync_timeout),
        watch_timeout=f.duration("watchTimeout", d.watch_timeout),
        initial_backoff=f.duration("initialBackoff", d.initial_backoff),
        max_backoff=f.duration("maxBackoff", d.max_backoff),
        allowed_models=tuple(dict.fromkeys(m.strip() for m in allowed)),
        max_priority=f.integer("maxPriority", d.max_priority, minimum=MIN_PRIORITY, maximum=MAX_PRIORITY),
        override_file_policies=f.boolean("overrideFilePolicies", d.override_file_policies),
    )
    if settings.lease_duration < 1:
        raise ConfigError(f.at("leaseDuration"), "must be at least 1s (Leases count whole seconds)")
    if settings.watch_timeout < 1:
        raise ConfigError(f.at("watchTimeout"), "must be at least 1s")
    if settings.max_backoff < settings.initial_backoff:
        raise ConfigError(f.at("maxBackoff"), "must be >= initialBackoff")
    f.done()
    return settings
