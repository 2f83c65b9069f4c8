/* Layer "device", the bottom of the heap: one device's shape and the owner records.
 *
 * A device record holds what every layer above needs and nothing of theirs: the ordinal, the
 * context it was first served in, the allocation properties and chunk granularity, the
 * usable bytes served (VMMHOOK_MEM_LIMIT) and how to make room when the driver runs out of
 * memory (a function the front sets: ownership as data, so this file never calls upwards).
 *
 * Owner records: every 2 MiB granule the library serves from points (registry.h) to an owner.
 * The owner says what kind of thing it is, which device it belongs to and which mutex guards it,
 * so that a pointer can be found and locked here without knowing the layer that made it.
 * Owners are recycled by their layer and never freed while the process runs (registry readers
 * are lock-free), except by the tests' reset.
 */
#ifndef VMH_DEVICE_H
#define VMH_DEVICE_H

#include "handle.h"
#include "log.h"
#include "options.h" /* the values of VMMHOOK_GRANULARITY and VMMHOOK_HANDLE_TYPE */
#include "range.h"

#include <cuda.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum vmh_owner_kind {
    VMH_OWN_CHUNKS = 1, /* a buffer with a range of its own (ownchunk.c) */
    VMH_OWN_EXTENT,     /* an extent whose buffers are carved from it (carved.c) */
    VMH_OWN_IDLE,       /* an idle range kept for reuse (cache.c): mapped, nobody's buffer */
    VMH_OWN_DEAD,       /* still mapped until queued work is done (the old address of a moved
                         * buffer, the tail of a shrunk one): queries must not pass it to the
                         * driver, which would answer for it as if it were allocated */
} vmh_owner_kind_t;

typedef struct vmh_dev vmh_dev_t;

typedef struct vmh_owner {
    vmh_owner_kind_t kind;
    vmh_dev_t *dev;        /* never changes once set: owners are recycled within their device */
    pthread_mutex_t *lock; /* what guards the owner (NULL for IDLE and DEAD: never locked) */
} vmh_owner_t;

/* The registry's owner of idle and of dead address space. */
extern vmh_owner_t vmh_owner_idle, vmh_owner_dead;

/* Frees idle memory of the device after the driver ran out of memory; true when anything was
 * (or may have been) given back, so that one more try makes sense. */
typedef bool (*vmh_relieve_fn)(vmh_dev_t *d);

/* Gives back idle memory of the device beyond what the program's recent peak may need (the
 * reclaim thread calls it, heap_upkeep.c decides: DESIGN.md, "Limits that follow the program"). */
typedef void (*vmh_tidy_fn)(vmh_dev_t *d);

struct vmh_dev {
    int ordinal;
    bool unsupported; /* no VMM on this device: everything passes through */
    CUcontext ctx;    /* the context first served in (reclaim waits on all of the device) */
    CUmemAllocationProp prop;
    CUmemAccessDesc access; /* the device's own read-write access (peers: handle.h) */
    vmh_grants_t *grants;   /* the peers granted its chunks: its record's part (handle.h) */
    size_t gran;            /* chunk granularity */
    size_t rec_gran;        /* the driver's recommended one (gran is larger only when set so) */
    size_t chunk_max;       /* VMMHOOK_CHUNK_MAX in whole granules (at least one); 0: none */
    /* Usable bytes of live buffers (and of allocations in flight), for VMMHOOK_MEM_LIMIT:
     * taken before a buffer is made (vmh_dev_usable_take), so the limit is never exceeded. */
    _Atomic size_t live_usable;
    /* The most live_usable has been since the last vmh_dev_usable_peak_reset (a trim): the
     * cache may keep what the program held at that peak and does not hold now (cache.h). */
    _Atomic size_t peak_usable;
    vmh_relieve_fn relieve; /* set by the front before the device is published */
    vmh_tidy_fn tidy;       /* likewise */
};

/* What this layer takes from the options; the front makes it once, at start (lifetime.c). */
typedef struct vmh_device_settings {
    vmh_gran_mode_t gran_mode; /* VMMHOOK_GRANULARITY */
    size_t gran_bytes;         /* when gran_mode is VMH_GRAN_BYTES */
    vmh_handle_kind_t handle;  /* VMMHOOK_HANDLE_TYPE */
    bool rdma;                 /* VMMHOOK_RDMA */
    uint64_t peers;            /* VMMHOOK_PEERS: bit i = grant device i access up front */
    size_t mem_limit;          /* VMMHOOK_MEM_LIMIT: usable bytes per device, 0 = no limit */
    size_t va_limit;           /* VMMHOOK_VA_LIMIT: address space, all devices together */
    size_t headroom;           /* VMMHOOK_HEADROOM: reserved past a buffer that may grow */
    size_t chunk_max;          /* VMMHOOK_CHUNK_MAX: 0 = the carved layer's own rule */
    vmh_refuse_fn refuse;      /* a value the driver refuses (log.h) */
} vmh_device_settings_t;

/* Takes a copy of *s; before any device is set up (tests call it again between devices). */
void vmh_device_configure(const vmh_device_settings_t *s);

/* Fills d for device `ordinal` (ctx: the context it is first served in): properties,
 * granularity (a handle type the driver refuses is reported here, once), VMMHOOK_PEERS grants
 * (handle.h). A device without VMM gets unsupported = true and CUDA_SUCCESS. */
