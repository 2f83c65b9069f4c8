/* Layer "driver table" (see driver.h). The only file that finds, opens or calls into
 * libcuda on its own: the dlopen of libcuda.so.1, the one resolution of every entry point the
 * library calls, the real dlsym, and the real definitions the interposer passes calls to. */
#include "driver.h"

#include "log.h"
#include "stats.h"
#include "thread_state.h"
#include "witness.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <string.h>

/* The table itself; vmh_drv (driver.h) reaches it through vmh_driver_call(). */
static vmh_driver_t drv_table;

enum { DRV_UNLOADED, DRV_READY, DRV_MISSING };
static atomic_int drv_state = DRV_UNLOADED;
static pthread_once_t drv_once = PTHREAD_ONCE_INIT;

/* The driver's cuGetProcAddress in the ABI of CUDA 12 (with a status), and of CUDA 11.3. */
typedef CUresult (*getproc_v2_fn)(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                  CUdriverProcAddressQueryResult *status);
typedef CUresult (*getproc_v1_fn)(const char *symbol, void **pfn, int cudaVersion,
                                  cuuint64_t flags);

const vmh_driver_t *vmh_driver_call(void)
{
#ifdef VMH_WITNESS
    vmh_witness_driver_call(); /* none under the heap's locks (witness.h) */
#endif
    vmh_count(VMH_STAT_driver_calls, 1);
    if (vmh_thread.background)
        vmh_count(VMH_STAT_driver_calls_background, 1);
    return &drv_table;
}

/* ---------------------------------------------------------------------------------------------
 * The real dlsym and the real definitions of driver symbols.
 */
static _Atomic(vmh_dlsym_fn) real_dlsym_ptr;

/* Used only if the C library's dlsym cannot be found, which does not happen with glibc. */
static void *dlsym_unavailable(void *handle, const char *symbol)
{
    (void)handle;
    (void)symbol;
    return NULL;
}

/* dlsym itself is interposed by the library, so the C library's own is fetched by version
 * (dlvsym is not interposed). The architecture's base version first: it exists in every glibc
 * (in libdl before 2.34, as a compat alias of the same function in libc since), so the lookup
 * succeeds at once and never takes dlerror's allocating path, which matters because this runs
 * inside the program's dlsym. */
vmh_dlsym_fn vmh_real_dlsym_fn(void)
{
    vmh_dlsym_fn f = atomic_load_explicit(&real_dlsym_ptr, memory_order_acquire);
    if (__builtin_expect(f != NULL, 1))
        return f;
    static const char *const versions[] = {
#if defined(__x86_64__)
        "GLIBC_2.2.5",
#elif defined(__aarch64__) || defined(__powerpc64__)
        "GLIBC_2.17",
#elif defined(__i386__)
        "GLIBC_2.0",
#endif
        "GLIBC_2.34",
    };
    for (size_t i = 0; f == NULL && i < sizeof versions / sizeof versions[0]; i++)
        f = (vmh_dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    if (f == NULL)
        return dlsym_unavailable;
    /* Two threads may race here; both store the same pointer. */
    atomic_store_explicit(&real_dlsym_ptr, f, memory_order_release);
    return f;
}

void *vmh_real_dlsym(void *handle, const char *symbol)
{
    return vmh_real_dlsym_fn()(handle, symbol);
}

bool vmh_dlsym_pseudo_handle(const void *handle)
{
    return handle == RTLD_DEFAULT || handle == RTLD_NEXT;
}

/* libcuda.so.1 if someone loaded it (RTLD_LOCAL, as cudart does), without loading it. NOLOAD
 * takes a reference that is never dropped, which keeps the functions found there valid. */
static void *loaded_libcuda(void)
{
    return dlopen("libcuda.so.1", RTLD_NOLOAD | RTLD_LAZY);
}

void *vmh_driver_next_symbol(const char *symbol)
{
    void *p = vmh_real_dlsym(RTLD_NEXT, symbol);
    if (p == NULL) {
        void *h = loaded_libcuda();
        if (h != NULL)
            p = vmh_real_dlsym(h, symbol);
    }
    return p;
}

/* Calls into the driver like any other, counted. */
void *vmh_driver_proc(const char *symbol, int version, cuuint64_t flags)
{
    void *fn = NULL;
    getproc_v2_fn v2 = (getproc_v2_fn)vmh_driver_next_symbol("cuGetProcAddress_v2");
    if (v2 != NULL) {
        CUdriverProcAddressQueryResult st;
        vmh_count(VMH_STAT_driver_calls, 1);
        if (v2(symbol, &fn, version, flags, &st) != CUDA_SUCCESS)
            return NULL;
        return fn;
    }
    getproc_v1_fn v1 = (getproc_v1_fn)vmh_driver_next_symbol("cuGetProcAddress");
    if (v1 == NULL)
        return NULL;
    vmh_count(VMH_STAT_driver_calls, 1);
    if (v1(symbol, &fn, version, flags) != CUDA_SUCCESS)
        return NULL;
    return fn;
}

/* ---------------------------------------------------------------------------------------------
 * The table.
 */

/* cuGetProcAddress answers the newest ABI at the version asked for. For most entries that is
 * the one cuda.h declares (through its _v2 macros), but CUDA 13 added cuCtxGetDevice_v2 and
 * cuCtxSynchronize_v2, which take a context, while cuda.h still declares the plain names with
 * the old ABI and no macro: asking for them at 13000 returns a function of another signature
 * (a call of cuCtxGetDevice_v2 through it crashed). These are asked for at the version of the ABI
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
    void *handle = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NODELETE);
    if (!handle) {
        atomic_store(&drv_state, DRV_MISSING);
        return;
    }
    getproc_v2_fn drv_getproc = (getproc_v2_fn)vmh_real_dlsym(handle, "cuGetProcAddress_v2");
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
        vmh_count(VMH_STAT_driver_calls, 1);                                                       \
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
    if (ok)
        vmh_count(VMH_STAT_driver_calls, 1); /* the cuInit below, made before the table is set */
    if (!ok || t.cuInit(0) != CUDA_SUCCESS) {
        atomic_store(&drv_state, DRV_MISSING);
        return;
    }
    drv_table = t;
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
    drv_table = *table;
    atomic_store_explicit(&drv_state, DRV_READY, memory_order_release);
}
