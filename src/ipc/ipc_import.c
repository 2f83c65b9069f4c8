/* CUDA IPC, the importing side (see ipc_import.h).
 *
 * Owns: the import table (what cuIpcOpenMemHandle mapped here, with its references).
 *
 * Locks: imp_lock guards the import table; it is never held across a driver call or socket
 * I/O, and no other lock of the library is taken inside it.
 */
#include "ipc_import.h"

#include "contexts.h"
#include "driver.h"
#include "grow.h"
#include "handle.h"
#include "heap.h"
#include "log.h"
#include "phase.h"
#include "range.h"
#include "stats.h"
#include "testable.h"
#include "witness.h"

#include <assert.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

VMH_TESTABLE _Atomic int vmh_ipc_exchange_timeout_ms = 10000;

/* More chunks than any buffer of a real device has (1 TiB in 2 MiB chunks is 2^19): an
 * exporter announcing more is not believed. */
#define IPC_MAX_CHUNKS ((uint64_t)1 << 20)

typedef struct import_entry {
    uint32_t pid;
    uint64_t socket_token;
    vmh_ipc_token_t export;
    CUcontext ctx;
    int device; /* ctx's: the close waits for every context of it */
    vmh_range_t *range;
    CUdeviceptr ptr; /* range->base + offset: what the program got */
    size_t size;
    unsigned refs;
} import_entry_t;

static pthread_mutex_t imp_lock = PTHREAD_MUTEX_INITIALIZER;
static import_entry_t *imports;
static size_t nimports, imports_cap;
static atomic_size_t nimports_atomic; /* lock-free "none" for every cuIpcCloseMemHandle */

/* fork (lifetime.c's handlers): the child must not inherit imp_lock held by another thread. */
void vmh_ipc_import_prefork(void)
{
    vmh_lock(&imp_lock, VMH_RANK_IPC_IMPORT);
}

void vmh_ipc_import_postfork(void)
{
    vmh_unlock(&imp_lock);
}

/* The same handle opened again in the same context: one more reference, the same pointer (as
 * cuIpcOpenMemHandle, cuda.h). imp_lock held. */
static bool import_reuse_locked(const vmh_ipc_handle_t *h, CUcontext ctx, CUdeviceptr *out)
{
    for (size_t i = 0; i < nimports; i++) {
        import_entry_t *e = &imports[i];
        if (e->pid == h->pid && e->socket_token == h->socket_token &&
            vmh_ipc_token_equal(&e->export, &h->export) && e->ctx == ctx) {
            e->refs++;
            *out = e->ptr;
            return true;
        }
    }
    return false;
}

/* ---- the exchange ---------------------------------------------------------------------------- */

/* Connects to h's exporter and makes sure it runs as our user: the connected socket, or -1
 * with *rc set (CUDA_ERROR_INVALID_HANDLE: unreachable, or another user's). */
static int connect_exporter(const vmh_ipc_handle_t *h, int64_t deadline, CUresult *rc)
{
    int s = vmh_ipc_connect(h->pid, h->socket_token, deadline);
    if (s < 0) {
        vmh_log("cuIpcOpenMemHandle: the exporting process (pid %u) cannot be reached (%s): it "
                "has exited, or runs in another network namespace (the abstract socket "
                "@vmmhook-ipc.%u.* must be visible to both); CUDA_ERROR_INVALID_HANDLE",
                h->pid, strerror(-s), h->pid);
        *rc = CUDA_ERROR_INVALID_HANDLE;
        return -1;
    }
    /* Before anything is sent or awaited: a socket of another user (one that took the name
     * after the exporter went, or a handle made up to point at it) gets neither the token nor
     * the chance to hand us memory or to hold us waiting. */
    uid_t uid;
    pid_t pid;
    int err = vmh_ipc_check_peer(s, VMH_IPC_IMPORTER_ASKS, &uid, &pid);
    if (err) {
        close(s);
        if (err == EACCES)
            vmh_log("cuIpcOpenMemHandle: the socket named by the handle belongs to pid %d, uid "
                    "%d, not to this user (uid %u): refused, nothing sent; "
                    "CUDA_ERROR_INVALID_HANDLE",
                    (int)pid, (int)uid, (unsigned)geteuid());
        else
            vmh_log("cuIpcOpenMemHandle: cannot tell who owns the exporter's socket (%s): "
                    "refused; CUDA_ERROR_INVALID_HANDLE",
                    strerror(err));
        *rc = CUDA_ERROR_INVALID_HANDLE;
        return -1;
    }
    return s;
}

