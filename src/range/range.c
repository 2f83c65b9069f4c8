/* Layer "ranges" (see range.h). A range never changes after it is built; every operation
 * builds a new one from references to the mappings it keeps plus mappings it creates, so a
 * failure only has to drop what it created: destroying the partial new range does exactly that. */
#include "range.h"

#include "clock.h"
#include "driver.h"
#include "log.h"
#include "witness.h"

#include <assert.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static vmh_range_t *range_alloc(size_t nmaps)
{
    if (nmaps > (SIZE_MAX - sizeof(vmh_range_t)) / sizeof(vmh_map_t *))
        return NULL;
    return calloc(1, sizeof(vmh_range_t) + nmaps * sizeof(vmh_map_t *));
}

void vmh_backup_release(vmh_backup_t *b)
{
    if (b->host && b->release)
        b->release(b->host, b->size);
    *b = (vmh_backup_t){0};
}

void vmh_range_destroy(vmh_range_t *r)
{
    if (!r)
        return;
    vmh_backup_release(&r->kept);
    vmh_maps_unref_run(r->maps, r->nmaps); /* one unmap per stretch in one reservation */
    free(r);
}

void vmh_range_destroy_then(vmh_range_t *r,
                            void (*unmapped)(CUdeviceptr base, size_t size, void *arg), void *arg)
{
    if (!r)
        return;
    const CUdeviceptr base = r->base;
    const size_t size = r->size;
    vmh_resv_t **held = malloc((r->nmaps ? r->nmaps : 1) * sizeof *held);
    size_t n = 0;
    if (!held) {
        unmapped(base, size, arg);
        vmh_range_destroy(r);
        return;
    }
    for (size_t i = 0; i < r->nmaps; i++) /* a range's mappings share few reservations */
        if (!n || held[n - 1] != r->maps[i]->resv)
            held[n++] = vmh_resv_ref(r->maps[i]->resv);
    vmh_range_destroy(r);
    unmapped(base, size, arg);
    while (n)
        vmh_resv_unref(held[--n]);
    free(held);
}

static int map_order(const void *a, const void *b)
{
    CUdeviceptr x = (*(vmh_map_t *const *)a)->ptr, y = (*(vmh_map_t *const *)b)->ptr;
    return (x > y) - (x < y);
}

void vmh_ranges_destroy(vmh_range_t *const *rs, size_t n)
{
    size_t total = 0;
    for (size_t i = 0; i < n; i++)
        total += rs[i] ? rs[i]->nmaps : 0;
    vmh_map_t **all = total > 1 ? malloc(total * sizeof *all) : NULL;
    if (!all) { /* one range or none, or no memory for the list: range by range */
        for (size_t i = 0; i < n; i++)
            vmh_range_destroy(rs[i]);
        return;
    }
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t j = 0; rs[i] && j < rs[i]->nmaps; j++)
            if (rs[i]->maps[j])
                all[k++] = rs[i]->maps[j];
    qsort(all, k, sizeof *all, map_order); /* the ranges may come in any order */
    vmh_maps_unref_run(all, k);
    free(all);
    for (size_t i = 0; i < n; i++) {
        if (rs[i])
            vmh_backup_release(&rs[i]->kept);
        free(rs[i]);
    }
}

void vmh_ranges_drop_shared(vmh_range_t *const *rs, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        vmh_range_t *r = rs[i];
        size_t k = 0;
        for (size_t j = 0; r && j < r->nmaps; j++) {
            vmh_map_t *m = r->maps[j];
            if (m && atomic_load(&m->refs) == 1)
                r->maps[k++] = m;
            else if (m)
                vmh_map_unref(m); /* another holder keeps it mapped: no driver call */
        }
        if (r) {
            r->nmaps = k;
            r->size = 0;
            for (size_t j = 0; j < k; j++)
                r->size += r->maps[j]->size;
        }
    }
}

size_t vmh_range_headroom(const vmh_range_t *r)
{
    if (!r || !r->nmaps)
        return 0;
    const vmh_resv_t *last = r->maps[r->nmaps - 1]->resv;
    return (size_t)(last->ptr + last->size - (r->base + r->size));
}

