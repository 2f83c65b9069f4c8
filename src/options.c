/* Layer "utilities": the VMMHOOK_* options. One table, one row per variable (name, kind, field,
 * default, bounds, help, detail); the defaults live only here, as text that the same parser
 * reads, so a default can never disagree with what the variable accepts. The launcher's help and
 * docs/OPTIONS.md's table are generated from it (tools/launcher/vmmhook-config), and the tools
 * suite fails when the committed page differs. The value parsers are in optparse.c.
 *
 * Rules every row follows:
 *  - read once, with secure_getenv (a set-uid program ignores the environment);
 *  - unset or empty: the default;
 *  - blanks around a value are ignored except for paths, which are taken verbatim;
 *  - a bad value: one warning naming the variable, the value (escaped, shortened) and the
 *    accepted forms, and the default is kept; with VMMHOOK_STRICT the program stops instead
 *    (log.h's vmh_log_stop).
 * This file parses, checks forms, formats and prints; what a value means to a layer is that
 * layer's (lifetime.c makes each layer's settings from the snapshot), and so is a value the
 * machine refuses later (lifetime.c's refusal policy). Nothing here allocates; stdio only to
 * format. The first read can happen inside dlsym or the driver. */
#include "options.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/auxv.h>
#include <unistd.h>

#include "log.h"
#include "optparse.h"
#include "testable.h"
#include "vmmhook.h"

/* The kinds of row (vmh_option_kind_t in options.h), by their short names here. */
typedef vmh_option_kind_t opt_kind_t;
#define K_SIZE VMH_OPTION_SIZE
#define K_BOOL VMH_OPTION_BOOL
#define K_ENUM VMH_OPTION_WORD
#define K_GRAN VMH_OPTION_GRANULARITY
#define K_DEVMASK VMH_OPTION_DEVICES
#define K_STRING VMH_OPTION_PATH

typedef struct opt_row {
    const char *name;
    opt_kind_t kind;
    size_t off;               /* offsetof the field in vmh_options_t */
    size_t size;              /* sizeof the field (the buffer size of strings) */
    const char *def;          /* the default, in a form the row accepts */
    size_t min;               /* K_SIZE: the smallest accepted value */
    size_t max;               /* K_SIZE, K_GRAN (as a size): the largest, 0 = no bound */
    const char *const *words; /* K_ENUM, K_GRAN: the word of each enum value, in order */
    unsigned nwords;
    const char *help;   /* one plain line: the launcher's help, vmmhook-config */
    const char *detail; /* markdown added after help in docs/OPTIONS.md ("" = none) */
} opt_row_t;

/* Enums are stored through an int pointer: gcc and clang give these enums int size. */
_Static_assert(sizeof(vmh_handle_kind_t) == sizeof(int), "enum size");
_Static_assert(sizeof(vmh_gran_mode_t) == sizeof(int), "enum size");

static const char *const handle_words[] = {"none", "posix_fd", "fabric"};
_Static_assert(sizeof(handle_words) / sizeof(handle_words[0]) == VMH_HANDLE_KIND_COUNT, "words");
/* The words of VMH_GRAN_RECOMMENDED and VMH_GRAN_MIN; VMH_GRAN_BYTES is spelled as a size. */
static const char *const overflow_words[] = {"off", "host"};
_Static_assert(sizeof(overflow_words) / sizeof(overflow_words[0]) == VMH_OVERFLOW_KIND_COUNT,
               "words");
_Static_assert(sizeof(vmh_overflow_kind_t) == sizeof(int), "enum size");
static const char *const gran_words[] = {"recommended", "min"};
_Static_assert(VMH_GRAN_RECOMMENDED == 0 && VMH_GRAN_MIN == 1 && VMH_GRAN_BYTES == 2, "order");

#define FIELD(f) offsetof(vmh_options_t, f), sizeof(((vmh_options_t *)0)->f)
#define WORDS(w) w, (unsigned)(sizeof(w) / sizeof(w[0]))
#define NO_WORDS NULL, 0

/* THE options table: the single source of every option's name, default, bounds and text. The
 * launcher's help (vmmhook --help) and the table of docs/OPTIONS.md are generated from it by
 * tools/launcher/vmmhook-config, and a test fails when the committed page differs. */
