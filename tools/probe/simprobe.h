/* What the probes on the simulated driver share (churn_sim.c, trace_sim.c): a fresh heap set up
 * as the product runs it, the counters read around a measured stretch, the simulated driver's
 * entry points sorted into VMM calls and synchronizations, a figure printed as its min-max
 * over runs, and the end of a run (nothing may be left in the driver).
 *
 * Header only (static inline), as tests/unit/testutil.h, which it includes: testutil.h defines
 * an external symbol of its own, so each probe is one translation unit. */
#ifndef VMH_SIMPROBE_H
#define VMH_SIMPROBE_H

#ifndef VMH_TESTING
#define VMH_TESTING 1
#endif
#include "testutil.h"

#include <assert.h>
#include <math.h>
#include <time.h>

/* A fresh simulated driver with the H200's memory (2 MiB granularity) and a fresh heap
 * (tu_reset), then the product's options from the environment (VMMHOOK_* as the library reads
 * them; tu_reset sets the unit suites' own) and the product's background reclaim thread unless
 * reclaim_thread is false. The caller may change tu_opt's fields after this, then calls
 * tu_configure(). */
static inline void probe_heap_reset(const char *tool, bool reclaim_thread)
{
    sim_config_t cfg = {.memory = 141 * GiB};
    tu_reset(&cfg);
    if (vmh_options_apply(&tu_opt, vmh_options_env_get, NULL) != 0)
        fprintf(stderr, "%s: a VMMHOOK_* value was refused (see above)\n", tool);
    tu_configure();
    vmh_reclaim_background(reclaim_thread);
}

/* As the unit suites end: the reclaim thread stopped, the cache given back, and nothing may be
 * left in the driver. Returns false, having said so, when something is. */
static inline bool probe_heap_finish(const char *tool)
{
    vmh_reclaim_stop();
    vmh_reclaim_background(false);
    vmh_heap_trim();
    if (!sim_ledger_empty()) {
        sim_ledger_dump();
        fprintf(stderr, "%s: the driver's ledger is not empty after the run\n", tool);
        return false;
    }
    return true;
}

/* The library's counters and the simulated driver's count of each entry point at one time. */
typedef struct probe_snapshot {
    uint64_t counters[VMH_COUNTER_COUNT];
    unsigned long *sim; /* per simulated entry point, sim_entry_count() of them */
    struct timespec at;
} probe_snapshot_t;

static inline void probe_snapshot_init(probe_snapshot_t *s)
{
    *s = (probe_snapshot_t){.sim = calloc(sim_entry_count(), sizeof(unsigned long))};
    assert(s->sim);
}

static inline void probe_snapshot_free(probe_snapshot_t *s)
{
    free(s->sim);
    s->sim = NULL;
}

static inline void probe_snap(probe_snapshot_t *s)
{
    for (unsigned i = 0; i < VMH_COUNTER_COUNT; i++)
        s->counters[i] = vmh_counter_get((vmh_counter_t)i);
    for (size_t i = 0; i < sim_entry_count(); i++)
        s->sim[i] = sim_calls(sim_entry_name(i));
    clock_gettime(CLOCK_MONOTONIC, &s->at);
}

/* The VMM entry points a large request's own chunk needs, made or given back. */
static inline bool probe_is_vmm_call(const char *name)
{
    static const char *const vmm[] = {"cuMemCreate",     "cuMemRelease",   "cuMemMap",
                                      "cuMemUnmap",      "cuMemSetAccess", "cuMemAddressReserve",
                                      "cuMemAddressFree"};
    for (size_t i = 0; i < sizeof vmm / sizeof vmm[0]; i++)
        if (strcmp(name, vmm[i]) == 0)
            return true;
    return false;
}

static inline bool probe_is_sync_call(const char *name)
{
    return strncmp(name, "cuCtxSynchronize", 16) == 0 || strcmp(name, "cuStreamSynchronize") == 0;
}

/* One table cell: the figure, or "min-max" over the repetitions when they differ as printed;
 * "-" for a figure not measured (NAN). */
static inline void probe_cell(char *buf, size_t len, const char *fmt, double lo, double hi)
{
    if (isnan(lo)) {
        snprintf(buf, len, "-");
        return;
    }
    char a[32], b[32];
    snprintf(a, sizeof a, fmt, lo);
    snprintf(b, sizeof b, fmt, hi);
    if (strcmp(a, b) == 0)
        snprintf(buf, len, "%s", a);
    else
        snprintf(buf, len, "%s-%s", a, b);
}

/* Prints " <cell> |" for the figure `expr` over the repetitions k = 0 .. n-1 (expr may use k):
 * one value, or "min-max" when they differ as printed (probe_cell). */
#define PROBE_PRINT_RANGE(fmt, n, expr)                                                            \
    do {                                                                                           \
        double lo_ = 0, hi_ = 0;                                                                   \
        for (int k = 0; k < (n); k++) {                                                            \
            double v_ = (expr);                                                                    \
            lo_ = k == 0 || v_ < lo_ ? v_ : lo_;                                                   \
            hi_ = k == 0 || v_ > hi_ ? v_ : hi_;                                                   \
        }                                                                                          \
        char cell_[64];                                                                            \
        probe_cell(cell_, sizeof cell_, fmt, lo_, hi_);                                            \
        printf(" %s |", cell_);                                                                    \
    } while (0)

#endif
