/* Layer "ranges": spans (see span.h). A span keeps its free address space as a short sorted
 * array of intervals: extents are few (they grow geometrically), so a linear walk is enough. */
#include "span.h"

#include "grow.h"

#include <stdlib.h>
#include <string.h>

typedef struct vmh_free_iv {
    CUdeviceptr ptr;
    size_t size;
} vmh_free_iv_t;

struct vmh_span {
    vmh_resv_t *resv;
    size_t taken;        /* bytes taken */
    vmh_free_iv_t *free; /* ascending, never adjacent (merged on give) */
    size_t nfree, cap;
    vmh_span_t *next;
};

/* Takes the first `size` bytes of sp's free interval i (which holds them). */
static void take_front(vmh_span_t *sp, size_t i, size_t size)
{
    vmh_free_iv_t *f = &sp->free[i];
    f->ptr += size;
    f->size -= size;
    if (!f->size) {
        memmove(f, f + 1, (sp->nfree - i - 1) * sizeof *f);
        sp->nfree--;
    }
    sp->taken += size;
}

bool vmh_spans_take(vmh_spans_t *ss, size_t size, vmh_resv_t **resv, CUdeviceptr *ptr)
{
    for (vmh_span_t *sp = ss->list; sp; sp = sp->next) {
        for (size_t i = 0; i < sp->nfree; i++) {
            vmh_free_iv_t *f = &sp->free[i];
            if (f->size < size)
                continue;
            *ptr = f->ptr;
            *resv = sp->resv;
            take_front(sp, i, size);
            return true;
        }
    }
    return false;
}

/* The free interval of the spans that starts exactly at ptr: its span (NULL: none) and index. */
static vmh_span_t *free_starting_at(const vmh_spans_t *ss, CUdeviceptr ptr, size_t *at)
{
    for (vmh_span_t *sp = ss->list; sp; sp = sp->next) {
        if (ptr < sp->resv->ptr || ptr - sp->resv->ptr >= sp->resv->size)
            continue;
        for (size_t i = 0; i < sp->nfree; i++) {
            if (sp->free[i].ptr == ptr) {
                *at = i;
                return sp;
            }
        }
        return NULL;
    }
    return NULL;
}

size_t vmh_spans_free_at(const vmh_spans_t *ss, CUdeviceptr ptr)
{
    size_t i;
    const vmh_span_t *sp = free_starting_at(ss, ptr, &i);
    return sp ? sp->free[i].size : 0;
}

bool vmh_spans_take_at(vmh_spans_t *ss, CUdeviceptr ptr, size_t size, vmh_resv_t **resv)
{
    size_t i;
    vmh_span_t *sp = free_starting_at(ss, ptr, &i);
    if (!sp || sp->free[i].size < size || !size)
        return false;
    *resv = sp->resv;
    take_front(sp, i, size);
    return true;
}

/* Inserts [ptr, +size) into sp's free intervals, merged with its neighbours; false when host
 * memory ran out (the space then stays taken: lost to reuse, never double-served). */
static bool free_insert(vmh_span_t *sp, CUdeviceptr ptr, size_t size)
{
    size_t i = 0;
    while (i < sp->nfree && sp->free[i].ptr < ptr)
        i++;
    bool join_prev = i > 0 && sp->free[i - 1].ptr + sp->free[i - 1].size == ptr;
    bool join_next = i < sp->nfree && ptr + size == sp->free[i].ptr;
    if (join_prev && join_next) {
        sp->free[i - 1].size += size + sp->free[i].size;
        memmove(&sp->free[i], &sp->free[i + 1], (sp->nfree - i - 1) * sizeof sp->free[0]);
        sp->nfree--;
    } else if (join_prev) {
        sp->free[i - 1].size += size;
    } else if (join_next) {
        sp->free[i].ptr = ptr;
        sp->free[i].size += size;
    } else {
        vmh_free_iv_t *grown = vmh_grow(sp->free, &sp->cap, sp->nfree, sizeof *grown, 8);
        if (!grown)
            return false;
        sp->free = grown;
        memmove(&sp->free[i + 1], &sp->free[i], (sp->nfree - i) * sizeof sp->free[0]);
        sp->free[i] = (vmh_free_iv_t){ptr, size};
        sp->nfree++;
    }
    return true;
}

vmh_resv_t *vmh_spans_give(vmh_spans_t *ss, CUdeviceptr ptr, size_t size)
{
    for (vmh_span_t **at = &ss->list; *at; at = &(*at)->next) {
        vmh_span_t *sp = *at;
        if (ptr < sp->resv->ptr || ptr - sp->resv->ptr >= sp->resv->size)
            continue;
        sp->taken -= size;
        if (sp->taken) {
            free_insert(sp, ptr, size);
            return NULL;
        }
        *at = sp->next;
        vmh_resv_t *resv = sp->resv;
        free(sp->free);
        free(sp);
        return resv;
    }
    return NULL;
}

bool vmh_spans_add(vmh_spans_t *ss, vmh_resv_t *resv)
{
    vmh_span_t *sp = calloc(1, sizeof *sp);
    if (!sp)
        return false;
    sp->resv = resv;
    if (!free_insert(sp, resv->ptr, resv->size)) {
        free(sp);
        return false;
    }
    sp->next = ss->list;
    ss->list = sp;
    return true;
}

size_t vmh_spans_bytes(const vmh_spans_t *ss)
{
    size_t bytes = 0;
    for (const vmh_span_t *sp = ss->list; sp; sp = sp->next)
        bytes += sp->resv->size;
    return bytes;
}

void vmh_spans_destroy(vmh_spans_t *ss)
{
    while (ss->list) {
        vmh_span_t *sp = ss->list;
        ss->list = sp->next;
        vmh_resv_unref(sp->resv);
        free(sp->free);
        free(sp);
    }
}
