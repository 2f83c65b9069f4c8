/* simdrv: the strict simulated CUDA driver. See simdrv.h for what is simulated, simint.h for
 * how the sources divide it. This file: the state, the helpers every source uses, the sorted
 * vectors the ledger keeps its objects in, initialisation and devices, the error strings, the
 * library's table and cuGetProcAddress (with the fake libcuda.so.1's extra exported names). */
#include "simint.h"

#define DRIVER_VERSION 13000

sim_state_t S = {
    .mu = PTHREAD_MUTEX_INITIALIZER,
    .next_id = 1,
    .next_handle = 0x51d000000000ULL,
};

__thread sim_thread_t T;

/* Why the calling thread's last call was refused (reject, or the fault sim_enter fired). */
__thread char last_reason[256];

/* ---------------------------------------------------------------------------------------- */
/* Helpers                                                                                   */

void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("simdrv: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}

CUresult reject(CUresult code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_reason, sizeof last_reason, fmt, ap);
    va_end(ap);
    __atomic_add_fetch(&S.rejected, 1, __ATOMIC_RELAXED);
    if (S.verbose)
        fprintf(stderr, "simdrv: rejected (%d): %s\n", (int)code, last_reason);
    return code;
}

const char *sim_last_reason(void) { return last_reason; }

int sim_lock(void)
{
    pthread_mutex_lock(&S.mu);
    return 1;
}

void sim_unlock_cleanup(int *held)
{
    (void)held;
    pthread_mutex_unlock(&S.mu);
}

void *xcalloc(size_t n, size_t sz)
{
    void *p = calloc(n ? n : 1, sz ? sz : 1);
    if (!p)
        die("out of host memory");
    return p;
}

void *xrealloc(void *p, size_t sz)
{
    p = realloc(p, sz ? sz : 1);
    if (!p)
        die("out of host memory");
    return p;
}

bool is_pow2(size_t x) { return x && !(x & (x - 1)); }
static CUdeviceptr align_up(CUdeviceptr x, size_t a) { return (x + a - 1) & ~(CUdeviceptr)(a - 1); }
size_t gran(void) { return S.cfg.granularity; }
int ndev(void) { return S.cfg.devices; }
bool overlaps(CUdeviceptr a, size_t an, CUdeviceptr b, size_t bn)
{
    return a < b + bn && b < a + an;
}

/* ---------------------------------------------------------------------------------------- */
/* Sorted vectors of intervals                                                               */

