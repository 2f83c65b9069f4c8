/* Layer "carved": buffers carved from shared extents (see carved.h). */
#include "carved.h"

#include "grow.h"
#include "list.h"
#include "registry.h"
#include "stats.h"
#include "thread_state.h"
#include "witness.h"

#include <assert.h>
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

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

/* Free carved space and parked blocks are idle bytes (VMH_STAT_bytes_cached). */
static void idle_gauge(int64_t delta)
{
    vmh_gauge_add(VMH_STAT_bytes_cached, delta);
}

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

/* Refreshes the shard's hints after a change; the shard is locked. */
static void shard_note(vmh_shard_t *s)
{
    vmh_arena_stats_t st;
    vmh_arena_stats(s->arena, &st);
    atomic_store_explicit(&s->nparked, vmh_arena_parked(s->arena), memory_order_relaxed);
    atomic_store_explicit(&s->free, st.free, memory_order_relaxed);
    atomic_store_explicit(&s->extents, st.extents, memory_order_relaxed);
    atomic_store_explicit(&s->holes, st.holes, memory_order_relaxed);
}

/* ---- an extent's pieces (between its holes; carved.h) ---- */

static CUdeviceptr piece_base(const vmh_ext_piece_t *pc)
{
    return pc->range ? pc->range->base : pc->paused->base;
}

static size_t piece_size(const vmh_ext_piece_t *pc)
{
    return pc->range ? pc->range->size : pc->paused->size;
}

/* e's backing becomes the one range r (NULL: none); the pieces' ranges are the caller's. */
static void ext_pieces_set(vmh_ext_t *e, vmh_range_t *r)
{
    if (e->pieces != &e->one)
        free(e->pieces);
    e->pieces = &e->one;
    e->pieces_cap = 1;
    e->one = (vmh_ext_piece_t){r, NULL};
    e->npieces = r != NULL;
}

/* The piece holding address p, or NULL (p in a hole). */
static vmh_ext_piece_t *ext_piece_at(const vmh_ext_t *e, CUdeviceptr p)
{
    for (size_t i = 0; i < e->npieces; i++)
        if (p - piece_base(&e->pieces[i]) < piece_size(&e->pieces[i]))
            return &e->pieces[i];
    return NULL;
}

/* ---- kept backups, each buffer's own (carved.h's vmh_ext_kept_t) ---- */

static void kept_owner_seen(const vmh_block_info_t *b, void *arg)
{
    vmh_ext_kept_t *k = arg;
    if (k->failed || b->base < k->base || b->base + b->size > k->base + k->size)
        return;
    CUdeviceptr *grown = vmh_grow(k->owners, &k->owners_cap, k->nowners, sizeof *grown, 8);
    if (!grown) {
        k->failed = true;
        return;
    }
    k->owners = grown;
    k->owners[k->nowners++] = b->base;
}

/* The backup kept on range r (a piece of e about to go, or whose buffer is being freed) moves
 * to e's list, answering for the live buffers wholly inside r: they keep reading it, each until
 * its own free. Without host memory for the move the backup goes (as before this list). */
static void kept_detach_locked(vmh_ext_t *e, vmh_range_t *r)
{
    if (!r || !r->kept.host)
        return;
    vmh_ext_kept_t k = {.base = r->base, .size = r->size, .backup = r->kept};
    r->kept = (vmh_backup_t){0};
    vmh_extent_for_each_live(e->extent, kept_owner_seen, &k);
    vmh_ext_kept_t *grown =
        !k.failed && k.nowners ? vmh_grow(e->kept, &e->kept_cap, e->nkept, sizeof *grown, 4) : NULL;
    if (!grown) {
        free(k.owners);
        vmh_backup_release(&k.backup);
        return;
    }
    e->kept = grown;
    e->kept[e->nkept++] = k;
}

static void kept_drop_at(vmh_ext_t *e, size_t i)
{
    free(e->kept[i].owners);
    vmh_backup_release(&e->kept[i].backup);
    e->kept[i] = e->kept[--e->nkept];
}

/* Every detached kept backup of e goes (a pause makes new ones; the extent goes). */
static void kept_drop_all(vmh_ext_t *e)
{
    while (e->nkept)
        kept_drop_at(e, e->nkept - 1);
}

/* Before a pause: a kept backup covering exactly one of e's running pieces goes back on its
 * range, so that the pause writes the fresh bytes into the same host memory (pause.c's
 * kept_take); the others go (the pause makes new ones). */
static void kept_reattach_locked(vmh_ext_t *e)
{
    for (size_t i = 0; i < e->npieces; i++) {
        vmh_range_t *r = e->pieces[i].range;
        for (size_t k = 0; r && !r->kept.host && k < e->nkept; k++)
            if (e->kept[k].base == r->base && e->kept[k].size == r->size) {
                r->kept = e->kept[k].backup;
                e->kept[k].backup = (vmh_backup_t){0};
                kept_drop_at(e, k);
            }
    }
    kept_drop_all(e);
}

