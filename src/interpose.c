/* Layer 6: the interposed entry points. They decide, call by call, whether the library serves
 * a request (heap.h) or the real driver answers it, untouched.
 *
 * How programs reach the driver, and where this file stands in each path (driver-facts.md 1):
 *   - cudart (static and shared) does dlopen("libcuda.so.1"), dlsym(h, "cuGetProcAddress_v2"),
 *     then fetches ~440 entry points through it (versions 11030/12000/13000, flags 0 and
 *     CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM): the dlsym wrapper hands out our
 *     cuGetProcAddress*, whose answers carry our wrappers for the few entry points we interpose;
 *   - PyTorch and others dlsym driver functions themselves on the libcuda handle: same wrapper;
 *   - programs linked with -lcuda bind to our exported symbols (we are preloaded, so first).
 *
 * Rules this file keeps (prior-art.md 1, HAMi-core's traps):
 *   - dlsym never initialises anything (HAMi-core#52: initialising inside a cuGetExportTable
 *     lookup hung CUDA 12.8) and never recurses: the real dlsym comes from dlvsym, resolved once
 *     into an atomic; no lock of ours, no malloc, no stdio on that path. Options and the driver
 *     table are loaded at the first interposed *call*, never at a lookup, so a process that never
 *     calls CUDA sees nothing (no output, no driver load, no option parsing).
 *   - Every lookup first asks the real driver, so symbolStatus, version and per-thread-stream
 *     semantics stay the driver's; a result is replaced only when the driver resolved exactly
 *     the ABI our wrapper implements (HAMi-core#57: a newer ABI handed to an older caller).
 *   - Each wrapper remembers the real function per variant (legacy / per-thread stream), so a
 *     pass-through call reaches exactly what the program would have called.
 *   - A thread-local depth guard: a call that arrives while this thread is already inside the
 *     library (the driver calling back, or a hook firing during our own initialisation) goes
 *     straight to the real driver.
 *   - No handle is ever NULL when we call the real dlsym (HAMi-core PR #215: dlsym(NULL, ...)
 *     is RTLD_DEFAULT, which finds our own symbols again: endless recursion).
 *
 * Codes: every entry point answers what the native call answers in the same situation; inputs
 * the native call rejects (NULL out-pointers, size 0, bad element sizes, free of 0) are passed to
 * the real driver so that the code is its own, not a guess.
 */
#include <cuda.h>
#include <cudaTypedefs.h>

#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "driver.h"
#include "heap.h"
#include "lifetime.h"
#include "ipc.h"
#include "log.h"
#include "options.h"
#include "stats.h"

/* cuda.h maps cuGetProcAddress to cuGetProcAddress_v2 (the CUDA 12 ABI); the driver exports both
 * names, and the plain one is the 4-argument CUDA 11.3 ABI, which we define too. */
#undef cuGetProcAddress

#define IP_LIKELY(x) __builtin_expect(!!(x), 1)
#define IP_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define IP_EXPORT __attribute__((visibility("default")))

/* ---------------------------------------------------------------------------------------------
 * The variants: one per ABI we interpose. X(id, exported name, implementation, ABI type). The
 * ABI type is cudaTypedefs.h's PFN for the version that introduced that exact signature.
 */
#define IP_VARIANTS(X)                                                                             \
    X(GETPROC_V1, "cuGetProcAddress", ip_cuGetProcAddress, PFN_cuGetProcAddress_v11030)           \
    X(GETPROC_V2, "cuGetProcAddress_v2", ip_cuGetProcAddress_v2, PFN_cuGetProcAddress_v12000)     \
    X(MEM_ALLOC, "cuMemAlloc_v2", ip_cuMemAlloc_v2, PFN_cuMemAlloc_v3020)                         \
    X(MEM_ALLOC_PITCH, "cuMemAllocPitch_v2", ip_cuMemAllocPitch_v2, PFN_cuMemAllocPitch_v3020)    \
    X(MEM_FREE, "cuMemFree_v2", ip_cuMemFree_v2, PFN_cuMemFree_v3020)                             \
    X(MEM_FREE_ASYNC, "cuMemFreeAsync", ip_cuMemFreeAsync, PFN_cuMemFreeAsync_v11020)             \
    X(MEM_FREE_ASYNC_PTSZ, "cuMemFreeAsync_ptsz", ip_cuMemFreeAsync_ptsz,                          \
      PFN_cuMemFreeAsync_v11020_ptsz)                                                              \
    X(MEM_GET_ADDRESS_RANGE, "cuMemGetAddressRange_v2", ip_cuMemGetAddressRange_v2,                \
      PFN_cuMemGetAddressRange_v3020)                                                              \
    X(POINTER_GET_ATTRIBUTE, "cuPointerGetAttribute", ip_cuPointerGetAttribute,                    \
      PFN_cuPointerGetAttribute_v4000)                                                             \
    X(POINTER_GET_ATTRIBUTES, "cuPointerGetAttributes", ip_cuPointerGetAttributes,                 \
      PFN_cuPointerGetAttributes_v7000)                                                            \
    X(MEM_GET_INFO, "cuMemGetInfo_v2", ip_cuMemGetInfo_v2, PFN_cuMemGetInfo_v3020)                \
    X(IPC_GET_MEM_HANDLE, "cuIpcGetMemHandle", ip_cuIpcGetMemHandle, PFN_cuIpcGetMemHandle_v4010) \
    X(IPC_OPEN_MEM_HANDLE, "cuIpcOpenMemHandle_v2", ip_cuIpcOpenMemHandle_v2,                      \
      PFN_cuIpcOpenMemHandle_v11000)                                                               \
    X(IPC_CLOSE_MEM_HANDLE, "cuIpcCloseMemHandle", ip_cuIpcCloseMemHandle,                         \
      PFN_cuIpcCloseMemHandle_v4010)                                                               \
    X(CTX_ENABLE_PEER_ACCESS, "cuCtxEnablePeerAccess", ip_cuCtxEnablePeerAccess,                   \
      PFN_cuCtxEnablePeerAccess_v4000)                                                             \
    X(CTX_DISABLE_PEER_ACCESS, "cuCtxDisablePeerAccess", ip_cuCtxDisablePeerAccess,                \
      PFN_cuCtxDisablePeerAccess_v4000)

