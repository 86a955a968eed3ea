"""The simulated engine against its calibration and against vLLM's scheduling behaviour, all in virtual time.

Latency expectations come from shared/calibration/README.md (the table's "ITL at B=1") or are recomputed
from the step-time formula with jitter switched off, so a failure points either at the scheduler (wrong
tokens batched in a step) or at the model (wrong price for a step). No test sleeps.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import zlib

import pytest

from worker.sim.engine import EngineConfig, EngineCore, SimRequest, StepResult
from worker.sim.profiles import PROFILES, GpuProfile
from worker.sim.virtual import run_virtual

H100 = PROFILES["h100"]
EXACT = dataclasses.replace(H100, jitter=0.0)  # step durations equal the formula


def engine(profile: GpuProfile = EXACT, seed: int = 0, **config: object) -> EngineCore:
    return EngineCore(profile, EngineConfig(**config), random.Random(seed))  # type: ignore[arg-type]


def prompt(n: int, start: int = 0) -> list[int]:
    """`n` distinct token ids; different `start`s give prompts that share no block."""
    return list(range(start, start + n))


def req(rid: str, n_prompt: int, max_tokens: int, arrival: float = 0.0, start: int | None = None) -> SimRequest:
    # Distinct requests get disjoint ids (crc32, not the per-process salted str hash: runs stay identical).
    start = zlib.crc32(rid.encode()) * 100_000 if start is None else start
    return SimRequest(rid, prompt(n_prompt, start), max_tokens, arrival)


def itls(r: SimRequest) -> list[float]:
    return [b - a for a, b in zip(r.token_times, r.token_times[1:], strict=False)]


def ttft(r: SimRequest) -> float:
    assert r.first_token_at is not None
    return r.first_token_at - r.arrival


def step_until(e: EngineCore, now: float, done: object) -> tuple[float, list[StepResult]]:
    results = []
    while e.has_work():
        res = e.step(now)
        results.append(res)
        now += res.duration
        if callable(done) and done(res):
            break
    return now, results


# -- calibration -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu", "itl_ms"),
    [("h100", 8.5), ("a100-80g", 12.5), ("a10g", 34.0), ("l4", 67.0)],
)
def test_single_stream_itl_is_within_10_percent_of_the_calibration_table(gpu: str, itl_ms: float) -> None:
    # One stream, jitter on: the median inter-token gap is the B=1 decode step (c0 + c_seq + T_w + KV read).
    r = req("a", 512, 300)
    run_virtual(engine(PROFILES[gpu], seed=7), [r])
    median_ms = statistics.median(itls(r)) * 1000
    assert median_ms == pytest.approx(itl_ms, rel=0.10)


def test_jitter_spreads_steps_by_about_its_sigma() -> None:
    r = req("a", 512, 2000)
    run_virtual(engine(H100, seed=3), [r])
    gaps = itls(r)
    spread = statistics.pstdev(gaps) / statistics.mean(gaps)
    assert 0.03 < spread < 0.07  # lognormal sigma 0.05 -> coefficient of variation ~5% (plus a slow KV ramp)


@pytest.mark.parametrize("batch", [1, 8, 64, 256])
def test_decode_step_time_for_a_batch_equals_the_step_time_model(batch: int) -> None:
    e = engine()
    for i in range(batch):
        e.add_request(req(f"r{i}", 100, 50))
    now = 0.0
    while True:  # step through the prefills until a pure decode step of the whole batch
        ctx = sum(len(r.prompt_tokens) + r.num_generated for r in e._running)
        res = e.step(now)
        now += res.duration
        if res.num_decode_seqs == batch and res.num_prefill_tokens == 0:
            break
    expected_ms = EXACT.step_time_ms(batch, batch, ctx, 0.0)
    assert res.duration * 1000 == pytest.approx(expected_ms, rel=1e-9)
    assert len(res.emitted) == batch


def test_decode_step_time_grows_with_batch_size_as_a_roofline() -> None:
    # Small batches ride the weight-streaming floor; large ones add the per-token slope and KV reads.
    def step_ms(b: int) -> float:
        return EXACT.step_time_ms(b, b, b * 300, 0.0)

    assert step_ms(8) / step_ms(1) < 1.05
    assert step_ms(1) < step_ms(8) < step_ms(64) < step_ms(256)
    assert step_ms(256) / step_ms(1) < 4  # so batch 256 decodes > 60x the tokens/s of batch 1
    # A straight line through B=1 and B=256 would overprice B=8 and B=64, which is what the sqrt avoids.
    line = step_ms(1) + (step_ms(256) - step_ms(1)) * 63 / 255
    assert step_ms(64) < line


def test_long_prompt_is_prefilled_in_budget_sized_chunks_and_its_ttft_is_compute_bound() -> None:
    e = engine(max_num_batched_tokens=8192)
    r = req("long", 20_000, 2)
    e.add_request(r)
    _, results = step_until(e, 0.0, lambda res: r.first_token_at is not None)
    assert [res.num_prefill_tokens for res in results] == [8192, 8192, 3616]
    assert [len(res.emitted) for res in results] == [0, 0, 1]  # the first token comes with the last chunk

    chunks = [(0, 8192), (8192, 8192), (16384, 3616)]
    expected = sum(EXACT.step_time_ms(q, 1, 0, q * (prefix + q / 2)) for prefix, q in chunks) / 1000
    assert ttft(r) == pytest.approx(expected, rel=1e-9)
    # Compute-bound: the GEMM slope (t_tok per token) and prefill attention (t_att per token pair, a
    # third of it at 20k tokens) are ~all of it; per-step overheads and the weight-streaming floor vanish.
    gemm = sum(EXACT.t_tok_us * 1e-6 * q for _, q in chunks)
    attention = sum(EXACT.t_att_ms * 1e-3 * q * (prefix + q / 2) for prefix, q in chunks)
    assert (gemm + attention) / ttft(r) > 0.98
    assert 0.25 < attention / ttft(r) < 0.40
    assert 30_000 < 20_000 / ttft(r) < 60_000  # tokens/s: an 8B model on an H100 prefills tens of thousands


def test_chunked_prefill_keeps_decodes_flowing_one_token_per_step() -> None:
    e = engine(max_num_batched_tokens=512)
    a = req("a", 64, 200)
    e.add_request(a)
    now, _ = step_until(e, 0.0, lambda res: a.first_token_at is not None)
    b = req("b", 8000, 1, arrival=now)
    e.add_request(b)
    steps = 0
    while b.first_token_at is None:
        res = e.step(now)
        now += res.duration
        steps += 1
        assert a in res.emitted  # a decodes in every step of b's prefill
        assert res.num_prefill_tokens == min(511, 8000 - 511 * (steps - 1))
    assert steps == 16  # ceil(8000 / 511): the decode takes one token of each 512-token budget
    assert max(itls(a)) < 0.030  # no gap anywhere near b's whole prefill (~0.2 s)


# -- KV cache, preemption ----------------------------------------------------------------------------------


def test_kv_exhaustion_preempts_and_every_request_still_gets_exactly_max_tokens() -> None:
    small = dataclasses.replace(H100, kv_pool_tokens=4096)  # 256 blocks; 24 requests want up to 32 each
    e = engine(small, seed=1)
    reqs = [req(f"r{i}", 200, 300) for i in range(24)]
    for r in reqs:
        e.add_request(r)
    now, peak = 0.0, 0.0
    while e.has_work():
        res = e.step(now)
        now += res.duration
        peak = max(peak, e.kv_usage)
    assert e.num_gpu_blocks == 256
    assert e.num_preemptions > 0
    assert sum(r.preemptions for r in reqs) == e.num_preemptions
    assert peak <= 1.0 and e.kv_usage == 0.0
    for r in reqs:
        assert r.num_generated == len(r.token_times) == r.max_tokens == 300
        assert r.token_times == sorted(r.token_times)
        assert r.finished
    assert e.generation_tokens_total == 24 * 300
    assert e.prompt_tokens_total == 24 * 200  # a re-prefill after preemption is not a new prompt


def test_preemption_takes_the_most_recently_admitted_request_and_requeues_it_first() -> None:
    tiny = dataclasses.replace(H100, kv_pool_tokens=64)  # 4 blocks of 16
    e = engine(tiny, max_num_seqs=2)
    a, b, c = req("a", 15, 40), req("b", 15, 40), req("c", 15, 5)  # c waits: max_num_seqs
    for r in (a, b, c):
        e.add_request(r)
    now = 0.0
    while not (a.preemptions or b.preemptions):
        now += e.step(now).duration
    # Both hold 2 blocks when a needs its third: b, admitted last, gives its blocks back.
    assert (a.preemptions, b.preemptions) == (0, 1)
    assert (e.num_running, e.num_waiting) == (1, 2)
    run_virtual(e, [])
    assert a.finished_at is not None and b.finished_at is not None and c.first_token_at is not None
    assert a.finished_at < b.finished_at
    assert b.num_generated == 40
    # b went back to the *front*: it needs 3 blocks, which only free up when a finishes, and c (1 block,
    # would fit at once) waits behind it, since admission is first-come-first-served without skipping.
    assert c.first_token_at > a.finished_at


def test_admission_reserves_a_block_for_the_first_generated_token() -> None:
    e = engine(dataclasses.replace(H100, kv_pool_tokens=64))  # 4 blocks
    e.add_request(req("aligned", 32, 2))  # ceil((32 + 1) / 16) = 3 blocks
    e.step(0.0)
    assert e.kv_usage == 0.75


def test_max_num_seqs_caps_the_running_batch() -> None:
    e = engine(max_num_seqs=4)
    for i in range(10):
        e.add_request(req(f"r{i}", 50, 20))
    now = 0.0
    while e.has_work():
        now += e.step(now).duration
        assert e.num_running <= 4
        assert e.num_running + e.num_waiting <= 10


def test_add_request_rejects_what_the_kv_cache_could_never_hold() -> None:
    e = engine(dataclasses.replace(H100, kv_pool_tokens=1024))
    assert e.max_model_len == 1024
    e.add_request(req("fits", 1000, 24))
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        e.add_request(req("big", 1000, 25))
    with pytest.raises(ValueError, match="already in the engine"):
        e.add_request(req("fits", 10, 1))


def test_sim_request_rejects_an_empty_prompt_or_no_output() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        SimRequest("x", [], 5, 0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        SimRequest("x", [1], 0, 0.0)


# -- prefix caching ----------------------------------------------------------------------------------------


def test_repeated_prompt_is_served_from_the_prefix_cache_with_a_lower_ttft() -> None:
    e = engine()
    first = SimRequest("first", prompt(4000), 10, 0.0)
    again = SimRequest("again", prompt(4000), 10, 10.0)
    run_virtual(e, [first, again])
    assert first.cached_tokens == 0
    # Every full block but the one holding the last prompt token (one token must be computed to sample).
    assert again.cached_tokens == (4000 - 1) // 16 * 16 == 3984
    assert ttft(again) < ttft(first) / 5
    assert (e.prefix_queries, e.prefix_hits) == (8000, 3984)  # tokens, like vLLM's counters


def test_shared_prefix_hits_only_its_full_blocks() -> None:
    e = engine()
    system = prompt(1000, start=10**6)
    a = SimRequest("a", system + prompt(50, start=1), 5, 0.0)
    b = SimRequest("b", system + prompt(70, start=2), 5, 1.0)
    run_virtual(e, [a, b])
    assert b.cached_tokens == 1000 // 16 * 16  # 62 full blocks; the 63rd mixes system and question


def test_a_prompt_is_only_cached_once_its_blocks_are_computed() -> None:
    # Two identical prompts arriving together both miss: the second is admitted in the same step as the
    # first, before any of the first's blocks hold computed KV.
    e = engine()
    a, b = SimRequest("a", prompt(3000), 5, 0.0), SimRequest("b", prompt(3000), 5, 0.0)
    run_virtual(e, [a, b])
    assert (a.cached_tokens, b.cached_tokens) == (0, 0)


def test_prefix_cache_forgets_least_recently_used_blocks_when_space_is_needed() -> None:
    e = engine(dataclasses.replace(H100, kv_pool_tokens=2048))  # 128 blocks
    old = SimRequest("old", prompt(800, start=1), 2, 0.0)
    filler = SimRequest("filler", prompt(1900, start=10**6), 2, 1.0)  # needs 119 blocks: evicts most of old
    again = SimRequest("again", prompt(800, start=1), 2, 2.0)
    run_virtual(e, [old, filler, again])
    # 128 - 119 = 9 of old's 50 blocks survive, and they are its head (freed last-to-first).
    assert again.cached_tokens == 9 * 16


def test_prefix_caching_can_be_switched_off() -> None:
    e = engine(enable_prefix_caching=False)
    run_virtual(e, [SimRequest("a", prompt(500), 2, 0.0), SimRequest("b", prompt(500), 2, 1.0)])
    assert (e.prefix_queries, e.prefix_hits) == (0, 0)


# -- abort -------------------------------------------------------------------------------------------------


def test_abort_frees_the_blocks_of_a_running_request_and_stops_its_tokens() -> None:
    e = engine()
    a = req("a", 300, 100)
    e.add_request(a)
    now = 0.0
    for _ in range(5):
        now += e.step(now).duration
    assert e.kv_usage > 0 and e.num_running == 1
    e.abort("a")
    assert a.aborted and not a.finished
    assert (e.kv_usage, e.num_running, e.has_work()) == (0.0, 0, False)
    assert e.step(now).idle
    assert a.num_generated == 5


def test_abort_removes_a_waiting_request_and_ignores_unknown_ids() -> None:
    e = engine(batching="static")
    e.add_request(req("a", 10, 5))
    e.abort("nope")
    e.abort("a")
    e.abort("a")
    assert (e.num_waiting, e.has_work()) == (0, False)


# -- batching modes ----------------------------------------------------------------------------------------


def test_static_batching_waits_for_the_window_when_the_batch_is_not_full() -> None:
    e = engine(batching="static", static_batch_size=32, static_window_s=0.05)
    r = req("alone", 100, 3)
    e.add_request(r)
    first = e.step(0.0)
    assert first.idle and first.duration == pytest.approx(0.05)
    assert e.step(0.02).duration == pytest.approx(0.03)  # the window counts from the oldest arrival
    assert not e.step(0.05).idle
    r2 = req("alone2", 100, 3)
    run_virtual(engine(batching="static", static_window_s=0.05), [r2])
    assert 0.05 < ttft(r2) < 0.07


def test_static_batching_starts_at_once_when_the_batch_is_full() -> None:
    e = engine(batching="static", static_batch_size=4)
    for i in range(4):
        e.add_request(req(f"r{i}", 100, 3))
    res = e.step(0.0)
    assert not res.idle and res.num_prefill_tokens == 400


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_batch_modes_admit_nothing_until_the_whole_batch_completes(mode: str) -> None:
    e = engine(batching=mode, static_batch_size=2)
    long, short = req("long", 100, 200), req("short", 100, 5)
    late = req("late", 100, 5, arrival=0.1)  # arrives while `long` is still decoding
    run_virtual(e, [long, short, late])
    assert long.finished_at is not None and late.first_token_at is not None
    assert late.first_token_at > long.finished_at


def test_continuous_batching_admits_a_late_request_at_the_next_step() -> None:
    long, late = req("long", 100, 200), req("late", 100, 5, arrival=0.1)
    run_virtual(engine(), [long, late])
    assert long.finished_at is not None and late.first_token_at is not None
    assert late.first_token_at < long.finished_at
    assert ttft(late) < 0.03


def test_dynamic_batching_takes_everything_waiting_when_the_engine_frees_up() -> None:
    e = engine(batching="dynamic", dynamic_max_batch=3)
    first = req("first", 100, 50)
    later = [req(f"l{i}", 100, 10, arrival=0.05 + i * 0.01) for i in range(4)]
    run_virtual(e, [first, *later])
    assert ttft(first) < 0.02  # no window: it starts alone, at once
    starts = [r.first_token_at for r in later]
    assert starts[0] == starts[1] == starts[2]  # one batch of dynamic_max_batch = 3
    assert starts[3] is not None and starts[0] is not None and starts[3] > starts[0]


def test_engine_config_rejects_bad_values_naming_the_field() -> None:
    with pytest.raises(ValueError, match="batching"):
        EngineConfig(batching="orca")
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="dynamic_max_batch"):
        EngineConfig(dynamic_max_batch=0)
    with pytest.raises(ValueError, match="static_window_s"):
        EngineConfig(static_window_s=-1)
    assert EngineConfig(max_num_seqs=8).batch_limit == 8
    assert EngineConfig(batching="static", static_batch_size=64, max_num_seqs=16).batch_limit == 16


# -- driver, counters, repeatability -----------------------------------------------------------------------


def workload(seed: int, n: int = 200) -> list[SimRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(30.0)
        out.append(SimRequest(f"r{i}", prompt(rng.randint(20, 600), start=i * 10_000), rng.randint(1, 300), t))
    return out


def test_seeded_runs_are_repeatable_and_seeds_differ() -> None:
    def times(seed: int) -> list[list[float]]:
        return [r.token_times for r in run_virtual(engine(H100, seed=seed), workload(5))]

    assert times(1) == times(1)
    assert times(1) != times(2)


def test_counters_add_up_over_a_run() -> None:
    e = engine(H100, seed=4)
    reqs = run_virtual(e, workload(6))
    assert all(r.finished and r.num_generated == r.max_tokens for r in reqs)
    assert e.prompt_tokens_total == sum(len(r.prompt_tokens) for r in reqs)
    assert e.generation_tokens_total == sum(r.max_tokens for r in reqs)
    assert 0 < e.busy_time <= max(r.finished_at or 0 for r in reqs) - reqs[0].arrival + 1e-9
    assert e.step_count >= max(r.max_tokens for r in reqs)
    assert (e.num_running, e.num_waiting, e.kv_usage) == (0, 0, 0.0)


def test_run_virtual_jumps_over_idle_time_without_counting_it_busy() -> None:
    e = engine()
    a, b = req("a", 100, 3), req("b", 100, 3, arrival=3600.0)
    run_virtual(e, [b, a])  # any order in, arrival order out
    assert b.first_token_at is not None and 3600.0 < b.first_token_at < 3600.1
    assert e.busy_time < 0.1
    assert run_virtual(engine(), []) == []
