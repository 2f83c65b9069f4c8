/* Layer "device" on the simulated driver: the granularity choice (vmh_dev_pick_granularity, the
 * one function the device set-up uses), the device set-up's checks of VMMHOOK_GRANULARITY
 * against the driver (a multiple of the minimum; a size the driver can make at all), and the
 * line VMMHOOK_VERBOSE prints when a served allocation fails (vmh_dev_alloc_failed). */
#ifndef VMH_TESTING
#define VMH_TESTING 1 /* vmh_log_exit, vmh_lifetime_refuse_reset, vmh_log_sink */
#endif
#include "testutil.h"

#include "device.h"
#include "log.h"
#include "tags.h"

/* ---- fixtures: captured log, the strict stop recorded ------------------------------------ */

static char logbuf[1 << 14];
static size_t loglen;
static int loglines;

static void capture(const char *line, size_t len)
{
    if (loglen + len < sizeof logbuf) {
        memcpy(logbuf + loglen, line, len);
        loglen += len;
        logbuf[loglen] = '\0';
    }
    loglines++;
}

static int exit_calls;
static void fake_exit(int status)
{
    (void)status;
    exit_calls++;
}

static int setup(void **state)
{
    tu_setup(state);
    vmh_log_sink = capture;
    vmh_log_set_verbose(false);
    vmh_log_exit = fake_exit;
    vmh_lifetime_refuse_reset();
    exit_calls = 0;
    loglen = 0;
    logbuf[0] = '\0';
    loglines = 0;
    return 0;
}

static int teardown(void **state)
{
    vmh_log_set_verbose(false);
    return tu_teardown(state);
}

static void gran_bytes(size_t n)
{
    tu_opt.gran_mode = VMH_GRAN_BYTES;
    tu_opt.gran_bytes = n;
    tu_configure();
}

/* ---- VMMHOOK_GRANULARITY against the driver -------------------------------------------------- */

/* What the choice refused (the settings' refuse function), for the pure choice below. */
static char refused_why[200], refused_instead[80];
static int refusals;

static void record_refusal(const char *name, const char *why, const char *instead)
{
    assert_string_equal(name, "VMMHOOK_GRANULARITY");
    snprintf(refused_why, sizeof refused_why, "%s", why);
    snprintf(refused_instead, sizeof refused_instead, "%s", instead);
    refusals++;
}

/* The choice from the driver's minimum and recommended granularity, without a driver. */
static void granularity_choice(void **state)
{
    (void)state;
    const size_t M2 = 2u << 20;
    vmh_device_settings_t s = {.gran_mode = VMH_GRAN_RECOMMENDED, .refuse = record_refusal};
    refusals = 0;
    assert_int_equal(vmh_dev_pick_granularity(&s, M2, 4 * M2), 4 * M2);
    s.gran_mode = VMH_GRAN_MIN;
    assert_int_equal(vmh_dev_pick_granularity(&s, M2, 4 * M2), M2);
    s.gran_mode = VMH_GRAN_BYTES;
    s.gran_bytes = 32 * M2;
    assert_int_equal(vmh_dev_pick_granularity(&s, M2, 4 * M2), 32 * M2);
    assert_int_equal(refusals, 0);
    s.gran_bytes = 3u << 20;
    assert_int_equal(vmh_dev_pick_granularity(&s, M2, 4 * M2), 4 * M2); /* the recommended */
    assert_int_equal(refusals, 1);
    assert_non_null(
        strstr(refused_why, "not a multiple of the driver's minimum granularity 2097152"));
    assert_string_equal(refused_instead, "the recommended granularity 8 MiB");
    /* A recommended value that is not a multiple of the minimum is not used. */
    s.gran_mode = VMH_GRAN_RECOMMENDED;
    assert_int_equal(vmh_dev_pick_granularity(&s, M2, 3u << 20), M2);
    /* A driver answering 0 does not divide by zero. */
    assert_int_equal(vmh_dev_pick_granularity(&s, 0, 0), 1);
    assert_int_equal(refusals, 1);
}

/* Not a multiple of the minimum: one warning however many devices ask, the recommended used. */
static void granularity_not_a_multiple(void **state)
{
    (void)state;
    sim_config_t cfg = {.devices = 2};
    tu_reset(&cfg);
    gran_bytes(3 * MiB);
    vmh_dev_t d0 = {0}, d1 = {0};
    assert_int_equal(vmh_dev_setup(&d0, 0, NULL), CUDA_SUCCESS);
    assert_int_equal(vmh_dev_setup(&d1, 1, NULL), CUDA_SUCCESS);
    assert_int_equal(d0.gran, GRAN);
    assert_int_equal(d1.gran, GRAN);
    assert_int_equal(loglines, 1);
    assert_non_null(strstr(logbuf, "vmmhook: VMMHOOK_GRANULARITY=\"3M\" is refused: not a "
                                   "multiple of the driver's minimum granularity 2097152 (2 MiB)"));
    assert_non_null(strstr(logbuf, "accepted: min, recommended"));
    assert_non_null(strstr(logbuf, "using the recommended granularity 2 MiB\n"));
    assert_int_equal(exit_calls, 0);
}

