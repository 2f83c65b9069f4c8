/* Helpers for the interpose suite: checks that print what they checked, where a function lives,
 * what the process has mapped, a capture of this process's own stderr (the library writes its
 * diagnostics to fd 2), the served/native argument, and, for the programs that include
 * <cuda.h> first, the simulated driver loaded as cudart loads the driver.
 *
 * Every program of the suite runs with LD_PRELOAD=libvmmhook.so and first makes sure the
 * preload is really there (ip_require_preloaded), so that no check can pass for want of the
 * library. */
#ifndef IP_COMMON_H
#define IP_COMMON_H

#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static int ip_failures;
static int ip_checks;

/* One line per check: "ok   what" or "FAIL what". */
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        ip_checks++;                                                                               \
        if (cond) {                                                                                \
            printf("ok   ");                                                                       \
        } else {                                                                                   \
            ip_failures++;                                                                         \
            printf("FAIL (%s:%d: %s) ", __FILE__, __LINE__, #cond);                                \
        }                                                                                          \
        printf(__VA_ARGS__);                                                                       \
        printf("\n");                                                                              \
        fflush(stdout);                                                                            \
    } while (0)

/* A CUresult check: prints the code got and the code expected. */
#define CHECK_RC(got, want, ...)                                                                   \
    do {                                                                                           \
        int got_ = (int)(got), want_ = (int)(want);                                                \
        CHECK(got_ == want_, "%s -> %d (want %d)", ip_fmt(__VA_ARGS__), got_, want_);             \
    } while (0)

static inline const char *ip_fmt(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static inline const char *ip_fmt(const char *fmt, ...)
{
    static __thread char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return buf;
}

static inline int ip_finish(const char *program)
{
    printf("%s: %d checks, %d failed\n", program, ip_checks, ip_failures);
    return ip_failures == 0 ? 0 : 1;
}

/* Whether /proc/self/maps names a file whose path contains needle. */
static inline bool ip_maps_has(const char *needle)
{
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f)
        return false;
    char line[4096];
    bool found = false;
    while (!found && fgets(line, sizeof line, f))
        found = strstr(line, needle) != NULL;
    fclose(f);
    return found;
}

/* The file of the object that holds p ("" when none). */
static inline const char *ip_object_of(const void *p)
{
    Dl_info di;
    if (p == NULL || !dladdr(p, &di) || di.dli_fname == NULL)
        return "";
    return di.dli_fname;
}

static inline bool ip_in_hook(const void *p)
{
    return strstr(ip_object_of(p), "libvmmhook") != NULL;
}

static inline bool ip_in_libcuda(const void *p)
{
    return strstr(ip_object_of(p), "libcuda.so") != NULL;
}

/* Stops the program unless libvmmhook.so is preloaded: every check below assumes it. */
static inline void ip_require_preloaded(void)
{
    if (!ip_maps_has("libvmmhook")) {
        printf("FAIL libvmmhook.so is not loaded in this process (LD_PRELOAD=%s)\n",
               getenv("LD_PRELOAD") ? getenv("LD_PRELOAD") : "(unset)");
        exit(1);
    }
    printf("ok   libvmmhook.so is preloaded\n");
}

/* Capture of fd 2 into a memfd, so that a program can check what the library printed. */
typedef struct ip_capture {
    int saved_fd;
    int mem_fd;
} ip_capture_t;

static inline void ip_capture_begin(ip_capture_t *c)
{
    fflush(stderr);
    c->saved_fd = dup(2);
    c->mem_fd = memfd_create("ip-stderr", 0);
    if (c->saved_fd < 0 || c->mem_fd < 0 || dup2(c->mem_fd, 2) < 0) {
        perror("ip_capture_begin");
        exit(1);
    }
}

/* What was written since ip_capture_begin (or the last read), NUL-terminated, at most n-1
 * bytes; capture goes on. */
static inline size_t ip_capture_read(ip_capture_t *c, char *buf, size_t n)
{
    off_t end = lseek(c->mem_fd, 0, SEEK_CUR);
    size_t got = 0;
    if (end > 0) {
        ssize_t r = pread(c->mem_fd, buf, n - 1, 0);
        got = r > 0 ? (size_t)r : 0;
    }
    buf[got] = '\0';
    return got;
}

