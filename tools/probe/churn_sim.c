/* churn_sim: the churn of tools/bench/bench.cu (workloads b, c, d) run through the library's
 * heap on the simulated driver, once per packing threshold, to see what each threshold costs in
 * driver calls and in memory (issue 14: "large requests without driver calls in steady state
 * ... without giving up the memory ratio"). CPU only: it measures counts and bytes, never the
 * GPU's speed.
 *
 * The workload is bench.cu's, step for step: 1000 live blocks; sizes from splitmix64 with the
 * bench's seed, 70% in [1 B, 64 KiB), 25% in [64 KiB, 8 MiB), 5% in [8 MiB, 256 MiB); one step
 * frees a random live block and allocates a new size into its slot. With T threads, thread t
 * keeps 1000/T blocks (the first 1000 % T one more) with seed + 1 + t, as bench (c) does. The
 * calls are those cudaMalloc / cudaFree reach under the hook: vmh_heap_alloc on the thread's
 * current context and vmh_heap_free(p, NULL, async false) (interpose_mem.c).
 *
 * Per threshold and thread count, from a fresh heap (tests/unit/testutil.h's tu_reset, then the
 * product's options from the environment, VMMHOOK_* as the library reads them, and the
 * product's background reclaim thread unless --no-reclaim-thread): fill, `--warmup` steps, then
 * `--steps` measured steps (split over the threads). Printed:
 *   - per 1000 measured steps: the library's VMH_STAT_driver_calls, its cache hits, blocking
 *     synchronizations and waits at VMMHOOK_PARK_LIMIT, and the simulated driver's own count
 *     of each entry point called (sim_calls), so that a driver call is attributed to
 *     cuMemCreate, cuMemMap, ...;
 *   - the library's gauges: peak bytes mapped / peak bytes requested, at the end of bench (d)'s
 *     window (fill + 4000 steps, one thread only: the GPU figure it compares with) and over the
 *     whole run; peak bytes reserved;
 *   - (one thread) what the mapped bytes were made of when they last peaked in bench (d)'s
 *     window (issue 27's slack: rounding, free space beside live blocks, whole idle extents,
 *     parked, outside extents), and with --holes C,... a model of holes inside extents per
 *     chunk size C (see "a model of holes" below; --chunk-div D: chunks of max(C, extent / D),
 *     0: of C; --hole-budget P: mapped free bytes kept, in % of live bytes, default 2).
 *
 * Timing is not the GPU's. The simulated driver's synchronizations return at once, and a step
 * here costs well under a microsecond of CPU (6.6-13.9 us on the H200, BENCHMARKS.md), so the
 * product's reclaim thread, which releases parked frees in the background, gets ahead of the
 * allocating thread at another rate than on a GPU: the blocking synchronizations and waits at
 * VMMHOOK_PARK_LIMIT counted here (and the parked bytes inside the peaks) are this machine's
 * scheduling, not a GPU's. With --no-reclaim-thread parked frees are released only when an
 * allocation finds more than VMMHOOK_PARK_LIMIT parked: deterministic on one thread, and the
 * most that parking can hold. The "sim us/step" column is CPU time on the simulated driver
 * (one global mutex), not a speed.
 *
 * Build: meson setup build -Dunit_tests=enabled (it links the simulated driver and the unit
 * suites' set-up, hence cmocka); run:
 *   build/tools/probe/churn_sim [--pack 8M,16M,...] [--threads 1,16] [--steps N] [--warmup N]
 *                               [--repeat N] [--no-reclaim-thread] [--quiet]
 *                               [--holes 8M,32M] [--chunk-div 4] [--hole-budget 2]
 * With --repeat N every setting runs N times (a fresh heap each) and a figure that differs is
 * printed as its min-max.
 * Exit 0, or 1 when an allocation failed or the driver's ledger was not empty at the end.
 */
#include "simprobe.h"

#include "heap_internal.h" /* the devices' carved shards, for the slack's breakdown */
#include "optparse.h"

#include <pthread.h>

