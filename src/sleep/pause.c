/* Pause and resume of tags (vmm_pause, vmm_resume; docs/SLEEP.md), over the heap layer.
 *
 * The heap keeps each tag's memory apart (its own-chunk set and carved shards per device)
 * and lets this file reach it only through one visit (vmh_heap_visit_tag), under the records'
 * locks, a run of records adjacent in address space at a time: a visit may swap a record's
 * range for a paused description (range.h) and back, and does so for a whole run at once, so
 * that the driver calls follow runs (one unmap, one access call per stretch in a reservation)
 * and the backups are copied a run at a time. While paused, the record has no range; the heap
 * answers frees (the paused description goes: its reservations are freed, its memory was released
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

#include "clock.h"
#include "contexts.h"
#include "driver.h"
#include "heap.h"
#include "log.h"
#include "overflow.h"
#include "reclaim.h"
#include "staging.h"
#include "tags.h"
#include "witness.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static pthread_mutex_t pause_lock = PTHREAD_MUTEX_INITIALIZER;

/* ---- host memory for backups ---------------------------------------------------------------- *
 * The staging layer owns it (staging.h): this file asks it for each backup and gives it back. The
 * measured rates (docs/SLEEP.md's design notes) order them: a pinned copy is the fastest each way;
 * pinning fresh memory is slower than a pageable copy, registering memory already touched much
 * faster than pinning fresh memory; a pageable copy up is slower than one down. So a backup is
 * never pinned before its copy: it goes into a kept pinned buffer when a free one fits (one direct
 * copy at the pinned rate), else into fresh pageable memory through the staging ring (the driver
 * copies into two small pinned slots in turn while a pool of threads copies each filled slot out,
 * faulting the fresh pages in on several cores), or with one direct copy when the pause's pageable
 * total is small or the ring's slots cannot be pinned. A backup copied through the ring is then
 * registered by the ring's pinner thread while the ring copies the next ones, when the budget has
 * room, and kept pinned: the first resume copies it back at the pinned rate, and so does every
 * later pause and resume. Backups the pause did not pin are registered by the resume before their
 * copy back (registering, then a pinned copy: faster than a pageable copy up) when the budget has
 * room. */

/* The staging ring (the probe's best case, tools/probe/backup_rate.c: two slots of 16 MiB and
 * 8 threads). Below STAGING_MIN bytes of pageable backups in a pause the ring's setup (pinning
 * 32 MiB, starting the threads) is not worth it. */
#define STAGING_SLOT ((size_t)16 << 20)
#define STAGING_MIN ((size_t)64 << 20)
#define STAGING_WORKERS 8

static size_t staging_slot = STAGING_SLOT, staging_min = STAGING_MIN; /* tests may set them */
static size_t staged_bytes; /* backed up through the ring since the last reset (tests) */

/* ---- visits ---------------------------------------------------------------------------------- */

/* What a visit of one tag needs: the device being visited, whether to back up; for a pause
 * with backups, the staging ring: wanted when enough pageable backups are expected, opened at
 * the first one (pinning its slots needs a context current, which a visit has), closed by the
 * pause before it returns. */
typedef struct job {
    const vmh_dev_t *dev;
    vmh_overflow_dev_t *overflow; /* the device's part of the overflow layer (a resume's spill) */
    bool backup;
    vmh_backup_kind_t kind; /* of the backups' host memory (staging.h) */
    bool stage; /* pageable backups go through the ring (false again if it cannot open) */
    bool keep;  /* a resume's commit: backups stay attached to their records (kept) */
    bool staging_open;
    vmh_staging_t staging;
} job_t;

/* Whether pageable backups go through the ring (opened now if this is the first): false when
 * it is not wanted or cannot open (then one cuMemcpyDtoH each, which the driver stages itself). */
static bool ring_ready(job_t *j)
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
    return j->staging_open;
}

/* Whether the pause takes a record's memory. Shared with another process: its memory would not
 * go, and the importer would lose what it shares; memory with another holder (a range left by a
 * move that the GPU has not passed yet, an export being made) likewise. Both stay mapped
 * (docs/SLEEP.md). */
static bool pausable(const vmh_visit_rec_t *r)
{
    return *r->range && !r->exported && vmh_range_owned_alone(*r->range);
}

