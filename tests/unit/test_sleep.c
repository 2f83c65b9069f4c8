/* vmm_pause / vmm_resume over the heap (pause.c), on the simulated driver: each defined edge of
 * docs/SLEEP.md, tags kept apart, concurrent allocation and frees, out of memory on resume,
 * and a fault-injection sweep over a whole tag's pause and resume. */
#ifndef VMH_TESTING
#define VMH_TESTING 1 /* vmh_tags_reset, vmh_pause_reset */
#endif
#include "testutil.h"
#include "testtags.h"

#include "contexts.h"
#include "lifetime.h"
#include "pause.h"
#include "tags.h"
#include "vmmhook.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#define INJECTED CUDA_ERROR_UNKNOWN

static void sleep_reset(const sim_config_t *cfg)
{
    tu_reset(cfg);
    assert_true(vmh_lifetime_ready()); /* reads the options once; the test's values come after */
    tu_opt.pack_below = MiB;
    tu_opt.pin_limit = 0; /* a test that keeps pinned memory sets its own */
    tu_configure();
    vmh_pause_configure(tu_opt.pin_limit);
    vmh_tags_reset();
    vmh_pause_reset();
}

static int setup(void **state)
{
    (void)state;
    sleep_reset(NULL);
    return 0;
}



static bool mapped(CUdeviceptr p, size_t n)
{
    for (size_t off = 0; off < n; off += 4096)
        if (!sim_is_mapped(p + off))
            return false;
    return sim_is_mapped(p + n - 1);
}

static bool unmapped_but_reserved(CUdeviceptr p, size_t n)
{
    for (size_t off = 0; off < n; off += 4096)
        if (sim_is_mapped(p + off) || !sim_is_reserved(p + off))
            return false;
    return true;
}

static vmh_tag_memory_t memory_of(const char *tag)
{
    char buf[8192];
    assert_true(vmm_stats_json(buf, sizeof buf) < (int)sizeof buf);
    vmh_tag_memory_t m;
    char key[64];
    snprintf(key, sizeof key, "\"%s\": {", tag);
    const char *at = strstr(buf, key);
    assert_non_null(at);
    assert_int_equal(sscanf(strstr(at, "\"mapped\""),
                            "\"mapped\": %zu, \"paused\": %zu, \"backed_up\": %zu, "
                            "\"kept_mapped\": %zu",
                            &m.mapped, &m.paused, &m.backed_up, &m.kept),
                     4);
    return m;
}

/* Two tags and the default one: pausing "kv" gives back exactly its memory, keeps every
 * address, leaves the others alone; resume maps it again at the same addresses. */
