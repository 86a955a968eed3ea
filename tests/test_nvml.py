"""The NVML sampler through the real `pynvml` against a fake libnvidia-ml.so.1 (tests/fake_nvml/fake_nvml.c).

Each test runs the sampler in a child process whose LD_LIBRARY_PATH holds only the fake, steps it one
sample at a time and changes the fake GPU's state file in between (no sleeps).
"""

from __future__ import annotations

import ctypes.util

import pytest

# The fixtures fake_nvml_dir (session: gcc once), fake_gpu and start_sampler.
pytest_plugins = ["tests.nvml_fixtures"]

GIB = 1024**3
XID_CRITICAL = 0x8  # nvmlEventTypeXidCriticalError
SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap


def expected(**fields: object) -> dict[str, object]:
    """A sample as the child reports it (GpuSample as a dict): defaults of a healthy, idle fake GPU."""
    sample: dict[str, object] = {
        "util": 0.0, "util_kind": "utilization", "mem_used_bytes": 0, "mem_total_bytes": 80 * GIB,
        "temperature_c": 30.0, "power_w": 70.0, "throttle_reasons": 0, "xid_errors": 0, "ecc_uncorrected": 0,
        "retired_pages": 0, "lost": False,
        "count": None, "reported_at": None,  # set only on the node agent's per-endpoint readings
    }
    sample.update(fields)
    return sample


def lost(xid_errors: int | None = 0) -> dict[str, object]:
    """A lost GPU's sample: nothing read but the XID count the sampler already holds."""
    return {**dict.fromkeys(expected()), "util_kind": "utilization", "xid_errors": xid_errors, "lost": True}


def test_a_sample_reports_the_gpu_in_protocol_units_and_follows_its_changes(fake_gpu, start_sampler) -> None:
    fake_gpu.set(name="NVIDIA H200", uuid="GPU-1234", util_gpu=37, mem_total=141 * GIB, mem_used=40 * GIB,
                 temp=61, power_mw=312_456, clocks_event_reasons=SW_POWER_CAP, retired_sbe=2, retired_dbe=1)
    sampler = start_sampler()
    assert sampler.ok("init") == {"name": "NVIDIA H200", "uuid": "GPU-1234"}
    # Percent -> fraction, mW -> W, C as float, bytes as is; retired pages summed over both causes.
    assert sampler.sample() == expected(util=0.37, mem_used_bytes=40 * GIB, mem_total_bytes=141 * GIB,
                                        temperature_c=61.0, power_w=312.456, throttle_reasons=SW_POWER_CAP,
                                        retired_pages=3)

    fake_gpu.set(util_gpu=100, mem_used=127 * GIB, temp=83, power_mw=699_000, clocks_event_reasons=0,
                 ecc_volatile_uncorrected=1, ecc_aggregate_uncorrected=9, ecc_volatile_corrected=5)
    # ECC is the *volatile uncorrected* counter: not the aggregate, not the corrected one.
    assert sampler.sample() == expected(util=1.0, mem_used_bytes=127 * GIB, mem_total_bytes=141 * GIB,
                                        temperature_c=83.0, power_w=699.0, ecc_uncorrected=1, retired_pages=3)
    # Without GPM (the default here) the busy fraction is the utilisation counter, and GPM is not sampled.
    assert "nvmlGpmSampleGet" not in fake_gpu.calls()


def test_memory_used_excludes_driver_reserved_memory(fake_gpu, start_sampler) -> None:
    fake_gpu.set(mem_total=80 * GIB, mem_used=10 * GIB, mem_reserved=1 * GIB)
    sampler = start_sampler()
    sampler.ok("init")
    assert sampler.sample()["mem_used_bytes"] == 10 * GIB  # v2: what is allocated


