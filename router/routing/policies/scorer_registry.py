"""Composite scorers by name. Adding a scorer means one module (a class with the `Scorer` members:
router/routing/policies/scorers.py) and one line in `BUILTIN`; the composite's config validation, its explanations
and the docs' scorer table (tests/test_scorers.py checks it) all read this registry, so nothing else names
scorers."""

from __future__ import annotations

from collections.abc import Iterable

from router.routing.policies.base import PolicyConfigError
from router.routing.policies.scorers import GpuScorer, LoadScorer, MemoryScorer, PrefixScorer, QueueScorer, Scorer

BUILTIN: tuple[Scorer, ...] = (GpuScorer(), MemoryScorer(), QueueScorer(), LoadScorer(), PrefixScorer())


class ScorerRegistry:
    def __init__(self, scorers: Iterable[Scorer] = BUILTIN) -> None:
        self._by_name: dict[str, Scorer] = {}
        for scorer in scorers:
            if scorer.name in self._by_name:
                raise ValueError(f"scorer {scorer.name!r} registered twice")
            self._by_name[scorer.name] = scorer

    def names(self) -> list[str]:
        """In registration order (the order the docs' table lists them)."""
        return list(self._by_name)

    def get(self, name: str) -> Scorer | None:
        return self._by_name.get(name)

    def require(self, name: object, where: str) -> Scorer:
        """The scorer called `name`, or a config error at `where` listing the known ones."""
        scorer = self._by_name.get(name) if isinstance(name, str) else None
        if scorer is None:
            raise PolicyConfigError(where, f"unknown scorer (expected one of: {', '.join(self._by_name)})")
        return scorer


SCORERS = ScorerRegistry()