static CUresult sum_sizes(vmh_alloc_t *const *allocs, size_t n, size_t *total)
{
    size_t t = 0;
    for (size_t i = 0; i < n; i++) {
        if (!allocs[i] || allocs[i]->size > SIZE_MAX - t)
            return CUDA_ERROR_INVALID_VALUE;
        t += allocs[i]->size;
    }
    *total = t;
    return CUDA_SUCCESS;
}

/* Appends mappings of allocs[0..n) at at, at + size0, ... inside resv to r (which has room).
 * On failure r keeps what was appended; the caller destroys r. */
static CUresult map_all(vmh_range_t *r, vmh_alloc_t *const *allocs, size_t n, CUdeviceptr at,
                        vmh_resv_t *resv)
{
    if (n == 0)
        return CUDA_SUCCESS;
    CUresult rc = vmh_maps_create_run(at, allocs, n, resv, &r->maps[r->nmaps]);
    if (rc == CUDA_SUCCESS)
        r->nmaps += n;
    return rc;
}

#ifdef VMH_WITNESS
/* What range.h promises of every range it returns: ascending and contiguous from base, each
 * mapping inside its reservation, size the sum of the mappings'. */
static bool range_well_formed(const vmh_range_t *r)
{
    CUdeviceptr at = r->base;
    for (size_t i = 0; i < r->nmaps; i++) {
        const vmh_map_t *m = r->maps[i];
        if (m->ptr != at || m->ptr < m->resv->ptr || m->ptr - m->resv->ptr > m->resv->size ||
            m->size > m->resv->size - (m->ptr - m->resv->ptr))
            return false;
        at += m->size;
    }
    return r->nmaps > 0 && at - r->base == r->size;
}
#endif

/* The end of a build: r (mapped, rc CUDA_SUCCESS) gets its size and becomes *out; on failure
 * r is destroyed, dropping what it mapped. */
static CUresult build_finish(vmh_range_t *r, CUresult rc, size_t total, vmh_range_t **out)
{
    if (rc != CUDA_SUCCESS) {
        vmh_range_destroy(r);
        return rc;
    }
    r->size = total;
    vmh_assert_internal(range_well_formed(r));
    *out = r;
    return CUDA_SUCCESS;
}

/* Maps the allocations of old (if any) then allocs[0..n) from the start of a new reservation
 * of max(reserve, total) bytes; *no_address (may be NULL): the reservation failed. */
static CUresult build_at_new_address(const vmh_range_t *old, vmh_alloc_t *const *allocs, size_t n,
                                     size_t total, size_t reserve, size_t align, CUdeviceptr hint,
                                     vmh_range_t **out, bool *no_address)
{
    if (no_address)
        *no_address = false;
    size_t nold = old ? old->nmaps : 0;
    vmh_range_t *r = range_alloc(nold + n);
    if (!r)
        return CUDA_ERROR_OUT_OF_MEMORY;
    vmh_resv_t *resv;
    CUresult rc = vmh_resv_create(reserve > total ? reserve : total, align, hint, &resv);
    if (rc != CUDA_SUCCESS) {
        if (no_address)
            *no_address = true;
        free(r);
        return rc;
    }
    r->base = resv->ptr;
    CUdeviceptr at = resv->ptr;
    for (size_t i = 0; i < nold && rc == CUDA_SUCCESS; i++) {
        /* The same physical chunk at a new address: no copy; it keeps its own access. */
        vmh_alloc_t *a = old->maps[i]->alloc;
        rc = map_all(r, &a, 1, at, resv);
        at += a->size;
    }
    if (rc == CUDA_SUCCESS)
        rc = map_all(r, allocs, n, at, resv);
    /* From here the mappings hold the reservation; drop the creation reference. */
    vmh_resv_unref(resv);
    return build_finish(r, rc, total, out);
}

CUresult vmh_range_create(vmh_alloc_t *const *allocs, size_t n, size_t reserve, size_t align,
                          CUdeviceptr hint, vmh_range_t **out, bool *no_address)
{
    size_t total;
    if (no_address)
        *no_address = false;
    if (!out || !allocs || n == 0 || sum_sizes(allocs, n, &total) != CUDA_SUCCESS)
        return CUDA_ERROR_INVALID_VALUE;
    return build_at_new_address(NULL, allocs, n, total, reserve, align, hint, out, no_address);
}

