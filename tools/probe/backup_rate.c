/* backup_rate: how fast can a first pause back device memory up into host memory nothing has
 * touched yet (issue 15's first-pause target: 8 GiB/s)? Each case copies the same device buffer
 * into fresh host memory and prints GiB/s over the whole operation, including mapping, zeroing
 * and any pinning it needs:
 *
 *   touched        pageable copy into memory already written (the driver's staging rate)
 *   fresh          pageable copy into fresh mmap'd memory with huge pages advised
 *   populate-N     the same while N helper threads populate the memory from its end backwards
 *                  (N=1 is what src/pause.c does at commit 6fff572)
 *   first-N        N threads populate all of it first, then the copy
 *   staging-T      the driver copies into two pinned staging buffers in turn (asynchronous), and
 *                  T threads copy each filled one into the fresh memory while the next fills
 *   staging+reg    staging-8/16M, and a thread registers (cuMemHostRegister, portable) each
 *                  40 MiB of the fresh memory as soon as the ring has filled it, as the
 *                  library's pinner does (src/staging/staging.c); the time includes the last
 *                  registration. Then reg-copyback: the copy back up from that pinned memory
 *                  (what the first resume does), and reg-free: unregistering it all
 *
 * GPU machine only. Build and run from the repository root:
 *   gcc -O2 -o /tmp/backup_rate tools/probe/backup_rate.c -I/usr/local/cuda/include -lcuda -lpthread
 *   /tmp/backup_rate [GiB]            # default 8
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

#define CK(x)                                                                                      \
    do {                                                                                           \
        CUresult rc_ = (x);                                                                        \
        if (rc_ != CUDA_SUCCESS) {                                                                 \
            fprintf(stderr, "%s:%d: %s -> %d\n", __FILE__, __LINE__, #x, (int)rc_);                \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define MiB ((size_t)1 << 20)
#define HUGE (2 * MiB)
#define PIECE (64 * MiB)

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static char *fresh(size_t len)
{
    char *raw = mmap(NULL, len + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    char *p = (char *)(((uintptr_t)raw + HUGE - 1) & ~(uintptr_t)(HUGE - 1));
    madvise(p, len, MADV_HUGEPAGE);
    return p; /* the probe never unmaps: the process is short */
}

static size_t total;
static CUdeviceptr dev;

/* ---- helpers that populate from the end backwards, interleaved by piece ---- */
typedef struct {
    char *base;
    size_t len;
    int id, n;
    atomic_bool *stop;
} pop_t;

static void *populate(void *arg)
{
    pop_t *p = arg;
    size_t pieces = (p->len + PIECE - 1) / PIECE;
    for (size_t k = p->id; k < pieces; k += p->n) {
        if (p->stop && atomic_load(p->stop))
            break;
        size_t i = pieces - 1 - k;
        size_t off = i * PIECE, n = p->len - off < PIECE ? p->len - off : PIECE;
        if (madvise(p->base + off, n, MADV_POPULATE_WRITE) != 0)
            memset(p->base + off, 0, n);
    }
    return NULL;
}

static void start_pop(pthread_t *t, pop_t *a, int n, char *base, atomic_bool *stop)
{
    for (int i = 0; i < n; i++) {
        a[i] = (pop_t){base, total, i, n, stop};
        pthread_create(&t[i], NULL, populate, &a[i]);
    }
}

static void copy_pieces(char *host)
{
    for (size_t off = 0; off < total; off += PIECE) {
        size_t n = total - off < PIECE ? total - off : PIECE;
        CK(cuMemcpyDtoH(host + off, dev + off, n));
    }
}

static void report(const char *name, double t)
{
    printf("%-14s %6.2f GiB/s  (%.1f ms)\n", name, total / (double)(1 << 30) / t, t * 1e3);
    fflush(stdout);
}