static const opt_row_t rows[] = {
    {"VMMHOOK_GRANULARITY", K_GRAN, FIELD(gran_mode), "recommended", 0, VMH_GRANULARITY_MAX,
     WORDS(gran_words),
     "Chunk size of device memory: the driver's minimum or recommended granularity, or a size "
     "that is a multiple of the minimum, at most 256G.",
     "The granularities are those the driver gives for the exact allocation properties in use "
     "(handle type, RDMA flag). An explicit size above 256G is refused when the options are "
     "read, and by `vmmhook --check` (no GPU has that much memory: the largest have 288 GB; "
     "every chunk would fail). The rest is checked against the driver when a device is first "
     "set up, which `--check` cannot do: a size that is not a multiple of the minimum, or one "
     "the driver cannot make on this GPU (one chunk of it is made and released then), gets a "
     "warning naming the value and the reason (the minimum, or the driver's answer), and the "
     "recommended granularity is used instead; with `VMMHOOK_STRICT` the program stops."},
    {"VMMHOOK_HANDLE_TYPE", K_ENUM, FIELD(handle), "posix_fd", 0, 0, WORDS(handle_words),
     "Shareable handle type requested for every chunk, so that CUDA IPC works on served memory.",
     "It is the `requestedHandleTypes` of `cuMemCreate`; CUDA IPC is `cudaIpcGetMemHandle` "
     "(docs/IPC.md). `posix_fd` is the default because without it IPC on served memory fails; "
     "it costs a little: on the H200 (docs/GPU-RUNS.md, run of 4f60da2, cache off) a 2 MiB "
     "alloc+free took 1.60 us with it against 1.44 us with `none` (+11%), a 64 MiB one 191.3 us "
     "against 190.7 us. When the driver rejects the type on this machine (`fabric` needs IMEX; "
     "the H200 refused it with error 800), a warning says so and `none` is used."},
    {"VMMHOOK_HEADROOM", K_SIZE, FIELD(headroom), "1G", 0, 0, NO_WORDS,
     "Address space reserved past the end of a buffer made by vmm_realloc, so that it can grow "
     "in place.",
     "Up to the buffer's own size, and within `VMMHOOK_VA_LIMIT`. Address space only: it costs "
     "no device memory. `0` reserves none (growth then relies on the adjacent address space, "
     "or moves)."},
    {"VMMHOOK_VA_LIMIT", K_SIZE, FIELD(va_limit), "64T", 1, 0, NO_WORDS,
     "Total virtual address space the library may reserve, all devices together.", ""},
    {"VMMHOOK_CACHE_LIMIT", K_SIZE, FIELD(cache_limit), "1G", 0, 0, NO_WORDS,
     "Idle device memory kept per device for reuse after frees; 0 keeps none.",
     "Cached memory is given back when an allocation fails, so it never makes the program run "
     "out of memory."},
    {"VMMHOOK_MEM_LIMIT", K_SIZE, FIELD(mem_limit), "0", 0, 0, NO_WORDS,
     "Device memory served per device; an allocation over it fails with the native "
     "out-of-memory code; 0 is no limit.",
     "The code is `CUDA_ERROR_OUT_OF_MEMORY`, which cudart reports as "
     "`cudaErrorMemoryAllocation`."},
    {"VMMHOOK_PACK_BELOW", K_SIZE, FIELD(pack_below), "1T", 0, 0, NO_WORDS,
     "Requests smaller than this are carved out of shared mapped chunks (the default: every "
     "size); larger ones get chunks of their own; 0 carves none.",
     "Carved buffers are 256-byte aligned, like `cudaMalloc`'s, placed best-fit in the mapped "
     "chunks of their device and tag, and freed space (coalesced with its free neighbours) "
     "serves any size without a driver call. A request no free space fits gets a new chunk of "
     "its own size (small ones share chunks that grow with the program's live bytes, up to "
     "64 MiB). Buffers made by `vmm_realloc` are carved only below half a chunk (or this value "
     "if smaller), so that they can grow in place."},
    {"VMMHOOK_RDMA", K_BOOL, FIELD(rdma), "off", 0, 0, NO_WORDS,
     "Request GPUDirect RDMA capable chunks.",
     "Sets `gpuDirectRDMACapable` in the allocation properties, on devices that support it "
     "with VMM memory (a warning on the others)."},
    {"VMMHOOK_PEERS", K_DEVMASK, FIELD(peers), "none", 0, 0, NO_WORDS,
     "Devices granted read/write access to every chunk up front.",
     "Access is granted when a chunk is mapped, so that kernels on those devices can use it."},
    {"VMMHOOK_DISABLE", K_BOOL, FIELD(disable), "off", 0, 0, NO_WORDS,
     "Pure pass-through: every call goes to the driver untouched.", ""},
    {"VMMHOOK_VERBOSE", K_BOOL, FIELD(verbose), "off", 0, 0, NO_WORDS,
     "One line when the library is loaded, every resolved option at the first CUDA call, and "
     "debug messages.",
     "The load line names the version and the options not at their default; it is printed "
     "in every process the library is loaded into, CUDA or not. A served allocation that fails "
     "gets one line saying why (`VMMHOOK_MEM_LIMIT`, `VMMHOOK_VA_LIMIT`, a paused tag, "
     "`VMMHOOK_GRANULARITY`, or the device out of memory)."},
    {"VMMHOOK_STATS", K_BOOL, FIELD(stats), "off", 0, 0, NO_WORDS,
     "Print a table of counters at exit.",
     "Served and passed-through calls, bytes requested, mapped, reserved and cached with the "
     "peak of each, driver calls, synchronizations, grows in place and moves."},
    {"VMMHOOK_STATS_JSON", K_STRING, FIELD(stats_json), "", 0, 0, NO_WORDS,
     "Write the counters at exit as JSON to this file (owner-only); %p is the process id.",
     "See \"Output files\" below for what is accepted at the path."},
    {"VMMHOOK_TRACE", K_STRING, FIELD(trace), "", 0, 0, NO_WORDS,
     "Write one CSV line per allocation event to this file, in RMM's logging format "
     "(owner-only); %p is the process id.",
     "The format is that of RAPIDS RMM's `logging_resource_adaptor` (see \"Trace format\"), so "
     "that RMM's `REPLAY_BENCHMARK` (and `tools/replay`) can replay it. Beside it, "
     "`<path>.gauges.csv` records the bytes requested, mapped, reserved and cached at every "
     "event, for `tools/replay/plot-trace.py`."},
    {"VMMHOOK_LEAKS", K_BOOL, FIELD(leaks), "off", 0, 0, NO_WORDS,
     "At exit, list the buffers still allocated, then their total.",
     "Each with its pointer, size and device; for buffers with chunks of their own (made by "
     "`vmm_realloc`, or at least `VMMHOOK_PACK_BELOW`) also the code that called the "
     "allocation entry point, e.g. "
     "`myprog+0x11da` or a place in cudart."},
    {"VMMHOOK_STRICT", K_BOOL, FIELD(strict), "off", 0, 0, NO_WORDS,
     "A bad or refused value stops the program (abort) instead of a warning.",
     "See \"When values are read, and bad values\" below."},
    {"VMMHOOK_FREE_SYNC", K_BOOL, FIELD(free_sync), "off", 0, 0, NO_WORDS,
     "Every free (not cuMemFreeAsync) blocks like cudaFree until the work queued before it has "
     "finished in every context of the buffer's device, not only the calling thread's.",
     "Without it a free returns at once, unlike cudaFree, and the memory is reused once the "
     "background reclaim has seen the GPU pass the free. During a stream capture a free never "
     "waits (the driver would refuse it and break the capture): it stays parked until the "
     "capture ends."},
    {"VMMHOOK_PARK_LIMIT", K_SIZE, FIELD(park_limit), "8G", 0, 0, NO_WORDS,
     "The cap on freed bytes not yet reusable, per device, past which an allocation that "
     "needs new memory waits for the GPU itself instead of leaving the wait to the background "
     "reclaim; the budget below the cap follows the program.",
     "Freed memory is parked until the GPU has passed the free (it may still be in use by "
     "queued work), unless the program's work runs in one queue (`VMMHOOK_STREAM_ORDERED`), "
     "where it is reused at once. What may stay parked is 1/8 of the program's recent peak of "
     "live bytes on the device, at least 64 MiB, and at most this value: a small program does "
     "not hold much freed memory back, a large one does not stall where a small one would. "
     "Past it, an allocating thread stalls (counted as `park_waits`, and as `syncs_blocking` "
     "when it synchronizes itself); the free of one buffer larger than the budget waits at the "
     "free, as cudaFree does. `0` makes an allocation that needs new memory wait whenever "
     "anything is parked. Never waits during a stream capture."},
    {"VMMHOOK_STREAM_ORDERED", K_BOOL, FIELD(stream_ordered), "on", 0, 0, NO_WORDS,
     "Reuse freed memory at once while the program's work runs in one queue per device.",
     "While the program has created no stream and has one context per device, everything it "
     "submits runs in order in the device's legacy default stream, so work submitted after a "
     "free runs after the work before it, and freed memory serves the next allocation without "
     "waiting for the GPU (as PyTorch's caching allocator reuses memory within a stream). The "
     "first stream or second context the program makes ends it: the library waits for the "
     "device once and frees park until the GPU has passed them from then on. Turn it off for "
     "a program whose threads use per-thread default streams (`cudaStreamPerThread`, or built "
     "with `--default-stream per-thread`) and free memory that another thread's work may still "
     "use: the library cannot see those streams."},
    {"VMMHOOK_PIN_LIMIT", K_SIZE, FIELD(pin_limit), "64T", 0, 0, NO_WORDS,
     "Cap on the pinned host memory kept between pauses for the backups of "
     "vmm_pause(VMM_PAUSE_BACKUP); 0 keeps none.",
     "What is kept is also at most a quarter of the host's physical memory (or of its memory "
     "cgroup's limit); nothing new is pinned that would leave less than an eighth of it "
     "available, and free kept memory is given back when less is available at a pause or a "
     "resume. The default, `64T`, sets no cap beyond that (docs/SLEEP.md). With `0` backups "
     "stay in pageable memory and resumes copy back at the pageable rate."},
    {"VMMHOOK_OVERFLOW", K_ENUM, FIELD(overflow), "off", 0, 0, WORDS(overflow_words),
     "`host`: an allocation the device cannot serve is served from host memory mapped at "
     "device addresses, and moved back to the device when room returns.",
     "Only after the usual wait for freed memory, release and trim have failed. The program "
     "gets an ordinary device pointer (kernels read and write it over the bus, copies and range "
     "queries accept it); the first spill says so once on stderr with the bytes, and the "
     "statistics count spilled bytes per device and tag. Spilled buffers move back at the same "
     "address once the GPU has passed the work submitted before the move and no capture runs, "
     "or when the program asks (`vmm_prefetch`, `vmm_prefetch_tag`). A resume that finds no room "
     "maps the rest on the host. docs/OVERFLOW.md."},
    {"VMMHOOK_OVERFLOW_LIMIT", K_SIZE, FIELD(overflow_limit), "64T", 0, 0, NO_WORDS,
     "Cap on the host memory serving overflow, over all devices.",
     "What is used is also at most half of the host's physical memory (or of its memory "
     "cgroup's limit), and no spill leaves less than an eighth of it available. Past it the "
     "allocation fails with out-of-memory, as natively."},
};
#define NROWS (sizeof(rows) / sizeof(rows[0]))

