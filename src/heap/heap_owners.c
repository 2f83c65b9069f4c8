/* Layer "heap front", the kinds of owner of served memory as one table (heap_internal.h's
 * owner_ops_t): the one place the heap tells a carved buffer (a block of a shared extent,
 * carved.c) from one with chunks of its own (ownchunk.c). heap.c, heap_devices.c and
 * heap_upkeep.c look an owner's operations up here (ops_of) and never test its kind.
 *
 * Each entry adapts its layer's call to the table's signature (an owner record in, the layer's
 * type out) and calls down, nothing more: what is called, under which lock and in which order
 * is the callers'. The layers do not know of the table.
 */
#include "heap_internal.h"

#include <stddef.h>

/* ---- carved: blocks of shared extents ------------------------------------------------------ */

static vmh_ext_t *ext_of(vmh_owner_t *o)
{
    return (vmh_ext_t *)o; /* an extent's record starts with its owner */
}

static const tagpart_t *ext_part(const vmh_owner_t *o)
{
    const vmh_carved_t *pk = ((const vmh_ext_t *)o)->shard->carved;
    return (const tagpart_t *)((const char *)pk - offsetof(tagpart_t, carved));
}

static CUresult ext_park(vmh_owner_t *o, CUdeviceptr p, bool at_once, size_t *req,
                         vmh_paused_t **gone)
{
    (void)gone; /* a paused block's extent keeps its addresses: nothing for the caller */
    return vmh_carved_park_locked(ext_of(o), p, at_once, req);
}

static bool ext_find(vmh_owner_t *o, CUdeviceptr p, vmh_buffer_info_t *info)
{
    return vmh_carved_find_locked(ext_of(o), p, info);
}

static const void *ext_backup(vmh_owner_t *o, CUdeviceptr p, size_t n)
{
    return vmh_carved_backup_locked(ext_of(o), p, n);
}

static CUresult ext_export(vmh_owner_t *o, CUdeviceptr p, vmh_export_t *out,
                           const vmh_range_t **range)
{
    return vmh_carved_export_locked(ext_of(o), p, out, range);
}

static bool ext_export_alive(vmh_owner_t *o, CUdeviceptr base, uint64_t serial)
{
    return vmh_carved_export_alive_locked(ext_of(o), base, serial);
}

static bool ext_paused(vmh_owner_t *o)
{
    return vmh_carved_paused_locked(ext_of(o));
}

static CUresult ext_resize(vmh_owner_t *o, CUdeviceptr p, size_t size, bool at_once,
                           size_t *old_size)
{
    return vmh_carved_resize_locked(ext_of(o), p, size, at_once, old_size);
}

static CUresult ext_visit(tagpart_t *part, vmh_visit_run_fn fn, void *arg)
{
    return vmh_carved_visit(&part->carved, fn, arg);
}

/* ---- own chunks: buffers with a range of their own ----------------------------------------- */

static vmh_ownbuf_t *own_of(vmh_owner_t *o)
{
    return (vmh_ownbuf_t *)o; /* an own-chunk buffer's record starts with its owner */
}

static const tagpart_t *own_part(const vmh_owner_t *o)
{
    const vmh_ownchunks_t *set = vmh_ownchunk_set_of((const vmh_ownbuf_t *)o);
    return (const tagpart_t *)((const char *)set - offsetof(tagpart_t, own));
}

static CUresult own_park(vmh_owner_t *o, CUdeviceptr p, bool at_once, size_t *req,
                         vmh_paused_t **gone)
{
    (void)at_once; /* a freed buffer's chunks are always parked until the GPU has passed it */
    return vmh_ownchunk_park_locked(own_of(o), p, req, gone);
}

static bool own_find(vmh_owner_t *o, CUdeviceptr p, vmh_buffer_info_t *info)
{
    return vmh_ownchunk_find_locked(own_of(o), p, info);
}

static const void *own_backup(vmh_owner_t *o, CUdeviceptr p, size_t n)
{
    return vmh_ownchunk_backup_locked(own_of(o), p, n);
}

static CUresult own_export(vmh_owner_t *o, CUdeviceptr p, vmh_export_t *out,
                           const vmh_range_t **range)
{
    (void)p; /* the whole buffer is exported, whatever address inside it was asked about */
    return vmh_ownchunk_export_locked(own_of(o), out, range);
}

static bool own_export_alive(vmh_owner_t *o, CUdeviceptr base, uint64_t serial)
{
    return vmh_ownchunk_export_alive_locked(own_of(o), base, serial);
}

static CUresult own_prefetch(vmh_owner_t *o, CUdeviceptr p, CUstream stream, size_t *moved)
{
    return vmh_ownchunk_prefetch_locked(own_of(o), p, stream, moved);
}

static CUresult own_visit(tagpart_t *part, vmh_visit_run_fn fn, void *arg)
{
    return vmh_ownchunk_visit(&part->own, fn, arg);
}

/* ---- the table ----------------------------------------------------------------------------- */

/* By kind; the kinds that serve nothing (idle, dead: device.h) have no operations. The visit
 * goes in index order: own-chunk buffers (VMH_OWN_CHUNKS) before extents, as heap.h says. */
const owner_ops_t vmh_heap_owner_ops[OWNER_KINDS] = {
    [VMH_OWN_CHUNKS] =
        {
            .part = own_part,
            .park = own_park,
            .find = own_find,
            .backup = own_backup,
            .export = own_export,
            .export_alive = own_export_alive,
            .realloc = vmh_ownchunk_realloc,
            .prefetch = own_prefetch,
            .visit = own_visit,
        },
    [VMH_OWN_EXTENT] =
        {
            .part = ext_part,
            .park = ext_park,
            .find = ext_find,
            .backup = ext_backup,
            .export = ext_export,
            .export_alive = ext_export_alive,
            .paused = ext_paused,
            .resize = ext_resize,
            .visit = ext_visit,
            .reuse_at_once = true,
        },
};