/* Scratch arrays of one run's visit: its records' ranges, descriptions and backups. */
typedef struct run_work {
    vmh_range_t **ranges;
    vmh_paused_t **paused;
    void **host;
    size_t *len;  /* bytes of each backup */
    bool *pinned; /* the backup is a kept pinned buffer, or one kept attached (copied directly) */
    bool *reused; /* the backup was kept attached to the record: it goes back there on failure */
    size_t *rec;  /* index into the run */
} run_work_t;

static bool run_work_get(run_work_t *w, size_t n)
{
    w->ranges = calloc(n, sizeof *w->ranges);
    w->paused = calloc(n, sizeof *w->paused);
    w->host = calloc(n, sizeof *w->host);
    w->len = calloc(n, sizeof *w->len);
    w->pinned = calloc(n, sizeof *w->pinned);
    w->reused = calloc(n, sizeof *w->reused);
    w->rec = calloc(n, sizeof *w->rec);
    return w->ranges && w->paused && w->host && w->len && w->pinned && w->reused && w->rec;
}

static void run_work_put(run_work_t *w)
{
    free(w->ranges);
    free(w->paused);
    free(w->host);
    free(w->len);
    free(w->pinned);
    free(w->reused);
    free(w->rec);
}

/* Copies the k pausable records of a run into their backups (got already): a kept pinned buffer
 * takes a direct copy (at the pinned rate); records next to each other in address space with
 * pageable backups go through the staging ring together, one stream of pieces for the stretch
 * (vmh_staging_copy_run), and the pinner registers each one copied (touched) while the ring
 * goes on, when the budget has room. */
static CUresult copy_backups(job_t *j, run_work_t *w, size_t k)
{
    CUresult rc = CUDA_SUCCESS;
    for (size_t x = 0, y; x < k && rc == CUDA_SUCCESS; x = y) {
        const vmh_range_t *r = w->ranges[x];
        y = x + 1;
        if (w->pinned[x] || !ring_ready(j)) {
            rc = vmh_drv.cuMemcpyDtoH(w->host[x], r->base, r->size);
            continue;
        }
        while (y < k && !w->pinned[y] &&
               w->ranges[y - 1]->base + w->ranges[y - 1]->size == w->ranges[y]->base)
            y++;
        rc = vmh_staging_copy_run(&j->staging, &w->host[x], &w->len[x], y - x, r->base);
        for (size_t i = x; i < y && rc == CUDA_SUCCESS; i++) {
            staged_bytes += w->len[i];
            /* Copied (so touched): the pinner registers it while the ring copies the next
             * ones, when the budget has room and the pause asked for no other kind. */
            if (j->kind == VMH_BACKUP_ANY)
                vmh_staging_pin_later(&j->staging, w->host[i], w->len[i]);
        }
    }
    return rc;
}

/* The backup kept attached to r since a resume (VMM_RESUME_KEEP_BACKUP), taken off r for this
 * pause to write the fresh bytes into (the same host memory, at the same address: what
 * torch_memory_saver's retained backups promise) when it fits: same size, same kind of memory.
 * One that does not fit is given back now. NULL when none is taken. */
static void *kept_take(const job_t *j, vmh_range_t *r)
{
    vmh_backup_t *kb = &r->kept;
    if (kb->host && (kb->size != r->size || kb->kind != (unsigned)j->kind))
        vmh_backup_release(kb);
    void *host = kb->host;
    *kb = (vmh_backup_t){0};
    return host;
}

/* Pauses every record of a run it may (pausable): the backups first, a stretch at a time
 * (copy_backups), then the records together, so that their mappings go with one cuMemUnmap per
 * stretch in one reservation (range.h's vmh_range_pause_run). On failure every record stays
 * as it was. */
