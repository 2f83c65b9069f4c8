/* Tags (tags.h): the registry of names, each thread's tag stack, the per-tag figures and the
 * live JSON API (vmm_stats_json). No driver needed. */
#ifndef VMH_TESTING
#define VMH_TESTING 1 /* vmh_tags_reset, declared in tags.h */
#endif
#include "testutil.h"

#include "tags.h"

#include <pthread.h>

static void *other_thread_tag(void *arg)
{
    (void)arg;
    /* A new thread starts in "default", whatever other threads pushed. */
    unsigned t = vmh_tag_current();
    if (vmm_tag_push("worker") != VMM_OK)
        return (void *)(uintptr_t)-1; /* the test compares the answer */
    return (void *)(uintptr_t)(t + 100 * vmh_tag_current());
}

static void tag_stack_and_registry(void **state)
{
    (void)state;
    vmh_tags_reset();
    assert_int_equal(vmh_tag_current(), VMH_TAG_DEFAULT);
    assert_string_equal(vmh_tag_name(0), "default");
    assert_int_equal(vmm_tag_pop(), VMM_ERR_INVALID);
    assert_int_equal(vmm_tag_push(NULL), VMM_ERR_INVALID);
    assert_int_equal(vmm_tag_push(""), VMM_ERR_INVALID);
    char longname[VMM_TAG_NAME_MAX + 2];
    memset(longname, 'x', sizeof longname - 1);
    longname[sizeof longname - 1] = '\0';
    assert_int_equal(vmm_tag_push(longname), VMM_ERR_INVALID);
    longname[VMM_TAG_NAME_MAX] = '\0';
    assert_int_equal(vmm_tag_push(longname), VMM_OK);
    assert_int_equal(vmm_tag_pop(), VMM_OK);

    assert_int_equal(vmm_tag_push("weights"), VMM_OK);
    unsigned w = vmh_tag_current();
    assert_int_not_equal(w, VMH_TAG_DEFAULT);
    assert_int_equal(vmm_tag_push("kv"), VMM_OK);
    unsigned kv = vmh_tag_current();
    assert_int_not_equal(kv, w);
    assert_int_equal(vmm_tag_push("weights"), VMM_OK); /* same name, same id */
    assert_int_equal(vmh_tag_current(), w);
    assert_int_equal(vmh_tag_lookup("kv"), kv);
    assert_int_equal(vmh_tag_lookup("nope"), VMH_TAG_NONE);

    pthread_t th;
    void *res;
    assert_int_equal(pthread_create(&th, NULL, other_thread_tag, NULL), 0);
    assert_int_equal(pthread_join(th, &res), 0);
    unsigned worker = vmh_tag_lookup("worker");
    assert_int_equal((uintptr_t)res, VMH_TAG_DEFAULT + 100 * worker);
    assert_int_equal(vmh_tag_current(), w); /* this thread's stack is untouched */

    assert_int_equal(vmm_tag_pop(), VMM_OK);
    assert_int_equal(vmh_tag_current(), kv);
    assert_int_equal(vmm_tag_pop(), VMM_OK);
    assert_int_equal(vmm_tag_pop(), VMM_OK);
    assert_int_equal(vmh_tag_current(), VMH_TAG_DEFAULT);

    /* Depth limit. */
    for (int i = 0; i < VMM_TAG_DEPTH_MAX; i++)
        assert_int_equal(vmm_tag_push("kv"), VMM_OK);
    assert_int_equal(vmm_tag_push("kv"), VMM_ERR_LIMIT);
    for (int i = 0; i < VMM_TAG_DEPTH_MAX; i++)
        assert_int_equal(vmm_tag_pop(), VMM_OK);

    /* Name limit: the table fills, known names still work. */
    char name[16];
    unsigned made = vmh_tag_count();
    for (unsigned i = made; i < VMM_TAGS_MAX; i++) {
        snprintf(name, sizeof name, "t%u", i);
        assert_int_equal(vmm_tag_push(name), VMM_OK);
        assert_int_equal(vmm_tag_pop(), VMM_OK);
    }
    assert_int_equal(vmh_tag_count(), VMM_TAGS_MAX);
    assert_int_equal(vmm_tag_push("one too many"), VMM_ERR_LIMIT);
    assert_int_equal(vmm_tag_push("kv"), VMM_OK);
    assert_int_equal(vmm_tag_pop(), VMM_OK);
    assert_int_equal(vmh_tag_current(), VMH_TAG_DEFAULT);
    vmh_tags_reset();
}

static void fake_memory(unsigned tag, vmh_tag_memory_t *out)
{
    *out = (vmh_tag_memory_t){.mapped = 100 + tag, .paused = 200, .backed_up = 300, .kept = 400};
}

static void stats_json_api(void **state)
{
    (void)state;
    vmh_tags_reset();
    assert_int_equal(vmm_tag_push("k\"v"), VMM_OK); /* a name that needs escaping */
    unsigned kv = vmh_tag_current();
    vmm_tag_pop();
    vmh_tag_requested_add(kv, 3 * (int64_t)GRAN);
    vmh_tag_requested_add(kv, -(int64_t)GRAN);
    vmh_tag_note_pause(kv, 1500000000u);
    assert_int_equal(vmh_tag_requested(kv), 2 * (int64_t)GRAN);
    assert_int_equal(vmh_tag_requested_peak(kv), 3 * (int64_t)GRAN);

    int need = vmm_stats_json(NULL, 0);
    assert_true(need > 100);
    char *buf = malloc((size_t)need + 1);
    assert_non_null(buf);
    /* Too small: truncated, NUL-terminated, same length answered. */
    assert_int_equal(vmm_stats_json(buf, 10), need);
    assert_int_equal(strlen(buf), 9);
    assert_int_equal(vmm_stats_json(buf, (size_t)need + 1), need);
    assert_int_equal(strlen(buf), (size_t)need);
    assert_non_null(strstr(buf, "\"tags\": {"));
    assert_non_null(strstr(buf, "\"default\": {\"state\": \"running\", \"requested\": 0"));
    assert_non_null(strstr(buf, "\"pinned_host_bytes\": {\"current\": 0"));
    char want[256];
    snprintf(want, sizeof want,
             "\"k\\\"v\": {\"state\": \"running\", \"requested\": %zu, \"requested_peak\": %zu, "
             "\"mapped\": 0, \"paused\": 0, \"backed_up\": 0, \"kept_mapped\": 0, "
             "\"spilled\": 0, \"pauses\": 1, \"resumes\": 0, \"pause_ns\": 1500000000",
             2 * GRAN, 3 * GRAN);
    if (!strstr(buf, want))
        fprintf(stderr, "%s\nwanted: %s\n", buf, want);
    assert_non_null(strstr(buf, want));
    assert_non_null(strstr(buf, "\"served_allocs\": "));
    assert_int_equal(buf[need - 1], '\n');
    assert_int_equal(vmm_stats_json(NULL, 5), -1);
    free(buf);

    /* The memory figures come from the layer that holds the memory. */
    vmh_tags_set_memory_source(fake_memory);
    char small[4096];
    assert_true(vmm_stats_json(small, sizeof small) < (int)sizeof small);
    snprintf(want, sizeof want, "\"mapped\": %u, \"paused\": 200, \"backed_up\": 300, "
             "\"kept_mapped\": 400", 100 + kv);
    assert_non_null(strstr(small, want));
    vmh_tags_set_memory_source(NULL);
    vmh_tags_reset();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tag_stack_and_registry),
        cmocka_unit_test(stats_json_api),
    };
    return cmocka_run_group_tests_name("tags", tests, NULL, NULL);
}