#define IP_ENUM(id, name, impl, pfn) IP_##id,
enum ip_variant { IP_VARIANTS(IP_ENUM) IP_VARIANT_COUNT };
#undef IP_ENUM

/* The implementations have exactly the driver's function types. */
#define IP_DECLARE(id, name, impl, pfn) static __typeof__(*(pfn)0) impl;
IP_VARIANTS(IP_DECLARE)
#undef IP_DECLARE

#define IP_NAME(id, name, impl, pfn) name,
static const char *const ip_names[IP_VARIANT_COUNT] = {IP_VARIANTS(IP_NAME)};
#undef IP_NAME

/* What we hand out: the static implementations, never the exported names, whose addresses
 * could bind to some other object's definition of the same symbol. */
#define IP_WRAPPER(id, name, impl, pfn) (void *)impl,
static void *const ip_wrappers[IP_VARIANT_COUNT] = {IP_VARIANTS(IP_WRAPPER)};
#undef IP_WRAPPER

/* The real function of each variant: the one the program would have called. */
static _Atomic(void *) ip_real[IP_VARIANT_COUNT];

/* Depth of this thread inside the library. initial-exec: no __tls_get_addr (which may
 * allocate) on paths that run inside dlsym. */
static __thread unsigned ip_depth __attribute__((tls_model("initial-exec")));

/* ---------------------------------------------------------------------------------------------
 * dlsym.
 *
 * The real dlsym looks at its return address: RTLD_NEXT means "after the caller's object" and
 * RTLD_DEFAULT searches the caller's scope (a library dlopen'ed RTLD_LOCAL sees its own
 * dependencies). A wrapper that *calls* the real dlsym makes libvmmhook the caller and breaks
 * both for every program (a malloc interposer preloaded after us would find itself through
 * RTLD_NEXT and recurse). So dlsym is a trampoline that asks vmh_ip_dlsym_route() where to go
 * and then *jumps* there with the caller's arguments and return address untouched: to the real
 * dlsym, or, for a driver-style name ("cu" and a capital) on an explicit handle, to
 * ip_dlsym_handle(), for which the caller does not matter (an explicit handle searches that
 * object and its dependencies).
 *
 * RTLD_DEFAULT and RTLD_NEXT lookups of our symbols are left to the real dlsym: it already
 * finds our exported definitions first (we are preloaded). Replacing an RTLD_NEXT answer would
 * be wrong: an interposer loaded after us that asks for the next cuMemAlloc_v2 must get the
 * driver's, or its call would come back to us, and ours would go to it again (recursion).
 */
typedef void *(*ip_dlsym_fn)(void *handle, const char *symbol);

static _Atomic(ip_dlsym_fn) ip_real_dlsym_ptr;

/* Used only if the C library's dlsym cannot be found, which does not happen with glibc. */
static void *ip_dlsym_unavailable(void *handle, const char *symbol)
{
    return NULL;
}

/* The C library's dlsym, by version (dlvsym is not interposed). The architecture's base version
 * first: it exists in every glibc (in libdl before 2.34, as a compat alias of the same function
 * in libc since), so the lookup succeeds at once and never takes dlerror's allocating path. */
