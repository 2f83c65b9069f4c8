/* simdrv: what every entry point does before its own work (SIM_ENTER, simint.h): the schedule
 * perturbed (SIM_PERTURB), the call counted and traced, an injected fault fired (sim_fail_call
 * and its kin), and a forked child's refusal; the control API of counts, faults and traces; the
 * fork handlers. */
#include "simint.h"

#define MAX_FAULTS (sizeof S.faults / sizeof S.faults[0])
#define TRACE_MAX (1u << 20)

static const char *const fn_names[SIM_E_COUNT] = {
#define SIM_NAME(name, params) #name,
    SIM_FUNCS(SIM_NAME)
#undef SIM_NAME
};

/* Entry points a forked child may still call: they touch no driver state. */
static bool works_after_fork(enum sim_fn fn)
{
    return fn == SIM_E_cuDriverGetVersion || fn == SIM_E_cuGetProcAddress ||
           fn == SIM_E_cuGetErrorString || fn == SIM_E_cuGetErrorName;
}

/* Schedule perturbation for the stress runs (tools/run-tests --stress): with SIM_PERTURB set to
 * a number (the seed), every simulated driver call first does, at random, nothing (half the
 * calls), sched_yield(), or sleeps 1-50 us (1 call in 8) or 50-500 us (1 in 32). Each thread
 * draws from its own generator, seeded from the seed and the order in which threads made their
 * first call, so a seed replays the same choices per thread (not the same interleaving: the
 * kernel schedules). Unset, empty or 0: off, one relaxed load per call. */
static _Atomic uint64_t perturb_seed = UINT64_MAX; /* UINT64_MAX: not read yet; 0: off */
static atomic_uint perturb_threads;
static _Thread_local uint64_t perturb_state;

static uint64_t perturb_next(void)
{
    uint64_t x = perturb_state; /* xorshift64* */
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    perturb_state = x;
    return x * 0x2545F4914F6CDD1DULL;
}

void sim_perturb(void)
{
    uint64_t seed = atomic_load_explicit(&perturb_seed, memory_order_relaxed);
    if (seed == 0)
        return;
    if (seed == UINT64_MAX) {
        const char *v = getenv("SIM_PERTURB");
        seed = v ? strtoull(v, NULL, 0) : 0;
        if (seed == UINT64_MAX)
            seed--;
        uint64_t expected = UINT64_MAX;
        if (atomic_compare_exchange_strong(&perturb_seed, &expected, seed) && seed)
            fprintf(stderr, "simdrv: schedule perturbation on, SIM_PERTURB=%llu\n",
                    (unsigned long long)seed);
        if (seed == 0)
            return;
    }
    if (perturb_state == 0) {
        uint64_t n = atomic_fetch_add(&perturb_threads, 1) + 1;
        perturb_state = (seed ^ (n * 0x9E3779B97F4A7C15ULL)) | 1;
    }
    uint64_t r = perturb_next();
    unsigned pick = (unsigned)(r >> 59); /* 0..31 */
    if (pick < 16)
        return;
    if (pick == 31) {
        usleep(50 + (useconds_t)((r >> 8) % 451));
    } else if (pick >= 27) {
        usleep(1 + (useconds_t)((r >> 8) % 50));
    } else {
        sched_yield();
    }
}

/* Counts the call, records it in the trace and fires a matching fault. */
CUresult sim_enter(enum sim_fn fn)
{
    S.total++;
    S.calls[fn]++;
    if (S.tracing) {
        if (S.ntrace < TRACE_MAX)
            S.trace[S.ntrace++] = fn_names[fn];
        S.trace_calls++;
    }
    /* CUDA is not usable in a child of a process that initialized it: the real driver answers
     * an error at once (measured: no child hung, driver-facts.md section 5). */
    if (S.forked_child && !works_after_fork(fn))
        return reject(CUDA_ERROR_NOT_INITIALIZED, "%s: forked child of an initialized process",
                      fn_names[fn]);
    CUresult rc = CUDA_SUCCESS;
    size_t j = 0;
    for (size_t i = 0; i < S.nfaults; i++) {
        sim_fault_t f = S.faults[i];
        unsigned long count = f.fn < 0 ? S.total : S.calls[fn];
        bool mine = f.fn < 0 || f.fn == (int)fn;
        if (mine && rc == CUDA_SUCCESS && count >= f.from && count <= f.to) {
            rc = f.code;
            S.fired++;
            snprintf(last_reason, sizeof last_reason, "%s: injected fault %d", fn_names[fn],
                     (int)rc);
            if (S.verbose)
                fprintf(stderr, "simdrv: %s\n", last_reason);
        }
        if (mine && count >= f.to)
            continue; /* spent */
        S.faults[j++] = f;
    }
    S.nfaults = j;
    if (rc == CUDA_SUCCESS)
        last_reason[0] = 0;
    return rc;
}

