/* Driver calls per phase of a tag's life on the simulated driver (issue 27's `bars`): N buffers
 * of one size allocated in one tag with the product's options (everything packed), the tag
 * paused and resumed, the buffers freed and the idle memory trimmed; the simulated driver's
 * count of each entry point read around each phase. Shared by the unit suite that asserts the
 * bounds (test_bulk.c) and the probe that prints them (tools/probe/bars_sim.c).
 *
 * Header only (static inline), as testutil.h, which it needs included first. */
#ifndef VMH_PHASE_CALLS_H
#define VMH_PHASE_CALLS_H

#include "pause.h"
#include "tags.h"
#include "vmmhook.h"

#define PC_TAG "bars"

typedef enum pc_phase { PC_ALLOC, PC_PAUSE, PC_RESUME, PC_FREE, PC_TRIM, PC_PHASES } pc_phase_t;

static const char *const pc_phase_names[PC_PHASES] = {"allocate", "pause", "resume", "free",
                                                      "trim"};

/* The entry points counted apart; PC_ALL is every entry point (sim_call_count). */
static const char *const pc_call_names[] = {"cuMemCreate",     "cuMemRelease",
                                            "cuMemMap",        "cuMemUnmap",
                                            "cuMemSetAccess",  "cuMemAddressReserve",
                                            "cuMemAddressFree"};
#define PC_NAMED (sizeof pc_call_names / sizeof pc_call_names[0])
#define PC_ALL PC_NAMED

typedef struct pc_counts {
    unsigned long calls[PC_PHASES][PC_NAMED + 1]; /* [phase][named call, or PC_ALL] */
} pc_counts_t;

static inline void pc_note(pc_counts_t *c, pc_phase_t ph)
{
    for (size_t k = 0; k < PC_NAMED; k++)
        c->calls[ph][k] = sim_calls(pc_call_names[k]);
    c->calls[ph][PC_ALL] = sim_call_count();
    sim_reset_counters();
}

static inline unsigned long pc_get(const pc_counts_t *c, pc_phase_t ph, const char *name)
{
    for (size_t k = 0; k < PC_NAMED; k++)
        if (strcmp(pc_call_names[k], name) == 0)
            return c->calls[ph][k];
    return c->calls[ph][PC_ALL];
}

/* A fresh simulated driver with the H200's memory and 2 MiB granularity, and a fresh heap with
 * the product's default options (tu_reset's are the suites': packing only below 1 MiB), no
 * reclaim thread (it would synchronize behind the counts). */
static inline void pc_heap_reset(void)
{
    sim_config_t cfg = {.memory = 141 * GiB};
    tu_reset(&cfg);
    vmh_options_defaults(&tu_opt);
    tu_configure();
    vmh_pause_configure(tu_opt.pin_limit);
    vmh_tags_reset();
    vmh_pause_reset();
}

/* One life of n buffers of size bytes in tag PC_TAG; pause_flags for vmm_pause (0 or
 * VMM_PAUSE_BACKUP). Returns false (having said why) when a step failed. The driver's ledger is
 * left to the caller (the heap still holds what trim does not give back). */
static inline bool pc_measure(size_t n, size_t size, unsigned pause_flags, pc_counts_t *out)
{
    memset(out, 0, sizeof *out);
    pc_heap_reset();
    CUdeviceptr *bufs = calloc(n, sizeof *bufs);
    if (!bufs)
        return false;
    bool ok = true;
    sim_reset_counters();
    if (vmm_tag_push(PC_TAG) != VMM_OK)
        ok = false;
    for (size_t i = 0; i < n && ok; i++)
        ok = vmh_heap_alloc(size, &bufs[i]) == CUDA_SUCCESS;
    vmm_tag_pop();
    pc_note(out, PC_ALLOC);
    vmm_status st = ok ? vmm_pause(PC_TAG, pause_flags) : VMM_OK;
    pc_note(out, PC_PAUSE);
    if (st == VMM_OK && ok)
        st = vmm_resume(PC_TAG);
    pc_note(out, PC_RESUME);
    for (size_t i = 0; i < n; i++)
        if (bufs[i] && vmh_heap_free(bufs[i], NULL, false) != CUDA_SUCCESS)
            ok = false;
    pc_note(out, PC_FREE);
    vmm_trim();
    pc_note(out, PC_TRIM);
    free(bufs);
    if (!ok || st != VMM_OK)
        fprintf(stderr, "pc_measure(%zu x %zu): %s failed (status %d)\n", n, size,
                !ok ? "an allocation or free" : "pause or resume", (int)st);
    return ok && st == VMM_OK;
}

#endif
