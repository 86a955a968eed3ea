/*
 * A fake libnvidia-ml.so.1 for tests: the real `pynvml` binding loads it by soname and runs unmodified.
 *
 * Built by tests/fake_nvml/__init__.py:
 *     gcc -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 -o DIR/libnvidia-ml.so.1 fake_nvml.c
 * and found through LD_LIBRARY_PATH=DIR in a subprocess.
 *
 * THE GPU's STATE is read from the file named by $FAKE_NVML_STATE on EVERY call, so a test changes the GPU
 * between two samples by rewriting that file. One `key=value` per line; `key.N=value` overrides `key` for
 * device N. A missing file or key means the default shown:
 *
 *     count=1                     devices visible
 *     init_error=0                nvmlInit* returns this code (9: driver not loaded, 18: RM version mismatch)
 *     name=NVIDIA H100 80GB HBM3  uuid=GPU-fa4e0000-0000-0000-0000-00000000000N
 *     util_gpu=0  util_mem=0      percent (nvmlDeviceGetUtilizationRates)
 *     mem_total=85899345920  mem_used=0  mem_reserved=0   bytes; v1 `used` includes `reserved`, v2 does not
 *     temp=30                     C, GPU sensor only
 *     power_mw=70000              milliwatts
 *     clocks_event_reasons=0      bit mask, for both the ClocksEventReasons and ClocksThrottleReasons calls
 *     ecc_volatile_uncorrected=0  ecc_volatile_corrected=0  ecc_aggregate_uncorrected=0  ecc_aggregate_corrected=0
 *     retired_sbe=0  retired_dbe=0   pages retired for multiple single-bit / double-bit errors
 *     xids=                       comma-separated XID codes raised so far, oldest first (see events below)
 *     event_types=8               event types the device supports (8 = nvmlEventTypeXidCriticalError)
 *     gpm=0                       1: GPM supported (Hopper+)
 *     gpm_sm_active=0  gpm_sm_cycles=0   cumulative counters; SM_UTIL between two GPM samples is
 *                                 100 * (active2 - active1) / (cycles2 - cycles1)
 *     lost=0                      1: every device call returns NVML_ERROR_GPU_IS_LOST (15)
 *     unsupported=FN,FN           these functions return NVML_ERROR_NOT_SUPPORTED (3)
 *     missing=FN,FN               these functions return NVML_ERROR_FUNCTION_NOT_FOUND (13), which pynvml
 *                                 raises exactly as it does for a symbol an older driver lacks
 *
 * EVENTS. An event set remembers how many `xids` existed when a device was registered to it and delivers
 * each later one once, in order (XIDs raised before registration are not delivered, as with the real
 * driver). nvmlEventSetWait never blocks: with nothing pending it answers as if the timeout had expired.
 *
 * CALL LOG. When $FAKE_NVML_LOG names a file, every exported function appends its name to it, one a line,
 * so tests can check what was called (e.g. nvmlShutdown exactly once).
 *
 * Layouts and version words follow nvml.h (CUDA 13, `nvidia-nvml-dev`); the header is not included so that
 * only gcc is needed.
 */

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_FUNCTION_NOT_FOUND 13
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_LIB_RM_VERSION_MISMATCH 18
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_ERROR_UNKNOWN 999

#define STRUCT_VERSION(size, ver) ((unsigned int)((size) | ((ver) << 24U)))
#define EVENT_TYPE_XID_CRITICAL 0x8ULL
#define GPM_METRIC_SM_UTIL 2
#define GPM_METRICS_GET_VERSION 1
#define GPM_SUPPORT_VERSION 1
#define MAX_DEVICES 8
#define LINE_MAX_LEN 512

struct nvmlDevice_st {
    int index;
};
typedef struct nvmlDevice_st *nvmlDevice_t;

typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;
#define NVML_MEMORY_V2 STRUCT_VERSION(sizeof(nvmlMemory_v2_t), 2U)

typedef struct {
    unsigned int version;
    unsigned int sensorType;
    int temperature;
} nvmlTemperature_v1_t;
#define NVML_TEMPERATURE_V1 STRUCT_VERSION(sizeof(nvmlTemperature_v1_t), 1U)