static ip_dlsym_fn ip_real_dlsym(void)
{
    ip_dlsym_fn f = atomic_load_explicit(&ip_real_dlsym_ptr, memory_order_acquire);
    if (IP_LIKELY(f != NULL))
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
        f = (ip_dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    if (f == NULL)
        return ip_dlsym_unavailable;
    /* Two threads may race here; both store the same pointer. */
    atomic_store_explicit(&ip_real_dlsym_ptr, f, memory_order_release);
    return f;
}

static bool ip_is_wrapper(const void *p)
{
    for (int v = 0; v < IP_VARIANT_COUNT; v++)
        if (ip_wrappers[v] == p)
            return true;
    return false;
}

/* Whether a function is the driver's: the object that defines it was loaded as "libcuda.so",
 * "libcuda.so.1" or "libcuda.so.<driver version>" (last path component). Asked of the answer,
 * not of the handle, so that a lookup through the handle of a library that depends on the
 * driver (dlsym(libtorch_cuda, "cuMemFree_v2") finds libcuda's) is hooked too: a served
 * pointer must never reach the driver's own cuMemFree. dladdr takes the loader lock, as the
 * real dlsym itself does; it runs only for the few names we interpose. */
static bool ip_from_libcuda(const void *fn)
{
    Dl_info di;
    if (!dladdr(fn, &di) || di.dli_fname == NULL)
        return false;
    const char *base = strrchr(di.dli_fname, '/');
    base = base ? base + 1 : di.dli_fname;
    return strncmp(base, "libcuda.so", 10) == 0 && (base[10] == '\0' || base[10] == '.');
}

static void ip_remember(enum ip_variant v, void *real)
{
    if (real != NULL && !ip_is_wrapper(real))
        atomic_store_explicit(&ip_real[v], real, memory_order_release);
}

/* dlsym(handle, "cu[A-Z]...") with an explicit handle: the real answer, or our wrapper when
 * the name is one of our exact ABIs and the real answer is the driver's. */
static void *ip_dlsym_handle(void *handle, const char *symbol)
{
    void *real = ip_real_dlsym()(handle, symbol);
    if (real == NULL)
        return NULL; /* dlerror is the real one's */
    for (int v = 0; v < IP_VARIANT_COUNT; v++) {
        if (strcmp(symbol + 2, ip_names[v] + 2) != 0)
            continue;
        /* A function already known as the driver's needs no dladdr (which costs microseconds
         * and the loader lock): the same name resolves to the same address every time. */
        if (real != atomic_load_explicit(&ip_real[v], memory_order_acquire) &&
            (ip_is_wrapper(real) || !ip_from_libcuda(real)))
            return real;
        ip_remember((enum ip_variant)v, real);
        return ip_wrappers[v];
    }
    return real;
}

/* Where dlsym goes. Cheap: three byte compares and two pointer compares for every lookup that
 * is not ours ("cu" then a capital: the driver's naming, not curl_*). Hidden, called from the
 * trampoline only. */
__attribute__((visibility("hidden"), used)) ip_dlsym_fn vmh_ip_dlsym_route(void *handle,
                                                                          const char *symbol);
__attribute__((visibility("hidden"), used)) ip_dlsym_fn vmh_ip_dlsym_route(void *handle,
                                                                          const char *symbol)
{
    if (symbol != NULL && symbol[0] == 'c' && symbol[1] == 'u' && symbol[2] >= 'A' &&
        symbol[2] <= 'Z' && handle != RTLD_DEFAULT && handle != RTLD_NEXT)
        return ip_dlsym_handle;
    return ip_real_dlsym();
}

#if defined(__x86_64__)
#if defined(__CET__) && (__CET__ & 1)
#define IP_ENDBR "endbr64\n"
#else
#define IP_ENDBR ""
#endif
/* Entry: %rsp = 8 mod 16. Two pushes and 8 bytes keep the call aligned. */
__asm__(".pushsection .text\n"
        ".globl dlsym\n"
        ".type dlsym, @function\n"
        ".p2align 4\n"
        "dlsym:\n"
        ".cfi_startproc\n" IP_ENDBR "pushq %rdi\n"
        ".cfi_adjust_cfa_offset 8\n"
        "pushq %rsi\n"
        ".cfi_adjust_cfa_offset 8\n"
        "subq $8, %rsp\n"
        ".cfi_adjust_cfa_offset 8\n"
        "call vmh_ip_dlsym_route@PLT\n"
        "addq $8, %rsp\n"
        ".cfi_adjust_cfa_offset -8\n"
        "popq %rsi\n"
        ".cfi_adjust_cfa_offset -8\n"
        "popq %rdi\n"
        ".cfi_adjust_cfa_offset -8\n"
        "jmp *%rax\n"
        ".cfi_endproc\n"
        ".size dlsym, .-dlsym\n"
        ".popsection\n");
#elif defined(__aarch64__)
#if defined(__ARM_FEATURE_BTI_DEFAULT) && __ARM_FEATURE_BTI_DEFAULT
#define IP_BTI "hint 34\n" /* bti c */
#else
#define IP_BTI ""
#endif
/* x16 is the intra-procedure-call register, allowed for the tail branch (also under BTI). */
__asm__(".pushsection .text\n"
        ".globl dlsym\n"
        ".type dlsym, %function\n"
        ".p2align 2\n"
        "dlsym:\n"
        ".cfi_startproc\n" IP_BTI "stp x29, x30, [sp, #-32]!\n"
        ".cfi_def_cfa_offset 32\n"
        ".cfi_offset 29, -32\n"
        ".cfi_offset 30, -24\n"
        "mov x29, sp\n"
        "stp x0, x1, [sp, #16]\n"
        "bl vmh_ip_dlsym_route\n"
        "mov x16, x0\n"
        "ldp x0, x1, [sp, #16]\n"
        "ldp x29, x30, [sp], #32\n"
        ".cfi_restore 30\n"
        ".cfi_restore 29\n"
        ".cfi_def_cfa_offset 0\n"
        "br x16\n"
        ".cfi_endproc\n"
        ".size dlsym, .-dlsym\n"
        ".popsection\n");
#else
/* Elsewhere the compiler's sibling call (-O1 and up) gives the jump; the interpose suite's
 * RTLD_NEXT / RTLD_DEFAULT tests catch a build where it does not. */
IP_EXPORT void *dlsym(void *handle, const char *symbol)
{
    return vmh_ip_dlsym_route(handle, symbol)(handle, symbol);
}
#endif

/* ---------------------------------------------------------------------------------------------
 * Real functions for pass-through.
 */

/* When no lookup of the program told us (a program linked with -lcuda calls our exported
 * symbol directly): the next definition after us (what its link would have bound without the
 * preload), else libcuda.so.1's if it is loaded, else the library's driver table. */
static void *ip_resolve_real(enum ip_variant v)
{
    void *p = vmh_real_dlsym(RTLD_NEXT, ip_names[v]);
    if (p == NULL || ip_is_wrapper(p)) {
        p = NULL;
        /* libcuda loaded RTLD_LOCAL by someone else. NOLOAD loads nothing; the reference it
         * takes is never dropped, which keeps the function we store valid. Once found, a
         * variant never comes here again. */
        void *h = dlopen("libcuda.so.1", RTLD_NOLOAD | RTLD_LAZY);
        if (h != NULL)
            p = vmh_real_dlsym(h, ip_names[v]);
    }
    if ((p == NULL || ip_is_wrapper(p)) && v != IP_GETPROC_V1 && v != IP_GETPROC_V2 &&
        ip_depth == 0) {
        /* Never for cuGetProcAddress: loading the driver table inside a lookup is what hung
         * HAMi-core. The memory entry points are calls, where initialising is allowed. */
        p = NULL;
        ip_depth++;
        bool ready = vmh_driver_ready();
        ip_depth--;
        if (ready) {
            switch (v) {
            case IP_MEM_ALLOC: p = (void *)vmh_drv.cuMemAlloc; break;
            case IP_MEM_ALLOC_PITCH: p = (void *)vmh_drv.cuMemAllocPitch; break;
            case IP_MEM_FREE: p = (void *)vmh_drv.cuMemFree; break;
            case IP_MEM_FREE_ASYNC: p = (void *)vmh_drv.cuMemFreeAsync; break;
            case IP_MEM_GET_ADDRESS_RANGE: p = (void *)vmh_drv.cuMemGetAddressRange; break;
            case IP_POINTER_GET_ATTRIBUTE: p = (void *)vmh_drv.cuPointerGetAttribute; break;
            case IP_POINTER_GET_ATTRIBUTES: p = (void *)vmh_drv.cuPointerGetAttributes; break;
            case IP_MEM_GET_INFO: p = (void *)vmh_drv.cuMemGetInfo; break;
            case IP_IPC_GET_MEM_HANDLE: p = (void *)vmh_drv.cuIpcGetMemHandle; break;
            case IP_IPC_OPEN_MEM_HANDLE: p = (void *)vmh_drv.cuIpcOpenMemHandle; break;
            case IP_IPC_CLOSE_MEM_HANDLE: p = (void *)vmh_drv.cuIpcCloseMemHandle; break;
            case IP_CTX_ENABLE_PEER_ACCESS: p = (void *)vmh_drv.cuCtxEnablePeerAccess; break;
            case IP_CTX_DISABLE_PEER_ACCESS: p = (void *)vmh_drv.cuCtxDisablePeerAccess; break;
            case IP_MEM_FREE_ASYNC_PTSZ: {
                vmh_getproc_fn gp = vmh_driver_real_getproc();
                CUdriverProcAddressQueryResult st;
                if (gp == NULL || gp("cuMemFreeAsync", &p, CUDA_VERSION,
                                     CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM,
                                     &st) != CUDA_SUCCESS)
                    p = NULL;
                break;
            }
            default: break;
            }
        }
    }
    if (p == NULL || ip_is_wrapper(p))
        return NULL;
    /* A program's own lookup may have raced us: keep what it stored. */
    void *expected = NULL;
    if (!atomic_compare_exchange_strong_explicit(&ip_real[v], &expected, p, memory_order_acq_rel,
                                                 memory_order_acquire))
        return expected;
    return p;
}

static inline void *ip_real_fn(enum ip_variant v)
{
    void *p = atomic_load_explicit(&ip_real[v], memory_order_acquire);
    if (IP_LIKELY(p != NULL))
        return p;
    return ip_resolve_real(v);
}

/* Pass a call to the real function of variant `id`, counted. No real function at all (no
 * driver anywhere in the process): CUDA_ERROR_NOT_INITIALIZED, what a driver-less stub says. */
#define IP_PASS(id, pfn, ...)                                                                      \
    do {                                                                                           \
        pfn real_ = (pfn)ip_real_fn(IP_##id);                                                      \
        vmh_count(VMH_STAT_passthrough_calls, 1);                                                  \
        if (IP_UNLIKELY(real_ == NULL))                                                            \
            return CUDA_ERROR_NOT_INITIALIZED;                                                     \
        return real_(__VA_ARGS__);                                                                 \
    } while (0)

/* ---------------------------------------------------------------------------------------------
 * cuGetProcAddress.
 *
 * Which requests get our wrapper: a base name, a cudaVersion range where the driver answers
 * with exactly the ABI we implement (cudaTypedefs.h: PFN_<name>_v<version introduced>), and for
 * cuMemFreeAsync the stream variant. Below a range the driver hands out the old 32-bit v1 ABI
 * (cuMemAlloc before 3020) or an older signature, which we leave alone; past CUDA_VERSION (the
 * newest ABI our headers know) a future driver might hand out a _v3, so there we check that the
 * driver gives the same function it gives for CUDA_VERSION before replacing it.
 */
static const struct ip_lookup {
    const char *name;
    enum ip_variant variant;
    int since; /* first cudaVersion answered with this ABI */
    int until; /* first cudaVersion answered with a newer ABI */
} ip_lookups[] = {
    {"cuGetProcAddress", IP_GETPROC_V1, 11030, 12000},
    {"cuGetProcAddress", IP_GETPROC_V2, 12000, INT_MAX},
    {"cuMemAlloc", IP_MEM_ALLOC, 3020, INT_MAX},
    {"cuMemAllocPitch", IP_MEM_ALLOC_PITCH, 3020, INT_MAX},
    {"cuMemFree", IP_MEM_FREE, 3020, INT_MAX},
    {"cuMemFreeAsync", IP_MEM_FREE_ASYNC, 11020, INT_MAX}, /* _PTSZ chosen by the flags */
    {"cuMemGetAddressRange", IP_MEM_GET_ADDRESS_RANGE, 3020, INT_MAX},
    {"cuPointerGetAttribute", IP_POINTER_GET_ATTRIBUTE, 4000, INT_MAX},
    {"cuPointerGetAttributes", IP_POINTER_GET_ATTRIBUTES, 7000, INT_MAX},
    {"cuMemGetInfo", IP_MEM_GET_INFO, 3020, INT_MAX},
    {"cuIpcGetMemHandle", IP_IPC_GET_MEM_HANDLE, 4010, INT_MAX},
    {"cuIpcOpenMemHandle", IP_IPC_OPEN_MEM_HANDLE, 11000, INT_MAX},
    {"cuIpcCloseMemHandle", IP_IPC_CLOSE_MEM_HANDLE, 4010, INT_MAX},
    {"cuCtxEnablePeerAccess", IP_CTX_ENABLE_PEER_ACCESS, 4000, INT_MAX},
    {"cuCtxDisablePeerAccess", IP_CTX_DISABLE_PEER_ACCESS, 4000, INT_MAX},
};

/* A second question to the real driver, through the same entry point the program used. */
static void *ip_real_lookup(enum ip_variant via, const char *symbol, int version, cuuint64_t flags)
{
    void *fn = NULL;
    if (via == IP_GETPROC_V2) {
        PFN_cuGetProcAddress_v12000 gp = (PFN_cuGetProcAddress_v12000)ip_real_fn(IP_GETPROC_V2);
        CUdriverProcAddressQueryResult st;
        if (gp == NULL || gp(symbol, &fn, version, flags, &st) != CUDA_SUCCESS)
            return NULL;
    } else {
        PFN_cuGetProcAddress_v11030 gp = (PFN_cuGetProcAddress_v11030)ip_real_fn(IP_GETPROC_V1);
        if (gp == NULL || gp(symbol, &fn, version, flags) != CUDA_SUCCESS)
            return NULL;
    }
    return fn;
}

/* The driver answered *pfn for (symbol, version, flags): swap in our wrapper if it is an ABI we
 * interpose, and remember the driver's function for that variant. */
static void ip_hook_lookup(enum ip_variant via, const char *symbol, void **pfn, int version,
                           cuuint64_t flags)
{
    if (symbol == NULL || symbol[0] != 'c' || symbol[1] != 'u' || *pfn == NULL ||
        ip_is_wrapper(*pfn))
        return;
    const struct ip_lookup *row = NULL;
    for (size_t i = 0; i < sizeof ip_lookups / sizeof ip_lookups[0]; i++) {
        if (version >= ip_lookups[i].since && version < ip_lookups[i].until &&
            strcmp(symbol + 2, ip_lookups[i].name + 2) == 0) {
            row = &ip_lookups[i];
            break;
        }
    }
    if (row == NULL)
        return;
    enum ip_variant v = row->variant;
    if (v == IP_MEM_FREE_ASYNC) {
        /* The driver: PER_THREAD searches the _ptsz function first, LEGACY excludes it, 0 is
         * legacy (cuda.h's inline cuGetProcAddress_v2_ptsz adds PER_THREAD itself). Both bits
         * at once is not documented: ask the driver which one it gave. */
        const cuuint64_t pt = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
        const cuuint64_t legacy = CU_GET_PROC_ADDRESS_LEGACY_STREAM;
        bool ptsz = (flags & pt) != 0;
        if (ptsz && (flags & legacy) != 0)
            ptsz = ip_real_lookup(via, symbol, version, pt) == *pfn;
        if (ptsz)
            v = IP_MEM_FREE_ASYNC_PTSZ;
    }
    if (version > CUDA_VERSION && ip_real_lookup(via, symbol, CUDA_VERSION, flags) != *pfn)
        return; /* a newer ABI than ours: leave it to the program */
    ip_remember(v, *pfn);
    *pfn = ip_wrappers[v];
}

static CUresult ip_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                       cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    PFN_cuGetProcAddress_v12000 real = (PFN_cuGetProcAddress_v12000)ip_real_fn(IP_GETPROC_V2);
    CUresult r;
    if (real != NULL) {
        r = real(symbol, pfn, cudaVersion, flags, status);
    } else {
        /* Only the CUDA 11.3 ABI in this driver, but the program found our _v2 export (through
         * RTLD_DEFAULT): answer through v1, with the status v1 cannot give. */
        PFN_cuGetProcAddress_v11030 v1 = (PFN_cuGetProcAddress_v11030)ip_real_fn(IP_GETPROC_V1);
        if (v1 == NULL)
            return CUDA_ERROR_NOT_INITIALIZED;
        r = v1(symbol, pfn, cudaVersion, flags);
        if (status != NULL)
            *status = (r == CUDA_SUCCESS && pfn != NULL && *pfn != NULL)
                          ? CU_GET_PROC_ADDRESS_SUCCESS
                          : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    }
    if (r == CUDA_SUCCESS && pfn != NULL)
        ip_hook_lookup(real != NULL ? IP_GETPROC_V2 : IP_GETPROC_V1, symbol, pfn, cudaVersion,
                       flags);
    return r;
}

static CUresult ip_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                    cuuint64_t flags)
{
    PFN_cuGetProcAddress_v11030 real = (PFN_cuGetProcAddress_v11030)ip_real_fn(IP_GETPROC_V1);
    CUresult r;
    enum ip_variant via = IP_GETPROC_V1;
    if (real != NULL) {
        r = real(symbol, pfn, cudaVersion, flags);
    } else {
        /* The driver exports only _v2 (the simulated one does): v1 is _v2 without a status. */
        PFN_cuGetProcAddress_v12000 v2 = (PFN_cuGetProcAddress_v12000)ip_real_fn(IP_GETPROC_V2);
        if (v2 == NULL)
            return CUDA_ERROR_NOT_INITIALIZED;
        r = v2(symbol, pfn, cudaVersion, flags, NULL);
        via = IP_GETPROC_V2;
    }
    if (r == CUDA_SUCCESS && pfn != NULL)
        ip_hook_lookup(via, symbol, pfn, cudaVersion, flags);
    return r;
}