static void granularity_not_a_multiple_strict(void **state)
{
    (void)state;
    gran_bytes(3 * MiB);
    tu_opt.strict = true;
    tu_configure();
    vmh_dev_t d = {0};
    vmh_dev_setup(&d, 0, NULL);
    assert_int_equal(exit_calls, 1);
    assert_non_null(strstr(logbuf, "VMMHOOK_GRANULARITY=\"3M\" is refused"));
    assert_non_null(strstr(logbuf, "stopping because VMMHOOK_STRICT is set"));
}

/* Good values say nothing, and a good size above the recommended one is kept after its one
 * chunk was made and released. */
static void granularity_good_is_quiet(void **state)
{
    (void)state;
    gran_bytes(64 * MiB);
    vmh_dev_t d = {0};
    sim_reset_counters();
    assert_int_equal(vmh_dev_setup(&d, 0, NULL), CUDA_SUCCESS);
    assert_int_equal(d.gran, 64 * MiB);
    assert_int_equal(loglines, 0);
    assert_int_equal(sim_live_allocations(), 0); /* the probes are released */
    /* The handle type's probe and the size's. */
    assert_int_equal(sim_calls("cuMemCreate"), 2);
}

/* The case: VMMHOOK_GRANULARITY=1T (also 512G, or 128G on a GPU of 80 GiB) used to be
 * taken, and then every served allocation failed with out of memory, silently. Now the set-up
 * makes one chunk of it: the driver refuses, a warning names the variable, the value and the
 * driver's answer, and every allocation is served at the recommended granularity. */
static void granularity_the_driver_cannot_make(void **state)
{
    (void)state;
    const size_t sizes[] = {(size_t)1 << 40, (size_t)512 << 30, (size_t)128 << 30};
    const char *texts[] = {"\"1T\"", "\"512G\"", "\"128G\""};
    for (size_t i = 0; i < 3; i++) {
        tu_reset(NULL); /* 80 GiB */
        vmh_lifetime_refuse_reset();
        loglen = 0;
        loglines = 0;
        gran_bytes(sizes[i]);
        CUdeviceptr p[4];
        for (int k = 0; k < 4; k++) {
            assert_int_equal(vmh_heap_alloc(64 * MiB, &p[k]), CUDA_SUCCESS);
            tu_fill(p[k], 64 * MiB, (unsigned)k);
        }
        for (int k = 0; k < 4; k++) {
            assert_true(tu_check(p[k], 64 * MiB, (unsigned)k));
            assert_int_equal(vmh_heap_free(p[k], NULL, false), CUDA_SUCCESS);
        }
        assert_int_equal(loglines, 1);
        char want[64];
        snprintf(want, sizeof want, "vmmhook: VMMHOOK_GRANULARITY=%s is refused: ", texts[i]);
        assert_non_null(strstr(logbuf, want));
        assert_non_null(strstr(logbuf, "answers CUDA_ERROR_OUT_OF_MEMORY 2"));
        assert_non_null(strstr(logbuf, "using the recommended granularity 2 MiB\n"));
        assert_int_equal(exit_calls, 0);
        vmh_heap_trim();
        tu_assert_ledger_empty();
    }
}

static void granularity_the_driver_cannot_make_strict(void **state)
{
    (void)state;
    gran_bytes((size_t)128 << 30);
    tu_opt.strict = true;
    tu_configure();
    vmh_dev_t d = {0};
    vmh_dev_setup(&d, 0, NULL);
    assert_int_equal(exit_calls, 1);
    assert_non_null(strstr(logbuf, "VMMHOOK_GRANULARITY=\"128G\" is refused: the driver cannot "
                                   "make a chunk of that size on device 0"));
    assert_non_null(strstr(logbuf, "stopping because VMMHOOK_STRICT is set"));
    assert_int_equal(sim_live_allocations(), 0);
}

