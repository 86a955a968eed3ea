"""GPU profiles: the built-in calibration table, name lookup, and custom profiles from YAML."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from worker.sim.profiles import PROFILES, GpuProfile, load_profiles, profile


def test_builtin_profiles_carry_the_calibration_table() -> None:
    assert set(PROFILES) == {"h100", "a100-80g", "a10g", "l4"}
    h100 = PROFILES["h100"]
    assert (h100.t_w_ms, h100.t_tok_us, h100.t_kv_ns, h100.t_att_ms) == (6.4, 22, 60, 1.1e-6)
    assert [PROFILES[n].memory_total_gib for n in ("h100", "a100-80g", "a10g", "l4")] == [80, 80, 24, 24]
    assert [PROFILES[n].tdp_watts for n in ("h100", "a100-80g", "a10g", "l4")] == [700, 400, 300, 72]
    assert all(p.idle_watts < p.tdp_watts for p in PROFILES.values())


def test_step_time_adds_the_terms_of_the_model_in_milliseconds() -> None:
    p = GpuProfile("t", t_w_ms=3.0, t_tok_us=1000.0, t_kv_ns=1e6, t_att_ms=0.5, kv_pool_tokens=16,
                   c0_ms=1.0, c_seq_ms=0.25)
    # c0 + c_seq*B + hypot(T_w, t_tok*N) + t_kv*ctx + t_att*pairs = 1 + 0.5 + hypot(3, 4) + 3 + 1
    assert p.step_time_ms(num_tokens=4, num_seqs=2, decode_ctx_sum=3, prefill_pairs=2.0) == pytest.approx(10.5)


def test_profile_lookup_knows_aliases_and_prefers_custom_profiles() -> None:
    assert profile("a100") is PROFILES["a100-80g"]
    mine = dataclasses.replace(PROFILES["l4"], name="h100")
    assert profile("h100", {"h100": mine}) is mine
    with pytest.raises(ValueError, match=r"unknown GPU profile 'b200' \(known: a100, a100-80g, a10g, h100, l4\)"):
        profile("b200")


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "profiles.yaml"
    path.write_text(text)
    return str(path)


def test_load_profiles_reads_full_and_based_profiles(tmp_path: Path) -> None:
    loaded = load_profiles(write(tmp_path, """
profiles:
  h100-small-kv: {base: h100, kv_pool_tokens: 50000}
  my-gpu:
    t_w_ms: 20
    t_tok_us: 90
    t_kv_ns: 200
    t_att_ms: 5.0e-6
    kv_pool_tokens: 100000
    memory_total_gib: 48
"""))
    assert loaded["h100-small-kv"] == dataclasses.replace(PROFILES["h100"], name="h100-small-kv", kv_pool_tokens=50000)
    mine = loaded["my-gpu"]
    assert (mine.t_w_ms, mine.kv_pool_tokens, mine.memory_total_gib, mine.c0_ms) == (20, 100000, 48, 2.0)
    assert profile("my-gpu", loaded) is mine


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("profiles: {g: {base: h100, t_w: 1}}", r"profiles\.g\.t_w: unknown field"),
        ("profiles: {g: {t_w_ms: 1, t_tok_us: 1, t_kv_ns: 1, t_att_ms: 1}}", r"profiles\.g\.kv_pool_tokens: required"),
        ("profiles: {g: {base: h100, kv_pool_tokens: 1.5}}", r"profiles\.g\.kv_pool_tokens: must be an integer"),
        ("profiles: {g: {base: h100, t_w_ms: 0}}", r"profiles\.g\.t_w_ms: must be > 0"),
        ("profiles: {g: {base: h100, t_kv_ns: -1}}", r"profiles\.g\.t_kv_ns: must be >= 0"),
        ("profiles: {g: {base: h100, jitter: yes}}", r"profiles\.g\.jitter: must be a finite number"),
        ("profiles: {g: {base: h100, jitter: 2}}", r"profiles\.g\.jitter: is a lognormal sigma"),
        ("profiles: {g: {base: h100, idle_watts: 900}}", r"profiles\.g\.idle_watts: 900 exceeds tdp_watts"),
        ("profiles: {g: {base: b200}}", r"profiles\.g\.base: unknown GPU profile 'b200'"),
        ("profiles: {g: 3}", r"profiles\.g: must be a mapping"),
        ("gpus: {}", r"expected a mapping with one key, 'profiles'"),
        ("profiles: [", r"invalid YAML"),
    ],
)
def test_load_profiles_errors_name_the_field(tmp_path: Path, text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        load_profiles(write(tmp_path, text))
