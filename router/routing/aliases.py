"""Model aliases with weighted targets: `llama-3-8b` -> 90% `llama-3-8b-v1`, 10% `llama-3-8b-v2`.

A policy entry (a `policies:` item of the config file, or a RoutingPolicy's spec: the same parser) may define
aliases. A request whose `model` names an alias is sent to one of its targets, chosen by weight; the request
body's `model` is rewritten to the target before it is forwarded, and from there on the request is a request
for the target (its policy, pool, stickiness, metrics). The answer is not rewritten: the client sees the model
the engine served, as the engine wrote it, which is how a client learns that it reached the new version.

**The choice.** Without `sticky`, each request draws at random by weight (the router's injected RNG). With
`sticky: true`, the request's session (the defining policy's `stickiness.key`, else `fallbackKey`: the same
extraction and the same bounded digest as session pins, router/routing/sticky.py) is hashed with the alias's name to a
point in [0, 1), and the target is the one whose share of the cumulative weights holds that point. So the same
session keeps its target for as long as the split does not change, on every router replica, with no state
kept; a changed split moves only the sessions whose point now falls in another target's share (from 90/10 to
80/20, only the sessions in [0.8, 0.9) move to the second target). A request without a session draws at
random. (The same construction as Envoy's weighted clusters with a hash policy, and Istio's subset weights
with consistent hashing, minus the ring: a point in the cumulative weights needs none.)

**Targets without endpoints.** A target is drawn among all targets; if no endpoint serves the drawn one right
now (a new version scaled to zero, its pods not ready yet), the choice is made again among the targets that
are served, in the same way (a sticky session's point in their cumulative weights), and the drawn target is
counted in `fleetroute_alias_unserved_total`. When no target is served, the request is answered like any
request for a model without endpoints. Where the router knows every endpoint at load time (static
`endpoints:`, no discovery), a target no endpoint serves is a configuration error instead.

**Resolution is one step.** A target is never resolved again as an alias: an alias may name itself as a target
(`llama-3-8b` -> 90% `llama-3-8b`, the model the fleet already serves under that name, 10% `llama-3-8b-v2`),
and a target that is another alias is a configuration error, not a chain.

Pure: no I/O (import-linter). Parsing raises AliasConfigError with the field relative to the `aliases` list,
which router/config/settings.py prefixes with the entry's path.
"""

from __future__ import annotations

import hashlib
import random
import re
from bisect import bisect_right
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

MAX_ALIASES = 16  # per policy entry; bounded as the CRD's lists are (its CEL rules' cost)
MAX_TARGETS = 8  # per alias
MAX_NAME = 253  # a model name, as the CRD bounds `models`
MAX_WEIGHT = 1_000_000
_MODEL_NAME = re.compile(r"^[^*?\[\s]+$")  # the CRD's pattern: no glob characters, no whitespace
_PERSON = b"fleetroute.alias"  # BLAKE2b personalisation: never confused with the session pins' digests


class AliasConfigError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Target:
    model: str
    weight: float


