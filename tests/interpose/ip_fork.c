/* Interpose test: fork while threads churn allocations (issue 16). A child of a process that
 * initialized CUDA cannot use it: the driver answers its calls with an error at once (the
 * simulated one in strict fork mode, SIM_FORK_STRICT=1, answers CUDA_ERROR_NOT_INITIALIZED).
 * Under the hook every child must get exactly what the driver answers, never hang (a lock held
 * by one of the parent's threads at the fork, a context wait of another thread), and report no
 * leak at its exit (VMMHOOK_LEAKS=1 is set: the parent's buffers are not the child's).
 *
 * The parent: 3 threads churn allocations (served in the "served" run) and one begins and ends
 * relaxed captures in a loop, while 40 children are forked, one at a time.
 * Each child: cuMemFree of a buffer the parent allocated, cuMemAlloc, cuCtxSetCurrent,
 * cuStreamEndCapture; it sends the codes back through one pipe and everything it wrote to stderr
 * through another, and is killed by SIGALRM after 5 s if it hangs.
 */
#include <cuda.h>
#include <cudaTypedefs.h>

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/wait.h>

#include "ip_common.h"

#define CHILDREN 40
#define CHURNERS 3

static bool served;
static PFN_cuGetProcAddress_v12000 getproc;
static PFN_cuInit_v2000 p_cuInit;
static PFN_cuDevicePrimaryCtxRetain_v7000 p_cuDevicePrimaryCtxRetain;
static PFN_cuCtxSetCurrent_v4000 p_cuCtxSetCurrent;
static PFN_cuMemAlloc_v3020 p_cuMemAlloc;
static PFN_cuMemFree_v3020 p_cuMemFree;
static PFN_cuStreamEndCapture_v10000 p_cuStreamEndCapture;
static PFN_cuStreamBeginCapture_v10010 p_cuStreamBeginCapture;
static PFN_cuStreamCreate_v2000 p_cuStreamCreate;
static PFN_cuGraphDestroy_v10000 p_cuGraphDestroy;

static CUcontext ctx0;
static atomic_bool stop;

static void *churn(void *arg)
{
    (void)arg;
    p_cuCtxSetCurrent(ctx0);
    size_t sizes[] = {256, 4096, 1 << 20, 3 << 20, 12 << 20};
    for (unsigned i = 0; !atomic_load(&stop); i++) {
        CUdeviceptr p = 0;
        if (p_cuMemAlloc(&p, sizes[i % 5]) == CUDA_SUCCESS)
            p_cuMemFree(p);
    }
    return NULL;
}

/* Relaxed captures begun and ended in a loop: the library's capture records change all the
 * time, under their lock, while children are forked. */
static void *capture_loop(void *arg)
{
    CUstream s = arg;
    p_cuCtxSetCurrent(ctx0);
    while (!atomic_load(&stop)) {
        if (p_cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_RELAXED) == CUDA_SUCCESS) {
            CUgraph g = NULL;
            if (p_cuStreamEndCapture(s, &g) == CUDA_SUCCESS && g != NULL)
                p_cuGraphDestroy(g);
        }
    }
    return NULL;
}

/* What a child reports through its pipe. */
typedef struct child_result {
    int free_rc, alloc_rc, set_rc, end_rc;
} child_result_t;

static void child(int result_fd, int stderr_fd, CUdeviceptr parents)
{
    alarm(5);
    dup2(stderr_fd, 2); /* the library's diagnostics, and any exit report, go to the parent */
    child_result_t r;
    r.free_rc = p_cuMemFree(parents);
    CUdeviceptr p = 0;
    r.alloc_rc = p_cuMemAlloc(&p, 1 << 20);
    r.set_rc = p_cuCtxSetCurrent(ctx0);
    CUgraph g = NULL;
    r.end_rc = p_cuStreamEndCapture((CUstream)0x1234, &g);
    if (write(result_fd, &r, sizeof r) != (ssize_t)sizeof r)
        _exit(4);
    exit(0); /* destructors run: the library's exit reports must stay quiet */
}

/* Everything readable from fd until end of file (the writer has exited), at most n-1 bytes. */
static size_t read_all(int fd, char *buf, size_t n)
{
    size_t got = 0;
    ssize_t k;
    while (got < n - 1 && (k = read(fd, buf + got, n - 1 - got)) > 0)
        got += (size_t)k;
    buf[got] = '\0';
    return got;
}

