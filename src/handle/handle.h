/* Layer "handles": the three refcounted VMM handles.
 *
 * Each handle owns exactly one driver object and frees it with the exact undo call when its
 * last reference goes:
 *   allocation  (cuMemCreate chunk)          -> cuMemRelease(handle)
 *   reservation (cuMemAddressReserve result) -> cuMemAddressFree(ptr, size), the pair returned
 *   mapping     (ptr, size, alloc, resv)     -> cuMemUnmap(ptr, size), then drops its refs
 * A mapping holds one reference on its allocation and one on its reservation, so unmap always
 * precedes release and free. Nothing else records how to undo anything: a failed multi-step
 * operation unwinds by dropping the references it took.
 */
#ifndef VMH_HANDLE_H
#define VMH_HANDLE_H

#include "driver.h"

#include <cuda.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Access descriptors an allocation carries with it (its device plus granted peers). */
#define VMH_MAX_ACCESS 8

/* One GPU's part of this layer, kept in the GPU's record (heap_internal.h): the peers granted
 * access to its chunks. Each chunk points to its device's part, so that this layer reaches a
 * grant without a table of devices. */
typedef struct vmh_grants {
    uint64_t peers; /* bit p: device p may read and write the chunks (access_lock) */
} vmh_grants_t;

typedef struct vmh_alloc {
    atomic_int refs;
    CUmemGenericAllocationHandle handle;
    size_t size;
    int device;      /* ordinal the chunk lives on, or serves when host-located */
    bool host;       /* host-located (overflow.h): pinned host memory at device addresses */
    int handle_type; /* CUmemAllocationHandleType it was created with */
    int naccess;
    CUmemAccessDesc access[VMH_MAX_ACCESS];
    /* Its device's part of the records (NULL: none, a chunk made outside the heap): the peers
     * granted, and the count of host bytes a host chunk counts in (vmh_alloc_count_in). */
    const vmh_grants_t *grants;
    _Atomic int64_t *host_count;
} vmh_alloc_t;

typedef struct vmh_resv {
    atomic_int refs;
    CUdeviceptr ptr;
    size_t size;
} vmh_resv_t;

typedef struct vmh_map {
    atomic_int refs;
    CUdeviceptr ptr;
    size_t size;
    vmh_alloc_t *alloc;
    vmh_resv_t *resv;
    struct vmh_map *prev, *next; /* every live mapping (peer access reaches them all) */
} vmh_map_t;

/* Bytes of host-located chunks alive in the process (created and not yet released): the
 * overflow layer's budget. */
size_t vmh_alloc_host_bytes(void);

/* A host-located chunk's bytes count in *count too while it lives: its device's count, which the
 * device's record keeps (overflow.h), so that this layer needs no table of devices. */
void vmh_alloc_count_in(vmh_alloc_t *a, _Atomic int64_t *count);

/* cuMemCreate(size, prop); the descriptors are copied and applied wherever the chunk is
 * mapped, with the peers of `grants` (its device's part, NULL for none). naccess may be 0 (a
 * mapping then gets no cuMemSetAccess call). */
CUresult vmh_alloc_create(const vmh_grants_t *grants, size_t size, const CUmemAllocationProp *prop,
                          const CUmemAccessDesc *access, int naccess, vmh_alloc_t **out);
vmh_alloc_t *vmh_alloc_ref(vmh_alloc_t *a);
void vmh_alloc_unref(vmh_alloc_t *a);

/* cuMemAddressReserve(size, align, hint). The driver may place it elsewhere than the hint;
 * the caller compares (*out)->ptr with the hint when that matters. */
CUresult vmh_resv_create(size_t size, size_t align, CUdeviceptr hint, vmh_resv_t **out);
vmh_resv_t *vmh_resv_ref(vmh_resv_t *r);
void vmh_resv_unref(vmh_resv_t *r);

/* Maps the whole allocation at ptr, which must lie (with the allocation's size) inside the
 * reservation, then applies the allocation's access descriptors and the peers granted for its
 * device (vmh_access_set_peer). On an access failure the mapping is undone and nothing is
 * held. */
CUresult vmh_map_create(CUdeviceptr ptr, vmh_alloc_t *alloc, vmh_resv_t *resv, vmh_map_t **out);
vmh_map_t *vmh_map_ref(vmh_map_t *m);
void vmh_map_unref(vmh_map_t *m);

/* Runs of adjacent mappings, for bulk operations (pause, resume, trim): the driver maps a chunk
 * only whole, one cuMemMap each, but unmaps several adjacent mappings with one cuMemUnmap and
 * sets access over a fully mapped range with one cuMemSetAccess (driver-facts.md 2a, 3). A run
 * stays inside one reservation: whether the driver takes either call across two adjacent
 * reservations is unmeasured (tests/gpu/driver_direct.c checks it).
 *
 * Maps allocs[0..n) one after another from ptr inside resv, as vmh_map_create each, with one
 * cuMemSetAccess per stretch of chunks whose descriptors are equal; out[0..n) gets the
 * mappings. On failure nothing is mapped and nothing held. */
CUresult vmh_maps_create_run(CUdeviceptr ptr, vmh_alloc_t *const *allocs, size_t n,
                             vmh_resv_t *resv, vmh_map_t **out);
/* Drops one reference on each of run[0..n) (ascending addresses): the mappings this drops
 * last go with one cuMemUnmap per stretch of them adjacent in one reservation (one call per
 * mapping if the driver refuses the stretch). */
void vmh_maps_unref_run(vmh_map_t *const *run, size_t n);

/* Peer access, the one place that sets it: from now on device `peer` may (grant) or may not
 * read and write every mapping of a chunk of the device whose part `owner` is (of `ordinal`),
 * existing and future. Existing
 * mappings get one cuMemSetAccess each; a mapping being made meanwhile is either reached here
 * or made with the new grant (a mapping is made and listed under the same lock this edit takes
 * exclusively). Returns the first failure (the grant is recorded anyway, as the driver's peer
 * call that asked for it succeeded). */
CUresult vmh_access_set_peer(vmh_grants_t *owner, int ordinal, int peer, bool grant);

/* Reports an undo call (release, free, unmap) that failed: the object stays alive. */
void vmh_handle_report_failure(const char *call, CUresult rc);

/* cuMemImportFromShareableHandle(fd, POSIX_FD) of a chunk another process exported: a handle of
 * the given size (as the exporter created it) whose access descriptors are applied wherever it
 * is mapped; its last reference calls cuMemRelease, as for a created chunk. The caller keeps
 * and closes fd (the imported handle does not need it). `grants`: the importing device's part. */
CUresult vmh_alloc_import(const vmh_grants_t *grants, int fd, size_t size, int device,
                          const CUmemAccessDesc *access, int naccess, vmh_alloc_t **out);

#endif
