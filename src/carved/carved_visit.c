/* Layer "carved", an extent's backing: its pieces (the ranges between its holes, carved.h's
 * vmh_ext_piece_t) rebuilt when a hole is made, filled or two extents are joined, the backups
 * kept after a resume (vmh_ext_kept_t) that must follow their buffers across those rebuilds, and
 * the heap's visit (pause, resume, backups) over the pieces, which reattaches and detaches the
 * kept backups around it. The bottom of the module: it calls no other carved file, and the
 * others build on these helpers (declared in carved_internal.h). */
#include "carved.h"
#include "carved_internal.h"

#include "grow.h"
#include "witness.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

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
void ext_pieces_set(vmh_ext_t *e, vmh_range_t *r)
{
    if (e->pieces != &e->one)
        free(e->pieces);
    e->pieces = &e->one;
    e->pieces_cap = 1;
    e->one = (vmh_ext_piece_t){r, NULL};
    e->npieces = r != NULL;
}

/* The piece holding address p, or NULL (p in a hole). */
vmh_ext_piece_t *ext_piece_at(const vmh_ext_t *e, CUdeviceptr p)
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
void kept_drop_all(vmh_ext_t *e)
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
vmh_ext_kept_t *kept_of(const vmh_ext_t *e, CUdeviceptr base, size_t *at)
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
void kept_forget_locked(vmh_ext_t *e, CUdeviceptr base)
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
vmh_range_t *maps_list(size_t n)
{
    return calloc(1, sizeof(vmh_range_t) + (n ? n : 1) * sizeof(vmh_map_t *));
}

/* e's pieces become one range per stretch of adjacent mappings of `list` (every one of them
 * held by e's pieces or by a range the caller holds): each new range takes its own
 * references; the old pieces' ranges go into old[*nold...] (room for e->npieces) for the caller
 * to destroy, which unmaps the mappings that `list` left out. No driver call. False without
 * host memory (nothing changed). The shard is locked. */
bool ext_pieces_from(vmh_ext_t *e, const vmh_range_t *list, vmh_range_t **old, size_t *nold)
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
vmh_range_t *ext_maps_with(const vmh_ext_t *e, const vmh_range_t *add)
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

/* ---- the heap's visit ---- */

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