CUresult vmh_range_create_in(vmh_alloc_t *const *allocs, size_t n, vmh_resv_t *resv, CUdeviceptr at,
                             vmh_range_t **out)
{
    size_t total;
    if (!out || !allocs || n == 0 || !resv || sum_sizes(allocs, n, &total) != CUDA_SUCCESS ||
        at < resv->ptr || at - resv->ptr > resv->size || total > resv->size - (at - resv->ptr))
        return CUDA_ERROR_INVALID_VALUE;
    vmh_range_t *r = range_alloc(n);
    if (!r)
        return CUDA_ERROR_OUT_OF_MEMORY;
    r->base = at;
    return build_finish(r, map_all(r, allocs, n, at, resv), total, out);
}

CUresult vmh_range_move(const vmh_range_t *r, size_t reserve, size_t align, CUdeviceptr hint,
                        vmh_range_t **out)
{
    if (!r || !out || !r->nmaps)
        return CUDA_ERROR_INVALID_VALUE;
    return build_at_new_address(r, NULL, 0, r->size, reserve, align, hint, out, NULL);
}

/* A new range holding references to r's mappings, with room for n more. */
static vmh_range_t *copy_prefix(const vmh_range_t *r, size_t keep_maps, size_t n)
{
    vmh_range_t *c = range_alloc(keep_maps + n);
    if (!c)
        return NULL;
    c->base = r->base;
    for (size_t i = 0; i < keep_maps; i++) {
        c->maps[i] = vmh_map_ref(r->maps[i]);
        c->size += r->maps[i]->size;
    }
    c->nmaps = keep_maps;
    return c;
}

/* Maps allocs[0..n) at r's end inside resv, into a copy of r. */
static CUresult extend_into(const vmh_range_t *r, vmh_alloc_t *const *allocs, size_t n, size_t add,
                            vmh_resv_t *resv, vmh_range_t **out)
{
    vmh_range_t *c = copy_prefix(r, r->nmaps, n);
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = map_all(c, allocs, n, r->base + r->size, resv);
    if (rc != CUDA_SUCCESS) {
        vmh_range_destroy(c);
        return rc;
    }
    c->size += add;
    vmh_assert_internal(range_well_formed(c));
    *out = c;
    return CUDA_SUCCESS;
}

CUresult vmh_range_grow(const vmh_range_t *r, vmh_alloc_t *const *allocs, size_t n, size_t reserve,
                        size_t align, bool allow_move, vmh_range_t **out, vmh_grow_kind_t *kind,
                        bool *no_address)
{
    size_t add;
    if (no_address)
        *no_address = false;
    if (!r || !out || !kind || !allocs || n == 0 || !r->nmaps ||
        sum_sizes(allocs, n, &add) != CUDA_SUCCESS || add > SIZE_MAX - r->size)
        return CUDA_ERROR_INVALID_VALUE;
    size_t total = r->size + add;

    /* 1. Headroom: the last reservation extends past the end. */
    if (vmh_range_headroom(r) >= add) {
        *kind = VMH_GROW_HEADROOM;
        return extend_into(r, allocs, n, add, r->maps[r->nmaps - 1]->resv, out);
    }

    /* 2. An adjacent reservation, kept only at exactly the hinted address; it takes the
     * headroom asked for too. The hint is a probe: the driver may refuse or place it
     * elsewhere (docs/DESIGN.md, "Growth", says when it did), and any failure falls through to
     * the move. */
    CUdeviceptr end = r->base + r->size;
    size_t want = reserve > total ? reserve - r->size : add;
    vmh_resv_t *adj = NULL;
    if (vmh_resv_create(want, 0, end, &adj) == CUDA_SUCCESS) {
        if (adj->ptr == end) {
            CUresult rc = extend_into(r, allocs, n, add, adj, out);
            vmh_resv_unref(adj);
            if (rc == CUDA_SUCCESS)
                *kind = VMH_GROW_ADJACENT;
            return rc;
        }
        vmh_resv_unref(adj);
    }

    /* 3. Move: the same chunks at a new address, then the new ones. */
    if (!allow_move)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = build_at_new_address(r, allocs, n, total, reserve, align, 0, out, no_address);
    if (rc == CUDA_SUCCESS)
        *kind = VMH_GROW_MOVED;
    return rc;
}

