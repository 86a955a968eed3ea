"""NVML GPU sampler: one GPU's telemetry through NVIDIA's official `pynvml` binding (package nvidia-ml-py).

What is read, and why that way:

- Busy fraction. NVML's utilisation counter (`utilization.gpu`) is the share of the last sample period (1/6 s
  to 1 s, by board) in which *any* kernel ran, so a GPU decoding a single sequence already shows ~100% and
  the number barely separates a light GPU from a saturated one. Hopper and later have GPM (GPU Performance
  Monitoring), whose SM activity (`NVML_GPM_METRIC_SM_UTIL`, the share of SMs busy) is computed between two
  GPM samples and does grow with batch size. So on a GPU with GPM the sampler keeps the previous GPM sample
  between calls and reports SM activity over the interval since the last call (`util_kind` =
  "gpm_sm_activity"); the first call, and the first after a failure or a lost GPU, has no interval yet and
  reports the utilisation counter (`util_kind` = "utilization").
- Memory: `nvmlDeviceGetMemoryInfo_v2`, whose `used` is what is allocated; v1's `used` also counts memory
  the driver reserves for itself (nvml.h: "Sum of Reserved and Allocated"). v1 only on drivers without v2.
- Temperature (GPU sensor): `nvmlDeviceGetTemperatureV` (the plain call is deprecated for CUDA 14), else
  `nvmlDeviceGetTemperature`. Power: `nvmlDeviceGetPowerUsage`, mW -> W.
- Clocks event reasons (why clocks are below their maximum; the bit mask of `nvmlClocksEventReason*`):
  `nvmlDeviceGetCurrentClocksEventReasons` (the name since driver 535), else the older `...ThrottleReasons`.
- ECC: volatile (since the driver loaded) uncorrected errors. Retired pages: both causes, which includes
  pages pending retirement. Ampere and later replaced page retirement by row remapping and answer
  NOT_SUPPORTED, so there it is None.
- XID errors: an NVML event set registered for `nvmlEventTypeXidCriticalError`, drained with timeout 0 at
  every sample; the count is cumulative since the sampler started, and each XID is logged with its code.

Failure model, so that the agent can publish something every interval:

- NVML_ERROR_GPU_IS_LOST from any call makes the whole sample `GpuSample(lost=True)` (with the XID count:
  XID 79, "fallen off the bus", arrives just before the loss and is counted because events are drained
  first). The sampler keeps its handle and keeps asking; a GPU that answers again is sampled normally.
- An answer meaning "not here" (NOT_SUPPORTED, FUNCTION_NOT_FOUND: the driver lacks the symbol,
  ARGUMENT_VERSION_MISMATCH: it lacks that struct version) drops that way of reading for good and tries the
  next, older one if any, else the signal is None from then on. Support depends on the board, the driver
  and modes that change only with a reset, so an unsupported signal costs one call and one debug line, not
  one per interval.
- Any other NVMLError leaves that signal None in this sample only, logged at debug.
- `NvmlSampler()` raises `NvmlUnavailable` with a one-line reason when there is no library, no driver or no
  such GPU: the agent then runs without GPU telemetry or with the simulator.

NVML calls are made directly on the event loop: they are answered from the driver in microseconds and the
event set is polled without waiting, so nothing blocks. `sample()` is async only to share one protocol with
the simulator-backed sampler. pynvml keeps the loaded library module-global and NVML counts
nvmlInit/nvmlShutdown pairs, so several samplers (one per GPU) can live in one process: each inits once and
shuts down once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import pynvml

from worker.protocol import GpuSample

log = logging.getLogger("fleetroute.nvml")

T = TypeVar("T")

# Answers that mean "this way of reading does not exist on this GPU/driver", as opposed to "failed this time".
_ABSENT = frozenset({
    pynvml.NVML_ERROR_NOT_SUPPORTED,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
    pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
})

_INIT_REASONS = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: "NVML library not found (no NVIDIA driver?)",
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "NVIDIA kernel driver not loaded (NVML: Driver Not Loaded)",
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH:
        "NVML library and NVIDIA kernel driver versions differ (driver updated without a reboot?)",
    pynvml.NVML_ERROR_NO_PERMISSION: "no permission to use NVML (is the GPU device exposed to this container?)",
}

# More than this many events in one interval is a storm; the rest are taken at the next sample.
MAX_EVENTS_PER_SAMPLE = 256


class NvmlUnavailable(Exception):
    """No NVML library or driver, or no such GPU. str() is a one-line reason."""


def _optional(name: str) -> Callable[..., Any] | None:
    """A pynvml function that older bindings lack (None then), e.g. nvmlDeviceGetTemperatureV before 12.550."""
    return getattr(pynvml, name, None)


def _call(name: str, *args: Any) -> tuple[str, Callable[[], Any] | None]:
    """A way of reading for _Reading: pynvml's `name` applied to args, or None where the binding lacks it."""
    fn = _optional(name)
    return name, (None if fn is None else lambda: fn(*args))


