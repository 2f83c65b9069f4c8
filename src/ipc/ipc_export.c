/* CUDA IPC, the export table (see ipc_export.h).
 *
 * Owns: the entries (token -> the buffer's chunks, with references). Once exit began (the
 * process's phase past RUNNING, phase.h: lifetime.c's exit handler moves it) nothing of the
 * exporting side calls the driver (no handler of its own: lifetime.c decides start, fork and
 * exit).
 *
 * Locks: table_lock guards the table, and the phase is read under it (table_shut). It is held
 * across every driver call of the table (exports, releases), never across socket I/O or a wait,
 * so that the exit step, which takes it after the phase moved, knows no such call is in flight
 * and none follows. The heap's locks are
 * taken inside it (export release, find); the heap never calls here with one of its own held
 * (its pressure hook runs unlocked).
 */
#include "ipc_export.h"

#include "contexts.h"
#include "driver.h"
#include "grow.h"
#include "heap.h"
#include "log.h"
#include "phase.h"
#include "stats.h"
#include "witness.h"

#include <assert.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct export_entry {
    vmh_ipc_token_t token;
    vmh_export_t ex;
    CUcontext ctx; /* current at cuIpcGetMemHandle: tried when an export needs a context */
} export_entry_t;

static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static export_entry_t *exports;
static size_t nexports, exports_cap;
/* Exit began (or this is a pass-through child, where nothing reaches the table): no more
 * driver calls from here. table_lock held. */
static bool table_shut(void)
{
    return vmh_phase_stage() != VMH_PHASE_RUNNING;
}

/* lifetime.c's exit handler, after the phase moved: it runs before libcuda's own teardown
 * (lifetime registers it once IPC began, after the driver was initialized; atexit handlers run
 * in reverse order). Taking the lock means no driver call of the table is in flight on return,
 * and every later holder reads the phase moved. */
void vmh_ipc_export_exit(void)
{
    vmh_lock(&table_lock, VMH_RANK_IPC_EXPORT);
    vmh_unlock(&table_lock);
}

/* fork (lifetime.c's handlers): the child must not inherit table_lock held by the listener (it
 * prunes every second and exports under it). */
void vmh_ipc_export_prefork(void)
{
    vmh_lock(&table_lock, VMH_RANK_IPC_EXPORT);
}

void vmh_ipc_export_postfork(void)
{
    vmh_unlock(&table_lock);
}

/* The heap's answer: the buffer exported at ex->base has not been freed since (its export
 * serial is that buffer's life; a grow in place keeps it, a free or a move ends it, and a new
 * buffer that lands at the same address has another). The heap recycles freed exported memory
 * like any other, so this check is what keeps a later buffer's data from an importer. */
bool vmh_ipc_buffer_live(const vmh_export_t *ex)
{
    return vmh_heap_export_alive(ex->base, ex->serial);
}

/* Drops the entries whose buffers are no longer live; their references go, and with the last
 * one the memory. table_lock held. */
static size_t prune_locked(void)
{
    if (table_shut())
        return 0;
    size_t w = 0, dropped = 0;
    for (size_t i = 0; i < nexports; i++) {
        if (vmh_ipc_buffer_live(&exports[i].ex)) {
            exports[w++] = exports[i];
            continue;
        }
        vmh_debug("IPC export of %zu bytes at 0x%llx released: the buffer was freed",
                  exports[i].ex.size, (unsigned long long)exports[i].ex.base);
        vmh_heap_export_release(&exports[i].ex);
        dropped++;
    }
    nexports = w;
    return dropped;
}

size_t vmh_ipc_prune(void)
{
    vmh_lock(&table_lock, VMH_RANK_IPC_EXPORT);
    size_t n = prune_locked();
    vmh_unlock(&table_lock);
    return n;
}

static bool same_export(const vmh_export_t *a, const vmh_export_t *b)
{
    if (a->serial != b->serial || a->base != b->base || a->size != b->size ||
        a->offset != b->offset || a->device != b->device || a->nchunks != b->nchunks)
        return false;
    /* Pointer identity is safe: the table's references keep every chunk it names alive. */
    for (size_t i = 0; i < a->nchunks; i++)
        if (a->chunks[i] != b->chunks[i])
            return false;
    return true;
}

CUresult vmh_ipc_export_record(vmh_export_t *ex, CUcontext ctx, vmh_ipc_token_t *token)
{
    vmh_lock(&table_lock, VMH_RANK_IPC_EXPORT);
    CUresult rc = CUDA_SUCCESS;
    if (table_shut()) {
        rc = CUDA_ERROR_DEINITIALIZED;
        goto out;
    }
    prune_locked(); /* an entry of a freed buffer is never matched again */
    for (size_t i = 0; i < nexports; i++) {
        if (same_export(&exports[i].ex, ex)) {
            *token = exports[i].token;
            vmh_heap_export_release(ex); /* the same buffer as before: the same handle */
            goto out;
        }
    }
    if (!vmh_ipc_random(token, sizeof *token)) {
        vmh_log("CUDA IPC: no random bytes for an export token (getrandom and /dev/urandom "
                "failed): cuIpcGetMemHandle answers CUDA_ERROR_OPERATING_SYSTEM");
        rc = CUDA_ERROR_OPERATING_SYSTEM;
        goto out;
    }
    export_entry_t *grown = vmh_grow(exports, &exports_cap, nexports, sizeof *grown, 16);
    if (!grown) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        goto out;
    }
    exports = grown;
    exports[nexports++] = (export_entry_t){.token = *token, .ex = *ex, .ctx = ctx};
