"""Parsing dcgm-exporter's /metrics (worker/dcgm_metrics.py) from pages shaped like the real exporter's."""

from __future__ import annotations

import pytest

from tests.fake_dcgm import FakeDcgmExporter, FakeGpu, default_fields
from worker.dcgm_metrics import MIB, parse_dcgm_metrics

NS = "inference"


def page(*gpus: FakeGpu) -> str:
    return FakeDcgmExporter(gpus=list(gpus)).render()


def test_each_pod_gets_its_own_gpus_in_protocol_units() -> None:
    gpus = parse_dcgm_metrics(page(
        FakeGpu(0, "GPU-a", default_fields(util=37, fb_used=70_000), pod=(NS, "llama-0", "vllm")),
        FakeGpu(1, "GPU-b", default_fields(util=5), pod=None),  # no pod holds it
        FakeGpu(2, "GPU-c", default_fields(util=80, fb_used=1_000), pod=(NS, "llama-1", "vllm")),
    ))
    by_pod = {g.pod: g for g in gpus}
    assert set(by_pod) == {"llama-0", "llama-1", ""} and by_pod[""].uuid == "GPU-b"
    a = by_pod["llama-0"]
    assert (a.namespace, a.container, a.uuid, a.last_xid) == (NS, "vllm", "GPU-a", 0)
    # The default counter set has no SM_ACTIVE: the engine-active ratio is the busy fraction.
    assert (a.sample.util, a.sample.util_kind) == (pytest.approx(0.37), "dcgm_gr_engine_active")
    # MiB -> bytes; total = used + free + reserved, as NVML's v2 memory info.
    assert a.sample.mem_used_bytes == 70_000 * MIB and a.sample.mem_total_bytes == 81_559 * MIB
    assert (a.sample.temperature_c, a.sample.power_w) == (45.0, 120.5)


@pytest.mark.parametrize(
    ("fields", "util", "kind"),
    [
        pytest.param({"DCGM_FI_PROF_SM_ACTIVE": 0.42}, 0.42, "dcgm_sm_active", id="sm-active-first"),
        pytest.param({"DCGM_FI_PROF_GR_ENGINE_ACTIVE": None}, 0.6, "utilization", id="no-profiling-metrics"),
        pytest.param({"DCGM_FI_PROF_GR_ENGINE_ACTIVE": None, "DCGM_FI_DEV_GPU_UTIL": None}, None, "utilization",
                     id="no-busy-signal"),
    ],
)
def test_busy_fraction_prefers_sm_activity_then_engine_activity_then_the_counter(fields, util, kind) -> None:
    values = {**default_fields(util=60), **fields}
    (gpu,) = parse_dcgm_metrics(page(FakeGpu(0, "GPU-a", {k: v for k, v in values.items() if v is not None},
                                             pod=(NS, "p", "vllm"))))
    assert gpu.sample.util == (pytest.approx(util) if util is not None else None) and gpu.sample.util_kind == kind


def test_health_fields_when_the_counter_set_has_them() -> None:
    fields = {**default_fields(), "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": 0x40, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 2,
              "DCGM_FI_DEV_RETIRED_SBE": 1, "DCGM_FI_DEV_RETIRED_DBE": 3, "DCGM_FI_DEV_XID_ERRORS": 48}
    text = page(FakeGpu(0, "GPU-a", {}, pod=(NS, "p", "vllm")))
    labels = 'gpu="0",UUID="GPU-a",device="nvidia0",container="vllm",namespace="inference",pod="p"'
    text += "".join(f"# TYPE {k} gauge\n{k}{{{labels}}} {v}\n" for k, v in fields.items())
    (gpu,) = parse_dcgm_metrics(text)
    assert (gpu.sample.throttle_reasons, gpu.sample.ecc_uncorrected, gpu.sample.retired_pages) == (0x40, 2, 4)
    assert gpu.last_xid == 48


def test_blank_values_are_absent_not_readings() -> None:
    # Older exporters leaked DCGM's blank sentinels (README: MEMORY_TEMP 9223372036854775794 = INT64 blank + 2).
    labels = 'gpu="0",UUID="GPU-a",container="vllm",namespace="inference",pod="p"'
    text = (f"DCGM_FI_DEV_GPU_TEMP{{{labels}}} 9223372036854775794\n"
            f"DCGM_FI_DEV_POWER_USAGE{{{labels}}} 140737488355328.000000\n"
            f"DCGM_FI_DEV_GPU_UTIL{{{labels}}} 2147483632\n"
            f"DCGM_FI_DEV_FB_USED{{{labels}}} 1000\n")
    (gpu,) = parse_dcgm_metrics(text)
    assert (gpu.sample.temperature_c, gpu.sample.power_w, gpu.sample.util) == (None, None, None)
    assert gpu.sample.mem_used_bytes == 1000 * MIB and gpu.sample.mem_total_bytes is None  # no FB_FREE


def test_old_label_names_and_mig_instances() -> None:
    # --use-old-namespace: pod_name / pod_namespace / container_name and uuid; MIG: GPU_I_PROFILE / GPU_I_ID.
    text = ('DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",uuid="GPU-a",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",'
            'GPU_I_PROFILE="1g.10gb",GPU_I_ID="7",Hostname="h",container_name="vllm",pod_namespace="inference",'
            'pod_name="small-0"} 0.250000\n'
            'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",uuid="GPU-a",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",'
            'GPU_I_PROFILE="1g.10gb",GPU_I_ID="8",Hostname="h",container_name="vllm",pod_namespace="inference",'
            'pod_name="small-1"} 0.750000\n')
    gpus = {g.pod: g for g in parse_dcgm_metrics(text)}
    assert (gpus["small-0"].namespace, gpus["small-0"].uuid, gpus["small-0"].sample.util) == (NS, "GPU-a/7", 0.25)
    assert gpus["small-0"].hostname == "h"
    assert (gpus["small-1"].uuid, gpus["small-1"].sample.util) == ("GPU-a/8", 0.75)


def test_the_exporters_hostname_is_read_under_either_spelling() -> None:
    exporter = FakeDcgmExporter(gpus=[FakeGpu(0, "GPU-a", default_fields(), pod=(NS, "llama-0", "vllm"))],
                                hostname="gpu-node-7")
    assert [g.hostname for g in parse_dcgm_metrics(exporter.render())] == ["gpu-node-7"]
    lower = exporter.render().replace("Hostname=", "hostname=")
    assert [g.hostname for g in parse_dcgm_metrics(lower)] == ["gpu-node-7"]
    assert [g.hostname for g in parse_dcgm_metrics(lower.replace(',hostname="gpu-node-7"', ""))] == [""]


def test_a_page_that_is_not_prometheus_text_raises_value_error() -> None:
    with pytest.raises(ValueError):
        parse_dcgm_metrics('DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a",pod="p" 37\n')