CUresult vmh_range_pick(const vmh_range_t *const *rs, size_t n, CUdeviceptr from, size_t bytes,
                        vmh_range_t **out)
{
    if (!out || !bytes || from + bytes < from)
        return CUDA_ERROR_INVALID_VALUE;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        for (size_t j = 0; rs[i] && j < rs[i]->nmaps; j++)
            k += rs[i]->maps[j]->ptr - from < bytes;
    vmh_range_t *c = k ? range_alloc(k) : NULL;
    if (!c)
        return k ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_INVALID_VALUE;
    c->base = from;
    bool ok = true;
    for (size_t i = 0; i < n; i++) {
        for (size_t j = 0; rs[i] && j < rs[i]->nmaps; j++) {
            vmh_map_t *m = rs[i]->maps[j];
            if (m->ptr - from >= bytes)
                continue;
            ok = ok && m->ptr == from + c->size && m->size <= bytes - c->size;
            c->maps[c->nmaps++] = vmh_map_ref(m);
            c->size += m->size;
        }
    }
    if (!ok || c->size != bytes) {
        vmh_range_destroy(c); /* drops only the references taken here */
        return CUDA_ERROR_INVALID_VALUE;
    }
    vmh_assert_internal(range_well_formed(c));
    *out = c;
    return CUDA_SUCCESS;
}

CUresult vmh_range_shrink(const vmh_range_t *r, size_t keep, vmh_range_t **out)
{
    if (!r || !out || keep == 0 || keep > r->size)
        return CUDA_ERROR_INVALID_VALUE;
    size_t k = 0, covered = 0;
    while (covered < keep)
        covered += r->maps[k++]->size;
    vmh_range_t *c = copy_prefix(r, k, 0);
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    vmh_assert_internal(range_well_formed(c));
    *out = c;
    return CUDA_SUCCESS;
}

/* ---- pause and resume ---- */

/* Whether mapping m can join segment s: the next bytes of the same reservation, with memory on
 * the same device and the same access, so that one chunk can stand for both. */
static bool joins(const vmh_paused_seg_t *s, const vmh_map_t *m)
{
    const vmh_alloc_t *a = m->alloc;
    return s->resv == m->resv && s->ptr + s->size == m->ptr && s->device == a->device &&
           s->grants == a->grants && s->naccess == a->naccess &&
           memcmp(s->access, a->access, (size_t)a->naccess * sizeof a->access[0]) == 0;
}

static void seg_start(vmh_paused_seg_t *s, const vmh_map_t *m)
{
    s->ptr = m->ptr;
    s->size = m->size;
    s->resv = vmh_resv_ref(m->resv);
    s->device = m->alloc->device;
    s->grants = m->alloc->grants;
    s->naccess = m->alloc->naccess;
    memcpy(s->access, m->alloc->access, sizeof s->access);
}

void vmh_paused_destroy(vmh_paused_t *p)
{
    if (!p)
        return;
    vmh_range_destroy(p->resumed);
    if (p->host && p->host_release)
        p->host_release(p->host, p->size);
    while (p->nsegs)
        vmh_resv_unref(p->segs[--p->nsegs].resv);
    free(p);
}

bool vmh_range_owned_alone(const vmh_range_t *r)
{
    for (size_t i = 0; i < r->nmaps; i++) {
        const vmh_map_t *m = r->maps[i];
        /* Another holder of the mapping would keep it mapped, another holder of the chunk
         * (an export, a range left by a move) would keep the memory alive: pausing would give
         * nothing back and the resumed range would no longer share memory with that holder. */
        if (atomic_load(&m->refs) != 1 || atomic_load(&m->alloc->refs) != 1)
            return false;
    }
    return true;
}