static CUresult visit_pause(vmh_visit_rec_t *recs, size_t n, void *arg)
{
    job_t *j = arg;
    run_work_t w;
    CUresult rc = run_work_get(&w, n) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    size_t k = 0;
    for (size_t i = 0; i < n && rc == CUDA_SUCCESS; i++) {
        if (!pausable(&recs[i]))
            continue;
        w.ranges[k] = *recs[i].range;
        w.rec[k] = i;
        w.len[k] = w.ranges[k]->size;
        /* A kept backup's pages are touched already: one direct copy (the ring's parallel
         * faulting gains nothing), pinned or not. */
        if (j->backup && (w.host[k] = kept_take(j, w.ranges[k])))
            w.pinned[k] = w.reused[k] = true;
        else if (j->backup &&
                 !(w.host[k] = vmh_staging_backup_get(w.len[k], j->kind, &w.pinned[k])))
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        k += rc == CUDA_SUCCESS;
    }
    if (rc == CUDA_SUCCESS && j->backup)
        rc = copy_backups(j, &w, k);
    if (rc == CUDA_SUCCESS && k)
        rc = vmh_range_pause_run(w.ranges, k, j->dev->chunk_max, w.paused);
    for (size_t i = 0; i < k; i++) {
        if (rc != CUDA_SUCCESS) {
            if (w.reused[i]) /* the range is still mapped: its kept backup goes back on it */
                w.ranges[i]->kept =
                    (vmh_backup_t){w.host[i], w.len[i], (unsigned)j->kind, vmh_staging_backup_put};
            else if (w.host[i])
                vmh_staging_backup_put(w.host[i], w.len[i]);
            continue;
        }
        vmh_paused_t *p = w.paused[i];
        if (w.host[i])
            vmh_staging_backup_settle(w.host[i], w.len[i]);
        p->host = w.host[i];
        p->host_release = p->host ? vmh_staging_backup_put : NULL;
        p->host_kind = (unsigned)j->kind;
        *recs[w.rec[i]].range = NULL;
        *recs[w.rec[i]].paused = p;
    }
    run_work_put(&w);
    return rc;
}

/* Host memory for a segment the device has no room for at a resume (overflow.h). */
static CUresult spill_chunk(void *arg, size_t size, vmh_alloc_t **out)
{
    return vmh_overflow_chunk(arg, size, out);
}

/* Maps new memory for every paused record of a run, all or nothing, with one cuMemSetAccess per
 * stretch of adjacent segments (range.h's vmh_range_resume_run); the records keep the new
 * ranges in p->resumed until the commit. */
static CUresult visit_prepare(vmh_visit_rec_t *recs, size_t n, void *arg)
{
    job_t *j = arg;
    run_work_t w;
    if (!run_work_get(&w, n)) {
        run_work_put(&w);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        vmh_paused_t *p = *recs[i].paused;
        if (!p || p->resumed)
            continue;
        if (p->host)
            vmh_staging_pin_now(p->host, p->size, j->dev->ctx);
        w.paused[k] = p;
        w.host[k++] = p->host;
    }
    /* naccess 0: each segment's own descriptors; peers come from the handle layer's grants.
     * With VMMHOOK_OVERFLOW=host what the device has no room for comes back in host memory:
     * a resume does not fail for lack of device memory. */
    CUresult rc =
        k ? vmh_range_resume_run((const vmh_paused_t *const *)w.paused, k, &j->dev->prop, NULL, 0,
                                 (const void *const *)w.host,
                                 vmh_overflow_enabled() ? spill_chunk : NULL, j->overflow, w.ranges)
          : CUDA_SUCCESS;
    for (size_t i = 0; i < k && rc == CUDA_SUCCESS; i++)
        w.paused[i]->resumed = w.ranges[i];
    run_work_put(&w);
    return rc;
}

static CUresult visit_abort(vmh_visit_rec_t *recs, size_t n, void *arg)
{
    (void)arg;
    for (size_t i = 0; i < n; i++) {
        vmh_paused_t *p = *recs[i].paused;
        if (p) {
            vmh_range_destroy(p->resumed);
            p->resumed = NULL;
        }
    }
    return CUDA_SUCCESS;
}

static CUresult visit_commit(vmh_visit_rec_t *recs, size_t n, void *arg)
{
    const job_t *j = arg;
    for (size_t i = 0; i < n; i++) {
        vmh_paused_t *p = *recs[i].paused;
        if (!p || !p->resumed)
            continue;
        /* Kept: the backup stays attached to the running record (readable, reused by its next
         * pause, given back with it). A file backup is never kept: its point is to hold no
         * host memory, and it is read back already. */
        if (j->keep && p->host && p->host_kind != VMH_BACKUP_FILE) {
            p->resumed->kept = (vmh_backup_t){p->host, p->size, p->host_kind, p->host_release};
            p->host = NULL;
        }
        *recs[i].range = p->resumed;
        p->resumed = NULL;
        *recs[i].paused = NULL;
        vmh_paused_destroy(p); /* a pinned backup stays for the next pause, others go */
    }
    return CUDA_SUCCESS;
}

