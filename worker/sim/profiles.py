"""GPU profiles: the constants of the simulated engine's step-time model, one frozen record per GPU.

The model (shared/calibration/README.md) prices one engine iteration that batches N tokens of B sequences:

    T_step = c0 + c_seq*B + sqrt(T_w^2 + (t_tok*N)^2) + t_kv*sum(ctx of decoding seqs)
             + t_att*sum(q*(prefix + q/2) of prefill chunks)

The square root is a smooth roofline: every step streams the weights once (the floor T_w, which is why a
decode step of one sequence costs almost as much as one of sixty-four), and large steps turn into a
per-token compute slope t_tok. A plain a + b*N is 30-40% wrong for small decode batches, so it is not used.
`t_kv` is the memory cost of reading each decoding sequence's KV cache; `t_att` the compute cost of
prefill attention, where a chunk of q new tokens after `prefix` cached ones attends to q*(prefix + q/2)
token pairs. T_w and t_tok were fitted to Vidur's per-layer GEMM profiles; t_kv, t_att, c0 and c_seq are
bandwidth and FLOPs estimates (shared/calibration/SOURCE.md names the data). All for an 8B GQA model
(Llama-3-8B class), BF16, tensor parallelism 1, gpu_memory_utilization 0.9.

Custom profiles come from YAML (`load_profiles`); every field is validated once, when a profile is built,
and errors name the field. Built-in profiles live in a read-only mapping: no module-level mutable state.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import yaml


@dataclass(frozen=True)
class GpuProfile:
    name: str
    t_w_ms: float  # weight-streaming floor of one step, ms
    t_tok_us: float  # compute slope, us per batched token
    t_kv_ns: float  # KV read cost, ns per context token of each decoding sequence
    t_att_ms: float  # prefill attention, ms per q*ctx token pair
    kv_pool_tokens: int  # KV-cache capacity in tokens (the pool is kv_pool_tokens // block_size blocks)
    c0_ms: float = 2.0  # fixed per-step overhead (scheduler, sampling, launch)
    c_seq_ms: float = 0.01  # per-sequence overhead (input preparation, detokenisation)
    jitter: float = 0.05  # sigma of the lognormal factor applied to each step
    # Telemetry only (what NVML would report); the step-time model does not use them.
    memory_total_gib: float = 80.0
    tdp_watts: float = 700.0
    idle_watts: float = 70.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("name: must be a non-empty string")
        for f in dataclasses.fields(self):
            if f.name == "name":
                continue
            value = getattr(self, f.name)
            if f.name == "kv_pool_tokens":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"kv_pool_tokens: must be an integer, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{f.name}: must be a finite number, got {value!r}")
            if f.name in _POSITIVE and value <= 0:
                raise ValueError(f"{f.name}: must be > 0, got {value!r}")
            if value < 0:
                raise ValueError(f"{f.name}: must be >= 0, got {value!r}")
        if self.jitter > 1:
            raise ValueError(f"jitter: is a lognormal sigma; {self.jitter} would make steps vary ~e-fold")
        if self.idle_watts > self.tdp_watts:
            raise ValueError(f"idle_watts: {self.idle_watts} exceeds tdp_watts {self.tdp_watts}")

    def step_time_ms(self, num_tokens: int, num_seqs: int, decode_ctx_sum: int, prefill_pairs: float) -> float:
        """One iteration's duration in ms, without jitter (the engine multiplies the jitter in)."""
        compute = math.hypot(self.t_w_ms, self.t_tok_us * 1e-3 * num_tokens)
        return (
            self.c0_ms
            + self.c_seq_ms * num_seqs
            + compute
            + self.t_kv_ns * 1e-6 * decode_ctx_sum
            + self.t_att_ms * prefill_pairs
        )


_POSITIVE = frozenset({"t_w_ms", "t_tok_us", "kv_pool_tokens", "memory_total_gib", "tdp_watts"})
_FIELDS = tuple(f.name for f in dataclasses.fields(GpuProfile) if f.name != "name")

