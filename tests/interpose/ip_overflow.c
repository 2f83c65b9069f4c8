/* Interpose test: VMMHOOK_OVERFLOW=host through the preloaded library, with its reclaim thread
 * (docs/OVERFLOW.md; issue 29's probe end to end). A 1 GiB simulated device (SIM_MEMORY=1G) is
 * filled past its size with 64 MiB buffers (cuMemAlloc), then 200 temporaries of 2 MiB are
 * allocated, written, read back and freed: with the default VMMHOOK_OVERFLOW_RESERVE none of
 * them spills (the statistics' spills_small, per device too), the big buffers do. Then half of
 * the device's buffers are freed and vmm_prefetch_tag moves the spilled ones back in one pass:
 * contents kept, bytes_spilled 0 when it returns, and the host memory they used released by the
 * reclaim thread shortly after.
 */
#include <cuda.h>
#include <cudaTypedefs.h>

#include <stdint.h>
#include <time.h>

#include "ip_common.h"
#include "simdrv.h"

#define BIG 20
#define BIG_SIZE ((size_t)64 << 20)
#define TEMPS 200
#define TEMP_SIZE ((size_t)2 << 20)

#define ENTRIES(X) X(cuInit, v2000) X(cuDevicePrimaryCtxRetain, v7000) X(cuCtxSetCurrent, v4000) \
    X(cuMemAlloc, v3020) X(cuMemFree, v3020)
ENTRIES(IP_ENTRY_DECLARE)

static ip_sim_t sim;

static void fill(CUdeviceptr p, size_t n, unsigned char seed)
{
    static unsigned char buf[TEMP_SIZE];
    for (size_t i = 0; i < n && i < sizeof buf; i++)
        buf[i] = (unsigned char)(seed + i * 7);
    sim.sim_write(p, buf, n < sizeof buf ? n : sizeof buf);
}

static bool same(CUdeviceptr p, size_t n, unsigned char seed)
{
    static unsigned char buf[TEMP_SIZE];
    size_t k = n < sizeof buf ? n : sizeof buf;
    if (sim.sim_read(buf, p, k) != CUDA_SUCCESS)
        return false;
    for (size_t i = 0; i < k; i++)
        if (buf[i] != (unsigned char)(seed + i * 7))
            return false;
    return true;
}

/* The number after "key": in the JSON (the first occurrence after `after`, if given). */
static long long json_number(const char *js, const char *after, const char *key)
{
    const char *from = after ? strstr(js, after) : js;
    const char *k = from ? strstr(from, key) : NULL;
    return k ? atoll(k + strlen(key)) : -1;
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    ip_require_preloaded();
    ip_driver_t d = ip_open_driver();
    sim = d.sim;
    PFN_cuGetProcAddress_v12000 getproc = d.getproc;
    ENTRIES(IP_ENTRY_FETCH)
    int (*stats_json)(char *, size_t) =
        (int (*)(char *, size_t))ip_need_dlsym(RTLD_DEFAULT, "vmm_stats_json");
    int (*prefetch_tag)(const char *) =
        (int (*)(const char *))ip_need_dlsym(RTLD_DEFAULT, "vmm_prefetch_tag");
    CUcontext ctx = NULL;
    CHECK_RC(p_cuInit(0), CUDA_SUCCESS, "cuInit");
    CHECK_RC(p_cuDevicePrimaryCtxRetain(&ctx, 0), CUDA_SUCCESS, "cuDevicePrimaryCtxRetain");
    CHECK_RC(p_cuCtxSetCurrent(ctx), CUDA_SUCCESS, "cuCtxSetCurrent");

    CUdeviceptr big[BIG] = {0};
    for (int i = 0; i < BIG; i++) {
        CHECK_RC(p_cuMemAlloc(&big[i], BIG_SIZE), CUDA_SUCCESS, "cuMemAlloc(64 MiB) #%d", i);
        fill(big[i], 1 << 20, (unsigned char)i);
    }
    CHECK(sim.sim_host_used() > 0, "the device filled past its size: %zu MiB on the host",
          sim.sim_host_used() >> 20);
    int wrong = 0;
    for (int t = 0; t < TEMPS; t++) {
        CUdeviceptr p = 0;
        if (p_cuMemAlloc(&p, TEMP_SIZE) != CUDA_SUCCESS) {
            wrong++;
            continue;
        }
        fill(p, TEMP_SIZE, (unsigned char)(t + 100));
        wrong += !same(p, TEMP_SIZE, (unsigned char)(t + 100));
        p_cuMemFree(p);
    }
    CHECK(wrong == 0, "%d temporaries allocated, written and read back right (%d wrong)", TEMPS,
          wrong);
    static char js[1 << 16];
    CHECK(stats_json(js, sizeof js) > 0, "vmm_stats_json");
    long long spills = json_number(js, NULL, "\"spills\": ");
    long long small = json_number(js, NULL, "\"spills_small\": ");
    CHECK(spills == 5 && small == 0, "spills %lld (the big buffers past the reserve: 5), of them "
          "small %lld (want 0: no temporary spilled)", spills, small);
    CHECK(json_number(js, "\"devices\"", "\"spills_small\": ") == 0 &&
              json_number(js, "\"devices\"", "\"spills\": ") == 5,
          "per device: spills 5, spills_small 0");

    for (int i = 0; i < BIG / 2; i++) { /* room on the device for the spilled ones */
        CHECK_RC(p_cuMemFree(big[i]), CUDA_SUCCESS, "cuMemFree(big #%d)", i);
        big[i] = 0;
    }
    CHECK(prefetch_tag("default") == 0, "vmm_prefetch_tag(\"default\")");
    stats_json(js, sizeof js);
    CHECK(json_number(js, "\"bytes_spilled\"", "\"current\": ") == 0,
          "bytes_spilled 0 when it returns");
    int kept = 0;
    for (int i = BIG / 2; i < BIG; i++)
        kept += same(big[i], 1 << 20, (unsigned char)i);
    CHECK(kept == BIG / 2, "%d of %d buffers kept their contents through the move", kept,
          BIG / 2);
    /* The host chunks go from the reclaim thread, not in the call. */
    for (int i = 0; i < 200 && sim.sim_host_used(); i++)
        nanosleep(&(struct timespec){0, 10 * 1000 * 1000}, NULL);
    CHECK(sim.sim_host_used() == 0, "the host memory released by the reclaim thread (%zu left)",
          sim.sim_host_used());
    for (int i = BIG / 2; i < BIG; i++)
        CHECK_RC(p_cuMemFree(big[i]), CUDA_SUCCESS, "cuMemFree(big #%d)", i);
    return ip_finish("ip_overflow");
}
