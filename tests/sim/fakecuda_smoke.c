/* Smoke test of the fake libcuda.so.1: loaded the way cudart loads the driver (dlopen of
 * "libcuda.so.1", dlsym of cuGetProcAddress_v2, everything else through it), with
 * LD_LIBRARY_PATH=fake_libcuda_dir and SIM_MEMORY=64M. This program also defines cuMemAlloc_v2
 * itself (exported), as a preloaded hook would: the fake's answers must stay its own. */
#include <cuda.h>
#include <dlfcn.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;
#define CHECK(cond)                                                        \
    do {                                                                   \
        if (!(cond)) {                                                     \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            failures++;                                                    \
        }                                                                  \
    } while (0)

/* The "interposer's" definition. */
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    (void)dptr;
    (void)bytesize;
    return (CUresult)999;
}

typedef CUresult (*getproc_t)(const char *, void **, int, cuuint64_t,
                              CUdriverProcAddressQueryResult *);

int main(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "dlopen libcuda.so.1: %s\n", dlerror());
        return 1;
    }
    CHECK(dlsym(lib, "sim_reset") != NULL); /* it is the fake */
    getproc_t gp = (getproc_t)dlsym(lib, "cuGetProcAddress_v2");
    CHECK(gp != NULL);
    CHECK(dlsym(lib, "cuGetProcAddress") != NULL);
    CHECK(dlsym(lib, "cuMemFreeAsync_ptsz") != NULL);
    CHECK(dlsym(lib, "cuMemcpyDtoD_v2_ptds") != NULL);
    CHECK(dlsym(lib, "cuMemAlloc") == NULL); /* v1 names are not simulated */
    /* The round-10 entry points under the real driver's exported names. */
    static const char *const exported[] = {
        "cuCtxCreate_v2", "cuCtxCreate_v3", "cuCtxCreate_v4", "cuCtxDestroy_v2",
        "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxReset_v2", "cuStreamCreate",
        "cuStreamDestroy_v2", "cuStreamBeginCapture_v2", "cuStreamBeginCapture_v2_ptsz",
        "cuStreamEndCapture", "cuStreamEndCapture_ptsz", "cuStreamIsCapturing",
        "cuStreamIsCapturing_ptsz", "cuThreadExchangeStreamCaptureMode", "cuGraphDestroy",
        "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz", "cuMemAllocManaged",
        "cuMemHostAlloc", "cuMemFreeHost", "cuMemHostRegister_v2", "cuMemHostUnregister",
        "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2", "cuMemcpyHtoDAsync_v2",
        "cuMemcpyHtoDAsync_v2_ptsz", "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync_v2_ptsz",
        "cuCtxSetCurrent", "sim_launch_write", "sim_range_mapped_bytes",
    };
    for (size_t i = 0; i < sizeof exported / sizeof exported[0]; i++)
        if (!dlsym(lib, exported[i])) {
            fprintf(stderr, "not exported: %s\n", exported[i]);
            failures++;
        }
    CHECK(dlsym(lib, "reject") == NULL && dlsym(lib, "vec_find") == NULL); /* internals hidden */
    if (!gp)
        return 1;

    CUdriverProcAddressQueryResult st;
    CUresult (*init)(unsigned) = NULL;
    CUresult (*drvver)(int *) = NULL;
    CUresult (*retain)(CUcontext *, CUdevice) = NULL;
    CUresult (*setcur)(CUcontext) = NULL;
    CUresult (*alloc)(CUdeviceptr *, size_t) = NULL;
    CUresult (*freep)(CUdeviceptr) = NULL;
    CUresult (*htod)(CUdeviceptr, const void *, size_t) = NULL;
    CUresult (*dtoh)(void *, CUdeviceptr, size_t) = NULL;
    CUresult (*info)(size_t *, size_t *) = NULL;
    CUresult (*freeasync)(CUdeviceptr, CUstream) = NULL;
    void *self = NULL;
    CHECK(gp("cuInit", (void **)&init, 12000, 0, &st) == CUDA_SUCCESS);
    CHECK(gp("cuDriverGetVersion", (void **)&drvver, 11030, 0, &st) == CUDA_SUCCESS);
    CHECK(gp("cuDevicePrimaryCtxRetain", (void **)&retain, 13000, 0, &st) == CUDA_SUCCESS);
    CHECK(gp("cuCtxSetCurrent", (void **)&setcur, 13000, 0, &st) == CUDA_SUCCESS);
    CHECK(gp("cuMemAlloc", (void **)&alloc, 13000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
             &st) == CUDA_SUCCESS);
    CHECK(gp("cuMemFree", (void **)&freep, 3020, 0, &st) == CUDA_SUCCESS);
    CHECK(gp("cuMemcpyHtoD", (void **)&htod, 13000, 0, &st) == CUDA_SUCCESS);
    CHECK(gp("cuMemcpyDtoH", (void **)&dtoh, 13000, 0, &st) == CUDA_SUCCESS);
    CHECK(gp("cuMemGetInfo", (void **)&info, 13000, 0, &st) == CUDA_SUCCESS);
    CHECK(gp("cuMemFreeAsync", (void **)&freeasync, 12000,
             CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM, &st) == CUDA_SUCCESS);
    CHECK(gp("cuGetProcAddress", &self, 12000, 0, &st) == CUDA_SUCCESS && self == (void *)gp);
    void *create = NULL;
    CHECK(gp("cuCtxCreate", &create, 13000, 0, &st) == CUDA_SUCCESS &&
          create == dlsym(lib, "cuCtxCreate_v4"));
    CHECK(gp("cuCtxCreate", &create, 11040, 0, &st) == CUDA_SUCCESS &&
          create == dlsym(lib, "cuCtxCreate_v3"));
    CHECK(gp("cuStreamBeginCapture", &create, 13000, CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
             &st) == CUDA_SUCCESS && create != NULL);
    void *none = (void *)1;
    CHECK(gp("cuNoSuchSymbol", &none, 13000, 0, &st) == CUDA_ERROR_NOT_FOUND);
    CHECK(none == NULL && st == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
    if (failures)
        return 1;

    /* The fake's cuMemAlloc is its own, not this program's. */
    CHECK((void *)alloc != (void *)cuMemAlloc_v2);

    CUdeviceptr d = 0;
    CHECK(alloc(&d, 16) == CUDA_ERROR_NOT_INITIALIZED);
    int v = 0;
    CHECK(drvver(&v) == CUDA_SUCCESS && v == 13000);
    CHECK(init(0) == CUDA_SUCCESS);
    CHECK(alloc(&d, 16) == CUDA_ERROR_INVALID_CONTEXT); /* cudart makes the context current */
    CUcontext ctx = NULL;
    CHECK(retain(&ctx, 0) == CUDA_SUCCESS && ctx);
    CHECK(setcur(ctx) == CUDA_SUCCESS);
    size_t fr = 0, tot = 0;
    CHECK(info(&fr, &tot) == CUDA_SUCCESS && tot == 64u << 20 && fr == tot);
    CHECK(alloc(&d, 1000) == CUDA_SUCCESS);
    char out[8] = {0};
    CHECK(htod(d + 10, "hello", 6) == CUDA_SUCCESS);
    CHECK(dtoh(out, d + 10, 6) == CUDA_SUCCESS && !strcmp(out, "hello"));
    CUdeviceptr big = 0;
    CHECK(alloc(&big, 1ull << 40) == CUDA_ERROR_OUT_OF_MEMORY && big == 0);
    bool (*empty)(void) = (bool (*)(void))dlsym(lib, "sim_ledger_empty");
    CHECK(empty && !empty());
    CUdeviceptr base = 0;
    CUresult (*range)(CUdeviceptr *, size_t *, CUdeviceptr) =
        (CUresult(*)(CUdeviceptr *, size_t *, CUdeviceptr))dlsym(lib, "cuMemGetAddressRange_v2");
    size_t sz = 0;
    CHECK(range && range(&base, &sz, d + 999) == CUDA_SUCCESS && sz == 1000);
    CHECK(freeasync(base, NULL) == CUDA_SUCCESS);
    CHECK(freep(base) == CUDA_ERROR_INVALID_VALUE);
    CHECK(empty && empty());
    if (failures) {
        void (*dump)(void) = (void (*)(void))dlsym(lib, "sim_ledger_dump");
        if (dump)
            dump();
    }
    printf("%s\n", failures ? "FAILED" : "ok");
    return failures ? 1 : 0;
}