# The calibration table (shared/calibration/README.md). KV pools: 80 GiB x 0.9 minus 16 GB of weights and
# activations leaves ~55 GiB, at 128 KiB per token (32 layers x 8 KV heads x 128 dims x K,V x 2 bytes);
# 24 GiB cards keep ~3.3 GiB. Idle power is the usual nvidia-smi reading of an idle, clocked-down card.
PROFILES: Mapping[str, GpuProfile] = MappingProxyType(
    {
        "h100": GpuProfile(
            "h100", t_w_ms=6.4, t_tok_us=22, t_kv_ns=60, t_att_ms=1.1e-6, kv_pool_tokens=436_000,
            memory_total_gib=80, tdp_watts=700, idle_watts=70,
        ),
        "a100-80g": GpuProfile(
            "a100-80g", t_w_ms=10.4, t_tok_us=66, t_kv_ns=99, t_att_ms=3.4e-6, kv_pool_tokens=436_000,
            memory_total_gib=80, tdp_watts=400, idle_watts=50,
        ),
        "a10g": GpuProfile(
            "a10g", t_w_ms=32, t_tok_us=200, t_kv_ns=336, t_att_ms=1e-5, kv_pool_tokens=27_000,
            memory_total_gib=24, tdp_watts=300, idle_watts=25,
        ),
        "l4": GpuProfile(
            "l4", t_w_ms=64, t_tok_us=210, t_kv_ns=672, t_att_ms=1e-5, kv_pool_tokens=27_000,
            memory_total_gib=24, tdp_watts=72, idle_watts=16,
        ),
    }
)
ALIASES: Mapping[str, str] = MappingProxyType({"a100": "a100-80g"})


def profile(name: str, custom: Mapping[str, GpuProfile] | None = None) -> GpuProfile:
    """The profile called `name`: custom profiles first (they may redefine a built-in), then built-ins."""
    if custom and name in custom:
        return custom[name]
    found = PROFILES.get(ALIASES.get(name, name))
    if found is None:
        known = sorted({*PROFILES, *ALIASES, *(custom or {})})
        raise ValueError(f"unknown GPU profile {name!r} (known: {', '.join(known)})")
    return found


def load_profiles(path: str) -> dict[str, GpuProfile]:
    """Custom profiles from a YAML file (format in docs/simulator.md).

        profiles:
          h100-small-kv: {base: h100, kv_pool_tokens: 50000}
          my-gpu: {t_w_ms: 20, t_tok_us: 90, t_kv_ns: 200, t_att_ms: 5e-6, kv_pool_tokens: 100000}

    `base` starts from a built-in profile (or alias) and overrides the fields given; without it the five
    model fields are required and the rest take the defaults. Errors are ValueErrors naming the field path.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: invalid YAML: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != {"profiles"} or not isinstance(doc["profiles"], dict):
        raise ValueError(f"{path}: expected a mapping with one key, 'profiles', mapping names to profiles")
    return {str(name): _parse_profile(f"profiles.{name}", str(name), body) for name, body in doc["profiles"].items()}


def _parse_profile(where: str, name: str, body: Any) -> GpuProfile:
    if not isinstance(body, dict):
        raise ValueError(f"{where}: must be a mapping of fields")
    body = dict(body)
    base_name = body.pop("base", None)
    for key in body:
        if key not in _FIELDS:
            raise ValueError(f"{where}.{key}: unknown field (expected one of: base, {', '.join(_FIELDS)})")
    if base_name is not None:
        try:
            base = profile(str(base_name))
        except ValueError as exc:
            raise ValueError(f"{where}.base: {exc}") from None
        fields = {**dataclasses.asdict(base), **body, "name": name}
    else:
        for key in ("t_w_ms", "t_tok_us", "t_kv_ns", "t_att_ms", "kv_pool_tokens"):
            if key not in body:
                raise ValueError(f"{where}.{key}: required (or give 'base' to start from a built-in profile)")
        fields = {**body, "name": name}
    try:
        return GpuProfile(**fields)
    except ValueError as exc:
        raise ValueError(f"{where}.{exc}") from None