/* Index of the first element with ptr > p. */
size_t vec_upper(const sim_vec_t *s, CUdeviceptr p)
{
    size_t lo = 0, hi = s->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (s->v[mid]->ptr <= p)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Element whose [ptr, ptr + span) holds p. */
void *vec_find(const sim_vec_t *s, CUdeviceptr p)
{
    size_t i = vec_upper(s, p);
    if (i == 0)
        return NULL;
    sim_iv_t *e = s->v[i - 1];
    return p - e->ptr < e->span ? e : NULL;
}

void *vec_exact(const sim_vec_t *s, CUdeviceptr p)
{
    size_t i = vec_upper(s, p);
    if (i == 0 || s->v[i - 1]->ptr != p)
        return NULL;
    return s->v[i - 1];
}

void vec_insert(sim_vec_t *s, void *obj)
{
    sim_iv_t *e = obj;
    if (s->n == s->cap) {
        s->cap = s->cap ? s->cap * 2 : 64;
        s->v = xrealloc(s->v, s->cap * sizeof *s->v);
    }
    size_t i = vec_upper(s, e->ptr);
    memmove(s->v + i + 1, s->v + i, (s->n - i) * sizeof *s->v);
    s->v[i] = e;
    s->n++;
}

void vec_remove(sim_vec_t *s, void *obj)
{
    sim_iv_t *e = obj;
    size_t i = vec_upper(s, e->ptr);
    while (i > 0 && s->v[i - 1] != e)
        i--;
    if (i == 0)
        die("vec_remove: element not found");
    i--;
    memmove(s->v + i, s->v + i + 1, (s->n - i - 1) * sizeof *s->v);
    s->n--;
}

bool vec_range_free(const sim_vec_t *s, CUdeviceptr p, size_t size)
{
    size_t i = vec_upper(s, p);
    if (i > 0 && s->v[i - 1]->ptr + s->v[i - 1]->span > p)
        return false;
    return i == s->n || s->v[i]->ptr >= p + size;
}

/* First address >= from, aligned, where size bytes fit below hi; 0 if none. */
CUdeviceptr vec_gap_from(const sim_vec_t *s, CUdeviceptr from, CUdeviceptr hi, size_t size,
                         size_t align)
{
    CUdeviceptr cur = align_up(from, align);
    size_t i = vec_upper(s, cur);
    if (i > 0 && s->v[i - 1]->ptr + s->v[i - 1]->span > cur)
        i--;
    for (;; i++) {
        if (cur < from || cur > hi || hi - cur < size)
            return 0;
        if (i == s->n || s->v[i]->ptr >= cur + size)
            return cur;
        CUdeviceptr end = s->v[i]->ptr + s->v[i]->span;
        if (end > cur)
            cur = align_up(end, align);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Initialisation and devices                                                               */

CUresult SIM_IMPL(cuInit)(unsigned int flags)
{
    SIM_ENTER(cuInit);
    if (flags)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuInit: flags %u", flags);
    if (!S.initialized) {
        sim_config_t c = {0};
        c.devices = (int)env_size("SIM_DEVICES", 0);
        c.memory = env_size("SIM_MEMORY", 0);
        c.host_memory = env_size("SIM_HOST_MEMORY", 0);
        c.granularity = env_size("SIM_GRANULARITY", 0);
        c.va_size = env_size("SIM_VA_SIZE", 0);
        c.no_current_context = true; /* cudart makes the primary context current itself */
        unsigned long total = S.total, calls = S.calls[SIM_E_cuInit];
        reset_locked(&c);
        S.total = total; /* this call stays counted */
        S.calls[SIM_E_cuInit] = calls;
        const char *v = getenv("SIM_VERBOSE");
        if (v && *v && *v != '0')
            S.verbose = true;
        v = getenv("SIM_FORK_STRICT");
        if (v && *v && *v != '0')
            S.fork_strict = true;
    }
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuDriverGetVersion)(int *version)
{
    SIM_ENTER(cuDriverGetVersion);
    if (!version)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuDriverGetVersion: NULL");
    *version = DRIVER_VERSION;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuDeviceGetCount)(int *count)
{
    SIM_ENTER(cuDeviceGetCount);
    NEED_INIT();
    if (!count)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuDeviceGetCount: NULL");
    *count = ndev();
    return CUDA_SUCCESS;
}


CUresult SIM_IMPL(cuDeviceGet)(CUdevice *dev, int ordinal)
{
    SIM_ENTER(cuDeviceGet);
    NEED_INIT();
    if (!dev)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuDeviceGet: NULL");
    NEED_DEVICE(ordinal, "cuDeviceGet");
    *dev = ordinal;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuDeviceGetAttribute)(int *pi, CUdevice_attribute attrib, CUdevice dev)
{
    SIM_ENTER(cuDeviceGetAttribute);
    NEED_INIT();
    if (!pi)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuDeviceGetAttribute: NULL");
    NEED_DEVICE(dev, "cuDeviceGetAttribute");
    if ((int)attrib <= 0 || attrib >= CU_DEVICE_ATTRIBUTE_MAX)
        return reject(CUDA_ERROR_INVALID_VALUE, "cuDeviceGetAttribute: attribute %d", attrib);
    int v = 0;
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: v = 132; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: v = 0x18 + dev; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT: v = 32; break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_INTEGRATED: v = 0; break;
    default: v = 0; break;
    }
    *pi = v;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuDeviceTotalMem)(size_t *bytes, CUdevice dev)
{
    SIM_ENTER(cuDeviceTotalMem);
    NEED_INIT();
    if (!bytes)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuDeviceTotalMem: NULL");
    NEED_DEVICE(dev, "cuDeviceTotalMem");
    *bytes = S.cfg.memory;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuDeviceCanAccessPeer)(int *can, CUdevice dev, CUdevice peer)
{
    SIM_ENTER(cuDeviceCanAccessPeer);
    NEED_INIT();
    if (!can)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuDeviceCanAccessPeer: NULL");
    NEED_DEVICE(dev, "cuDeviceCanAccessPeer");
    NEED_DEVICE(peer, "cuDeviceCanAccessPeer");
    *can = dev != peer && !S.cfg.no_peer_access;
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuDeviceGetName)(char *name, int len, CUdevice dev)
{
    SIM_ENTER(cuDeviceGetName);
    NEED_INIT();
    if (!name || len <= 0)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuDeviceGetName: bad buffer");
    NEED_DEVICE(dev, "cuDeviceGetName");
    snprintf(name, (size_t)len, "Simulated NVIDIA H200 (simdrv)");
    return CUDA_SUCCESS;
}

CUresult SIM_IMPL(cuMemGetInfo)(size_t *free_bytes, size_t *total)
{
    SIM_ENTER(cuMemGetInfo);
    NEED_CTX(dev);
    if (!free_bytes || !total)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuMemGetInfo: NULL");
    *free_bytes = S.cfg.memory - S.used[dev];
    *total = S.cfg.memory;
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------------------------------- */
/* Errors                                                                                    */

static const struct {
    CUresult code;
    const char *name, *text;
} errors[] = {
#define E(c, t) {c, #c, t}
    E(CUDA_SUCCESS, "no error"),
    E(CUDA_ERROR_INVALID_VALUE, "invalid argument"),
    E(CUDA_ERROR_OUT_OF_MEMORY, "out of memory"),
    E(CUDA_ERROR_NOT_INITIALIZED, "initialization error"),
    E(CUDA_ERROR_DEINITIALIZED, "driver shutting down"),
    E(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected"),
    E(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"),
    E(CUDA_ERROR_INVALID_CONTEXT, "invalid device context"),
    E(CUDA_ERROR_MAP_FAILED, "mapping of buffer object failed"),
    E(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, "peer access is not supported between these two devices"),
    E(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"),
    E(CUDA_ERROR_NOT_FOUND, "named symbol not found"),
    E(CUDA_ERROR_NOT_READY, "device not ready"),
    E(CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered"),
    E(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "peer access is already enabled"),
    E(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "peer access has not been enabled"),
    E(CUDA_ERROR_NOT_PERMITTED, "operation not permitted"),
    E(CUDA_ERROR_NOT_SUPPORTED, "operation not supported"),
    E(CUDA_ERROR_UNKNOWN, "unknown error"),
#undef E
};

CUresult SIM_IMPL(cuGetErrorString)(CUresult error, const char **pStr)
{
    SIM_ENTER(cuGetErrorString);
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == error) {
            *pStr = errors[i].text;
            return CUDA_SUCCESS;
        }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult SIM_IMPL(cuGetErrorName)(CUresult error, const char **pStr)
{
    SIM_ENTER(cuGetErrorName);
    if (!pStr)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
        if (errors[i].code == error) {
            *pStr = errors[i].name;
            return CUDA_SUCCESS;
        }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

/* ---------------------------------------------------------------------------------------- */
/* The table and cuGetProcAddress                                                            */

/* Filled by name: every row of the library's table must be one of SIM_FUNCS (see simint.h). */
static const vmh_driver_t table = {
#define SIM_FILL(name, params) .name = SIM_IMPL(name),
    VMH_DRIVER_FUNCS(SIM_FILL)
#undef SIM_FILL
};

const vmh_driver_t *sim_table(void) { return &table; }

static const struct {
    const char *name;
    void *fn;
} procs[] = {
#define SIM_PROC(name, params) {#name, (void *)SIM_IMPL(name)},
    SIM_FUNCS(SIM_PROC)
#undef SIM_PROC
};

/* The CUDA version in which the entry point that cuda.h's name maps to appeared (older
 * versions got the v1 ABI, which the simulation does not have). */
static int min_version(const char *name)
{
    static const struct {
        const char *name;
        int version;
    } v[] = {
        {"cuMemAlloc", 3020}, {"cuMemAllocPitch", 3020}, {"cuMemFree", 3020},
        {"cuMemGetAddressRange", 3020}, {"cuMemGetInfo", 3020}, {"cuDeviceTotalMem", 3020},
        {"cuMemcpyDtoD", 3020}, {"cuMemcpyDtoDAsync", 3020}, {"cuMemcpyHtoD", 3020},
        {"cuMemcpyDtoH", 3020}, {"cuMemcpyHtoDAsync", 3020}, {"cuMemcpyDtoHAsync", 3020},
        {"cuMemsetD8", 3020}, {"cuCtxCreate", 3020}, {"cuCtxDestroy", 4000},
        {"cuCtxPushCurrent", 4000}, {"cuCtxPopCurrent", 4000}, {"cuStreamDestroy", 4000},
        {"cuCtxGetCurrent", 4000}, {"cuCtxSetCurrent", 4000}, {"cuCtxEnablePeerAccess", 4000},
        {"cuCtxDisablePeerAccess", 4000}, {"cuDeviceCanAccessPeer", 4000},
        {"cuIpcGetMemHandle", 4010}, {"cuIpcCloseMemHandle", 4010},
        {"cuIpcOpenMemHandle", 11000}, {"cuDevicePrimaryCtxRetain", 7000},
        {"cuDevicePrimaryCtxRelease", 11000}, {"cuDevicePrimaryCtxReset", 11000},
        {"cuPointerGetAttributes", 7000}, {"cuMemHostAlloc", 2020},
        {"cuMemHostRegister", 6050}, {"cuMemHostUnregister", 4000},
        {"cuMemAllocManaged", 6000}, {"cuStreamBeginCapture", 10010},
        {"cuStreamEndCapture", 10000}, {"cuStreamIsCapturing", 10000},
        {"cuThreadExchangeStreamCaptureMode", 10010}, {"cuGraphDestroy", 10000},
        {"cuMemCreate", 10020}, {"cuMemRelease", 10020}, {"cuMemAddressReserve", 10020},
        {"cuMemAddressFree", 10020}, {"cuMemMap", 10020}, {"cuMemUnmap", 10020},
        {"cuMemSetAccess", 10020}, {"cuMemGetAllocationGranularity", 10020},
        {"cuMemExportToShareableHandle", 10020}, {"cuMemImportFromShareableHandle", 10020},
        {"cuMemRetainAllocationHandle", 11000},
        {"cuMemGetAllocationPropertiesFromHandle", 10020}, {"cuMemFreeAsync", 11020},
        {"cuMemAllocAsync", 11020}, {"cuMemAllocFromPoolAsync", 11020},
        {"cuGetProcAddress", 12000},
    };
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++)
        if (!strcmp(v[i].name, name))
            return v[i].version;
    return 2000;
}

/* Entry points whose ABI depends on the cudaVersion asked for, as the real driver answers
 * (cudaTypedefs.h's PFN_<name>_v<version>): from `since` on, cuGetProcAddress(name) answers fn.
 * The newest row of a name that cuda.h maps (cuCtxCreate -> cuCtxCreate_v4) is procs' own entry;
 * the others are exported under their own names for dlsym, which cuGetProcAddress does not take
 * (it takes base names): those names answer NOT_FOUND there.
 *   - cuCtxGetDevice / cuCtxSynchronize: cuda.h declares the plain ABI with no versioning macro
 *     and the _v2 beside it (PFN_..._v13000); as on the H200 (driver 580) the _v2 is answered from
 *     13000 on, for every flag set.
 *   - cuCtxCreate: _v2 (flags, dev) at 3020, _v3 (exec affinity) at 11040, _v4 (params) at 12050. */
static const struct {
    const char *name;
    int since;
    void *fn;
    const char *own_name; /* the procs name of fn when it is not the plain name's own entry */
} sim_abi_versions[] = {
    {"cuCtxGetDevice", 13000, (void *)SIM_IMPL(cuCtxGetDevice_v2), "cuCtxGetDevice_v2"},
    {"cuCtxSynchronize", 13000, (void *)SIM_IMPL(cuCtxSynchronize_v2), "cuCtxSynchronize_v2"},
    {"cuCtxCreate", 3020, (void *)SIM_IMPL(cuCtxCreate_v2), "cuCtxCreate_v2"},
    {"cuCtxCreate", 11040, (void *)SIM_IMPL(cuCtxCreate_v3), "cuCtxCreate_v3"},
    {"cuCtxCreate", 12050, (void *)SIM_IMPL(cuCtxCreate), NULL},
};
#define N_ABI_VERSIONS (sizeof sim_abi_versions / sizeof sim_abi_versions[0])

/* Whether procs' name is only an export for dlsym, not a cuGetProcAddress symbol. */
static bool not_a_proc_symbol(const char *name)
{
    for (size_t i = 0; i < N_ABI_VERSIONS; i++)
        if (sim_abi_versions[i].own_name && !strcmp(sim_abi_versions[i].own_name, name))
            return true;
    return false;
}

/* The function answered for symbol at cudaVersion (procs' one when no versioned row applies). */
static void *versioned_fn(const char *symbol, int cudaVersion, void *fn)
{
    int best = -1;
    for (size_t i = 0; i < N_ABI_VERSIONS; i++)
        if (!strcmp(sim_abi_versions[i].name, symbol) && cudaVersion >= sim_abi_versions[i].since &&
            (best < 0 || sim_abi_versions[i].since > sim_abi_versions[best].since))
            best = (int)i;
    return best < 0 ? fn : sim_abi_versions[best].fn;
}

/* The per-thread-default-stream variant of symbol, when it has one (the fake libcuda only:
 * the static form's table keeps the legacy stream). */
static void *per_thread_fn(const char *symbol, void *fn)
{
#ifdef SIM_SHARED
    static const struct {
        const char *name;
        void *fn;
    } pt[] = {
#define SIM_PT_ENTRY(plain, exported, params) {#plain, (void *)exported},
        SIM_PT_FUNCS(SIM_PT_ENTRY)
#undef SIM_PT_ENTRY
    };
    for (size_t i = 0; i < sizeof pt / sizeof pt[0]; i++)
        if (!strcmp(pt[i].name, symbol))
            return pt[i].fn;
#else
    (void)symbol;
#endif
    return fn;
}

#ifdef SIM_SHARED
static CUresult getproc_v1(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
#endif

CUresult SIM_IMPL(cuGetProcAddress)(const char *symbol, void **pfn, int cudaVersion,
                                     cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus)
{
    SIM_ENTER(cuGetProcAddress);
    if (!symbol || !pfn)
        return reject(CUDA_ERROR_INVALID_VALUE, "%s", "cuGetProcAddress: NULL");
    if (flags & ~(cuuint64_t)(CU_GET_PROC_ADDRESS_LEGACY_STREAM |
                              CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)) {
        *pfn = NULL;
        return reject(CUDA_ERROR_INVALID_VALUE, "cuGetProcAddress: flags 0x%llx",
                      (unsigned long long)flags);
    }
    for (size_t i = 0; i < sizeof procs / sizeof procs[0]; i++) {
        if (strcmp(procs[i].name, symbol) || not_a_proc_symbol(procs[i].name))
            continue;
        if (cudaVersion < min_version(symbol)) {
#ifdef SIM_SHARED
            if (!strcmp(symbol, "cuGetProcAddress") && cudaVersion >= 11030) {
                *pfn = (void *)getproc_v1;
                if (symbolStatus)
                    *symbolStatus = CU_GET_PROC_ADDRESS_SUCCESS;
                return CUDA_SUCCESS;
            }
#endif
            *pfn = NULL;
            if (symbolStatus)
                *symbolStatus = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
            return reject(CUDA_ERROR_NOT_FOUND, "cuGetProcAddress(%s, %d): version too low",
                          symbol, cudaVersion);
        }
        *pfn = versioned_fn(symbol, cudaVersion, procs[i].fn);
        if (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM)
            *pfn = per_thread_fn(symbol, *pfn);
        if (symbolStatus)
            *symbolStatus = CU_GET_PROC_ADDRESS_SUCCESS;
        return CUDA_SUCCESS;
    }
    *pfn = NULL;
    if (symbolStatus)
        *symbolStatus = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return reject(CUDA_ERROR_NOT_FOUND, "cuGetProcAddress: %s not simulated", symbol);
}

CUresult sim_get_proc_address(const char *symbol, void **pfn, int cudaVersion,
                              cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    return SIM_IMPL(cuGetProcAddress)(symbol, pfn, cudaVersion, flags, status);
}

/* ---------------------------------------------------------------------------------------- */
/* The fake libcuda.so.1's extra exported names                                              */

#ifdef SIM_SHARED
static CUresult getproc_v1(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    return SIM_IMPL(cuGetProcAddress)(symbol, pfn, cudaVersion, flags, NULL);
}

/* The CUDA 11.3 four-argument cuGetProcAddress, under its exported name. */
#undef cuGetProcAddress
CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    return getproc_v1(symbol, pfn, cudaVersion, flags);
}

/* The per-thread-default-stream exports of this file's entry points (see SIM_PT_FUNCS). */
CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream stream)
{
    return SIM_IMPL(cuMemFreeAsync)(dptr, SIM_PT_STREAM(stream));
}

CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t n, CUstream stream)
{
    return SIM_IMPL(cuMemAllocAsync)(dptr, n, SIM_PT_STREAM(stream));
}

CUresult cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t n, CUmemoryPool pool,
                                      CUstream stream)
{
    return SIM_IMPL(cuMemAllocFromPoolAsync)(dptr, n, pool, SIM_PT_STREAM(stream));
}
#endif