/* The description of r (no driver call); r stays as it is. */
static CUresult describe(const vmh_range_t *r, size_t seg_max, vmh_paused_t **out)
{
    /* At most one segment per mapping; usually far fewer. */
    if (r->nmaps > (SIZE_MAX - sizeof(vmh_paused_t)) / sizeof(vmh_paused_seg_t))
        return CUDA_ERROR_OUT_OF_MEMORY;
    vmh_paused_t *p = calloc(1, sizeof *p + r->nmaps * sizeof p->segs[0]);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    p->base = r->base;
    p->size = r->size;
    for (size_t i = 0; i < r->nmaps; i++) {
        const vmh_map_t *m = r->maps[i];
        if (p->nsegs && joins(&p->segs[p->nsegs - 1], m) &&
            (!seg_max || p->segs[p->nsegs - 1].size + m->size <= seg_max))
            p->segs[p->nsegs - 1].size += m->size;
        else
            seg_start(&p->segs[p->nsegs++], m);
    }
    *out = p;
    return CUDA_SUCCESS;
}

CUresult vmh_range_pause_run(vmh_range_t *const *rs, size_t n, size_t seg_max, vmh_paused_t **out)
{
    if (!rs || !out || n == 0)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < n; i++) {
        if (!rs[i] || !rs[i]->nmaps)
            return CUDA_ERROR_INVALID_VALUE;
        if (!vmh_range_owned_alone(rs[i]))
            return CUDA_ERROR_NOT_PERMITTED;
    }
    for (size_t i = 0; i < n; i++) {
        CUresult rc = describe(rs[i], seg_max, &out[i]);
        if (rc != CUDA_SUCCESS) {
            while (i)
                vmh_paused_destroy(out[--i]);
            return rc;
        }
    }
    /* The paused descriptions hold every reservation, so destroying the ranges unmaps (one call
     * per stretch of adjacent mappings in one reservation, across the ranges) and releases the
     * memory but frees no address. */
    vmh_ranges_destroy(rs, n);
    return CUDA_SUCCESS;
}

/* One chunk for segment s: prop on the segment's device, with access[0..naccess) or the
 * segment's own descriptors; spill's when the device has no memory for it (spill may be NULL). */
static CUresult segment_chunk(const vmh_paused_seg_t *s, const CUmemAllocationProp *prop,
                              const CUmemAccessDesc *access, int naccess, vmh_chunk_fn spill,
                              void *spill_arg, vmh_alloc_t **out)
{
    CUmemAllocationProp chunk_prop = *prop;
    chunk_prop.location.id = s->device;
    CUresult rc =
        naccess ? vmh_alloc_create(s->grants, s->size, &chunk_prop, access, naccess, out)
                : vmh_alloc_create(s->grants, s->size, &chunk_prop, s->access, s->naccess, out);
    if (rc == CUDA_ERROR_OUT_OF_MEMORY && spill)
        rc = spill(spill_arg, s->size, out);
    return rc;
}

/* Every segment of ps[0..n) in address order, flattened: the resume's work list. */
typedef struct seg_ref {
    const vmh_paused_seg_t *seg;
    size_t rec; /* index into ps */
} seg_ref_t;

