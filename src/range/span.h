/* Layer "ranges": spans, large reservations carved into the address ranges of many extents,
 * so that a shard's extents are neighbours in address space (the mappings of adjacent
 * extents can then be joined by range, and one reservation serves many extents).
 *
 * A span holds one reference on its reservation (handle.h); each extent's mappings hold
 * theirs, so the address space is freed only when the span is dropped and no mapping is left
 * (docs/DESIGN.md, "What owns what"). A span is dropped once nothing in it is taken. Host
 * bookkeeping only, under the owner's lock (a shard's): taking space never calls the driver;
 * a new span is reserved by vmh_span_reserve (a driver call, outside that lock) and then
 * added with vmh_spans_add.
 */
#ifndef VMH_SPAN_H
#define VMH_SPAN_H

#include "handle.h"

typedef struct vmh_span vmh_span_t;

typedef struct vmh_spans {
    vmh_span_t *list;
} vmh_spans_t;

/* Takes `size` bytes of address space (a granularity multiple) from the spans, first fit:
 * true with *resv (no reference taken: the span keeps one until the space is given back) and
 * *ptr; false when no span has room. */
bool vmh_spans_take(vmh_spans_t *ss, size_t size, vmh_resv_t **resv, CUdeviceptr *ptr);

/* The free address space that starts exactly at ptr in the spans (0: none), and taking `size`
 * bytes of it (at most that many; true with *resv as vmh_spans_take): what lets an extent grow
 * into the addresses that follow it (carved_place.c). */
size_t vmh_spans_free_at(const vmh_spans_t *ss, CUdeviceptr ptr);
bool vmh_spans_take_at(vmh_spans_t *ss, CUdeviceptr ptr, size_t size, vmh_resv_t **resv);

/* Gives back what vmh_spans_take took (nothing may be mapped there any more); returns the
 * reservation of a span this emptied, for the caller to vmh_resv_unref outside its lock (the
 * driver's cuMemAddressFree), or NULL. */
vmh_resv_t *vmh_spans_give(vmh_spans_t *ss, CUdeviceptr ptr, size_t size);

/* Adds a reservation as a new span (taking over the caller's reference); false when host
 * memory ran out (the caller still holds its reference). */
bool vmh_spans_add(vmh_spans_t *ss, vmh_resv_t *resv);

/* Bytes of address space the spans hold (taken or not). */
size_t vmh_spans_bytes(const vmh_spans_t *ss);

/* Tests' teardown: drops every span (their space given back or not). */
void vmh_spans_destroy(vmh_spans_t *ss);

#endif