CUresult vmh_dev_setup(vmh_dev_t *d, int ordinal, CUcontext ctx);

#ifdef VMH_TESTING
/* The chunk granularity vmh_dev_setup uses for allocation properties whose minimum and
 * recommended granularities the driver gave: VMMHOOK_GRANULARITY's choice (s), or when an
 * explicit size is not a multiple of the minimum, the recommended one after s->refuse. Static
 * in the library (testable.h). */
size_t vmh_dev_pick_granularity(const vmh_device_settings_t *s, size_t min_gran, size_t rec_gran);
#endif

/* Reserves n usable bytes within VMMHOOK_MEM_LIMIT; false (nothing taken) when they do not fit.
 * vmh_dev_usable_give returns them; adjust corrects by a signed amount. */
bool vmh_dev_usable_take(vmh_dev_t *d, size_t n);
void vmh_dev_usable_give(vmh_dev_t *d, size_t n);
void vmh_dev_usable_adjust(vmh_dev_t *d, int64_t delta);
/* The recent peak of the usable bytes (peak_usable), and its reset to the bytes live now. */
size_t vmh_dev_usable_peak(const vmh_dev_t *d);
void vmh_dev_usable_peak_reset(vmh_dev_t *d);

/* Address space for a buffer of `size` bytes (headroom when it may grow, within the
 * VMMHOOK_VA_LIMIT budget), and whether `reserve` more bytes would pass the budget. */
size_t vmh_dev_reserve_for(size_t size, bool growable);
bool vmh_dev_va_exhausted(size_t reserve);

/* One chunk of `size` bytes on the device (its access applied wherever it is mapped). */
CUresult vmh_dev_chunk(vmh_dev_t *d, size_t size, vmh_alloc_t **out);

/* One chunk of `size` bytes mapped in a range of its own with `reserve` bytes of address
 * space. On out of memory the device is relieved (d->relieve) and the creation tried once
 * more: memory held idle by the library must never make the program fail. *no_address tells
 * an exhausted address space budget from exhausted memory. */
CUresult vmh_dev_range_new(vmh_dev_t *d, size_t size, size_t reserve, vmh_range_t **out,
                           bool *no_address);

/* As vmh_dev_range_new, mapped at `at` inside resv (a span the caller holds, span.h) instead of
 * in a reservation of its own, in chunks of `chunk` bytes (the last one shorter; 0: one chunk),
 * mapped with one cuMemSetAccess for the stretch (a shared extent's backing, carved.h). */
CUresult vmh_dev_range_in(vmh_dev_t *d, size_t size, size_t chunk, vmh_resv_t *resv, CUdeviceptr at,
                          vmh_range_t **out);
/* As vmh_dev_range_in without relieving the device on out of memory: for a caller that holds
 * a heap lock the relief takes (carved.c's hole fill, under its shard's). */
CUresult vmh_dev_range_at(vmh_dev_t *d, size_t size, size_t chunk, vmh_resv_t *resv, CUdeviceptr at,
                          vmh_range_t **out);

/* The one line VMMHOOK_VERBOSE prints when a served allocation of `size` bytes on the device
 * failed with rc (no_address: the address space budget was met): why, most of all when the
 * library's own settings are the reason (VMMHOOK_VA_LIMIT, VMMHOOK_MEM_LIMIT, a paused tag,
 * VMMHOOK_GRANULARITY), since the driver alone would have served it. For the front, where an
 * allocation's failure is final. No driver call; nothing without VMMHOOK_VERBOSE. */
void vmh_dev_alloc_failed(const vmh_dev_t *d, size_t size, CUresult rc, bool no_address);

/* Finds the owner of p and locks it; NULL (nothing locked) when p is not in a live owner.
 * An address whose owner changed meanwhile (carved_place.c joins extents) is followed to its new
 * owner. Unlock with vmh_owner_unlock(). */
vmh_owner_t *vmh_owner_lock(CUdeviceptr p);
void vmh_owner_unlock(vmh_owner_t *o);

/* What the layers above fill for the front (heap.h): a live served buffer, and the chunks
 * behind one for sharing with another process. */
typedef struct vmh_buffer_info {
    CUdeviceptr base;
    size_t size;   /* the size the program asked for (what native range queries answer) */
    size_t usable; /* bytes usable without moving */
    int device;
    bool carved; /* lives in a shared chunk (carved.h) */
} vmh_buffer_info_t;

typedef struct vmh_export {
    CUdeviceptr base;
    size_t size;
    size_t offset; /* where the buffer starts in the first chunk (non-zero when carved) */
    int device;
    size_t nchunks;
    vmh_alloc_t **chunks;
    uint64_t serial; /* this life of the buffer: the same for every export until it is freed */
} vmh_export_t;

/* A new export serial (never 0, never repeated in the process). */
uint64_t vmh_export_serial_new(void);

/* n rounded up to a multiple of `to`; false on overflow. */
static inline bool vmh_round_up(size_t n, size_t to, size_t *out)
{
    if (n > SIZE_MAX - (to - 1))
        return false;
    *out = (n + to - 1) / to * to;
    return true;
}

#endif