def _quietly(what: str, fn: Callable[..., Any], *args: Any) -> None:
    """Release something; a failure there changes nothing for the caller, so it is only logged."""
    try:
        fn(*args)
    except pynvml.NVMLError as err:
        log.debug("%s failed: %s", what, err)


class _Reading(Generic[T]):
    """One signal and its ways of reading it, newest API first. A way this GPU/driver lacks is dropped."""

    __slots__ = ("_gpu", "_name", "_ways")

    def __init__(self, gpu: str, name: str, *ways: tuple[str, Callable[[], T] | None]) -> None:
        self._gpu = gpu
        self._name = name
        self._ways = [(label, fn) for label, fn in ways if fn is not None]

    def read(self) -> T | None:
        """The value, or None. Raises pynvml.NVMLError_GpuIsLost."""
        while self._ways:
            label, fn = self._ways[0]
            try:
                return fn()
            except pynvml.NVMLError_GpuIsLost:
                raise
            except pynvml.NVMLError as err:
                if err.value not in _ABSENT:
                    log.debug("%s: %s unreadable this time (%s: %s)", self._gpu, self._name, label, err)
                    return None
                self._ways.pop(0)
                then = f"trying {self._ways[0][0]}" if self._ways else "not read again"
                log.debug("%s: %s: %s answered %s; %s", self._gpu, self._name, label, err, then)
        return None


class _GpmSmActivity:
    """SM activity between consecutive GPM samples: two sample buffers, swapped at each call."""

    __slots__ = ("_gpu", "_handle", "_samples", "_primed")

    def __init__(self, gpu: str, handle: Any, samples: tuple[Any, Any]) -> None:
        self._gpu = gpu
        self._handle = handle
        self._samples: tuple[Any, Any] | None = samples  # (previous, spare); None once GPM proved unusable
        self._primed = False  # whether `previous` holds a sample taken by the last call

    @classmethod
    def open(cls, gpu: str, handle: Any) -> _GpmSmActivity | None:
        """None where the GPU has no GPM (before Hopper, or in MIG mode) or the binding/driver predate it."""
        query, alloc = _optional("nvmlGpmQueryDeviceSupport"), _optional("nvmlGpmSampleAlloc")
        if query is None or alloc is None:
            return None
        try:
            if not query(handle).isSupportedDevice:
                log.debug("%s: no GPM; busy fraction from the utilisation counter", gpu)
                return None
        except pynvml.NVMLError as err:
            log.debug("%s: GPM support query failed (%s); busy fraction from the utilisation counter", gpu, err)
            return None
        samples: list[Any] = []
        try:
            samples.extend((alloc(), alloc()))
        except pynvml.NVMLError as err:
            log.debug("%s: GPM sample allocation failed: %s", gpu, err)
            for sample in samples:
                _quietly("nvmlGpmSampleFree", pynvml.nvmlGpmSampleFree, sample)
            return None
        return cls(gpu, handle, (samples[0], samples[1]))

    def forget(self) -> None:
        """The next interval must not start from the last sample (the GPU was lost in between)."""
        self._primed = False

    def read(self) -> float | None:
        """SM activity in [0, 1] since the previous call, or None (no previous sample, or GPM failed)."""
        if self._samples is None:
            return None
        previous, current = self._samples
        try:
            pynvml.nvmlGpmSampleGet(self._handle, current)
        except pynvml.NVMLError_GpuIsLost:
            raise
        except pynvml.NVMLError as err:
            self._primed = False
            if err.value in _ABSENT:
                log.debug("%s: GPM sampling answered %s; utilisation counter from now on", self._gpu, err)
                self.close()
            else:
                log.debug("%s: GPM sample failed: %s", self._gpu, err)
            return None
        self._samples = (current, previous)  # the newest sample starts the next interval
        if not self._primed:
            self._primed = True
            return None
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = 1
        request.sample1 = previous
        request.sample2 = current
        request.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
        try:
            pynvml.nvmlGpmMetricsGet(request)
        except pynvml.NVMLError_GpuIsLost:
            raise
        except pynvml.NVMLError as err:
            log.debug("%s: GPM metrics failed: %s", self._gpu, err)
            return None
        metric = request.metrics[0]
        if metric.nvmlReturn != pynvml.NVML_SUCCESS:
            log.debug("%s: GPM SM activity unavailable: %s", self._gpu, pynvml.NVMLError(metric.nvmlReturn))
            return None
        return min(1.0, max(0.0, metric.value / 100.0))

    def close(self) -> None:
        if self._samples is not None:
            for sample in self._samples:
                _quietly("nvmlGpmSampleFree", pynvml.nvmlGpmSampleFree, sample)
            self._samples = None