static void case_touched(void)
{
    char *h = fresh(total);
    memset(h, 1, total);
    double t0 = now_s();
    copy_pieces(h);
    report("touched", now_s() - t0);
}

static void case_fresh(void)
{
    double t0 = now_s();
    char *h = fresh(total);
    copy_pieces(h);
    report("fresh", now_s() - t0);
}

static void case_populate(int n, bool first)
{
    pthread_t t[64];
    pop_t a[64];
    atomic_bool stop = false;
    double t0 = now_s();
    char *h = fresh(total);
    start_pop(t, a, n, h, &stop);
    if (first)
        for (int i = 0; i < n; i++)
            pthread_join(t[i], NULL);
    copy_pieces(h);
    if (!first) {
        atomic_store(&stop, true);
        for (int i = 0; i < n; i++)
            pthread_join(t[i], NULL);
    }
    char name[32];
    snprintf(name, sizeof name, "%s-%d", first ? "first" : "populate", n);
    report(name, now_s() - t0);
}

/* ---- staging ring ---- */
typedef struct {
    const char *src;
    char *dst;
    size_t len;
} cp_t;

static void *cpu_copy(void *arg)
{
    cp_t *c = arg;
    memcpy(c->dst, c->src, c->len);
    return NULL;
}

/* The registering thread of staging+reg: registers chunk i once `ready` says the ring has
 * filled it (polling: the probe's own stand-in for the library's queue). */
typedef struct {
    char *base;
    size_t chunk, nchunks;
    atomic_size_t ready;
    CUcontext ctx;
    int failed;
} reg_t;

static void *registrar(void *arg)
{
    reg_t *r = arg;
    CK(cuCtxSetCurrent(r->ctx));
    for (size_t i = 0; i < r->nchunks; i++) {
        while (atomic_load(&r->ready) <= i)
            usleep(20);
        size_t off = i * r->chunk, len = total - off < r->chunk ? total - off : r->chunk;
        if (cuMemHostRegister(r->base + off, len, CU_MEMHOSTREGISTER_PORTABLE) != CUDA_SUCCESS)
            r->failed++;
    }
    return NULL;
}

static void case_staging_reg(int nthreads, size_t slot, size_t chunk);

static void case_staging(int nthreads, size_t slot)
{
    case_staging_reg(nthreads, slot, 0);
}