/* Restores fd 2 and copies what was captured to stdout, so that the test log shows it. */
static inline void ip_capture_end(ip_capture_t *c)
{
    static char text[1 << 16];
    size_t n = ip_capture_read(c, text, sizeof text);
    dup2(c->saved_fd, 2);
    close(c->saved_fd);
    close(c->mem_fd);
    if (n)
        printf("---- stderr captured ----\n%s---- end of stderr ----\n", text);
}

static inline size_t ip_count_substr(const char *hay, const char *needle)
{
    size_t k = 0;
    for (const char *p = hay; (p = strstr(p, needle)) != NULL; p += strlen(needle))
        k++;
    return k;
}

/* The run's mode from the one argument "served" or "native" (true: served), the usage on stderr
 * and exit status 2 otherwise. Then stdout line-buffered (the test log interleaves it with the
 * library's stderr), what the run expects printed, and the preload made sure of. */
static inline bool ip_served_arg(int argc, char **argv, const char *program)
{
    if (argc != 2 || (strcmp(argv[1], "served") && strcmp(argv[1], "native"))) {
        fprintf(stderr, "usage: %s served|native\n", argv[0]);
        exit(2);
    }
    bool served = !strcmp(argv[1], "served");
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("%s: expecting %s allocations\n", program, served ? "served" : "native");
    ip_require_preloaded();
    return served;
}

#ifdef CUDA_VERSION
/* ---- the driver, for programs that include <cuda.h> first -------------------------------- */
#include <cudaTypedefs.h>

#include "simdrv.h"

/* dlsym that stops the program when the symbol is missing: nothing can be checked without it. */
static inline void *ip_need_dlsym(void *h, const char *name)
{
    void *p = dlsym(h, name);
    if (!p) {
        printf("FAIL dlsym(%s): %s\n", name, dlerror());
        exit(1);
    }
    return p;
}

/* libcuda.so.1 (the simulated driver, LD_LIBRARY_PATH) opened as cudart opens it: RTLD_LOCAL,
 * so that its symbols reach the program only through dlsym and cuGetProcAddress. */
static inline void *ip_open_libcuda(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        printf("FAIL dlopen(libcuda.so.1): %s\n", dlerror());
        exit(1);
    }
    return h;
}

/* What cudart asks the opened driver for first: dlsym(h, "cuGetProcAddress_v2"), which the
 * preloaded library answers with its own (checked). */
static inline PFN_cuGetProcAddress_v12000 ip_getproc(void *libcuda)
{
    PFN_cuGetProcAddress_v12000 getproc =
        (PFN_cuGetProcAddress_v12000)ip_need_dlsym(libcuda, "cuGetProcAddress_v2");
    CHECK(ip_in_hook((void *)getproc), "dlsym(libcuda, \"cuGetProcAddress_v2\") is the library's");
    return getproc;
}

/* The entry point name through getproc, as cudart fetches one; stops the program when there is
 * none. */
static inline void *ip_fetch(PFN_cuGetProcAddress_v12000 getproc, const char *name, int version,
                             cuuint64_t flags)
{
    void *fn = NULL;
    CUdriverProcAddressQueryResult st;
    CUresult rc = getproc(name, &fn, version, flags, &st);
    if (rc != CUDA_SUCCESS || !fn) {
        printf("FAIL cuGetProcAddress(%s, %d, %llu) -> %d\n", name, version,
               (unsigned long long)flags, rc);
        exit(1);
    }
    return fn;
}

/* The simulated driver's control functions (simdrv.h) that the programs use, looked up in the
 * opened libcuda.so.1 like any of its symbols (a program that dlopens the driver cannot link
 * them). */
#define IP_SIM_FNS(X)                                                                              \
    X(sim_live_native) X(sim_live_allocations) X(sim_live_handles) X(sim_live_reservations)        \
    X(sim_live_mappings) X(sim_live_contexts) X(sim_is_mapped) X(sim_access_flags)                 \
    X(sim_ledger_empty) X(sim_ledger_dump) X(sim_calls) X(sim_write) X(sim_read)                   \
    X(sim_device_capacity) X(sim_device_used) X(sim_get_proc_address) X(sim_capture_refusals)    \
    X(sim_launch_write) X(sim_flush) X(sim_host_used)
#define IP_SIM_FIELD(n) __typeof__(&n) n;
typedef struct ip_sim {
    IP_SIM_FNS(IP_SIM_FIELD)
} ip_sim_t;
#undef IP_SIM_FIELD

