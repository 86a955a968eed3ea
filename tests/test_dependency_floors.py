"""Dependency floors: pyproject.toml's lower bounds stay at or above the releases with the security fixes the
router relies on, and the installed versions satisfy every declared requirement (a CI step: an environment
built from an old lock file or an image fails here, not in production)."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
# The oldest release without a known flaw that reaches the router: each with why.
SECURITY_FLOORS = {
    # Request smuggling (3.12.14; pure-Python parser 3.14.4), duplicate Host and header injection through a
    # proxied reason phrase (3.13.4), the C parser's line-size bypass (3.14.1), an out-of-bounds read on a
    # malformed chunked response (3.14.3).
    "aiohttp": Version("3.14.4"),
    "orjson": Version("3.9.15"),  # no recursion limit before: a deeply nested body could crash the process
}


def _requirements(extra: str | None = None) -> list[Requirement]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    raw = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return [Requirement(line) for line in raw]


def _floor(specifier: SpecifierSet) -> Version | None:
    floors = [Version(spec.version) for spec in specifier if spec.operator in (">=", "==", "~=")]
    return max(floors) if floors else None


@pytest.mark.parametrize("name", sorted(SECURITY_FLOORS))
def test_declared_floors_are_at_least_the_security_fixes(name: str) -> None:
    (requirement,) = [r for r in _requirements() if r.name == name]
    floor = _floor(requirement.specifier)
    assert floor is not None and floor >= SECURITY_FLOORS[name], (
        f"pyproject.toml allows {name}{requirement.specifier}; it must not allow releases before "
        f"{SECURITY_FLOORS[name]}")


@pytest.mark.parametrize("requirement", _requirements() + _requirements("test"), ids=str)
def test_installed_versions_satisfy_the_declared_requirements(requirement: Requirement) -> None:
    if requirement.marker is not None and not requirement.marker.evaluate():
        pytest.skip(f"not for this platform: {requirement.marker}")
    installed = Version(metadata.version(requirement.name))
    assert requirement.specifier.contains(installed, prereleases=True), (
        f"{requirement.name} {installed} is installed; pyproject.toml needs {requirement.specifier}")


def test_opentelemetry_protos_are_opentelemetry_protos_own() -> None:
    """xds-protos ships an old copy of `opentelemetry/proto/*` (grpc/grpc#42926): installed after opentelemetry-proto
    it overwrites the files, and the router's OTLP exporter (tracing) cannot be imported. So nothing fleetroute
    installs may bring it (the endpoint picker carries its own Envoy protos, router/gateway/envoy_api)."""
    try:
        from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"{exc}: opentelemetry-proto's files were overwritten (xds-protos?); "
                    "run pip install --force-reinstall --no-deps opentelemetry-proto")
