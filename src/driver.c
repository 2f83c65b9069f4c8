/* Layer 1: the driver table (see driver.h). Owns the dlopen of libcuda.so.1 and the one
 * resolution of every entry point the library calls. */
#include "driver.h"

#include "log.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <string.h>

vmh_driver_t vmh_drv;

enum { DRV_UNLOADED, DRV_READY, DRV_MISSING };
static atomic_int drv_state = DRV_UNLOADED;
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;
static void *drv_handle;
static vmh_getproc_fn drv_getproc;

typedef void *(*dlsym_fn)(void *, const char *);
static _Atomic(dlsym_fn) real_dlsym_ptr;

/* dlsym itself is interposed by the library, so the C library's own is fetched by version:
 * GLIBC_2.2.5 on x86-64 and GLIBC_2.17 on aarch64 exist in every glibc (2.34 moved them into
 * libc and added GLIBC_2.34 beside them). */
void *vmh_real_dlsym(void *handle, const char *symbol)
{
    dlsym_fn f = atomic_load_explicit(&real_dlsym_ptr, memory_order_acquire);
    if (!f) {
        /* The architecture's base version first: a miss goes through dlerror's malloc. */
        static const char *const versions[] = {"GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.34",
                                               "GLIBC_2.0"};
        for (size_t i = 0; !f && i < sizeof versions / sizeof versions[0]; i++)
            f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
        if (!f)
            return NULL;
        atomic_store_explicit(&real_dlsym_ptr, f, memory_order_release);
    }
    return f(handle, symbol);
}

/* cuGetProcAddress answers the newest ABI at the version asked for. For most entries that is
 * the one cuda.h declares (through its _v2 macros), but CUDA 13 added cuCtxGetDevice_v2 and
 * cuCtxSynchronize_v2, which take a context, while cuda.h still declares the plain names with
 * the old ABI and no macro: asking for them at 13000 returns a function of another signature
 * (the H200 run crashed in cuCtxGetDevice_v2). These are asked for at the version of the ABI
 * declared. */
static int abi_version(const char *name)
{
    static const struct {
        const char *name;
        int version;
    } older[] = {
        {"cuCtxGetDevice", 2000},
        {"cuCtxSynchronize", 2000},
    };
    for (size_t i = 0; i < sizeof older / sizeof older[0]; i++)
        if (!strcmp(name, older[i].name))
            return older[i].version;
    return CUDA_VERSION;
}

/* Every entry is fetched for the ABI the headers declare and the legacy default stream,
 * whatever the program asked for: these are the library's own calls. */
static void drv_load(void)
{
    drv_handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NODELETE);
    if (!drv_handle) {
        atomic_store(&drv_state, DRV_MISSING);
        return;
    }
    drv_getproc = (vmh_getproc_fn)vmh_real_dlsym(drv_handle, "cuGetProcAddress_v2");
    if (!drv_getproc) {
        vmh_log("libcuda.so.1 has no cuGetProcAddress_v2 (driver older than CUDA 12.5?): "
                "passing everything through");
        atomic_store(&drv_state, DRV_MISSING);
        return;
    }
    vmh_driver_t t;
    memset(&t, 0, sizeof t);
    bool ok = true;
#define VMH_RESOLVE(name, params)                                                                  \
    do {                                                                                           \
        CUdriverProcAddressQueryResult st;                                                         \
        void *fn = NULL;                                                                           \
        if (drv_getproc(#name, &fn, abi_version(#name), CU_GET_PROC_ADDRESS_DEFAULT, &st) !=       \
                CUDA_SUCCESS ||                                                                    \
            !fn) {                                                                                 \
            vmh_log("driver entry point %s not found", #name);                                     \
            ok = false;                                                                            \
        }                                                                                          \
        memcpy(&t.name, &fn, sizeof fn);                                                           \
    } while (0);
    VMH_DRIVER_FUNCS(VMH_RESOLVE)
#undef VMH_RESOLVE
    if (!ok || t.cuInit(0) != CUDA_SUCCESS) {
        atomic_store(&drv_state, DRV_MISSING);
        return;
    }
    vmh_drv = t;
    atomic_store_explicit(&drv_state, DRV_READY, memory_order_release);
}

bool vmh_driver_ready(void)
{
    int s = atomic_load_explicit(&drv_state, memory_order_acquire);
    if (s == DRV_UNLOADED) {
        pthread_once(&drv_once, drv_load);
        s = atomic_load_explicit(&drv_state, memory_order_acquire);
    }
    return s == DRV_READY;
}

bool vmh_driver_loaded(void)
{
    return atomic_load_explicit(&drv_state, memory_order_acquire) == DRV_READY;
}

void vmh_driver_install(const vmh_driver_t *table)
{
    vmh_drv = *table;
    atomic_store_explicit(&drv_state, DRV_READY, memory_order_release);
}

void *vmh_driver_handle(void)
{
    return drv_handle;
}

vmh_getproc_fn vmh_driver_real_getproc(void)
{
    return drv_getproc;
}