def test_an_older_driver_without_the_newer_calls_is_read_through_the_older_ones(fake_gpu, start_sampler) -> None:
    # The newer calls answer NVML_ERROR_FUNCTION_NOT_FOUND, which is how pynvml reports a symbol the
    # installed driver lacks.
    newer = ["nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetTemperatureV", "nvmlDeviceGetCurrentClocksEventReasons"]
    fake_gpu.set(missing=",".join(newer), mem_total=80 * GIB, mem_used=10 * GIB, mem_reserved=1 * GIB, temp=55,
                 clocks_event_reasons=SW_POWER_CAP)
    sampler = start_sampler()
    sampler.ok("init")
    first = sampler.sample()
    assert first == expected(mem_used_bytes=11 * GIB, temperature_c=55.0, throttle_reasons=SW_POWER_CAP)  # v1 counts reserved as used
    assert sampler.sample() == first
    calls = fake_gpu.calls()
    assert {name: calls.count(name) for name in newer} == dict.fromkeys(newer, 1)  # tried once, then dropped
    assert calls.count("nvmlDeviceGetTemperature") == 2


def test_unsupported_signals_are_none_without_errors_and_are_not_asked_again(fake_gpu, start_sampler) -> None:
    unsupported = ["nvmlDeviceGetUtilizationRates", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEccErrors",
                   "nvmlDeviceGetRetiredPages", "nvmlDeviceGetCurrentClocksEventReasons",
                   "nvmlDeviceGetCurrentClocksThrottleReasons"]
    # event_types=0: the device offers no events, so registering for XIDs answers NOT_SUPPORTED.
    fake_gpu.set(unsupported=",".join(unsupported), event_types=0, temp=40)
    sampler = start_sampler()
    sampler.ok("init")
    none = expected(util=None, power_w=None, throttle_reasons=None, xid_errors=None, ecc_uncorrected=None,
                    retired_pages=None, temperature_c=40.0)
    assert sampler.sample() == none
    fake_gpu.set(temp=41)
    assert sampler.sample() == {**none, "temperature_c": 41.0}
    calls = fake_gpu.calls()
    assert {name: calls.count(name) for name in unsupported} == dict.fromkeys(unsupported, 1)
    assert "nvmlEventSetWait_v2" not in calls


def test_a_gpu_lost_mid_run_is_reported_lost_and_sampled_again_when_it_answers(fake_gpu, start_sampler) -> None:
    fake_gpu.set(util_gpu=50)
    sampler = start_sampler()
    sampler.ok("init")
    assert sampler.sample()["util"] == 0.5

    fake_gpu.set(lost=1)
    assert sampler.sample() == lost()
    assert sampler.sample() == lost()  # keeps answering, not raising
    assert "GPU is lost" in sampler.stderr()

    fake_gpu.set(lost=0, util_gpu=20)
    assert sampler.sample() == expected(util=0.2)


def test_xid_79_before_the_loss_is_counted_in_the_lost_sample(fake_gpu, start_sampler) -> None:
    sampler = start_sampler()
    sampler.ok("init")
    sampler.sample()
    fake_gpu.set(xids="79", lost=1)  # "GPU has fallen off the bus", then every call answers GPU_IS_LOST
    assert sampler.sample() == lost(xid_errors=1)
    fake_gpu.set(lost=0)
    assert sampler.sample()["xid_errors"] == 1


def test_xid_errors_are_counted_cumulatively_from_start(fake_gpu, start_sampler) -> None:
    fake_gpu.set(xids="13")  # raised before the agent started: not ours to count
    sampler = start_sampler()
    sampler.ok("init")
    assert sampler.sample()["xid_errors"] == 0
    fake_gpu.set(xids="13,31,48")
    assert sampler.sample()["xid_errors"] == 2
    assert sampler.sample()["xid_errors"] == 2  # each event is counted once
    fake_gpu.set(xids="13,31,48,63")
    assert sampler.sample()["xid_errors"] == 3
    assert "XID 48" in sampler.stderr()  # each XID is logged with its code for the operator


