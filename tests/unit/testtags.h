/* Shared by the suites of tags, pause and resume (test_sleep.c, test_backup.c): a buffer
 * allocated under a tag, and the fixture's end (the cache trimmed, pause state and kept pinned
 * memory dropped, the ledger checked empty, the tags forgotten). Include after testutil.h. */
#ifndef VMH_TESTTAGS_H
#define VMH_TESTTAGS_H

#include "lifetime.h"
#include "pause.h"
#include "tags.h"
#include "vmmhook.h"

/* The fixture's start as the product serves (every size carved, no pinned backups kept), with
 * the tags and the pause state fresh (test_geometry.c, test_holes.c). */
static inline int tt_setup_carved(void **state)
{
    (void)state;
    tu_reset(NULL);
    assert_true(vmh_lifetime_ready());
    tu_opt.pack_below = (size_t)1 << 40; /* the product's default: every size carved */
    tu_opt.pin_limit = 0;
    tu_configure();
    vmh_pause_configure(tu_opt.pin_limit);
    vmh_tags_reset();
    vmh_pause_reset();
    return 0;
}

/* A buffer of size bytes allocated under tag (NULL: the thread's current tag). */
static inline CUdeviceptr tt_alloc_in(const char *tag, size_t size)
{
    if (tag)
        assert_int_equal(vmm_tag_push(tag), VMM_OK);
    CUdeviceptr p = 0;
    assert_int_equal(vmh_heap_alloc(size, &p), CUDA_SUCCESS);
    if (tag)
        assert_int_equal(vmm_tag_pop(), VMM_OK);
    return p;
}

static inline int tt_teardown(void **state)
{
    (void)state;
    vmh_heap_trim();
    vmh_pause_reset();
    tu_assert_ledger_empty();
    tu_assert_stats_consistent();
    vmh_tags_reset();
    return 0;
}

#endif
