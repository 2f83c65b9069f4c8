/* Layer "carved": buffers carved from shared extents (see carved.h), its entry and exit: the
 * shards made and destroyed, each shard's reclaim item (its parked blocks released), and what
 * happens to one block once served: its free (parked or free at once), lookup, backup, resize in
 * place and export. The module's other files (carved_internal.h) stand below this one: placement
 * (carved_place.c), idle memory given back (carved_idle.c) and an extent's backing with the
 * heap's visit (carved_visit.c); a release that empties a retired extent calls down into
 * carved_idle.c, never the other way. */
#include "carved.h"
#include "carved_internal.h"

#include "grow.h"
#include "registry.h"
#include "witness.h"

#include <assert.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

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

bool vmh_carved_has_parked(vmh_carved_t *pk)
{
    for (int i = 0; i < VMH_SHARDS; i++)
        if (atomic_load_explicit(&pk->shards[i].nparked, memory_order_relaxed))
            return true;
    return false;
}

/* ---- a served block: free, lookup, backup, resize, export ---- */

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