/* The accepted forms, as the warnings state them. */
static const char *forms(const opt_row_t *r)
{
    switch (r->kind) {
    case K_SIZE:
        return "a byte count with an optional K, M, G or T suffix (KiB, KB... also accepted; "
               "powers of 1024), e.g. 512K or 64M";
    case K_BOOL:
        return "1, 0, true, false, yes, no, on, off";
    case K_ENUM:
        return "none, posix_fd, fabric"; /* the only enum row */
    case K_GRAN:
        return "min, recommended, or a size such as 2M or 64M that is a multiple of the "
               "driver's minimum granularity, at most 256G";
    case K_DEVMASK:
        return "all, none, or a comma-separated list of device ordinals 0 to 63, e.g. 0,1,3";
    case K_STRING:
        return "a file path of at most 255 bytes";
    default:
        return "?";
    }
}

static int parse_word(const opt_row_t *r, const char *s, size_t len, int *out)
{
    for (unsigned i = 0; i < r->nwords; i++) {
        if (vmh_word_eq(s, len, r->words[i])) {
            *out = (int)i;
            return 0;
        }
    }
    return EINVAL;
}

/* ---- rows ------------------------------------------------------------------------------- */

static void *field(vmh_options_t *o, const opt_row_t *r)
{
    return (char *)o + r->off;
}