struct nvmlEventSet_st {
    nvmlDevice_t device; /* NULL until a device is registered */
    unsigned long long types;
    unsigned long long delivered; /* index into `xids` of the next event to deliver */
};
typedef struct nvmlEventSet_st *nvmlEventSet_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

#define GPM_SAMPLE_MAGIC 0x47504d53u
struct nvmlGpmSample_st {
    unsigned int magic;
    int filled; /* -1 until nvmlGpmSampleGet, then the device index */
    unsigned long long sm_active;
    unsigned long long sm_cycles;
};
typedef struct nvmlGpmSample_st *nvmlGpmSample_t;

typedef struct {
    unsigned int version;
    unsigned int isSupportedDevice;
} nvmlGpmSupport_t;

typedef struct {
    unsigned int metricId;
    nvmlReturn_t nvmlReturn;
    double value;
    struct {
        char *shortName;
        char *longName;
        char *unit;
    } metricInfo;
} nvmlGpmMetric_t;

/* The callers' array length is NVML_GPM_METRIC_MAX of *their* header (98 in pynvml 12.535, 477 in 13.x):
 * only the first numMetrics entries are touched, so the size does not matter here. */
typedef struct {
    unsigned int version;
    unsigned int numMetrics;
    nvmlGpmSample_t sample1;
    nvmlGpmSample_t sample2;
    nvmlGpmMetric_t metrics[];
} nvmlGpmMetricsGet_t;

static struct nvmlDevice_st devices[MAX_DEVICES] = {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}};
static int init_count;

/* ---- state file and call log ---------------------------------------------------------------------- */

/* The value of `key.dev` if present, else of `key`; 1 if found. dev < 0 looks up `key` only. */
static int state_get(const char *key, int dev, char *out, size_t size) {
    const char *path = getenv("FAKE_NVML_STATE");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f) return 0;
    char specific[128];
    snprintf(specific, sizeof specific, "%s.%d", key, dev);
    char line[LINE_MAX_LEN];
    int found = 0;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = '\0';
        char *eq = strchr(line, '=');
        if (!eq) continue;
        *eq = '\0';
        if (dev >= 0 && strcmp(line, specific) == 0) {
            snprintf(out, size, "%s", eq + 1);
            fclose(f);
            return 1;
        }
        if (strcmp(line, key) == 0) {
            snprintf(out, size, "%s", eq + 1);
            found = 1;
        }
    }
    fclose(f);
    return found;
}

static unsigned long long state_u64(const char *key, int dev, unsigned long long fallback) {
    char value[LINE_MAX_LEN];
    if (!state_get(key, dev, value, sizeof value) || value[0] == '\0') return fallback;
    return strtoull(value, NULL, 0);
}

/* Whether the comma-separated list under `key` names `fn`. */
static int state_lists(const char *key, int dev, const char *fn) {
    char value[LINE_MAX_LEN];
    if (!state_get(key, dev, value, sizeof value)) return 0;
    for (char *item = strtok(value, ", "); item; item = strtok(NULL, ", ")) {
        if (strcmp(item, fn) == 0) return 1;
    }
    return 0;
}

/* The n-th (0-based) XID code in `xids`, and how many there are. */
static unsigned long long xid_at(int dev, unsigned long long n, unsigned long long *count) {
    char value[LINE_MAX_LEN];
    unsigned long long i = 0, code = 0;
    if (state_get("xids", dev, value, sizeof value)) {
        for (char *item = strtok(value, ", "); item; item = strtok(NULL, ", "), i++) {
            if (i == n) code = strtoull(item, NULL, 0);
        }
    }
    *count = i;
    return code;
}

static void log_call(const char *fn) {
    const char *path = getenv("FAKE_NVML_LOG");
    FILE *f = path ? fopen(path, "a") : NULL;
    if (!f) return;
    fprintf(f, "%s\n", fn);
    fclose(f);
}

static int device_index(nvmlDevice_t device) {
    if (device < &devices[0] || device >= &devices[MAX_DEVICES]) return -1;
    return (int)(device - devices);
}

