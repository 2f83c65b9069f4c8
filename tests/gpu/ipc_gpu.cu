/* ipc_gpu: CUDA IPC of cudaMalloc buffers between two processes, with and without the hook.
 *
 * The parent allocates, writes a pattern with a kernel, takes cudaIpcGetMemHandle and starts a
 * second process of this same program (posix_spawn of /proc/self/exe: CUDA is never used in a
 * forked child before exec) with the handle in hex on its command line. The child opens it
 * (cudaIpcOpenMemHandle), verifies the pattern with a kernel, opens it a second time (the same
 * pointer, counted), writes a second pattern, closes twice and exits; the parent verifies the
 * second pattern. Cases: 64 MiB (its own chunk under the hook) and 4 KiB behind a 1000-byte
 * buffer (packed under the hook: the child's pointer is base + offset in the mapped chunk).
 * Also: opening one's own handle in the same process (the driver's code), and, under the hook
 * only (natively cuda.h calls it undefined), the exporter freeing the buffer while the child
 * still has it open: the child keeps reading and writing its mapping, and the exporter's next
 * buffer of the same size is other memory.
 *
 * Under the hook it needs VMMHOOK_HANDLE_TYPE=posix_fd (tools/gpu-suite.sh sets it). With the
 * hook and another handle type, cudaIpcGetMemHandle must fail with cudaErrorInvalidValue (the
 * driver's answer for VMM memory) and the program exits 77 saying why.
 *
 * R lines (compared native vs hooked): codes, mismatch counts, same-pointer answers. */
#include "gpu_common.h"

#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

#define CHILD_TIMEOUT_MS 120000

static const char *hex_of(const cudaIpcMemHandle_t &h, char *buf)
{
    const unsigned char *b = (const unsigned char *)&h;
    for (size_t i = 0; i < sizeof h; i++)
        sprintf(buf + 2 * i, "%02x", b[i]);
    return buf;
}

static bool handle_of(const char *hex, cudaIpcMemHandle_t *h)
{
    unsigned char *b = (unsigned char *)h;
    if (strlen(hex) != 2 * sizeof *h)
        return false;
    for (size_t i = 0; i < sizeof *h; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1)
            return false;
        b[i] = (unsigned char)v;
    }
    return true;
}

/* ---------------------------------------------------------------- the child */

/* One line from the parent on fd 3 (blocking). */
static bool wait_parent(void)
{
    char c;
    ssize_t n;
    do
        n = read(3, &c, 1);
    while (n < 0 && errno == EINTR);
    return n == 1;
}

static void tell_parent(void)
{
    char c = '1';
    if (write(4, &c, 1) != 1)
        printf("FAIL child: cannot write to the parent\n");
}

/* argv: --child <tag> <hex handle> <size> <seed a> <seed b> <free-first 0|1> */
static int child_main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    g_prog = "ipc_gpu child";
    if (argc != 8) {
        printf("FAIL child: %d arguments\n", argc);
        return 1;
    }
    const char *tag = argv[2];
    cudaIpcMemHandle_t h;
    size_t n = strtoull(argv[4], NULL, 10);
    uint64_t seed_a = strtoull(argv[5], NULL, 10), seed_b = strtoull(argv[6], NULL, 10);
    bool free_first = argv[7][0] == '1';
    if (!handle_of(argv[3], &h)) {
        printf("FAIL child: bad handle text\n");
        return 1;
    }
    if (CK(cudaSetDevice(0)) || CK(cudaFree(0)))
        return 1;
    void *p = NULL, *p2 = NULL;
    cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    CHECK(e == cudaSuccess, "child %s: cudaIpcOpenMemHandle -> %d (%s)", tag, (int)e,
          cudaGetErrorString(e));
    if (e != cudaSuccess) {
        R("child %s open=%d", tag, (int)e);
        if (free_first)
            tell_parent();
        return 1;
    }
    INFO("child %s: opened at %p", tag, p);
    cudaPointerAttributes attr;
    memset(&attr, 0, sizeof attr);
    e = cudaPointerGetAttributes(&attr, p);
    unsigned long long bad = gt_verify(p, n, seed_a, 0, 0, "child verify a");
    if (!free_first) {
        R("child %s open=0 attr=%d type=%d device=%d verify_a_mismatches=%llu", tag, (int)e,
          (int)attr.type, attr.device, bad);
        /* Opened twice in one context: the same pointer, counted (cuda.h). */
        cudaError_t e2 = cudaIpcOpenMemHandle(&p2, h, cudaIpcMemLazyEnablePeerAccess);
        R("child %s double_open=%d same_ptr=%d", tag, (int)e2, p2 == p);
        if (e2 == cudaSuccess)
            R("child %s close_one_of_two=%d", tag, (int)cudaIpcCloseMemHandle(p2));
        cudaGetLastError();
    } else {
        INFO("child %s: attr %d type %d device %d, verify a: %llu mismatches", tag, (int)e,
             (int)attr.type, attr.device, bad);
        CHECK(bad == 0, "child %s: the pattern before the exporter's free", tag);
        tell_parent(); /* opened: the parent frees its buffer now */
        if (!wait_parent())
            printf("FAIL child %s: the parent went away\n", tag);
        bad = gt_verify(p, n, seed_a, 0, 0, "child verify a after the exporter's free");
        INFO("child %s: after the exporter's free: %llu mismatches", tag, bad);
        CHECK(bad == 0, "child %s: the mapping still shows the pattern after the exporter freed",
              tag);
    }
    gt_fill(p, n, seed_b);
    CK(cudaDeviceSynchronize());
    e = cudaIpcCloseMemHandle(p);
    if (!free_first)
        R("child %s close=%d", tag, (int)e);
    else
        CHECK(e == cudaSuccess, "child %s: close -> %d", tag, (int)e);
    e = cudaDeviceSynchronize();
    CHECK(e == cudaSuccess, "child %s: final synchronize -> %d", tag, (int)e);
    printf("I child %s: %d checks, %d failed\n", tag, g_checks, g_failed);
    fflush(stdout);
    return g_failed ? 1 : 0;
}