static const void *cfield(const vmh_options_t *o, const opt_row_t *r)
{
    return (const char *)o + r->off;
}

/* Sets row r from value (already known non-empty or a default). On failure the field is left
 * as it was and *reason says why in a few words. */
static int set_row(vmh_options_t *o, const opt_row_t *r, const char *value, const char **reason)
{
    size_t len = strlen(value);
    const char *s = value;
    int rc;
    if (r->kind != K_STRING)
        vmh_trim(&s, &len);
    *reason = "not one of the accepted forms";

    switch (r->kind) {
    case K_SIZE: {
        size_t v;
        rc = vmh_parse_size(s, len, &v);
        if (rc == ERANGE)
            *reason = "too large";
        if (rc == 0 && v < r->min) {
            *reason = "too small";
            rc = ERANGE;
        }
        if (rc == 0 && r->max != 0 && v > r->max) {
            *reason = "too large";
            rc = ERANGE;
        }
        if (rc == 0)
            *(size_t *)field(o, r) = v;
        return rc;
    }
    case K_BOOL: {
        bool v;
        rc = vmh_parse_bool(s, len, &v);
        if (rc == 0)
            *(bool *)field(o, r) = v;
        return rc;
    }
    case K_ENUM: {
        int v;
        rc = parse_word(r, s, len, &v);
        if (rc == 0)
            *(int *)field(o, r) = v;
        return rc;
    }
    case K_GRAN: {
        int mode;
        size_t bytes;
        if (parse_word(r, s, len, &mode) == 0) {
            o->gran_mode = (vmh_gran_mode_t)mode;
            o->gran_bytes = 0;
            return 0;
        }
        rc = vmh_parse_size(s, len, &bytes);
        if (rc == ERANGE)
            *reason = "too large";
        if (rc == 0 && bytes == 0) {
            *reason = "a granularity of 0";
            rc = ERANGE;
        }
        if (rc == 0 && r->max != 0 && bytes > r->max) {
            *reason = "larger than any GPU's memory; at most 256G";
            rc = ERANGE;
        }
        if (rc == 0) {
            o->gran_mode = VMH_GRAN_BYTES;
            o->gran_bytes = bytes;
        }
        return rc;
    }
    case K_DEVMASK: {
        uint64_t v;
        rc = vmh_parse_devices(s, len, &v);
        if (rc == ERANGE)
            *reason = "a device ordinal above 63";
        if (rc == 0)
            *(uint64_t *)field(o, r) = v;
        return rc;
    }
    case K_STRING:
        if (len >= r->size) {
            *reason = "longer than 255 bytes";
            return ERANGE;
        }
        memcpy(field(o, r), s, len + 1);
        return 0;
    default:
        return EINVAL;
    }
}