/* The checks every per-device call starts with, in the order the real library reports them. */
static nvmlReturn_t enter(const char *fn, nvmlDevice_t device, int *index) {
    log_call(fn);
    if (state_lists("missing", -1, fn)) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    int i = device_index(device);
    if (i < 0 || (unsigned long long)i >= state_u64("count", -1, 1)) return NVML_ERROR_INVALID_ARGUMENT;
    if (state_u64("lost", i, 0)) return NVML_ERROR_GPU_IS_LOST;
    if (state_lists("unsupported", i, fn)) return NVML_ERROR_NOT_SUPPORTED;
    if (index) *index = i;
    return NVML_SUCCESS;
}

#define ENTER(device, index)                                       \
    do {                                                           \
        nvmlReturn_t entered_ = enter(__func__, (device), (index)); \
        if (entered_ != NVML_SUCCESS) return entered_;             \
    } while (0)

static nvmlReturn_t copy_string(const char *value, char *out, unsigned int length) {
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(value) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, value, strlen(value) + 1);
    return NVML_SUCCESS;
}

/* ---- library lifecycle ---------------------------------------------------------------------------- */

static nvmlReturn_t do_init(const char *fn) {
    log_call(fn);
    nvmlReturn_t error = (nvmlReturn_t)state_u64("init_error", -1, 0);
    if (error != NVML_SUCCESS) return error;
    init_count++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit(void) { return do_init(__func__); }
nvmlReturn_t nvmlInit_v2(void) { return do_init(__func__); }
nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return do_init(__func__);
}

nvmlReturn_t nvmlShutdown(void) {
    log_call(__func__);
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    init_count--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    log_call(__func__);
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    return copy_string("999.99.99-fake", version, length);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    log_call(__func__);
    return copy_string("13.999.99-fake", version, length);
}

/* ---- devices ---------------------------------------------------------------------------------------- */

static nvmlReturn_t get_count(const char *fn, unsigned int *count) {
    log_call(fn);
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = (unsigned int)state_u64("count", -1, 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return get_count(__func__, count); }
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) { return get_count(__func__, count); }

static nvmlReturn_t get_handle(const char *fn, unsigned int index, nvmlDevice_t *device) {
    log_call(fn);
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= MAX_DEVICES || index >= state_u64("count", -1, 1)) return NVML_ERROR_INVALID_ARGUMENT;
    if (state_u64("lost", (int)index, 0)) return NVML_ERROR_GPU_IS_LOST;
    *device = &devices[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return get_handle(__func__, index, device);
}
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    return get_handle(__func__, index, device);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    int i;
    ENTER(device, &i);
    char value[LINE_MAX_LEN];
    if (!state_get("name", i, value, sizeof value)) snprintf(value, sizeof value, "NVIDIA H100 80GB HBM3");
    return copy_string(value, name, length);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    int i;
    ENTER(device, &i);
    char value[LINE_MAX_LEN];
    if (!state_get("uuid", i, value, sizeof value)) {
        snprintf(value, sizeof value, "GPU-fa4e0000-0000-0000-0000-%012d", i);
    }
    return copy_string(value, uuid, length);
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    int i;
    ENTER(device, &i);
    if (!utilization) return NVML_ERROR_INVALID_ARGUMENT;
    utilization->gpu = (unsigned int)state_u64("util_gpu", i, 0);
    utilization->memory = (unsigned int)state_u64("util_mem", i, 0);
    return NVML_SUCCESS;
}

