/* Layer "utilities": THE VMMHOOK_* options table, data only. One row per variable (name, kind,
 * field, default, bounds, help, detail); the defaults live only here, as text that options.c's
 * parser reads, so a default can never disagree with what the variable accepts. The launcher's
 * help (vmmhook --help) and the table of docs/OPTIONS.md are generated from it by
 * tools/launcher/vmmhook-config, and the tools suite fails when the committed page differs.
 * options.c reads the rows (parse, check, format, print); optparse.c has the value parsers.
 * Rows of one kind look alike on purpose: one shape per row, so that a reader compares them. */
#include "options_internal.h"

#include <stddef.h>

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

/* The few rows with a step or a run-time-only check give them by name after the rest
 * (.step = ..., .later = ...); the others leave them out, zero. */
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

#define FIELD(f) offsetof(vmh_options_t, f), sizeof(((vmh_options_t *)0)->f)
#define WORDS(w) w, (unsigned)(sizeof(w) / sizeof(w[0]))
#define NO_WORDS NULL, 0

const opt_row_t vmh_option_rows[] = {
    {"VMMHOOK_GRANULARITY", K_GRAN, FIELD(gran_mode), "recommended", 0, VMH_GRANULARITY_MAX,
     WORDS(gran_words),
     "Chunk size of device memory: the driver's minimum or recommended granularity, or a size "
     "that is a multiple of 2M (and of the driver's minimum), at most 256G.",
     "The granularities are those the driver gives for the exact allocation properties in use "
     "(handle type, RDMA flag). A size that is not a multiple of 2M (the smallest chunk the "
     "library makes, and the minimum granularity of every NVIDIA GPU seen), or that is above "
     "256G (no GPU has that much memory: the largest have 288 GB; every chunk would fail), is "
     "refused when the options are read, and by `vmmhook --check`. The rest is checked against "
     "the driver when a device is first set up, which `--check` cannot do (it says so): a size "
     "that is not a multiple of a larger minimum of this GPU, or one the driver cannot make on "
     "it (one chunk of it is made and released then), gets a warning naming the value and the "
     "reason (the minimum, or the driver's answer), and the recommended granularity is used "
     "instead; with `VMMHOOK_STRICT` the program stops.",
     .step = VMH_GRANULARITY_UNIT,
     .later = "whether this GPU's driver takes the size (a multiple of its minimum granularity "
              "for these allocation properties, where that is above 2M, and a chunk it can "
              "make) is checked when the library sets up each device"},
    {"VMMHOOK_CHUNK_MAX", K_SIZE, FIELD(chunk_max), "0", 0, 0, NO_WORDS,
     "The largest chunk of device memory behind carved buffers (a multiple of 2M); 0 lets the "
     "library choose (up to 341M).",
     "Device memory goes back in whole chunks, and one live buffer keeps its chunk mapped. On "
     "the simulated driver (tests/unit/test_holes.c), 10240 buffers of 2 MiB freed but one in "
     "64 leave 1456 MiB of the 20 GiB mapped that can go back by default, and 10874 MiB with "
     "`64M`. Every chunk costs driver calls to make, pause and resume (a pause's and a "
     "resume's chunks obey the limit too): 20480 buffers of 2 MiB in one tag take 593 calls to "
     "allocate, 246 to pause and 205 to resume by default, and 1471, 685 and 1363 with `64M` "
     "(tests/unit/test_geometry.c prints both). A value that is not a multiple of the "
     "device's granularity is rounded down to one.",
     .step = VMH_GRANULARITY_UNIT},
    {"VMMHOOK_HANDLE_TYPE", K_ENUM, FIELD(handle), "posix_fd", 0, 0, WORDS(handle_words),
     "Shareable handle type requested for every chunk, so that CUDA IPC works on served memory.",
     "It is the `requestedHandleTypes` of `cuMemCreate`; CUDA IPC is `cudaIpcGetMemHandle` "
     "(docs/IPC.md). `posix_fd` is the default because without it IPC on served memory fails; "
     "it costs a little: on the H200 (docs/GPU-RUNS.md, run of 4f60da2, cache off) a 2 MiB "
     "alloc+free took 1.60 us with it against 1.44 us with `none` (+11%), a 64 MiB one 191.3 us "
     "against 190.7 us. When the driver rejects the type on this machine (`fabric` needs IMEX; "
     "the H200 refused it with error 800), a warning says so and `none` is used.",
     .later = "whether the driver makes chunks with this handle type on this machine (fabric "
              "needs IMEX) is checked when the library sets up each device"},
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
     "with VMM memory (a warning on the others).",
     .later = "whether each device supports GPUDirect RDMA with VMM memory is checked when the "
              "library sets up each device"},
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
     "device addresses; `vmm_prefetch` moves it back to the device.",
     "After the usual wait for freed memory, release and trim have failed, or at once for a big "
     "allocation that would eat into `VMMHOOK_OVERFLOW_RESERVE`. The program gets an ordinary "
     "device pointer (kernels read and write it over the bus, copies and range queries accept "
     "it); the first spill says so once on stderr with the bytes, and the statistics count "
     "spilled bytes and spills (per tag too). Spilled buffers move back at the same address "
     "when the program asks (`vmm_prefetch`, `vmm_prefetch_tag`) or at a resume of their tag; "
     "a resume that finds no room maps the rest on the host. docs/OVERFLOW.md."},
    {"VMMHOOK_OVERFLOW_LIMIT", K_SIZE, FIELD(overflow_limit), "64T", 0, 0, NO_WORDS,
     "Cap on the host memory serving overflow, over all devices.",
     "What is used is also at most half of the host's physical memory (or of its memory "
     "cgroup's limit), and no spill leaves less than an eighth of it available. Past it the "
     "allocation fails with out-of-memory, as natively."},
    {"VMMHOOK_OVERFLOW_RESERVE", K_SIZE, FIELD(overflow_reserve), "4G", 0, 0, NO_WORDS,
     "With `VMMHOOK_OVERFLOW=host`: device memory kept for small allocations; a big one that "
     "would leave less free spills to the host first.",
     "At most a sixteenth of the device's memory. Big: at least a quarter of the reserve (1G on "
     "a GPU of 64 GiB or more); smaller allocations (a program's temporaries) may use the "
     "reserve and spill only when the device is full. On the simulated driver's probe (1 GiB "
     "device filled with 64 MiB buffers, then 200 temporaries of 2 MiB) 0 of 200 temporaries "
     "spill with the default and 200 of 200 with `0`, which keeps no reserve (docs/OVERFLOW.md). "
     "Without `VMMHOOK_OVERFLOW` it does nothing."},
};
const size_t vmh_option_nrows = sizeof(vmh_option_rows) / sizeof(vmh_option_rows[0]);

const char *vmh_handle_kind_name(vmh_handle_kind_t k)
{
    return (unsigned)k < VMH_HANDLE_KIND_COUNT ? handle_words[k] : "?";
}

const char *vmh_option_word_forms(const opt_row_t *r)
{
    if (r->words == handle_words)
        return "none, posix_fd, fabric";
    if (r->words == overflow_words)
        return "off, host";
    return "?";
}
