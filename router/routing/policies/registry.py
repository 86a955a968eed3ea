"""Policies by name. Adding a strategy means one module and one line in `BUILTIN`: no if/elif anywhere. The
module owns everything about its strategy: its parameters, its pickers, and the sentence that explains each
reason its pickers give (`reasons`), which explanations and the status page read through `sentence`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from router.routing.policies.adaptive import AdaptivePolicy
from router.routing.policies.base import REASONS, Policy, Sentence
from router.routing.policies.composite import CompositePolicy
from router.routing.policies.consistent_hash import ConsistentHashPolicy
from router.routing.policies.least_connections import LeastConnectionsPolicy
from router.routing.policies.prefix_aware import PrefixAwarePolicy
from router.routing.policies.round_robin import RoundRobinPolicy

BUILTIN: tuple[Policy, ...] = (
    RoundRobinPolicy(),
    LeastConnectionsPolicy(),
    ConsistentHashPolicy(),
    AdaptivePolicy(),
    PrefixAwarePolicy(),
    CompositePolicy(),
)


class PolicyRegistry:
    def __init__(self, policies: Iterable[Policy] = BUILTIN) -> None:
        self._by_name: dict[str, Policy] = {}
        for policy in policies:
            self.register(policy)

    def register(self, policy: Policy) -> None:
        if policy.name in self._by_name:
            raise ValueError(f"policy {policy.name!r} registered twice")
        self._by_name[policy.name] = policy

    def get(self, name: str) -> Policy | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def all(self) -> list[Policy]:
        return list(self._by_name.values())


def _sentences(policies: Iterable[Policy]) -> Mapping[str, Sentence]:
    out: dict[str, Sentence] = dict(REASONS)
    for policy in policies:
        for reason, sentence in policy.reasons.items():
            if out.get(reason, sentence) is not sentence:
                raise ValueError(f"reason {reason!r} is explained twice (policy {policy.name!r})")
            out[reason] = sentence
    return out


SENTENCES = _sentences(BUILTIN)


def sentence(reason: str) -> Sentence | None:
    """The sentence that explains a pick's reason, from the policy that gives it."""
    return SENTENCES.get(reason)