/* ---------------------------------------------------------------------------------------------
 * Serve or pass: decided once, at the first interposed call.
 */
enum { IP_MODE_UNKNOWN, IP_MODE_SERVE, IP_MODE_PASS };
static atomic_int ip_mode = IP_MODE_UNKNOWN;
static pthread_once_t ip_once = PTHREAD_ONCE_INIT;

static void ip_init(void)
{
    /* Options, then the driver table (heap.h). After the heap's shutdown at exit its calls
     * answer "not ours" (CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_NOT_FOUND) and we pass through. */
    bool serve = vmh_lifetime_ready();
    if (!serve)
        vmh_debug(vmh_opt.disable ? "VMMHOOK_DISABLE is set: every call goes to the driver"
                                  : "no usable CUDA driver: every call goes to the driver");
    atomic_store_explicit(&ip_mode, serve ? IP_MODE_SERVE : IP_MODE_PASS, memory_order_release);
}

/* true: this call may be served. A call made while this thread is already inside the library
 * (including during ip_init, where pthread_once would deadlock on itself) passes through. */
static inline bool ip_serving(void)
{
    if (IP_UNLIKELY(ip_depth != 0))
        return false;
    int m = atomic_load_explicit(&ip_mode, memory_order_acquire);
    if (IP_UNLIKELY(m == IP_MODE_UNKNOWN)) {
        ip_depth++;
        pthread_once(&ip_once, ip_init);
        ip_depth--;
        m = atomic_load_explicit(&ip_mode, memory_order_acquire);
    }
    return m == IP_MODE_SERVE;
}

