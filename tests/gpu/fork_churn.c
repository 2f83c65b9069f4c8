/* fork_churn: fork while other threads allocate and free (issue 16, "fork").
 *
 * Threads churn cuMemAlloc/cuMemFree (packed and chunk-sized buffers, each written with
 * cuMemsetD8) while the main thread forks children, about 25 ms apart. Each child calls
 * cuMemFree on a buffer the parent allocated and cuMemAlloc once (CUDA is not usable in a child
 * once the parent initialised it: natively the driver answers with an error), writes both codes
 * to a pipe and exits with exit(0), so that atexit handlers (the hook's reports) run. A child
 * still alive 10 s after its fork is killed and counted as hung. Each child's stderr goes to a
 * file of its own; a child that reports leaked buffers ("still allocated at exit") is counted:
 * a child owns none of its parent's buffers.
 *
 * Plain C on the driver API, linked with -lcuda: it runs on a GPU and on the simulated driver
 * (meson's gpu-sim suite, SIM_FORK_STRICT=1: the simulated driver then answers a forked child
 * as the real one does). Same output conventions as gpu_common.h (R/I lines, exit 0/1/77).
 * Usage: fork_churn [children=40] [threads=4]
 * Compared part (R lines): hung children, children reporting leaks, and how many children gave
 * each (cuMemFree, cuMemAlloc, exit status) result. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <cuda.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

static int g_checks, g_failed;

#define R(...) (printf("R " __VA_ARGS__), printf("\n"))
#define INFO(...) (printf("I " __VA_ARGS__), printf("\n"))
#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        g_checks++;                                                                                \
        if (!(cond)) {                                                                             \
            g_failed++;                                                                            \
            printf("FAIL fork_churn.c:%d: ", __LINE__);                                            \
            printf(__VA_ARGS__);                                                                   \
            printf("\n");                                                                          \
        }                                                                                          \
    } while (0)

enum { MAX_CHILDREN = 256, SLOTS = 32 };
static const double kHangSeconds = 10.0;

static CUcontext g_ctx;
static int g_stop;
static long long g_churn_ops, g_churn_errors;

static void *churn(void *arg)
{
    uint64_t rng = 0x9E3779B97F4A7C15ull * (uint64_t)((uintptr_t)arg + 1);
    CUdeviceptr live[SLOTS] = {0};
    if (cuCtxSetCurrent(g_ctx) != CUDA_SUCCESS) {
        __atomic_add_fetch(&g_churn_errors, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    while (!__atomic_load_n(&g_stop, __ATOMIC_RELAXED)) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        int i = (int)(rng % SLOTS);
        if (live[i]) {
            if (cuMemFree(live[i]) != CUDA_SUCCESS)
                __atomic_add_fetch(&g_churn_errors, 1, __ATOMIC_RELAXED);
            live[i] = 0;
        } else {
            size_t n = (rng >> 8) % 4 == 0 ? (size_t)(1 + (rng >> 16) % 24) * MiB
                                           : (size_t)(1 + (rng >> 16) % (256 * KiB));
            if (cuMemAlloc(&live[i], n) != CUDA_SUCCESS) {
                __atomic_add_fetch(&g_churn_errors, 1, __ATOMIC_RELAXED);
                live[i] = 0;
            } else if (cuMemsetD8(live[i], (unsigned char)i, n) != CUDA_SUCCESS) {
                __atomic_add_fetch(&g_churn_errors, 1, __ATOMIC_RELAXED);
            }
        }
        __atomic_add_fetch(&g_churn_ops, 1, __ATOMIC_RELAXED);
    }
    for (int i = 0; i < SLOTS; i++)
        if (live[i] && cuMemFree(live[i]) != CUDA_SUCCESS)
            __atomic_add_fetch(&g_churn_errors, 1, __ATOMIC_RELAXED);
    return NULL;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

typedef struct child {
    pid_t pid;
    int rfd;
    double t0;
    int done, hung, status;
    char answer[64];
    size_t alen;
    char errpath[160];
} child_t;

/* In the child: the CUDA calls, their codes to the pipe, and exit(0). Another thread of the
 * parent may have held any lock at the fork; what hangs here is what the test looks for. */
