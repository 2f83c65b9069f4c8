/* Layer "backup staging": host memory for backups, the pool of kept pinned buffers and its budget,
 * and the staging ring with its pinner (see staging.h). */
#include "staging.h"

#include "contexts.h"
#include "log.h"
#include "tags.h"
#include "testable.h"
#include "thread_state.h"
#include "witness.h"

#include <assert.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define HUGE_PAGE ((size_t)2 << 20)

/* The budget (staging.h): a share of the host's memory per process, and a mark of available
 * memory that new pinning never goes below and that pressure is measured against. A quarter:
 * room for a process's backups (an engine's weights are a fraction of a GPU's memory, and hosts
 * have several times their GPUs' memory) while several processes of one host (one per GPU) each
 * keep theirs; the available-memory mark, not the share, is what protects the host when they
 * add up. */
#define HOST_SHARE_DIV 4
#define HOST_LOW_DIV 8

/* ---- the host's memory ---------------------------------------------------------------------- */

/* Reads a small text file into buf (NUL-terminated); false when it cannot. No stdio: it may run
 * in any thread of the program. */
static bool read_text(const char *path, char *buf, size_t len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return false;
    size_t got = 0;
    while (got + 1 < len) {
        ssize_t n = read(fd, buf + got, len - 1 - got);
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    close(fd);
    buf[got] = '\0';
    return got > 0;
}

/* The value of "key: N kB" in /proc/meminfo's text, in bytes. */
static bool meminfo_field(const char *text, const char *key, size_t *out)
{
    const char *at = strstr(text, key);
    if (!at)
        return false;
    unsigned long long kb = strtoull(at + strlen(key), NULL, 10);
    if (kb > SIZE_MAX / 1024)
        return false;
    *out = (size_t)kb * 1024;
    return true;
}

/* One number of a cgroup file (memory.max, memory.limit_in_bytes, ...); false for "max" or
 * when unreadable. */
static bool cgroup_value(const char *root, const char *dir, const char *file, size_t *out)
{
    char path[512], text[64];
    if (snprintf(path, sizeof path, "%s%s/%s", root, dir, file) >= (int)sizeof path ||
        !read_text(path, text, sizeof text) || text[0] < '0' || text[0] > '9')
        return false;
    unsigned long long v = strtoull(text, NULL, 10);
    *out = v > SIZE_MAX ? SIZE_MAX : (size_t)v;
    return true;
}

/* Applies one cgroup's limit when it is below the host's; false when the cgroup has no such
 * file (another version, another mount). Its available memory is taken as the limit less the
 * cgroup's current use, page cache included (which the kernel could reclaim): an underestimate,
 * so the budget errs towards pinning less. */
static bool cgroup_limit(const char *root, const char *dir, const char *max_file,
                         const char *cur_file, vmh_host_mem_t *m)
{
    char probe[512];
    if (snprintf(probe, sizeof probe, "%s%s/%s", root, dir, max_file) >= (int)sizeof probe ||
        access(probe, R_OK) != 0)
        return false;
    size_t max, cur;
    if (!cgroup_value(root, dir, max_file, &max) || max >= m->total)
        return true; /* "max", or no lower than the host */
    m->total = max;
    if (!cgroup_value(root, dir, cur_file, &cur))
        cur = max;
    size_t room = max > cur ? max - cur : 0;
    if (m->available > room)
        m->available = room;
    return true;
}

/* The memory cgroup's limit, when it is below the host's: the process cannot pin beyond it.
 * cgroup v2 ("0::PATH" in /proc/self/cgroup: memory.max, memory.current), else v1
 * (":memory:PATH": memory.limit_in_bytes, memory.usage_in_bytes), each at its path under the
 * mount, else at the mount's root (a container's own view). */
static void cgroup_apply(vmh_host_mem_t *m)
{
    char text[1024];
    if (!read_text("/proc/self/cgroup", text, sizeof text))
        return;
    char *v2 = strstr(text, "0::"), *v1 = strstr(text, ":memory:");
    char *ends[2] = {v2 ? strchr(v2, '\n') : NULL, v1 ? strchr(v1, '\n') : NULL};
    for (int k = 0; k < 2; k++)
        if (ends[k])
            *ends[k] = '\0';
    if (v2) {
        const char *dir = !strcmp(v2 + 3, "/") ? "" : v2 + 3;
        if (cgroup_limit("/sys/fs/cgroup", dir, "memory.max", "memory.current", m) ||
            cgroup_limit("/sys/fs/cgroup", "", "memory.max", "memory.current", m))
            return;
    }
    if (v1) {
        const char *dir = !strcmp(v1 + 8, "/") ? "" : v1 + 8;
        if (!cgroup_limit("/sys/fs/cgroup/memory", dir, "memory.limit_in_bytes",
                          "memory.usage_in_bytes", m))
            cgroup_limit("/sys/fs/cgroup/memory", "", "memory.limit_in_bytes",
                         "memory.usage_in_bytes", m);
    }
}

/* The production reader: MemTotal and MemAvailable of /proc/meminfo (sysconf's physical and
 * free pages where it cannot be read: free understates available, which errs towards pinning
 * less), then a smaller memory cgroup's (v2 or v1). */
VMH_TESTABLE bool vmh_host_mem_read(vmh_host_mem_t *out)
{
    char text[4096];
    memset(out, 0, sizeof *out);
    if (!read_text("/proc/meminfo", text, sizeof text) ||
        !meminfo_field(text, "MemTotal:", &out->total) ||
        !meminfo_field(text, "MemAvailable:", &out->available)) {
        long pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES),
             page = sysconf(_SC_PAGESIZE);
        if (pages <= 0 || avail < 0 || page <= 0)
            return false;
        out->total = (size_t)pages * (size_t)page;
        out->available = (size_t)avail * (size_t)page;
    }
    cgroup_apply(out);
    return out->total > 0;
}