/* A device that is full at the start says nothing about the value: it is kept, quietly. */
static void granularity_kept_when_the_device_is_full(void **state)
{
    (void)state;
    sim_config_t cfg = {.memory = 64 * MiB};
    tu_reset(&cfg);
    gran_bytes(32 * MiB);
    CUmemAllocationProp prop = tu_prop(0);
    CUmemGenericAllocationHandle all;
    assert_int_equal(vmh_drv.cuMemCreate(&all, 64 * MiB, &prop, 0), CUDA_SUCCESS);
    vmh_dev_t d = {0};
    assert_int_equal(vmh_dev_setup(&d, 0, NULL), CUDA_SUCCESS);
    assert_int_equal(d.gran, 32 * MiB);
    assert_int_equal(loglines, 0);
    assert_int_equal(vmh_drv.cuMemRelease(all), CUDA_SUCCESS);
}

/* ---- why a served allocation failed (VMMHOOK_VERBOSE) ------------------------------------- */

static void why_failed(size_t size)
{
    loglen = 0;
    logbuf[0] = '\0';
    loglines = 0;
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(size, &p), CUDA_ERROR_OUT_OF_MEMORY);
    /* One line (besides the set-up's own, when this allocation set the device up). */
    int n = 0;
    for (const char *l = logbuf; (l = strstr(l, "vmmhook: an allocation of")); l++)
        n++;
    assert_int_equal(n, 1);
}

static void failure_says_mem_limit(void **state)
{
    (void)state;
    tu_opt.mem_limit = 16 * MiB;
    tu_configure();
    vmh_log_set_verbose(true);
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(12 * MiB, &p), CUDA_SUCCESS);
    why_failed(8 * MiB);
    assert_non_null(strstr(logbuf, "vmmhook: an allocation of 8388608 bytes on device 0 failed "
                                   "(CUDA_ERROR_OUT_OF_MEMORY 2): over VMMHOOK_MEM_LIMIT=16 MiB "
                                   "(12 MiB already served on the device)\n"));
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
}

static void failure_says_va_limit(void **state)
{
    (void)state;
    tu_opt.va_limit = 8 * MiB;
    tu_configure();
    vmh_log_set_verbose(true);
    why_failed(16 * MiB);
    assert_non_null(strstr(logbuf, "the address space budget VMMHOOK_VA_LIMIT=8 MiB is used up"));
}

static void failure_says_granularity(void **state)
{
    (void)state;
    /* 32G chunks on 80 GiB: the set-up's chunk is made, the third allocation's is not. */
    gran_bytes((size_t)32 << 30);
    vmh_log_set_verbose(true);
    CUdeviceptr p, q;
    assert_int_equal(vmh_heap_alloc(64 * MiB, &p), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_alloc(64 * MiB, &q), CUDA_SUCCESS);
    why_failed(64 * MiB);
    assert_non_null(strstr(logbuf, "the driver has no memory for it in chunks of "
                                   "VMMHOOK_GRANULARITY=32 GiB (32 GiB for this request; 64 MiB "
                                   "at the recommended granularity 2 MiB)\n"));
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
}

static void failure_says_paused_tag(void **state)
{
    (void)state;
    vmh_log_set_verbose(true);
    unsigned tag = vmh_tag_current();
    assert_true(vmh_tag_transition(tag, VMH_TAG_RUNNING, VMH_TAG_PAUSED));
    vmh_heap_tag_freeze(tag, true);
    why_failed(4 * MiB);
    assert_non_null(strstr(logbuf, "is paused (vmm_pause): it takes no memory until vmm_resume"));
    vmh_heap_tag_freeze(tag, false);
    assert_true(vmh_tag_transition(tag, VMH_TAG_PAUSED, VMH_TAG_RUNNING));
}

static void failure_says_out_of_memory(void **state)
{
    (void)state;
    sim_config_t cfg = {.memory = 64 * MiB};
    tu_reset(&cfg);
    vmh_log_set_verbose(true);
    why_failed(128 * MiB);
    assert_non_null(strstr(logbuf, "the device is out of memory"));
}

/* Quiet without VMMHOOK_VERBOSE. */
static void failure_quiet_without_verbose(void **state)
{
    (void)state;
    tu_opt.mem_limit = 4 * MiB;
    tu_configure();
    CUdeviceptr p;
    assert_int_equal(vmh_heap_alloc(8 * MiB, &p), CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(loglines, 0);
}

int main(void)
{
#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)
    const struct CMUnitTest tests[] = {
        T(granularity_choice),
        T(granularity_not_a_multiple),
        T(granularity_not_a_multiple_strict),
        T(granularity_good_is_quiet),
        T(granularity_the_driver_cannot_make),
        T(granularity_the_driver_cannot_make_strict),
        T(granularity_kept_when_the_device_is_full),
        T(failure_says_mem_limit),
        T(failure_says_va_limit),
        T(failure_says_granularity),
        T(failure_says_paused_tag),
        T(failure_says_out_of_memory),
        T(failure_quiet_without_verbose),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