int main(int argc, char **argv)
{
    served = ip_served_arg(argc, argv, "ip_fork");
    getproc = ip_getproc(ip_open_libcuda());
    p_cuInit = ip_fetch(getproc, "cuInit", 12000, 0);
    p_cuDevicePrimaryCtxRetain = ip_fetch(getproc, "cuDevicePrimaryCtxRetain", 12000, 0);
    p_cuCtxSetCurrent = ip_fetch(getproc, "cuCtxSetCurrent", 12000, 0);
    p_cuMemAlloc = ip_fetch(getproc, "cuMemAlloc", 12000, 0);
    p_cuMemFree = ip_fetch(getproc, "cuMemFree", 12000, 0);
    p_cuStreamEndCapture = ip_fetch(getproc, "cuStreamEndCapture", 12000, 0);
    p_cuStreamBeginCapture = ip_fetch(getproc, "cuStreamBeginCapture", 12000, 0);
    p_cuStreamCreate = ip_fetch(getproc, "cuStreamCreate", 12000, 0);
    p_cuGraphDestroy = ip_fetch(getproc, "cuGraphDestroy", 12000, 0);
    CHECK_RC(p_cuInit(0), CUDA_SUCCESS, "cuInit");
    CHECK_RC(p_cuDevicePrimaryCtxRetain(&ctx0, 0), CUDA_SUCCESS, "cuDevicePrimaryCtxRetain");
    CHECK_RC(p_cuCtxSetCurrent(ctx0), CUDA_SUCCESS, "cuCtxSetCurrent");
    CUdeviceptr parents = 0;
    CHECK_RC(p_cuMemAlloc(&parents, 1 << 20), CUDA_SUCCESS, "cuMemAlloc (the parent's buffer)");

    CUstream s = NULL;
    CHECK_RC(p_cuStreamCreate(&s, 0), CUDA_SUCCESS, "cuStreamCreate");
    pthread_t th[CHURNERS], capturer;
    for (int i = 0; i < CHURNERS; i++)
        pthread_create(&th[i], NULL, churn, NULL);
    pthread_create(&capturer, NULL, capture_loop, s);

    int hung = 0, wrong = 0, noisy = 0;
    child_result_t first = {-1, -1, -1, -1};
    for (int k = 0; k < CHILDREN; k++) {
        int res[2], err[2];
        if (pipe(res) != 0 || pipe(err) != 0) {
            printf("FAIL pipe\n");
            return 1;
        }
        fflush(stdout);
        pid_t pid = fork();
        if (pid == 0) {
            close(res[0]);
            close(err[0]);
            child(res[1], err[1], parents);
        }
        close(res[1]);
        close(err[1]);
        int status = 0;
        waitpid(pid, &status, 0); /* small writes: the pipes never fill */
        char back[sizeof(child_result_t) + 1];
        size_t got = read_all(res[0], back, sizeof back);
        child_result_t r;
        memcpy(&r, back, sizeof r);
        static char text[8192];
        read_all(err[0], text, sizeof text);
        close(res[0]);
        close(err[0]);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || got != sizeof r) {
            printf("     child %d: status 0x%x, %zu bytes back\n", k, status, got);
            if (++hung == 3)
                break; /* each hang costs the alarm's 5 s: three tell enough */
            continue;
        }
        if (k == 0)
            first = r;
        /* Every child answers the same: what the driver answers in a child. */
        if (r.free_rc == CUDA_SUCCESS || r.alloc_rc == CUDA_SUCCESS ||
            memcmp(&r, &first, sizeof r) != 0)
            wrong++;
        if (strstr(text, "vmmhook: leak") != NULL) {
            printf("     child %d wrote: %s\n", k, text);
            noisy++;
        }
    }
    atomic_store(&stop, true);
    for (int i = 0; i < CHURNERS; i++)
        pthread_join(th[i], NULL);
    pthread_join(capturer, NULL);

    printf("     a child's codes: cuMemFree %d, cuMemAlloc %d, cuCtxSetCurrent %d, "
           "cuStreamEndCapture %d\n",
           first.free_rc, first.alloc_rc, first.set_rc, first.end_rc);
    CHECK(hung == 0, "%d children forked during churn, none hung or died (%d did)", CHILDREN, hung);
    CHECK(first.free_rc == CUDA_ERROR_NOT_INITIALIZED &&
              first.alloc_rc == CUDA_ERROR_NOT_INITIALIZED,
          "a child's cuMemFree and cuMemAlloc get the driver's answer in a child "
          "(CUDA_ERROR_NOT_INITIALIZED)");
    CHECK(wrong == 0, "every child got the same codes, none a success (%d differ)", wrong);
    CHECK(noisy == 0, "no child reported leaks (%d did)", noisy);
    CHECK_RC(p_cuMemFree(parents), CUDA_SUCCESS, "the parent frees its buffer");
    return ip_finish(served ? "ip_fork served" : "ip_fork native");
}
