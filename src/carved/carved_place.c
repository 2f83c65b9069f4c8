/* Layer "carved", placement: where a request's bytes come from. The thread's shard and its size
 * class (here, not in carved.c: every use of the choice is placement's, and carved.c stands
 * above this file), the shard's spans (address space), extents made in chunks, neighbouring
 * extents joined and an extent grown at its free end, a new extent published with the request
 * already served from it, a hole mapped again (a fill: the allocation's, unlike the tidy's punch,
 * carved_idle.c), and the fallback chain of vmh_carved_alloc that tries them in order. It stands
 * on carved_visit.c (an extent's pieces) alone; carved_idle.c calls span_give here when it gives
 * an extent back. */
#include "carved.h"
#include "carved_internal.h"

#include "list.h"
#include "registry.h"
#include "thread_state.h"
#include "witness.h"

#include <assert.h>
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>

#define EXTENT_MAX ((size_t)1 << 30)
#define EXTENT_SHARE 16
#define EXTENT_FIT 8
/* The free space a new shared extent may bring however few bytes are live: a program's first
 * small buffers share extents too (the first 128 of 2 MiB made an extent each below it). */
#define EXTENT_FLOOR ((size_t)32 << 20)
/* A shard's spans (span.h): the first reserves SPAN_MIN bytes of address space, each next one
 * as much as the shard's spans hold already, up to SPAN_MAX (address space is cheap; the
 * VMMHOOK_VA_LIMIT budget bounds it). */
#define SPAN_MIN ((size_t)16 << 30)
#define SPAN_MAX ((size_t)64 << 30)
/* The small class's first span: its extents hold blocks of at most VMH_SMALL_MAX bytes. */
#define SMALL_SPAN_MIN ((size_t)1 << 30)
/* An extent's backing: chunks of max(CHUNK_MIN, extent / CHUNK_SPLIT), so that a
 * stretch of whole free chunks inside it can go back (the tidy's holes) while a tag's pause
 * still releases few chunks (20480 x 2 MiB: 101 extents, tests/unit/test_geometry.c); extents
 * up to CHUNK_MIN are one chunk. */
#define CHUNK_MIN ((size_t)128 << 20)
#define CHUNK_SPLIT 3
/* An extent made for one large request (its own size, or what a grown extent's free end lacked)
 * holds few blocks, so its chunks may be smaller without many chunks per tag: max(OWN_CHUNK_MIN,
 * extent / OWN_CHUNK_SPLIT), one chunk under two of them. A program's large tensors are what
 * stays scattered after its load drops (tests/gpu/torch_varlen.py's trace, replayed with
 * trace_sim: 874 MiB still mapped for 193 live with the shared extents' chunks, 364 with these),
 * and each live block keeps its chunk. */
#define OWN_CHUNK_MIN ((size_t)32 << 20)
#define OWN_CHUNK_SPLIT 8

#ifdef VMH_TESTING
void (*vmh_carved_test_extent_published)(void);
#endif

/* ---- shard choice: the thread's shard and its size class ---- */

/* The calling thread's carved shard: picked at its first carved allocation, kept for the
 * thread's life, so that threads spread over the shards and a thread keeps its cache lines. */
static _Atomic unsigned shard_next;

unsigned vmh_carved_thread_shard(void)
{
    unsigned s = vmh_thread.shard_mine;
    if (!s) {
        s = atomic_fetch_add_explicit(&shard_next, 1, memory_order_relaxed) % VMH_CLASS_SHARDS + 1;
        vmh_thread.shard_mine = s;
    }
    return s - 1;
}

/* Whether shard s serves the small class (VMH_SMALL_MAX). */
static bool shard_small(const vmh_shard_t *s)
{
    return s - s->carved->shards >= VMH_CLASS_SHARDS;
}

/* The i-th shard of home's size class, counted from home (i = 0: home itself). */
static unsigned class_peer(unsigned home, unsigned i)
{
    unsigned base = home - home % VMH_CLASS_SHARDS;
    return base + (home % VMH_CLASS_SHARDS + i) % VMH_CLASS_SHARDS;
}

/* ---- spans and extents ---- */

/* Address space for an extent of `size` bytes from shard s's spans; a new span is reserved
 * (outside the shard's lock) when none has room. The driver's code with *no_address when the
 * VMMHOOK_VA_LIMIT budget or the driver refused the address space. */
