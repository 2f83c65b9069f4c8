/* Layer "utilities": options. Every VMMHOOK_* environment variable is one row of the table in
 * options.c. They are read once, at the first use of the library by a CUDA program, into a
 * snapshot (vmh_options_load); the front (lifetime.c) makes each layer's settings from it (a
 * small struct in that layer's header: vmh_device_settings_t, ...) and passes them down
 * through the configure calls, so that no layer below the front uses vmh_options_t. The enums
 * below are the values of rows (a layer's settings may hold them). Only the load line of
 * VMMHOOK_VERBOSE (vmh_options_announce) reads the environment earlier, quietly. Below: log
 * only. */
#ifndef VMH_OPTIONS_H
#define VMH_OPTIONS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum vmh_gran_mode {
    VMH_GRAN_RECOMMENDED, /* the driver's recommended granularity (default) */
    VMH_GRAN_MIN,         /* the driver's minimum granularity */
    VMH_GRAN_BYTES,       /* an explicit size, checked to be a multiple of the minimum */
    VMH_GRAN_MODE_COUNT
} vmh_gran_mode_t;

typedef enum vmh_handle_kind {
    VMH_HANDLE_NONE,
    VMH_HANDLE_POSIX_FD,
    VMH_HANDLE_FABRIC,
    VMH_HANDLE_KIND_COUNT
} vmh_handle_kind_t;

/* The largest VMMHOOK_GRANULARITY accepted: 256 GiB, the largest power of two below the memory
 * of the largest GPUs (288 GB). A size above it is refused when the
 * options are read, so that vmmhook --check, which has no driver to ask, refuses it too; one
 * below it that this GPU cannot make is found at the device's set-up (device.c). A larger
 * chunk could never be created, and every served allocation would fail. */
#define VMH_GRANULARITY_MAX ((size_t)256 << 30)

/* VMMHOOK_GRANULARITY as a size is a multiple of this: 2 MiB, the granule of the library's
 * address registry (arena/registry.h's VMH_REGISTRY_SHIFT; test_options_parse checks that they
 * agree), below which the device set-up never goes, and the minimum granularity of every NVIDIA
 * GPU seen. Checked when the options are read (the row's `step`), so that the library and
 * vmmhook --check refuse the same sizes (3M, 1000); whether this GPU's driver has a larger
 * minimum, or can make a chunk of the size, only the device's set-up can tell (device.c). */
#define VMH_GRANULARITY_UNIT ((size_t)2 << 20)

/* VMMHOOK_OVERFLOW: where an allocation goes that the device cannot serve. */
typedef enum vmh_overflow_kind {
    VMH_OVERFLOW_OFF,  /* out of memory, as natively (default) */
    VMH_OVERFLOW_HOST, /* host memory mapped at device addresses (overflow.h) */
    VMH_OVERFLOW_KIND_COUNT
} vmh_overflow_kind_t;

typedef struct vmh_options {
    vmh_gran_mode_t gran_mode; /* VMMHOOK_GRANULARITY */
    size_t gran_bytes;         /* when gran_mode is VMH_GRAN_BYTES */
    vmh_handle_kind_t handle;  /* VMMHOOK_HANDLE_TYPE */
    size_t chunk_max;          /* VMMHOOK_CHUNK_MAX: the largest chunk of shared memory, 0 = rule */
    size_t headroom;           /* VMMHOOK_HEADROOM: address space reserved past a grown buffer */
    size_t va_limit;           /* VMMHOOK_VA_LIMIT: total address space the library may reserve */
    size_t cache_limit;        /* VMMHOOK_CACHE_LIMIT: idle bytes kept for reuse, per device */
    size_t mem_limit;          /* VMMHOOK_MEM_LIMIT: bytes served per device, 0 = no limit */
    size_t pack_below;         /* VMMHOOK_PACK_BELOW: requests smaller than this are packed */
    bool rdma;                 /* VMMHOOK_RDMA: request GPUDirect RDMA capable chunks */
    uint64_t peers;            /* VMMHOOK_PEERS: bit i = grant device i access up front */
    bool disable;              /* VMMHOOK_DISABLE: pure pass-through */
    bool verbose;              /* VMMHOOK_VERBOSE */
    bool stats;                /* VMMHOOK_STATS: table at exit */
    char stats_json[256];      /* VMMHOOK_STATS_JSON: path for the JSON form, "" = none */
    char trace[256];           /* VMMHOOK_TRACE: CSV trace path, "" = none */
    bool leaks;                /* VMMHOOK_LEAKS: leak report at exit */
    bool strict;               /* VMMHOOK_STRICT: a bad value stops the program */
    bool free_sync;            /* VMMHOOK_FREE_SYNC: every free synchronizes like cudaFree */
    size_t park_limit;         /* VMMHOOK_PARK_LIMIT: freed bytes not yet reusable, past which an
                                  allocating thread waits for the GPU itself */
    size_t pin_limit;          /* VMMHOOK_PIN_LIMIT: pinned host memory kept between pauses for
                                  VMM_PAUSE_BACKUP backups, 0 = none kept */
    bool stream_ordered;       /* VMMHOOK_STREAM_ORDERED: reuse freed memory at once while the
                                  program's work runs in one queue per device (contexts.h) */
    vmh_overflow_kind_t overflow; /* VMMHOOK_OVERFLOW */
    size_t overflow_limit;        /* VMMHOOK_OVERFLOW_LIMIT: cap on host bytes serving overflow */
    size_t overflow_reserve;      /* VMMHOOK_OVERFLOW_RESERVE: device memory kept for small
                                     allocations once big ones spill (overflow.h) */
} vmh_options_t;