/* ---------------------------------------------------------------- the parent */

typedef struct child {
    pid_t pid;
    int to_child, from_child;
} child_t;

/* The child's environment: the parent's, with its own stats file. */
static char **child_env(void)
{
    static char stats[4200];
    size_t n = 0;
    while (environ[n])
        n++;
    char **env = (char **)calloc(n + 1, sizeof *env);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (!strncmp(environ[i], "VMMHOOK_STATS_JSON=", 19) && environ[i][19]) {
            snprintf(stats, sizeof stats, "%s.child", environ[i]);
            env[k++] = stats;
        } else {
            env[k++] = environ[i];
        }
    }
    env[k] = NULL;
    return env;
}

static bool spawn_child(child_t *c, const char *tag, const cudaIpcMemHandle_t &h, size_t n,
                        uint64_t seed_a, uint64_t seed_b, bool free_first)
{
    int down[2], up[2];
    if (pipe(down) != 0 || pipe(up) != 0) {
        printf("FAIL pipe: %s\n", strerror(errno));
        return false;
    }
    char hex[2 * sizeof h + 1], size_s[32], a_s[32], b_s[32];
    hex_of(h, hex);
    snprintf(size_s, sizeof size_s, "%zu", n);
    snprintf(a_s, sizeof a_s, "%llu", (unsigned long long)seed_a);
    snprintf(b_s, sizeof b_s, "%llu", (unsigned long long)seed_b);
    char self[] = "/proc/self/exe", child_flag[] = "--child", ff[] = "0";
    ff[0] = free_first ? '1' : '0';
    char *argv[] = {self, child_flag, (char *)tag, hex, size_s, a_s, b_s, ff, NULL};
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, down[0], 3);
    posix_spawn_file_actions_adddup2(&fa, up[1], 4);
    posix_spawn_file_actions_addclose(&fa, down[1]);
    posix_spawn_file_actions_addclose(&fa, up[0]);
    fflush(stdout);
    fflush(stderr);
    char **env = child_env();
    int rc = posix_spawn(&c->pid, "/proc/self/exe", &fa, NULL, argv, env);
    free(env);
    posix_spawn_file_actions_destroy(&fa);
    close(down[0]);
    close(up[1]);
    if (rc != 0) {
        printf("FAIL posix_spawn: %s\n", strerror(rc));
        close(down[1]);
        close(up[0]);
        return false;
    }
    c->to_child = down[1];
    c->from_child = up[0];
    return true;
}

/* Waits for one byte from the child; false on timeout or end of file. */
static bool from_child(const child_t *c)
{
    struct pollfd p = {c->from_child, POLLIN, 0};
    if (poll(&p, 1, CHILD_TIMEOUT_MS) != 1)
        return false;
    char ch;
    return read(c->from_child, &ch, 1) == 1;
}

