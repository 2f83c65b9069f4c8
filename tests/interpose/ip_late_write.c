/* Interpose test: memory freed in one context is not handed out again while work of that
 * context submitted before the free can still write it (issue 14, "data corruption with two
 * contexts"; measured on the H200: 17 of 80 buffers overwritten under the hook, 0 natively).
 *
 * A context made with cuCtxCreate gets a buffer, a "kernel" (sim_launch_write: it runs only at
 * that context's next synchronization) that writes it, and the buffer is freed. Then, in the
 * primary context, buffers of the same size are allocated and zeroed, and only afterwards does
 * everything queued land (sim_flush). Natively cuMemFree lands the block's context's work
 * before it returns; under the hook the freed memory may be reused only after a wait on every
 * context of the device, not only the one the library saw first. Every buffer must read back
 * as zeroes.
 */
#include <cuda.h>
#include <cudaTypedefs.h>

#include <stdint.h>

#include "ip_common.h"
#include "simdrv.h"

#define ROUNDS 20
#define PER_ROUND 4
#define SIZE ((size_t)8 << 20)

static void *libcuda;
static PFN_cuGetProcAddress_v12000 getproc;

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    ip_require_preloaded();
    bool served = argc > 1 && strcmp(argv[1], "served") == 0;
    libcuda = ip_open_libcuda();
    ip_sim_t sim = ip_sim_controls(libcuda);
    getproc = ip_getproc(libcuda);
    PFN_cuInit_v2000 init = ip_fetch(getproc, "cuInit", 12000, 0);
    PFN_cuDevicePrimaryCtxRetain_v7000 retain =
        ip_fetch(getproc, "cuDevicePrimaryCtxRetain", 12000, 0);
    PFN_cuCtxSetCurrent_v4000 set_current = ip_fetch(getproc, "cuCtxSetCurrent", 12000, 0);
    PFN_cuCtxCreate_v12050 create = ip_fetch(getproc, "cuCtxCreate", 13000, 0);
    PFN_cuCtxDestroy_v4000 destroy = ip_fetch(getproc, "cuCtxDestroy", 12000, 0);
    PFN_cuMemAlloc_v3020 alloc = ip_fetch(getproc, "cuMemAlloc", 12000, 0);
    PFN_cuMemFree_v3020 mem_free = ip_fetch(getproc, "cuMemFree", 12000, 0);
    PFN_cuMemsetD8_v3020 memset_d8 = ip_fetch(getproc, "cuMemsetD8", 12000, 0);
    PFN_cuMemcpyDtoH_v3020 to_host = ip_fetch(getproc, "cuMemcpyDtoH", 12000, 0);

    CUcontext primary = NULL, other = NULL;
    CHECK_RC(init(0), CUDA_SUCCESS, "cuInit");
    CHECK_RC(retain(&primary, 0), CUDA_SUCCESS, "cuDevicePrimaryCtxRetain(0)");
    CHECK_RC(set_current(primary), CUDA_SUCCESS, "cuCtxSetCurrent(primary)");
    CUdeviceptr warm = 0; /* the library has seen the primary context first */
    CHECK_RC(alloc(&warm, SIZE), CUDA_SUCCESS, "cuMemAlloc in the primary context");
    CHECK_RC(create(&other, NULL, 0, 0), CUDA_SUCCESS, "cuCtxCreate(device 0)");

    static unsigned char host[SIZE];
    int late = 0, failures = 0;
    for (int round = 0; round < ROUNDS; round++) {
        CUdeviceptr victim = 0;
        failures += set_current(other) != CUDA_SUCCESS;
        failures += alloc(&victim, SIZE) != CUDA_SUCCESS;
        failures += sim.sim_launch_write(other, NULL, victim, SIZE, 0xee) != CUDA_SUCCESS;
        failures += mem_free(victim) != CUDA_SUCCESS;

        failures += set_current(primary) != CUDA_SUCCESS;
        CUdeviceptr fresh[PER_ROUND] = {0};
        for (int i = 0; i < PER_ROUND; i++) {
            failures += alloc(&fresh[i], SIZE) != CUDA_SUCCESS;
            failures += memset_d8(fresh[i], 0, SIZE) != CUDA_SUCCESS;
        }
        sim.sim_flush(); /* whatever was still queued lands now */
        for (int i = 0; i < PER_ROUND; i++) {
            failures += to_host(host, fresh[i], SIZE) != CUDA_SUCCESS;
            for (size_t k = 0; k < SIZE; k += 4096)
                if (host[k] != 0) {
                    late++;
                    break;
                }
            failures += mem_free(fresh[i]) != CUDA_SUCCESS;
        }
    }
    CHECK(failures == 0, "every call succeeded (%d did not)", failures);
    CHECK(late == 0,
          "%s: %d of %d buffers were overwritten by work of another context "
          "queued before the free",
          served ? "served" : "native", late, ROUNDS * PER_ROUND);
    CHECK_RC(mem_free(warm), CUDA_SUCCESS, "cuMemFree");
    CHECK_RC(destroy(other), CUDA_SUCCESS, "cuCtxDestroy");
    return ip_finish(served ? "ip_late_write served" : "ip_late_write native");
}