/* The canonical spelling of a size: the largest suffix that divides it exactly. */
static size_t fmt_size(char *buf, size_t len, size_t v)
{
    static const char sfx[] = "TGMK";
    for (unsigned i = 0; i < 4; i++) {
        unsigned shift = 10 * (4 - i);
        if (v != 0 && (v & ((1ULL << shift) - 1)) == 0)
            return (size_t)snprintf(buf, len, "%zu%c", v >> shift, sfx[i]);
    }
    return (size_t)snprintf(buf, len, "%zu", v);
}

static size_t fmt_row(const vmh_options_t *o, const opt_row_t *r, char *buf, size_t len)
{
    if (len == 0)
        return 0;
    buf[0] = '\0';
    switch (r->kind) {
    case K_SIZE:
        return fmt_size(buf, len, *(const size_t *)cfield(o, r));
    case K_BOOL:
        return (size_t)snprintf(buf, len, "%s", *(const bool *)cfield(o, r) ? "on" : "off");
    case K_ENUM: {
        int v = *(const int *)cfield(o, r);
        return (size_t)snprintf(buf, len, "%s",
                                v >= 0 && (unsigned)v < r->nwords ? r->words[v] : "?");
    }
    case K_GRAN:
        if (o->gran_mode == VMH_GRAN_BYTES)
            return fmt_size(buf, len, o->gran_bytes);
        return (size_t)snprintf(buf, len, "%s",
                                (unsigned)o->gran_mode < r->nwords ? r->words[o->gran_mode] : "?");
    case K_DEVMASK: {
        uint64_t m = *(const uint64_t *)cfield(o, r);
        if (m == 0)
            return (size_t)snprintf(buf, len, "none");
        if (m == UINT64_MAX)
            return (size_t)snprintf(buf, len, "all");
        size_t n = 0;
        /* Each item is at most 3 bytes (",63"): stop while 4 more always fit. */
        for (unsigned d = 0; d < 64 && n + 4 < len; d++)
            if (m & (1ULL << d))
                n += (size_t)snprintf(buf + n, len - n, "%s%u", n ? "," : "", d);
        return n;
    }
    case K_STRING:
        return (size_t)snprintf(buf, len, "%s", (const char *)cfield(o, r));
    default:
        return 0;
    }
}

