/* Pause and resume of tags (vmm_pause, vmm_resume; docs/SLEEP.md), over the heap layer.
 *
 * The heap keeps each tag's memory apart (its own big-buffer set and packing shards per device)
 * and lets this file visit every record of one tag's sets under the record's lock
 * (vmh_bigbuf_visit, vmh_packing_visit): a visit may swap a record's range for a paused
 * description (range.h) and back. While paused, the record has no range; the heap answers
 * frees (the paused description goes: its reservations are freed, its memory was released
 * already), lookups and refusals (realloc, export) from that. Allocation in a tag that is not
 * running is refused by the heap (the sets are frozen, under the same locks the visits take, so
 * an allocation either completes before a pause visits its set or is refused).
 *
 * Pause: freeze the tag's sets, wait for the device (the context synchronize of reclaim.h, which
 * also releases parked frees), give back idle memory, then pause each record (copy to host
 * memory first when asked: through the staging ring of staging.h for fresh pageable memory, see
 * "host memory for backups" below). A failure resumes what the call paused and unfreezes.
 * Resume: prepare every paused record (new memory mapped at its addresses, backup copied back;
 * the description keeps the new range), and only when all succeeded commit them all; otherwise
 * drop what was prepared, so that out of memory leaves the whole tag paused and retryable.
 *
 * Calls are serialized (one pause or resume at a time); the visits hold the heap's record locks
 * across their driver calls (unmap, release, create, map, copy), as the peer-access grant does:
 * these are rare, explicit calls, and holding the locks is what makes a concurrent free or
 * allocation see a record either before or after its change, never half-way.
 */
#include "pause.h"

#include "bigbuf.h"
#include "contexts.h"
#include "driver.h"
#include "heap.h"
#include "log.h"
#include "packing.h"
#include "reclaim.h"
#include "staging.h"
#include "tags.h"

#include <assert.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static pthread_mutex_t pause_lock = PTHREAD_MUTEX_INITIALIZER;
static size_t pin_limit; /* VMMHOOK_PIN_LIMIT */

/* ---- host memory for backups ---------------------------------------------------------------- *
 * Rates measured on an H200 (issue 15, driver-facts.md section 6): pinned copies ~51 GiB/s each
 * way; pinning fresh memory (cudaHostAlloc, or registering memory nothing has touched: every page
 * is faulted in by the pinning) ~2.4 GiB/s; registering memory already touched ~16 GiB/s; copies
 * with pageable memory 9-12 GiB/s down, 6.5 GiB/s up. So pinning a backup before its first copy
 * makes the first pause run at the pinning rate. Instead a pause never pins a backup: it goes
 * into pinned memory kept from an earlier resume when one fits, copied directly at the pinned
 * rate; else into fresh pageable memory, through the staging ring (staging.h: the driver copies
 * into two small pinned slots in turn while a pool of threads copies each filled slot out,
 * faulting the fresh pages in on several cores), or with one direct copy when the pause's
 * pageable total is small or the ring's slots cannot be pinned. The resume registers such a
 * backup, now touched, before copying it back (16 GiB/s, then 51: faster than the 6.5 of a
 * pageable copy up) when VMMHOOK_PIN_LIMIT has room, and keeps it pinned for the process: the
 * next pause of the tag finds it and copies at the pinned rate. docs/SLEEP.md's design notes
 * give the measured and the predicted rates. */

typedef struct pinned {
    void *host;
    size_t size;
    bool in_use;
    struct pinned *next;
} pinned_t;

static pthread_mutex_t pinned_lock = PTHREAD_MUTEX_INITIALIZER;
static pinned_t *pinned_list;
static size_t pinned_bytes; /* kept pinned, plus room claimed by a registration under way */

#define HUGE_PAGE ((size_t)2 << 20)

/* The staging ring (the probe's best case, tools/probe/backup_rate.c: two slots of 16 MiB and
 * 8 threads, 11.09 GiB/s into fresh memory on an H200). Below STAGING_MIN bytes of pageable
 * backups in a pause the ring's setup (pinning 32 MiB, starting the threads) is not worth it. */