class _XidCounter:
    """XID errors since start, from an NVML event set polled without waiting."""

    __slots__ = ("_gpu", "_events", "count")

    def __init__(self, gpu: str, events: Any) -> None:
        self._gpu = gpu
        self._events = events
        self.count = 0

    @classmethod
    def open(cls, gpu: str, handle: Any) -> _XidCounter | None:
        """None where the GPU or driver has no XID events (or, e.g. in some containers, does not allow them)."""
        try:
            events = pynvml.nvmlEventSetCreate()
        except pynvml.NVMLError as err:
            log.debug("%s: no NVML event set (%s); XID errors not counted", gpu, err)
            return None
        try:
            pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, events)
        except pynvml.NVMLError as err:
            log.debug("%s: XID events unavailable (%s); XID errors not counted", gpu, err)
            _quietly("nvmlEventSetFree", pynvml.nvmlEventSetFree, events)
            return None
        return cls(gpu, events)

    def drain(self) -> int:
        """Take the pending events; the count so far. Raises pynvml.NVMLError_GpuIsLost."""
        for _ in range(MAX_EVENTS_PER_SAMPLE):
            try:
                event = pynvml.nvmlEventSetWait(self._events, 0)
            except pynvml.NVMLError_Timeout:
                break
            except pynvml.NVMLError_GpuIsLost:
                raise
            except pynvml.NVMLError as err:
                log.debug("%s: reading XID events failed: %s", self._gpu, err)
                break
            if event.eventType & pynvml.nvmlEventTypeXidCriticalError:
                self.count += 1
                log.warning("%s: XID %d (critical error event)", self._gpu, event.eventData)
        return self.count

    def close(self) -> None:
        _quietly("nvmlEventSetFree", pynvml.nvmlEventSetFree, self._events)


def _device_reason(index: int, err: pynvml.NVMLError) -> str:
    if isinstance(err, pynvml.NVMLError_InvalidArgument):
        try:
            return f"no GPU at index {index} ({pynvml.nvmlDeviceGetCount()} visible)"
        except pynvml.NVMLError:
            return f"no GPU at index {index}"
    if isinstance(err, pynvml.NVMLError_GpuIsLost):
        return f"GPU {index} is lost (fallen off the bus?)"
    return f"GPU {index} unusable: NVML: {err}"