def test_gpm_sm_activity_between_consecutive_samples_replaces_the_utilisation_counter(fake_gpu, start_sampler) -> None:
    # The utilisation counter says 100% (a kernel is always running); SM activity tells how busy the SMs are.
    fake_gpu.set(gpm=1, util_gpu=100, gpm_sm_active=0, gpm_sm_cycles=0)
    sampler = start_sampler()
    sampler.ok("init")
    first = sampler.sample()
    assert (first["util"], first["util_kind"]) == (1.0, "utilization")  # no interval yet
    fake_gpu.set(gpm_sm_active=250, gpm_sm_cycles=1000)
    second = sampler.sample()
    assert (second["util"], second["util_kind"]) == (0.25, "gpm_sm_activity")
    fake_gpu.set(gpm_sm_active=1150, gpm_sm_cycles=2000)
    assert sampler.sample()["util"] == pytest.approx(0.9)  # the last interval only, not since start

    fake_gpu.set(lost=1)
    assert sampler.sample() == lost()
    fake_gpu.set(lost=0, gpm_sm_active=1200, gpm_sm_cycles=3000)
    after = sampler.sample()
    assert (after["util"], after["util_kind"]) == (1.0, "utilization")  # no interval spans the loss
    fake_gpu.set(gpm_sm_active=1700, gpm_sm_cycles=4000)
    assert sampler.sample()["util_kind"] == "gpm_sm_activity"


def test_gpm_samples_that_fail_fall_back_to_the_utilisation_counter(fake_gpu, start_sampler) -> None:
    fake_gpu.set(gpm=1, util_gpu=64, missing="nvmlGpmMetricsGet")
    sampler = start_sampler()
    sampler.ok("init")
    for _ in range(2):
        sample = sampler.sample()
        assert (sample["util"], sample["util_kind"]) == (0.64, "utilization")


def test_samples_the_gpu_at_the_given_index(fake_gpu, start_sampler) -> None:
    fake_gpu.set(count=2, util_gpu=10, **{"util_gpu.1": 90, "uuid.1": "GPU-second", "lost.0": 1})
    sampler = start_sampler()
    assert sampler.ok("init", index=1)["uuid"] == "GPU-second"
    assert sampler.sample()["util"] == 0.9


# A host with a real driver always finds its library, so "no library" cannot be produced there.
@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="a real NVIDIA driver is installed")
def test_no_driver_library_raises_nvml_unavailable(start_sampler, tmp_path) -> None:
    empty = tmp_path / "no-driver"
    empty.mkdir()
    sampler = start_sampler(lib_dir=empty)
    assert sampler.request("init") == {"error": "NvmlUnavailable",
                                       "message": "NVML library not found (no NVIDIA driver?)"}


@pytest.mark.parametrize(
    ("state", "index", "message"),
    [
        pytest.param({"init_error": 9}, 0, "NVIDIA kernel driver not loaded (NVML: Driver Not Loaded)",
                     id="library-present-kernel-driver-not-loaded"),
        pytest.param({"init_error": 18}, 0,
                     "NVML library and NVIDIA kernel driver versions differ (driver updated without a reboot?)",
                     id="driver-upgraded-without-reboot"),
        pytest.param({"count": 2}, 2, "no GPU at index 2 (2 visible)", id="index-beyond-the-visible-gpus"),
        pytest.param({"lost": 1}, 0, "GPU 0 is lost (fallen off the bus?)", id="gpu-lost-before-start"),
    ],
)
def test_an_unusable_driver_or_gpu_raises_nvml_unavailable_with_the_reason(
    fake_gpu, start_sampler, state, index, message
) -> None:
    fake_gpu.set(**state)
    sampler = start_sampler()
    assert sampler.request("init", index=index) == {"error": "NvmlUnavailable", "message": message}
    calls = fake_gpu.calls()
    # NVML initialised means NVML shut down again: nothing is left held.
    assert calls.count("nvmlShutdown") == (0 if "init_error" in state else 1)


def test_close_releases_everything_once_and_is_idempotent(fake_gpu, start_sampler) -> None:
    fake_gpu.set(gpm=1)
    sampler = start_sampler()
    sampler.ok("init")
    sampler.sample()
    assert sampler.ok("close") is None
    assert sampler.ok("close") is None
    calls = fake_gpu.calls()
    assert [calls.count(fn) for fn in ("nvmlShutdown", "nvmlEventSetFree", "nvmlGpmSampleFree")] == [1, 1, 2]
    assert sampler.request("sample") == {"error": "RuntimeError", "message": "NvmlSampler.sample() after close()"}