static CUresult span_take(vmh_shard_t *s, size_t size, vmh_resv_t **resv, CUdeviceptr *at,
                          bool *no_address)
{
    vmh_lock(&s->lock, VMH_RANK_OWNER);
    bool got = vmh_spans_take(&s->spans, size, resv, at);
    size_t held = vmh_spans_bytes(&s->spans);
    vmh_unlock(&s->lock);
    if (got)
        return CUDA_SUCCESS;
    size_t least = shard_small(s) ? SMALL_SPAN_MIN : SPAN_MIN;
    size_t span = held < least ? least : held > SPAN_MAX ? SPAN_MAX : held;
    /* A span takes at most a quarter of what is left of the VMMHOOK_VA_LIMIT budget (own-chunk
     * buffers reserve from it too); else the extent gets a span of its own size. */
    if (span < size || vmh_dev_va_exhausted(4 * span) ||
        !vmh_round_up(span, s->carved->dev->gran, &span))
        span = size;
    vmh_resv_t *nr;
    CUresult rc =
        vmh_dev_va_exhausted(span) ? CUDA_ERROR_OUT_OF_MEMORY : vmh_resv_create(span, 0, 0, &nr);
    if (rc != CUDA_SUCCESS) {
        *no_address = true;
        return rc;
    }
    vmh_lock(&s->lock, VMH_RANK_OWNER);
    got = vmh_spans_add(&s->spans, nr);
    if (got)
        got = vmh_spans_take(&s->spans, size, resv, at); /* the new span has room */
    vmh_unlock(&s->lock);
    if (!got)
        vmh_resv_unref(nr);
    return got ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}

/* Gives an extent's address space back to shard s's spans (nothing is mapped there any
 * more), freeing a span this empties. */
void span_give(vmh_shard_t *s, CUdeviceptr at, size_t size)
{
    vmh_lock(&s->lock, VMH_RANK_OWNER);
    vmh_resv_t *emptied = vmh_spans_give(&s->spans, at, size);
    vmh_unlock(&s->lock);
    vmh_resv_unref(emptied); /* NULL is allowed */
}

/* The library's chunk size rule: CHUNK_MIN, and OWN_CHUNK_MIN for an extent made for one
 * request (own). */
static size_t extent_chunk_rule(size_t size, size_t gran, bool own)
{
    const size_t min = own ? OWN_CHUNK_MIN : CHUNK_MIN, split = own ? OWN_CHUNK_SPLIT : CHUNK_SPLIT;
    /* (an extent of less than two own chunks is one: a 40 MiB buffer gains nothing from a
     * chunk of 32 and one of 8, and a tag of them would pause with twice the calls) */
    if (size <= min || (own && size < 2 * min))
        return size;
    size_t chunk = size / split < min ? min : size / split;
    chunk -= chunk % gran;
    return chunk ? chunk : gran;
}

/* The chunk size of an extent of `size` bytes (a multiple of d's granularity): the rule's,
 * at most VMMHOOK_CHUNK_MAX. */
static size_t extent_chunk(const vmh_dev_t *d, size_t size, bool own)
{
    size_t chunk = extent_chunk_rule(size, d->gran, own);
    return d->chunk_max && chunk > d->chunk_max ? d->chunk_max : chunk;
}

/* A range of `size` bytes in chunks of extent_chunk, in shard s's spans. */
static CUresult extent_range_new(vmh_shard_t *s, size_t size, bool own, vmh_range_t **out,
                                 bool *no_address)
{
    vmh_resv_t *resv;
    CUdeviceptr at;
    *no_address = false;
    CUresult rc = span_take(s, size, &resv, &at, no_address);
    if (rc != CUDA_SUCCESS)
        return rc;
    vmh_dev_t *d = s->carved->dev;
    rc = vmh_dev_range_in(d, size, extent_chunk(d, size, own), resv, at, out);
    if (rc != CUDA_SUCCESS)
        span_give(s, at, size);
    return rc;
}

/* ---- joins: neighbouring extents made one ---- */

/* Whether e may be joined with a neighbour (s locked): it serves blocks (not retired), runs
 * (backed, no piece paused) and no piece keeps a retained backup (vmm_resume_flags' KEEP_BACKUP:
 * attached to its range, which a join replaces). */