static bool row_equal(const vmh_options_t *a, const vmh_options_t *b, const opt_row_t *r)
{
    if (r->kind == K_GRAN)
        return a->gran_mode == b->gran_mode &&
               (a->gran_mode != VMH_GRAN_BYTES || a->gran_bytes == b->gran_bytes);
    if (r->kind == K_STRING)
        return strcmp(cfield(a, r), cfield(b, r)) == 0;
    return memcmp(cfield(a, r), cfield(b, r), r->size) == 0;
}

static const opt_row_t *find_row(const char *name)
{
    for (size_t i = 0; i < NROWS; i++)
        if (strcmp(rows[i].name, name) == 0)
            return &rows[i];
    return NULL;
}

/* ---- the table, as a whole ---------------------------------------------------------------- */

void vmh_options_defaults(vmh_options_t *o)
{
    memset(o, 0, sizeof(*o));
    for (size_t i = 0; i < NROWS; i++) {
        const char *reason;
        /* Cannot fail: test_options checks that every default parses. */
        (void)set_row(o, &rows[i], rows[i].def, &reason);
    }
}

/* How parse_rows reports a bad value: not at all (the load line), as the library acts on it
 * (the default, or the strict stop), or for vmmhook-config --check, which fails instead. */
typedef enum { WARN_NONE, WARN_RUN, WARN_CHECK } warn_mode_t;

static void warn_bad(const opt_row_t *r, const char *value, const char *reason, bool strict,
                     warn_mode_t how)
{
    char q[80], def[64];
    vmh_fmt_quoted(q, sizeof(q), value, 64);
    if (how == WARN_CHECK) {
        vmh_log("%s=%s is not valid (%s); accepted: %s", r->name, q, reason, forms(r));
    } else if (strict) {
        vmh_log("%s=%s is not valid (%s); accepted: %s; stopping because VMMHOOK_STRICT is set",
                r->name, q, reason, forms(r));
    } else {
        vmh_options_t d;
        vmh_options_defaults(&d);
        fmt_row(&d, r, def, sizeof(def));
        vmh_log("%s=%s is not valid (%s); accepted: %s; using the default %s", r->name, q, reason,
                forms(r), def[0] ? def : "(none)");
    }
}

/* Every row from get() into *o; a bad value leaves its field and gets a warning as `how` says. */
static unsigned parse_rows(vmh_options_t *o, vmh_getenv_fn get, void *arg, warn_mode_t how)
{
    unsigned bad = 0;
    /* VMMHOOK_STRICT first: the warnings of the other rows say whether the program stops. */
    const opt_row_t *strict_row = find_row("VMMHOOK_STRICT");
    for (int pass = 0; pass < 2; pass++) {
        for (size_t i = 0; i < NROWS; i++) {
            const opt_row_t *r = &rows[i];
            if ((pass == 0) != (r == strict_row))
                continue;
            const char *v = get(r->name, arg);
            if (v == NULL || v[0] == '\0')
                continue; /* empty is unset: `VMMHOOK_X= prog` restores the default */
            const char *reason;
            if (set_row(o, r, v, &reason) != 0) {
                if (how != WARN_NONE)
                    warn_bad(r, v, reason, o->strict && r != strict_row, how);
                bad++;
            }
        }
    }
    return bad;
}

int vmh_options_parse(vmh_options_t *o, vmh_getenv_fn get, void *arg, unsigned *nbad)
{
    unsigned bad = parse_rows(o, get, arg, WARN_RUN);
    if (nbad)
        *nbad = bad;
    return (int)bad;
}

unsigned vmh_options_parse_for_check(vmh_options_t *o, vmh_getenv_fn get, void *arg)
{
    return parse_rows(o, get, arg, WARN_CHECK);
}

void vmh_options_print(const vmh_options_t *o)
{
    vmh_options_t d;
    vmh_options_defaults(&d);
    vmh_log("libvmmhook %d.%d.%d, options:", VMM_VERSION_MAJOR, VMM_VERSION_MINOR,
            VMM_VERSION_PATCH);
    for (size_t i = 0; i < NROWS; i++) {
        char v[300], q[1100];
        fmt_row(o, &rows[i], v, sizeof(v));
        /* Paths are quoted and escaped: one could hold a newline and forge a log line. */
        if (rows[i].kind == K_STRING && v[0] != '\0')
            vmh_fmt_quoted(q, sizeof(q), v, sizeof(v));
        else
            snprintf(q, sizeof(q), "%s", v[0] ? v : "(none)");
        vmh_log("  %-20s = %s%s", rows[i].name, q, row_equal(o, &d, &rows[i]) ? " (default)" : "");
    }
}