/* Where the parser reads a variable: secure_getenv in the library (vmh_options_env_get), a
 * fake environment in the tests and the fuzzer. Returns NULL when the variable is unset. */
typedef const char *(*vmh_getenv_fn)(const char *name, void *arg);
const char *vmh_options_env_get(const char *name, void *arg);

/* The kinds of value a row takes. */
typedef enum vmh_option_kind {
    VMH_OPTION_SIZE,        /* size_t: bytes with an optional suffix */
    VMH_OPTION_BOOL,        /* bool */
    VMH_OPTION_WORD,        /* an int-sized enum, one word per value */
    VMH_OPTION_GRANULARITY, /* vmh_gran_mode_t + gran_bytes: a word or a size */
    VMH_OPTION_DEVICES,     /* uint64_t bit mask of device ordinals */
    VMH_OPTION_PATH,        /* char[]: a file path */
    VMH_OPTION_KIND_COUNT
} vmh_option_kind_t;

/* One row of the table, as vmmhook-config presents it (help and docs are generated from it). */
typedef struct vmh_option_info {
    const char *name; /* "VMMHOOK_..." */
    vmh_option_kind_t kind;
    const char *def;          /* the default, in a form the row accepts ("" = none) */
    const char *help;         /* one plain sentence */
    const char *detail;       /* markdown for docs/OPTIONS.md after help ("" = none) */
    const char *forms;        /* the accepted forms, as the warnings state them */
    size_t min, max;          /* sizes: bounds (max 0 = none) */
    const char *const *words; /* words: the accepted ones, in enum order */
    unsigned nwords;
    size_t step;       /* sizes: a value must be a multiple of it (0 = any) */
    const char *later; /* what only the run can check, on the GPU ("" = nothing) */
} vmh_option_info_t;

/* The table, row by row: count, name, default text, everything; set a row from text as the
 * environment would (0, or an errno and the field untouched); format a row's value in a form
 * the setter accepts again. */
size_t vmh_options_count(void);
const char *vmh_options_name(size_t row);
const char *vmh_options_default_text(size_t row);
bool vmh_options_info(size_t row, vmh_option_info_t *out);
int vmh_options_set(vmh_options_t *o, size_t row, const char *value);
size_t vmh_options_format(const vmh_options_t *o, size_t row, char *buf, size_t len);

/* The length of the longest name of the table: the column of '=' in the listings of the
 * resolved options (VMMHOOK_VERBOSE's, vmmhook --check's). */
int vmh_options_name_width(void);

/* What of row's value in *o only the run can check, on the GPU (the driver's minimum
 * granularity, a handle type the driver refuses...), as a sentence; NULL when nothing is left
 * for it (an explicit granularity size has, `recommended` has not). For vmmhook --check. */
const char *vmh_options_later(const vmh_options_t *o, size_t row);

/* Parses every row of the table from get() into *o (which holds defaults or earlier values); a
 * bad value gets one warning and leaves its field untouched. Returns the number of bad values,
 * also stored in *nbad when non-NULL. Never exits. */
int vmh_options_parse(vmh_options_t *o, vmh_getenv_fn get, void *arg, unsigned *nbad);

/* Prints every resolved option with vmh_log, marking those equal to the default. */
void vmh_options_print(const vmh_options_t *o);

/* Warns about VMMHOOK_* names in envp that are not in the table, one line each, with the
 * closest known name when one is near ("VMMHOOK_GRANULARTY: unknown variable, ignored; did you
 * mean VMMHOOK_GRANULARITY?"); `check`: for vmmhook-config --check, which fails on them
 * ("unknown", not "ignored"). Returns how many. */
int vmh_options_check_unknown(char *const *envp, bool check);

/* As vmh_options_parse, for vmmhook-config --check: each warning ends with the accepted forms,
 * not with what the library would do about the value (the check fails instead). Returns the
 * number of bad values. */
unsigned vmh_options_parse_for_check(vmh_options_t *o, vmh_getenv_fn get, void *arg);

/* "VMMHOOK_A=v VMMHOOK_B=w": the options of *o that differ from the defaults (paths quoted),
 * into buf; whole items only. Returns the length. */
size_t vmh_options_changed(const vmh_options_t *o, char *buf, size_t len);

/* With VMMHOOK_VERBOSE on in get(): one log line "libvmmhook X.Y.Z loaded (pid N); options not
 * at their default: ...". Reads quietly: no warning, no strict stop, nothing kept (those come
 * with vmh_options_load at the first CUDA call). For the library's load-time constructor. */
void vmh_options_announce(vmh_getenv_fn get, void *arg);

/* Defaults into *o. */
void vmh_options_defaults(vmh_options_t *o);

/* Reads the environment once (thread-safe); prints warnings, and with VMMHOOK_STRICT stops the
 * program on a bad value (vmh_log_stop); with VMMHOOK_VERBOSE prints every resolved option.
 * Returns the snapshot, the same on every call, from which the front makes each layer's
 * settings (lifetime.c). */
const vmh_options_t *vmh_options_load(void);

/* "none", "posix_fd", "fabric". */
const char *vmh_handle_kind_name(vmh_handle_kind_t k);

#ifdef VMH_TESTING
/* Internal to options.c (static in the shipped library, see testable.h). */

/* What vmh_options_load does once: defaults, parse, strict stop (vmh_log_stop), verbose
 * listing. Returns 0 when every value was good, else -1. */
int vmh_options_apply(vmh_options_t *o, vmh_getenv_fn get, void *arg);
#endif

#endif