/* Runs fn over every run of records of tag on every device that has memory of it (the heap's
 * visit); with_context: with the device's context current (the copies need one; unmapping,
 * releasing and freeing addresses do not, so the steps that cannot fail never depend on it).
 * Stops at the first failure. */
static CUresult visit_tag(unsigned tag, vmh_visit_run_fn fn, job_t *j, bool with_context)
{
    for (int dev = 0; dev < VMH_MAX_DEVICES; dev++) {
        vmh_tag_parts_t parts;
        if (!vmh_heap_tag_parts(dev, tag, &parts))
            continue;
        j->dev = parts.dev;
        j->overflow = parts.overflow;
        vmh_ctx_scope_t scope = {0};
        CUresult rc = with_context ? vmh_ctx_enter(parts.dev->ctx, &scope) : CUDA_SUCCESS;
        if (rc != CUDA_SUCCESS)
            return rc;
        rc = vmh_heap_visit_tag(dev, tag, fn, j);
        if (j->staging_open) /* its stream belongs to this context */
            vmh_staging_leave_context(&j->staging);
        CUresult left = vmh_ctx_leave(&scope);
        if (rc == CUDA_SUCCESS)
            rc = left; /* the program's thread must get its context back */
        if (rc != CUDA_SUCCESS)
            return rc;
    }
    return CUDA_SUCCESS;
}

/* Both steps of a resume; on failure nothing of the tag is left mapped by the call. Out of
 * memory first gives back the library's idle memory (cached buffers of any tag, empty shared
 * chunks) and tries once more: memory held idle must not keep a tag paused. */
static CUresult resume_records(unsigned tag, bool keep)
{
    CUresult rc;
    for (int attempt = 0;; attempt++) {
        job_t j = {0};
        rc = visit_tag(tag, visit_prepare, &j, true);
        job_t k = {.keep = keep};
        /* Neither step can fail: they only swap pointers and undo (unmap, release, free). */
        visit_tag(tag, rc == CUDA_SUCCESS ? visit_commit : visit_abort, &k, false);
        if (rc != CUDA_ERROR_OUT_OF_MEMORY || attempt > 0 || vmh_heap_trim() == 0)
            return rc;
    }
}

static void tag_memory(unsigned tag, vmh_tag_memory_t *out);

/* *stays_paused: the pause failed and so did resuming what it had paused. */
/* The host memory a pause's flags ask for (VMM_PAUSE_PAGEABLE, VMM_PAUSE_DISK). */
static vmh_backup_kind_t backup_kind(unsigned flags)
{
    if (flags & VMM_PAUSE_DISK)
        return VMH_BACKUP_FILE;
    return flags & VMM_PAUSE_PAGEABLE ? VMH_BACKUP_PAGEABLE : VMH_BACKUP_ANY;
}

static CUresult pause_tag(unsigned tag, unsigned flags, bool *stays_paused)
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
        vmh_heap_trim(); /* idle memory: cached buffers, empty shared extents */
        job_t j = {.backup = flags & VMM_PAUSE_BACKUP, .kind = backup_kind(flags)};
        if (j.backup) {
            /* What the backups will need beyond the kept pinned memory (an estimate: a
             * record that stays mapped takes nothing). */
            vmh_tag_memory_t m;
            tag_memory(tag, &m);
            size_t need = m.mapped - m.kept;
            size_t pinned = j.kind == VMH_BACKUP_ANY ? vmh_staging_pinned_free() : 0;
            j.stage = need > pinned && need - pinned >= staging_min;
            /* mapped before the copies (see vmh_staging_region_open); files map their own */
            if (j.stage && j.kind != VMH_BACKUP_FILE)
                vmh_staging_region_open(need - pinned);
        }
        rc = visit_tag(tag, visit_pause, &j, true);
        if (j.staging_open)
            vmh_staging_close(&j.staging); /* before any resume below: nothing pinned stays */
        vmh_staging_region_close();
    }
    if (rc != CUDA_SUCCESS && resume_records(tag, false) != CUDA_SUCCESS) {
        /* Back to running failed too (out of memory after a failed copy): the tag stays
         * paused, and vmm_resume can be tried again. */
        vmh_log("pause of tag %s failed (CUDA error %d) and so did giving back what it had "
                "paused: the tag stays paused",
                vmh_tag_name(tag), (int)rc);
        *stays_paused = true;
    }
    return rc;
}