static vmh_host_mem_fn host_mem = vmh_host_mem_read;

bool vmh_staging_host_mem(vmh_host_mem_t *out)
{
    return host_mem(out);
}

/* ---- backups: pageable memory --------------------------------------------------------------- */

static size_t page_round(size_t n)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return (n + page - 1) / page * page;
}

/* Fresh pageable memory of len bytes (a multiple of the page size), starting on a huge-page
 * boundary when it is at least one huge page long, with huge pages advised: the copy faults it
 * in, and huge pages make that 512 times fewer faults (advice only; the kernel may ignore it).
 * Exactly [result, result + len) is mapped. NULL when the system has none. */
static void *pageable_map(size_t len)
{
    size_t extra = len >= HUGE_PAGE ? HUGE_PAGE : 0;
    if (len > SIZE_MAX - extra)
        return NULL;
    char *raw = mmap(NULL, len + extra, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED)
        return NULL;
    char *host = raw;
    if (extra) {
        host = (char *)(((uintptr_t)raw + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
        if (host > raw)
            munmap(raw, (size_t)(host - raw));
        size_t tail = (size_t)(raw + extra - host);
        if (tail)
            munmap(host + len, tail);
    }
    madvise(host, len, MADV_HUGEPAGE);
    return host;
}

/* ---- the pool of kept pinned buffers -------------------------------------------------------- *
 * Every buffer registered for backups, from the moment its room is claimed: QUEUED for the
 * pinner, PINNING (a registration under way, on the pinner or on a resuming thread), KEPT
 * (registered). While an entry exists its memory is never unmapped by _put (which only marks it
 * free): whoever ends a failed registration unmaps it when it was put meanwhile. */
typedef enum { KEPT_QUEUED, KEPT_PINNING, KEPT_PINNED } kept_state_t;

typedef struct kept {
    void *host;
    size_t size; /* page-rounded: what is mapped and registered */
    bool in_use; /* holds a paused buffer's backup */
    kept_state_t state;
    CUcontext ctx; /* current at the registration: made current again to unregister */
    struct kept *next, *next_queued;
} kept_t;

/* A leaf lock: taken under the heap's record locks (a free of a paused buffer puts its backup),
 * and no other lock and no driver call is taken while it is held. */
static pthread_mutex_t kept_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t queue_cv = PTHREAD_COND_INITIALIZER; /* queued work or stop, for the pinner */
static kept_t *kept_list;
static kept_t *queue_head, *queue_tail;
static bool pinner_stop;
static size_t pin_cap; /* VMMHOOK_PIN_LIMIT */
static size_t claimed; /* bytes of every entry (queued, pinning, pinned) */
static size_t room;    /* bytes the current pause or resume may still claim */

void vmh_staging_configure(size_t cap)
{
    vmh_lock(&kept_lock, VMH_RANK_KEPT);
    pin_cap = cap;
    vmh_unlock(&kept_lock);
}

static kept_t *kept_find(const void *host)
{
    kept_t *k = kept_list;
    while (k && k->host != host)
        k = k->next;
    return k;
}

static void kept_unlink(kept_t *k)
{
    kept_t **at = &kept_list;
    while (*at != k)
        at = &(*at)->next;
    *at = k->next;
    claimed -= k->size;
}

/* A new entry for host, claimed against the call's room; NULL when there is none. */
static kept_t *kept_claim(void *host, size_t len, kept_state_t state)
{
    if (len > room)
        return NULL;
    kept_t *k = calloc(1, sizeof *k);
    if (!k)
        return NULL;
    *k = (kept_t){.host = host, .size = len, .in_use = true, .state = state};
    k->next = kept_list;
    kept_list = k;
    claimed += len;
    room -= len;
    return k;
}

/* The end of a registration, under kept_lock. On failure the entry goes (its room is given back)
 * and the memory to unmap (*len bytes), if the backup was put meanwhile, is returned. */
static void *kept_pinned(kept_t *k, CUresult rc, CUcontext ctx, size_t *len)
{
    *len = k->size;
    if (rc == CUDA_SUCCESS) {
        k->state = KEPT_PINNED;
        k->ctx = ctx;
        vmh_tags_pinned_add((int64_t)k->size);
        return NULL;
    }
    kept_unlink(k);
    room += k->size;
    void *unmap = k->in_use ? NULL : k->host;
    free(k);
    return unmap;
}

/* Gives back kept buffers (unlinked, chained by next): unregistered with their context current,
 * then unmapped. One that cannot be unregistered is linked again (still pinned, still usable). */
static void kept_release(kept_t *list)
{
    while (list) {
        kept_t *k = list;
        list = k->next;
        vmh_ctx_scope_t scope;
        CUresult rc = vmh_ctx_enter(k->ctx, &scope);
        if (rc == CUDA_SUCCESS) {
            rc = vmh_drv.cuMemHostUnregister(k->host);
            /* Unregistered: given back below whatever the leave says (it logs a failure). */
            (void)vmh_ctx_leave(&scope);
        }
        if (rc != CUDA_SUCCESS) {
            vmh_log("backup memory: giving back %zu pinned bytes failed (CUDA error %d); kept",
                    k->size, (int)rc);
            vmh_lock(&kept_lock, VMH_RANK_KEPT);
            k->next = kept_list;
            kept_list = k;
            claimed += k->size;
            vmh_unlock(&kept_lock);
            continue;
        }
        munmap(k->host, k->size);
        vmh_tags_pinned_add(-(int64_t)k->size);
        free(k);
    }
}

void vmh_staging_budget_begin(void)
{
    vmh_host_mem_t m;
    bool known = host_mem(&m) && m.total > 0;
    kept_t *release = NULL;
    vmh_lock(&kept_lock, VMH_RANK_KEPT);
    /* Unknown host memory: keep what is kept, pin nothing new. */
    size_t budget =
        known && m.total / HOST_SHARE_DIV < pin_cap ? m.total / HOST_SHARE_DIV : pin_cap;
    size_t low = known ? m.total / HOST_LOW_DIV : 0, avail = known ? m.available : 0;
    /* Pressure: give back free kept buffers until the mark is met (largest first: fewest
     * unregistrations). Buffers in use hold a paused tag's contents: never. */
    while (known && avail < low) {
        kept_t *big = NULL;
        for (kept_t *k = kept_list; k; k = k->next)
            if (!k->in_use && k->state == KEPT_PINNED && (!big || k->size > big->size))
                big = k;
        if (!big)
            break;
        kept_unlink(big);
        avail += big->size;
        big->next = release;
        release = big;
    }
    room = known && budget > claimed ? budget - claimed : 0;
    if (room > (avail > low ? avail - low : 0))
        room = avail > low ? avail - low : 0;
    vmh_unlock(&kept_lock);
    if (release)
        vmh_log("backup memory: host memory is low (%zu MiB available, mark %zu MiB): giving "
                "back free pinned buffers",
                m.available >> 20, low >> 20);
    kept_release(release);
}

/* The pause's region (vmh_staging_region_open): carved by _get on the pausing thread only (the
 * pause layer's lock serializes pauses), so no lock. */
static char *region_next;
static size_t region_left;

void vmh_staging_region_open(size_t bytes)
{
    assert(!region_left);
    size_t len = page_round(bytes);
    region_next = len ? pageable_map(len) : NULL;
    region_left = region_next ? len : 0;
}

void vmh_staging_region_close(void)
{
    if (region_left)
        munmap(region_next, region_left);
    region_next = NULL;
    region_left = 0;
}

/* Fresh pageable memory for one backup: the next part of the pause's region when it has room
 * (no mmap while the pinner registers the backups before it), else a mapping of its own. */
static void *pageable_get(size_t size)
{
    size_t len = page_round(size);
    if (len > region_left)
        return pageable_map(len);
    void *host = region_next;
    region_next += len;
    region_left -= len;
    return host;
}

/* ---- backups that are never pinned: pageable-only and file-backed ---------------------------- *
 * Listed so that _put knows how to give them back and _pin_now leaves them pageable. */
typedef struct unpinned {
    void *host;
    size_t size; /* page-rounded: what is mapped */
    int fd;      /* the backup's file (VMH_BACKUP_FILE), else -1 */
    char *path;  /* its name, unlinked at _put */
    struct unpinned *next;
} unpinned_t;

static unpinned_t *unpinned_list; /* under kept_lock */
static char *backup_dir;          /* vmh_staging_set_dir; under kept_lock */

bool vmh_staging_set_dir(const char *dir)
{
    char *copy = dir ? strdup(dir) : NULL;
    if (dir && !copy)
        return false;
    vmh_lock(&kept_lock, VMH_RANK_KEPT);
    char *old = backup_dir;
    backup_dir = copy;
    vmh_unlock(&kept_lock);
    free(old);
    return true;
}

/* A file of len bytes in the backup directory, mapped shared: what the copy writes lands in the
 * file's pages (vmh_staging_backup_settle then drops them from the process). NULL when there is
 * no directory or the file cannot be made. */
static void *file_map(size_t len, unpinned_t *u)
{
    vmh_lock(&kept_lock, VMH_RANK_KEPT);
    size_t n = backup_dir ? strlen(backup_dir) + sizeof "/vmmhook-backup-XXXXXX" : 0;
    char *path = n ? malloc(n) : NULL;
    if (path)
        snprintf(path, n, "%s/vmmhook-backup-XXXXXX", backup_dir);
    vmh_unlock(&kept_lock);
    if (!path)
        return NULL;
    int fd = mkostemp(path, O_CLOEXEC);
    void *host = MAP_FAILED;
    if (fd >= 0 && ftruncate(fd, (off_t)len) == 0)
        host = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (host == MAP_FAILED) {
        if (fd >= 0) {
            unlink(path);
            close(fd);
        }
        free(path);
        return NULL;
    }
    u->fd = fd;
    u->path = path;
    return host;
}

/* A never-pinned backup of kind PAGEABLE or FILE, listed. */
static void *unpinned_get(size_t size, vmh_backup_kind_t kind)
{
    unpinned_t *u = calloc(1, sizeof *u);
    if (!u)
        return NULL;
    u->fd = -1;
    u->size = page_round(size);
    u->host = kind == VMH_BACKUP_FILE ? file_map(u->size, u) : pageable_get(size);
    if (!u->host) {
        free(u);
        return NULL;
    }
    vmh_lock(&kept_lock, VMH_RANK_KEPT);
    u->next = unpinned_list;
    unpinned_list = u;
    vmh_unlock(&kept_lock);
    return u->host;
}

/* The listed entry of host, unlinked; NULL when host is not a never-pinned backup. */
static unpinned_t *unpinned_take(const void *host)
{
    vmh_lock(&kept_lock, VMH_RANK_KEPT);
    unpinned_t **at = &unpinned_list;
    while (*at && (*at)->host != host)
        at = &(*at)->next;
    unpinned_t *u = *at;
    if (u)
        *at = u->next;
    vmh_unlock(&kept_lock);
    return u;
}

static bool is_unpinned(const void *host)
{
    vmh_lock(&kept_lock, VMH_RANK_KEPT);
    unpinned_t *u = unpinned_list;
    while (u && u->host != host)
        u = u->next;
    vmh_unlock(&kept_lock);
    return u != NULL;
}

void vmh_staging_backup_settle(void *host, size_t size)
{
    vmh_lock(&kept_lock, VMH_RANK_KEPT);
    unpinned_t *u = unpinned_list;
    while (u && u->host != host)
        u = u->next;
    bool file = u && u->fd >= 0; /* u stays listed: only this backup's holder puts it */
    vmh_unlock(&kept_lock);
    /* The copy's pages are the file's (page cache, written back by the kernel): out of the
     * process's resident memory now; the resume's copy reads them back from the file. */
    if (!file)
        return;
    size_t len = page_round(size);
    madvise(host, len, MADV_DONTNEED);
    /* And out of the page cache, so that the backup takes no host memory (TMS's meaning of a
     * disk backup): written to the disk first, then dropped (no effect on tmpfs). */
    fdatasync(u->fd);
    posix_fadvise(u->fd, 0, (off_t)len, POSIX_FADV_DONTNEED);
}

void *vmh_staging_backup_get(size_t size, vmh_backup_kind_t kind, bool *pinned)
{
    *pinned = false;
    if (kind != VMH_BACKUP_ANY)
        return unpinned_get(size, kind);
    vmh_lock(&kept_lock, VMH_RANK_KEPT);
    kept_t *best = NULL;
    for (kept_t *k = kept_list; k; k = k->next)
        if (!k->in_use && k->state == KEPT_PINNED && k->size >= size &&
            (!best || k->size < best->size))
            best = k;
    if (best)
        best->in_use = true;
    vmh_unlock(&kept_lock);
    *pinned = best != NULL;
    return best ? best->host : pageable_get(size);
}

void vmh_staging_backup_put(void *host, size_t size)
{
    unpinned_t *u = unpinned_take(host);
    if (u) {
        munmap(u->host, u->size);
        if (u->fd >= 0) { /* the file goes with its backup */
            unlink(u->path);
            close(u->fd);
        }
        free(u->path);
        free(u);
        return;
    }
    vmh_lock(&kept_lock, VMH_RANK_KEPT);
    kept_t *k = kept_find(host);
    if (k)
        k->in_use = false;
    vmh_unlock(&kept_lock);
    if (!k)
        munmap(host, page_round(size));
}

size_t vmh_staging_pinned_free(void)
{
    size_t bytes = 0;
    vmh_lock(&kept_lock, VMH_RANK_KEPT);
    for (kept_t *k = kept_list; k; k = k->next)
        if (!k->in_use && k->state == KEPT_PINNED)
            bytes += k->size;
    vmh_unlock(&kept_lock);
    return bytes;
}

size_t vmh_staging_trim(void)
{
    kept_t *release = NULL;
    size_t bytes = 0;
    vmh_lock(&kept_lock, VMH_RANK_KEPT);
    for (kept_t **at = &kept_list; *at;) {
        kept_t *k = *at;
        if (k->in_use || k->state != KEPT_PINNED) {
            at = &k->next;
            continue;
        }
        *at = k->next;
        claimed -= k->size;
        bytes += k->size;
        k->next = release;
        release = k;
    }
    vmh_unlock(&kept_lock);
    kept_release(release);
    return bytes;
}

bool vmh_staging_pin_now(void *host, size_t size, CUcontext ctx)
{
    if (is_unpinned(host))
        return false;
    vmh_lock(&kept_lock, VMH_RANK_KEPT);
    kept_t *k = kept_find(host);
    bool kept = k != NULL;
    if (!k)
        k = kept_claim(host, page_round(size), KEPT_PINNING);
    vmh_unlock(&kept_lock);
    if (kept || !k)
        return kept;
    /* PORTABLE: pinned for every context, as a kept buffer may serve another device later. */
    CUresult rc = vmh_drv.cuMemHostRegister(host, k->size, CU_MEMHOSTREGISTER_PORTABLE);
    vmh_lock(&kept_lock, VMH_RANK_KEPT);
    size_t len;
    void *unmap = kept_pinned(k, rc, ctx, &len);
    vmh_unlock(&kept_lock);
    if (unmap) /* not reached: the resuming thread holds the backup's record */
        munmap(unmap, len);
    return rc == CUDA_SUCCESS;
}

/* ---- the staging ring ----------------------------------------------------------------------- */

CUresult vmh_staging_open(vmh_staging_t *s, CUcontext ctx, size_t slot_size, int workers)
{
    assert(ctx && slot_size > 0);
    memset(s, 0, sizeof *s);
    for (int i = 0; i < 2; i++) {
        /* PORTABLE: a tag's memory may be on several devices; one pair of slots serves all. */
        CUresult rc = vmh_drv.cuMemHostAlloc(&s->slot[i], slot_size, CU_MEMHOSTALLOC_PORTABLE);
        if (rc != CUDA_SUCCESS) {
            if (i == 1)
                vmh_drv.cuMemFreeHost(s->slot[0]);
            memset(s, 0, sizeof *s);
            return rc;
        }
    }
    s->slot_size = slot_size;
    s->pinned_in = ctx;
    vmh_copy_pool_start(&s->pool, workers);
    return CUDA_SUCCESS;
}

/* Queues the copy of piece k of [src, src + n) into slot k % 2. */
static CUresult queue_piece(vmh_staging_t *s, size_t k, CUdeviceptr src, size_t n)
{
    size_t off = k * s->slot_size;
    size_t len = n - off < s->slot_size ? n - off : s->slot_size;
    CUresult rc = vmh_drv.cuMemcpyDtoHAsync(s->slot[k % 2], src + off, len, s->stream);
    s->in_flight = rc == CUDA_SUCCESS;
    return rc;
}

/* Copies the slot's len bytes, which are the run's bytes from off on, out to the destinations
 * they belong to (d: a cursor into the list, advanced past what this fills). */
static void slot_out(vmh_staging_t *s, const char *slot, size_t len, void *const *dst,
                     const size_t *dst_len, size_t *d, size_t *d_off)
{
    while (len) {
        size_t m = dst_len[*d] - *d_off < len ? dst_len[*d] - *d_off : len;
        if (m)
            vmh_copy_pool_run(&s->pool, (char *)dst[*d] + *d_off, slot, m);
        slot += m;
        len -= m;
        *d_off += m;
        if (*d_off == dst_len[*d]) {
            ++*d;
            *d_off = 0;
        }
    }
}

CUresult vmh_staging_copy_run(vmh_staging_t *s, void *const *dst, const size_t *dst_len,
                              size_t ndst, CUdeviceptr src)
{
    assert(s->slot[0]);
    /* A copy left queued by a failed wait (the caller may go on: a failure it takes for "skip
     * this one") must land before its slot is written again. */
    if (s->in_flight) {
        CUresult rc = vmh_drv.cuStreamSynchronize(s->stream);
        if (rc != CUDA_SUCCESS)
            return rc;
        s->in_flight = false;
    }
    size_t n = 0, d = 0, d_off = 0;
    for (size_t i = 0; i < ndst; i++)
        n += dst_len[i];
    while (d < ndst && dst_len[d] == 0)
        d++;
    if (n == 0)
        return CUDA_SUCCESS;
    if (!s->stream) {
        /* Non-blocking: the ring's copies neither wait for the program's legacy-stream work
         * (the pause waited for the device before its copies) nor make it wait. */
        CUresult rc = vmh_drv.cuStreamCreate(&s->stream, CU_STREAM_NON_BLOCKING);
        if (rc != CUDA_SUCCESS) {
            s->stream = NULL;
            return rc;
        }
    }
    /* The run is one stream of pieces through the two slots, whatever its destinations: the
     * ring does not drain between buffers. */
    size_t pieces = (n - 1) / s->slot_size + 1;
    CUresult rc = queue_piece(s, 0, src, n);
    for (size_t k = 0; k < pieces && rc == CUDA_SUCCESS; k++) {
        /* Only piece k is queued: the next one is queued after this wait, so waiting for the
         * stream is waiting for exactly this piece (no event per slot needed). */
        rc = vmh_drv.cuStreamSynchronize(s->stream);
        if (rc != CUDA_SUCCESS)
            break;
        s->in_flight = false;
        /* The driver fills the other slot while the pool empties this one. */
        if (k + 1 < pieces && (rc = queue_piece(s, k + 1, src, n)) != CUDA_SUCCESS)
            break;
        size_t off = k * s->slot_size;
        size_t len = n - off < s->slot_size ? n - off : s->slot_size;
        slot_out(s, s->slot[k % 2], len, dst, dst_len, &d, &d_off);
    }
    return rc;
}

CUresult vmh_staging_copy(vmh_staging_t *s, void *dst, CUdeviceptr src, size_t n)
{
    return vmh_staging_copy_run(s, &dst, &n, 1, src);
}

/* The pinner: registers the queued backups, oldest first, with the ring's context current
 * (PORTABLE, so any context will do), until it is stopped and nothing is queued. Registering
 * memory the ring has just written (touched) is the fast kind of pinning, and on this thread it
 * overlaps the ring's copies of the next buffers instead of adding to them. */
static void *pinner_main(void *arg)
{
    const vmh_staging_t *s = arg;
    vmh_ctx_scope_t scope;
    CUresult ctx_rc = vmh_ctx_enter(s->pinned_in, &scope);
    CUresult first_failure = CUDA_SUCCESS;
    size_t failed = 0;
    vmh_lock(&kept_lock, VMH_RANK_KEPT);
    for (;;) {
        while (!queue_head && !pinner_stop)
            pthread_cond_wait(&queue_cv, &kept_lock);
        kept_t *k = queue_head;
        if (!k)
            break;
        queue_head = k->next_queued;
        if (!queue_head)
            queue_tail = NULL;
        k->state = KEPT_PINNING;
        vmh_unlock(&kept_lock);
        CUresult rc =
            ctx_rc != CUDA_SUCCESS
                ? ctx_rc
                : vmh_drv.cuMemHostRegister(k->host, k->size, CU_MEMHOSTREGISTER_PORTABLE);
        vmh_lock(&kept_lock, VMH_RANK_KEPT);
        size_t len;
        void *unmap = kept_pinned(k, rc, s->pinned_in, &len);
        if (rc != CUDA_SUCCESS && failed++ == 0)
            first_failure = rc;
        if (unmap) {
            vmh_unlock(&kept_lock);
            munmap(unmap, len);
            vmh_lock(&kept_lock, VMH_RANK_KEPT);
        }
    }
    vmh_unlock(&kept_lock);
    (void)vmh_ctx_leave(&scope); /* the thread ends: a failure is only logged */
    if (failed)                  /* slower, not wrong: those backups stay pageable */
        vmh_log("backup memory: pinning %zu backups failed (first: CUDA error %d); they stay "
                "pageable",
                failed, (int)first_failure);
    return NULL;
}

bool vmh_staging_pin_later(vmh_staging_t *s, void *host, size_t size)
{
    vmh_lock(&kept_lock, VMH_RANK_KEPT);
    kept_t *k = kept_claim(host, page_round(size), KEPT_QUEUED);
    if (k && !s->pinner_running) {
        pinner_stop = false;
        s->pinner_running = vmh_thread_start(&s->pinner, pinner_main, s) == 0;
        if (!s->pinner_running) {
            kept_unlink(k);
            room += k->size;
            free(k);
            k = NULL;
        }
    }
    if (k) {
        if (queue_tail)
            queue_tail->next_queued = k;
        else
            queue_head = k;
        queue_tail = k;
        pthread_cond_signal(&queue_cv);
    }
    vmh_unlock(&kept_lock);
    return k != NULL;
}

void vmh_staging_leave_context(vmh_staging_t *s)
{
    if (!s->stream)
        return;
    /* A copy left queued by a failed wait would write into a slot after it is freed. */
    if (s->in_flight && vmh_drv.cuStreamSynchronize(s->stream) != CUDA_SUCCESS)
        vmh_log("backup staging: waiting for a queued copy failed; freeing its slot anyway");
    s->in_flight = false;
    if (vmh_drv.cuStreamDestroy(s->stream) != CUDA_SUCCESS)
        vmh_log("backup staging: cuStreamDestroy failed (the stream is left to its context)");
    s->stream = NULL;
}

void vmh_staging_close(vmh_staging_t *s)
{
    assert(!s->stream && !s->in_flight);
    if (s->pinner_running) {
        /* What is queued is registered first: a pause returns with its backups pinned. */
        vmh_lock(&kept_lock, VMH_RANK_KEPT);
        pinner_stop = true;
        pthread_cond_broadcast(&queue_cv);
        vmh_unlock(&kept_lock);
        pthread_join(s->pinner, NULL);
        vmh_lock(&kept_lock, VMH_RANK_KEPT);
        pinner_stop = false;
        vmh_unlock(&kept_lock);
    }
    vmh_copy_pool_stop(&s->pool);
    vmh_ctx_scope_t scope;
    if (vmh_ctx_enter(s->pinned_in, &scope) != CUDA_SUCCESS) {
        vmh_log("backup staging: cannot make the slots' context current: 2 x %zu bytes of "
                "pinned host memory are not given back",
                s->slot_size);
    } else {
        for (int i = 0; i < 2; i++)
            if (vmh_drv.cuMemFreeHost(s->slot[i]) != CUDA_SUCCESS)
                vmh_log("backup staging: cuMemFreeHost of a slot failed");
        (void)vmh_ctx_leave(&scope); /* a failure is logged; the slots are freed */
    }
    memset(s, 0, sizeof *s);
}

#ifdef VMH_TESTING
void vmh_staging_set_host_mem(vmh_host_mem_fn fn)
{
    host_mem = fn ? fn : vmh_host_mem_read;
}

void vmh_staging_reset(void)
{
    vmh_lock(&kept_lock, VMH_RANK_KEPT);
    assert(!queue_head);
    kept_t *list = kept_list; /* unregistered outside the lock, as in kept_release */
    kept_list = NULL;
    claimed = room = 0;
    host_mem = vmh_host_mem_read;
    vmh_unlock(&kept_lock);
    while (list) {
        kept_t *k = list;
        list = k->next;
        assert(k->state == KEPT_PINNED);
        vmh_drv.cuMemHostUnregister(k->host);
        if (!k->in_use) /* else a failed test left it paused: its holder unmaps it */
            munmap(k->host, k->size);
        vmh_tags_pinned_add(-(int64_t)k->size);
        free(k);
    }
}

size_t vmh_staging_kept_count(void)
{
    size_t n = 0;
    vmh_lock(&kept_lock, VMH_RANK_KEPT);
    for (kept_t *k = kept_list; k; k = k->next)
        n++;
    vmh_unlock(&kept_lock);
    return n;
}

size_t vmh_staging_kept_bytes(void)
{
    return vmh_read_locked(&kept_lock, VMH_RANK_KEPT, &claimed);
}
#endif