#define DEFAULT_MEM_TOTAL 85899345920ULL /* 80 GiB */

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    int i;
    ENTER(device, &i);
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long reserved = state_u64("mem_reserved", i, 0);
    memory->total = state_u64("mem_total", i, DEFAULT_MEM_TOTAL);
    memory->used = state_u64("mem_used", i, 0) + reserved; /* v1: "Sum of Reserved and Allocated" */
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    int i;
    ENTER(device, &i);
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != NVML_MEMORY_V2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory->total = state_u64("mem_total", i, DEFAULT_MEM_TOTAL);
    memory->reserved = state_u64("mem_reserved", i, 0);
    memory->used = state_u64("mem_used", i, 0);
    memory->free = memory->total - memory->used - memory->reserved;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, unsigned int sensor, unsigned int *temp) {
    int i;
    ENTER(device, &i);
    if (sensor != 0 || !temp) return NVML_ERROR_INVALID_ARGUMENT; /* 0 = NVML_TEMPERATURE_GPU */
    *temp = (unsigned int)state_u64("temp", i, 30);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_v1_t *temperature) {
    int i;
    ENTER(device, &i);
    if (!temperature) return NVML_ERROR_INVALID_ARGUMENT;
    if (temperature->version != NVML_TEMPERATURE_V1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (temperature->sensorType != 0) return NVML_ERROR_INVALID_ARGUMENT;
    temperature->temperature = (int)state_u64("temp", i, 30);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    int i;
    ENTER(device, &i);
    if (!power) return NVML_ERROR_INVALID_ARGUMENT;
    *power = (unsigned int)state_u64("power_mw", i, 70000);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons) {
    int i;
    ENTER(device, &i);
    if (!reasons) return NVML_ERROR_INVALID_ARGUMENT;
    *reasons = state_u64("clocks_event_reasons", i, 0);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device, unsigned long long *reasons) {
    int i;
    ENTER(device, &i);
    if (!reasons) return NVML_ERROR_INVALID_ARGUMENT;
    *reasons = state_u64("clocks_event_reasons", i, 0);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, unsigned int errorType, unsigned int counterType,
                                         unsigned long long *count) {
    static const char *keys[2][2] = {
        /* counterType 0 = volatile, 1 = aggregate; errorType 0 = corrected, 1 = uncorrected */
        {"ecc_volatile_corrected", "ecc_volatile_uncorrected"},
        {"ecc_aggregate_corrected", "ecc_aggregate_uncorrected"},
    };
    int i;
    ENTER(device, &i);
    if (errorType > 1 || counterType > 1 || !count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = state_u64(keys[counterType][errorType], i, 0);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, unsigned int cause, unsigned int *pageCount,
                                       unsigned long long *addresses) {
    int i;
    ENTER(device, &i);
    if (cause > 1 || !pageCount) return NVML_ERROR_INVALID_ARGUMENT;
    /* cause 0 = multiple single-bit ECC errors, 1 = double-bit ECC error */
    unsigned int pages = (unsigned int)state_u64(cause == 0 ? "retired_sbe" : "retired_dbe", i, 0);
    if (*pageCount < pages) {
        *pageCount = pages;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (pages > 0 && !addresses) return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int p = 0; p < pages; p++) addresses[p] = 0x100000ULL * (cause + 1) + 0x1000ULL * p;
    *pageCount = pages;
    return NVML_SUCCESS;
}

/* ---- events ------------------------------------------------------------------------------------------ */

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    log_call(__func__);
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    *set = calloc(1, sizeof **set);
    return *set ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes) {
    int i;
    ENTER(device, &i);
    if (!eventTypes) return NVML_ERROR_INVALID_ARGUMENT;
    *eventTypes = state_u64("event_types", i, EVENT_TYPE_XID_CRITICAL);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set) {
    int i;
    ENTER(device, &i);
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    if (eventTypes & ~state_u64("event_types", i, EVENT_TYPE_XID_CRITICAL)) return NVML_ERROR_NOT_SUPPORTED;
    unsigned long long raised;
    xid_at(i, 0, &raised);
    set->device = device;
    set->types |= eventTypes;
    set->delivered = raised; /* only XIDs raised from now on are delivered */
    return NVML_SUCCESS;
}

static nvmlReturn_t event_wait(const char *fn, nvmlEventSet_t set, nvmlEventData_t *data) {
    log_call(fn);
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    if (!set || !data) return NVML_ERROR_INVALID_ARGUMENT;
    if (!set->device || !(set->types & EVENT_TYPE_XID_CRITICAL)) return NVML_ERROR_TIMEOUT;
    int i = device_index(set->device);
    unsigned long long raised;
    unsigned long long code = xid_at(i, set->delivered, &raised);
    /* Pending events are delivered even from a lost GPU: XID 79 is how a GPU falling off the bus is reported. */
    if (set->delivered < raised) {
        set->delivered++;
        data->device = set->device;
        data->eventType = EVENT_TYPE_XID_CRITICAL;
        data->eventData = code;
        data->gpuInstanceId = 0xFFFFFFFFu;
        data->computeInstanceId = 0xFFFFFFFFu;
        return NVML_SUCCESS;
    }
    if (state_u64("lost", i, 0)) return NVML_ERROR_GPU_IS_LOST;
    return NVML_ERROR_TIMEOUT; /* never blocks: as if the timeout had expired */
}

nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    (void)timeoutms;
    return event_wait(__func__, set, data);
}
nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    (void)timeoutms;
    return event_wait(__func__, set, data);
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    log_call(__func__);
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    free(set);
    return NVML_SUCCESS;
}

