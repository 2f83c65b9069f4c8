/* Internal to layer "carved" (carved.c, carved_idle.c, carved_place.c, carved_visit.c): what its
 * files share beyond carved.h. Nothing else includes this.
 *
 * One module in four files, listed top down, each calling only the files below it (one order,
 * no circle):
 *   carved.c        init and destroy, a shard's reclaim item, a served block's free, lookup,
 *                   backup, resize and export, the live-block walk;
 *   carved_idle.c   idle memory given back: empty extents trimmed, holes punched, idle counts;
 *   carved_place.c  placement: the thread's shard, spans, extents made, joined and grown, holes
 *                   filled, the allocation's fallback chain (vmh_carved_alloc);
 *   carved_visit.c  an extent's backing (its pieces between holes, its kept backups) and the
 *                   heap's visit over it.
 * Names: a function one file defines and another calls keeps the short name it had as a static
 * one (ext_, kept_, maps_, span_, extents_, unlink_; no vmh_ prefix: vmh_carved_ names are
 * carved.h's API) and is declared here, grouped by the file that defines it, where its comment
 * says more. The two small helpers that the files above carved_visit.c all call, on the hot
 * paths of an allocation and a free too, are static inline here, so that they stay inlined. The
 * shipped library exports none of these names (hidden visibility, src/meson.build). */
#ifndef VMH_CARVED_INTERNAL_H
#define VMH_CARVED_INTERNAL_H

#include "carved.h"

#include "stats.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Free carved space and parked blocks are idle bytes (VMH_STAT_bytes_cached). */
static inline void idle_gauge(int64_t delta)
{
    vmh_gauge_add(VMH_STAT_bytes_cached, delta);
}

/* Refreshes the shard's hints after a change; the shard is locked. */
static inline void shard_note(vmh_shard_t *s)
{
    vmh_arena_stats_t st;
    vmh_arena_stats(s->arena, &st);
    atomic_store_explicit(&s->nparked, vmh_arena_parked(s->arena), memory_order_relaxed);
    atomic_store_explicit(&s->free, st.free, memory_order_relaxed);
    atomic_store_explicit(&s->extents, st.extents, memory_order_relaxed);
    atomic_store_explicit(&s->holes, st.holes, memory_order_relaxed);
}

/* Whether no driver call on e's addresses runs outside its shard's lock now (a hole fill's
 * mapping, a punch's unmapping): only then may e be trimmed (its addresses go back and may be
 * mapped again while still mapped), punched or filled (a hole would be mapped while still
 * mapped, or the reverse). A join needs only that no fill holds e's record (ext_joinable).
 * s locked. */
static inline bool ext_settled(const vmh_ext_t *e)
{
    return !e->filling && !e->shard->unmapping;
}

/* ---- carved_visit.c: an extent's pieces and kept backups ---- */

/* e's backing becomes the one range r (NULL: none). */
void ext_pieces_set(vmh_ext_t *e, vmh_range_t *r);
/* The piece of e's backing that p lies in; NULL in a hole. */
vmh_ext_piece_t *ext_piece_at(const vmh_ext_t *e, CUdeviceptr p);
/* An empty list of up to n mappings in address order, holding no references; free() it. */
vmh_range_t *maps_list(size_t n);
/* Rebuilds e's pieces from the mappings of `list` (no driver call); e's old ranges go into
 * old[*nold...] for the caller to destroy. False, nothing changed, without host memory. */
bool ext_pieces_from(vmh_ext_t *e, const vmh_range_t *list, vmh_range_t **old, size_t *nold);
/* A list of e's mappings and add's, in address order (maps_list's kind). */
vmh_range_t *ext_maps_with(const vmh_ext_t *e, const vmh_range_t *add);
/* The detached kept backup that answers for the buffer at base (*at: its index among the
 * backup's owners), or NULL. */
vmh_ext_kept_t *kept_of(const vmh_ext_t *e, CUdeviceptr base, size_t *at);
/* The buffer at base is freed: its own kept backup goes, never a neighbour's. */
void kept_forget_locked(vmh_ext_t *e, CUdeviceptr base);
/* Drops every detached kept backup of e. */
void kept_drop_all(vmh_ext_t *e);

/* ---- carved_place.c: spans ---- */

/* An extent's address space goes back to shard s's spans (nothing mapped there any more). */
void span_give(vmh_shard_t *s, CUdeviceptr at, size_t size);

/* ---- carved_idle.c: empty extents ---- */

/* Which empty extents unlink_empty_locked takes. */
typedef enum { EMPTY_ALL, EMPTY_RETIRED, EMPTY_PAUSED } empty_kind_t;
/* Takes shard s's empty extents of `kind` out of its arena, list and registry (s locked). */
vmh_ext_t *unlink_empty_locked(vmh_shard_t *s, empty_kind_t kind);
/* Unmaps the extents unlink_empty_locked took (s not locked); returns their bytes. */
size_t extents_destroy(vmh_shard_t *s, vmh_ext_t *list);

#endif
