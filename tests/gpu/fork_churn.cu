/* fork_churn: fork while other threads allocate and free (issue 16, "fork").
 *
 * Four threads churn cudaMalloc/cudaFree (packed and chunk-sized buffers) while the main thread
 * forks 40 children, about 25 ms apart. Each child calls cuMemFree on a buffer the parent
 * allocated and cuMemAlloc once (CUDA is not usable in a child once the parent initialised it:
 * natively the driver answers with an error), writes both codes to a pipe and exits with
 * exit(0) (so atexit handlers, the hook's reports included, run). A child that has not exited
 * 10 s after its fork is killed and counted as hung. Each child's stderr goes to a file of its
 * own: one that reports leaked buffers ("still allocated at exit") is counted too (a child
 * owns none of its parent's buffers).
 *
 * Usage: fork_churn [children=40] [threads=4]
 * Compared part (R lines): hung children, children reporting leaks, and how many children gave
 * each (cuMemFree, cuMemAlloc, exit status) result. */
#include "gpu_common.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <string>
#include <thread>
#include <vector>

typedef CUresult (*mem_alloc_fn)(CUdeviceptr *, size_t);
typedef CUresult (*mem_free_fn)(CUdeviceptr);

static std::atomic<bool> g_stop{false};
static std::atomic<long long> g_churn_ops{0}, g_churn_errors{0};

static void churn(int t)
{
    cudaSetDevice(0);
    uint64_t rng = 0x9E3779B97F4A7C15ull * (uint64_t)(t + 1);
    void *live[32] = {NULL};
    size_t sz[32] = {0};
    while (!g_stop.load(std::memory_order_relaxed)) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        int i = (int)(rng % 32);
        if (live[i]) {
            if (cudaFree(live[i]) != cudaSuccess)
                g_churn_errors++;
            live[i] = NULL;
        } else {
            sz[i] = (rng >> 8) % 4 == 0 ? (size_t)(1 + (rng >> 16) % 24) * MiB
                                        : (size_t)(1 + (rng >> 16) % (256 * KiB));
            if (cudaMalloc(&live[i], sz[i]) != cudaSuccess) {
                g_churn_errors++;
                live[i] = NULL;
            } else {
                cudaMemsetAsync(live[i], t, sz[i], 0);
            }
        }
        g_churn_ops++;
    }
    for (int i = 0; i < 32; i++)
        if (live[i] && cudaFree(live[i]) != cudaSuccess)
            g_churn_errors++;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

struct Child {
    pid_t pid = -1;
    int rfd = -1;
    double t0 = 0;
    bool done = false, hung = false;
    int status = 0;
    std::string answer;
    std::string errpath;
};

/* In the child: only async-signal-safe calls before the CUDA calls (another thread of the
 * parent may have held any lock at the fork). */
static void child_main(int wfd, const char *errpath, mem_free_fn mfree, mem_alloc_fn malloc_,
                       CUdeviceptr parent_buf)
{
    int fd = open(errpath, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd >= 0) {
        dup2(fd, 2);
        close(fd);
    }
    int rf = (int)mfree(parent_buf);
    CUdeviceptr d = 0;
    int ra = (int)malloc_(&d, 1 * MiB);
    char buf[64];
    int n = snprintf(buf, sizeof buf, "%d %d\n", rf, ra);
    if (write(wfd, buf, (size_t)n) != n)
        _exit(3);
    close(wfd);
    exit(0);
}

