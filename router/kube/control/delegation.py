"""What the operator delegates to RoutingPolicy authors, and the check of one RoutingPolicy against it.

Whoever may create RoutingPolicies in the watched namespace is not, in general, whoever writes the router's
config file. Without a limit, one RoutingPolicy with `models: ['*']` and a high priority would route every
model (a bogus health path and `panicThreshold: 0` then fail every request). So a RoutingPolicy governs only
what `control.kubernetes` delegates (docs/kubernetes.md, "Trust model"):

- `allowedModels`: every entry of the policy's `models` must lie inside one of these names or patterns. A
  plain name must match an allowed pattern (fnmatch, as routing matches). A pattern is inside an allowed
  pattern only when that one is a literal prefix followed by `*` (`team-a-*`, or `*` alone) and the
  pattern starts with the prefix: every name it can match then starts with the prefix too. Containment of
  two arbitrary shell patterns is not decided; such a pattern is refused, never guessed. Default: nothing.
  The same holds for the names and targets of the policy's model aliases (router/routing/aliases.py): an alias takes
  the requests for its name and sends them to its targets.
- `maxPriority`: the highest `spec.priority` accepted (the order among RoutingPolicies). Default 1000, the
  CRD's maximum.
- `overrideFilePolicies`: false (the default) keeps the file's policies in charge: they are matched before
  every RoutingPolicy, and a RoutingPolicy may not take a file policy's name (which would remove it, for
  all its models). True puts RoutingPolicies first and lets one replace the file policy of its name.

A RoutingPolicy beyond its delegation is not applied: it gets `Accepted: False` with the refusal's reason
(typed, as status condition reasons are) and message, a log line and a count. Pure: no I/O.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Collection
from dataclasses import dataclass

from router.config.settings import PolicySpec
from router.kube.control import KubernetesControlSettings

_GLOB = frozenset("*?[")

MODELS_NOT_DELEGATED = "ModelsNotDelegated"
PRIORITY_NOT_DELEGATED = "PriorityNotDelegated"
FILE_POLICY_CONFLICT = "FilePolicyConflict"
REASONS = (MODELS_NOT_DELEGATED, PRIORITY_NOT_DELEGATED, FILE_POLICY_CONFLICT)


@dataclass(frozen=True)
class Refusal:
    reason: str  # one of REASONS: the Accepted condition's reason
    message: str


def _is_pattern(name: str) -> bool:
    return not _GLOB.isdisjoint(name)


def delegated(model: str, allowed: Collection[str]) -> bool:
    """Whether every model name `model` (a name or a shell pattern) can match is inside `allowed`."""
    if not _is_pattern(model):
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in allowed)
    for pattern in allowed:
        prefix = pattern[:-1]
        if pattern.endswith("*") and not _is_pattern(prefix) and model.startswith(prefix):
            return True
    return False


def file_conflict(name: str, file_policies: Collection[str], settings: KubernetesControlSettings) -> Refusal | None:
    """A RoutingPolicy named like a file policy, when RoutingPolicies may not override the file's."""
    if settings.override_file_policies or name not in file_policies:
        return None
    return Refusal(FILE_POLICY_CONFLICT, f"the router's config file has a policy named {name!r}, which stays in "
                                         "charge (control.kubernetes.overrideFilePolicies is false): give this "
                                         "RoutingPolicy another name")


def check(policy: PolicySpec, priority: int, settings: KubernetesControlSettings) -> Refusal | None:
    """Why `policy` (parsed from a RoutingPolicy with `priority`) exceeds what is delegated, or None. The file
    name conflict is `file_conflict`: it depends on the config file, which a reload changes."""
    allowed = settings.allowed_models
    outside = [m for m in policy.models if not delegated(m, allowed)]
    if outside:
        listed = ", ".join(repr(m) for m in outside[:8]) + (", ..." if len(outside) > 8 else "")
        scope = f"[{', '.join(allowed)}]" if allowed else "empty: no model is delegated"
        hint = " (a pattern is delegated only inside an allowed pattern that ends in *)" \
            if any(_is_pattern(m) for m in outside) and allowed else ""
        return Refusal(MODELS_NOT_DELEGATED, f"models {listed} are not delegated to RoutingPolicies "
                                             f"(control.kubernetes.allowedModels is {scope}){hint}")
    # An alias takes its name's requests and sends them to its targets: both are models it routes.
    named = dict.fromkeys(m for a in policy.aliases for m in (a.name, *(t.model for t in a.targets)))
    outside = [m for m in named if not delegated(m, allowed)]
    if outside:
        listed = ", ".join(repr(m) for m in outside[:8]) + (", ..." if len(outside) > 8 else "")
        scope = f"[{', '.join(allowed)}]" if allowed else "empty: no model is delegated"
        return Refusal(MODELS_NOT_DELEGATED, f"aliases name models {listed} that are not delegated to "
                                             f"RoutingPolicies (control.kubernetes.allowedModels is {scope})")
    if priority > settings.max_priority:
        return Refusal(PRIORITY_NOT_DELEGATED, f"priority {priority} is above what is delegated to RoutingPolicies "
                                               f"(control.kubernetes.maxPriority is {settings.max_priority})")
    return None