/* What the reply's status means for the program. */
static CUresult reply_verdict(const vmh_ipc_handle_t *h, const vmh_ipc_reply_t *rep)
{
    switch (rep->status) {
    case VMH_IPC_OK:
        if (rep->nchunks == 0 || rep->nchunks > IPC_MAX_CHUNKS) {
            vmh_log("cuIpcOpenMemHandle: the exporting process announced %llu chunks: "
                    "CUDA_ERROR_MAP_FAILED",
                    (unsigned long long)rep->nchunks);
            return CUDA_ERROR_MAP_FAILED;
        }
        return CUDA_SUCCESS;
    case VMH_IPC_REFUSED_USER:
        vmh_log("cuIpcOpenMemHandle: the exporting process (pid %u) refused: it runs as "
                "another user; CUDA_ERROR_INVALID_HANDLE",
                h->pid);
        return CUDA_ERROR_INVALID_HANDLE;
    case VMH_IPC_UNKNOWN_EXPORT:
    case VMH_IPC_SHUT_DOWN:
        vmh_log("cuIpcOpenMemHandle: the exporting process (pid %u) %s; "
                "CUDA_ERROR_INVALID_HANDLE",
                h->pid,
                rep->status == VMH_IPC_SHUT_DOWN
                    ? "is exiting"
                    : "has no such export (the buffer was freed, or the handle is not its)");
        return CUDA_ERROR_INVALID_HANDLE;
    default:
        vmh_log("cuIpcOpenMemHandle: the exporting process (pid %u) could not export the "
                "buffer (status %u, CUDA error %d): CUDA_ERROR_MAP_FAILED",
                h->pid, rep->status, (int)rep->driver_rc);
        return CUDA_ERROR_MAP_FAILED;
    }
}

/* Receives the batches of s and imports each descriptor as it arrives (closing it at once):
 * allocs[0..n) with a reference each; on failure none is left. */
static CUresult import_batches(int s, const vmh_ipc_handle_t *h, size_t n, int device,
                               int64_t deadline, vmh_alloc_t **allocs)
{
    /* Access for the importing context's device only, as native IPC maps for the current
     * context; the exporter's device numbering means nothing here. */
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = device;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CUresult rc = CUDA_SUCCESS;
    size_t have = 0;
    while (rc == CUDA_SUCCESS && have < n) {
        vmh_ipc_batch_t b;
        int fds[VMH_IPC_BATCH];
        size_t got = 0;
        size_t want = n - have < VMH_IPC_BATCH ? n - have : VMH_IPC_BATCH;
        int err = vmh_ipc_recv(s, &b, sizeof b, fds, VMH_IPC_BATCH, &got, deadline);
        if (err || b.driver_rc || b.count != want || got != want) {
            if (!err && b.driver_rc)
                vmh_log("cuIpcOpenMemHandle: the exporting process (pid %u) could not export "
                        "chunk %zu (CUDA error %d): CUDA_ERROR_MAP_FAILED",
                        h->pid, have, (int)b.driver_rc);
            else
                vmh_log("cuIpcOpenMemHandle: %zu of %zu file descriptors arrived from the "
                        "exporting process (pid %u): %s; CUDA_ERROR_MAP_FAILED",
                        have + got, n, h->pid,
                        err == EPROTO ? "a batch was cut (the descriptor limit?)"
                        : err         ? strerror(err)
                                      : "a batch of the wrong size");
            rc = CUDA_ERROR_MAP_FAILED;
        }
        size_t imported = 0;
        while (rc == CUDA_SUCCESS && imported < got) {
            if (b.sizes[imported] == 0)
                rc = CUDA_ERROR_MAP_FAILED;
            else
                rc = vmh_alloc_import(vmh_heap_grants(device), fds[imported], b.sizes[imported],
                                      device, &acc, 1, &allocs[have + imported]);
            if (rc == CUDA_SUCCESS)
                imported++;
        }
        /* The driver handles hold the memory now; the descriptors are not needed. */
        for (size_t i = 0; i < got; i++)
            close(fds[i]);
        have += imported;
        assert(have <= n);
    }
    if (rc != CUDA_SUCCESS) {
        for (size_t i = 0; i < have; i++)
            vmh_alloc_unref(allocs[i]);
    }
    return rc;
}

/* Asks h's exporter for its chunks and imports them: *pallocs (n of them, a reference each;
 * the caller drops them) and the reply. */
