/* Helpers for the interpose suite: checks that print what they checked, where a function lives,
 * what the process has mapped, and a capture of this process's own stderr (the library writes
 * its diagnostics to fd 2).
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

#endif
