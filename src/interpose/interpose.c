/* Layer "entry points": the interposed entry points: how the program's calls reach them. This file
 * holds dlsym, cuGetProcAddress, the real function behind each hooked symbol (found by driver.c)
 * and the decision, at the first interposed call, to serve or to pass everything through. The
 * hooked symbols are listed once, in hooked.h; their wrappers live in interpose_mem.c (memory) and
 * interpose_ctx.c (contexts and stream capture).
 *
 * How programs reach the driver, and where this file stands in each path (driver-facts.md 1):
 *   - cudart (static and shared) opens libcuda.so.1, dlsym(h, "cuGetProcAddress_v2"),
 *     then fetches ~440 entry points through it (versions 11030/12000/13000, flags 0 and
 *     CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM): the dlsym wrapper hands out our
 *     cuGetProcAddress*, whose answers carry our wrappers for the few entry points we interpose;
 *   - PyTorch and others dlsym driver functions themselves on the libcuda handle: same wrapper;
 *   - programs linked with -lcuda bind to our exported symbols (we are preloaded, so first).
 *
 * Rules this file keeps (prior-art.md 1, HAMi-core's traps):
 *   - dlsym never initialises anything (HAMi-core#52: initialising inside a cuGetExportTable
 *     lookup hung CUDA 12.8) and never recurses: the real dlsym comes from driver.c (dlvsym,
 *     resolved once into an atomic); no lock of ours, no malloc, no stdio on that path.
 *     Options and the driver table are loaded at the first interposed *call*, never at a
 *     lookup, so a process that never calls CUDA sees nothing (no output, no driver load, no
 *     option parsing).
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
#include "interpose.h"
#include "lifetime.h"
#include "log.h"
#include "options.h"
#include "thread_state.h"

#define IP_EXPORT __attribute__((visibility("default")))

/* ---------------------------------------------------------------------------------------------
 * The hooked symbols as data, the real function of each, and this thread's depth.
 */