/* ---- statistics ------------------------------------------------------------------------------ */

static CUresult visit_count(vmh_visit_rec_t *recs, size_t n, void *arg)
{
    vmh_tag_memory_t *m = arg;
    for (size_t i = 0; i < n; i++) {
        const vmh_range_t *r = *recs[i].range;
        const vmh_paused_t *p = *recs[i].paused;
        if (r) {
            size_t host = vmh_range_host_bytes(r);
            m->mapped += r->size - host;
            m->spilled += host;
            if (recs[i].exported)
                m->kept += r->size;
        }
        if (p) {
            m->paused += p->size;
            if (p->host)
                m->backed_up += p->size;
        }
    }
    return CUDA_SUCCESS;
}

static void tag_memory(unsigned tag, vmh_tag_memory_t *out)
{
    memset(out, 0, sizeof *out);
    for (int dev = 0; dev < VMH_MAX_DEVICES; dev++)
        vmh_heap_visit_tag(dev, tag, visit_count, out);
}

void vmh_pause_configure(size_t pin_limit)
{
    vmh_staging_configure(pin_limit);
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
    uint64_t t0 = vmh_now_ns();
    bool stays_paused;
    CUresult rc = pause_tag(tag, flags, &stays_paused);
    if (rc == CUDA_SUCCESS || stays_paused) {
        vmh_tag_transition(tag, VMH_TAG_PAUSING, VMH_TAG_PAUSED);
        if (rc == CUDA_SUCCESS)
            vmh_tag_note_pause(tag, vmh_now_ns() - t0);
    } else {
        /* Running first, then unfrozen: a set the heap creates meanwhile sees either. */
        vmh_tag_transition(tag, VMH_TAG_PAUSING, VMH_TAG_RUNNING);
        vmh_heap_tag_freeze(tag, false);
    }
    return to_status(rc, driver_rc);
}

static vmm_status resume_one(unsigned tag, unsigned flags, CUresult *driver_rc)
{
    if (!vmh_tag_transition(tag, VMH_TAG_PAUSED, VMH_TAG_RESUMING))
        return VMM_ERR_NOT_PAUSED;
    uint64_t t0 = vmh_now_ns();
    CUresult rc = resume_records(tag, flags & VMM_RESUME_KEEP_BACKUP);
    if (rc == CUDA_SUCCESS) {
        vmh_tag_transition(tag, VMH_TAG_RESUMING, VMH_TAG_RUNNING);
        vmh_heap_tag_freeze(tag, false);
        vmh_tag_note_resume(tag, vmh_now_ns() - t0);
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
    vmh_lock(&pause_lock, VMH_RANK_PAUSE);
    /* The host's memory is read here, once a call: pressure gives back free kept pinned
     * buffers now, and the budget for new pinning holds for the call (staging.h). */
    vmh_staging_budget_begin();
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
    vmh_unlock(&pause_lock);
    return st;
}

vmm_status vmh_pause_tags(const char *tag, unsigned flags, CUresult *driver_rc)
{
    const unsigned kinds = VMM_PAUSE_PAGEABLE | VMM_PAUSE_DISK;
    if ((flags & ~(VMM_PAUSE_BACKUP | kinds)) || ((flags & kinds) && !(flags & VMM_PAUSE_BACKUP)) ||
        (flags & kinds) == kinds)
        return VMM_ERR_INVALID;
    return for_tags(tag, flags, pause_one, VMM_ERR_PAUSED, driver_rc);
}

vmm_status vmh_resume_tags(const char *tag, unsigned flags, CUresult *driver_rc)
{
    if (flags & ~VMM_RESUME_KEEP_BACKUP)
        return VMM_ERR_INVALID;
    return for_tags(tag, flags, resume_one, VMM_ERR_NOT_PAUSED, driver_rc);
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
    vmh_staging_reset();
}
#endif