CUresult vmh_range_resume_run(const vmh_paused_t *const *ps, size_t n,
                              const CUmemAllocationProp *prop, const CUmemAccessDesc *access,
                              int naccess, const void *const *backups, vmh_chunk_fn spill,
                              void *spill_arg, vmh_range_t **out)
{
    if (!ps || !prop || !out || n == 0 || naccess < 0 || naccess > VMH_MAX_ACCESS ||
        (naccess && !access))
        return CUDA_ERROR_INVALID_VALUE;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (!ps[i] || !ps[i]->nsegs)
            return CUDA_ERROR_INVALID_VALUE;
        total += ps[i]->nsegs;
    }
    seg_ref_t *segs = calloc(total, sizeof *segs);
    vmh_alloc_t **chunks = calloc(total, sizeof *chunks);
    vmh_map_t **maps = calloc(total, sizeof *maps);
    vmh_range_t **rs = calloc(n, sizeof *rs);
    CUresult rc = segs && chunks && maps && rs ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    for (size_t i = 0, k = 0; i < n && rc == CUDA_SUCCESS; i++) {
        if (!(rs[i] = range_alloc(ps[i]->nsegs)))
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        for (size_t j = 0; rs[i] && j < ps[i]->nsegs; j++)
            segs[k++] = (seg_ref_t){&ps[i]->segs[j], i};
    }
    /* One chunk per segment (never one across segments or records: the driver maps chunks
     * only whole, and each record's range starts at its own mapping). */
    size_t made = 0; /* chunks[0..made) were made */
    while (rc == CUDA_SUCCESS && made < total)
        if ((rc = segment_chunk(segs[made].seg, prop, access, naccess, spill, spill_arg,
                                &chunks[made])) == CUDA_SUCCESS)
            made++;
    /* Mapped a stretch at a time: segments adjacent in one reservation, across records, get
     * their access set with one call where their descriptors agree. */
    size_t mapped = 0;
    while (rc == CUDA_SUCCESS && mapped < total) {
        const vmh_paused_seg_t *s = segs[mapped].seg;
        size_t end = mapped + 1;
        CUdeviceptr next = s->ptr + s->size;
        while (end < total && segs[end].seg->resv == s->resv && segs[end].seg->ptr == next)
            next += segs[end++].seg->size;
        rc = vmh_maps_create_run(s->ptr, &chunks[mapped], end - mapped, s->resv, &maps[mapped]);
        if (rc == CUDA_SUCCESS)
            mapped = end;
    }
    for (size_t k = 0; chunks && k < made; k++)
        vmh_alloc_unref(chunks[k]); /* the mappings hold them now (or nothing does) */
    if (rc == CUDA_SUCCESS) {
        for (size_t k = 0; k < total; k++) {
            vmh_range_t *r = rs[segs[k].rec];
            r->maps[r->nmaps++] = maps[k];
            r->size += maps[k]->size;
        }
        for (size_t i = 0; i < n; i++) {
            rs[i]->base = ps[i]->base;
            assert(rs[i]->size == ps[i]->size);
        }
        for (size_t i = 0; backups && i < n && rc == CUDA_SUCCESS; i++)
            if (backups[i])
                rc = vmh_drv.cuMemcpyHtoD(ps[i]->base, backups[i], ps[i]->size);
        if (rc != CUDA_SUCCESS) /* the ranges hold the mappings: they go with them */
            mapped = 0;
    }
    if (rc != CUDA_SUCCESS) {
        /* Unmaps and releases exactly what was created; ps still hold the reservations. */
        if (mapped)
            vmh_maps_unref_run(maps, mapped);
        vmh_ranges_destroy(rs, rs ? n : 0);
    } else {
        memcpy(out, rs, n * sizeof *rs);
    }
    free(segs);
    free(chunks);
    free(maps);
    free(rs);
    return rc;
}

/* ---- visits of heap records ---- */

static CUdeviceptr rec_base(const vmh_visit_rec_t *r)
{
    return *r->range ? (*r->range)->base : (*r->paused)->base;
}

static size_t rec_size(const vmh_visit_rec_t *r)
{
    return *r->range ? (*r->range)->size : (*r->paused)->size;
}

static int rec_order(const void *a, const void *b)
{
    CUdeviceptr x = rec_base(a), y = rec_base(b);
    return (x > y) - (x < y);
}

CUresult vmh_visit_runs(vmh_visit_rec_t *recs, size_t n, vmh_visit_run_fn fn, void *arg)
{
    qsort(recs, n, sizeof *recs, rec_order);
    CUresult rc = CUDA_SUCCESS;
    for (size_t i = 0; i < n && rc == CUDA_SUCCESS;) {
        size_t j = i + 1;
        while (j < n && rec_base(&recs[j - 1]) + rec_size(&recs[j - 1]) == rec_base(&recs[j]))
            j++;
        rc = fn(&recs[i], j - i, arg);
        i = j;
    }
    return rc;
}

/* ---- host chunks back to the device ---- */