static inline ip_sim_t ip_sim_controls(void *libcuda)
{
    ip_sim_t s;
#define IP_SIM_GET(n) s.n = (__typeof__(s.n))ip_need_dlsym(libcuda, #n);
    IP_SIM_FNS(IP_SIM_GET)
#undef IP_SIM_GET
    return s;
}

/* A program's entry points, each named once: the program lists them as X(name, version) in a
 * macro, where PFN_<name>_<version> is cudaTypedefs.h's type; IP_ENTRY_DECLARE declares each as
 * p_<name>, and IP_ENTRY_FETCH, where a `getproc` is in scope, fetches each as cudart does (CUDA
 * 12000, no flags). Entry points fetched otherwise (another version, the per-thread flavour) are
 * declared and fetched by hand beside them. */
#define IP_ENTRY_DECLARE(name, version) static PFN_##name##_##version p_##name;
#define IP_ENTRY_FETCH(name, version) p_##name = ip_fetch(getproc, #name, 12000, 0);

/* What a program that dlopens the driver holds of it, from ip_open_driver. */
typedef struct ip_driver {
    void *libcuda;                       /* ip_open_libcuda */
    PFN_cuGetProcAddress_v12000 getproc; /* ip_getproc: the library's */
    ip_sim_t sim;                        /* the simulated driver's controls */
    int (*vmm_owns)(const void *);       /* the library's API, found as any program finds it */
    size_t (*vmm_trim)(void);
} ip_driver_t;

static inline ip_driver_t ip_open_driver(void)
{
    ip_driver_t d;
    d.libcuda = ip_open_libcuda();
    d.sim = ip_sim_controls(d.libcuda);
    d.getproc = ip_getproc(d.libcuda);
    d.vmm_owns = (int (*)(const void *))ip_need_dlsym(RTLD_DEFAULT, "vmm_owns");
    d.vmm_trim = (size_t(*)(void))ip_need_dlsym(RTLD_DEFAULT, "vmm_trim");
    return d;
}

/* cuInit, then devices 0 and 1 (SIM_DEVICES=2) and their primary contexts (in ctx), device 0's
 * made current: each call fetched through getproc and checked. */
static inline void ip_two_primary_contexts(PFN_cuGetProcAddress_v12000 getproc, CUcontext ctx[2])
{
    PFN_cuInit_v2000 init = ip_fetch(getproc, "cuInit", 12000, 0);
    PFN_cuDeviceGet_v2000 device_get = ip_fetch(getproc, "cuDeviceGet", 12000, 0);
    PFN_cuDevicePrimaryCtxRetain_v7000 retain =
        ip_fetch(getproc, "cuDevicePrimaryCtxRetain", 12000, 0);
    PFN_cuCtxSetCurrent_v4000 set_current = ip_fetch(getproc, "cuCtxSetCurrent", 12000, 0);
    CUdevice dev[2];
    CHECK_RC(init(0), CUDA_SUCCESS, "cuInit");
    CHECK_RC(device_get(&dev[0], 0), CUDA_SUCCESS, "cuDeviceGet(0)");
    CHECK_RC(device_get(&dev[1], 1), CUDA_SUCCESS, "cuDeviceGet(1) (SIM_DEVICES=2)");
    CHECK_RC(retain(&ctx[0], dev[0]), CUDA_SUCCESS, "cuDevicePrimaryCtxRetain(0)");
    CHECK_RC(retain(&ctx[1], dev[1]), CUDA_SUCCESS, "cuDevicePrimaryCtxRetain(1)");
    CHECK_RC(set_current(ctx[0]), CUDA_SUCCESS, "cuCtxSetCurrent(device 0)");
}

/* For programs linked against the driver (-lcuda style): cuInit, and device 0's primary context
 * retained and made current, each call checked. */
static inline void ip_linked_primary_context(void)
{
    CUdevice dev;
    CUcontext ctx = NULL;
    CHECK_RC(cuInit(0), CUDA_SUCCESS, "cuInit");
    CHECK_RC(cuDeviceGet(&dev, 0), CUDA_SUCCESS, "cuDeviceGet");
    CHECK_RC(cuDevicePrimaryCtxRetain(&ctx, dev), CUDA_SUCCESS, "cuDevicePrimaryCtxRetain");
    CHECK_RC(cuCtxSetCurrent(ctx), CUDA_SUCCESS, "cuCtxSetCurrent");
}
#endif

#endif