static char upper(char c)
{
    return c >= 'a' && c <= 'z' ? (char)(c - 'a' + 'A') : c;
}

/* The edit distance between a[0..na) and b[0..nb), ignoring ASCII case, with a transposition
 * of two neighbours counting one (GRANULARTY -> GRANULARITY is 1). Three rows on the stack
 * (this can run inside dlsym); names of 64 bytes or more are never near a row's name (the
 * longest has 19). */
static size_t name_distance(const char *a, size_t na, const char *b, size_t nb)
{
    enum { N = 65 };
    if (na >= N || nb >= N)
        return SIZE_MAX;
    size_t rows3[3][N], *back2 = rows3[0], *back = rows3[1], *cur = rows3[2];
    for (size_t j = 0; j <= nb; j++)
        back[j] = j;
    for (size_t i = 1; i <= na; i++) {
        cur[0] = i;
        for (size_t j = 1; j <= nb; j++) {
            size_t best = back[j - 1] + (upper(a[i - 1]) != upper(b[j - 1]));
            if (back[j] + 1 < best)
                best = back[j] + 1;
            if (cur[j - 1] + 1 < best)
                best = cur[j - 1] + 1;
            if (i > 1 && j > 1 && upper(a[i - 1]) == upper(b[j - 2]) &&
                upper(a[i - 2]) == upper(b[j - 1]) && back2[j - 2] + 1 < best)
                best = back2[j - 2] + 1;
            cur[j] = best;
        }
        size_t *t = back2;
        back2 = back;
        back = cur;
        cur = t;
    }
    return back[nb];
}

/* The row whose name is closest to name[0..n) (after the common "VMMHOOK_"), when it is close
 * enough to be a misspelling of it: at most half the letters differ. NULL otherwise. */
static const opt_row_t *closest_row(const char *name, size_t n)
{
    static const size_t plen = sizeof("VMMHOOK_") - 1;
    const opt_row_t *best = NULL;
    size_t best_d = SIZE_MAX;
    if (n <= plen)
        return NULL;
    for (size_t i = 0; i < NROWS; i++) {
        size_t d = name_distance(name + plen, n - plen, rows[i].name + plen,
                                 strlen(rows[i].name) - plen);
        if (d < best_d) {
            best_d = d;
            best = &rows[i];
        }
    }
    return best && 2 * best_d <= n - plen ? best : NULL;
}

/* A name as it may be printed bare: capitals, digits and '_' only (an environment name could
 * hold anything, a newline that would forge a log line included: those are quoted). */
static bool plain_name(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= 'A' && s[i] <= 'Z') || (s[i] >= '0' && s[i] <= '9') || s[i] == '_'))
            return false;
    return true;
}

int vmh_options_check_unknown(char *const *envp, bool check)
{
    static const char prefix[] = "VMMHOOK_";
    int unknown = 0;
    for (; envp && *envp; envp++) {
        const char *e = *envp;
        if (strncmp(e, prefix, sizeof(prefix) - 1) != 0)
            continue;
        const char *eq = strchr(e, '=');
        size_t n = eq ? (size_t)(eq - e) : strlen(e);
        bool known = false;
        for (size_t i = 0; i < NROWS && !known; i++)
            known = strlen(rows[i].name) == n && memcmp(rows[i].name, e, n) == 0;
        if (known)
            continue;
        /* A typo would otherwise be silently ignored. Not fatal under VMMHOOK_STRICT: a newer
         * launcher may set a variable this library does not know yet. */
        char q[80];
        char name[72];
        size_t m = n < sizeof(name) - 1 ? n : sizeof(name) - 1;
        memcpy(name, e, m);
        name[m] = '\0';
        if (plain_name(name, m))
            snprintf(q, sizeof(q), "%s", name);
        else
            vmh_fmt_quoted(q, sizeof(q), name, 64);
        const opt_row_t *near = closest_row(e, n);
        const char *what = check ? "unknown" : "unknown variable, ignored";
        if (near)
            vmh_log("%s: %s; did you mean %s?", q, what, near->name);
        else
            vmh_log("%s: %s (%s lists the known ones)", q, what,
                    check ? "vmmhook-config --list" : "VMMHOOK_VERBOSE=1");
        unknown++;
    }
    return unknown;
}