/* The served buffer holding p, or false. Only after ip_serving(): before it nothing is served. */
static bool ip_find(CUdeviceptr p, vmh_buffer_info_t *info)
{
    ip_depth++;
    bool found = vmh_heap_find(p, info);
    ip_depth--;
    return found;
}

/* ---------------------------------------------------------------------------------------------
 * Allocation and free.
 */
static CUresult ip_cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    /* NULL dptr and size 0 are the driver's to reject (CUDA_ERROR_INVALID_VALUE). */
    if (dptr != NULL && bytesize != 0 && ip_serving()) {
        CUdeviceptr p = 0;
        ip_depth++;
        CUresult r = vmh_heap_alloc_at(bytesize, __builtin_return_address(0), &p);
        ip_depth--;
        /* A failed native allocation writes 0 to *dptr (measured on the H200). */
        if (r != CUDA_ERROR_NOT_SUPPORTED)
            *dptr = r == CUDA_SUCCESS ? p : 0;
        /* CUDA_ERROR_NOT_SUPPORTED: the heap does not serve (shut down at exit, or a device
         * without VMM support); the driver's own allocator does. Anything else (out of memory
         * after a trim, no context) is the code the native call gives. The heap traces. */
        if (r != CUDA_ERROR_NOT_SUPPORTED)
            return r;
    }
    IP_PASS(MEM_ALLOC, PFN_cuMemAlloc_v3020, dptr, bytesize);
}

