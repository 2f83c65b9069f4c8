/* Test hooks of the arena (declared in arena.h under VMH_TESTING): the invariant check and the
 * host-memory accounting the unit tests read. Compiled into the test build only. */
#include "arena.h"
#include "arena_internal.h"

#ifdef VMH_TESTING
#include <stdio.h>

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "arena check failed at %s:%d: %s\n", __FILE__, __LINE__, #cond);       \
            return __LINE__;                                                                       \
        }                                                                                          \
    } while (0)

/* Checks every invariant the fast paths rely on; 0 when all hold, else the failing line. */
int vmh_arena_check(const vmh_arena_t *a)
{
    size_t live = 0, parked = 0, freeb = 0, retired = 0, ext_bytes = 0, exts = 0, nfree = 0,
           nparked = 0, holes = 0;
    const vmh_extent_t *lists[2] = {a->busy, a->idle};
    for (int li = 0; li < 2; li++) {
        for (const vmh_extent_t *e = lists[li]; e; e = e->next) {
            CHECK(e->arena == a);
            CHECK(!e->next || e->next->prev == e);
            exts++;
            ext_bytes += e->size;
            size_t elive = 0, eparked = 0, nstarts = 0, eholes = 0;
            uintptr_t at = e->base;
            const blk_t *prev = NULL;
            CHECK(e->first && !e->first->phys_prev && e->first->base == e->base);
            for (const blk_t *b = e->first; b; prev = b, b = b->phys_next) {
                CHECK(b->ext == e);
                CHECK(b->phys_prev == prev);
                CHECK(b->base == at);
                size_t sz = blk_size(b);
                CHECK(sz > 0);
                at += sz;
                CHECK(at <= e->base + e->size);
                size_t g = granule(e, b->base);
                bool started = (e->starts[g >> 6] >> (g & 63)) & 1;
                switch (blk_state(b)) {
                case B_LIVE:
                    CHECK(started && tab_get(e, b->base) == b);
                    CHECK(b->u.req > 0 && b->u.req <= sz);
                    live += sz;
                    elive++;
                    nstarts++;
                    break;
                case B_PARKED:
                    CHECK(!started && !tab_get(e, b->base));
                    parked += sz;
                    eparked++;
                    break;
                case B_HOLE:
                    CHECK(!started && !tab_get(e, b->base));
                    eholes += sz;
                    break;
                case B_FREE: {
                    CHECK(!started && !tab_get(e, b->base));
                    CHECK(!prev || blk_state(prev) != B_FREE);
                    if (e->retired) { /* in no free list: never served */
                        retired += sz;
                        break;
                    }
                    unsigned fl, sl;
                    mapping(sz, &fl, &sl);
                    const blk_t *f = a->heads[fl][sl];
                    while (f && f != b)
                        f = f->next;
                    CHECK(f == b);
                    freeb += sz;
                    nfree++;
                    break;
                }
                default:
                    CHECK(!"bad state");
                }
            }
            CHECK(at == e->base + e->size);
            CHECK(elive == e->nlive && eparked == e->nparked && eholes == e->holes);
            holes += eholes;
            CHECK((li == 1) == (elive == 0 && eparked == 0));
            CHECK(e->tab_n == elive);
            size_t bits = 0;
            for (size_t w = 0; w < e->nwords; w++) {
                bits += (size_t)__builtin_popcountll(e->starts[w]);
                CHECK(((e->summary[w >> 6] >> (w & 63)) & 1) == (e->starts[w] != 0));
            }
            CHECK(bits == nstarts);
        }
    }
    size_t listed = 0;
    for (unsigned fl = 0; fl < FL_COUNT; fl++) {
        CHECK(((a->fl_map >> fl) & 1) == (a->sl_map[fl] != 0));
        for (unsigned sl = 0; sl < SL_COUNT; sl++) {
            CHECK(((a->sl_map[fl] >> sl) & 1) == (a->heads[fl][sl] != NULL));
            const blk_t *pv = NULL;
            for (const blk_t *f = a->heads[fl][sl]; f; pv = f, f = f->next) {
                unsigned ff, ss;
                mapping(blk_size(f), &ff, &ss);
                CHECK(ff == fl && ss == sl && blk_state(f) == B_FREE && f->u.prev == pv);
                listed++;
            }
        }
    }
    CHECK(listed == nfree);
    const blk_t *tail = NULL;
    for (const blk_t *b = a->park_head; b; tail = b, b = b->next) {
        CHECK(blk_state(b) == B_PARKED);
        nparked++;
    }
    CHECK(tail == a->park_tail);
    CHECK(nparked == a->nparked);
    CHECK(live == a->live && parked == a->parked && freeb == a->free && retired == a->retired);
    CHECK(ext_bytes == a->extents_bytes && exts == a->extents && holes == a->holes);
    CHECK(live + parked + freeb + retired + holes == ext_bytes);
    return 0;
}

size_t vmh_arena_free_blocks(const vmh_arena_t *a)
{
    size_t n = 0;
    for (unsigned fl = 0; fl < FL_COUNT; fl++)
        for (unsigned sl = 0; sl < SL_COUNT; sl++)
            for (const blk_t *f = a->heads[fl][sl]; f; f = f->next)
                n++;
    return n;
}

/* Host memory held for bookkeeping (slabs, extents with their bitmaps, hash tables). */
size_t vmh_arena_host_bytes(const vmh_arena_t *a)
{
    size_t n = sizeof(*a) + a->nslabs * SLAB_BYTES;
    const vmh_extent_t *lists[2] = {a->busy, a->idle};
    for (int li = 0; li < 2; li++) {
        for (const vmh_extent_t *e = lists[li]; e; e = e->next) {
            n += sizeof(*e) + (e->nwords + (e->nwords + 63) / 64) * sizeof(uint64_t);
            if (e->tab_shift)
                n += ((size_t)1 << e->tab_shift) * sizeof(blk_t *);
        }
    }
    return n;
}
#endif