VMH_TESTABLE int vmh_options_apply(vmh_options_t *o, vmh_getenv_fn get, void *arg)
{
    unsigned bad;
    vmh_options_defaults(o);
    vmh_options_parse(o, get, arg, &bad);
    if (bad > 0 && o->strict) {
        vmh_log_stop();
        return -1; /* only when a test's exit hook returns */
    }
    if (o->verbose)
        vmh_options_print(o);
    return bad ? -1 : 0;
}

const char *vmh_options_env_get(const char *name, void *arg)
{
    (void)arg;
    return secure_getenv(name);
}

size_t vmh_options_changed(const vmh_options_t *o, char *buf, size_t len)
{
    vmh_options_t d;
    vmh_options_defaults(&d);
    size_t n = 0;
    if (len == 0)
        return 0;
    buf[0] = '\0';
    for (size_t i = 0; i < NROWS; i++) {
        if (row_equal(o, &d, &rows[i]))
            continue;
        char v[300], q[80];
        fmt_row(o, &rows[i], v, sizeof(v));
        /* Quoted: a path could hold a newline that would forge a log line. */
        vmh_fmt_quoted(q, sizeof(q), v, 64);
        int w = snprintf(buf + n, len - n, "%s%s=%s", n ? " " : "", rows[i].name,
                         rows[i].kind == K_STRING ? q : v);
        if (w < 0 || (size_t)w >= len - n) {
            buf[n] = '\0';
            return n; /* what fits, whole items only */
        }
        n += (size_t)w;
    }
    return n;
}

void vmh_options_announce(vmh_getenv_fn get, void *arg)
{
    vmh_options_t o;
    vmh_options_defaults(&o);
    /* Quietly: warnings and the strict stop belong to the first use by a CUDA program (a
     * process that never uses CUDA is not stopped for a value it never uses). */
    unsigned bad = parse_rows(&o, get, arg, WARN_NONE);
    if (!o.verbose)
        return;
    char changed[700];
    size_t n = vmh_options_changed(&o, changed, sizeof(changed));
    vmh_log("libvmmhook %d.%d.%d loaded (pid %d); options not at their default: %s%s",
            VMM_VERSION_MAJOR, VMM_VERSION_MINOR, VMM_VERSION_PATCH, (int)getpid(),
            n ? changed : "none", bad ? " (and bad values, reported at the first CUDA call)" : "");
}

/* The options as the environment set them, read once by vmh_options_load. */
static vmh_options_t snapshot;

static void load_once(void)
{
    vmh_options_t o;
    /* Parse into a local, publish whole: a reader never sees a half-parsed table. */
    vmh_options_apply(&o, vmh_options_env_get, NULL);
    if (!getauxval(AT_SECURE))
        vmh_options_check_unknown(environ, false);
    snapshot = o;
}

const vmh_options_t *vmh_options_load(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, load_once);
    return &snapshot;
}

const char *vmh_handle_kind_name(vmh_handle_kind_t k)
{
    return (unsigned)k < VMH_HANDLE_KIND_COUNT ? handle_words[k] : "?";
}

/* ---- the table, row by row (vmmhook-config, the tests, the fuzzer) ----------------------------
 */

size_t vmh_options_count(void)
{
    return NROWS;
}

const char *vmh_options_name(size_t row)
{
    return row < NROWS ? rows[row].name : NULL;
}

const char *vmh_options_default_text(size_t row)
{
    return row < NROWS ? rows[row].def : NULL;
}

bool vmh_options_info(size_t row, vmh_option_info_t *out)
{
    if (row >= NROWS)
        return false;
    const opt_row_t *r = &rows[row];
    *out = (vmh_option_info_t){r->name,  r->kind, r->def, r->help,  r->detail,
                               forms(r), r->min,  r->max, r->words, r->nwords};
    return true;
}

int vmh_options_set(vmh_options_t *o, size_t row, const char *value)
{
    const char *reason;
    if (row >= NROWS)
        return EINVAL;
    return set_row(o, &rows[row], value, &reason);
}

size_t vmh_options_format(const vmh_options_t *o, size_t row, char *buf, size_t len)
{
    if (row >= NROWS) {
        if (len)
            buf[0] = '\0';
        return 0;
    }
    return fmt_row(o, &rows[row], buf, len);
}