static int reap(child_t *c)
{
    close(c->to_child);
    close(c->from_child);
    int status = 0;
    for (int waited = 0; waitpid(c->pid, &status, WNOHANG) == 0; waited += 100) {
        if (waited >= CHILD_TIMEOUT_MS) {
            printf("FAIL the child did not finish in %d s: killed\n", CHILD_TIMEOUT_MS / 1000);
            kill(c->pid, SIGKILL);
            waitpid(c->pid, &status, 0);
            return -1;
        }
        usleep(100 * 1000);
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

static void share_case(const char *tag, size_t n, uint64_t seed_a, uint64_t seed_b, bool pad)
{
    void *padp = NULL, *p = NULL;
    if (pad)
        CK(cudaMalloc(&padp, 1000)); /* so that the buffer sits behind another in its chunk */
    if (CK(cudaMalloc(&p, n)))
        return;
    CHECK_OWNS(p, 1, tag);
    gt_fill(p, n, seed_a);
    CK(cudaDeviceSynchronize());
    cudaIpcMemHandle_t h;
    cudaError_t e = cudaIpcGetMemHandle(&h, p);
    R("%s get_handle=%d", tag, (int)e);
    if (e != cudaSuccess) {
        CHECK(false, "%s: cudaIpcGetMemHandle -> %d (%s)", tag, (int)e, cudaGetErrorString(e));
        cudaFree(p);
        return;
    }
    cudaIpcMemHandle_t h2;
    e = cudaIpcGetMemHandle(&h2, p);
    R("%s get_handle_again=%d", tag, (int)e);
    /* The hook gives the same handle for the same buffer; the driver's bytes are its own
     * business (information only). */
    INFO("%s: the second handle is %s", tag, memcmp(&h, &h2, sizeof h) ? "different" : "the same");
    child_t c;
    if (spawn_child(&c, tag, h, n, seed_a, seed_b, false)) {
        int rc = reap(&c);
        R("%s child_exit=%d", tag, rc);
        CHECK(rc == 0, "%s: the child exited %d", tag, rc);
    }
    unsigned long long bad = gt_verify(p, n, seed_b, 0, 0, "parent verify b");
    R("%s parent_verify_b_mismatches=%llu", tag, bad);
    CK(cudaFree(p));
    if (padp)
        CK(cudaFree(padp));
}

/* Under the hook only: the exporter frees while the importer maps the buffer. */
static void free_first_case(size_t n)
{
    const char *tag = "free_first";
    void *p = NULL, *q = NULL;
    if (CK(cudaMalloc(&p, n)))
        return;
    gt_fill(p, n, 31);
    CK(cudaDeviceSynchronize());
    cudaIpcMemHandle_t h;
    if (CK(cudaIpcGetMemHandle(&h, p)))
        return;
    child_t c;
    if (!spawn_child(&c, tag, h, n, 31, 32, true))
        return;
    bool opened = from_child(&c);
    CHECK(opened, "free_first: the child did not report its open");
    CK(cudaFree(p)); /* the exporter lets go while the child still maps it */
    CK(cudaMalloc(&q, n));
    gt_fill(q, n, 33);
    CK(cudaDeviceSynchronize());
    INFO("free_first: freed %p, the next buffer of the size is %p", p, q);
    char go = '1';
    if (write(c.to_child, &go, 1) != 1)
        printf("FAIL free_first: cannot write to the child\n");
    int rc = reap(&c);
    CHECK(rc == 0, "free_first: the child exited %d", rc);
    unsigned long long bad = gt_verify(q, n, 33, 0, 0, "the exporter's next buffer");
    INFO("free_first: the next buffer after the child wrote its mapping: %llu mismatches", bad);
    CHECK(bad == 0, "free_first: the child's writes reached the exporter's next buffer");
    CK(cudaFree(q));
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "--child"))
        return child_main(argc, argv);
    gt_init("ipc_gpu");
    const char *ht = getenv("VMMHOOK_HANDLE_TYPE");
    bool posix = ht && !strcmp(ht, "posix_fd");
    INFO("VMMHOOK_HANDLE_TYPE=%s", ht ? ht : "(unset)");
    if (gt_hooked() && !posix) {
        void *p = NULL;
        CK(cudaMalloc(&p, 64 * MiB));
        cudaIpcMemHandle_t h;
        cudaError_t e = cudaIpcGetMemHandle(&h, p);
        cudaGetLastError();
        CHECK(e == cudaErrorInvalidValue,
              "hooked without VMMHOOK_HANDLE_TYPE=posix_fd: cudaIpcGetMemHandle -> %d (want %d, "
              "the driver's answer for VMM memory)",
              (int)e, (int)cudaErrorInvalidValue);
        CK(cudaFree(p));
        if (g_failed)
            return gt_finish();
        gt_skip("IPC of served buffers needs VMMHOOK_HANDLE_TYPE=posix_fd (it is %s): "
                "cudaIpcGetMemHandle answered invalid argument, as expected",
                ht ? ht : "unset");
    }

    share_case("big", 64 * MiB, 11, 12, false);
    share_case("small", 4 * KiB, 21, 22, true);

    /* One's own handle in the same process: the driver's answer (invalid context). */
    void *p = NULL, *q = NULL;
    CK(cudaMalloc(&p, 2 * MiB));
    cudaIpcMemHandle_t h;
    if (!CK(cudaIpcGetMemHandle(&h, p))) {
        cudaError_t e = cudaIpcOpenMemHandle(&q, h, cudaIpcMemLazyEnablePeerAccess);
        cudaGetLastError();
        R("same_process_open=%d", (int)e);
    }
    CK(cudaFree(p));

    if (gt_hooked())
        free_first_case(64 * MiB);
    else
        INFO("free_first: left out natively (cuda.h: freeing exported memory before the "
             "importer closes it is undefined)");
    gt_trim();
    return gt_finish();
}