static CUresult ip_cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                      size_t Height, unsigned int ElementSizeBytes)
{
    /* Everything the driver rejects stays its answer: NULL outputs, an empty rectangle, an
     * element size other than 4, 8 or 16. */
    if (dptr != NULL && pPitch != NULL && WidthInBytes != 0 && Height != 0 &&
        (ElementSizeBytes == 4 || ElementSizeBytes == 8 || ElementSizeBytes == 16) &&
        ip_serving()) {
        CUdeviceptr p = 0;
        size_t pitch = 0;
        ip_depth++;
        CUresult r = vmh_heap_alloc_pitch(WidthInBytes, Height, ElementSizeBytes,
                                          __builtin_return_address(0), &p, &pitch);
        ip_depth--;
        if (r == CUDA_SUCCESS)
            *pPitch = pitch;
        if (r != CUDA_ERROR_NOT_SUPPORTED)
            *dptr = r == CUDA_SUCCESS ? p : 0; /* as cuMemAlloc: 0 on failure */
        if (r != CUDA_ERROR_NOT_SUPPORTED)
            return r;
    }
    IP_PASS(MEM_ALLOC_PITCH, PFN_cuMemAllocPitch_v3020, dptr, pPitch, WidthInBytes, Height,
            ElementSizeBytes);
}

/* A served buffer's free: its code, or CUDA_ERROR_NOT_FOUND for a pointer we did not serve
 * (someone else's, allocated before we loaded, already freed: the driver answers those). */
static CUresult ip_free(CUdeviceptr p, CUstream stream, bool async)
{
    ip_depth++;
    CUresult r = vmh_heap_free(p, stream, async);
    ip_depth--;
    return r;
}

static CUresult ip_cuMemFree_v2(CUdeviceptr dptr)
{
    /* free(0) is the driver's (success once initialised). */
    if (dptr != 0 && ip_serving()) {
        CUresult r = ip_free(dptr, NULL, false);
        if (r != CUDA_ERROR_NOT_FOUND)
            return r; /* served, or CUDA_ERROR_INVALID_VALUE for an interior pointer */
    }
    IP_PASS(MEM_FREE, PFN_cuMemFree_v3020, dptr);
}

static CUresult ip_cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream)
{
    if (dptr != 0 && ip_serving()) {
        CUresult r = ip_free(dptr, hStream, true);
        if (r != CUDA_ERROR_NOT_FOUND)
            return r;
    }
    IP_PASS(MEM_FREE_ASYNC, PFN_cuMemFreeAsync_v11020, dptr, hStream);
}

/* The per-thread-default-stream ABI: stream 0 means this thread's default stream, which the
 * heap must order the free after, not the legacy stream. */
static CUresult ip_cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream)
{
    if (dptr != 0 && ip_serving()) {
        CUresult r = ip_free(dptr, hStream != NULL ? hStream : CU_STREAM_PER_THREAD, true);
        if (r != CUDA_ERROR_NOT_FOUND)
            return r;
    }
    IP_PASS(MEM_FREE_ASYNC_PTSZ, PFN_cuMemFreeAsync_v11020_ptsz, dptr, hStream);
}