int main(int argc, char **argv)
{
    gt_init("fork_churn");
    int nchildren = argc > 1 ? atoi(argv[1]) : 40;
    int nthreads = argc > 2 ? atoi(argv[2]) : 4;
    R("children=%d threads=%d", nchildren, nthreads);
    mem_alloc_fn malloc_ = gt_entry<mem_alloc_fn>("cuMemAlloc", 12000);
    mem_free_fn mfree = gt_entry<mem_free_fn>("cuMemFree", 12000);
    if (!malloc_ || !mfree)
        return gt_finish();
    CUdeviceptr parent_buf = 0;
    if (CKD(malloc_(&parent_buf, 4 * MiB)))
        return gt_finish();

    std::vector<std::thread> th;
    for (int t = 0; t < nthreads; t++)
        th.emplace_back(churn, t);
    while (g_churn_ops.load() < 200) /* the churn is under way */
        usleep(1000);

    const double hang_s = 10.0;
    std::vector<Child> kids(nchildren);
    for (int i = 0; i < nchildren; i++) {
        Child &c = kids[i];
        char path[128];
        snprintf(path, sizeof path, "%s/fork_churn.%d.%d.err", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp",
                 (int)getpid(), i);
        c.errpath = path;
        int p[2];
        if (pipe(p) != 0) {
            CHECK(0, "pipe failed");
            break;
        }
        fflush(NULL);
        c.t0 = now_s();
        pid_t pid = fork();
        if (pid == 0) {
            close(p[0]);
            child_main(p[1], path, mfree, malloc_, parent_buf);
        }
        close(p[1]);
        if (pid < 0) {
            CHECK(0, "fork failed");
            close(p[0]);
            break;
        }
        c.pid = pid;
        c.rfd = p[0];
        fcntl(c.rfd, F_SETFL, O_NONBLOCK);
        usleep(25000);
    }

    /* Wait for every child, each up to hang_s after its own fork. */
    int left = 0;
    for (auto &c : kids)
        left += c.pid > 0;
    while (left > 0) {
        for (auto &c : kids) {
            if (c.pid <= 0 || c.done)
                continue;
            char buf[64];
            ssize_t r;
            while ((r = read(c.rfd, buf, sizeof buf)) > 0)
                c.answer.append(buf, (size_t)r);
            int st = 0;
            pid_t w = waitpid(c.pid, &st, WNOHANG);
            if (w == c.pid) {
                while ((r = read(c.rfd, buf, sizeof buf)) > 0)
                    c.answer.append(buf, (size_t)r);
                c.status = st;
                c.done = true;
                left--;
            } else if (now_s() - c.t0 > hang_s) {
                kill(c.pid, SIGKILL);
                waitpid(c.pid, &st, 0);
                c.status = st;
                c.hung = true;
                c.done = true;
                left--;
            }
        }
        usleep(5000);
    }
    g_stop = true;
    for (auto &t : th)
        t.join();

    int hung = 0, leaky = 0;
    std::map<std::string, int> results;
    for (size_t i = 0; i < kids.size(); i++) {
        Child &c = kids[i];
        if (c.pid <= 0)
            continue;
        if (c.rfd >= 0)
            close(c.rfd);
        std::string key;
        if (c.hung) {
            hung++;
            key = "hung (killed)";
        } else {
            std::string a = c.answer;
            while (!a.empty() && a.back() == '\n')
                a.pop_back();
            char st[48];
            if (WIFEXITED(c.status))
                snprintf(st, sizeof st, "exit %d", WEXITSTATUS(c.status));
            else
                snprintf(st, sizeof st, "signal %d", WIFSIGNALED(c.status) ? WTERMSIG(c.status) : -1);
            key = "cuMemFree,cuMemAlloc=" + (a.empty() ? std::string("(none)") : a) + " " + st;
        }
        results[key]++;
        /* The child's stderr: a leak report there is a false one. */
        FILE *f = fopen(c.errpath.c_str(), "r");
        if (f) {
            char line[512];
            bool leak = false;
            int shown = 0;
            while (fgets(line, sizeof line, f)) {
                if (strstr(line, "still allocated at exit"))
                    leak = true;
                if (shown < 3 && line[0]) {
                    line[strcspn(line, "\n")] = 0;
                    INFO("child %zu stderr: %s", i, line);
                    shown++;
                }
            }
            fclose(f);
            leaky += leak;
        }
        unlink(c.errpath.c_str());
    }
    for (auto &kv : results)
        R("children %s: %d", kv.first.c_str(), kv.second);
    R("hung=%d children_reporting_leaks=%d", hung, leaky);
    INFO("churn: %lld operations, %lld errors", g_churn_ops.load(), g_churn_errors.load());
    CHECK(hung == 0, "%d of %d children hung (killed after %.0f s)", hung, nchildren, hang_s);
    CHECK(leaky == 0, "%d children reported leaks at exit (they own none of the parent's buffers)",
          leaky);
    CHECK(g_churn_errors.load() == 0, "the churn threads saw %lld errors", g_churn_errors.load());
    CKD(mfree(parent_buf));
    CK(cudaDeviceSynchronize());
    gt_trim();
    return gt_finish();
}
