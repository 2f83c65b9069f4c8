/* Interpose test 3: a process that never uses CUDA, under the preload.
 *
 * It must see nothing: no driver loaded, no output but VMMHOOK_VERBOSE's one load line (not
 * even with a bad VMMHOOK_* value under VMMHOOK_STRICT=1, which would print and stop the program
 * if options were parsed for use), and a dlsym whose answers are the C library's, including the
 * answers that depend on the caller (RTLD_NEXT, RTLD_DEFAULT from a library loaded RTLD_LOCAL),
 * at next to no cost.
 *
 *   ip_nocuda            the checks, with the preload (meson test "nocuda")
 *   ip_nocuda bare       the caller-dependent dlsym checks without the preload (meson test
 *                        "nocuda-control"): shows they hold natively, so they can fail
 *   ip_nocuda child      run by the checks in a fresh process with the VMMHOOK_* variables
 *   ip_nocuda control    the same, but makes one interposed call: the library must speak now,
 *                        which shows the silence of "child" is not for want of a bad value
 */
#include <stdint.h>
#include <sys/wait.h>
#include <time.h>

#include "ip_common.h"
#include "ipt.h"

#ifndef IPT_LOCAL_PATH
#error "IPT_LOCAL_PATH: the path of libipt_local.so (set by meson.build)"
#endif

static void check_dlsym_semantics(void)
{
    CHECK(dlsym(RTLD_DEFAULT, "getpid") == (void *)getpid,
          "dlsym(RTLD_DEFAULT, getpid) is libc's getpid");
    CHECK(dlsym(RTLD_NEXT, "getpid") == (void *)getpid,
          "dlsym(RTLD_NEXT, getpid) from the program is libc's getpid");
    CHECK(dlsym(RTLD_DEFAULT, "ipt_no_such_symbol") == NULL && dlerror() != NULL,
          "an unknown symbol gives NULL and a dlerror message");
    CHECK(ipt_second_marker() == 22 && ipt_value() == 1, "global order: libipt_first first");
    CHECK(ipt_first_next() == 2,
          "dlsym(RTLD_NEXT, ipt_value) called from libipt_first finds libipt_second's (got %d)",
          ipt_first_next());
    CHECK(ipt_first_default() == 1, "dlsym(RTLD_DEFAULT, ipt_value) from libipt_first -> 1");

    void *local = dlopen(IPT_LOCAL_PATH, RTLD_NOW | RTLD_LOCAL);
    CHECK(local != NULL, "dlopen(libipt_local.so, RTLD_LOCAL)");
    if (!local)
        return;
    void *(*local_default)(const char *) =
        (void *(*)(const char *))dlsym(local, "ipt_local_default");
    void *(*local_next)(const char *) = (void *(*)(const char *))dlsym(local, "ipt_local_next");
    CHECK(local_default && local_next, "libipt_local's functions found on its handle");
    if (!local_default || !local_next)
        return;
    CHECK(dlsym(RTLD_DEFAULT, "ipt_dep_value") == NULL,
          "ipt_dep_value is not in the global scope (libipt_dep is local to libipt_local)");
    void *d = local_default("ipt_dep_value");
    CHECK(d != NULL && ((int (*)(void))d)() == 7,
          "dlsym(RTLD_DEFAULT, ipt_dep_value) called from libipt_local sees its dependency");
    void *c = local_default("cuipt_dep_value");
    CHECK(c != NULL && ((int (*)(void))c)() == 8, "the same for a \"cu\" name");
    void *n = local_next("ipt_dep_value");
    CHECK(n != NULL && ((int (*)(void))n)() == 7,
          "dlsym(RTLD_NEXT, ipt_dep_value) called from libipt_local finds libipt_dep's");
    void *h = dlsym(local, "cuMemAlloc_v2");
    CHECK(h != NULL && strstr(ip_object_of(h), "libipt_dep") != NULL && ((int (*)(void))h)() == 42,
          "dlsym(non-libcuda handle, \"cuMemAlloc_v2\") is that library's, not the hook's (%s)",
          ip_object_of(h));
    c = dlsym(local, "cuipt_dep_value");
    CHECK(c != NULL && ((int (*)(void))c)() == 8, "dlsym(handle, \"cuipt_dep_value\")");
    CHECK(dlsym(local, "cuipt_no_such") == NULL && dlerror() != NULL,
          "dlsym(handle, unknown \"cu\" name) -> NULL with a dlerror message");
}

/* Lookups a non-CUDA program (or a CUDA-probing one) makes; none may load or initialise. */
static int child(bool control)
{
    void *self = dlopen(NULL, RTLD_NOW);
    void *gp = dlsym(self, "cuGetProcAddress_v2");
    void *ma = dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
    void *ci = dlsym(RTLD_DEFAULT, "cuInit");
    void *pf = dlsym(RTLD_DEFAULT, "printf");
    int bad = 0;
    bad |= (gp == NULL) << 0; /* exported by the library */
    bad |= (ma == NULL) << 1;
    bad |= (ci != NULL) << 2; /* no driver here */
    bad |= (pf == NULL) << 3;
    bad |= ip_maps_has("libcuda.so") << 4;
    bad |= !ip_maps_has("libvmmhook") << 5;
    if (control) {
        /* One interposed call: the library initialises, parses the options and speaks. */
        int (*mem_alloc)(unsigned long long *, size_t) =
            (int (*)(unsigned long long *, size_t))dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
        unsigned long long p = 0;
        if (mem_alloc)
            mem_alloc(&p, 4096);
    }
    return bad;
}