#define IP_ROW(sym, pfn, base, since, until, stream)                                               \
    {#sym, base, since, until, stream, (void *)vmh_ip_##sym},
static const ip_hooked_t ip_rows[IP_VARIANT_COUNT] = {VMH_HOOKED(IP_ROW)};
#undef IP_ROW

_Atomic(void *) vmh_ip_real_fns[IP_VARIANT_COUNT];

/* ---------------------------------------------------------------------------------------------
 * dlsym.
 *
 * The real dlsym looks at its return address: the "next" pseudo-handle means "after the
 * caller's object" and the "default" one searches the caller's scope (a library opened
 * RTLD_LOCAL sees its own dependencies). A wrapper that *calls* the real dlsym makes libvmmhook
 * the caller and breaks both for every program (a malloc interposer preloaded after us would
 * find itself through "next" and recurse). So dlsym is a trampoline that asks
 * vmh_ip_dlsym_route() where to go and then *jumps* there with the caller's arguments and return
 * address untouched: to the real dlsym, or, for a driver-style name ("cu" and a capital) on an
 * explicit handle, to ip_dlsym_handle(), for which the caller does not matter (an explicit handle
 * searches that object and its dependencies).
 *
 * Lookups of our symbols through the pseudo-handles are left to the real dlsym: it already
 * finds our exported definitions first (we are preloaded). Replacing a "next" answer would be
 * wrong: an interposer loaded after us that asks for the next cuMemAlloc_v2 must get the
 * driver's, or its call would come back to us, and ours would go to it again (recursion).
 */
static bool ip_is_wrapper(const void *p)
{
    for (int v = 0; v < IP_VARIANT_COUNT; v++)
        if (ip_rows[v].wrapper == p)
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
        atomic_store_explicit(&vmh_ip_real_fns[v], real, memory_order_release);
}

/* dlsym(handle, "cu[A-Z]...") with an explicit handle: the real answer, or our wrapper when
 * the name is one of our exact ABIs and the real answer is the driver's. */
static void *ip_dlsym_handle(void *handle, const char *symbol)
{
    void *real = vmh_real_dlsym(handle, symbol);
    if (real == NULL)
        return NULL; /* dlerror is the real one's */
    for (int v = 0; v < IP_VARIANT_COUNT; v++) {
        if (strcmp(symbol + 2, ip_rows[v].name + 2) != 0)
            continue;
        /* A function already known as the driver's needs no dladdr (which costs microseconds
         * and the loader lock): the same name resolves to the same address every time. */
        if (real != atomic_load_explicit(&vmh_ip_real_fns[v], memory_order_acquire) &&
            (ip_is_wrapper(real) || !ip_from_libcuda(real)))
            return real;
        ip_remember((enum ip_variant)v, real);
        return ip_rows[v].wrapper;
    }
    return real;
}

/* Where dlsym goes. Cheap: three byte compares and two pointer compares for every lookup that
 * is not ours ("cu" then a capital: the driver's naming, not curl_*). Hidden, called from the
 * trampoline only. */
__attribute__((visibility("hidden"), used)) vmh_dlsym_fn vmh_ip_dlsym_route(void *handle,
                                                                            const char *symbol);
__attribute__((visibility("hidden"), used)) vmh_dlsym_fn vmh_ip_dlsym_route(void *handle,
                                                                            const char *symbol)
{
    if (symbol != NULL && symbol[0] == 'c' && symbol[1] == 'u' && symbol[2] >= 'A' &&
        symbol[2] <= 'Z' && !vmh_dlsym_pseudo_handle(handle))
        return ip_dlsym_handle;
    return vmh_real_dlsym_fn();
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
 * pseudo-handle tests catch a build where it does not. */
IP_EXPORT void *dlsym(void *handle, const char *symbol)
{
    return vmh_ip_dlsym_route(handle, symbol)(handle, symbol);
}
#endif

/* ---------------------------------------------------------------------------------------------
 * Real functions for pass-through.
 */

/* When no lookup of the program told us (a program linked with -lcuda calls our exported
 * symbol directly): the definition the program's link would have bound without the preload
 * (driver.c finds it), else the driver's own answer for the ABI the wrapper implements, once the
 * driver is loaded. Never loading for cuGetProcAddress itself: loading the driver table inside a
 * lookup is what hung HAMi-core; the other entry points are calls, where initialising is
 * allowed. */
void *vmh_ip_resolve_real(enum ip_variant v)
{
    const ip_hooked_t *row = &ip_rows[v];
    void *p = vmh_driver_next_symbol(row->name);
    if ((p == NULL || ip_is_wrapper(p)) && v != IP_cuGetProcAddress &&
        v != IP_cuGetProcAddress_v2 && vmh_thread.ip_depth == 0) {
        vmh_thread.ip_depth++;
        bool ready = vmh_driver_ready();
        vmh_thread.ip_depth--;
        p = ready ? vmh_driver_proc(row->base, row->since,
                                    row->stream == IP_STREAM_PTSZ
                                        ? CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM
                                        : CU_GET_PROC_ADDRESS_DEFAULT)
                  : NULL;
    }
    if (p == NULL || ip_is_wrapper(p))
        return NULL;
    /* A program's own lookup may have raced us: keep what it stored. */
    void *expected = NULL;
    if (!atomic_compare_exchange_strong_explicit(&vmh_ip_real_fns[v], &expected, p,
                                                 memory_order_acq_rel, memory_order_acquire))
        return expected;
    return p;
}

/* ---------------------------------------------------------------------------------------------
 * cuGetProcAddress.
 *
 * Which requests get our wrapper: a row of hooked.h whose base name is asked for, at a
 * cudaVersion in the row's range (the driver answers exactly the ABI the wrapper implements),
 * and for the bases with a per-thread-stream variant the variant the flags select. Outside
 * every range the driver hands out an ABI we do not implement, which we leave alone; past
 * CUDA_VERSION (the newest ABI our headers know) a future driver might hand out a newer one, so
 * there we check that the driver gives the same function it gives for CUDA_VERSION before
 * replacing it.
 */

/* Whether the lookup selects the per-thread-default-stream variant. The driver: PER_THREAD
 * searches the _ptsz function first, LEGACY excludes it, 0 is legacy (cuda.h's inline
 * cuGetProcAddress_v2_ptsz adds PER_THREAD itself). Both bits at once is not documented: ask the
 * driver which one it gave. */
static bool ip_lookup_is_ptsz(const char *symbol, void *answer, int version, cuuint64_t flags)
{
    const cuuint64_t pt = CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    bool ptsz = (flags & pt) != 0;
    if (ptsz && (flags & CU_GET_PROC_ADDRESS_LEGACY_STREAM) != 0)
        ptsz = vmh_driver_proc(symbol, version, pt) == answer;
    return ptsz;
}

/* The driver answered *pfn for (symbol, version, flags): swap in our wrapper if it is an ABI we
 * interpose, and remember the driver's function for that variant. */
static void ip_hook_lookup(const char *symbol, void **pfn, int version, cuuint64_t flags)
{
    if (symbol == NULL || symbol[0] != 'c' || symbol[1] != 'u' || *pfn == NULL ||
        ip_is_wrapper(*pfn))
        return;
    int ptsz = -1; /* asked for only when a base has two stream variants */
    for (int v = 0; v < IP_VARIANT_COUNT; v++) {
        const ip_hooked_t *row = &ip_rows[v];
        if (version < row->since || version >= row->until || strcmp(symbol + 2, row->base + 2) != 0)
            continue;
        if (row->stream != IP_STREAM_NONE) {
            if (ptsz < 0)
                ptsz = ip_lookup_is_ptsz(symbol, *pfn, version, flags);
            if ((row->stream == IP_STREAM_PTSZ) != (ptsz == 1))
                continue;
        }
        if (version > CUDA_VERSION && vmh_driver_proc(symbol, CUDA_VERSION, flags) != *pfn)
            return; /* a newer ABI than ours: leave it to the program */
        ip_remember((enum ip_variant)v, *pfn);
        *pfn = row->wrapper;
        return;
    }
}

CUresult vmh_ip_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                    cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    PFN_cuGetProcAddress_v12000 real =
        (PFN_cuGetProcAddress_v12000)vmh_ip_real(IP_cuGetProcAddress_v2);
    CUresult r;
    if (real != NULL) {
        r = real(symbol, pfn, cudaVersion, flags, status);
    } else {
        /* Only the CUDA 11.3 ABI in this driver, but the program found our _v2 export (through
         * RTLD_DEFAULT): answer through v1, with the status v1 cannot give. */
        PFN_cuGetProcAddress_v11030 v1 =
            (PFN_cuGetProcAddress_v11030)vmh_ip_real(IP_cuGetProcAddress);
        if (v1 == NULL)
            return CUDA_ERROR_NOT_INITIALIZED;
        r = v1(symbol, pfn, cudaVersion, flags);
        if (status != NULL)
            *status = (r == CUDA_SUCCESS && pfn != NULL && *pfn != NULL)
                          ? CU_GET_PROC_ADDRESS_SUCCESS
                          : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    }
    if (r == CUDA_SUCCESS && pfn != NULL)
        ip_hook_lookup(symbol, pfn, cudaVersion, flags);
    return r;
}

CUresult vmh_ip_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    PFN_cuGetProcAddress_v11030 real =
        (PFN_cuGetProcAddress_v11030)vmh_ip_real(IP_cuGetProcAddress);
    CUresult r;
    if (real != NULL) {
        r = real(symbol, pfn, cudaVersion, flags);
    } else {
        /* The driver exports only _v2 (the simulated one does): v1 is _v2 without a status. */
        PFN_cuGetProcAddress_v12000 v2 =
            (PFN_cuGetProcAddress_v12000)vmh_ip_real(IP_cuGetProcAddress_v2);
        if (v2 == NULL)
            return CUDA_ERROR_NOT_INITIALIZED;
        r = v2(symbol, pfn, cudaVersion, flags, NULL);
    }
    if (r == CUDA_SUCCESS && pfn != NULL)
        ip_hook_lookup(symbol, pfn, cudaVersion, flags);
    return r;
}

