/* Shared by the simulated driver's own suites (test_sim_driver.c, test_sim_vmm.c,
 * test_sim_native.c): the driver's table, a snapshot of everything a rejected call must leave
 * alone, helpers that make handles, reservations and access, and fixtures for the default, a
 * small and a two-device driver. Header-only (static) like testutil.h, so that each suite
 * stays one program of one file; include it first. */
#ifndef VMH_SIM_FIXTURE_H
#define VMH_SIM_FIXTURE_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>

#include <cudaTypedefs.h>

#include "simdrv.h"

#define MB (1024ULL * 1024)
#define GB (1024ULL * MB)
#define G2 (2 * MB)

#define OK(x) assert_int_equal((x), CUDA_SUCCESS)
#define RC(code, x) assert_int_equal((x), (code))
#define LEDGER_EMPTY()                \
    do {                              \
        if (!sim_ledger_empty())      \
            sim_ledger_dump();        \
        assert_true(sim_ledger_empty()); \
    } while (0)

static const vmh_driver_t *D;

/* Snapshot of everything a rejected call must leave alone. */
typedef struct snap {
    size_t allocs, handles, resvs, maps, native, used0;
} snap_t;

static inline snap_t snap(void)
{
    return (snap_t){sim_live_allocations(), sim_live_handles(), sim_live_reservations(),
                    sim_live_mappings(), sim_live_native(), sim_device_used(0)};
}

static inline void same(snap_t a)
{
    snap_t b = snap();
    assert_int_equal(a.allocs, b.allocs);
    assert_int_equal(a.handles, b.handles);
    assert_int_equal(a.resvs, b.resvs);
    assert_int_equal(a.maps, b.maps);
    assert_int_equal(a.native, b.native);
    assert_int_equal(a.used0, b.used0);
}

static inline CUmemAllocationProp prop_dev(int dev, int types)
{
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = dev;
    p.requestedHandleTypes = (CUmemAllocationHandleType)types;
    return p;
}

static inline CUmemGenericAllocationHandle create(size_t size, int dev)
{
    CUmemAllocationProp p = prop_dev(dev, 0);
    CUmemGenericAllocationHandle h = 0;
    OK(D->cuMemCreate(&h, size, &p, 0));
    return h;
}

static inline CUdeviceptr reserve(size_t size, CUdeviceptr hint)
{
    CUdeviceptr p = 0;
    OK(D->cuMemAddressReserve(&p, size, 0, hint, 0));
    return p;
}

static inline void set_access(CUdeviceptr p, size_t size, int dev, CUmemAccess_flags flags)
{
    CUmemAccessDesc a;
    memset(&a, 0, sizeof a);
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = dev;
    a.flags = flags;
    OK(D->cuMemSetAccess(p, size, &a, 1));
}

static inline int setup(void **state)
{
    (void)state;
    sim_reset(NULL);
    D = sim_table();
    return 0;
}

static inline int setup_small(void **state)
{
    (void)state;
    sim_config_t c = {.memory = 64 * MB, .va_size = 1 * GB};
    sim_reset(&c);
    D = sim_table();
    return 0;
}

static inline int setup_two(void **state)
{
    (void)state;
    sim_config_t c = {.devices = 2, .memory = 256 * MB};
    sim_reset(&c);
    D = sim_table();
    return 0;
}

#endif