size_t vmh_range_host_bytes(const vmh_range_t *r)
{
    size_t n = 0;
    for (size_t i = 0; r && i < r->nmaps; i++)
        n += r->maps[i] && r->maps[i]->alloc->host ? r->maps[i]->size : 0;
    return n;
}

/* One host mapping of a range being rehomed: its new chunk and where that is copied to. */
typedef struct rehome_slot {
    vmh_alloc_t *fresh;   /* the new chunk (NULL: the mapping stays) */
    vmh_range_t *scratch; /* fresh mapped at a scratch address for the copy */
    vmh_alloc_t *old;     /* the host chunk, kept until its replacement is mapped */
    vmh_resv_t *resv;     /* the reservation the mapping is in */
    CUdeviceptr ptr;
} rehome_slot_t;

static void slots_drop(rehome_slot_t *slots, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        vmh_range_destroy(slots[i].scratch);
        vmh_alloc_unref(slots[i].fresh);
        vmh_alloc_unref(slots[i].old);
        if (slots[i].resv)
            vmh_resv_unref(slots[i].resv);
    }
    free(slots);
}

/* Maps a at ptr in resv into *slot; tried again once with the old chunk (the bytes it held are
 * unchanged: nothing touched them) when the new one cannot be mapped there. */
static CUresult remap(rehome_slot_t *s, vmh_map_t **slot)
{
    CUresult rc = vmh_map_create(s->ptr, s->fresh, s->resv, slot);
    if (rc == CUDA_SUCCESS)
        return rc;
    if (vmh_map_create(s->ptr, s->old, s->resv, slot) != CUDA_SUCCESS) {
        *slot = NULL;
        vmh_log("moving memory back to the device: the driver refused to map [0x%llx, +%zu) "
                "again (CUDA error %d): that part of the buffer is lost",
                (unsigned long long)s->ptr, s->old->size, (int)rc);
    }
    return rc;
}

/* The scratch mappings of slots[0..n) in one list (references), for a caller that must keep
 * them until queued copies are done; NULL when there are none (no copy was queued), or when out
 * of host memory (then they stay mapped for ever: the copies may run, the memory must not go). */
static vmh_range_t *scratch_list(rehome_slot_t *slots, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += slots[i].scratch != NULL;
    if (!k)
        return NULL;
    vmh_range_t *l = range_alloc(k);
    if (!l) {
        for (size_t i = 0; i < n; i++)
            slots[i].scratch = NULL; /* leaked on purpose, see above */
        return NULL;
    }
    for (size_t i = 0; i < n; i++)
        if (slots[i].scratch) {
            l->maps[l->nmaps++] = vmh_map_ref(slots[i].scratch->maps[0]);
            l->size += slots[i].scratch->size;
        }
    return l;
}

struct vmh_rehome {
    vmh_range_t *r;
    rehome_slot_t *slots; /* one per mapping of r */
};

static void rehome_free(vmh_rehome_t *job)
{
    slots_drop(job->slots, job->r->nmaps);
    free(job);
}

