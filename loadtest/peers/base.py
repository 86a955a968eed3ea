"""What every peer router module describes, and the pieces they share.

A peer module (`vllm_router`, `sglang_router`, `litellm`, `nginx`) is pure description: its `INFO`, where its
install puts it, and `plan(...)`, which turns (policy, backends, model, port) into a `LaunchPlan`: the argv,
extra environment, configuration files to write, the readiness probe and the headers clients must send. It
starts nothing. Running a plan is the caller's business: `loadtest.peers.start_peer` runs it in a
`ProcessGroup` (the load-test harness, asyncio), `loadtest.router_overhead` with its own blocking `Proc`.
Keeping the plan as data is what lets both run exactly the same command line, and lets the unit tests check
every rendered configuration without any peer installed.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VERSIONS_FILE = Path(__file__).resolve().parent / "versions.env"
# The peers' virtualenvs; the install scripts honour the same variable (a lead's worktree can point at a
# helper's installs instead of installing 1 GB again).
PEERS_DIR_ENV = "FLEETROUTE_PEERS_DIR"


class PeerError(ValueError):
    """A peer or policy that does not exist, or arguments a peer cannot run with."""


@dataclass(frozen=True)
class PeerInfo:
    name: str
    policies: tuple[str, ...]
    summary: str
    install: str  # the script that installs it, relative to the repository
    # policy -> what the peer does with it, in one line (README and --help text).
    policy_notes: Mapping[str, str] = field(default_factory=dict)
    min_backends: Mapping[str, int] = field(default_factory=dict)  # policy -> backends it refuses to run with fewer


@dataclass(frozen=True)
class ReadyProbe:
    """GET `path` until `check(status, body)` returns None (ready); otherwise it returns why not yet."""

    path: str
    check: Callable[[int, bytes], str | None]
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LaunchPlan:
    argv: tuple[str, ...]
    port: int
    probe: ReadyProbe
    env: Mapping[str, str] = field(default_factory=dict)  # set on top of os.environ
    files: Mapping[str, str] = field(default_factory=dict)  # name -> text, written into the work directory first
    client_headers: Mapping[str, str] = field(default_factory=dict)  # e.g. LiteLLM's master key

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def pinned_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def peers_dir() -> Path:
    return Path(os.environ.get(PEERS_DIR_ENV) or ROOT / ".venv-peers")


def venv_dist_version(venv: Path, dist: str) -> str | None:
    """The installed version of `dist` in a peer's virtualenv, read from its metadata (no import of it)."""
    site = sorted((venv / "lib").glob("python3*/site-packages"))
    if not site:
        return None
    name = "[-_.]".join(re.escape(part) for part in re.split(r"[-_.]", dist))  # PEP 503: - _ . are alike
    pattern = re.compile(rf"^{name}-([^-]+)\.dist-info$", re.IGNORECASE)
    for entry in site[0].iterdir():
        if m := pattern.match(entry.name):
            return m.group(1)
    return None


def install_hint(info: PeerInfo) -> str:
    return f"install it with {info.install} (or loadtest/peers/install-all.sh)"


def venv_unavailable_reason(info: PeerInfo, entry: Path, venv: Path, dist: str, pinned: str) -> str | None:
    """Why a pip-installed peer cannot run: its entry point missing, or another version than the pin."""
    if not entry.exists():
        return f"{info.name} is not installed (no {entry}); {install_hint(info)}"
    installed = venv_dist_version(venv, dist)
    if installed is None:
        return f"{info.name}'s virtualenv {venv} has no {dist} package; {install_hint(info)}"
    if installed != pinned:
        return f"{info.name} {installed} is installed, {pinned} is pinned; {install_hint(info)}"
    return None


@dataclass(frozen=True)
class PipInstall:
    """Where a pip-installed peer lives: its own virtualenv `<peers dir>/<name>`, the distribution `dist` in
    it, and the program in its bin/ that runs the router (`python` for a module launched with -m)."""

    info: PeerInfo
    dist: str
    program: str

    def venv(self, root: Path) -> Path:
        return root / self.info.name

    def executable(self, root: Path) -> Path:
        return self.venv(root) / "bin" / self.program

    def unavailable_reason(self, root: Path, pinned: str) -> str | None:
        return venv_unavailable_reason(self.info, self.executable(root), self.venv(root), self.dist, pinned)

    def version(self, root: Path) -> str:
        return venv_dist_version(self.venv(root), self.dist) or "unknown"


def check_backends(info: PeerInfo, policy: str, backends: Sequence[tuple[str, str]]) -> None:
    if not backends:
        raise PeerError(f"{info.name}: at least one backend is needed")
    ids = [b[0] for b in backends]
    if len(set(ids)) != len(ids):
        raise PeerError(f"{info.name}: backend ids must be unique, got {ids}")
    for endpoint_id, url in backends:
        if not re.fullmatch(r"https?://[^/\s]+", url.rstrip("/")):
            raise PeerError(f"{info.name}: backend {endpoint_id!r} url must be like http://127.0.0.1:8001, got {url!r}")
    need = info.min_backends.get(policy, 1)
    if len(backends) < need:
        raise PeerError(f"{info.name}:{policy} needs at least {need} backends (the peer refuses to start with "
                        f"fewer), got {len(backends)}")


def host_port(url: str) -> str:
    """`http://127.0.0.1:8001/` -> `127.0.0.1:8001`."""
    return url.rstrip("/").split("://", 1)[1]




def cpu_count_of(cpu: str | None) -> int | None:
    """How many cores a taskset list names: "0" -> 1, "0,1" -> 2, "0-3" -> 4; None -> None (not pinned)."""
    if cpu is None:
        return None
    cores: set[int] = set()
    for part in cpu.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise PeerError(f"cpu must be a taskset list like 0 or 0,1 or 0-3, got {cpu!r}")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return len(cores)


def status_ok(status: int, body: bytes) -> str | None:
    return None if status == 200 else f"answered {status}"


def lists_model(model: str) -> Callable[[int, bytes], str | None]:
    """A /v1/models check: 200 and `model` among the ids."""

    def check(status: int, body: bytes) -> str | None:
        if status != 200:
            return f"answered {status}"
        try:
            ids = [m.get("id") for m in json.loads(body).get("data", [])]
        except (ValueError, AttributeError):
            return f"answered a body that is not a model list: {body[:200]!r}"
        return None if model in ids else f"lists models {ids}, not {model!r}"

    return check


def wait_ready_blocking(plan: LaunchPlan, *, timeout: float, alive: Callable[[], bool],
                        interval: float = 0.1) -> None:
    """The probe, for callers without an event loop (router_overhead): poll until ready, the process dies
    (`alive()` false) or `timeout` passes; raise RuntimeError saying which."""
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"exited during start-up (last probe: {last})")
        request = urllib.request.Request(plan.url + plan.probe.path, headers=dict(plan.probe.headers))
        try:
            with urllib.request.urlopen(request, timeout=2) as r:
                status, body = r.status, r.read()
        except urllib.error.HTTPError as exc:
            status, body = exc.code, exc.read()
        except OSError as exc:
            status, body = 0, str(exc).encode()
        reason = plan.probe.check(status, body) if status else f"not answering ({body.decode(errors='replace')})"
        if reason is None:
            return
        last = reason
        time.sleep(interval)
    raise RuntimeError(f"not ready within {timeout:g}s: GET {plan.probe.path} {last}")
