/* Layer "entry points", inside: what the files of the interposed entry points share (interpose.c:
 * dlsym, cuGetProcAddress, the real functions, serve or pass; interpose_mem.c: memory;
 * interpose_ctx.c: contexts and capture). Not for other layers.
 */
#ifndef VMH_INTERPOSE_H
#define VMH_INTERPOSE_H

#include <cuda.h>
#include <cudaTypedefs.h>

#include <stdatomic.h>
#include <stdbool.h>

#include "hooked.h"
#include "stats.h"
#include "thread_state.h"

/* In these files a driver name means that exact symbol (hooked.h undefines cuda.h's versioning
 * macros of the hooked names). */

#define IP_LIKELY(x) __builtin_expect(!!(x), 1)
#define IP_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define IP_HIDDEN __attribute__((visibility("hidden")))

/* The wrappers, with exactly the driver's function types (hidden: what the program reaches is
 * the exported alias below or the pointer a lookup hands out). */
#define IP_DECLARE(sym, pfn, base, since, until, stream) IP_HIDDEN __typeof__(*(pfn)0) vmh_ip_##sym;
VMH_HOOKED(IP_DECLARE)
#undef IP_DECLARE

/* The exported symbol `sym`, an alias of its wrapper; expand a VMH_HOOKED_* list with it in the
 * file that defines the wrappers (an alias must be defined beside its target). The asm label
 * keeps cuda.h's versioning macros (cuCtxCreate -> cuCtxCreate_v4) off the exported name. */
#define IP_EXPORT_ALIAS(sym, pfn, base, since, until, stream)                                      \
    extern __typeof__(vmh_ip_##sym) vmh_export_##sym __asm__(#sym)                                 \
        __attribute__((alias("vmh_ip_" #sym), visibility("default")));

/* Depth of this thread inside the library is its state's ip_depth (thread_state.h): a call
 * that arrives while this thread is already inside (the driver calling back, a hook firing
 * during our own initialisation) goes straight to the real driver. */

/* The real function of variant v (the one the program would have called), or NULL when there
 * is none anywhere in the process. */
extern IP_HIDDEN _Atomic(void *) vmh_ip_real_fns[IP_VARIANT_COUNT];
IP_HIDDEN void *vmh_ip_resolve_real(enum ip_variant v);
static inline void *vmh_ip_real(enum ip_variant v)
{
    void *p = atomic_load_explicit(&vmh_ip_real_fns[v], memory_order_acquire);
    if (IP_LIKELY(p != NULL))
        return p;
    return vmh_ip_resolve_real(v);
}

/* Pass a call to the real function of variant `sym`, counted. No real function at all (no
 * driver anywhere in the process): CUDA_ERROR_NOT_INITIALIZED, what a driver-less stub says. */
#define IP_PASS(sym, ...) IP_PASS_VARIANT(IP_##sym, sym, __VA_ARGS__)

/* IP_PASS to variant v, one of the stream forms of `sym` (both have sym's function type). */
#define IP_PASS_VARIANT(v, sym, ...)                                                               \
    do {                                                                                           \
        __typeof__(&vmh_ip_##sym) real_ = (__typeof__(&vmh_ip_##sym))vmh_ip_real(v);               \
        vmh_count(VMH_STAT_passthrough_calls, 1);                                                  \
        if (IP_UNLIKELY(real_ == NULL))                                                            \
            return CUDA_ERROR_NOT_INITIALIZED;                                                     \
        return real_(__VA_ARGS__);                                                                 \
    } while (0)

/* The real function of `sym`, counted as a pass-through (for wrappers that act on its answer).
 * NULL: answer CUDA_ERROR_NOT_INITIALIZED. */
#define IP_REAL(sym)                                                                               \
    (vmh_count(VMH_STAT_passthrough_calls, 1), (__typeof__(&vmh_ip_##sym))vmh_ip_real(IP_##sym))

/* result = the real function of `sym` called with the arguments (counted as a pass-through), or
 * CUDA_ERROR_NOT_INITIALIZED when there is none: for wrappers that act on the driver's answer. */
#define IP_CALL_REAL(result, sym, ...) IP_CALL_REAL_VARIANT(result, IP_##sym, sym, __VA_ARGS__)

/* IP_CALL_REAL of variant v, one of the stream forms of `sym`. */
#define IP_CALL_REAL_VARIANT(result, v, sym, ...)                                                  \
    do {                                                                                           \
        vmh_count(VMH_STAT_passthrough_calls, 1);                                                  \
        __typeof__(&vmh_ip_##sym) real_ = (__typeof__(&vmh_ip_##sym))vmh_ip_real(v);               \
        (result) = IP_LIKELY(real_ != NULL) ? real_(__VA_ARGS__) : CUDA_ERROR_NOT_INITIALIZED;     \
    } while (0)

/* The wrappers of an entry point's two stream forms (hooked.h's IP_STREAM_FORMS rows), written
 * once: vmh_ip_<sym> and vmh_ip_<sym>_ptsz both return body(variant, ptsz, arguments...), where
 * variant is the form's own (IP_<sym> or IP_<sym>_ptsz: the real function a pass-through
 * reaches) and ptsz whether it is the per-thread-default-stream form. params is the wrapper's
 * parameter list, args the names of its arguments, each in parentheses. */
#define IP_STREAM_FORM_WRAPPERS(sym, body, params, args)                                           \
    CUresult vmh_ip_##sym params                                                                   \
    {                                                                                              \
        return body(IP_##sym, false, IP_UNPAREN args);                                             \
    }                                                                                              \
    CUresult vmh_ip_##sym##_ptsz params                                                            \
    {                                                                                              \
        return body(IP_##sym##_ptsz, true, IP_UNPAREN args);                                       \
    }
#define IP_UNPAREN(...) __VA_ARGS__

/* The stream a call names: in the per-thread-default-stream forms (ptsz) stream 0 is the calling
 * thread's default stream, named CU_STREAM_PER_THREAD (which the heap orders a free after, and
 * captures.c pairs with the thread), not the legacy stream. */
static inline CUstream vmh_ip_stream(bool ptsz, CUstream s)
{
    return ptsz && s == NULL ? CU_STREAM_PER_THREAD : s;
}

/* Serve or pass, decided once at the first interposed call (never at a lookup). */
enum { IP_MODE_UNKNOWN, IP_MODE_SERVE, IP_MODE_PASS };
extern IP_HIDDEN atomic_int vmh_ip_mode;
IP_HIDDEN bool vmh_ip_decide(void);

/* true: this call may be served. A call made while this thread is already inside the library
 * (including during the decision, where pthread_once would deadlock on itself) passes. */
static inline bool vmh_ip_serving(void)
{
    if (IP_UNLIKELY(vmh_thread.ip_depth != 0))
        return false;
    int m = atomic_load_explicit(&vmh_ip_mode, memory_order_acquire);
    if (IP_UNLIKELY(m == IP_MODE_UNKNOWN))
        return vmh_ip_decide();
    return m == IP_MODE_SERVE;
}

/* Whether the library already serves (decided and serving), without deciding: for reactions
 * that matter only when the library holds memory (a trim after another allocator's OOM). */
static inline bool vmh_ip_served_before(void)
{
    return vmh_thread.ip_depth == 0 &&
           atomic_load_explicit(&vmh_ip_mode, memory_order_acquire) == IP_MODE_SERVE;
}

#endif
