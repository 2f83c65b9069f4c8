/* simdrv: device memory's contents and the lifetimes of the ledger's memory objects.
 *
 * Contents: a VMM allocation's or a native block's bytes, mapped (MAP_NORESERVE) at the first
 * write that is not zeroes, so that most of the fake address space costs nothing; reads and
 * writes go through the mappings with their access flags, as a kernel's would. Lifetimes: an
 * allocation goes when no handle, no mapping and no open exported descriptor is left; handles,
 * mappings and native blocks are created and destroyed here for the VMM, IPC and native
 * allocator sources. */
#include "simint.h"

/* The copies below stand for the GPU's copy engines and kernels, not for a CPU thread: what
 * orders them against the program's threads is the stream's and context's synchronization,
 * which the simulator checks itself (hazards). ThreadSanitizer would check every byte of them
 * against shadow memory four times their size (most of the sanitized suites' time, its page
 * faults included: 200 s for one 1.2 GiB backup pause on 2 busy cores), so under TSan they are
 * done with the thread's memory accesses ignored. The library's own host copies (the staging
 * ring, the copy pool) stay checked. */
#if defined(__SANITIZE_THREAD__)
#define SIM_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SIM_TSAN 1
#endif
#endif
#ifdef SIM_TSAN
/* Device memory's backing is mapped and unmapped by system calls TSan does not see: its mmap
 * interceptor writes the shadow of the whole range (four times a chunk's bytes) and munmap
 * clears it, for memory only the copies below touch, with accesses ignored. */
#include <sys/syscall.h>
#include <unistd.h>
#define sim_mmap(a, n, prot, flags, fd, off) ((void *)syscall(SYS_mmap, a, n, prot, flags, fd, off))
#define sim_munmap(a, n) syscall(SYS_munmap, a, n)
void AnnotateIgnoreReadsBegin(const char *file, int line);
void AnnotateIgnoreReadsEnd(const char *file, int line);
void AnnotateIgnoreWritesBegin(const char *file, int line);
void AnnotateIgnoreWritesEnd(const char *file, int line);
#define DMA_BEGIN() (AnnotateIgnoreReadsBegin(__FILE__, __LINE__), AnnotateIgnoreWritesBegin(__FILE__, __LINE__))
#define DMA_END() (AnnotateIgnoreWritesEnd(__FILE__, __LINE__), AnnotateIgnoreReadsEnd(__FILE__, __LINE__))
#else
#define DMA_BEGIN() ((void)0)
#define DMA_END() ((void)0)
#define sim_mmap mmap
#define sim_munmap munmap
#endif

/* ---------------------------------------------------------------------------------------- */
/* Contents                                                                                  */

static unsigned char *backing(unsigned char **slot, size_t size)
{
    if (!*slot) {
        void *p = sim_mmap(NULL, size, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED)
            die("mmap of %zu bytes for contents failed: %s", size, strerror(errno));
        *slot = p;
    }
    return *slot;
}

static void drop_backing(unsigned char **slot, size_t size)
{
    if (*slot)
        sim_munmap(*slot, size);
    *slot = NULL;
}

typedef struct loc {
    unsigned char **slot;
    size_t slot_size;
    size_t off;
    size_t avail; /* bytes from off on with the same answer */
} loc_t;

/* Where device address p lives, if device dev may read (or write) it. */
static CUresult resolve(CUdeviceptr p, int dev, bool write, loc_t *out)
{
    sim_map_t *m = vec_find(&S.maps, p);
    if (m) {
        size_t g = (p - m->iv.ptr) / gran();
        unsigned flags = m->acc[g * (size_t)ndev() + (size_t)dev];
        unsigned need = write ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_READ;
        if ((flags & need) != need)
            return reject(CUDA_ERROR_ILLEGAL_ADDRESS,
                          "0x%llx: device %d has no %s access (flags %u)", (unsigned long long)p,
                          dev, write ? "write" : "read", flags);
        out->slot = &m->a->bytes;
        out->slot_size = m->a->size;
        out->off = p - m->iv.ptr;
        out->avail = (g + 1) * gran() - out->off;
        return CUDA_SUCCESS;
    }
    sim_native_t *n = vec_find(&S.natives, p);
    if (n && p - n->iv.ptr < n->size) {
        out->slot = &n->bytes;
        out->slot_size = n->size;
        out->off = p - n->iv.ptr;
        out->avail = n->size - out->off;
        return CUDA_SUCCESS;
    }
    return reject(CUDA_ERROR_ILLEGAL_ADDRESS, "0x%llx is not mapped", (unsigned long long)p);
}

CUresult check_range(CUdeviceptr p, size_t n, int dev, bool write)
{
    if (p + n < p)
        return reject(CUDA_ERROR_ILLEGAL_ADDRESS, "%s", "range wraps");
    while (n) {
        loc_t l;
        CUresult rc = resolve(p, dev, write, &l);
        if (rc)
            return rc;
        size_t k = l.avail < n ? l.avail : n;
        p += k;
        n -= k;
    }
    return CUDA_SUCCESS;
}