static int run_child(const char *self, const char *arg, const char *what, char *err, size_t n,
                     int *status)
{
    int pipefd[2];
    if (pipe(pipefd))
        return -1;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(pipefd[1], 2);
        close(pipefd[0]);
        close(pipefd[1]);
        setenv("VMMHOOK_VERBOSE", "1", 1);
        setenv("VMMHOOK_STRICT", "1", 1);
        setenv("VMMHOOK_GRANULARITY", "not-a-size", 1);
        if (arg)
            execl(self, self, arg, (char *)NULL);
        else
            execl(self, self, (char *)NULL);
        _exit(127);
    }
    close(pipefd[1]);
    size_t got = 0;
    ssize_t r;
    while ((r = read(pipefd[0], err + got, n - 1 - got)) > 0 && got < n - 1)
        got += (size_t)r;
    err[got] = '\0';
    close(pipefd[0]);
    waitpid(pid, status, 0);
    printf("     (%s: status 0x%x, %zu bytes on stderr)\n", what, *status, got);
    if (got)
        printf("---- its stderr ----\n%s---- end ----\n", err);
    return 0;
}

/* stderr holds exactly VMMHOOK_VERBOSE's load line, which notes the bad value without acting. */
static bool only_load_line(const char *err)
{
    const char *nl = strchr(err, '\n');
    return strncmp(err, "vmmhook: libvmmhook ", 20) == 0 && nl != NULL && nl[1] == '\0' &&
           strstr(err, " loaded (pid ") != NULL &&
           strstr(err, "(and bad values, reported at the first CUDA call)\n") != NULL;
}

typedef void *(*dlsym_fn)(void *, const char *);

static double least(double a, double b)
{
    return a < b ? a : b;
}

static double ns_per_call(dlsym_fn f, void *h, const char *name, int n)
{
    double best = 1e30;
    for (int rep = 0; rep < 5; rep++) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        for (int i = 0; i < n; i++)
            if (f(h, name) == NULL)
                return -1;
        clock_gettime(CLOCK_MONOTONIC, &b);
        double ns = ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n;
        if (ns < best)
            best = ns;
    }
    return best;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *mode = argc > 1 ? argv[1] : "";
    if (!strcmp(mode, "child"))
        return child(false);
    if (!strcmp(mode, "control"))
        return child(true);
    if (!strcmp(mode, "bare")) {
        printf("ip_nocuda bare: dlsym's caller-dependent answers without the preload\n");
        CHECK(!ip_maps_has("libvmmhook"), "libvmmhook.so is not loaded");
        check_dlsym_semantics();
        return ip_finish("ip_nocuda bare");
    }

    printf("ip_nocuda: a process that never uses CUDA, under the preload\n");
    ip_require_preloaded();
    CHECK(!ip_maps_has("libcuda.so"), "libcuda is not loaded at start");
    check_dlsym_semantics();
    CHECK(dlsym(RTLD_DEFAULT, "cuInit") == NULL, "dlsym(RTLD_DEFAULT, cuInit) -> NULL (no driver)");
    CHECK(ip_in_hook(dlsym(RTLD_DEFAULT, "vmm_realloc")), "vmm_realloc is found (aware code)");
    CHECK(!ip_maps_has("libcuda.so"), "libcuda is still not loaded after all these lookups");

    /* The cost of the wrapper: the C library's own dlsym against ours, same lookups. */
    void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
    dlsym_fn real = libc ? (dlsym_fn)dlvsym(libc, "dlsym", "GLIBC_2.34") : NULL;
    if (!real && libc)
        real = (dlsym_fn)dlvsym(libc, "dlsym", "GLIBC_2.2.5");
    CHECK(real != NULL && real != (dlsym_fn)dlsym, "the C library's dlsym, for comparison");
    if (real) {
        /* Measured in turns, the best of each kept, so that a burst of load from other
         * processes on a shared machine weighs on both sides alike. */
        double r1 = 1e30, o1 = 1e30, r2 = 1e30, o2 = 1e30;
        for (int turn = 0; turn < 4; turn++) {
            r1 = least(r1, ns_per_call(real, RTLD_DEFAULT, "getpid", 50000));
            o1 = least(o1, ns_per_call((dlsym_fn)dlsym, RTLD_DEFAULT, "getpid", 50000));
            r2 = least(r2, ns_per_call(real, libc, "clock_gettime", 50000));
            o2 = least(o2, ns_per_call((dlsym_fn)dlsym, libc, "clock_gettime", 50000));
        }
        CHECK(o1 > 0 && o2 > 0 && o1 < 2 * r1 + 100 && o2 < 2 * r2 + 100,
              "dlsym costs next to nothing more: RTLD_DEFAULT %.0f ns vs libc %.0f ns, handle "
              "%.0f ns vs %.0f ns",
              o1, r1, o2, r2);
    }

    static char err[1 << 16];
    int status = 0;
    if (run_child(argv[0], "child", "child: lookups only", err, sizeof err, &status) == 0)
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0 && only_load_line(err),
              "a fresh process with VMMHOOK_VERBOSE=1 VMMHOOK_STRICT=1 and a bad "
              "VMMHOOK_GRANULARITY that only looks symbols up: exit 0 (bits %d), no output but "
              "the load line",
              WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    if (run_child("/bin/true", NULL, "/bin/true", err, sizeof err, &status) == 0)
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0 && only_load_line(err),
              "/bin/true under the preload with the same variables: exit 0, no output but the "
              "load line");
    if (run_child(argv[0], "control", "control: one interposed call", err, sizeof err,
                  &status) == 0)
        CHECK(strstr(err, "vmmhook:") != NULL && strstr(err, "VMMHOOK_GRANULARITY") != NULL,
              "control: once a CUDA entry point is called, the library parses the options and "
              "names the bad VMMHOOK_GRANULARITY");
    return ip_finish("ip_nocuda");
}