/* The detached kept backup answering for the buffer at base, or NULL. */
static vmh_ext_kept_t *kept_of(const vmh_ext_t *e, CUdeviceptr base, size_t *at)
{
    for (size_t i = 0; i < e->nkept; i++)
        for (size_t j = 0; j < e->kept[i].nowners; j++)
            if (e->kept[i].owners[j] == base) {
                *at = j;
                return &e->kept[i];
            }
    return NULL;
}

/* The buffer at base is freed: its own kept backup goes (the host memory once no other buffer
 * of it is left), never a neighbour's. */
static void kept_forget_locked(vmh_ext_t *e, CUdeviceptr base)
{
    vmh_ext_piece_t *pc = ext_piece_at(e, base);
    if (pc && pc->range)
        kept_detach_locked(e, pc->range);
    size_t j;
    vmh_ext_kept_t *k = kept_of(e, base, &j);
    if (!k)
        return;
    k->owners[j] = k->owners[--k->nowners];
    if (!k->nowners)
        kept_drop_at(e, (size_t)(k - e->kept));
}

/* A list of mappings in address order, with no references of its own (a range's layout, so
 * that vmh_range_pick can take stretches of it); free() it. */
static vmh_range_t *maps_list(size_t n)
{
    return calloc(1, sizeof(vmh_range_t) + (n ? n : 1) * sizeof(vmh_map_t *));
}

/* e's pieces become one range per stretch of adjacent mappings of `list` (every one of them
 * held by e's pieces or by a range the caller holds): each new range takes its own
 * references; the old pieces' ranges go into old[*nold...] (room for e->npieces) for the caller
 * to destroy, which unmaps the mappings that `list` left out. No driver call. False without
 * host memory (nothing changed). The shard is locked. */
static bool ext_pieces_from(vmh_ext_t *e, const vmh_range_t *list, vmh_range_t **old, size_t *nold)
{
    size_t stretches = 0;
    for (size_t i = 0; i < list->nmaps; i++)
        stretches += !i || list->maps[i - 1]->ptr + list->maps[i - 1]->size != list->maps[i]->ptr;
    vmh_ext_piece_t *np = stretches ? malloc(stretches * sizeof *np) : NULL;
    size_t made = 0;
    bool ok = np != NULL;
    for (size_t i = 0; ok && i < list->nmaps;) {
        size_t j = i + 1;
        CUdeviceptr end = list->maps[i]->ptr + list->maps[i]->size;
        while (j < list->nmaps && list->maps[j]->ptr == end)
            end += list->maps[j++]->size;
        ok = vmh_range_pick(&list, 1, list->maps[i]->ptr, end - list->maps[i]->ptr,
                            &np[made].range) == CUDA_SUCCESS;
        if (ok)
            np[made++].paused = NULL;
        i = j;
    }
    if (!ok) {
        while (made)
            vmh_range_destroy(np[--made].range); /* references only: the old ones hold them */
        free(np);
        return false;
    }
    for (size_t i = 0; i < e->npieces; i++) {
        kept_detach_locked(e, e->pieces[i].range); /* its buffers keep reading it */
        old[(*nold)++] = e->pieces[i].range;
    }
    ext_pieces_set(e, NULL);
    if (made == 1) {
        e->one = np[0];
        free(np);
    } else {
        e->pieces = np;
        e->pieces_cap = made;
    }
    e->npieces = made;
    return true;
}

/* Every mapping of e's pieces and of `add` (NULL: none), in address order. */
static vmh_range_t *ext_maps_with(const vmh_ext_t *e, const vmh_range_t *add)
{
    size_t n = add ? add->nmaps : 0;
    for (size_t i = 0; i < e->npieces; i++)
        n += e->pieces[i].range->nmaps;
    vmh_range_t *l = maps_list(n);
    for (size_t i = 0; l && i <= e->npieces; i++) {
        const vmh_range_t *r = i < e->npieces ? e->pieces[i].range : NULL;
        if (add && (!r || add->base < r->base)) {
            memcpy(&l->maps[l->nmaps], add->maps, add->nmaps * sizeof add->maps[0]);
            l->nmaps += add->nmaps;
            add = NULL;
        }
        if (r) {
            memcpy(&l->maps[l->nmaps], r->maps, r->nmaps * sizeof r->maps[0]);
            l->nmaps += r->nmaps;
        }
    }
    return l;
}

bool vmh_carved_paused_locked(const vmh_ext_t *e)
{
    for (size_t i = 0; i < e->npieces; i++)
        if (e->pieces[i].paused)
            return true;
    return false;
}

/* Which empty extents unlink_empty_locked takes. */
typedef enum { EMPTY_ALL, EMPTY_RETIRED, EMPTY_PAUSED } empty_kind_t;
static vmh_ext_t *unlink_empty_locked(vmh_shard_t *s, empty_kind_t kind);
static size_t extents_destroy(vmh_shard_t *s, vmh_ext_t *list);

/* Bytes of the shard's parked blocks (what it counts in reclaim's parked bytes); locked. */
static size_t parked_bytes_locked(const vmh_shard_t *s)
{
    vmh_arena_stats_t st;
    vmh_arena_stats(s->arena, &st);
    return st.parked;
}