@dataclass(frozen=True)
class Alias:
    name: str
    targets: tuple[Target, ...]
    sticky: bool = False

    def share(self, model: str) -> float:
        """The target's configured share of the alias's requests, in [0, 1]."""
        total = sum(t.weight for t in self.targets)
        return sum(t.weight for t in self.targets if t.model == model) / total


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _model_name(value: Any, field: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise AliasConfigError(field, f"must be a non-empty {what}, got {_show(value)}")
    if len(value) > MAX_NAME:
        raise AliasConfigError(field, f"must be at most {MAX_NAME} characters, got {len(value)}")
    if not _MODEL_NAME.match(value):
        raise AliasConfigError(field, f"must be a model name, not a pattern (no *, ? or [) and without spaces, "
                                      f"got {_show(value)}")
    return value


def parse_aliases(raw: Any) -> tuple[Alias, ...]:
    """A policy entry's `aliases:` list: `[{name, targets: [{model, weight}], sticky}]`. Fields are named
    relative to the list (`[0].targets[1].weight`)."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_ALIASES:
        raise AliasConfigError("", f"must be a list of at most {MAX_ALIASES} aliases, got {_show(raw)}")
    aliases: list[Alias] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        at = f"[{i}]"
        if not isinstance(item, Mapping):
            raise AliasConfigError(at, f"must be a mapping with name and targets, got {_show(item)}")
        unknown = sorted(str(k) for k in item if k not in ("name", "targets", "sticky"))
        if unknown:
            raise AliasConfigError(f"{at}.{unknown[0]}", "unknown field (expected one of: name, sticky, targets)")
        if "name" not in item:
            raise AliasConfigError(f"{at}.name", "is required")
        name = _model_name(item["name"], f"{at}.name", "model name (what clients send as model)")
        if name in seen:
            raise AliasConfigError(f"{at}.name", f"duplicate alias {name!r}")
        seen.add(name)
        sticky = item.get("sticky", False)
        if not isinstance(sticky, bool):
            raise AliasConfigError(f"{at}.sticky", f"must be true or false, got {_show(sticky)}")
        aliases.append(Alias(name, _targets(item.get("targets"), f"{at}.targets"), sticky))
    for i, alias in enumerate(aliases):
        for j, target in enumerate(alias.targets):
            if target.model != alias.name and target.model in seen:
                raise AliasConfigError(f"[{i}].targets[{j}].model", _chain(target.model, "in this list"))
    return tuple(aliases)


def _chain(model: str, where: str) -> str:
    return (f"{model!r} is an alias itself ({where}); aliases resolve once, so a target must name a model the "
            "endpoints serve (or the alias's own name)")


def _targets(raw: Any, at: str) -> tuple[Target, ...]:
    if not isinstance(raw, list) or not raw or len(raw) > MAX_TARGETS:
        problem = "is required" if raw is None else f"got {_show(raw)}"
        raise AliasConfigError(at, f"must be a list of 1 to {MAX_TARGETS} targets ({{model, weight}}): {problem}")
    targets: list[Target] = []
    for j, item in enumerate(raw):
        where = f"{at}[{j}]"
        if not isinstance(item, Mapping):
            raise AliasConfigError(where, f"must be a mapping with model and weight, got {_show(item)}")
        unknown = sorted(str(k) for k in item if k not in ("model", "weight"))
        if unknown:
            raise AliasConfigError(f"{where}.{unknown[0]}", "unknown field (expected one of: model, weight)")
        if "model" not in item:
            raise AliasConfigError(f"{where}.model", "is required")
        model = _model_name(item["model"], f"{where}.model", "model name")
        if any(t.model == model for t in targets):
            raise AliasConfigError(f"{where}.model", f"duplicate target {model!r} (give it one weight)")
        if "weight" not in item:
            raise AliasConfigError(f"{where}.weight", "is required (a positive number: the target's share is its "
                                                      "weight over the sum of the alias's weights)")
        weight = item["weight"]
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight <= MAX_WEIGHT:
            raise AliasConfigError(f"{where}.weight", f"must be a number > 0 and <= {MAX_WEIGHT}, got {_show(weight)}")
        targets.append(Target(model, float(weight)))
    return tuple(targets)


def cross_check(entries: Iterable[tuple[str, Alias]], served: Collection | None = None) -> tuple[str, str] | None:
    """The first problem across the aliases of several policy entries, as (field path, message), or None.
    `entries`: (path of the alias, like `policies[0].aliases[1]`, alias). `served`: the models the endpoints
    serve, when the router knows all of them now (static endpoints, no discovery); None skips that check."""
    entries = list(entries)
    defined: dict[str, str] = {}
    for path, alias in entries:
        if alias.name in defined:
            return f"{path}.name", f"alias {alias.name!r} is already defined at {defined[alias.name]}"
        defined[alias.name] = path
    for path, alias in entries:
        for j, target in enumerate(alias.targets):
            where = f"{path}.targets[{j}].model"
            if target.model != alias.name and target.model in defined:
                return where, _chain(target.model, defined[target.model])
            if served is not None and target.model not in served:
                listed = sorted(served)
                available = ", ".join(listed[:20]) + (f" and {len(listed) - 20} more" if len(listed) > 20 else "")
                return where, (f"no endpoint serves {target.model!r} (the endpoints serve: {available or 'none'})")
    return None


# ---- the request path --------------------------------------------------------------------------------


def session_point(alias: str, session: str) -> float:
    """Where a session falls in [0, 1) for this alias: the same on every replica, independent across aliases
    (the alias's name is hashed in). `session` is already a bounded digest (router/routing/sticky.py)."""
    data = f"{alias}\0{session}".encode("utf-8", "surrogateescape")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=_PERSON).digest(), "big") / 2.0 ** 64