static void child_main(int wfd, const char *errpath, CUdeviceptr parent_buf)
{
    int fd = open(errpath, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) {
        dup2(fd, 2);
        close(fd);
    }
    int rf = (int)cuMemFree(parent_buf);
    CUdeviceptr d = 0;
    int ra = (int)cuMemAlloc(&d, 1 * MiB);
    char buf[64];
    int n = snprintf(buf, sizeof buf, "%d %d", rf, ra);
    if (write(wfd, buf, (size_t)n) != n)
        _exit(3);
    close(wfd);
    exit(0);
}

static void read_answer(child_t *c)
{
    ssize_t r;
    while (c->alen < sizeof c->answer - 1 &&
           (r = read(c->rfd, c->answer + c->alen, sizeof c->answer - 1 - c->alen)) > 0)
        c->alen += (size_t)r;
    c->answer[c->alen] = 0;
}

/* Distinct result lines and their counts. */
static char g_keys[MAX_CHILDREN][96];
static int g_counts[MAX_CHILDREN], g_nkeys;

static void count_key(const char *k)
{
    for (int i = 0; i < g_nkeys; i++)
        if (strcmp(g_keys[i], k) == 0) {
            g_counts[i]++;
            return;
        }
    snprintf(g_keys[g_nkeys], sizeof g_keys[0], "%s", k);
    g_counts[g_nkeys++] = 1;
}

static int cmp_keys(const void *a, const void *b)
{
    return strcmp(g_keys[*(const int *)a], g_keys[*(const int *)b]);
}