/* ---- GPM (GPU Performance Monitoring, Hopper+) ------------------------------------------------------ */

nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t device, nvmlGpmSupport_t *support) {
    int i;
    ENTER(device, &i);
    if (!support) return NVML_ERROR_INVALID_ARGUMENT;
    if (support->version != GPM_SUPPORT_VERSION) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    support->isSupportedDevice = state_u64("gpm", i, 0) ? 1 : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *sample) {
    log_call(__func__);
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    if (!sample) return NVML_ERROR_INVALID_ARGUMENT;
    *sample = calloc(1, sizeof **sample);
    if (!*sample) return NVML_ERROR_UNKNOWN;
    (*sample)->magic = GPM_SAMPLE_MAGIC;
    (*sample)->filled = -1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t sample) {
    log_call(__func__);
    if (!sample || sample->magic != GPM_SAMPLE_MAGIC) return NVML_ERROR_INVALID_ARGUMENT;
    sample->magic = 0;
    free(sample);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t device, nvmlGpmSample_t sample) {
    int i;
    ENTER(device, &i);
    if (!sample || sample->magic != GPM_SAMPLE_MAGIC) return NVML_ERROR_INVALID_ARGUMENT;
    if (!state_u64("gpm", i, 0)) return NVML_ERROR_NOT_SUPPORTED;
    sample->filled = i;
    sample->sm_active = state_u64("gpm_sm_active", i, 0);
    sample->sm_cycles = state_u64("gpm_sm_cycles", i, 0);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *metrics) {
    log_call(__func__);
    if (state_lists("missing", -1, __func__)) return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    if (!metrics) return NVML_ERROR_INVALID_ARGUMENT;
    if (metrics->version != GPM_METRICS_GET_VERSION) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlGpmSample_t a = metrics->sample1, b = metrics->sample2;
    if (!a || !b || a->magic != GPM_SAMPLE_MAGIC || b->magic != GPM_SAMPLE_MAGIC || a->filled < 0 ||
        a->filled != b->filled)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (state_u64("lost", a->filled, 0)) return NVML_ERROR_GPU_IS_LOST;
    for (unsigned int m = 0; m < metrics->numMetrics; m++) {
        nvmlGpmMetric_t *metric = &metrics->metrics[m];
        metric->value = 0.0;
        metric->metricInfo.shortName = metric->metricInfo.longName = metric->metricInfo.unit = NULL;
        if (metric->metricId != GPM_METRIC_SM_UTIL) {
            metric->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
            continue;
        }
        metric->metricInfo.shortName = "sm_util";
        metric->metricInfo.longName = "SM utilization";
        metric->metricInfo.unit = "%";
        if (b->sm_cycles <= a->sm_cycles || b->sm_active < a->sm_active) {
            metric->nvmlReturn = NVML_ERROR_INVALID_ARGUMENT; /* samples not in time order */
            continue;
        }
        metric->nvmlReturn = NVML_SUCCESS;
        metric->value = 100.0 * (double)(b->sm_active - a->sm_active) / (double)(b->sm_cycles - a->sm_cycles);
    }
    return NVML_SUCCESS;
}
