"""The container images the chart renders, each replaced by local programs that behave as the image does.

An image is its ENTRYPOINT, CMD, WORKDIR and ENV, plus the programs on its PATH. Each stand-in keeps the
image's own ENTRYPOINT/CMD and puts small shell shims first on the container's PATH, so the rendered
`command`/`args` (or the image defaults) run unchanged and resolve to:

| image | ENTRYPOINT / CMD (the image's) | programs on PATH |
|---|---|---|
| `fleetroute/fleetroute` (the repository's Dockerfile) | `fleetroute` / `router --help` | `fleetroute` -> `python -m router` from this checkout |
| `vllm/vllm-openai` | `vllm serve` (vLLM's Dockerfile since 0.9; `python3 -m vllm.entrypoints.openai.api_server` before, also accepted) | `vllm serve ARGS` and `python3 -m vllm.entrypoints.openai.api_server ARGS` -> `python -m router sim --vllm ARGS` (worker/sim/cli.py: the simulator reads vLLM's command line; `--time-scale` and `--gpu` are the harness's) |
| `redis`, `valkey/valkey` | `docker-entrypoint.sh` / `redis-server`, WORKDIR /data | the entrypoint script's rules (arguments starting with `-` get `redis-server` put first, and `--protected-mode no`), `redis-server` -> the real server binary (loadtest/redis_server.py finds one), `redis-cli` -> a real `redis-cli` when the machine has one, else a small Python one (PING and other plain commands through redis-py) |

Every image also gets `sleep` scaled by the harness's time scale (preStop hooks: `sleep 5`).

What a pod's network namespace would give is added here too, per image: servers that would listen on every
interface of their namespace are told to listen on the pod's address (`redis-server ... --bind POD_IP`, last
`bind` wins; the router through FLEETROUTE_LISTEN_HOST / FLEETROUTE_ADMIN_HOST), and `redis-cli` talks to the
pod's address (`-h POD_IP` first: a later `-h` wins). Any other image fails the pod with a message naming it.
"""

from __future__ import annotations

import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.redis_server import server_binary

ROOT = Path(__file__).resolve().parent.parent.parent
PYTHON = sys.executable


@dataclass(frozen=True)
class ShimContext:
    pod_ip: str
    time_scale: float  # the kubelet's: preStop sleeps
    sim_time_scale: float  # the simulated engines'
    sim_gpu: str


@dataclass(frozen=True)
class Image:
    name: str
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    workdir: str | None = None  # a path inside the container (rewritten to a volume or the pod's dir)
    env: dict[str, str] = field(default_factory=dict)
    listen_env: bool = False  # the router's FLEETROUTE_*_HOST: set to the pod's address unless rendered

    def shims(self, ctx: ShimContext) -> dict[str, str]:
        scripts = {"sleep": _SLEEP.format(scale=ctx.time_scale)}
        if self.name == "fleetroute":
            scripts["fleetroute"] = f'exec {_q(PYTHON)} -m router "$@"\n'
        elif self.name == "vllm":
            sim = f'{_q(PYTHON)} -m router sim --gpu {_q(ctx.sim_gpu)} --time-scale {ctx.sim_time_scale} --vllm'
            scripts["vllm"] = ('[ "$1" = serve ] || { echo "vllm stand-in: only \'vllm serve\' is emulated, got: $*" >&2; '
                               f'exit 127; }}\nshift\nexec {sim} "$@"\n')
            for python in ("python3", "python"):
                scripts[python] = (f'if [ "$1" = -m ] && [ "$2" = vllm.entrypoints.openai.api_server ]; then\n'
                                   f'  shift 2\n  exec {sim} "$@"\nfi\nexec {_q(PYTHON)} "$@"\n')
        elif self.name == "redis":
            scripts["docker-entrypoint.sh"] = _REDIS_ENTRYPOINT
            scripts["redis-server"] = f'exec {_q(server_binary())} "$@" --bind {ctx.pod_ip}\n'
            real_cli = shutil.which("redis-cli")
            scripts["redis-cli"] = (f'exec {_q(real_cli)} -h {ctx.pod_ip} "$@"\n' if real_cli else
                                    f'exec {_q(PYTHON)} {_q(str(Path(__file__).with_name("redis_cli.py")))} '
                                    f'-h {ctx.pod_ip} "$@"\n')
        return {name: "#!/bin/sh\n" + body for name, body in scripts.items()}


def _q(text: str) -> str:
    return shlex.quote(text)


_SLEEP = ('case "$1" in\n  *[!0-9.]*|"") exec /bin/sleep "$@" ;;\n'
          '  *) exec /bin/sleep "$(awk "BEGIN {{ print $1 * {scale} }}")" ;;\nesac\n')
# docker-library/redis docker-entrypoint.sh, less the user switch: options first -> redis-server; and the
# protected mode off (ports are exposed only by the Service).
_REDIS_ENTRYPOINT = '''if [ "${1#-}" != "$1" ] || [ "${1%.conf}" != "$1" ]; then
  set -- redis-server "$@"
fi
if [ "$1" = redis-server ]; then
  set -- "$@" --protected-mode no
fi
exec "$@"
'''

IMAGES = {
    "fleetroute": Image("fleetroute", ("fleetroute",), ("router", "--help"), listen_env=True,
                        env={"PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}),
    "vllm": Image("vllm", ("vllm", "serve"), (), env={"VLLM_USAGE_SOURCE": "production-docker-image"}),
    "redis": Image("redis", ("docker-entrypoint.sh",), ("redis-server",), workdir="/data"),
}


class UnknownImage(Exception):
    pass


def image_for(reference: str) -> Image:
    """The stand-in of an image reference (`[registry/]repository[:tag][@digest]`)."""
    name = reference.split("@")[0]
    if ":" in name.rsplit("/", 1)[-1]:
        name = name.rsplit(":", 1)[0]
    parts = name.split("/")
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        parts = parts[1:]  # a registry host
    repository = "/".join(parts).removeprefix("library/")
    if repository == "fleetroute" or repository.endswith("/fleetroute"):
        return IMAGES["fleetroute"]
    if repository in ("vllm/vllm-openai", "vllm/vllm-openai-cpu"):
        return IMAGES["vllm"]
    if repository in ("redis", "valkey/valkey", "bitnami/redis"):
        return IMAGES["redis"]
    raise UnknownImage(f"image {reference!r} has no local stand-in (tests/cluster/images.py knows fleetroute, "
                       "vllm/vllm-openai and redis)")