#define KiB ((size_t)1 << 10)
#define LIVE_BLOCKS 1000
#define BENCH_SEED 0x5eed20261202ull /* tools/bench/bench.cu's kSeed */
#define MEM_WINDOW_STEPS 4000        /* bench (d): fill + 4000 steps */
#define MAX_THREADS 64
#define MAX_SETTINGS 16

/* ---- bench.cu's random sizes (keep in step with its Rng) ---------------------------------- */

typedef struct rng {
    uint64_t s;
} rng_t;

static uint64_t rng_next(rng_t *r) /* splitmix64 */
{
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static size_t rng_range(rng_t *r, size_t lo, size_t hi) /* [lo, hi) */
{
    return lo + (size_t)(rng_next(r) % (hi - lo));
}

static size_t churn_size(rng_t *r)
{
    uint64_t c = rng_next(r) % 100;
    if (c < 70)
        return rng_range(r, 1, 64 * KiB);
    if (c < 95)
        return rng_range(r, 64 * KiB, 8 * MiB);
    return rng_range(r, 8 * MiB, 256 * MiB);
}

/* ---- what the mapped bytes are made of -------------------------------------------------- */

/* At one time: bytes mapped (the gauge) split into what the program asked for and the slack
 * (issue 27): rounding (block usable sizes over requests), free space beside live blocks inside
 * extents, whole extents holding no live block (free or parked, what a trim gives back), parked
 * blocks in extents that hold live ones, and what is mapped outside the shared extents (big
 * buffers, idle ranges of the cache). */
typedef struct slack {
    int64_t mapped, requested;
    size_t live, rounding, free_inside, idle_extents, parked_inside, outside, extents;
    size_t own_parked, cached; /* of outside: parked own-chunk buffers, the cache's idle ranges */
    long at; /* operations of the window before it (fill allocations, then steps) */
} slack_t;

static void slack_read(slack_t *sl)
{
    *sl = (slack_t){.mapped = vmh_gauge_get(VMH_STAT_bytes_mapped),
                    .requested = vmh_gauge_get(VMH_STAT_bytes_requested)};
    size_t ext_bytes = 0, parked = 0, free_bytes = 0;
    for (int i = 0; i < VMH_MAX_DEVICES; i++) {
        hdev_t *h = hdev_at(i);
        if (!h)
            continue;
        sl->cached += vmh_cache_bytes(&h->cache);
        FOR_EACH_PART(h, part)
        sl->own_parked += vmh_ownchunk_parked_bytes(&part->own);
        FOR_EACH_PART(h, part)
        for (int k = 0; k < VMH_SHARDS; k++) {
            vmh_shard_t *s = &part->carved.shards[k];
            vmh_arena_stats_t st;
            pthread_mutex_lock(&s->lock);
            vmh_arena_stats(s->arena, &st);
            sl->idle_extents += vmh_arena_unused_extent_bytes(s->arena, NULL);
            pthread_mutex_unlock(&s->lock);
            sl->live += st.live;
            parked += st.parked;
            free_bytes += st.free + st.retired;
            ext_bytes += st.extents_bytes;
            sl->extents += st.extents;
        }
    }
    /* Whole idle extents hold free and parked bytes; the rest of each is inside used extents.
     * Parked bytes in idle extents are counted as idle extents. */
    sl->rounding = sl->live > (size_t)sl->requested ? sl->live - (size_t)sl->requested : 0;
    size_t busy_nonlive = ext_bytes - sl->live - sl->idle_extents;
    sl->parked_inside = parked < busy_nonlive ? parked : busy_nonlive;
    sl->free_inside = busy_nonlive - sl->parked_inside;
    (void)free_bytes;
    sl->outside = (size_t)sl->mapped > ext_bytes ? (size_t)sl->mapped - ext_bytes : 0;
}

static void slack_print(const char *when, const slack_t *sl, int64_t peak_requested)
{
    double r = (double)peak_requested;
    printf("slack at %s: mapped %.0f MiB = %.3f x peak requested %.0f MiB; requested now %.0f "
           "MiB (%.3f); rounding %.0f MiB (%.3f); free beside live blocks %.0f MiB (%.3f); whole "
           "idle extents %.0f MiB (%.3f); parked beside live blocks %.0f MiB (%.3f); outside "
           "extents %.0f MiB (%.3f), of it parked own-chunk buffers %.0f MiB (%.3f) and cached "
           "idle ranges %.0f MiB (%.3f); %zu extents; after %ld of the window's %d allocations "
           "and steps\n",
           when, (double)sl->mapped / MiB, (double)sl->mapped / r, r / MiB,
           (double)sl->requested / MiB, (double)sl->requested / r, (double)sl->rounding / MiB,
           (double)sl->rounding / r, (double)sl->free_inside / MiB, (double)sl->free_inside / r,
           (double)sl->idle_extents / MiB, (double)sl->idle_extents / r,
           (double)sl->parked_inside / MiB, (double)sl->parked_inside / r,
           (double)sl->outside / MiB, (double)sl->outside / r, (double)sl->own_parked / MiB,
           (double)sl->own_parked / r, (double)sl->cached / MiB, (double)sl->cached / r,
           sl->extents, sl->at, LIVE_BLOCKS + MEM_WINDOW_STEPS);
}

/* The slack when the mapped bytes last reached a new peak (bench (d)'s window, one thread). */
static slack_t slack_at_peak;
static long slack_ops; /* operations of the window so far */

static void slack_track(void)
{
    int64_t mapped = vmh_gauge_get(VMH_STAT_bytes_mapped);
    slack_ops++;
    if (mapped > slack_at_peak.mapped) {
        slack_read(&slack_at_peak);
        slack_at_peak.at = slack_ops;
    }
}

static double per_k(uint64_t n, long steps)
{
    return 1000.0 * (double)n / (double)steps;
}

/* ---- a model of holes inside extents (issue 27) ------------------------------------------ */

/* What design (a) of issue 27 would give on this workload, modelled beside the product without
 * changing it: every extent backed by chunks of max(C, extent / --chunk-div) bytes (a chunk maps
 * only whole, so a hole is whole chunks); after each step, chunks that a block now uses again
 * are mapped back (on the allocating thread: cuMemCreate and cuMemMap per chunk, one
 * cuMemSetAccess per run of them), and while the mapped bytes beside live blocks pass a budget
 * (a fraction of the live bytes) fully free chunks are released (in the background: cuMemUnmap
 * and cuMemRelease per chunk), first found first. Free means free in the arena: parked blocks
 * are never released (vmh_arena_free_runs). Placement is the product's (the arena does not
 * know which free space is mapped), so the figures are what the policy alone would change. */
#define MODEL_EXTENTS 4096
#define MAX_MODELS 8
#define SIM_GRAN (2 * MiB)

typedef struct model_ext {
    uintptr_t base;
    size_t size, chunk, nchunks;
    bool *released, *free_now;
    bool seen;
} model_ext_t;

typedef struct hole_model {
    size_t chunk_min;
    double budget; /* mapped bytes beside live blocks allowed, over live bytes */
    model_ext_t ext[MODEL_EXTENTS];
    size_t next;
    int64_t peak_mapped;
    uint64_t remapped, released, map_calls, release_calls, steps;
    size_t chunks_at_peak;
} hole_model_t;

static hole_model_t models[MAX_MODELS];
static int nmodels;
static double hole_budget = 0.02;
static size_t chunk_div = 4; /* 0: chunks of the size given, whatever the extent */

static model_ext_t *model_ext(hole_model_t *m, uintptr_t base, size_t size)
{
    for (size_t i = 0; i < m->next; i++)
        if (m->ext[i].base == base && m->ext[i].size == size)
            return &m->ext[i];
    assert(m->next < MODEL_EXTENTS);
    model_ext_t *x = &m->ext[m->next++];
    size_t chunk = chunk_div ? size / chunk_div : 0;
    chunk = chunk < m->chunk_min ? m->chunk_min : chunk;
    chunk = (chunk + SIM_GRAN - 1) / SIM_GRAN * SIM_GRAN;
    *x = (model_ext_t){
        .base = base, .size = size, .chunk = chunk, .nchunks = (size + chunk - 1) / chunk};
    x->released = calloc(x->nchunks, sizeof(bool));
    x->free_now = calloc(x->nchunks, sizeof(bool));
    assert(x->released && x->free_now);
    return x;
}

static void on_free_run(uintptr_t base, size_t size, void *arg)
{
    model_ext_t *x = arg;
    for (size_t off = base - x->base; off < base - x->base + size; off += x->chunk)
        x->free_now[off / x->chunk] = true; /* runs are chunk-aligned: whole chunks */
}

/* One step of the model after a step of the workload (one thread: nothing changes meanwhile). */
static void model_step(hole_model_t *m)
{
    for (size_t i = 0; i < m->next; i++)
        m->ext[i].seen = false;
    size_t live = 0;
    for (int d = 0; d < VMH_MAX_DEVICES; d++) {
        hdev_t *h = hdev_at(d);
        if (!h)
            continue;
        FOR_EACH_PART(h, part)
        for (int k = 0; k < VMH_SHARDS; k++) {
            vmh_shard_t *s = &part->carved.shards[k];
            pthread_mutex_lock(&s->lock);
            vmh_arena_stats_t st;
            vmh_arena_stats(s->arena, &st);
            live += st.live;
            for (vmh_ext_t *e = s->exts; e; e = e->next) {
                if (!e->extent || !e->npieces || vmh_carved_paused_locked(e))
                    continue;
                model_ext_t *x =
                    model_ext(m, vmh_extent_base(e->extent), vmh_extent_size(e->extent));
                x->seen = true;
                memset(x->free_now, 0, x->nchunks);
                vmh_arena_free_runs(e->extent, x->chunk, false, on_free_run, x);
                /* Released chunks a block uses again are mapped back. */
                for (size_t c = 0; c < x->nchunks; c++)
                    if (x->released[c] && !x->free_now[c]) {
                        x->released[c] = false;
                        m->remapped++;
                        m->map_calls += 2 + (c == 0 || !x->released[c - 1] ? 1 : 0);
                    }
            }
            pthread_mutex_unlock(&s->lock);
        }
    }
    size_t released_bytes = 0, chunks = 0;
    for (size_t i = 0; i < m->next;) {
        model_ext_t *x = &m->ext[i];
        if (!x->seen) { /* given back whole by the product */
            free(x->released);
            free(x->free_now);
            *x = m->ext[--m->next];
            continue;
        }
        chunks += x->nchunks;
        for (size_t c = 0; c < x->nchunks; c++)
            if (x->released[c])
                released_bytes += c + 1 == x->nchunks ? x->size - c * x->chunk : x->chunk;
        i++;
    }
    int64_t mapped = vmh_gauge_get(VMH_STAT_bytes_mapped) - (int64_t)released_bytes;
    const int64_t allowed = (int64_t)(m->budget * (double)live);
    for (size_t i = 0; i < m->next && mapped - (int64_t)live > allowed; i++) {
        model_ext_t *x = &m->ext[i];
        for (size_t c = 0; c < x->nchunks && mapped - (int64_t)live > allowed; c++)
            if (x->free_now[c] && !x->released[c]) {
                x->released[c] = true;
                m->released++;
                m->release_calls += 2;
                mapped -= (int64_t)(c + 1 == x->nchunks ? x->size - c * x->chunk : x->chunk);
            }
    }
    m->steps++;
    if (mapped > m->peak_mapped) {
        m->peak_mapped = mapped;
        m->chunks_at_peak = chunks;
    }
}

static void models_step(void)
{
    for (int i = 0; i < nmodels; i++)
        model_step(&models[i]);
}

static void models_reset(void)
{
    for (int i = 0; i < nmodels; i++) {
        hole_model_t *m = &models[i];
        for (size_t k = 0; k < m->next; k++) {
            free(m->ext[k].released);
            free(m->ext[k].free_now);
        }
        *m = (hole_model_t){.chunk_min = m->chunk_min, .budget = hole_budget};
    }
}

static void models_print(int64_t peak_requested, long window_steps)
{
    for (int i = 0; i < nmodels; i++) {
        const hole_model_t *m = &models[i];
        printf("holes model, chunks of max(%zu MiB, extent/%zu), budget %.0f%% of live: peak "
               "mapped %.0f MiB = %.3f x peak requested; per 1000 window steps (fill "
               "included): %.1f chunks mapped back (%.1f calls, allocating thread), %.1f "
               "released (%.1f calls, background); %zu chunks at the peak\n",
               m->chunk_min / MiB, chunk_div, 100 * m->budget, (double)m->peak_mapped / MiB,
               (double)m->peak_mapped / (double)peak_requested, per_k(m->remapped, window_steps),
               per_k(m->map_calls, window_steps), per_k(m->released, window_steps),
               per_k(m->release_calls, window_steps), m->chunks_at_peak);
    }
}

/* ---- one thread's live set ---------------------------------------------------------------- */

typedef struct churner {
    int nlive;
    rng_t rng;
    CUdeviceptr p[LIVE_BLOCKS];
    CUresult err; /* the first failure, CUDA_SUCCESS while none */
} churner_t;

static void fill_one(churner_t *c, int i)
{
    CUresult r = vmh_heap_alloc(churn_size(&c->rng), &c->p[i]);
    if (r != CUDA_SUCCESS && c->err == CUDA_SUCCESS)
        c->err = r;
    if (r != CUDA_SUCCESS)
        c->p[i] = 0;
}

static void step(churner_t *c)
{
    int i = (int)(rng_next(&c->rng) % (uint64_t)c->nlive);
    if (c->p[i]) {
        CUresult r = vmh_heap_free(c->p[i], NULL, false);
        if (r != CUDA_SUCCESS && c->err == CUDA_SUCCESS)
            c->err = r;
    }
    fill_one(c, i);
}

static void free_all(churner_t *c)
{
    for (int i = 0; i < c->nlive; i++)
        if (c->p[i]) {
            CUresult r = vmh_heap_free(c->p[i], NULL, false);
            if (r != CUDA_SUCCESS && c->err == CUDA_SUCCESS)
                c->err = r;
            c->p[i] = 0;
        }
}

/* ---- a run: one threshold, one thread count ----------------------------------------------- */

typedef struct run {
    int threads;
    long warmup, steps; /* in all, split over the threads */
    pthread_barrier_t phase;
    churner_t *ch;
    /* Filled by the main thread between the phases. */
    int64_t window_mapped, window_requested; /* peaks at the end of bench (d)'s window */
} run_t;

typedef struct worker {
    run_t *run;
    int t;
} worker_t;

static long share(long total, int threads, int t)
{
    return total / threads + (t < total % threads ? 1 : 0);
}

/* Between two phases every worker stops until the main thread has read the counters and
 * gauges: one barrier says that all have arrived, a second that the reading is done (with one,
 * the workers would run on while the main thread reads). */
static void worker_pause(run_t *run)
{
    pthread_barrier_wait(&run->phase);
    pthread_barrier_wait(&run->phase);
}

/* Each worker: fill; [pause] bench (d)'s window (thread 0 of a 1-thread run only) [pause]
 * warm-up [pause] measured steps [pause] free all. The main thread reads the counters in the
 * pauses. */
static void *worker_main(void *arg)
{
    worker_t *w = arg;
    run_t *run = w->run;
    churner_t *c = &run->ch[w->t];
    sim_set_current_device(0); /* as cudart makes the primary context current on each thread */
    bool track = run->threads == 1;
    for (int i = 0; i < c->nlive; i++) {
        fill_one(c, i);
        if (track) {
            slack_track();
            models_step();
        }
    }
    worker_pause(run);
    long window = track ? MEM_WINDOW_STEPS : 0;
    for (long k = 0; k < window; k++) {
        step(c);
        slack_track();
        models_step();
    }
    worker_pause(run);
    for (long k = share(run->warmup, run->threads, w->t) - window; k > 0; k--)
        step(c);
    worker_pause(run);
    for (long k = share(run->steps, run->threads, w->t); k > 0; k--)
        step(c);
    worker_pause(run);
    free_all(c);
    return NULL;
}

typedef struct result {
    size_t pack_below;
    int threads;
    double driver_calls, cache_hits, vmm_calls, syncs, syncs_blocking, park_waits; /* per 1000 */
    double window_ratio, run_ratio;
    int64_t peak_mapped, peak_requested, peak_reserved;
    double sim_us_per_step;
    bool failed;
} result_t;

static bool quiet;
static bool reclaim_thread = true;

static result_t run_one(size_t pack_below, int threads, long warmup, long steps)
{
    result_t res = {.pack_below = pack_below, .threads = threads};
    probe_heap_reset("churn_sim", reclaim_thread);
    slack_at_peak = (slack_t){0};
    slack_ops = 0;
    models_reset();
    tu_opt.pack_below = pack_below; /* the threshold tried */
    tu_configure();

    run_t run = {.threads = threads, .warmup = warmup, .steps = steps};
    run.ch = calloc((size_t)threads, sizeof *run.ch);
    assert(run.ch);
    for (int t = 0; t < threads; t++) {
        run.ch[t].nlive = (int)share(LIVE_BLOCKS, threads, t);
        run.ch[t].rng.s = threads == 1 ? BENCH_SEED : BENCH_SEED + 1 + (uint64_t)t;
    }
    pthread_barrier_init(&run.phase, NULL, (unsigned)threads + 1);
    pthread_t tid[MAX_THREADS];
    worker_t w[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        w[t] = (worker_t){&run, t};
        if (pthread_create(&tid[t], NULL, worker_main, &w[t]) != 0) {
            fprintf(stderr, "churn_sim: pthread_create failed\n");
            exit(1);
        }
    }
    size_t nentries = sim_entry_count();
    probe_snapshot_t before, after;
    probe_snapshot_init(&before);
    probe_snapshot_init(&after);

    /* Each phase: wait until every worker has arrived, read, let them go on. */
    pthread_barrier_wait(&run.phase); /* filled */
    pthread_barrier_wait(&run.phase);
    pthread_barrier_wait(&run.phase); /* bench (d)'s window done (1 thread) */
    run.window_mapped = vmh_gauge_peak(VMH_STAT_bytes_mapped);
    run.window_requested = vmh_gauge_peak(VMH_STAT_bytes_requested);
    if (threads == 1) {
        slack_print("the window's peak mapped", &slack_at_peak, run.window_requested);
        models_print(run.window_requested, LIVE_BLOCKS + MEM_WINDOW_STEPS);
    }
    pthread_barrier_wait(&run.phase);
    pthread_barrier_wait(&run.phase); /* warmed up */
    probe_snap(&before);
    pthread_barrier_wait(&run.phase);
    pthread_barrier_wait(&run.phase); /* measured steps done */
    probe_snap(&after);
    res.peak_mapped = vmh_gauge_peak(VMH_STAT_bytes_mapped);
    res.peak_requested = vmh_gauge_peak(VMH_STAT_bytes_requested);
    res.peak_reserved = vmh_gauge_peak(VMH_STAT_bytes_reserved);
    pthread_barrier_wait(&run.phase);
    for (int t = 0; t < threads; t++)
        pthread_join(tid[t], NULL);
    pthread_barrier_destroy(&run.phase);

#define DELTA(c) (after.counters[VMH_STAT_##c] - before.counters[VMH_STAT_##c])
    res.driver_calls = per_k(DELTA(driver_calls), steps);
    res.cache_hits = per_k(DELTA(cache_hits), steps);
    res.syncs_blocking = per_k(DELTA(syncs_blocking), steps);
    res.park_waits = per_k(DELTA(park_waits), steps);
#undef DELTA
    uint64_t vmm = 0, syncs = 0;
    for (size_t i = 0; i < nentries; i++) {
        uint64_t n = after.sim[i] - before.sim[i];
        if (probe_is_vmm_call(sim_entry_name(i)))
            vmm += n;
        if (probe_is_sync_call(sim_entry_name(i)))
            syncs += n;
    }
    res.vmm_calls = per_k(vmm, steps);
    res.syncs = per_k(syncs, steps);
    /* bench (d)'s window is run on one thread only */
    res.window_ratio =
        threads == 1 ? (double)run.window_mapped / (double)run.window_requested : (double)NAN;
    res.run_ratio = (double)res.peak_mapped / (double)res.peak_requested;
    res.sim_us_per_step = ((double)(after.at.tv_sec - before.at.tv_sec) * 1e6 +
                           (double)(after.at.tv_nsec - before.at.tv_nsec) / 1e3) /
                          (double)steps;

    for (int t = 0; t < threads; t++)
        if (run.ch[t].err != CUDA_SUCCESS) {
            fprintf(stderr, "churn_sim: pack %zu MiB, %d threads: thread %d: error %d\n",
                    pack_below / MiB, threads, t, (int)run.ch[t].err);
            res.failed = true;
        }
    if (!quiet) {
        printf("## pack below %zu MiB, %d thread(s): simulated driver calls per 1000 measured "
               "steps\n",
               pack_below / MiB, threads);
        for (size_t i = 0; i < nentries; i++) {
            uint64_t n = after.sim[i] - before.sim[i];
            if (n)
                printf("   %-28s %9.2f\n", sim_entry_name(i), per_k(n, steps));
        }
    }
    probe_snapshot_free(&before);
    probe_snapshot_free(&after);
    free(run.ch);

    if (!probe_heap_finish("churn_sim"))
        res.failed = true;
    return res;
}

/* ---- the table ---------------------------------------------------------------------------- */

/* The figures of the table, in its column order. */
#define COLUMNS(X)                                                                                 \
    X("driver calls / 1000 steps", "%.1f", r->driver_calls)                                        \
    X("of them VMM", "%.1f", r->vmm_calls)                                                         \
    X("syncs", "%.1f", r->syncs)                                                                   \
    X("blocking syncs", "%.1f", r->syncs_blocking)                                                 \
    X("park waits", "%.1f", r->park_waits)                                                         \
    X("cache hits / 1000", "%.1f", r->cache_hits)                                                  \
    X("mapped / requested, bench (d) window", "%.3f", r->window_ratio)                             \
    X("mapped / requested, whole run", "%.3f", r->run_ratio)                                       \
    X("peak mapped MiB", "%.0f", (double)r->peak_mapped / MiB)                                     \
    X("peak requested MiB", "%.0f", (double)r->peak_requested / MiB)                               \
    X("peak reserved MiB", "%.0f", (double)r->peak_reserved / MiB)                                 \
    X("sim us/step", "%.2f", r->sim_us_per_step)

/* A markdown row for one setting over its nrep results. */
static void print_row(const result_t *res, int nrep)
{
    printf("| %zuM | %d |", res[0].pack_below / MiB, res[0].threads);
#define PRINT_COLUMN(title, fmt, expr)                                                             \
    {                                                                                              \
        const result_t *r;                                                                         \
        PROBE_PRINT_RANGE(fmt, nrep, (r = &res[k], (expr)));                                       \
    }
    COLUMNS(PRINT_COLUMN)
#undef PRINT_COLUMN
    printf("\n");
}

static void print_table(const result_t *res, int nsettings, int nrep)
{
#define PRINT_TITLE(title, fmt, expr) printf(" %s |", title);
#define PRINT_RULE(title, fmt, expr) printf(" --- |");
    printf("\n| pack below | threads |");
    COLUMNS(PRINT_TITLE)
    printf("\n| --- | --- |");
    COLUMNS(PRINT_RULE)
    printf("\n");
#undef PRINT_TITLE
#undef PRINT_RULE
    result_t *one = calloc((size_t)nrep, sizeof *one);
    assert(one);
    for (int i = 0; i < nsettings; i++) {
        for (int k = 0; k < nrep; k++)
            one[k] = res[k * nsettings + i];
        print_row(one, nrep);
    }
    free(one);
}

/* ---- command line ------------------------------------------------------------------------- */

static int parse_sizes(const char *s, size_t *out, int max)
{
    int n = 0;
    while (*s) {
        size_t len = strcspn(s, ",");
        if (n == max || vmh_parse_size(s, len, &out[n]) != 0)
            return -1;
        n++;
        s += len + (s[len] == ',');
    }
    return n;
}

static void usage(void)
{
    fprintf(stderr, "usage: churn_sim [--pack 8M,16M,32M,64M,128M,512M] [--threads 1,16] "
                    "[--steps 200000] [--warmup 20000] [--repeat 1] [--no-reclaim-thread] "
                    "[--holes 32M,128M] [--chunk-div 4] [--hole-budget PERCENT] [--quiet]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    size_t packs[MAX_SETTINGS] = {8 * MiB, 16 * MiB, 32 * MiB, 64 * MiB, 128 * MiB, 512 * MiB};
    int npacks = 6;
    size_t threads[MAX_SETTINGS] = {1, 16};
    int nthreads = 2;
    long steps = 200000, warmup = 20000, repeat = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--pack") == 0 && v) {
            npacks = parse_sizes(v, packs, MAX_SETTINGS);
            i++;
        } else if (strcmp(a, "--threads") == 0 && v) {
            nthreads = parse_sizes(v, threads, MAX_SETTINGS);
            i++;
        } else if (strcmp(a, "--steps") == 0 && v) {
            steps = strtol(v, NULL, 10);
            i++;
        } else if (strcmp(a, "--warmup") == 0 && v) {
            warmup = strtol(v, NULL, 10);
            i++;
        } else if (strcmp(a, "--repeat") == 0 && v) {
            repeat = strtol(v, NULL, 10);
            i++;
        } else if (strcmp(a, "--no-reclaim-thread") == 0) {
            reclaim_thread = false;
        } else if (strcmp(a, "--holes") == 0 && v) {
            size_t chunks[MAX_MODELS];
            nmodels = parse_sizes(v, chunks, MAX_MODELS);
            if (nmodels < 0)
                usage();
            for (int k = 0; k < nmodels; k++)
                models[k].chunk_min = chunks[k];
            i++;
        } else if (strcmp(a, "--chunk-div") == 0 && v) {
            chunk_div = (size_t)strtoul(v, NULL, 10);
            i++;
        } else if (strcmp(a, "--hole-budget") == 0 && v) {
            hole_budget = strtod(v, NULL) / 100;
            i++;
        } else if (strcmp(a, "--quiet") == 0) {
            quiet = true;
        } else {
            usage();
        }
    }
    if (npacks <= 0 || nthreads <= 0 || steps <= 0 || warmup < MEM_WINDOW_STEPS || repeat < 1 ||
        repeat > 100)
        usage();
    for (int i = 0; i < nthreads; i++)
        if (threads[i] < 1 || threads[i] > MAX_THREADS || threads[i] > LIVE_BLOCKS)
            usage();

    vmh_options_t env;
    vmh_options_apply(&env, vmh_options_env_get, NULL);
    printf("churn_sim: bench.cu's churn on the simulated driver, %ld measured steps after %ld "
           "(fill + warm-up), %ld run(s) of each setting; VMMHOOK_CACHE_LIMIT %zu MiB, "
           "VMMHOOK_PARK_LIMIT %zu MiB; reclaim thread %s\n",
           steps, warmup, repeat, env.cache_limit / MiB, env.park_limit / MiB,
           reclaim_thread ? "on (syncs are instant here)" : "off");
    int nsettings = npacks * nthreads;
    result_t *res = calloc((size_t)(nsettings * repeat), sizeof *res);
    assert(res);
    bool failed = false;
    for (int k = 0; k < repeat; k++)
        for (int p = 0; p < npacks; p++)
            for (int t = 0; t < nthreads; t++) {
                result_t *r = &res[k * nsettings + p * nthreads + t];
                *r = run_one(packs[p], (int)threads[t], warmup, steps);
                failed |= r->failed;
            }
    print_table(res, nsettings, (int)repeat);
    free(res);
    return failed ? 1 : 0;
}