out:
    vmh_unlock(&table_lock);
    return rc;
}

vmh_ipc_status_t vmh_ipc_export_take(const vmh_ipc_token_t *token, vmh_export_t *ex, CUcontext *ctx,
                                     int32_t *driver_rc)
{
    memset(ex, 0, sizeof *ex);
    *ctx = NULL;
    *driver_rc = 0;
    vmh_lock(&table_lock, VMH_RANK_IPC_EXPORT);
    vmh_ipc_status_t st = VMH_IPC_UNKNOWN_EXPORT;
    export_entry_t *e = NULL;
    for (size_t i = 0; i < nexports; i++) /* every entry compared: no early exit to time */
        if (vmh_ipc_token_equal(&exports[i].token, token))
            e = &exports[i];
    if (table_shut()) {
        st = VMH_IPC_SHUT_DOWN;
    } else if (e && !vmh_ipc_buffer_live(&e->ex)) {
        prune_locked(); /* freed: the entry goes now, not at the next idle second */
    } else if (e) {
        /* References for the exchange: a prune or reset meanwhile cannot release the chunks. */
        *ex = e->ex;
        *ctx = e->ctx;
        ex->chunks = malloc(e->ex.nchunks * sizeof *ex->chunks);
        if (!ex->chunks) {
            st = VMH_IPC_EXPORT_FAILED;
            *driver_rc = CUDA_ERROR_OUT_OF_MEMORY;
            memset(ex, 0, sizeof *ex);
        } else {
            for (size_t i = 0; i < e->ex.nchunks; i++)
                ex->chunks[i] = vmh_alloc_ref(e->ex.chunks[i]);
            st = VMH_IPC_OK;
        }
    }
    vmh_unlock(&table_lock);
    return st;
}

/* The VMM calls need no context; should a driver want one, the context current at
 * cuIpcGetMemHandle is tried. */
CUresult vmh_ipc_export_fds(const vmh_export_t *ex, CUcontext ctx, size_t first, size_t count,
                            int *fds)
{
    assert(count <= VMH_IPC_BATCH && first + count <= ex->nchunks);
    vmh_lock(&table_lock, VMH_RANK_IPC_EXPORT);
    CUresult rc = table_shut() ? CUDA_ERROR_DEINITIALIZED : CUDA_SUCCESS;
    size_t done = 0;
    while (rc == CUDA_SUCCESS && done < count) {
        CUmemGenericAllocationHandle h = ex->chunks[first + done]->handle;
        rc = vmh_drv.cuMemExportToShareableHandle(&fds[done], h,
                                                  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        vmh_ctx_scope_t scope;
        if (rc == CUDA_ERROR_INVALID_CONTEXT && ctx && vmh_ctx_enter(ctx, &scope) == CUDA_SUCCESS) {
            rc = vmh_drv.cuMemExportToShareableHandle(&fds[done], h,
                                                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
            /* The program's thread keeps the context it had, or the export fails. */
            CUresult left = vmh_ctx_leave(&scope);
            if (rc == CUDA_SUCCESS && left != CUDA_SUCCESS) {
                close(fds[done]);
                rc = left;
            }
        }
        if (rc == CUDA_SUCCESS)
            done++;
    }
    vmh_unlock(&table_lock);
    if (rc != CUDA_SUCCESS)
        for (size_t i = 0; i < done; i++)
            close(fds[i]);
    return rc;
}

void vmh_ipc_export_untake(vmh_export_t *ex)
{
    if (!ex->chunks)
        return;
    vmh_export_t described = *ex;
    described.chunks = NULL;
    vmh_lock(&table_lock, VMH_RANK_IPC_EXPORT);
    if (!table_shut())
        vmh_heap_export_release(ex);
    else
        free(ex->chunks);
    vmh_unlock(&table_lock);
    *ex = described;
}

#ifdef VMH_TESTING
void vmh_ipc_export_reset(void)
{
    vmh_lock(&table_lock, VMH_RANK_IPC_EXPORT);
    for (size_t i = 0; i < nexports; i++)
        vmh_heap_export_release(&exports[i].ex);
    nexports = 0;
    vmh_unlock(&table_lock);
}

size_t vmh_ipc_export_count(void)
{
    return vmh_read_locked(&table_lock, VMH_RANK_IPC_EXPORT, &nexports);
}
#endif