static void pause_gives_back_one_tag(void **state)
{
    (void)state;
    CUdeviceptr big = tt_alloc_in("kv", 3 * MiB), small = tt_alloc_in("kv", 4096);
    CUdeviceptr w = tt_alloc_in("weights", 3 * MiB), wsmall = tt_alloc_in("weights", 4096);
    CUdeviceptr d = tt_alloc_in(NULL, 5000);
    tu_fill(w, 3 * MiB, 1);
    tu_fill(wsmall, 4096, 2);
    tu_fill(d, 5000, 3);
    size_t used = sim_device_used(0);
    vmh_tag_memory_t before = memory_of("kv");
    assert_int_equal(before.mapped, 4 * MiB + GRAN); /* its own range + its own extent */
    assert_int_equal(before.paused, 0);

    assert_int_equal(vmm_pause("kv", 0), VMM_OK);
    assert_true(unmapped_but_reserved(big, 3 * MiB));
    assert_true(unmapped_but_reserved(small, 4096));
    /* The small buffer's chunk was the tag's own: nothing of another tag went with it. */
    assert_true(tu_check(w, 3 * MiB, 1) && tu_check(wsmall, 4096, 2) && tu_check(d, 5000, 3));
    assert_int_equal(sim_device_used(0), used - before.mapped);
    vmh_tag_memory_t m = memory_of("kv");
    assert_int_equal(m.mapped, 0);
    assert_int_equal(m.paused, before.mapped);
    assert_int_equal(m.backed_up, 0);
    char json[8192];
    vmm_stats_json(json, sizeof json);
    assert_non_null(strstr(json, "\"kv\": {\"state\": \"paused\""));
    /* Still the program's buffers. */
    assert_int_equal(vmm_owns((void *)(uintptr_t)big), 1);
    assert_int_equal(vmm_usable_size((void *)(uintptr_t)big), 4 * MiB);

    assert_int_equal(vmm_resume("kv"), VMM_OK);
    assert_true(mapped(big, 3 * MiB) && mapped(small, 4096));
    assert_int_equal(sim_device_used(0), used);
    tu_fill(big, 3 * MiB, 4); /* writable again */
    tu_fill(small, 4096, 5);
    assert_int_equal(memory_of("kv").mapped, before.mapped);
    assert_int_equal(vmh_tag_pauses(vmh_tag_lookup("kv")), 1);
    assert_int_equal(vmh_tag_resumes(vmh_tag_lookup("kv")), 1);
    CUdeviceptr all[] = {big, small, w, wsmall, d};
    for (size_t i = 0; i < 5; i++)
        assert_int_equal(vmh_heap_free(all[i], NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_tag_requested(vmh_tag_lookup("kv")), 0);
}

static void backup_keeps_contents(void **state)
{
    (void)state;
    CUdeviceptr big = tt_alloc_in("w", 5 * MiB), small = tt_alloc_in("w", 3000);
    tu_fill(big, 5 * MiB, 11);
    tu_fill(small, 3000, 12);
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    vmh_tag_memory_t m = memory_of("w");
    assert_int_equal(m.backed_up, m.paused);
    assert_true(m.paused >= 6 * MiB);
    assert_true(unmapped_but_reserved(big, 5 * MiB));
    assert_int_equal(vmm_resume("w"), VMM_OK);
    assert_true(tu_check(big, 5 * MiB, 11));
    assert_true(tu_check(small, 3000, 12));
    assert_int_equal(memory_of("w").backed_up, 0);
    /* Without VMMHOOK_PIN_LIMIT nothing is pinned; with it, the first resume pins the backups
     * (touched by the pause's copy) and later pauses and resumes reuse them (no more pinning). */
    assert_int_equal(sim_calls("cuMemHostRegister"), 0);
    tu_opt.pin_limit = 64 * MiB;
    vmh_pause_configure(tu_opt.pin_limit);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
        assert_int_equal(sim_calls("cuMemHostRegister"), i == 0 ? 0 : 2);
        assert_int_equal(vmm_resume("w"), VMM_OK);
        assert_int_equal(sim_calls("cuMemHostRegister"), 2); /* one per record, once */
        assert_true(tu_check(big, 5 * MiB, 11) && tu_check(small, 3000, 12));
    }
    char buf[8192];
    vmm_stats_json(buf, sizeof buf);
    assert_null(strstr(buf, "\"pinned_host_bytes\": {\"current\": 0,"));
    assert_int_equal(vmh_heap_free(big, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(small, NULL, false), CUDA_SUCCESS);
}

/* Trace positions of the first and last calls whose names start with prefix (the _v2 forms
 * count), and how many; first = SIZE_MAX when none. */
typedef struct trace_calls {
    size_t first, last, n;
} trace_calls_t;

static trace_calls_t traced(const char **names, size_t n, const char *prefix)
{
    trace_calls_t t = {SIZE_MAX, 0, 0};
    for (size_t i = 0; i < n; i++)
        if (strncmp(names[i], prefix, strlen(prefix)) == 0 &&
            (names[i][strlen(prefix)] == '\0' || names[i][strlen(prefix)] == '_')) {
            if (t.first == SIZE_MAX)
                t.first = i;
            t.last = i;
            t.n++;
        }
    return t;
}

/* Pinning host memory nothing has touched runs at a fraction of the copy rate (SLEEP.md's design
 * notes), so a pause never pins a backup before its copy: with no pinned memory kept
 * (VMMHOOK_PIN_LIMIT 0, or room but nothing kept yet) a pause too small for the staging ring
 * copies to pageable memory with no cuMemHostRegister or cuMemHostAlloc at all (a pause with
 * more pageable backups pins the ring's two slots for its own duration, and its pinner
 * registers the copied backups within the budget: test_backup.c). With room, the resume
 * registers each backup before copying it back, and the next pause copies into that pinned
 * memory without pinning again. */
static void first_pause_never_pins(void **state)
{
    (void)state;
    static const char *names[4096];
    CUdeviceptr big = tt_alloc_in("w", 5 * MiB), small = tt_alloc_in("w", 3000);
    tu_fill(big, 5 * MiB, 21);
    tu_fill(small, 3000, 22);
    for (int limit = 0; limit < 2; limit++) {
        tu_opt.pin_limit = limit ? 64 * MiB : 0;
        vmh_pause_configure(tu_opt.pin_limit);
        sim_reset_counters();
        sim_trace_begin();
        assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
        size_t n = sim_trace_get(names, 4096);
        assert_true(n < 4096);
        trace_calls_t down = traced(names, n, "cuMemcpyDtoH");
        assert_int_equal(down.n, 2); /* one copy per record, whole */
        assert_int_equal(traced(names, n, "cuMemHostRegister").n, 0);
        assert_int_equal(traced(names, n, "cuMemHostAlloc").n, 0);
        assert_int_equal(memory_of("w").backed_up, memory_of("w").paused);
        /* Nothing pinned yet, and too little for the staging ring (test_backup.c): each backup
         * was copied directly into fresh pageable memory. */
        assert_int_equal(vmh_pause_staged_bytes(), 0);

        sim_trace_begin();
        assert_int_equal(vmm_resume("w"), VMM_OK);
        n = sim_trace_get(names, 4096);
        trace_calls_t reg = traced(names, n, "cuMemHostRegister");
        trace_calls_t up = traced(names, n, "cuMemcpyHtoD");
        assert_int_equal(up.n, 2);
        assert_int_equal(reg.n, limit ? 2 : 0);
        assert_int_equal(traced(names, n, "cuMemHostAlloc").n, 0);
        if (limit) /* registered before the copy back that it speeds up */
            assert_true(reg.first < up.first);
        assert_true(tu_check(big, 5 * MiB, 21) && tu_check(small, 3000, 22));
    }
    /* Kept pinned now: the next pause copies into it, pinning nothing (and staging nothing). */
    sim_trace_begin();
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(vmh_pause_staged_bytes(), 0);
    size_t n = sim_trace_get(names, 4096);
    assert_int_equal(traced(names, n, "cuMemcpyDtoH").n, 2);
    assert_int_equal(traced(names, n, "cuMemHostRegister").n, 0);
    assert_int_equal(vmm_resume("w"), VMM_OK);
    n = sim_trace_get(names, 4096);
    sim_trace_end();
    assert_int_equal(traced(names, n, "cuMemHostRegister").n, 0);
    assert_true(tu_check(big, 5 * MiB, 21) && tu_check(small, 3000, 22));
    assert_int_equal(vmh_heap_free(big, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(small, NULL, false), CUDA_SUCCESS);
}

/* Pinning at resume is an optimisation: when the driver refuses it, the backup is copied back
 * from pageable memory, the resume succeeds, nothing is counted as pinned, and the room it had
 * claimed under VMMHOOK_PIN_LIMIT is free again for the next resume. */
static void pin_refused_at_resume(void **state)
{
    (void)state;
    CUdeviceptr big = tt_alloc_in("w", 5 * MiB);
    tu_fill(big, 5 * MiB, 31);
    tu_opt.pin_limit = 6 * MiB; /* room for this one backup only */
    vmh_pause_configure(tu_opt.pin_limit);
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    sim_fail_function("cuMemHostRegister", 1, CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    assert_int_equal(vmm_resume("w"), VMM_OK);
    assert_int_equal(sim_faults_fired(), 1);
    sim_clear_faults();
    assert_true(tu_check(big, 5 * MiB, 31));
    char buf[8192];
    vmm_stats_json(buf, sizeof buf);
    assert_non_null(strstr(buf, "\"pinned_host_bytes\": {\"current\": 0,"));
    /* The room came back: the next resume pins. */
    unsigned long registered = sim_calls("cuMemHostRegister");
    assert_int_equal(vmm_pause("w", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(vmm_resume("w"), VMM_OK);
    assert_int_equal(sim_calls("cuMemHostRegister"), registered + 1);
    assert_true(tu_check(big, 5 * MiB, 31));
    vmm_stats_json(buf, sizeof buf);
    assert_null(strstr(buf, "\"pinned_host_bytes\": {\"current\": 0,"));
    assert_int_equal(vmh_heap_free(big, NULL, false), CUDA_SUCCESS);
}

static void defined_edges(void **state)
{
    (void)state;
    CUdeviceptr p = tt_alloc_in("kv", 3 * MiB), q = tt_alloc_in("kv", 100);
    assert_int_equal(vmm_pause("nope", 0), VMM_ERR_UNKNOWN_TAG);
    assert_int_equal(vmm_resume("nope"), VMM_ERR_UNKNOWN_TAG);
    assert_int_equal(vmm_pause("kv", 0x80), VMM_ERR_INVALID);
    assert_int_equal(vmm_resume("kv"), VMM_ERR_NOT_PAUSED);
    /* A stream capture in progress (reported by the interposer): refused, nothing done. */
    CUstream cs = (CUstream)(uintptr_t)0x5151;
    vmh_capture_began(cs, CU_STREAM_CAPTURE_MODE_RELAXED);
    assert_int_equal(vmm_pause("kv", 0), VMM_ERR_CAPTURING);
    assert_true(mapped(p, 3 * MiB));
    vmh_capture_ended(cs);
    assert_int_equal(vmm_pause("kv", 0), VMM_OK);
    vmh_capture_began(cs, CU_STREAM_CAPTURE_MODE_RELAXED);
    assert_int_equal(vmm_resume("kv"), VMM_ERR_CAPTURING);
    assert_true(unmapped_but_reserved(p, 3 * MiB));
    vmh_capture_ended(cs);
    assert_int_equal(vmm_resume("kv"), VMM_OK);
    assert_int_equal(vmm_pause("kv", 0), VMM_OK);
    assert_int_equal(vmm_pause("kv", 0), VMM_ERR_PAUSED);

    /* Allocation in a paused tag: refused, big or small. */
    assert_int_equal(vmm_tag_push("kv"), VMM_OK);
    CUdeviceptr r = 0;
    uint64_t ooms = vmh_counter_get(VMH_STAT_ooms);
    assert_int_equal(vmh_heap_alloc(3 * MiB, &r), CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(vmh_heap_alloc(100, &r), CUDA_ERROR_OUT_OF_MEMORY);
    assert_int_equal(vmh_counter_get(VMH_STAT_ooms), ooms + 2); /* PyTorch's num_ooms */
    void *vr = NULL;
    assert_int_equal(vmm_realloc(&vr, 100), VMM_ERR_NO_MEMORY);
    assert_int_equal(vmm_tag_pop(), VMM_OK);
    /* ... while other tags allocate as ever. */
    CUdeviceptr other = tt_alloc_in("other", 100);

    /* vmm_realloc of a paused buffer: refused, untouched. */
    void *vp = (void *)(uintptr_t)p, *vq = (void *)(uintptr_t)q;
    assert_int_equal(vmm_realloc(&vp, 9 * MiB), VMM_ERR_PAUSED);
    assert_int_equal(vmm_realloc(&vp, 2 * MiB), VMM_ERR_PAUSED);
    assert_int_equal(vmm_realloc(&vq, 200), VMM_ERR_PAUSED);
    assert_int_equal(vmm_realloc(&vq, 3 * MiB), VMM_ERR_PAUSED);
    assert_ptr_equal(vp, (void *)(uintptr_t)p);
    assert_ptr_equal(vq, (void *)(uintptr_t)q);
    /* Exporting one for another process: refused. */
    vmh_export_t ex;
    assert_int_not_equal(vmh_heap_export(p, &ex), CUDA_SUCCESS);

    /* NULL: every tag that applies; the paused one is skipped. */
    assert_int_equal(vmm_pause(NULL, 0), VMM_OK);
    assert_true(unmapped_but_reserved(other, 100));
    assert_int_equal(vmm_resume(NULL), VMM_OK);
    assert_int_equal(vmm_resume(NULL), VMM_OK); /* nothing paused: nothing to do */
    assert_true(mapped(p, 3 * MiB) && mapped(q, 100) && mapped(other, 100));
    assert_int_equal(vmm_realloc(&vp, 9 * MiB), VMM_OK); /* running again */
    assert_int_equal(vmh_heap_free((CUdeviceptr)(uintptr_t)vp, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(other, NULL, false), CUDA_SUCCESS);
}

/* Free while paused: the addresses go once, the memory (already released) is not released
 * again, and resume never maps it. */
static void free_while_paused(void **state)
{
    (void)state;
    CUdeviceptr p = tt_alloc_in("kv", 3 * MiB), q = tt_alloc_in("kv", 100), keep = tt_alloc_in("kv", 200);
    assert_int_equal(vmm_pause("kv", VMM_PAUSE_BACKUP), VMM_OK);
    unsigned long released = sim_calls("cuMemRelease");
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
    assert_int_equal(sim_calls("cuMemRelease"), released); /* nothing released twice */
    assert_false(sim_is_reserved(p));
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_ERROR_NOT_FOUND); /* once */
    assert_int_equal(vmm_owns((void *)(uintptr_t)p), 0);
    assert_int_equal(vmm_resume("kv"), VMM_OK);
    assert_false(sim_is_mapped(p));
    assert_true(mapped(keep, 200));
    assert_int_equal(vmh_heap_free(keep, NULL, false), CUDA_SUCCESS);
    /* An extent emptied while paused is given back by a trim while still paused. Until then it
     * is not idle memory: its memory went at the pause, and cuMemGetInfo's free (which adds the
     * idle bytes) counts it already. */
    CUdeviceptr lone = tt_alloc_in("solo", 100);
    assert_int_equal(vmm_pause("solo", 0), VMM_OK);
    size_t idle = vmh_heap_idle_bytes(0);
    assert_int_equal(vmh_heap_free(lone, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_idle_bytes(0), idle);
    vmh_heap_trim();
    assert_false(sim_is_reserved(lone));
    assert_int_equal(vmm_resume("solo"), VMM_OK);
    assert_false(sim_is_mapped(lone));
}

/* Out of memory on resume: VMM_ERR_NO_MEMORY, nothing of the tag mapped, still paused with its
 * backup; once memory is free the same call succeeds. */
static void resume_out_of_memory(void **state)
{
    (void)state;
    sim_config_t cfg = {.memory = 16 * GRAN};
    sleep_reset(&cfg);
    CUdeviceptr a = tt_alloc_in("kv", 5 * MiB), b = tt_alloc_in("kv", 7 * MiB), s = tt_alloc_in("kv", 64);
    tu_fill(a, 5 * MiB, 21);
    tu_fill(b, 7 * MiB, 22);
    tu_fill(s, 64, 23);
    assert_int_equal(vmm_pause("kv", VMM_PAUSE_BACKUP), VMM_OK);
    CUdeviceptr filler = tt_alloc_in("other", 12 * GRAN); /* leaves 4 granules: not enough */
    assert_int_equal(vmm_resume("kv"), VMM_ERR_NO_MEMORY);
    assert_true(unmapped_but_reserved(a, 5 * MiB));
    assert_true(unmapped_but_reserved(b, 7 * MiB));
    assert_true(unmapped_but_reserved(s, 64));
    assert_int_equal(vmh_tag_state(vmh_tag_lookup("kv")), VMH_TAG_PAUSED);
    assert_int_equal(vmm_pause("kv", 0), VMM_ERR_PAUSED);
    /* Freed memory held idle (cached) by the library is given back by the resume itself. */
    assert_int_equal(vmh_heap_free(filler, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmm_resume("kv"), VMM_OK);
    assert_true(tu_check(a, 5 * MiB, 21) && tu_check(b, 7 * MiB, 22) && tu_check(s, 64, 23));
    CUdeviceptr all[] = {a, b, s};
    for (size_t i = 0; i < 3; i++)
        assert_int_equal(vmh_heap_free(all[i], NULL, false), CUDA_SUCCESS);
}

/* A buffer shared with another process stays mapped (its memory would not go anyway). */
static void exported_buffer_stays(void **state)
{
    (void)state;
    CUdeviceptr p = tt_alloc_in("kv", 3 * MiB), q = tt_alloc_in("kv", 3 * MiB);
    tu_fill(p, 3 * MiB, 31);
    vmh_export_t ex;
    assert_int_equal(vmh_heap_export(p, &ex), CUDA_SUCCESS);
    assert_int_equal(vmm_pause("kv", 0), VMM_OK);
    assert_true(mapped(p, 3 * MiB) && tu_check(p, 3 * MiB, 31));
    assert_true(unmapped_but_reserved(q, 3 * MiB));
    assert_int_equal(memory_of("kv").kept, 4 * MiB);
    assert_int_equal(vmm_resume("kv"), VMM_OK);
    vmh_heap_export_release(&ex);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(q, NULL, false), CUDA_SUCCESS);
}

/* Peer access comes back, including a grant made while paused. */
static void peer_access_restored(void **state)
{
    (void)state;
    sim_config_t cfg = {.devices = 3};
    sleep_reset(&cfg);
    assert_int_equal(vmh_heap_set_peer_access(0, 1, true), CUDA_SUCCESS);
    CUdeviceptr p = tt_alloc_in("kv", 3 * MiB), s = tt_alloc_in("kv", 128);
    assert_int_equal(sim_access_flags(p, 1), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    assert_int_equal(vmm_pause("kv", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(vmh_heap_set_peer_access(0, 2, true), CUDA_SUCCESS);
    assert_int_equal(vmm_resume("kv"), VMM_OK);
    for (int dev = 0; dev < 3; dev++) {
        assert_int_equal(sim_access_flags(p, dev), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
        assert_int_equal(sim_access_flags(s, dev), CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    }
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(s, NULL, false), CUDA_SUCCESS);
}

/* Several devices: each device's memory of the tag goes and comes back, with its context. */
static void several_devices(void **state)
{
    (void)state;
    sim_config_t cfg = {.devices = 2};
    sleep_reset(&cfg);
    CUdeviceptr p0 = tt_alloc_in("kv", 3 * MiB);
    sim_set_current_device(1);
    CUdeviceptr p1 = tt_alloc_in("kv", 3 * MiB), s1 = tt_alloc_in("kv", 99);
    tu_fill(p1, 3 * MiB, 41);
    sim_set_current_device(0);
    tu_fill(p0, 3 * MiB, 40);
    assert_int_equal(vmm_pause("kv", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(sim_device_used(1), 0);
    assert_int_equal(sim_current_device(), 0); /* the caller's context is back */
    assert_int_equal(vmm_resume("kv"), VMM_OK);
    assert_true(tu_check(p0, 3 * MiB, 40));
    sim_set_current_device(1);
    assert_true(tu_check(p1, 3 * MiB, 41));
    CUdeviceptr all[] = {p0, p1, s1};
    for (size_t i = 0; i < 3; i++)
        assert_int_equal(vmh_heap_free(all[i], NULL, false), CUDA_SUCCESS);
    sim_set_current_device(0);
}

/* Memory of another device than the caller's: its context is made current for the copies and
 * the caller's given back; a refused pop fails the call like any other failure (the tag runs
 * again, contents intact) and says so once in the log. */
static void refused_pop_fails_the_call(void **state)
{
    (void)state;
    sim_config_t cfg = {.devices = 2};
    sleep_reset(&cfg);
    sim_set_current_device(1);
    CUdeviceptr p1 = tt_alloc_in("kv", 3 * MiB);
    tu_fill(p1, 3 * MiB, 41);
    sim_set_current_device(0);
    sim_fail_function("cuCtxPopCurrent", 1, INJECTED);
    assert_int_equal(vmm_pause("kv", VMM_PAUSE_BACKUP), VMM_ERR_DRIVER);
    assert_int_equal(vmm_last_driver_error(), INJECTED);
    sim_clear_faults();
    assert_int_equal(vmh_tag_state(vmh_tag_lookup("kv")), VMH_TAG_RUNNING);
    /* The refused pop left device 1's context pushed on this thread: the test's own undo. */
    CUcontext popped;
    assert_int_equal(sim_table()->cuCtxPopCurrent(&popped), CUDA_SUCCESS);
    assert_ptr_equal(popped, sim_primary_context(1));
    sim_set_current_device(0);
    assert_int_equal(vmm_pause("kv", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(sim_current_device(), 0);
    assert_int_equal(vmm_resume("kv"), VMM_OK);
    sim_set_current_device(1);
    assert_true(tu_check(p1, 3 * MiB, 41));
    assert_int_equal(vmh_heap_free(p1, NULL, false), CUDA_SUCCESS);
    sim_set_current_device(0);
}

/* Work queued before the pause lands before the memory goes (and is in the backup); a
 * "kernel" that touches a paused buffer faults; work captured with the buffer's address (a
 * CUDA graph replayed after resume) finds the same address mapped, with the same contents. */
static unsigned char byte_at(CUdeviceptr p)
{
    unsigned char b = 0;
    assert_int_equal(sim_read(&b, p, 1), CUDA_SUCCESS);
    return b;
}

static void queued_work_and_replay(void **state)
{
    (void)state;
    CUdeviceptr p = tt_alloc_in("kv", 3 * MiB), s = tt_alloc_in("kv", 512);
    /* Without a backup nothing else lands the work: the pause's own wait must. */
    assert_int_equal(sim_launch_write(NULL, NULL, p, 4096, 0x11), CUDA_SUCCESS);
    assert_int_equal(vmm_pause("kv", 0), VMM_OK);
    assert_int_equal(sim_hazards(), 0);
    assert_int_equal(vmm_resume("kv"), VMM_OK);
    tu_fill(p, 3 * MiB, 61);
    assert_int_equal(sim_launch_write(NULL, NULL, p + MiB, 4096, 0x5a), CUDA_SUCCESS);
    assert_int_equal(sim_launch_write(NULL, NULL, s, 512, 0x3c), CUDA_SUCCESS);
    assert_int_equal(vmm_pause("kv", VMM_PAUSE_BACKUP), VMM_OK);
    assert_int_equal(sim_hazards(), 0); /* the pause waited for the queued work */

    assert_int_equal(sim_launch_write(NULL, NULL, p, 16, 1), CUDA_SUCCESS);
    sim_flush();
    assert_int_equal(sim_hazards(), 1); /* a kernel touching a paused buffer faults */
    printf("  (the HAZARD line above is this test's own: a kernel into a paused buffer)\n");

    assert_int_equal(vmm_resume("kv"), VMM_OK);
    assert_int_equal(byte_at(p + MiB), 0x5a);
    assert_int_equal(byte_at(p + MiB + 4095), 0x5a);
    assert_int_equal(byte_at(s + 511), 0x3c);
    assert_true(tu_check(p, MiB, 61));
    /* The same "kernels" at the same addresses, as a graph replay: no fault. */
    assert_int_equal(sim_launch_write(NULL, NULL, p + MiB, 4096, 0x77), CUDA_SUCCESS);
    assert_int_equal(sim_launch_write(NULL, NULL, s, 512, 0x78), CUDA_SUCCESS);
    sim_flush();
    assert_int_equal(sim_hazards(), 1);
    assert_int_equal(byte_at(p + MiB), 0x77);
    assert_int_equal(byte_at(s), 0x78);
    assert_int_equal(vmh_heap_free(p, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(s, NULL, false), CUDA_SUCCESS);
}

/* ---- other threads allocate and free in the tag while it is paused and resumed ---- */

typedef struct churn {
    atomic_bool stop;
    atomic_ulong served, refused;
    int device_ok;
} churn_t;

static void *churn_thread(void *arg)
{
    churn_t *c = arg;
    sim_set_current_device(0);
    if (vmm_tag_push("kv") != VMM_OK) {
        c->device_ok = 0;
        return NULL;
    }
    CUdeviceptr held[16] = {0};
    unsigned seed = 7;
    while (!atomic_load(&c->stop)) {
        unsigned i = (seed = seed * 1103515245u + 12345u) >> 16 & 15;
        if (held[i]) {
            CUresult frc = vmh_heap_free(held[i], NULL, false);
            if (frc != CUDA_SUCCESS) {
                fprintf(stderr, "free of %#llx (slot %u) failed: %d\n",
                        (unsigned long long)held[i], i, (int)frc);
                c->device_ok = 0;
            }
            held[i] = 0;
        } else {
            size_t size = i & 1 ? 2 * MiB + 4096 : 512u << (i & 7);
            if (vmh_heap_alloc(size, &held[i]) == CUDA_SUCCESS)
                atomic_fetch_add(&c->served, 1);
            else
                atomic_fetch_add(&c->refused, 1), held[i] = 0;
        }
        sched_yield(); /* the pausing thread gets its share of 2 busy cores */
    }
    for (int i = 0; i < 16; i++)
        if (held[i] && vmh_heap_free(held[i], NULL, false) != CUDA_SUCCESS)
            c->device_ok = 0;
    vmm_tag_pop();
    return NULL;
}

static void pause_while_others_allocate(void **state)
{
    (void)state;
    churn_t c = {.device_ok = 1};
    pthread_t th[4];
    for (int i = 0; i < 4; i++)
        assert_int_equal(pthread_create(&th[i], NULL, churn_thread, &c), 0);
    CUdeviceptr mine = tt_alloc_in("kv", 3 * MiB);
    /* Fewer rounds under a sanitizer (testutil.h's TU_SLOWDOWN; the stress step repeats the
     * test): 4 threads allocating beside each round made it the slowest test under TSan. */
    const int rounds = 30 / TU_SLOWDOWN < 6 ? 6 : 30 / TU_SLOWDOWN;
    for (int round = 0; round < rounds; round++) {
        vmm_status st = vmm_pause("kv", round & 1 ? VMM_PAUSE_BACKUP : 0);
        assert_int_equal(st, VMM_OK);
        /* While paused nothing of the tag is mapped, whatever the others do. */
        assert_int_equal(memory_of("kv").mapped, memory_of("kv").kept);
        assert_true(unmapped_but_reserved(mine, 3 * MiB));
        assert_int_equal(vmm_resume("kv"), VMM_OK);
        assert_true(mapped(mine, 3 * MiB));
        usleep(2000); /* a window for the others to allocate in the running tag */
    }
    atomic_store(&c.stop, true);
    for (int i = 0; i < 4; i++)
        pthread_join(th[i], NULL);
    assert_true(c.device_ok);
    assert_true(atomic_load(&c.served) > 0);
    printf("  churn during %d pauses: %lu served, %lu refused while paused\n", rounds,
           atomic_load(&c.served), atomic_load(&c.refused));
    assert_int_equal(vmh_heap_free(mine, NULL, false), CUDA_SUCCESS);
    assert_int_equal(sim_hazards(), 0);
}

/* ---- fault injection over a tag's pause and resume (test_sweep.c's discovery approach) ---- */

typedef struct tfix {
    CUdeviceptr big, grown, small;
} tfix_t;

static void tfix_make(tfix_t *f)
{
    sleep_reset(NULL);
    tu_opt.headroom = 0;
    tu_configure();
    f->big = tt_alloc_in("kv", 3 * MiB);
    void *g = NULL;
    assert_int_equal(vmm_tag_push("kv"), VMM_OK);
    assert_int_equal(vmm_realloc(&g, 2 * MiB), VMM_OK);
    assert_int_equal(vmm_realloc(&g, 6 * MiB), VMM_OK); /* two chunks */
    assert_int_equal(vmm_tag_pop(), VMM_OK);
    f->grown = (CUdeviceptr)(uintptr_t)g;
    f->small = tt_alloc_in("kv", 1000);
    vmh_heap_trim();
    tu_fill(f->big, 3 * MiB, 51);
    tu_fill(f->grown, 6 * MiB, 52);
    tu_fill(f->small, 1000, 53);
}

static bool tfix_intact(const tfix_t *f)
{
    return tu_check(f->big, 3 * MiB, 51) && tu_check(f->grown, 6 * MiB, 52) &&
           tu_check(f->small, 1000, 53);
}

static bool tfix_paused(const tfix_t *f)
{
    return unmapped_but_reserved(f->big, 3 * MiB) && unmapped_but_reserved(f->grown, 6 * MiB) &&
           unmapped_but_reserved(f->small, 1000);
}

static void tfix_free(const tfix_t *f)
{
    assert_int_equal(vmh_heap_free(f->big, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(f->grown, NULL, false), CUDA_SUCCESS);
    assert_int_equal(vmh_heap_free(f->small, NULL, false), CUDA_SUCCESS);
    vmh_heap_trim();
    vmh_pause_reset();
    tu_assert_ledger_empty();
}

static bool is_undo(const char *name)
{
    return !strcmp(name, "cuMemUnmap") || !strcmp(name, "cuMemAddressFree") ||
           !strcmp(name, "cuMemRelease") || !strcmp(name, "cuCtxPopCurrent");
}

static unsigned sweep_one(bool resume)
{
    tfix_t f;
    tfix_make(&f);
    if (resume)
        assert_int_equal(vmm_pause("kv", VMM_PAUSE_BACKUP), VMM_OK);
    sim_reset_counters();
    sim_trace_begin();
    assert_int_equal(resume ? vmm_resume("kv") : vmm_pause("kv", VMM_PAUSE_BACKUP), VMM_OK);
    unsigned long n = sim_call_count();
    const char *names[512];
    assert_true(sim_trace_get(names, 512) == n && n < 512);
    sim_trace_end();
    if (!resume)
        assert_int_equal(vmm_resume("kv"), VMM_OK);
    assert_true(tfix_intact(&f));
    tfix_free(&f);

    unsigned points = 0;
    unsigned long candidate = 0;
    for (unsigned long i = 1; i <= n; i++) {
        if (is_undo(names[i - 1]) || !tu_sweep_point(candidate++))
            continue;
        tfix_make(&f);
        if (resume)
            assert_int_equal(vmm_pause("kv", VMM_PAUSE_BACKUP), VMM_OK);
        sim_reset_counters();
        /* Two codes in turn: vmm_last_driver_error must be this call's, not a previous one's. */
        CUresult injected = i % 2 ? INJECTED : CUDA_ERROR_OPERATING_SYSTEM;
        sim_fail_call(i, injected);
        vmm_status st = resume ? vmm_resume("kv") : vmm_pause("kv", VMM_PAUSE_BACKUP);
        sim_clear_faults();
        if (st == VMM_OK) {
            /* Only a wait may fail without failing the call: ... none here. */
            fprintf(stderr, "%s: call %lu (%s) failed, call succeeded\n",
                    resume ? "resume" : "pause", i, names[i - 1]);
        }
        assert_int_equal(st, VMM_ERR_DRIVER);
        assert_int_equal(vmm_last_driver_error(), injected);
        if (resume && !tfix_paused(&f))
            fprintf(stderr, "resume: call %lu (%s) failed: the tag is not left paused\n", i,
                    names[i - 1]);
        if (resume) {
            /* Still paused, nothing half-mapped; the retry restores everything. */
            assert_true(tfix_paused(&f));
            assert_int_equal(vmm_resume("kv"), VMM_OK);
        } else {
            /* Running again, as before the call. */
            assert_int_equal(vmh_tag_state(vmh_tag_lookup("kv")), VMH_TAG_RUNNING);
        }
        assert_true(tfix_intact(&f));
        assert_int_equal(sim_hazards(), 0);
        tfix_free(&f);
        points++;
    }
    printf("  %-8s %3lu driver calls, each failed in turn:", resume ? "resume" : "pause", n);
    for (unsigned long i = 0; i < n; i++)
        printf(" %s", names[i] + 2);
    printf("\n");
    return points;
}

static void fault_sweep(void **state)
{
    (void)state;
    unsigned points = sweep_one(false) + sweep_one(true);
    printf("tag pause/resume sweep: %u injection points, no leak, nothing half-mapped\n",
           points);
    assert_true(points >= (TU_SLOWDOWN <= 2 ? 12 : 4));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(pause_gives_back_one_tag, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(backup_keeps_contents, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(first_pause_never_pins, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(pin_refused_at_resume, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(defined_edges, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(free_while_paused, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(resume_out_of_memory, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(exported_buffer_stays, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(peer_access_restored, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(several_devices, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(refused_pop_fails_the_call, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(queued_work_and_replay, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(pause_while_others_allocate, setup, tt_teardown),
        cmocka_unit_test_setup_teardown(fault_sweep, setup, tt_teardown),
    };
    return cmocka_run_group_tests_name("sleep", tests, NULL, NULL);
}