static bool ext_joinable(const vmh_ext_t *e)
{
    /* (a fill mapping a hole of e holds e's record, which a join of e as the higher one would
     * recycle; a punch's unmapping holds no record, and a join leaves holes as they are) */
    if (!e->extent || !e->npieces || vmh_extent_retired(e->extent) || vmh_carved_paused_locked(e) ||
        e->filling)
        return false;
    for (size_t i = 0; i < e->npieces; i++)
        if (e->pieces[i].range->kept.host)
            return false;
    return e->nkept == 0;
}

/* The reservation e's addresses were carved from (its span's): every piece's mappings are in it. */
static const vmh_resv_t *ext_resv(const vmh_ext_t *e)
{
    return e->pieces[0].range->maps[0]->resv;
}

/* Whether hi starts where lo ends, in the same reservation (so one extent may hold both). */
static bool ext_adjacent(const vmh_ext_t *lo, const vmh_ext_t *hi)
{
    return lo->va + lo->va_size == hi->va && ext_resv(lo) == ext_resv(hi);
}

/* Makes hi part of lo (hi starts where lo ends; both joinable; s locked): one arena extent,
 * whose pieces are the stretches of lo's and hi's mappings (lo's last piece and hi's first one
 * become one: a block that the joined free space serves may cross their border, and a block's
 * backup and export are its piece's), hi's addresses registered to lo, hi's record spare. No
 * driver call: the mappings stay as they are. False without host memory (nothing changed). A
 * reader that found hi in the registry meanwhile waits for the lock and finds lo
 * (vmh_owner_lock). */
static bool ext_join_locked(vmh_shard_t *s, vmh_ext_t *lo, vmh_ext_t *hi)
{
    vmh_extent_t *fresh = vmh_arena_join_new(lo->extent, hi->extent);
    vmh_range_t *his = fresh ? ext_maps_with(hi, NULL) : NULL, *all = NULL;
    if (his) {
        his->base = hi->va; /* after lo's pieces, where ext_maps_with puts it */
        all = ext_maps_with(lo, his);
    }
    vmh_range_t **old = all ? malloc((lo->npieces + hi->npieces) * sizeof *old) : NULL;
    if (!old) {
        free(all);
        all = NULL;
    }
    size_t nold = 0;
    /* Readers of hi's addresses wait for this lock and look again (vmh_owner_lock): they find
     * lo once the join is done, hi again if it is undone. */
    bool registered = all && vmh_registry_set(hi->va, hi->va_size, lo);
    if (!registered || !ext_pieces_from(lo, all, old, &nold)) {
        if (registered)
            vmh_registry_set(hi->va, hi->va_size, hi); /* its entries exist: cannot fail */
        vmh_arena_join_drop(fresh);
        free(all);
        free(his);
        free(old);
        return false;
    }
    free(all);
    free(his);
    for (size_t i = 0; i < hi->npieces; i++)
        old[nold++] = hi->pieces[i].range;
    lo->extent = vmh_arena_join(s->arena, lo->extent, hi->extent, fresh);
    lo->va_size += hi->va_size;
    /* The later mark (marks grow): a trim waits for the last block freed at once in either. */
    if (hi->freed_mark > lo->freed_mark)
        lo->freed_mark = hi->freed_mark;
    VMH_HLIST_REMOVE(s->exts, hi);
    ext_pieces_set(hi, NULL);
    hi->extent = NULL;
    hi->freed_mark = 0;
    hi->next = s->spare;
    s->spare = hi;
    for (size_t i = 0; i < nold; i++)
        vmh_range_destroy(old[i]); /* references only: lo's new pieces hold the mappings */
    free(old);
    return true;
}

static int ext_by_address(const void *x, const void *y)
{
    const vmh_ext_t *a = *(vmh_ext_t *const *)x, *b = *(vmh_ext_t *const *)y;
    return a->va < b->va ? -1 : a->va > b->va;
}

/* ---- growth: a new extent that joins the free end of one before it ---- */

/* The extent of shard s whose free end an extent of the request's size would best grow (s
 * locked): joinable, with a free end and room in its span's address space right after it for
 * the new extent, the largest free end first. *grow: the new extent's size (`want`, or for a
 * request that gets an extent of its own, `need` less that free end); NULL: none. */
