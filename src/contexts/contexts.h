/* The process's contexts and stream captures, as the library sees them through the interposed
 * entry points (interpose_ctx.c reports them; contexts.c and captures.c keep them; ctx_scope.c and
 * one_queue.c hold the library's scopes and the one-queue rule).
 *
 * Why: memory a program frees may be reused only after work submitted before the free has
 * completed in every context of that device (not only the first context the library saw),
 * and while a stream is capturing the driver forbids calls such as cuCtxSynchronize (they fail
 * and invalidate the capture). The reclaim layer asks this module which contexts to wait for
 * and whether it may wait at all.
 *
 * CONTRACT: interpose_ctx.c / the contexts layer implement it; the heap's reclaim layer
 * consumes it. Change a signature only together with both sides.
 *
 * The library's own driver calls (vmh_drv) are never the interposed ones, so no report follows
 * them: a layer that needs a context current for its own calls enters it through a scope of this
 * file (vmh_ctx_enter, below), which restores the thread's context when it is left, and a
 * context the library retains for itself comes from here too (vmh_ctx_of_device).
 */
#ifndef VMH_CONTEXTS_H
#define VMH_CONTEXTS_H

#include <cuda.h>
#include <stdbool.h>
#include <stddef.h>

#include "phase.h"

/* --- reported by the interposer (after the real call succeeded) --- */

/* A context exists on `device`: cuCtxCreate*, cuDevicePrimaryCtxRetain, or a context first seen
 * current on some thread. Idempotent. */
void vmh_ctx_seen(CUcontext ctx, int device);

/* The program is about to destroy ctx (cuCtxDestroy) or reset/release a primary context:
 * waits until no wait of the library on ctx is in progress, then forgets ctx. */
void vmh_ctx_forget(CUcontext ctx);

/* The calling thread's current context changed (cuCtxSetCurrent, cuCtxPushCurrent,
 * cuCtxPopCurrent, cuCtxCreate, cuDevicePrimaryCtx*, cuCtxDestroy of the current one). */
void vmh_ctx_current_changed(void);

/* Begins a capture on `stream` in `mode` for the calling thread: `begin(call)` makes the real
 * cuStreamBeginCapture* call (the interposer's, with its arguments in `call`), and a success is
 * recorded as by vmh_capture_began. Beginning a capture and a library synchronize
 * (vmh_ctx_sync_device) exclude each other: this waits, holding no lock, while synchronizes
 * that started before it are in progress (a context synchronize of a context with a capturing
 * stream fails and invalidates the capture, in any mode), and no synchronize starts from its
 * call until its capture is recorded (they answer CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED). Returns
 * what `begin` returned. */
typedef CUresult (*vmh_capture_begin_fn)(void *call);
CUresult vmh_capture_begin(CUstream stream, CUstreamCaptureMode mode, vmh_capture_begin_fn begin,
                           void *call);

/* A capture began on `stream` in `mode` on the calling thread, begun without vmh_capture_begin
 * (tests; a report after the fact): waits out the synchronizes in progress like it, then
 * records. Or a capture ended (cuStreamEndCapture, whatever its result, or cuStreamDestroy of
 * the stream). */
void vmh_capture_began(CUstream stream, CUstreamCaptureMode mode);
void vmh_capture_ended(CUstream stream);

/* The calling thread's capture interaction mode changed (cuThreadExchangeStreamCaptureMode). */
void vmh_capture_thread_mode(CUstreamCaptureMode mode);

/* --- asked by the library --- */

/* The calling thread's current context and its device ordinal, with no driver call in steady
 * state (a thread-local cache kept true by the reports above). CUDA_ERROR_INVALID_CONTEXT when
 * the thread has no current context. */
CUresult vmh_ctx_current(CUcontext *ctx, int *device);

/* True when the driver would refuse a potentially unsafe call (cuCtxSynchronize,
 * cuMemAlloc, ...) made by the calling thread now, by the driver's rule: the thread has its
 * own non-relaxed capture in progress, or its interaction mode is global and another thread
 * has a global-mode capture in progress. */
bool vmh_capture_forbids_unsafe(void);

/* True while any stream of the process is capturing (any mode, any thread). The background
 * reclaim waits for this to be false before it synchronizes anything. */
bool vmh_capture_any(void);

/* Waits (from the calling thread) until every context of `device` that the program has made
 * has finished the work submitted before the call: synchronizes each of them in turn, making it
 * current on the calling thread for the wait and restoring the thread's previous context.
 * Returns CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED at once, without calling the driver, while any
 * stream of the process is capturing (vmh_capture_any(), which includes every case where
 * vmh_capture_forbids_unsafe() holds) or a capture is beginning (vmh_capture_begin): a context
 * synchronize waits for the context's capturing streams too, which conflicts with a capture
 * whatever its mode. Once past that check no capture begins until it returns. A context destroyed
 * meanwhile is skipped (vmh_ctx_forget waits for a wait in progress on it); one destroyed without a
 * report (the driver answers CUDA_ERROR_INVALID_CONTEXT or CUDA_ERROR_CONTEXT_IS_DESTROYED for it)
 * is skipped and forgotten, so that it fails no later wait; any other error of a synchronize is
 * returned (the first one), after the other contexts were waited for. The calling thread's current
 * context is learnt here if no report named it. The caller counts its waits (VMH_STAT_syncs). */
CUresult vmh_ctx_sync_device(int device);

/* --- the library's own use of a context ---
 *
 * A scope makes a context current on the calling thread for the library's own driver calls (a
 * synchronize, a copy, a host registration, asking a context's device) and restores the thread's
 * context when it is left. Scopes nest and are left in reverse order of their enter, on the
 * thread that entered them (checked in witness builds). */