def gpu_count() -> int:
    """How many GPUs NVML shows (all of the node's where the container sees them all). Raises NvmlUnavailable."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise NvmlUnavailable(_INIT_REASONS.get(err.value, f"NVML initialisation failed: {err}")) from err
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError as err:
        raise NvmlUnavailable(f"NVML cannot count the GPUs: {err}") from err
    finally:
        _quietly("nvmlShutdown", pynvml.nvmlShutdown)


class NvmlSampler:
    """Samples one GPU through NVML. Construct, `await sample()` every interval, `close()` at the end."""

    name: str
    uuid: str

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self._closed = True  # until NVML is initialised there is nothing for close() to undo
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            raise NvmlUnavailable(_INIT_REASONS.get(err.value, f"NVML initialisation failed: {err}")) from err
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.name = pynvml.nvmlDeviceGetName(handle)
            self.uuid = pynvml.nvmlDeviceGetUUID(handle)
        except pynvml.NVMLError as err:
            reason = _device_reason(index, err)
            _quietly("nvmlShutdown", pynvml.nvmlShutdown)
            raise NvmlUnavailable(reason) from err
        self._closed = False
        self._lost = False
        gpu = self._label = f"GPU {index} ({self.uuid})"
        self._util = _Reading(
            gpu, "utilisation",
            ("nvmlDeviceGetUtilizationRates", lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0),
        )
        self._memory = _Reading(
            gpu, "memory",
            ("nvmlDeviceGetMemoryInfo_v2", lambda: _used_total(handle, pynvml.nvmlMemory_v2)),
            ("nvmlDeviceGetMemoryInfo", lambda: _used_total(handle, None)),
        )
        self._temperature = _Reading(
            gpu, "temperature",
            _call("nvmlDeviceGetTemperatureV", handle, pynvml.NVML_TEMPERATURE_GPU),
            _call("nvmlDeviceGetTemperature", handle, pynvml.NVML_TEMPERATURE_GPU),
        )
        self._power_mw = _Reading(gpu, "power", _call("nvmlDeviceGetPowerUsage", handle))
        self._clock_reasons = _Reading(
            gpu, "clocks event reasons",
            _call("nvmlDeviceGetCurrentClocksEventReasons", handle),
            _call("nvmlDeviceGetCurrentClocksThrottleReasons", handle),
        )
        self._ecc = _Reading(
            gpu, "ECC errors",
            _call("nvmlDeviceGetTotalEccErrors", handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                  pynvml.NVML_VOLATILE_ECC),
        )
        self._retired = _Reading(
            gpu, "retired pages",
            ("nvmlDeviceGetRetiredPages", lambda: sum(
                len(pynvml.nvmlDeviceGetRetiredPages(handle, cause)) for cause in (
                    pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                    pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
                ))),
        )
        self._gpm = _GpmSmActivity.open(gpu, handle)
        self._xids = _XidCounter.open(gpu, handle)
        log.info("%s: %s; busy fraction from %s; XID errors %s", gpu, self.name,
                 "GPM SM activity" if self._gpm else "the utilisation counter",
                 "counted" if self._xids else "not available")

    async def sample(self) -> GpuSample:
        """One reading. A GPU problem never raises: a lost GPU gives lost=True, an unreadable signal None."""
        if self._closed:
            raise RuntimeError("NvmlSampler.sample() after close()")
        try:
            sample = self._read()
        except pynvml.NVMLError_GpuIsLost:
            if self._gpm is not None:
                self._gpm.forget()
            if not self._lost:
                log.warning("%s: GPU is lost (NVML_ERROR_GPU_IS_LOST); reporting it lost", self._label)
            self._lost = True
            return GpuSample(lost=True, xid_errors=self._xids.count if self._xids else None)
        if self._lost:
            log.info("%s: GPU answers again", self._label)
            self._lost = False
        return sample

    def _read(self) -> GpuSample:
        # Events first: the XID that announces a loss is counted even when the calls after it fail.
        xids = self._xids.drain() if self._xids else None
        sm_activity = self._gpm.read() if self._gpm else None
        if sm_activity is not None:
            util, util_kind = sm_activity, "gpm_sm_activity"
        else:
            util, util_kind = self._util.read(), "utilization"
        memory = self._memory.read()
        temperature = self._temperature.read()
        power_mw = self._power_mw.read()
        return GpuSample(
            util=util,
            util_kind=util_kind,
            mem_used_bytes=memory[0] if memory else None,
            mem_total_bytes=memory[1] if memory else None,
            temperature_c=float(temperature) if temperature is not None else None,
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            throttle_reasons=self._clock_reasons.read(),
            xid_errors=xids,
            ecc_uncorrected=self._ecc.read(),
            retired_pages=self._retired.read(),
        )

    def close(self) -> None:
        """Free the event set and GPM samples and shut NVML down; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._xids is not None:
            self._xids.close()
        if self._gpm is not None:
            self._gpm.close()
        _quietly("nvmlShutdown", pynvml.nvmlShutdown)


def _used_total(handle: Any, version: int | None) -> tuple[int, int]:
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle, version=version)
    return int(memory.used), int(memory.total)