static vmh_ext_t *grow_pick_locked(vmh_shard_t *s, size_t need, size_t want, bool own, size_t *grow)
{
    vmh_ext_t *best = NULL;
    size_t best_tail = 0, gran = s->carved->dev->gran;
    for (vmh_ext_t *e = s->exts; e; e = e->next) {
        size_t head, tail;
        if (!ext_joinable(e))
            continue;
        vmh_extent_edges(e->extent, &head, &tail);
        if (tail <= best_tail || tail >= need)
            continue;
        size_t g = own ? need - tail : want;
        g = (g + gran - 1) / gran * gran;
        if (vmh_spans_free_at(&s->spans, e->va + e->va_size) >= g) {
            best = e;
            best_tail = tail;
            *grow = g;
        }
    }
    return best;
}

/* The extent of s that ends where r starts and whose free end with r holds `need` bytes (s
 * locked): what a grown extent joins; NULL when it went meanwhile (trimmed, joined, its end
 * served). */
static vmh_ext_t *grow_onto_locked(vmh_shard_t *s, const vmh_range_t *r, size_t need)
{
    for (vmh_ext_t *e = s->exts; e; e = e->next) {
        if (e->va + e->va_size != r->base || !ext_joinable(e))
            continue;
        size_t head, tail;
        vmh_extent_edges(e->extent, &head, &tail);
        return tail + r->size >= need && ext_resv(e) == r->maps[0]->resv ? e : NULL;
    }
    return NULL;
}

/* Adds a shared extent of range r to shard s and serves `size` from it in the same hold of the
 * shard's lock, joined first to `onto`'s extent when r grows one (r starts where it ends; see
 * grow_pick_locked). So a new extent is never seen empty: a trim on another thread (a pause's)
 * cannot take it between its publication and its use, and nothing of its range is read once the
 * lock is let go (the heap's unit test trim_never_takes_an_extent_being_served checks that a
 * pause's trim never destroys an extent its allocating thread still reads). OUT_OF_MEMORY with
 * r destroyed and its addresses given back when host memory runs out, or when the extent r was
 * to grow went meanwhile and r alone is too small (the caller makes an extent of its own). */