typedef struct vmh_ctx_scope {
    CUcontext ctx;    /* the context entered (NULL: an empty scope; leaving it does nothing) */
    CUcontext outer;  /* the thread's current context as known before the enter (NULL: unknown) */
    bool pushed;      /* the enter pushed ctx: the leave pops it */
    CUdevice primary; /* >= 0: the enter retained this device's primary context for the scope */
    unsigned depth;   /* the thread's open scopes, this one included (they are left in order) */
} vmh_ctx_scope_t;

/* Makes ctx current on the calling thread until vmh_ctx_leave(scope). No driver call when ctx is
 * already current as far as the library knows without asking (the thread's cached context,
 * contexts.h's vmh_ctx_current, or the context of an open scope); otherwise cuCtxPushCurrent.
 * On failure the driver's code is returned, nothing was pushed and the scope is empty. */
CUresult vmh_ctx_enter(CUcontext ctx, vmh_ctx_scope_t *scope);

/* Enters the context the library uses for `device` (vmh_ctx_of_device): the calling thread's
 * current context when it is that device's (no push), else the device's primary context,
 * retained for the scope and released when it is left. */
CUresult vmh_ctx_enter_device(int device, vmh_ctx_scope_t *scope);

/* Restores what the enter changed: pops the context it pushed, releases the primary context it
 * retained. A failure is returned (the first one) and logged, once per process (what a failed
 * pop leaves current is unknown: the thread's cached context is asked for again, and the
 * enclosing scopes push again whatever they enter). The scope is empty afterwards. */
CUresult vmh_ctx_leave(vmh_ctx_scope_t *scope);

/* The context the library serves `device` in: the calling thread's current context when it is
 * that device's (asked of the driver), else the device's primary context, retained: a reference
 * the caller keeps for as long as it uses the context (the heap, for the process's life). */
CUresult vmh_ctx_of_device(int device, CUcontext *ctx);

/* The device of ctx (the driver's answer, asked with ctx entered for the call). */
CUresult vmh_ctx_device_of(CUcontext ctx, int *device);

/* --- the order of the program's work ---
 *
 * While the program has made no stream and has one context per device, all its work on a
 * device runs in one queue: the context's legacy default stream (with which the per-thread
 * default streams synchronize, as blocking streams do). Work submitted after a free then runs
 * after every kernel and copy submitted before it, so the freed memory may serve the next
 * allocation at once, as PyTorch's caching allocator and cudaMallocAsync reuse memory within a
 * stream: no wait for the GPU, no memory held back meanwhile. Memory is still unmapped only
 * once the GPU has passed its free (cuMemUnmap does not wait for kernels). The first stream
 * created (cuStreamCreate*, reported by the interposer) or second context of a device ends
 * it for the rest of the process: the report waits for every context the program has made
 * (so that what was reused under the rule has been passed before the new stream or context
 * can run anything), and frees park from then on. What it cannot see: several threads that
 * pass cudaStreamPerThread explicitly, or a program built with --default-stream per-thread,
 * freeing on one thread memory that another thread's per-thread stream still uses (natively
 * cudaFree would wait); VMMHOOK_STREAM_ORDERED=0 is for them (docs/DESIGN.md). */

/* Whether the program's work runs in one queue per device (see above). A free that would reuse
 * its memory at once calls vmh_work_note_reuse first, then this (both sequentially consistent):
 * then either it sees the end of the rule and parks, or the end's wait sees its note and covers
 * the work it followed. */
bool vmh_work_in_one_queue(void);

/* The program made a second queue (why: for the log and the stats): ends the above for good.
 * Only marks (any thread, any mode, no driver call); the wait that makes the end safe is
 * vmh_work_split_wait's. Idempotent. */
void vmh_work_queue_split(const char *why);

/* After the end above, once (the first caller): waits for every context the library knows on
 * every device, so that memory reused under the rule has been passed by the work of the old
 * queue before anything of the new one runs. Called by the interposer right after the report
 * (the program has not got its new stream or context yet) when the library serves, and by the
 * heap's allocation and free paths, which find it pending with one relaxed load. Never while a
 * stream captures: none can before a second queue exists. */
void vmh_work_split_wait(void);
bool vmh_work_split_wait_pending(void);

/* The library is about to release freed memory at once under the rule (until then, the end of
 * the rule needs no wait: nothing was reused early). One load, and one store the first time. */
void vmh_work_note_reuse(void);

/* Why the work is no longer in one queue (NULL while it is). */
const char *vmh_work_split_reason(void);

/* --- fork --- */

/* The layer's process-event steps (phase.h; ctx_wait.c): in the child of a fork, before any
 * higher layer's step runs there, the locks are made anew (another thread of the parent may
 * have held one at the fork) and the waits (contexts.c) and captures (captures.c) of the
 * parent's other threads, which do not exist in the child, are dropped, so that no report made
 * in the child can block. The contexts are kept (CUDA is not usable in the child anyway; the
 * driver answers its calls). lifetime.c's fork handler walks it, once, in every child: reports
 * arrive from the program's first CUDA calls, before the library's start, so that handler is
 * registered at the first use of this layer's locks (first_use.h), after the driver's first
 * successful call. This layer registers no handler of its own. */
extern const vmh_steps_t vmh_contexts_steps;

#ifdef VMH_TESTING
/* Tests: how many times the layer's child step ran in this process (a child inherits its
 * parent's count: 0 unless the parent itself is a forked child). */
unsigned vmh_contexts_after_fork_runs(void);
/* Tests: forget every context and capture; the work is in one queue again. */
void vmh_contexts_reset(void);
/* Tests: the captures beginning now (waiting for synchronizes, or in their real call). */
size_t vmh_capture_begins_pending(void);
#endif

#endif