/* The shard's reclaim item: the GPU has passed `passed`; its blocks parked up to there become
 * free. Blocks parked later keep the item queued for the next wait. Retired extents (a freed
 * exported block's) that this empties go at once: nothing of them is served again. */
static size_t shard_release(vmh_parked_t *item, uint64_t passed)
{
    vmh_shard_t *s = (vmh_shard_t *)((char *)item - offsetof(vmh_shard_t, parked_item));
    assert(&s->parked_item == item && s->carved);
    vmh_lock(&s->lock, VMH_RANK_OWNER);
    size_t before = parked_bytes_locked(s);
    vmh_arena_unpark_upto(s->arena, passed);
    vmh_ext_t *retired = unlink_empty_locked(s, EMPTY_RETIRED);
    shard_note(s);
    size_t released = before - parked_bytes_locked(s);
    bool left = vmh_arena_parked(s->arena) != 0;
    vmh_unlock(&s->lock);
    if (retired)
        extents_destroy(s, retired);
    if (left && passed != UINT64_MAX)
        vmh_reclaim_park(s->carved->reclaim, item, passed + 1, 0); /* their bytes count already */
    return released;
}

CUresult vmh_carved_init(vmh_carved_t *pk, vmh_dev_t *dev, vmh_reclaim_t *reclaim)
{
    memset(pk, 0, sizeof *pk);
    pk->dev = dev;
    pk->reclaim = reclaim;
    for (int i = 0; i < VMH_SHARDS; i++) {
        vmh_shard_t *s = &pk->shards[i];
        pthread_mutex_init(&s->lock, NULL);
        s->carved = pk;
        s->parked_item.release = shard_release;
        s->extent_next = dev->gran;
        s->arena = vmh_arena_new();
        if (!s->arena)
            return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

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
static void span_give(vmh_shard_t *s, CUdeviceptr at, size_t size)
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
    if (!e->extent || !e->npieces || vmh_extent_retired(e->extent) || vmh_carved_paused_locked(e))
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

/* Maps a hole of shard s large enough for `want` bytes again and serves `size` from the space
 * it frees (the same hold of the lock, as a new extent is served: no other thread takes it
 * first). NOT_FOUND when s has no such hole (or is frozen); the driver's code when it has no
 * memory (nothing changed: the caller goes on as for a new extent, whose path relieves the
 * device, spills or fails). Driver calls (create, map, set access) under the shard's lock at
 * OWNER_VISIT: rare (only after the tidy unmapped idle space), and no trim or other fill can
 * meet the hole half-mapped. */
static CUresult hole_fill_serving(vmh_shard_t *s, size_t size, size_t want, CUdeviceptr *out)
{
    if (atomic_load_explicit(&s->holes, memory_order_relaxed) < want)
        return CUDA_ERROR_NOT_FOUND;
    vmh_lock(&s->lock, VMH_RANK_OWNER_VISIT);
    vmh_ext_t *e = NULL;
    hole_pick_t h = {.want = want};
    for (vmh_ext_t *x = s->exts; x && !atomic_load(&s->carved->frozen) && !h.size; x = x->next)
        if (vmh_extent_holes(x->extent) >= want && !vmh_extent_retired(x->extent) && x->npieces &&
            !vmh_carved_paused_locked(x) && vmh_arena_holes(x->extent, hole_seen, &h))
            e = x;
    CUresult rc = h.size ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
    vmh_range_t *r = NULL;
    const vmh_dev_t *d = s->carved->dev;
    if (rc == CUDA_SUCCESS) /* one chunk of the hole's size, or chunks of VMMHOOK_CHUNK_MAX */
        rc = vmh_dev_range_at(s->carved->dev, h.size, d->chunk_max,
                              e->pieces[0].range->maps[0]->resv, h.base, &r);
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
    vmh_unlock(&s->lock);
    for (size_t i = 0; i < nold; i++)
        vmh_range_destroy(old[i]); /* references only: the new pieces hold the mappings */
    free(old);
    /* Its references: the pieces hold the mapping now, or nothing does (then it is unmapped
     * and its chunk released). */
    vmh_range_destroy(r);
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

bool vmh_carved_has_parked(vmh_carved_t *pk)
{
    for (int i = 0; i < VMH_SHARDS; i++)
        if (atomic_load_explicit(&pk->shards[i].nparked, memory_order_relaxed))
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

/* Carved buffers of a shard that were exported: a small unsorted set (exports are rare);
 * the shard is locked. NULL when p is not listed. */
static vmh_carved_export_t *exported_find_locked(vmh_shard_t *s, CUdeviceptr p)
{
    for (size_t i = 0; i < s->nexported; i++)
        if (s->exported[i].base == p)
            return &s->exported[i];
    return NULL;
}

/* s's arena parked `bytes` more at generation gen: its item in reclaim covers them. An item
 * already queued is released by a wait that also covers them, or parks itself again for them
 * (shard_release runs under this shard's lock). */
static void shard_parked_locked(vmh_shard_t *s, uint64_t gen, size_t bytes)
{
    vmh_reclaim_t *r = s->carved->reclaim;
    if (!atomic_load(&s->parked_item.queued))
        vmh_reclaim_park(r, &s->parked_item, gen, bytes);
    else
        vmh_reclaim_add_bytes(r, bytes);
}

/* Space of e that work queued before now may still touch became free at once (the program's
 * work runs in one queue): e stays mapped until a wait has passed it (ext_passed). */
static void ext_freed_at_once_locked(vmh_ext_t *e)
{
    vmh_reclaim_t *r = e->shard->carved->reclaim;
    e->freed_mark = vmh_reclaim_mark(r);
    vmh_reclaim_freed_at_once(r);
}

CUresult vmh_carved_park_locked(vmh_ext_t *e, CUdeviceptr p, bool at_once, size_t *req)
{
    vmh_shard_t *s = e->shard;
    vmh_assert_held(&s->lock);
    vmh_carved_t *pk = s->carved;
    uint64_t gen = vmh_reclaim_now(pk->reclaim);
    vmh_block_info_t info;
    /* The freed buffer's kept backup goes, its neighbours' stay (no driver call). */
    kept_forget_locked(e, p);
    /* An exported block's export dies here, and its memory is never served again: another
     * process may still map the extent's chunk (an import holds the whole chunk), as natively
     * memory freed by its exporter stays the importer's. The extent serves nothing more and
     * goes once its other blocks are freed and the GPU is past them (shard_release). */
    vmh_carved_export_t *x = exported_find_locked(s, p);
    if (at_once && !x) {
        if (vmh_arena_release(s->arena, e->extent, p, &info) != 0)
            return CUDA_ERROR_INVALID_VALUE;
        ext_freed_at_once_locked(e);
    } else {
        size_t parked_before = parked_bytes_locked(s);
        if (vmh_arena_park(s->arena, e->extent, p, gen, &info) != 0)
            return CUDA_ERROR_INVALID_VALUE;
        if (x) {
            *x = s->exported[--s->nexported];
            vmh_arena_retire_extent(s->arena, e->extent);
            /* Its free space is stranded until its other blocks go: the next extents start
             * small again, so that a program exporting small buffers strands little. */
            s->extent_next = pk->dev->gran;
        }
        shard_parked_locked(s, gen, parked_bytes_locked(s) - parked_before);
    }
    shard_note(s);
    vmh_dev_usable_give(pk->dev, info.usable);
    idle_gauge((int64_t)info.usable);
    *req = info.size;
    return CUDA_SUCCESS;
}

bool vmh_carved_find_locked(vmh_ext_t *e, CUdeviceptr p, vmh_buffer_info_t *info)
{
    vmh_block_info_t bi;
    if (!vmh_arena_find(e->extent, p, &bi) || p >= bi.base + bi.size)
        return false;
    *info = (vmh_buffer_info_t){bi.base, bi.size, bi.usable, e->o.dev->ordinal, true};
    return true;
}

const void *vmh_carved_backup_locked(vmh_ext_t *e, CUdeviceptr p, size_t n)
{
    vmh_block_info_t bi;
    const vmh_ext_piece_t *pc = ext_piece_at(e, p);
    if (!pc || (!pc->paused && !pc->range))
        return NULL;
    CUdeviceptr base = pc->paused ? pc->paused->base : pc->range->base;
    size_t size = pc->paused ? pc->paused->size : pc->range->size;
    const char *host = pc->paused ? pc->paused->host : pc->range->kept.host;
    if (!vmh_arena_find(e->extent, p, &bi) || p < bi.base || n > bi.base + bi.size - p)
        return NULL;
    size_t j;
    const vmh_ext_kept_t *k = host ? NULL : kept_of(e, bi.base, &j);
    if (k) {
        host = k->backup.host;
        base = k->base;
        size = k->size;
    }
    if (!host || p < base || p + n > base + size)
        return NULL;
    return host + (p - base);
}

CUresult vmh_carved_resize_locked(vmh_ext_t *e, CUdeviceptr p, size_t size, bool at_once,
                                  size_t *old_size)
{
    vmh_shard_t *s = e->shard;
    vmh_dev_t *d = e->o.dev;
    vmh_block_info_t info;
    if (!vmh_arena_find(e->extent, p, &info) || info.base != p)
        return CUDA_ERROR_NOT_FOUND;
    *old_size = info.size;
    if (vmh_carved_paused_locked(e))
        return CUDA_ERROR_NOT_PERMITTED; /* untouched until its tag is resumed */
    /* The growth's usable bytes are taken first (VMMHOOK_MEM_LIMIT). */
    size_t want = (size + VMH_ARENA_ALIGN - 1) & ~(size_t)(VMH_ARENA_ALIGN - 1);
    size_t extra = want > info.usable ? want - info.usable : 0;
    if (extra && !vmh_dev_usable_take(d, extra))
        return CUDA_ERROR_OUT_OF_MEMORY;
    /* A shrink's tail follows the free rule (vmh_carved_park_locked): free at once only while
     * the work runs in one queue, parked until the GPU has passed it otherwise, kept by an
     * exported block (an importer may map it). */
    vmh_arena_tail_t tail = exported_find_locked(s, p) ? VMH_TAIL_KEEP
                            : at_once                  ? VMH_TAIL_FREE
                                                       : VMH_TAIL_PARK;
    uint64_t gen = vmh_reclaim_now(s->carved->reclaim);
    size_t parked_before = parked_bytes_locked(s);
    if (vmh_arena_resize(s->arena, e->extent, p, size, tail, gen) != 0) {
        if (extra)
            vmh_dev_usable_give(d, extra);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    size_t parked = parked_bytes_locked(s) - parked_before;
    if (parked)
        shard_parked_locked(s, gen, parked);
    else if (tail == VMH_TAIL_FREE && want < info.usable)
        ext_freed_at_once_locked(e);
    vmh_block_info_t now;
    vmh_arena_find(e->extent, p, &now);
    shard_note(s);
    /* now.usable - info.usable in all, of which extra is taken already */
    vmh_dev_usable_adjust(d, (int64_t)now.usable - (int64_t)info.usable - (int64_t)extra);
    idle_gauge((int64_t)info.usable - (int64_t)now.usable);
    return CUDA_SUCCESS;
}

CUresult vmh_carved_export_locked(vmh_ext_t *e, CUdeviceptr p, vmh_export_t *out,
                                  const vmh_range_t **range)
{
    vmh_shard_t *s = e->shard;
    vmh_block_info_t bi;
    if (!vmh_arena_find(e->extent, p, &bi))
        return CUDA_ERROR_INVALID_VALUE;
    if (vmh_carved_paused_locked(e))
        return CUDA_ERROR_NOT_PERMITTED;
    /* The piece of backing the block lies in (a live block never lies in a hole, and pieces
     * are joined when a hole is mapped again: one piece holds it but when host memory for the
     * join ran out, then the export is refused). While exported its extent gets no hole. */
    const vmh_ext_piece_t *pc = ext_piece_at(e, bi.base);
    if (!pc || !pc->range || bi.base + bi.usable - pc->range->base > pc->range->size)
        return CUDA_ERROR_NOT_PERMITTED;
    vmh_carved_export_t *x = exported_find_locked(s, bi.base); /* exported twice: listed once */
    if (!x) {
        vmh_carved_export_t *grown =
            vmh_grow(s->exported, &s->exported_cap, s->nexported, sizeof *grown, 16);
        if (!grown)
            return CUDA_ERROR_OUT_OF_MEMORY;
        s->exported = grown;
        x = &s->exported[s->nexported++];
        *x = (vmh_carved_export_t){bi.base, vmh_export_serial_new()};
    }
    out->serial = x->serial;
    out->base = bi.base;
    out->size = bi.size;
    out->offset = bi.base - pc->range->base;
    *range = pc->range;
    return CUDA_SUCCESS;
}

bool vmh_carved_export_alive_locked(vmh_ext_t *e, CUdeviceptr base, uint64_t serial)
{
    const vmh_carved_export_t *x = exported_find_locked(e->shard, base);
    return x && x->serial == serial;
}

static bool ext_holds_memory(const void *owner);
static bool ext_paused(const void *owner)
{
    return !ext_holds_memory(owner);
}

/* Whether an empty extent may be unmapped now: every block freed at once in it was freed
 * before a wait that has completed (a free may land between a trim's wait and its unmapping). */
static bool ext_passed(const void *owner)
{
    const vmh_ext_t *e = owner;
    return vmh_reclaim_passed(e->shard->carved->reclaim, e->freed_mark);
}

static bool ext_retired_passed(const void *owner)
{
    return vmh_extent_retired(((const vmh_ext_t *)owner)->extent) && ext_passed(owner);
}

/* Takes shard s's empty extents of a kind out of its arena, list and the registry, until they
 * hold at least *budget bytes (then lowered by theirs; NULL: all); returns them linked by next.
 * s is locked. */
static vmh_ext_t *unlink_empty_upto_locked(vmh_shard_t *s, empty_kind_t kind, size_t *budget)
{
    vmh_ext_t *empty = NULL, *e;
    uintptr_t base;
    size_t size;
    while ((!budget || *budget > 0) &&
           (e = vmh_arena_take_empty_extent_where(s->arena,
                                                  kind == EMPTY_RETIRED  ? ext_retired_passed
                                                  : kind == EMPTY_PAUSED ? ext_paused
                                                                         : ext_passed,
                                                  &base, &size))) {
        /* Dead, not unknown, until extents_destroy has unmapped it: a query meanwhile must not
         * reach the driver, which would answer for the still-mapped chunks (device.h). */
        vmh_registry_set(base, size, &vmh_owner_dead);
        if (budget)
            *budget -= size < *budget ? size : *budget;
        VMH_HLIST_REMOVE(s->exts, e);
        e->next = empty;
        empty = e;
    }
    return empty;
}

static vmh_ext_t *unlink_empty_locked(vmh_shard_t *s, empty_kind_t kind)
{
    return unlink_empty_upto_locked(s, kind, NULL);
}

/* Gives back the memory of extents unlinked from s (s not locked: driver calls) and keeps
 * their records as spares; returns the bytes. */
static size_t extents_destroy(vmh_shard_t *s, vmh_ext_t *list)
{
    size_t bytes = 0, n = 0, k = 0;
    vmh_ext_t *last = NULL;
    for (vmh_ext_t *e = list; e; e = e->next)
        n += e->npieces;
    /* The ranges go together: adjacent extents of one reservation are unmapped with one call
     * (range.h's vmh_ranges_destroy); without memory for the list, one by one. */
    vmh_range_t **ranges = calloc(n ? n : 1, sizeof *ranges);
    for (vmh_ext_t *e = list; e; e = e->next) {
        for (size_t i = 0; i < e->npieces; i++) {
            vmh_range_t *r = e->pieces[i].range;
            if (r) {
                bytes += r->size;
                idle_gauge(-(int64_t)r->size);
            }
            if (ranges)
                ranges[k++] = r;
            else
                vmh_range_destroy(r);
        }
    }
    /* Unmapped before their address space goes back to the spans: another thread may take
     * it and map there at once. */
    vmh_ranges_destroy(ranges, k);
    free(ranges);
    for (vmh_ext_t *e = list; e; e = e->next) {
        for (size_t i = 0; i < e->npieces; i++)
            vmh_paused_destroy(e->pieces[i].paused); /* emptied while paused: its addresses go */
        vmh_registry_set(e->va, e->va_size, NULL);   /* unmapped now: unknown, as natively */
        span_give(s, e->va, e->va_size);
        ext_pieces_set(e, NULL);
        kept_drop_all(e);
        e->extent = NULL;
        e->freed_mark = 0; /* the record serves a new extent next */
        last = e;
    }
    /* A registry reader may still hold one of these records: keep them (type-stable). */
    vmh_lock(&s->lock, VMH_RANK_OWNER);
    last->next = s->spare;
    s->spare = list;
    vmh_unlock(&s->lock);
    return bytes;
}

/* Gives back the shards' empty extents of a kind, until at least *budget bytes (NULL: all);
 * returns the bytes that were mapped. */
static size_t trim_kind(vmh_carved_t *pk, empty_kind_t kind, size_t *budget)
{
    size_t bytes = 0;
    for (int i = 0; i < VMH_SHARDS && (!budget || *budget > 0); i++) {
        vmh_shard_t *s = &pk->shards[i];
        vmh_lock(&s->lock, VMH_RANK_OWNER);
        vmh_ext_t *empty = unlink_empty_upto_locked(s, kind, budget);
        shard_note(s);
        vmh_unlock(&s->lock);
        if (empty)
            bytes += extents_destroy(s, empty);
    }
    return bytes;
}

size_t vmh_carved_trim(vmh_carved_t *pk)
{
    return trim_kind(pk, EMPTY_ALL, NULL);
}

size_t vmh_carved_trim_upto(vmh_carved_t *pk, size_t bytes)
{
    return trim_kind(pk, EMPTY_ALL, &bytes);
}

void vmh_carved_trim_paused(vmh_carved_t *pk)
{
    trim_kind(pk, EMPTY_PAUSED, NULL);
}

/* ---- holes: idle chunks inside extents unmapped (the tidy's) ---- */

/* The free runs of an extent, granule-aligned (vmh_arena_free_runs), in address order. */
typedef struct free_runs {
    struct free_run {
        uintptr_t base;
        size_t size;
    } * run;
    size_t n, cap;
    bool failed; /* out of host memory: the extent is left alone */
} free_runs_t;

static void free_run_seen(uintptr_t base, size_t size, void *arg)
{
    free_runs_t *f = arg;
    struct free_run *grown = f->failed ? NULL : vmh_grow(f->run, &f->cap, f->n, sizeof *grown, 16);
    if (!grown) {
        f->failed = true;
        return;
    }
    f->run = grown;
    f->run[f->n++] = (struct free_run){base, size};
}

/* Whether e's free chunks may become holes, once the GPU has passed what was freed in it at
 * once (s locked; see ext_punchable). */
static bool ext_may_hole(const vmh_shard_t *s, const vmh_ext_t *e)
{
    if (!e->extent || !e->npieces || !vmh_extent_busy(e->extent) || vmh_extent_retired(e->extent) ||
        vmh_carved_paused_locked(e))
        return false;
    for (size_t x = 0; x < s->nexported; x++)
        if (s->exported[x].base - vmh_extent_base(e->extent) < vmh_extent_size(e->extent))
            return false;
    return true;
}

/* Whether shard s may make holes in e now (s locked): it holds a live or parked block (empty
 * extents are the trim's, and so e keeps a piece), serves blocks (not retired), is shared with
 * no process (no live export in it), runs (no piece paused), and every block freed at once in
 * it was freed before the last completed wait (else the GPU may still touch it). */
static bool ext_punchable(const vmh_shard_t *s, const vmh_ext_t *e)
{
    return ext_may_hole(s, e) && ext_passed(e);
}

/* Whether mapping m (of an extent whose free runs are `runs`, the mappings visited in address
 * order, *r the run reached) lies wholly in free space and nothing but its piece holds it or
 * its chunk (an export being made keeps it): a hole could take it. */
static bool map_idle(const free_runs_t *runs, size_t *r, const vmh_map_t *m)
{
    while (*r < runs->n && runs->run[*r].base + runs->run[*r].size <= m->ptr)
        ++*r;
    bool in_run = *r < runs->n && runs->run[*r].base <= m->ptr &&
                  m->ptr + m->size <= runs->run[*r].base + runs->run[*r].size;
    return in_run && atomic_load(&m->refs) == 1 && atomic_load(&m->alloc->refs) == 1;
}

/* Makes holes of e's mappings that lie wholly in its free runs and that it alone holds (one
 * chunk each: extents are made of chunks, extent_chunk), until at least *budget bytes (then
 * lowered); the pieces' old ranges go into *old (grown as needed) for the caller to destroy,
 * which unmaps and releases what the new pieces left out. Returns the bytes. s locked. */
static size_t ext_punch_locked(vmh_shard_t *s, vmh_ext_t *e, size_t *budget, free_runs_t *runs,
                               vmh_range_t ***old, size_t *nold, size_t *oldcap)
{
    runs->n = 0;
    if (!vmh_arena_free_runs(e->extent, s->carved->dev->gran, false, free_run_seen, runs) ||
        runs->failed)
        return 0;

    if (*nold + e->npieces > *oldcap) {
        size_t cap = (*nold + e->npieces) * 2;
        vmh_range_t **grown = realloc(*old, cap * sizeof *grown);
        if (!grown)
            return 0;
        *old = grown;
        *oldcap = cap;
    }
    vmh_range_t *all = ext_maps_with(e, NULL), *kept = all ? maps_list(all->nmaps) : NULL;
    uintptr_t *holes = all ? malloc(all->nmaps * sizeof *holes) : NULL;
    size_t punched = 0, nholes = 0;
    for (size_t i = 0, r = 0; holes && kept && i < all->nmaps; i++) {
        vmh_map_t *m = all->maps[i];
        if (map_idle(runs, &r, m) && punched < *budget &&
            vmh_arena_hole(s->arena, e->extent, m->ptr, m->size) == 0) {
            holes[nholes++] = m->ptr;
            punched += m->size;
        } else {
            kept->maps[kept->nmaps++] = m;
        }
    }
    /* The kept mappings become the pieces; without host memory for them the holes are undone
     * (free space again: nothing was unmapped). */
    if (punched && !ext_pieces_from(e, kept, *old, nold)) {
        while (nholes)
            vmh_arena_unhole(s->arena, e->extent, holes[--nholes]);
        punched = 0;
    }
    free(all);
    free(kept);
    free(holes);
    *budget -= punched < *budget ? punched : *budget;
    return punched;
}

size_t vmh_carved_punch_upto(vmh_carved_t *pk, size_t bytes)
{
    size_t punched = 0;
    free_runs_t runs = {0};
    for (int i = 0; i < VMH_SHARDS && bytes > 0; i++) {
        vmh_shard_t *s = &pk->shards[i];
        if (atomic_load_explicit(&s->free, memory_order_relaxed) < pk->dev->gran)
            continue;
        vmh_range_t **old = NULL;
        size_t nold = 0, cap = 0, here = 0;
        /* At OWNER_VISIT: the unmapping below is done under the lock, so that no trim gives the
         * addresses away and no fill maps them before they are unmapped. */
        vmh_lock(&s->lock, VMH_RANK_OWNER_VISIT);
        for (vmh_ext_t *e = s->exts; e && bytes > 0 && !atomic_load(&pk->frozen); e = e->next)
            if (ext_punchable(s, e))
                here += ext_punch_locked(s, e, &bytes, &runs, &old, &nold, &cap);
        if (here) {
            shard_note(s);
            idle_gauge(-(int64_t)here);
        }
        vmh_ranges_destroy(old, nold); /* one cuMemUnmap per stretch, one release per chunk */
        vmh_unlock(&s->lock);
        free(old);
        punched += here;
    }
    free(runs.run);
    return punched;
}

size_t vmh_carved_hole_bytes(vmh_carved_t *pk)
{
    size_t bytes = 0;
    free_runs_t runs = {0};
    for (int i = 0; i < VMH_SHARDS && !atomic_load(&pk->frozen); i++) {
        vmh_shard_t *s = &pk->shards[i];
        if (atomic_load_explicit(&s->free, memory_order_relaxed) < pk->dev->gran)
            continue;
        vmh_lock(&s->lock, VMH_RANK_OWNER);
        for (vmh_ext_t *e = s->exts; e; e = e->next) {
            runs.n = 0;
            runs.failed = false;
            if (!vmh_extent_has_live(e->extent) || !ext_may_hole(s, e) ||
                !vmh_arena_free_runs(e->extent, pk->dev->gran, true, free_run_seen, &runs) ||
                runs.failed)
                continue;
            size_t r = 0;
            for (size_t k = 0; k < e->npieces; k++)
                for (size_t m = 0; m < e->pieces[k].range->nmaps; m++)
                    if (map_idle(&runs, &r, e->pieces[k].range->maps[m]))
                        bytes += e->pieces[k].range->maps[m]->size;
        }
        vmh_unlock(&s->lock);
    }
    free(runs.run);
    return bytes;
}

size_t vmh_carved_free_hint(vmh_carved_t *pk)
{
    size_t bytes = 0;
    for (int i = 0; i < VMH_SHARDS && !atomic_load(&pk->frozen); i++)
        bytes += atomic_load_explicit(&pk->shards[i].free, memory_order_relaxed);
    return bytes;
}

CUresult vmh_carved_visit(vmh_carved_t *pk, vmh_visit_run_fn fn, void *arg)
{
    CUresult rc = CUDA_SUCCESS;
    for (int i = 0; i < VMH_SHARDS && rc == CUDA_SUCCESS; i++) {
        vmh_shard_t *s = &pk->shards[i];
        vmh_lock(&s->lock, VMH_RANK_OWNER_VISIT);
        size_t n = 0;
        for (vmh_ext_t *e = s->exts; e; e = e->next)
            n += e->npieces;
        /* The shard's extents' pieces as records, for runs of adjacent ones (one reservation
         * can hold many of a shard's extents: carved.h). */
        vmh_visit_rec_t *recs = n ? malloc(n * sizeof *recs) : NULL;
        if (n && !recs)
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        size_t k = 0;
        /* A pause (the tag is frozen) makes new backups: a kept one that still covers exactly a
         * piece goes back on its range for the pause to write into (kept_take, the same host
         * memory); the others go. */
        for (vmh_ext_t *e = atomic_load(&pk->frozen) ? s->exts : NULL; e; e = e->next)
            kept_reattach_locked(e);
        for (vmh_ext_t *e = s->exts; e && recs; e = e->next) {
            /* A retired extent holds a freed exported block: another process may map it. */
            bool exported = vmh_extent_retired(e->extent);
            for (size_t x = 0; x < s->nexported && !exported; x++)
                exported =
                    s->exported[x].base - vmh_extent_base(e->extent) < vmh_extent_size(e->extent);
            for (size_t j = 0; j < e->npieces; j++)
                recs[k++] = (vmh_visit_rec_t){&e->pieces[j].range, &e->pieces[j].paused, exported};
        }
        if (recs)
            rc = vmh_visit_runs(recs, n, fn, arg);
        /* A resume that kept its backups put them on the pieces' ranges: they move to the
         * extent's list at once, answering for the buffers live now (none can be served before
         * the lock goes), not for one carved later where a buffer freed while paused was. */
        for (vmh_ext_t *e = s->exts; e; e = e->next)
            for (size_t j = 0; j < e->npieces; j++) {
                assert(!e->pieces[j].range != !e->pieces[j].paused);
                kept_detach_locked(e, e->pieces[j].range);
            }
        free(recs);
        vmh_unlock(&s->lock);
    }
    return rc;
}

/* Whether an extent (its owner record, read under its shard's lock) has memory mapped: a paused
 * one (pause.c) has given its memory back already. */
static bool ext_holds_memory(const void *owner)
{
    const vmh_ext_t *e = owner;
    for (size_t i = 0; i < e->npieces; i++)
        if (e->pieces[i].range)
            return true;
    return false;
}

size_t vmh_carved_idle_bytes(vmh_carved_t *pk)
{
    size_t idle = 0;
    for (int i = 0; i < VMH_SHARDS; i++) {
        vmh_lock(&pk->shards[i].lock, VMH_RANK_OWNER);
        idle += vmh_arena_unused_extent_bytes(pk->shards[i].arena, ext_holds_memory);
        vmh_unlock(&pk->shards[i].lock);
    }
    return idle;
}

void vmh_carved_for_each_live(vmh_carved_t *pk, void (*cb)(const vmh_block_info_t *b, void *arg),
                              void *arg)
{
    for (int k = 0; k < VMH_SHARDS; k++) {
        vmh_lock(&pk->shards[k].lock, VMH_RANK_OWNER);
        vmh_arena_for_each_live(pk->shards[k].arena, cb, arg);
        vmh_unlock(&pk->shards[k].lock);
    }
}

void vmh_carved_destroy(vmh_carved_t *pk)
{
    for (int k = 0; k < VMH_SHARDS; k++) {
        vmh_shard_t *s = &pk->shards[k];
        for (vmh_ext_t *e = s->exts, *next; e; e = next) {
            next = e->next;
            vmh_registry_set(vmh_extent_base(e->extent), vmh_extent_size(e->extent), NULL);
            for (size_t i = 0; i < e->npieces; i++) {
                vmh_range_destroy(e->pieces[i].range);
                vmh_paused_destroy(e->pieces[i].paused);
            }
            ext_pieces_set(e, NULL);
            kept_drop_all(e);
            free(e->kept);
            span_give(s, e->va, e->va_size);
            free(e);
        }
        for (vmh_ext_t *e = s->spare, *next; e; e = next) {
            next = e->next;
            ext_pieces_set(e, NULL);
            free(e->kept);
            free(e);
        }
        vmh_spans_destroy(&s->spans);
        if (s->arena)
            vmh_arena_delete(s->arena, NULL, NULL);
        pthread_mutex_destroy(&s->lock);
        free(s->exported);
    }
}