static int finish(void)
{
    if (g_failed) {
        printf("FAIL: fork_churn (%d of %d checks failed)\n", g_failed, g_checks);
        return 1;
    }
    printf("PASS: fork_churn (%d checks)\n", g_checks);
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    int nchildren = argc > 1 ? atoi(argv[1]) : 40;
    int nthreads = argc > 2 ? atoi(argv[2]) : 4;
    if (nchildren < 1 || nchildren > MAX_CHILDREN)
        nchildren = 40;
    if (nthreads < 1 || nthreads > 64)
        nthreads = 4;
    CUresult r = cuInit(0);
    int ndev = 0;
    if (r == CUDA_SUCCESS)
        r = cuDeviceGetCount(&ndev);
    if (r != CUDA_SUCCESS || ndev == 0) {
        printf("SKIP: no CUDA device: cuInit/cuDeviceGetCount -> %d, %d devices\n", (int)r, ndev);
        printf("SKIP: fork_churn (exit 77)\n");
        return 77;
    }
    CUdevice dev = 0;
    CHECK(cuDeviceGet(&dev, 0) == CUDA_SUCCESS, "cuDeviceGet");
    CHECK(cuDevicePrimaryCtxRetain(&g_ctx, dev) == CUDA_SUCCESS, "cuDevicePrimaryCtxRetain");
    CHECK(cuCtxSetCurrent(g_ctx) == CUDA_SUCCESS, "cuCtxSetCurrent");
    if (g_failed)
        return finish();
    int hooked = dlsym(RTLD_DEFAULT, "vmm_owns") != NULL;
    const char *ex = getenv("GPUTEST_EXPECT_HOOK");
    INFO("hook: %s; expected: %s", hooked ? "loaded" : "absent", ex && ex[0] == '1' ? "yes" : "no");
    if (ex && ex[0] == '1')
        CHECK(hooked, "GPUTEST_EXPECT_HOOK=1 but vmm_owns is not visible: the hook is not loaded");
    R("children=%d threads=%d", nchildren, nthreads);

    CUdeviceptr parent_buf = 0;
    CHECK(cuMemAlloc(&parent_buf, 4 * MiB) == CUDA_SUCCESS, "cuMemAlloc(parent buffer)");

    pthread_t th[64];
    for (int t = 0; t < nthreads; t++)
        pthread_create(&th[t], NULL, churn, (void *)(uintptr_t)t);
    while (__atomic_load_n(&g_churn_ops, __ATOMIC_RELAXED) < 200) /* the churn is under way */
        usleep(1000);

    static child_t kids[MAX_CHILDREN];
    const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    int started = 0;
    for (int i = 0; i < nchildren; i++) {
        child_t *c = &kids[i];
        snprintf(c->errpath, sizeof c->errpath, "%s/fork_churn.%d.%d.err", tmp, (int)getpid(), i);
        int p[2];
        if (pipe(p) != 0) {
            CHECK(0, "pipe failed");
            break;
        }
        fflush(NULL);
        c->t0 = now_s();
        pid_t pid = fork();
        if (pid == 0) {
            close(p[0]);
            child_main(p[1], c->errpath, parent_buf);
        }
        close(p[1]);
        if (pid < 0) {
            CHECK(0, "fork failed");
            close(p[0]);
            break;
        }
        c->pid = pid;
        c->rfd = p[0];
        fcntl(c->rfd, F_SETFL, O_NONBLOCK);
        started++;
        usleep(25000);
    }

    /* Every child gets up to kHangSeconds from its own fork. */
    int left = started;
    while (left > 0) {
        for (int i = 0; i < started; i++) {
            child_t *c = &kids[i];
            if (c->done)
                continue;
            read_answer(c);
            int st = 0;
            pid_t w = waitpid(c->pid, &st, WNOHANG);
            if (w == c->pid) {
                read_answer(c);
                c->status = st;
                c->done = 1;
                left--;
            } else if (now_s() - c->t0 > kHangSeconds) {
                kill(c->pid, SIGKILL);
                waitpid(c->pid, &st, 0);
                c->status = st;
                c->hung = c->done = 1;
                left--;
            }
        }
        usleep(5000);
    }
    __atomic_store_n(&g_stop, 1, __ATOMIC_RELAXED);
    for (int t = 0; t < nthreads; t++)
        pthread_join(th[t], NULL);

    int hung = 0, leaky = 0;
    for (int i = 0; i < started; i++) {
        child_t *c = &kids[i];
        close(c->rfd);
        char key[96];
        if (c->hung) {
            hung++;
            snprintf(key, sizeof key, "hung (killed)");
        } else if (WIFEXITED(c->status)) {
            snprintf(key, sizeof key, "cuMemFree,cuMemAlloc=%s exit %d",
                     c->alen ? c->answer : "(none)", WEXITSTATUS(c->status));
        } else {
            snprintf(key, sizeof key, "cuMemFree,cuMemAlloc=%s signal %d",
                     c->alen ? c->answer : "(none)",
                     WIFSIGNALED(c->status) ? WTERMSIG(c->status) : -1);
        }
        count_key(key);
        FILE *f = fopen(c->errpath, "r");
        if (f) {
            char line[512];
            int leak = 0, shown = 0;
            while (fgets(line, sizeof line, f)) {
                if (strstr(line, "still allocated at exit"))
                    leak = 1;
                line[strcspn(line, "\n")] = 0;
                if (shown < 3 && line[0]) {
                    INFO("child %d stderr: %s", i, line);
                    shown++;
                }
            }
            fclose(f);
            leaky += leak;
        }
        unlink(c->errpath);
    }
    int order[MAX_CHILDREN];
    for (int i = 0; i < g_nkeys; i++)
        order[i] = i;
    qsort(order, (size_t)g_nkeys, sizeof order[0], cmp_keys);
    for (int i = 0; i < g_nkeys; i++)
        R("children %s: %d", g_keys[order[i]], g_counts[order[i]]);
    R("hung=%d children_reporting_leaks=%d", hung, leaky);
    INFO("churn: %lld operations, %lld errors", g_churn_ops, g_churn_errors);
    CHECK(hung == 0, "%d of %d children hung (killed after %.0f s)", hung, started, kHangSeconds);
    CHECK(leaky == 0, "%d children reported leaks at exit (they own none of the parent's buffers)",
          leaky);
    CHECK(g_churn_errors == 0, "the churn threads saw %lld errors", g_churn_errors);
    CHECK(cuMemFree(parent_buf) == CUDA_SUCCESS, "cuMemFree(parent buffer)");
    CHECK(cuCtxSynchronize() == CUDA_SUCCESS, "final cuCtxSynchronize");
    size_t (*trim)(void) = (size_t (*)(void))dlsym(RTLD_DEFAULT, "vmm_trim");
    if (trim && hooked)
        INFO("vmm_trim released %zu bytes", trim());
    cuDevicePrimaryCtxRelease(dev);
    return finish();
}