/* fork: the child gets a fresh lock (the parent's may have been held by a thread that does not
 * exist in the child; prepare takes it so that the child's copy of the state is consistent) and,
 * in strict mode when the parent had initialized, answers NOT_INITIALIZED from then on, as the
 * real driver does. Strict mode is opt-in (sim_set_fork_strict, SIM_FORK_STRICT=1) because the
 * IPC tests use forked children as stand-ins for other processes. */
static void fork_prepare(void) { pthread_mutex_lock(&S.mu); }
static void fork_parent(void) { pthread_mutex_unlock(&S.mu); }
static void fork_child(void)
{
    pthread_mutex_init(&S.mu, NULL);
    if (S.initialized && S.fork_strict)
        S.forked_child = true;
}

void sim_set_fork_strict(bool strict)
{
    LOCKED;
    S.fork_strict = strict;
}

__attribute__((constructor)) static void sim_register_fork_handlers(void)
{
    pthread_atfork(fork_prepare, fork_parent, fork_child);
}

bool sim_in_forked_child(void)
{
    LOCKED;
    return S.forked_child;
}

/* ---------------------------------------------------------------------------------------- */
/* Counts, faults and traces: the control API                                               */

unsigned long sim_call_count(void)
{
    LOCKED;
    return S.total;
}

static int fn_index(const char *name)
{
    for (int i = 0; i < SIM_E_COUNT; i++)
        if (!strcmp(fn_names[i], name))
            return i;
    die("unknown entry point name \"%s\"", name);
}

unsigned long sim_calls(const char *name)
{
    LOCKED;
    return S.calls[fn_index(name)];
}

void sim_reset_counters(void)
{
    LOCKED;
    S.total = 0;
    memset(S.calls, 0, sizeof S.calls);
    S.nfaults = 0; /* their counts were relative to the old counters */
    S.fired = 0;
    __atomic_store_n(&S.rejected, 0, __ATOMIC_RELAXED);
}

unsigned long sim_rejections(void)
{
    return __atomic_load_n(&S.rejected, __ATOMIC_RELAXED);
}

static void add_fault(int fn, unsigned long nth, unsigned long times, CUresult code)
{
    if (S.nfaults == MAX_FAULTS)
        die("more than %zu pending faults", MAX_FAULTS);
    if (!nth)
        nth = 1;
    unsigned long base = fn < 0 ? S.total : S.calls[fn];
    sim_fault_t f = {.fn = fn, .from = base + nth, .code = code};
    f.to = times ? f.from + times - 1 : ULONG_MAX;
    S.faults[S.nfaults++] = f;
}

void sim_fail_call(unsigned long nth, CUresult code)
{
    LOCKED;
    add_fault(-1, nth, 1, code);
}

void sim_fail_function(const char *name, unsigned long nth, CUresult code)
{
    LOCKED;
    add_fault(fn_index(name), nth, 1, code);
}

void sim_fail_function_repeat(const char *name, unsigned long nth, unsigned long times,
                              CUresult code)
{
    LOCKED;
    add_fault(fn_index(name), nth, times, code);
}

void sim_clear_faults(void)
{
    LOCKED;
    S.nfaults = 0;
}

unsigned long sim_faults_fired(void)
{
    LOCKED;
    return S.fired;
}

void sim_trace_begin(void)
{
    LOCKED;
    if (!S.trace)
        S.trace = xcalloc(TRACE_MAX, sizeof *S.trace);
    S.tracing = true;
    S.ntrace = 0;
    S.trace_calls = 0;
}

size_t sim_trace_get(const char **names, size_t max)
{
    LOCKED;
    size_t k = S.ntrace < max ? S.ntrace : max;
    if (names && k)
        memcpy(names, S.trace, k * sizeof *names);
    return S.trace_calls;
}

void sim_trace_end(void)
{
    LOCKED;
    S.tracing = false;
}

size_t sim_entry_count(void) { return SIM_E_COUNT; }

const char *sim_entry_name(size_t i) { return i < SIM_E_COUNT ? fn_names[i] : NULL; }