/* ---------------------------------------------------------------------------------------------
 * Queries. A served buffer answers as a native allocation of the size asked for would
 * (driver-facts 3a: base = the pointer returned, size = the size requested), not the chunk or
 * the reservation the driver would name (driver-facts 3).
 */
static CUresult ip_cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
    /* One lock-free registry read decides for every pointer the library does not hold. */
    if (ip_serving() && vmh_heap_holds(dptr)) {
        vmh_buffer_info_t bi;
        if (!ip_find(dptr, &bi))
            return CUDA_ERROR_NOT_FOUND; /* freed, kept mapped for reuse: natively unknown */
        if (pbase != NULL)
            *pbase = bi.base;
        if (psize != NULL)
            *psize = bi.size;
        return CUDA_SUCCESS;
    }
    IP_PASS(MEM_GET_ADDRESS_RANGE, PFN_cuMemGetAddressRange_v3020, pbase, psize, dptr);
}

static bool ip_is_range_attribute(CUpointer_attribute a)
{
    return a == CU_POINTER_ATTRIBUTE_RANGE_START_ADDR || a == CU_POINTER_ATTRIBUTE_RANGE_SIZE;
}

static void ip_write_range_attribute(CUpointer_attribute a, void *data,
                                     const vmh_buffer_info_t *bi)
{
    if (a == CU_POINTER_ATTRIBUTE_RANGE_START_ADDR) {
        CUdeviceptr base = bi->base;
        memcpy(data, &base, sizeof base);
    } else {
        size_t size = bi->size;
        memcpy(data, &size, sizeof size);
    }
}

static CUresult ip_cuPointerGetAttribute(void *data, CUpointer_attribute attribute,
                                         CUdeviceptr ptr)
{
    if (ip_serving() && vmh_heap_holds(ptr)) {
        vmh_buffer_info_t bi;
        if (!ip_find(ptr, &bi))
            return CUDA_ERROR_INVALID_VALUE; /* freed: unknown to a native allocator */
        /* Only the range attributes differ from what the driver says about our memory. */
        if (data != NULL && ip_is_range_attribute(attribute)) {
            ip_write_range_attribute(attribute, data, &bi);
            return CUDA_SUCCESS;
        }
    }
    IP_PASS(POINTER_GET_ATTRIBUTE, PFN_cuPointerGetAttribute_v4000, data, attribute, ptr);
}

static CUresult ip_cuPointerGetAttributes(unsigned int numAttributes,
                                          CUpointer_attribute *attributes, void **data,
                                          CUdeviceptr ptr)
{
    PFN_cuPointerGetAttributes_v7000 real =
        (PFN_cuPointerGetAttributes_v7000)ip_real_fn(IP_POINTER_GET_ATTRIBUTES);
    vmh_count(VMH_STAT_passthrough_calls, 1);
    if (real == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    /* The driver answers everything first (its codes, its validation of the list); then the
     * range entries are corrected for a served buffer. */
    vmh_buffer_info_t dead;
    if (ip_serving() && vmh_heap_holds(ptr) && !ip_find(ptr, &dead))
        ptr = 0; /* freed memory kept for reuse: answer as for an address nobody allocated */
    CUresult r = real(numAttributes, attributes, data, ptr);
    if (r != CUDA_SUCCESS || attributes == NULL || data == NULL)
        return r;
    bool wants_range = false;
    for (unsigned int i = 0; i < numAttributes && !wants_range; i++)
        wants_range = ip_is_range_attribute(attributes[i]) && data[i] != NULL;
    vmh_buffer_info_t bi;
    if (wants_range && ip_serving() && ip_find(ptr, &bi)) {
        for (unsigned int i = 0; i < numAttributes; i++)
            if (ip_is_range_attribute(attributes[i]) && data[i] != NULL)
                ip_write_range_attribute(attributes[i], data[i], &bi);
    }
    return r;
}

/* Memory the library holds idle for reuse is free for the program: programs that size
 * themselves from free memory (PyTorch's, TensorFlow's BFC, cuDNN workspaces) must not see
 * our cache as used. */
static CUresult ip_cuMemGetInfo_v2(size_t *free, size_t *total)
{
    PFN_cuMemGetInfo_v3020 real = (PFN_cuMemGetInfo_v3020)ip_real_fn(IP_MEM_GET_INFO);
    vmh_count(VMH_STAT_passthrough_calls, 1);
    if (real == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(free, total);
    if (r != CUDA_SUCCESS || free == NULL || total == NULL || !ip_serving())
        return r;
    CUdevice dev;
    ip_depth++;
    vmh_count(VMH_STAT_driver_calls, 1);
    CUresult dr = vmh_drv.cuCtxGetDevice(&dev);
    size_t idle = dr == CUDA_SUCCESS ? vmh_heap_idle_bytes((int)dev) : 0;
    ip_depth--;
    size_t f;
    if (__builtin_add_overflow(*free, idle, &f) || f > *total)
        f = *total;
    *free = f;
    return r;
}

/* ---------------------------------------------------------------------------------------------
 * IPC and peer access (ipc.h, docs/IPC.md).
 *
 * A served buffer's IPC handle is ours (magic, pid, token, export id) when VMMHOOK_HANDLE_TYPE is
 * posix_fd; otherwise cuIpcGetMemHandle answers CUDA_ERROR_INVALID_VALUE, as the driver does for
 * VMM memory, and says once how to make it work. Open takes our handles only (anything else,
 * including native handles, goes to the driver); close takes only what our open returned.
 */
static CUresult ip_cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
    vmh_buffer_info_t bi;
    /* NULL pHandle is the driver's to reject. */
    if (pHandle != NULL && ip_serving() && ip_find(dptr, &bi)) {
        ip_depth++;
        CUresult r = vmh_ipc_get_handle(dptr, pHandle);
        ip_depth--;
        if (r != CUDA_ERROR_NOT_FOUND) /* NOT_FOUND: freed meanwhile, the driver answers */
            return r;
    }
    IP_PASS(IPC_GET_MEM_HANDLE, PFN_cuIpcGetMemHandle_v4010, pHandle, dptr);
}

static CUresult ip_cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle,
                                         unsigned int Flags)
{
    if (pdptr != NULL && vmh_ipc_handle_is_ours(&handle) && ip_serving()) {
        ip_depth++;
        CUresult r = vmh_ipc_open(&handle, Flags, pdptr);
        ip_depth--;
        return r;
    }
    IP_PASS(IPC_OPEN_MEM_HANDLE, PFN_cuIpcOpenMemHandle_v11000, pdptr, handle, Flags);
}