CUresult vmh_range_rehome_begin(vmh_range_t *r, vmh_chunk_fn make, void *arg, CUstream stream,
                                vmh_rehome_t **job, vmh_range_t **unfinished)
{
    if (!r || !make || !job || !unfinished || !vmh_range_host_bytes(r))
        return CUDA_ERROR_INVALID_VALUE;
    *job = NULL;
    *unfinished = NULL;
    if (!vmh_range_owned_alone(r))
        return CUDA_ERROR_NOT_PERMITTED;
    vmh_rehome_t *j = calloc(1, sizeof *j);
    rehome_slot_t *slots = calloc(r->nmaps, sizeof *slots);
    if (!j || !slots) {
        free(j);
        free(slots);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *j = (vmh_rehome_t){r, slots};
    /* Copy first, while r stays mapped: a failure here changes nothing. Each host chunk is one
     * copy (a spill is one chunk of the buffer's size: one run at the link's speed), queued on
     * the caller's stream, so that the next buffer's chunks are made and mapped meanwhile. */
    CUresult rc = CUDA_SUCCESS;
    for (size_t i = 0; i < r->nmaps && rc == CUDA_SUCCESS; i++) {
        const vmh_map_t *m = r->maps[i];
        if (!m->alloc->host)
            continue;
        rc = make(arg, m->size, &slots[i].fresh);
        if (rc == CUDA_SUCCESS)
            rc = vmh_range_create(&slots[i].fresh, 1, m->size, 0, 0, &slots[i].scratch, NULL);
        if (rc == CUDA_SUCCESS)
            rc = vmh_drv.cuMemcpyDtoDAsync(slots[i].scratch->base, m->ptr, m->size, stream);
    }
    if (rc != CUDA_SUCCESS) {
        /* Copies queued before may still write the scratch memory, which goes only once the
         * GPU has passed them (the caller's reclaim). */
        *unfinished = scratch_list(slots, r->nmaps);
        rehome_free(j);
        return rc;
    }
    *job = j;
    return CUDA_SUCCESS;
}

CUresult vmh_range_rehome_finish(vmh_rehome_t *j, CUresult waited, vmh_range_t **out,
                                 vmh_range_t **unfinished, vmh_alloc_t **old_host)
{
    vmh_range_t *r = j->r;
    rehome_slot_t *slots = j->slots;
    size_t n = r->nmaps;
    *out = *unfinished = NULL;
    vmh_range_t *nr = waited == CUDA_SUCCESS ? range_alloc(n) : NULL;
    if (!nr) {
        /* A failed wait proves nothing: the copies may still run (as above). */
        *unfinished = scratch_list(slots, n);
        rehome_free(j);
        return waited != CUDA_SUCCESS ? waited : CUDA_ERROR_OUT_OF_MEMORY;
    }
    /* Then the swap: hold what stays and where the host chunks were, unmap them (destroying
     * r, which alone holds them), map the new chunks there. */
    nr->base = r->base;
    for (size_t i = 0; i < n; i++) {
        vmh_map_t *m = r->maps[i];
        if (!slots[i].fresh) {
            nr->maps[i] = vmh_map_ref(m);
            continue;
        }
        slots[i].old = vmh_alloc_ref(m->alloc);
        slots[i].resv = vmh_resv_ref(m->resv);
        slots[i].ptr = m->ptr;
    }
    uint64_t t0 = vmh_now_ns();
    vmh_range_destroy(r);
    uint64_t t1 = vmh_now_ns();
    j->r = nr; /* what slots_drop reads the count from */
    CUresult swap_rc = CUDA_SUCCESS, rc;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (slots[i].fresh && (rc = remap(&slots[i], &nr->maps[i])) != CUDA_SUCCESS)
            swap_rc = rc;
        nr->size += nr->maps[i] ? nr->maps[i]->size : 0;
        if (slots[i].old) { /* the caller's reference now: released when it chooses */
            old_host[k++] = slots[i].old;
            slots[i].old = NULL;
        }
    }
    nr->nmaps = n;
    uint64_t t2 = vmh_now_ns();
    rehome_free(j); /* the scratch mappings go; the new ones hold the chunks */
    /* The swap's parts (VMMHOOK_VERBOSE): the host mappings' unmap, the device chunks mapped in
     * their place, the scratch mappings' unmap (a GPU run tells which part costs). */
    vmh_debug("move back of [0x%llx, +%zu): host mappings unmapped %.1f ms, device chunks mapped "
              "%.1f ms, scratch unmapped %.1f ms",
              (unsigned long long)nr->base, nr->size, (double)(t1 - t0) / 1e6,
              (double)(t2 - t1) / 1e6, (double)(vmh_now_ns() - t2) / 1e6);
    *out = nr;
    /* A mapping the driver refused even for the old chunk is a hole in the buffer: said by
     * the caller; the range holds what could be mapped, the old chunk where the new one failed,
     * so the bytes and the address stay right whenever the driver allowed either. */
    return swap_rc;
}

size_t vmh_range_rehome_chunks(const vmh_range_t *r)
{
    size_t n = 0;
    for (size_t i = 0; r && i < r->nmaps; i++)
        n += r->maps[i] && r->maps[i]->alloc->host;
    return n;
}