static CUresult fetch_chunks(const vmh_ipc_handle_t *h, int device, vmh_ipc_reply_t *rep,
                             vmh_alloc_t ***pallocs)
{
    *pallocs = NULL;
    int64_t deadline = vmh_ipc_now_ms() + vmh_ipc_exchange_timeout_ms;
    CUresult rc = CUDA_SUCCESS;
    int s = connect_exporter(h, deadline, &rc);
    if (s < 0)
        return rc;
    vmh_ipc_request_t req;
    memset(&req, 0, sizeof req);
    req.magic = VMH_IPC_MAGIC;
    req.version = VMH_IPC_VERSION;
    req.export = h->export;
    /* A failed send still reads: the exporter may have answered (refused) already. */
    (void)vmh_ipc_send(s, &req, sizeof req, NULL, 0);
    size_t nfd = 0;
    int junk[VMH_IPC_BATCH];
    int err = vmh_ipc_recv(s, rep, sizeof *rep, junk, VMH_IPC_BATCH, &nfd, deadline);
    for (size_t i = 0; i < nfd; i++)
        close(junk[i]); /* a reply carries none */
    if (err || rep->magic != VMH_IPC_MAGIC) {
        close(s);
        vmh_log("cuIpcOpenMemHandle: no valid answer from the exporting process (pid %u): %s; "
                "CUDA_ERROR_MAP_FAILED",
                h->pid, err == ETIMEDOUT ? "it did not answer in time" : "the exchange broke");
        return CUDA_ERROR_MAP_FAILED;
    }
    rc = reply_verdict(h, rep);
    vmh_alloc_t **allocs = NULL;
    if (rc == CUDA_SUCCESS) {
        allocs = calloc(rep->nchunks, sizeof *allocs);
        if (!allocs)
            rc = CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (rc == CUDA_SUCCESS)
        rc = import_batches(s, h, rep->nchunks, device, deadline, allocs);
    close(s);
    if (rc != CUDA_SUCCESS) {
        free(allocs);
        return rc;
    }
    *pallocs = allocs;
    return CUDA_SUCCESS;
}

CUresult vmh_ipc_import(const vmh_ipc_handle_t *h, CUcontext ctx, CUdeviceptr *out)
{
    vmh_lock(&imp_lock, VMH_RANK_IPC_IMPORT);
    bool reused = import_reuse_locked(h, ctx, out);
    vmh_unlock(&imp_lock);
    if (reused)
        return CUDA_SUCCESS;

    CUdevice dev;
    CUresult rc = vmh_drv.cuCtxGetDevice(&dev);
    if (rc != CUDA_SUCCESS)
        return rc;
    vmh_ipc_reply_t rep;
    vmh_alloc_t **allocs;
    rc = fetch_chunks(h, (int)dev, &rep, &allocs);
    if (rc != CUDA_SUCCESS)
        return rc;
    size_t n = rep.nchunks, total = 0;
    for (size_t i = 0; i < n && rc == CUDA_SUCCESS; i++)
        if (__builtin_add_overflow(total, allocs[i]->size, &total))
            rc = CUDA_ERROR_MAP_FAILED;
    if (rc == CUDA_SUCCESS && (rep.offset > total || rep.size > total - rep.offset))
        rc = CUDA_ERROR_MAP_FAILED;
    vmh_range_t *range = NULL;
    if (rc == CUDA_SUCCESS)
        rc = vmh_range_create(allocs, n, 0, 0, 0, &range, NULL);
    /* The mappings hold their allocations: drop the import references (on failure this
     * releases every imported handle). */
    for (size_t i = 0; i < n; i++)
        vmh_alloc_unref(allocs[i]);
    free(allocs);
    if (rc != CUDA_SUCCESS) {
        if (rc != CUDA_ERROR_MAP_FAILED)
            vmh_log("cuIpcOpenMemHandle: importing %zu chunk(s) from pid %u failed with CUDA "
                    "error %d",
                    n, h->pid, (int)rc);
        return rc;
    }

    CUdeviceptr ptr = range->base + rep.offset;
    vmh_lock(&imp_lock, VMH_RANK_IPC_IMPORT);
    if (import_reuse_locked(h, ctx, out)) {
        /* Another thread opened the same handle meanwhile: keep its mapping. */
        vmh_unlock(&imp_lock);
        vmh_range_destroy(range);
        return CUDA_SUCCESS;
    }
    import_entry_t *grown = vmh_grow(imports, &imports_cap, nimports, sizeof *grown, 16);
    if (!grown) {
        vmh_unlock(&imp_lock);
        vmh_range_destroy(range);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    imports = grown;
    imports[nimports++] = (import_entry_t){.pid = h->pid,
                                           .socket_token = h->socket_token,
                                           .export = h->export,
                                           .ctx = ctx,
                                           .device = (int)dev,
                                           .range = range,
                                           .ptr = ptr,
                                           .size = rep.size,
                                           .refs = 1};
    atomic_store(&nimports_atomic, nimports);
    vmh_unlock(&imp_lock);
    vmh_debug("CUDA IPC: opened an export of pid %u: %llu bytes in %zu chunk(s) at 0x%llx", h->pid,
              (unsigned long long)rep.size, n, (unsigned long long)ptr);
    *out = ptr;
    return CUDA_SUCCESS;
}

/* ---- close ---------------------------------------------------------------------------------- */

/* Before a mapping goes, the work queued on it must have completed: the program may have
 * launched kernels on the memory just before closing it (cuMemUnmap does not wait,
 * driver-facts 2a), from any context of the device (the mapping is the process's). The wait is
 * contexts.h's: it waits for every context of the device, skips destroyed ones, and refuses
 * (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, no driver call) while any stream captures, where a
 * context synchronize would be refused or invalidate the capture. Any other failure of the
 * wait (a context in an error state) does not keep the mapping: its work is over either way. */
static CUresult wait_before_unmap(int device)
{
    CUresult rc = vmh_ctx_sync_device(device);
    if (rc == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
        return rc;
    vmh_count(VMH_STAT_syncs, 1);
    vmh_count(VMH_STAT_syncs_blocking, 1); /* the program's thread, in its close */
    return CUDA_SUCCESS;
}

/* The entry of p, under imp_lock; NULL when p is not an open import. */
static import_entry_t *import_find_locked(CUdeviceptr p)
{
    for (size_t i = 0; i < nimports; i++)
        if (imports[i].ptr == p)
            return &imports[i];
    return NULL;
}

/* The import at p when a close of it holds its last reference; otherwise NULL with *rc:
 * CUDA_ERROR_NOT_FOUND (no import there) or CUDA_SUCCESS (one reference dropped, others stay).
 * imp_lock held. */
static import_entry_t *last_reference_locked(CUdeviceptr p, CUresult *rc)
{
    import_entry_t *e = import_find_locked(p);
    if (e == NULL) {
        *rc = CUDA_ERROR_NOT_FOUND;
        return NULL;
    }
    if (e->refs > 1) {
        e->refs--;
        *rc = CUDA_SUCCESS;
        return NULL;
    }
    return e;
}

CUresult vmh_ipc_close(CUdeviceptr p)
{
    if (atomic_load_explicit(&nimports_atomic, memory_order_relaxed) == 0)
        return CUDA_ERROR_NOT_FOUND;
    CUresult rc;
    vmh_lock(&imp_lock, VMH_RANK_IPC_IMPORT);
    import_entry_t *e = last_reference_locked(p, &rc);
    if (e == NULL) {
        vmh_unlock(&imp_lock);
        return rc;
    }
    int device = e->device;
    vmh_unlock(&imp_lock);
    /* The last reference: wait (without the lock) before anything changes, so that a close
     * refused during a capture leaves the import open, to be closed after the capture. At exit
     * the driver may be gone: the mapping is forgotten (the process ends with it). */
    bool ready = vmh_phase_stage() < VMH_PHASE_EXITED && vmh_driver_ready();
    if (ready) {
        rc = wait_before_unmap(device);
        if (rc != CUDA_SUCCESS)
            return rc;
    }
    /* Another thread may have opened it again (one more reference: it stays) or closed it
     * (a double close, as natively an error) meanwhile. */
    vmh_lock(&imp_lock, VMH_RANK_IPC_IMPORT);
    e = last_reference_locked(p, &rc);
    if (e == NULL) {
        vmh_unlock(&imp_lock);
        return rc;
    }
    vmh_range_t *range = e->range;
    *e = imports[--nimports];
    atomic_store(&nimports_atomic, nimports);
    vmh_unlock(&imp_lock);
    if (ready)
        vmh_range_destroy(range);
    return CUDA_SUCCESS;
}

/* ---- tests ---------------------------------------------------------------------------------- */

#ifdef VMH_TESTING
void vmh_ipc_import_reset(void)
{
    vmh_lock(&imp_lock, VMH_RANK_IPC_IMPORT);
    import_entry_t *all = imports;
    size_t n = nimports;
    imports = NULL;
    nimports = imports_cap = 0;
    atomic_store(&nimports_atomic, 0);
    vmh_unlock(&imp_lock);
    for (size_t i = 0; i < n; i++)
        vmh_range_destroy(all[i].range);
    free(all);
}

size_t vmh_ipc_import_count(void)
{
    return vmh_read_locked(&imp_lock, VMH_RANK_IPC_IMPORT, &nimports);
}
#endif