static CUresult ip_cuIpcCloseMemHandle(CUdeviceptr dptr)
{
    if (dptr != 0 && ip_serving()) {
        ip_depth++;
        CUresult r = vmh_ipc_close(dptr);
        ip_depth--;
        if (r != CUDA_ERROR_NOT_FOUND)
            return r;
    }
    IP_PASS(IPC_CLOSE_MEM_HANDLE, PFN_cuIpcCloseMemHandle_v4010, dptr);
}

/* Peer access does not reach VMM memory by itself (driver-facts 3): after the driver enabled
 * (disabled) it, every served buffer of the peer context's device gets (loses) an access
 * descriptor for the current context's device, and so do the device's future buffers.
 * cudaDeviceEnablePeerAccess arrives here too: cudart fetches cuCtxEnablePeerAccess through
 * cuGetProcAddress. The driver's code is the answer; should the access update fail, the
 * program is told in the log (its peer access is on natively, and a code other than success
 * would make it believe otherwise). */
static void ip_peer_changed(CUcontext peerContext, bool grant)
{
    ip_depth++;
    CUresult r = vmh_ipc_peer_changed(peerContext, grant);
    ip_depth--;
    if (r != CUDA_SUCCESS)
        vmh_log("cuCtx%sPeerAccess succeeded, but %s the peer's access to served buffers "
                "failed with CUDA error %d: kernels %s",
                grant ? "Enable" : "Disable", grant ? "granting" : "revoking", (int)r,
                grant ? "of this context may fault on the peer's served memory"
                      : "of this context may still reach the peer's served memory");
}

static CUresult ip_cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int Flags)
{
    PFN_cuCtxEnablePeerAccess_v4000 real =
        (PFN_cuCtxEnablePeerAccess_v4000)ip_real_fn(IP_CTX_ENABLE_PEER_ACCESS);
    vmh_count(VMH_STAT_passthrough_calls, 1);
    if (real == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(peerContext, Flags);
    if (r == CUDA_SUCCESS && ip_serving())
        ip_peer_changed(peerContext, true);
    return r;
}

static CUresult ip_cuCtxDisablePeerAccess(CUcontext peerContext)
{
    PFN_cuCtxDisablePeerAccess_v4000 real =
        (PFN_cuCtxDisablePeerAccess_v4000)ip_real_fn(IP_CTX_DISABLE_PEER_ACCESS);
    vmh_count(VMH_STAT_passthrough_calls, 1);
    if (real == NULL)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult r = real(peerContext);
    if (r == CUDA_SUCCESS && ip_serving())
        ip_peer_changed(peerContext, false);
    return r;
}

/* ---------------------------------------------------------------------------------------------
 * The exported symbols (src/vmmhook.map), for programs linked with -lcuda and for RTLD_DEFAULT
 * lookups: aliases of the implementations above.
 */
CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
CUresult cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream);

#define IP_ALIAS(pub, impl) extern __typeof__(impl) pub __attribute__((alias(#impl))) IP_EXPORT;
IP_ALIAS(cuGetProcAddress, ip_cuGetProcAddress)
IP_ALIAS(cuGetProcAddress_v2, ip_cuGetProcAddress_v2)
IP_ALIAS(cuMemAlloc_v2, ip_cuMemAlloc_v2)
IP_ALIAS(cuMemAllocPitch_v2, ip_cuMemAllocPitch_v2)
IP_ALIAS(cuMemFree_v2, ip_cuMemFree_v2)
IP_ALIAS(cuMemFreeAsync, ip_cuMemFreeAsync)
IP_ALIAS(cuMemFreeAsync_ptsz, ip_cuMemFreeAsync_ptsz)
IP_ALIAS(cuMemGetAddressRange_v2, ip_cuMemGetAddressRange_v2)
IP_ALIAS(cuPointerGetAttribute, ip_cuPointerGetAttribute)
IP_ALIAS(cuPointerGetAttributes, ip_cuPointerGetAttributes)
IP_ALIAS(cuMemGetInfo_v2, ip_cuMemGetInfo_v2)
IP_ALIAS(cuIpcGetMemHandle, ip_cuIpcGetMemHandle)
IP_ALIAS(cuIpcOpenMemHandle_v2, ip_cuIpcOpenMemHandle_v2)
IP_ALIAS(cuIpcCloseMemHandle, ip_cuIpcCloseMemHandle)
IP_ALIAS(cuCtxEnablePeerAccess, ip_cuCtxEnablePeerAccess)
IP_ALIAS(cuCtxDisablePeerAccess, ip_cuCtxDisablePeerAccess)
#undef IP_ALIAS