/* chunk 0: the plain ring; else a registering thread beside it (staging+reg). */
static void case_staging_reg(int nthreads, size_t slot, size_t chunk)
{
    double t0 = now_s();
    char *h = fresh(total);
    void *stage[2];
    CK(cuMemHostAlloc(&stage[0], slot, 0));
    CK(cuMemHostAlloc(&stage[1], slot, 0));
    double t_pin = now_s() - t0;
    CUstream s;
    CUevent ev[2];
    CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CK(cuEventCreate(&ev[0], CU_EVENT_DISABLE_TIMING));
    CK(cuEventCreate(&ev[1], CU_EVENT_DISABLE_TIMING));
    size_t npieces = (total + slot - 1) / slot;
    reg_t reg = {.base = h, .chunk = chunk, .nchunks = chunk ? (total + chunk - 1) / chunk : 0};
    pthread_t reg_thread;
    if (chunk) {
        CK(cuCtxGetCurrent(&reg.ctx));
        atomic_init(&reg.ready, 0);
        pthread_create(&reg_thread, NULL, registrar, &reg);
    }
    /* fill slot 0 */
    size_t n0 = total < slot ? total : slot;
    CK(cuMemcpyDtoHAsync(stage[0], dev, n0, s));
    CK(cuEventRecord(ev[0], s));
    for (size_t i = 0; i < npieces; i++) {
        int cur = (int)(i % 2);
        size_t off = i * slot, n = total - off < slot ? total - off : slot;
        CK(cuEventSynchronize(ev[cur]));
        if (i + 1 < npieces) {
            size_t off2 = (i + 1) * slot, n2 = total - off2 < slot ? total - off2 : slot;
            CK(cuMemcpyDtoHAsync(stage[1 - cur], dev + off2, n2, s));
            CK(cuEventRecord(ev[1 - cur], s));
        }
        pthread_t t[64];
        cp_t c[64];
        size_t part = (n / nthreads + 4095) & ~(size_t)4095;
        int used = 0;
        for (int k = 0; k < nthreads; k++) {
            size_t a = (size_t)k * part;
            if (a >= n)
                break;
            c[k] = (cp_t){(char *)stage[cur] + a, h + off + a, n - a < part ? n - a : part};
            pthread_create(&t[k], NULL, cpu_copy, &c[k]);
            used++;
        }
        for (int k = 0; k < used; k++)
            pthread_join(t[k], NULL);
        if (chunk) /* chunks wholly filled so far (all of them after the last piece) */
            atomic_store(&reg.ready, i + 1 == npieces ? reg.nchunks : (off + n) / chunk);
    }
    if (chunk)
        pthread_join(reg_thread, NULL);
    double t = now_s() - t0;
    char name[40];
    if (chunk)
        snprintf(name, sizeof name, "staging+reg");
    else
        snprintf(name, sizeof name, "staging-%d/%zuM", nthreads, slot / MiB);
    printf("%-14s %6.2f GiB/s  (%.1f ms, of which pinning the staging buffers %.1f ms)\n", name,
           total / (double)(1 << 30) / t, t * 1e3, t_pin * 1e3);
    /* verify */
    unsigned char *chk = malloc(MiB);
    CK(cuMemcpyDtoH(chk, dev + total - MiB, MiB));
    if (memcmp(chk, h + total - MiB, MiB) != 0)
        printf("  MISMATCH\n");
    free(chk);
    CK(cuMemFreeHost(stage[0]));
    CK(cuMemFreeHost(stage[1]));
    CK(cuStreamDestroy(s));
    if (chunk) {
        if (reg.failed)
            printf("  %d registrations failed\n", reg.failed);
        double t1 = now_s();
        CK(cuMemcpyHtoD(dev, h, total));
        double tc = now_s() - t1;
        printf("%-14s %6.2f GiB/s  (%.1f ms: copy back up from the registered memory)\n",
               "reg-copyback", total / (double)(1 << 30) / tc, tc * 1e3);
        t1 = now_s();
        for (size_t i = 0; i < reg.nchunks; i++)
            cuMemHostUnregister(h + i * chunk);
        tc = now_s() - t1;
        printf("%-14s %6.2f GiB/s  (%.1f ms: unregistering it)\n", "reg-free",
               total / (double)(1 << 30) / tc, tc * 1e3);
        munmap(h, total);
    }
}

int main(int argc, char **argv)
{
    size_t gib = argc > 1 ? strtoul(argv[1], NULL, 10) : 8;
    total = gib << 30;
    CK(cuInit(0));
    CUdevice d;
    CUcontext c;
    CK(cuDeviceGet(&d, 0));
    CK(cuDevicePrimaryCtxRetain(&c, d));
    CK(cuCtxSetCurrent(c));
    CK(cuMemAlloc(&dev, total));
    CK(cuMemsetD32(dev, 0x5a5a5a5a, total / 4));
    CK(cuCtxSynchronize());
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    char thp[128] = "?";
    if (f) {
        if (!fgets(thp, sizeof thp, f))
            thp[0] = 0;
        fclose(f);
    }
    printf("backup_rate: %zu GiB, transparent huge pages: %s", gib, thp);
    case_touched();
    case_fresh();
    case_populate(1, false);
    case_populate(4, false);
    case_populate(8, false);
    case_populate(8, true);
    case_staging(4, 64 * MiB);
    case_staging(8, 64 * MiB);
    case_staging(8, 16 * MiB);
    case_staging_reg(8, 16 * MiB, 40 * MiB);
    return 0;
}