/* ---------------------------------------------------------------------------------------------
 * Serve or pass: decided once, at the first interposed call.
 */
atomic_int vmh_ip_mode = IP_MODE_UNKNOWN;
static pthread_once_t ip_once = PTHREAD_ONCE_INIT;

static void ip_init(void)
{
    /* Options, then the driver table (lifetime.h). After the heap's shutdown at exit its calls
     * answer "not ours" (CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_NOT_FOUND) and we pass through. */
    bool serve = vmh_lifetime_ready();
    const vmh_options_t *o = vmh_lifetime_options();
    if (!serve)
        vmh_debug(o && o->disable ? "VMMHOOK_DISABLE is set: every call goes to the driver"
                                  : "no usable CUDA driver: every call goes to the driver");
    atomic_store_explicit(&vmh_ip_mode, serve ? IP_MODE_SERVE : IP_MODE_PASS, memory_order_release);
}

bool vmh_ip_decide(void)
{
    vmh_thread.ip_depth++;
    pthread_once(&ip_once, ip_init);
    vmh_thread.ip_depth--;
    return atomic_load_explicit(&vmh_ip_mode, memory_order_acquire) == IP_MODE_SERVE;
}

/* The exported symbols (src/vmmhook.map), for programs linked with -lcuda and for RTLD_DEFAULT
 * lookups. */
VMH_HOOKED_LOOKUP(IP_EXPORT_ALIAS)
