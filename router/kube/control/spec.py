"""A RoutingPolicy's spec as the router reads it. Pure: no I/O.

The spec is exactly one entry of the config file's `policies:` list, `preset` included, with `name` set to the
object's name, plus `priority` (the order among RoutingPolicies). It goes through the file's own parser, so a
spec and the same file entry give the same PolicySpec, and the router refuses a spec for exactly the reasons
it refuses the entry. The CRD's schema and CEL rules refuse the same specs at `kubectl apply`, except what only
the router can see (a preset's values): tests/test_crd_router_agreement.py holds one table for both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.config.settings import PolicySpec, _policy
from router.routing.policies.registry import PolicyRegistry


def policy_from_spec(name: str, spec: Mapping[str, Any], registry: PolicyRegistry) -> tuple[int, PolicySpec]:
    """(priority, policy). Raises ConfigError naming the field as `spec.<field>` (or `spec (preset NAME).<field>`
    for a field the preset's expansion holds)."""
    body = dict(spec)
    priority = body.pop("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        priority = 0  # the CRD's schema makes it an integer; an object written around it counts as the default
    return priority, _policy("spec", {**body, "name": name}, registry)