static CUresult extent_publish_serving(vmh_shard_t *s, vmh_range_t *r, bool onto, size_t size,
                                       CUdeviceptr *out)
{
    vmh_carved_t *pk = s->carved;
    const size_t mapped = r->size;
    vmh_lock(&s->lock, VMH_RANK_OWNER);
    vmh_ext_t *e = s->spare;
    if (e) {
        s->spare = e->next;
    } else if ((e = calloc(1, sizeof *e))) {
        e->o.kind = VMH_OWN_EXTENT;
        e->o.dev = pk->dev;
        e->o.lock = &s->lock;
        e->shard = s;
    }
    uintptr_t p = 0;
    /* A paused tag takes no memory (checked under the lock pause.c's visit takes). */
    if (e && !atomic_load(&pk->frozen)) {
        ext_pieces_set(e, r);
        e->va = r->base;
        e->va_size = r->size;
        e->extent = vmh_arena_add_extent(s->arena, r->base, r->size, e);
    }
    vmh_ext_t *lo = onto && e && e->extent ? grow_onto_locked(s, r, size) : NULL;
    bool published = e && e->extent && vmh_registry_set(r->base, r->size, e);
    if (published)
        VMH_HLIST_PUSH(s->exts, e);
    /* Joined, the record that served the request is lo's (e's is spare again). */
    if (published && lo && ext_join_locked(s, lo, e))
        e = lo;
    const bool joined = lo && e == lo;
    if (joined && vmh_arena_alloc(s->arena, size, &p) != 0) {
        /* Not expected (lo's free end and r hold size), but r is lo's now: its free space
         * stays, and the caller makes an extent of its own. */
        shard_note(s);
        vmh_unlock(&s->lock);
        idle_gauge((int64_t)mapped);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (!joined && (!published || vmh_arena_alloc(s->arena, size, &p) != 0)) {
        /* Nothing of it was served: the arena learnt of it above, under this lock, and forgets
         * it here (an extent that serves no block is empty). */
        if (e) {
            if (published) {
                VMH_HLIST_REMOVE(s->exts, e);
                vmh_registry_set(r->base, r->size, &vmh_owner_dead); /* until unmapped below */
            }
            if (e->extent) {
                uintptr_t base;
                size_t bytes;
                void *back = vmh_arena_take_empty_extent(s->arena, &base, &bytes);
                assert(back == e);
                (void)back;
            }
            ext_pieces_set(e, NULL);
            e->extent = NULL;
            e->prev = NULL;
            e->next = s->spare;
            s->spare = e;
        }
        vmh_unlock(&s->lock);
        CUdeviceptr base = r->base;
        vmh_range_destroy(r);
        if (published)
            vmh_registry_set(base, mapped, NULL);
        span_give(s, base, mapped);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    shard_note(s);
    vmh_unlock(&s->lock);
#ifdef VMH_TESTING
    if (vmh_carved_test_extent_published)
        vmh_carved_test_extent_published();
#endif
    idle_gauge((int64_t)mapped);
    *out = p;
    return CUDA_SUCCESS;
}

/* Adds a shared extent large enough for `size` to shard s and serves `size` from it
 * (extent_publish_serving). *out: the block. OUT_OF_MEMORY with nothing left behind when the
 * driver or host memory runs out. */
static CUresult extent_add_serving(vmh_carved_t *pk, vmh_shard_t *s, size_t size, bool *no_address,
                                   CUdeviceptr *out)
{
    vmh_dev_t *d = pk->dev;
    size_t want;
    if (!vmh_round_up(size, d->gran, &want))
        return CUDA_ERROR_OUT_OF_MEMORY;
    /* Small requests share extents whose size doubles with every new extent of the shard (up
     * to EXTENT_MAX), so that a program with many makes few chunks; the doubling stops at
     * 1/EXTENT_SHARE of the device's live bytes (or EXTENT_FLOOR), so that the free space a
     * new extent brings stays a small part of what the program uses (docs/DESIGN.md,
     * "Serving", gives the stored PyTorch trace's figures). A request larger than
     * 1/EXTENT_FIT of the shared extent gets an extent of its own size: a shared extent serves
     * many small requests well, but a few large ones leave its rest unused. Either way the
     * next extent may be twice as large: growth follows the number of extents, not only the
     * requests that fit (else a program asking only for 2 MiB makes one extent each). */
    size_t share = atomic_load_explicit(&d->live_usable, memory_order_relaxed) / EXTENT_SHARE;
    if (share < EXTENT_FLOOR)
        share = EXTENT_FLOOR;
    vmh_lock(&s->lock, VMH_RANK_OWNER);
    size_t next = s->extent_next < share ? s->extent_next : share;
    if (s->extent_next < EXTENT_MAX)
        s->extent_next *= 2;
    next -= next % d->gran;
    const size_t need = want;
    const bool own = want > next / EXTENT_FIT;
    if (!own)
        want = next;
    /* The new extent grows one whose end is free, where the span has room after it: joined,
     * their free space is one block, and a request of its own size needs only what that end
     * lacks (as an expandable segment grows by what its free end lacks). */
    size_t grow = 0;
    vmh_unlock(&s->lock);
    /* A request of its own size grows the largest free end of any shard of its size class: the
     * threads of one program (PyTorch's autograd thread beside its main one) allocate in shards
     * of their own, and two shards' free ends would otherwise each hold a part of what one
     * request needs (tools/probe/trace_sim replays each trace thread in its own shard). A
     * request of the shared extent size stays in the thread's shard. */
    vmh_shard_t *gs = s;
    size_t least = SIZE_MAX; /* the least new memory a growth found so far needs */
    for (unsigned i = 0; own && i < VMH_CLASS_SHARDS; i++) {
        vmh_shard_t *k = &pk->shards[class_peer((unsigned)(s - pk->shards), i)];
        if (!atomic_load_explicit(&k->extents, memory_order_relaxed))
            continue;
        size_t g = 0;
        vmh_lock(&k->lock, VMH_RANK_OWNER);
        if (grow_pick_locked(k, need, want, own, &g) && g < least) {
            least = g;
            gs = k;
        }
        vmh_unlock(&k->lock);
    }
    vmh_resv_t *resv = NULL;
    vmh_lock(&gs->lock, VMH_RANK_OWNER);
    vmh_ext_t *onto = grow_pick_locked(gs, need, want, own, &grow);
    CUdeviceptr at = onto ? onto->va + onto->va_size : 0;
    if (onto && !vmh_spans_take_at(&gs->spans, at, grow, &resv))
        onto = NULL;
    vmh_unlock(&gs->lock);

    vmh_range_t *r;
    CUresult rc;
    if (onto) {
        /* The driver's error is the answer (the caller relieves the device, spills or fails):
         * the whole extent below is no smaller. */
        rc = vmh_dev_range_in(d, grow, extent_chunk(d, grow, own), resv, at, &r);
        if (rc != CUDA_SUCCESS) {
            span_give(gs, at, grow);
            return rc;
        }
        if (extent_publish_serving(gs, r, true, size, out) == CUDA_SUCCESS)
            return CUDA_SUCCESS;
        /* Its neighbour went meanwhile (or host memory ran out): a whole extent. */
    }
    rc = extent_range_new(s, want, own, &r, no_address);
    /* A device too full for a shared extent may still hold the request: an extent of its own
     * size, before the caller relieves memory or spills to the host (the overflow reserve
     * keeps room for small requests, not for a grown extent). */
    if (rc == CUDA_ERROR_OUT_OF_MEMORY && want > need)
        rc = extent_range_new(s, need, true, &r, no_address);
    if (rc != CUDA_SUCCESS)
        return rc;
    return extent_publish_serving(s, r, false, size, out);
}

/* ---- the allocation's fallback chain: free space, joins, holes, a new extent ---- */

/* Serves size bytes from shard s: 0, ENOMEM when it has no room, EBUSY when `try` and another
 * thread holds the shard. One arena search, no registry lookup: the block's usable size is the
 * size rounded to VMH_ARENA_ALIGN (arena.h). */
static int shard_alloc(vmh_shard_t *s, size_t size, bool try, CUdeviceptr *out)
{
    if (try) {
        if (vmh_trylock(&s->lock, VMH_RANK_OWNER) != 0)
            return EBUSY;
    } else {
        vmh_lock(&s->lock, VMH_RANK_OWNER);
    }
    uintptr_t p;
    int rc = atomic_load(&s->carved->frozen) ? ENOMEM : vmh_arena_alloc(s->arena, size, &p);
    if (rc == 0) {
        *out = p;
        shard_note(s);
    }
    vmh_unlock(&s->lock);
    return rc == 0 ? 0 : ENOMEM;
}

/* Free space in the other shards of home's size class, before any memory is made. Shards whose free
 * bytes (the hint) are fewer than `want` are not tried. Busy ones are waited for only when
 * wait_busy: a thread whose own shard has no extent yet and meets contention elsewhere gives its
 * shard a first extent instead, which is what spreads threads over the shards (at most one chunk
 * per shard); beyond that, free space anywhere comes before growth. */
static bool others_alloc(vmh_carved_t *pk, unsigned home, size_t size, size_t want, bool wait_busy,
                         CUdeviceptr *out)
{
    unsigned busy = 0;
    for (unsigned i = 1; i < VMH_CLASS_SHARDS; i++) {
        unsigned k = class_peer(home, i);
        if (atomic_load_explicit(&pk->shards[k].free, memory_order_relaxed) < want)
            continue;
        int rc = shard_alloc(&pk->shards[k], size, true, out);
        if (rc == 0)
            return true;
        if (rc == EBUSY)
            busy |= 1u << k;
    }
    for (unsigned k = 0; wait_busy && busy && k < VMH_SHARDS; k++)
        if ((busy & (1u << k)) && shard_alloc(&pk->shards[k], size, false, out) == 0)
            return true;
    return false;
}

/* ---- holes: mapped again when an allocation needs them ---- */

/* The first hole of e with at least `want` bytes (in *base, *size). */
typedef struct hole_pick {
    size_t want;
    uintptr_t base;
    size_t size;
} hole_pick_t;

static void hole_seen(uintptr_t base, size_t size, void *arg)
{
    hole_pick_t *h = arg;
    if (!h->size && size >= h->want) {
        h->base = base;
        h->size = size;
    }
}

/* Whether e serves from memory mapped now: its set is not frozen, it runs, it is not retired
 * (s locked). */
static bool ext_serving(const vmh_shard_t *s, const vmh_ext_t *e)
{
    return !atomic_load(&s->carved->frozen) && e->npieces && !vmh_extent_retired(e->extent) &&
           !vmh_carved_paused_locked(e);
}

/* Maps a hole of shard s large enough for `want` bytes again and serves `size` from the space
 * it frees. NOT_FOUND when s has no such hole (or is frozen, or the extent was paused or
 * retired meanwhile); the driver's code when it has no memory (nothing changed: the caller
 * goes on as for a new extent, whose path relieves the device, spills or fails). The driver
 * calls (create, map, set access) run with the lock let go, the extent marked filling so that
 * nothing else maps, unmaps or gives back its addresses meanwhile; the space is then served in
 * the same hold of the lock that makes it free (no other thread takes it first). */
static CUresult hole_fill_serving(vmh_shard_t *s, size_t size, size_t want, CUdeviceptr *out)
{
    if (atomic_load_explicit(&s->holes, memory_order_relaxed) < want)
        return CUDA_ERROR_NOT_FOUND;
    vmh_lock(&s->lock, VMH_RANK_OWNER);
    vmh_ext_t *e = NULL;
    hole_pick_t h = {.want = want};
    for (vmh_ext_t *x = s->exts; x && !h.size; x = x->next)
        if (vmh_extent_holes(x->extent) >= want && ext_serving(s, x) && ext_settled(x) &&
            vmh_arena_holes(x->extent, hole_seen, &h))
            e = x;
    if (!h.size) {
        vmh_unlock(&s->lock);
        return CUDA_ERROR_NOT_FOUND;
    }
    /* The span's reservation: e's mappings hold it, and e stays while it is filling. */
    vmh_resv_t *resv = e->pieces[0].range->maps[0]->resv;
    e->filling++;
    vmh_unlock(&s->lock);

    vmh_range_t *r = NULL;
    vmh_dev_t *d = s->carved->dev;
    /* one chunk of the hole's size, or chunks of VMMHOOK_CHUNK_MAX */
    CUresult rc = vmh_dev_range_at(d, h.size, d->chunk_max, resv, h.base, &r);

    vmh_lock(&s->lock, VMH_RANK_OWNER);
    /* Paused, retired or frozen meanwhile: the hole stays one (NOT_FOUND). */
    if (rc == CUDA_SUCCESS && !ext_serving(s, e))
        rc = CUDA_ERROR_NOT_FOUND;
    vmh_range_t **old = NULL;
    size_t nold = 0;
    if (rc == CUDA_SUCCESS) {
        old = malloc(e->npieces * sizeof *old);
        vmh_range_t *all = ext_maps_with(e, r);
        if (!old || !all || !ext_pieces_from(e, all, old, &nold))
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        free(all);
    }
    uintptr_t p;
    if (rc == CUDA_SUCCESS) {
        int unholed = vmh_arena_unhole(s->arena, e->extent, h.base);
        assert(unholed == 0);
        (void)unholed;
        idle_gauge((int64_t)h.size);
        /* The space just mapped fits: the arena serves it, or another fit it finds first. */
        if (vmh_arena_alloc(s->arena, size, &p) != 0)
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        shard_note(s);
    }
    /* Mapped but not taken into the pieces: e stays filling until it is unmapped again, so
     * that no other fill maps the hole meanwhile. */
    const bool undo = r && nold == 0;
    if (!undo)
        e->filling--;
    vmh_unlock(&s->lock);
    for (size_t i = 0; i < nold; i++)
        vmh_range_destroy(old[i]); /* references only: the new pieces hold the mappings */
    free(old);
    /* Its references: the pieces hold the mapping now, or nothing does (then it is unmapped
     * and its chunk released). */
    vmh_range_destroy(r);
    if (undo) {
        vmh_lock(&s->lock, VMH_RANK_OWNER);
        e->filling--;
        vmh_unlock(&s->lock);
    }
    if (rc == CUDA_SUCCESS)
        *out = p;
    return rc;
}

/* Serves size bytes from a hole of any shard of home's size class, home first. */
static bool holes_alloc(vmh_carved_t *pk, unsigned home, size_t size, size_t want, CUdeviceptr *out)
{
    for (unsigned i = 0; i < VMH_CLASS_SHARDS; i++)
        if (hole_fill_serving(&pk->shards[class_peer(home, i)], size, want, out) == CUDA_SUCCESS)
            return true;
    return false;
}

/* ---- joins: free space that neighbouring extents hold only together ---- */

/* Serves size bytes (want rounded) from free space that neighbouring extents of shard s hold
 * only together: a free end of one, the free start of the next, whole free extents between,
 * joined into one extent (ext_join_locked), as an expandable segment holds its free space in
 * one piece (a program whose tensors grow a little each step frees extents that its next,
 * slightly larger, size never fits one by one). No driver call. */
static bool joins_alloc_shard(vmh_shard_t *s, size_t size, size_t want, CUdeviceptr *out)
{
    vmh_lock(&s->lock, VMH_RANK_OWNER);
    size_t n = 0;
    for (vmh_ext_t *e = s->exts; e; e = e->next)
        n++;
    vmh_ext_t **x = n > 1 && !atomic_load(&s->carved->frozen) ? malloc(n * sizeof *x) : NULL;
    n = 0;
    for (vmh_ext_t *e = x ? s->exts : NULL; e; e = e->next)
        if (ext_joinable(e))
            x[n++] = e;
    if (n > 1)
        qsort(x, n, sizeof *x, ext_by_address);
    bool served = false;
    for (size_t i = 0; x && !served && i + 1 < n;) {
        size_t head, tail;
        vmh_extent_edges(x[i]->extent, &head, &tail);
        size_t have = tail, k = i;
        /* The chain goes on past whole free extents: [tail][free extent]...[head]. */
        while (have < want && k + 1 < n && ext_adjacent(x[k], x[k + 1])) {
            vmh_extent_edges(x[++k]->extent, &head, &tail);
            have += head;
            if (head != x[k]->va_size)
                break;
        }
        if (!tail || have < want) {
            i = k > i ? k : i + 1; /* a chain that fell short: the next may start at its end */
            continue;
        }
        size_t joined = i;
        while (joined < k && ext_join_locked(s, x[i], x[joined + 1]))
            joined++;
        uintptr_t p;
        served = joined == k && vmh_arena_alloc(s->arena, size, &p) == 0;
        if (served)
            *out = p;
        if (joined > i)
            shard_note(s);
        break;
    }
    vmh_unlock(&s->lock);
    free(x);
    return served;
}

/* Serves size bytes by joining neighbouring extents of any shard of home's size class, home
 * first. */
static bool joins_alloc(vmh_carved_t *pk, unsigned home, size_t size, size_t want, CUdeviceptr *out)
{
    for (unsigned i = 0; i < VMH_CLASS_SHARDS; i++)
        if (joins_alloc_shard(&pk->shards[class_peer(home, i)], size, want, out))
            return true;
    return false;
}

CUresult vmh_carved_alloc(vmh_carved_t *pk, size_t size, CUdeviceptr *out, bool *no_address)
{
    size_t want;
    if (atomic_load(&pk->frozen) || !vmh_round_up(size, VMH_ARENA_ALIGN, &want) ||
        !vmh_dev_usable_take(pk->dev, want))
        return CUDA_ERROR_OUT_OF_MEMORY;
    unsigned home = vmh_carved_thread_shard() + (size <= VMH_SMALL_MAX ? VMH_CLASS_SHARDS : 0);
    /* The thread's own shard of the request's size class, then free space in the others of that
     * class, and only then a new extent (in the thread's own shard). Parked blocks are not waited
     * for here (reclaim.h: the reclaim thread releases them, a thread about to add an extent waits
     * past VMMHOOK_PARK_LIMIT, and a new extent the driver has no memory for relieves the device,
     * which waits). A new extent is made with this request served from it, so no other thread takes
     * its room first and no trim takes it empty. */
    vmh_shard_t *mine = &pk->shards[home];
    bool served = false;
    for (int attempt = 0; attempt < 2 && !served; attempt++) {
        served = (atomic_load_explicit(&mine->free, memory_order_relaxed) >= want &&
                  shard_alloc(mine, size, false, out) == 0) ||
                 others_alloc(pk, home, size, want,
                              atomic_load_explicit(&mine->extents, memory_order_relaxed) > 0, out);
        /* New memory is needed: past VMMHOOK_PARK_LIMIT the thread waits first, and what
         * that released may serve it (reclaim.h). */
        if (!served && (attempt > 0 || !vmh_reclaim_throttle(pk->reclaim)))
            break;
    }
    /* Space the tidy unmapped inside extents (holes) is mapped again before a new extent is
     * made: it costs a chunk too, and no new address space. */
    if (!served)
        served = joins_alloc(pk, home, size, want, out);
    if (!served)
        served = holes_alloc(pk, home, size, want, out);
    if (!served) {
        CUresult rc = extent_add_serving(pk, mine, size, no_address, out);
        if (rc != CUDA_SUCCESS) {
            vmh_dev_usable_give(pk->dev, want);
            return rc;
        }
    }
    idle_gauge(-(int64_t)want);
    return CUDA_SUCCESS;
}