#define STAGING_SLOT ((size_t)16 << 20)
#define STAGING_MIN ((size_t)64 << 20)
#define STAGING_WORKERS 8

static size_t staging_slot = STAGING_SLOT, staging_min = STAGING_MIN; /* tests may set them */
static size_t staged_bytes; /* backed up through the ring since the last reset (tests) */

static size_t page_round(size_t n)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return (n + page - 1) / page * page;
}

/* Fresh pageable memory of len bytes (a multiple of the page size), starting on a huge-page
 * boundary when it is at least one huge page long, with huge pages advised: the copy faults it
 * in, and huge pages make that 512 times fewer faults (advice only; the kernel may ignore it).
 * Exactly [result, result + len) is mapped. NULL when the system has none. */
static void *pageable_map(size_t len)
{
    size_t extra = len >= HUGE_PAGE ? HUGE_PAGE : 0;
    if (len > SIZE_MAX - extra)
        return NULL;
    char *raw = mmap(NULL, len + extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
                     0);
    if (raw == MAP_FAILED)
        return NULL;
    char *host = raw;
    if (extra) {
        host = (char *)(((uintptr_t)raw + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
        if (host > raw)
            munmap(raw, (size_t)(host - raw));
        size_t tail = (size_t)(raw + extra - host);
        if (tail)
            munmap(host + len, tail);
    }
    madvise(host, len, MADV_HUGEPAGE);
    return host;
}

/* Bytes of kept pinned buffers free for the next backups. */
static size_t pinned_free_bytes(void)
{
    size_t bytes = 0;
    pthread_mutex_lock(&pinned_lock);
    for (pinned_t *k = pinned_list; k; k = k->next)
        if (!k->in_use)
            bytes += k->size;
    pthread_mutex_unlock(&pinned_lock);
    return bytes;
}

/* Host memory for a backup of size bytes: a kept pinned buffer that is free and fits (the
 * smallest; *pinned true), else fresh pageable memory. Never pins (see above). NULL when the
 * system has no memory. */
static void *backup_get(size_t size, bool *pinned)
{
    pthread_mutex_lock(&pinned_lock);
    pinned_t *best = NULL;
    for (pinned_t *k = pinned_list; k; k = k->next)
        if (!k->in_use && k->size >= size && (!best || k->size < best->size))
            best = k;
    if (best)
        best->in_use = true;
    pthread_mutex_unlock(&pinned_lock);
    *pinned = best != NULL;
    return best ? best->host : pageable_map(page_round(size));
}

static pinned_t *pinned_find(const void *host)
{
    pinned_t *k = pinned_list;
    while (k && k->host != host)
        k = k->next;
    return k;
}

/* Before a resume copies a backup back: pins it (it was touched by the pause's copy, so this is
 * the fast registration) when it is not pinned yet and VMMHOOK_PIN_LIMIT has room, and keeps it
 * for later backups. The calling thread has a context current (registration needs one). A
 * failure only means the copy runs from pageable memory. */
static void backup_pin_for_resume(void *host, size_t size)
{
    size_t len = page_round(size);
    pthread_mutex_lock(&pinned_lock);
    /* Room claimed now, given back below if registering fails. */
    bool pin = !pinned_find(host) && len <= pin_limit && pinned_bytes <= pin_limit - len;
    if (pin)
        pinned_bytes += len;
    pthread_mutex_unlock(&pinned_lock);
    if (!pin)
        return;
    pinned_t *k = malloc(sizeof *k);
    /* PORTABLE: pinned for every context, as a kept buffer may serve another device later. */
    if (k && vmh_drv.cuMemHostRegister(host, len, CU_MEMHOSTREGISTER_PORTABLE) == CUDA_SUCCESS) {
        *k = (pinned_t){host, len, true, NULL};
        pthread_mutex_lock(&pinned_lock);
        k->next = pinned_list;
        pinned_list = k;
        pthread_mutex_unlock(&pinned_lock);
        vmh_tags_pinned_add((int64_t)len);
        return;
    }
    free(k);
    pthread_mutex_lock(&pinned_lock);
    pinned_bytes -= len;
    pthread_mutex_unlock(&pinned_lock);
}

/* Gives back a backup (vmh_host_release_fn): a pinned one stays pinned for the next backup,
 * a pageable one goes back to the system. No driver call: it may run on any thread. */
static void backup_put(void *host, size_t size)
{
    pthread_mutex_lock(&pinned_lock);
    pinned_t *k = pinned_find(host);
    if (k)
        k->in_use = false;
    pthread_mutex_unlock(&pinned_lock);
    if (!k)
        munmap(host, page_round(size));
}

/* ---- visits ---------------------------------------------------------------------------------- */

/* What a visit of one tag needs: the device being visited, whether to back up; for a pause
 * with backups, the staging ring: wanted when enough pageable backups are expected, opened at
 * the first one (pinning its slots needs a context current, which a visit has), closed by the
 * pause before it returns. */
typedef struct job {
    const vmh_dev_t *dev;
    bool backup;
    bool stage; /* pageable backups go through the ring (false again if it cannot open) */
    bool staging_open;
    vmh_staging_t staging;
} job_t;

static CUresult staged_copy(void *dst, CUdeviceptr src, size_t n, void *arg)
{
    return vmh_staging_copy(arg, dst, src, n);
}

/* How to copy a backup into fresh pageable memory: through the ring (opened now if it is the
 * first), else directly (NULL: one cuMemcpyDtoH, which the driver stages itself). */
static vmh_backup_copy_fn pageable_copy(job_t *j)
{
    if (j->stage && !j->staging_open) {
        CUresult rc = vmh_staging_open(&j->staging, j->dev->ctx, staging_slot, STAGING_WORKERS);
        j->staging_open = rc == CUDA_SUCCESS;
        if (!j->staging_open) {
            /* Slower, not wrong: the pause goes on with direct copies. */
            vmh_log("pause: pinning the backup staging slots failed (CUDA error %d): copying "
                    "directly",
                    (int)rc);
            j->stage = false;
        }
    }
    return j->staging_open ? staged_copy : NULL;
}

static CUresult visit_pause(vmh_range_t **range, vmh_paused_t **paused, bool exported, void *arg)
{
    job_t *j = arg;
    /* Shared with another process: its memory would not go, and the importer would lose what
     * it shares. It stays mapped (docs/SLEEP.md). */
    if (!*range || exported)
        return CUDA_SUCCESS;
    size_t size = (*range)->size;
    void *host = NULL;
    bool pinned = false;
    if (j->backup && !(host = backup_get(size, &pinned)))
        return CUDA_ERROR_OUT_OF_MEMORY;
    /* A kept pinned buffer takes the direct copy, at the pinned rate. */
    vmh_backup_copy_fn copy = host && !pinned ? pageable_copy(j) : NULL;
    vmh_paused_t *p;
    CUresult rc = vmh_range_pause(*range, host, copy, &j->staging, &p);
    if (rc != CUDA_SUCCESS) {
        if (host)
            backup_put(host, size);
        /* Memory with another holder (a range left by a move that the GPU has not passed
         * yet, an export being made) stays mapped, like an exported buffer. The same code
         * from the copy is a failure: the range tells the two apart. */
        return rc == CUDA_ERROR_NOT_PERMITTED && !vmh_range_owned_alone(*range) ? CUDA_SUCCESS
                                                                                : rc;
    }
    if (copy)
        staged_bytes += size;
    p->host = host;
    p->host_release = host ? backup_put : NULL;
    *range = NULL;
    *paused = p;
    return CUDA_SUCCESS;
}

static CUresult visit_prepare(vmh_range_t **range, vmh_paused_t **paused, bool exported,
                              void *arg)
{
    (void)range;
    (void)exported;
    job_t *j = arg;
    vmh_paused_t *p = *paused;
    if (!p || p->resumed)
        return CUDA_SUCCESS;
    if (p->host)
        backup_pin_for_resume(p->host, p->size);
    /* naccess 0: each segment's own descriptors; peers come from the handle layer's grants. */
    return vmh_range_resume(p, &j->dev->prop, NULL, 0, p->host, &p->resumed);
}

static CUresult visit_abort(vmh_range_t **range, vmh_paused_t **paused, bool exported, void *arg)
{
    (void)range;
    (void)exported;
    (void)arg;
    if (*paused) {
        vmh_range_destroy((*paused)->resumed);
        (*paused)->resumed = NULL;
    }
    return CUDA_SUCCESS;
}

static CUresult visit_commit(vmh_range_t **range, vmh_paused_t **paused, bool exported,
                             void *arg)
{
    (void)exported;
    (void)arg;
    vmh_paused_t *p = *paused;
    if (!p || !p->resumed)
        return CUDA_SUCCESS;
    *range = p->resumed;
    p->resumed = NULL;
    *paused = NULL;
    vmh_paused_destroy(p); /* a pinned backup stays for the next pause, others go */
    return CUDA_SUCCESS;
}

/* Runs fn over every record of tag on every device that has memory of it; with_context: with
 * the device's context current (the copies need one; unmapping, releasing and freeing
 * addresses do not, so the steps that cannot fail never depend on it). Stops at the first
 * failure. */
static CUresult visit_tag(unsigned tag, vmh_pause_visit_fn fn, job_t *j, bool with_context)
{
    for (int dev = 0; dev < VMH_MAX_DEVICES; dev++) {
        vmh_tag_parts_t parts;
        if (!vmh_heap_tag_parts(dev, tag, &parts))
            continue;
        j->dev = parts.dev;
        CUresult rc = with_context ? vmh_drv.cuCtxPushCurrent(parts.dev->ctx) : CUDA_SUCCESS;
        if (rc != CUDA_SUCCESS)
            return rc;
        if (parts.big)
            rc = vmh_bigbuf_visit(parts.big, fn, j);
        if (rc == CUDA_SUCCESS && parts.pack)
            rc = vmh_packing_visit(parts.pack, fn, j);
        if (j->staging_open) /* its stream belongs to this context */
            vmh_staging_leave_context(&j->staging);
        CUcontext popped;
        if (with_context)
            vmh_drv.cuCtxPopCurrent(&popped);
        if (rc != CUDA_SUCCESS)
            return rc;
    }
    return CUDA_SUCCESS;
}

/* Both steps of a resume; on failure nothing of the tag is left mapped by the call. Out of
 * memory first gives back the library's idle memory (cached buffers of any tag, empty packing
 * chunks) and tries once more: memory held idle must not keep a tag paused. */
static CUresult resume_records(unsigned tag)
{
    CUresult rc;
    for (int attempt = 0;; attempt++) {
        job_t j = {0};
        rc = visit_tag(tag, visit_prepare, &j, true);
        job_t k = {0};
        /* Neither step can fail: they only swap pointers and undo (unmap, release, free). */
        visit_tag(tag, rc == CUDA_SUCCESS ? visit_commit : visit_abort, &k, false);
        if (rc != CUDA_ERROR_OUT_OF_MEMORY || attempt > 0 || vmh_heap_trim() == 0)
            return rc;
    }
}

static void tag_memory(unsigned tag, vmh_tag_memory_t *out);

/* *stays_paused: the pause failed and so did resuming what it had paused. */
static CUresult pause_tag(unsigned tag, bool backup, bool *stays_paused)
{
    *stays_paused = false;
    vmh_heap_tag_freeze(tag, true);
    /* Work queued before the call may still use the memory: wait for every device the tag
     * has memory on (this also releases the parked frees that the trim below gives back). */
    CUresult rc = CUDA_SUCCESS;
    for (int dev = 0; dev < VMH_MAX_DEVICES && rc == CUDA_SUCCESS; dev++) {
        vmh_tag_parts_t parts;
        if (vmh_heap_tag_parts(dev, tag, &parts))
            rc = vmh_reclaim_wait(parts.reclaim, VMH_WAIT_APP);
    }
    if (rc == CUDA_SUCCESS) {
        vmh_heap_trim(); /* idle memory: cached buffers, empty packing extents */
        job_t j = {.backup = backup};
        if (backup) {
            /* What the backups will need beyond the kept pinned memory (an estimate: a
             * record that stays mapped takes nothing). */
            vmh_tag_memory_t m;
            tag_memory(tag, &m);
            size_t need = m.mapped - m.kept, pinned = pinned_free_bytes();
            j.stage = need > pinned && need - pinned >= staging_min;
        }
        rc = visit_tag(tag, visit_pause, &j, true);
        if (j.staging_open)
            vmh_staging_close(&j.staging); /* before any resume below: nothing pinned stays */
    }
    if (rc != CUDA_SUCCESS && resume_records(tag) != CUDA_SUCCESS) {
        /* Back to running failed too (out of memory after a failed copy): the tag stays
         * paused, and vmm_resume can be tried again. */
        vmh_log("pause of tag %s failed (CUDA error %d) and so did giving back what it had "
                "paused: the tag stays paused", vmh_tag_name(tag), (int)rc);
        *stays_paused = true;
    }
    return rc;
}

/* ---- statistics ------------------------------------------------------------------------------ */

static CUresult visit_count(vmh_range_t **range, vmh_paused_t **paused, bool exported, void *arg)
{
    vmh_tag_memory_t *m = arg;
    if (*range) {
        m->mapped += (*range)->size;
        if (exported)
            m->kept += (*range)->size;
    }
    if (*paused) {
        m->paused += (*paused)->size;
        if ((*paused)->host)
            m->backed_up += (*paused)->size;
    }
    return CUDA_SUCCESS;
}

static void tag_memory(unsigned tag, vmh_tag_memory_t *out)
{
    memset(out, 0, sizeof *out);
    for (int dev = 0; dev < VMH_MAX_DEVICES; dev++) {
        vmh_tag_parts_t parts;
        if (!vmh_heap_tag_parts(dev, tag, &parts))
            continue;
        if (parts.big)
            vmh_bigbuf_visit(parts.big, visit_count, out);
        if (parts.pack)
            vmh_packing_visit(parts.pack, visit_count, out);
    }
}

void vmh_pause_configure(const vmh_options_t *opt)
{
    pin_limit = opt->pin_limit;
    vmh_tags_set_memory_source(tag_memory);
}

/* ---- the API --------------------------------------------------------------------------------- */

/* *driver_rc: the driver's code when the result is VMM_ERR_DRIVER (for vmm_last_driver_error,
 * which the entry points keep). */
static vmm_status to_status(CUresult rc, CUresult *driver_rc)
{
    switch (rc) {
    case CUDA_SUCCESS:
        return VMM_OK;
    case CUDA_ERROR_OUT_OF_MEMORY:
        return VMM_ERR_NO_MEMORY;
    default:
        vmh_log("pause/resume: CUDA error %d", (int)rc);
        *driver_rc = rc;
        return VMM_ERR_DRIVER;
    }
}

typedef vmm_status (*tag_op_t)(unsigned tag, unsigned flags, CUresult *driver_rc);

static vmm_status pause_one(unsigned tag, unsigned flags, CUresult *driver_rc)
{
    if (!vmh_tag_transition(tag, VMH_TAG_RUNNING, VMH_TAG_PAUSING))
        return VMM_ERR_PAUSED;
    uint64_t t0 = vmh_tags_now_ns();
    bool stays_paused;
    CUresult rc = pause_tag(tag, flags & VMM_PAUSE_BACKUP, &stays_paused);
    if (rc == CUDA_SUCCESS || stays_paused) {
        vmh_tag_transition(tag, VMH_TAG_PAUSING, VMH_TAG_PAUSED);
        if (rc == CUDA_SUCCESS)
            vmh_tag_note_pause(tag, vmh_tags_now_ns() - t0);
    } else {
        /* Running first, then unfrozen: a set the heap creates meanwhile sees either. */
        vmh_tag_transition(tag, VMH_TAG_PAUSING, VMH_TAG_RUNNING);
        vmh_heap_tag_freeze(tag, false);
    }
    return to_status(rc, driver_rc);
}

static vmm_status resume_one(unsigned tag, unsigned flags, CUresult *driver_rc)
{
    (void)flags;
    if (!vmh_tag_transition(tag, VMH_TAG_PAUSED, VMH_TAG_RESUMING))
        return VMM_ERR_NOT_PAUSED;
    uint64_t t0 = vmh_tags_now_ns();
    CUresult rc = resume_records(tag);
    if (rc == CUDA_SUCCESS) {
        vmh_tag_transition(tag, VMH_TAG_RESUMING, VMH_TAG_RUNNING);
        vmh_heap_tag_freeze(tag, false);
        vmh_tag_note_resume(tag, vmh_tags_now_ns() - t0);
    } else {
        vmh_tag_transition(tag, VMH_TAG_RESUMING, VMH_TAG_PAUSED);
    }
    return to_status(rc, driver_rc);
}

/* One tag by name, or (name NULL) every tag op applies to: VMM_ERR_PAUSED / NOT_PAUSED from a
 * tag it does not apply to are skipped then; the first other failure stops and is returned. */
static vmm_status for_tags(const char *name, unsigned flags, tag_op_t op, vmm_status skip,
                           CUresult *driver_rc)
{
    /* The device wait (and the unmapping of memory a capture may be recording) would break
     * a capture in progress: the driver refuses the wait and invalidates the capture. */
    if (vmh_capture_any())
        return VMM_ERR_CAPTURING;
    unsigned one = VMH_TAG_NONE;
    if (name && (one = vmh_tag_lookup(name)) == VMH_TAG_NONE)
        return VMM_ERR_UNKNOWN_TAG;
    pthread_mutex_lock(&pause_lock);
    vmm_status st = VMM_OK;
    if (name) {
        st = op(one, flags, driver_rc);
    } else {
        unsigned n = vmh_tag_count();
        for (unsigned t = 0; t < n && st == VMM_OK; t++) {
            st = op(t, flags, driver_rc);
            if (st == skip)
                st = VMM_OK;
        }
    }
    pthread_mutex_unlock(&pause_lock);
    return st;
}

vmm_status vmh_pause_tags(const char *tag, unsigned flags, CUresult *driver_rc)
{
    if (flags & ~VMM_PAUSE_BACKUP)
        return VMM_ERR_INVALID;
    return for_tags(tag, flags, pause_one, VMM_ERR_PAUSED, driver_rc);
}

vmm_status vmh_resume_tags(const char *tag, CUresult *driver_rc)
{
    return for_tags(tag, 0, resume_one, VMM_ERR_NOT_PAUSED, driver_rc);
}

#ifdef VMH_TESTING
size_t vmh_pause_staged_bytes(void)
{
    return staged_bytes;
}

void vmh_pause_set_staging(size_t slot, size_t min_total)
{
    staging_slot = slot ? slot : STAGING_SLOT;
    staging_min = min_total ? min_total : STAGING_MIN;
}

void vmh_pause_reset(void)
{
    staged_bytes = 0;
    vmh_pause_set_staging(0, 0);
    pthread_mutex_lock(&pinned_lock);
    while (pinned_list) {
        pinned_t *k = pinned_list;
        pinned_list = k->next;
        assert(!k->in_use);
        vmh_drv.cuMemHostUnregister(k->host);
        munmap(k->host, k->size);
        vmh_tags_pinned_add(-(int64_t)k->size);
        free(k);
    }
    pinned_bytes = 0;
    pthread_mutex_unlock(&pinned_lock);
}
#endif