def weighted(targets: tuple[Target, ...], point: float) -> Target:
    """The target whose share of the cumulative weights holds `point` (in [0, 1))."""
    bounds = list(accumulate(t.weight for t in targets))
    index = bisect_right(bounds, point * bounds[-1])
    return targets[min(index, len(targets) - 1)]  # min: a point that rounds up to the total


@dataclass(frozen=True)
class Choice:
    """One request's target, and how it was chosen (for the explanation and the metrics)."""

    alias: Alias
    target: str | None  # None: no endpoint serves any target
    how: str  # "sticky" (the session's point) or "random" (no sticky, or no session)
    unserved: str | None = None  # the target first drawn, when no endpoint served it

    def to_dict(self) -> dict[str, Any]:
        """The explanation's `alias` entry: names from configuration only."""
        out: dict[str, Any] = {"name": self.alias.name, "target": self.target, "how": self.how,
                               "shares": {t.model: round(self.alias.share(t.model), 4) for t in self.alias.targets}}
        if self.unserved is not None:
            out["unserved"] = self.unserved
        return out


def choose(alias: Alias, *, session: str | None, rng: random.Random, serves: Callable[[str], bool]) -> Choice:
    """The request's target: drawn by weight (the session's point when sticky and known, else at random),
    drawn again among the served targets when no endpoint serves the first; None when none is served."""
    point = session_point(alias.name, session) if alias.sticky and session is not None else rng.random()
    how = "sticky" if alias.sticky and session is not None else "random"
    first = weighted(alias.targets, point)
    if serves(first.model):
        return Choice(alias, first.model, how)
    served = tuple(t for t in alias.targets if serves(t.model))
    if not served:
        return Choice(alias, None, how, unserved=first.model)
    return Choice(alias, weighted(served, point).model, how, unserved=first.model)


@dataclass(frozen=True)
class AliasEntry:
    alias: Alias
    policy: str  # the defining policy's name
    stickiness: Any  # its router.routing.sticky.StickinessSettings: whose key names the session


class AliasTable:
    """The aliases in effect, by name: built from the policies in effect (file and RoutingPolicies, in
    matching order), the first definition of a name winning, as the first matching policy routes a model."""

    def __init__(self, entries: Mapping[str, AliasEntry]) -> None:
        self._entries = dict(entries)

    @classmethod
    def of(cls, policies: Iterable[Any]) -> AliasTable:
        entries: dict[str, AliasEntry] = {}
        for spec in policies:
            for alias in getattr(spec, "aliases", ()):
                entries.setdefault(alias.name, AliasEntry(alias, spec.name, spec.stickiness))
        return cls(entries)

    def get(self, model: str) -> AliasEntry | None:
        return self._entries.get(model)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def available(self, serves: Callable[[str], bool]) -> list[str]:
        """The aliases a client can use now: those with a target some endpoint serves."""
        return [name for name, entry in self._entries.items() if any(serves(t.model) for t in entry.alias.targets)]

    def describe(self) -> dict[str, dict[str, float]]:
        """Alias -> target -> weight, for the log lines that say what is in effect."""
        return {name: {t.model: t.weight for t in e.alias.targets} for name, e in self._entries.items()}

    def __len__(self) -> int:
        return len(self._entries)
