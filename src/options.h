/* Layer 7: options. Every VMMHOOK_* environment variable is one row of the table in options.c;
 * they are read once, at the first use of the library by a CUDA program (never in a process
 * that does not use CUDA), into vmh_opt. */
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

typedef struct vmh_options {
    vmh_gran_mode_t gran_mode;  /* VMMHOOK_GRANULARITY */
    size_t gran_bytes;          /* when gran_mode is VMH_GRAN_BYTES */
    vmh_handle_kind_t handle;   /* VMMHOOK_HANDLE_TYPE */
    size_t headroom;            /* VMMHOOK_HEADROOM: address space reserved past a grown buffer */
    size_t va_limit;            /* VMMHOOK_VA_LIMIT: total address space the library may reserve */
    size_t cache_limit;         /* VMMHOOK_CACHE_LIMIT: idle bytes kept for reuse, per device */
    size_t mem_limit;           /* VMMHOOK_MEM_LIMIT: bytes served per device, 0 = no limit */
    size_t pack_below;          /* VMMHOOK_PACK_BELOW: requests smaller than this are packed */
    bool rdma;                  /* VMMHOOK_RDMA: request GPUDirect RDMA capable chunks */
    uint64_t peers;             /* VMMHOOK_PEERS: bit i = grant device i access up front */
    bool disable;               /* VMMHOOK_DISABLE: pure pass-through */
    bool verbose;               /* VMMHOOK_VERBOSE */
    bool stats;                 /* VMMHOOK_STATS: table at exit */
    char stats_json[256];       /* VMMHOOK_STATS_JSON: path for the JSON form, "" = none */
    char trace[256];            /* VMMHOOK_TRACE: CSV trace path, "" = none */
    bool leaks;                 /* VMMHOOK_LEAKS: leak report at exit */
    bool strict;                /* VMMHOOK_STRICT: a bad value stops the program */
    bool free_sync;             /* VMMHOOK_FREE_SYNC: every free synchronizes like cudaFree */
} vmh_options_t;

extern vmh_options_t vmh_opt;

/* Defaults into *o. */
void vmh_options_defaults(vmh_options_t *o);

/* Reads the environment once (thread-safe); prints warnings, and with VMMHOOK_STRICT exits on a
 * bad value; with VMMHOOK_VERBOSE prints every resolved option. */
void vmh_options_load(void);

#endif