/* The three below assume check_range passed. src NULL writes zeroes (fill = value). */
void do_write(CUdeviceptr p, const unsigned char *src, int fill, size_t n, int dev)
{
    while (n) {
        loc_t l;
        if (resolve(p, dev, true, &l))
            die("do_write: unchecked range");
        size_t k = l.avail < n ? l.avail : n;
        if (src || fill || *l.slot) {
            unsigned char *b = backing(l.slot, l.slot_size);
            DMA_BEGIN();
            if (src)
                memcpy(b + l.off, src, k);
            else
                memset(b + l.off, fill, k);
            DMA_END();
        }
        if (src)
            src += k;
        p += k;
        n -= k;
    }
}

void do_read(unsigned char *dst, CUdeviceptr p, size_t n, int dev)
{
    while (n) {
        loc_t l;
        if (resolve(p, dev, false, &l))
            die("do_read: unchecked range");
        size_t k = l.avail < n ? l.avail : n;
        DMA_BEGIN();
        if (*l.slot)
            memcpy(dst, *l.slot + l.off, k);
        else
            memset(dst, 0, k);
        DMA_END();
        dst += k;
        p += k;
        n -= k;
    }
}

static bool unbacked(CUdeviceptr p, size_t n, int dev)
{
    while (n) {
        loc_t l;
        if (resolve(p, dev, false, &l))
            return false;
        if (*l.slot)
            return false;
        size_t k = l.avail < n ? l.avail : n;
        p += k;
        n -= k;
    }
    return true;
}

void do_copy(CUdeviceptr dst, CUdeviceptr src, size_t n, int dev)
{
    enum { CH = 1 << 20 };
    static unsigned char buf[CH]; /* under the lock */
    bool backward = dst > src && dst < src + n;
    size_t done = 0;
    while (done < n) {
        size_t k = n - done < CH ? n - done : CH;
        size_t off = backward ? n - done - k : done;
        if (unbacked(src + off, k, dev) && unbacked(dst + off, k, dev)) {
            done += k;
            continue;
        }
        do_read(buf, src + off, k, dev);
        do_write(dst + off, buf, 0, k, dev);
        done += k;
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Allocation lifetimes                                                                     */

/* Whether a descriptor exported from allocation a is still open in this process. As with the
 * real driver, an open exported descriptor keeps the allocation alive (an importer may import
 * it later); a descriptor sent to another process is that process's (a forked child has its
 * own copy of this state). */
static bool export_fd_open(const sim_alloc_t *a)
{
    bool exported = false;
    for (size_t i = 0; i < S.nexports && !exported; i++)
        exported = S.exports[i].a == a;
    if (!exported)
        return false;
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return false;
    bool open = false;
    struct dirent *de;
    while (!open && (de = readdir(d))) {
        struct stat st;
        int fd = atoi(de->d_name);
        if (de->d_name[0] == '.' || fd == dirfd(d) || fstat(fd, &st) != 0)
            continue;
        for (size_t i = 0; i < S.nexports && !open; i++)
            open = S.exports[i].a == a && S.exports[i].dev == st.st_dev &&
                   S.exports[i].ino == st.st_ino;
    }
    closedir(d);
    return open;
}

void alloc_maybe_free(sim_alloc_t *a)
{
    if (a->nhandles || a->nmaps)
        return;
    bool held = export_fd_open(a);
    if (held != a->held_by_fd) {
        a->held_by_fd = held;
        if (held)
            S.held_by_fd++;
        else
            S.held_by_fd--;
    }
    if (held)
        return;
    if (a->device >= 0)
        S.used[a->device] -= a->size;
    else
        S.host_used -= a->size;
    drop_backing(&a->bytes, a->size);
    for (size_t i = 0; i < S.nexports;) {
        if (S.exports[i].a == a)
            S.exports[i] = S.exports[--S.nexports];
        else
            i++;
    }
    if (a->prev)
        a->prev->next = a->next;
    else
        S.allocs = a->next;
    if (a->next)
        a->next->prev = a->prev;
    S.nallocs--;
    free(a);
}

/* Frees the allocations that only an exported descriptor kept alive once it is closed: checked
 * at the next allocation and ledger query (a close is no driver call). */
void allocs_sweep_held(void)
{
    if (!S.held_by_fd)
        return;
    for (sim_alloc_t *a = S.allocs, *next; a; a = next) {
        next = a->next;
        if (a->held_by_fd)
            alloc_maybe_free(a);
    }
}

CUmemGenericAllocationHandle handle_new(sim_alloc_t *a)
{
    sim_handle_t *h = xcalloc(1, sizeof *h);
    S.next_handle += 0x10;
    h->iv.ptr = S.next_handle;
    h->iv.span = 1;
    h->a = a;
    a->nhandles++;
    vec_insert(&S.handles, h);
    return h->iv.ptr;
}

void map_destroy(sim_map_t *m)
{
    vec_remove(&S.maps, m);
    m->a->nmaps--;
    alloc_maybe_free(m->a);
    free(m->acc);
    free(m);
}

void native_destroy(sim_native_t *n)
{
    vec_remove(&S.natives, n);
    S.used[n->device] -= n->charged;
    drop_backing(&n->bytes, n->size);
    free(n);
}
