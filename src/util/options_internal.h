/* Internal to the options (options.c, options_table.c): the shape of a row of the VMMHOOK_* table.
 * The rows themselves are options_table.c's (data only); options.c parses, checks, formats and
 * prints them. Nothing else includes this. */
#ifndef VMH_OPTIONS_INTERNAL_H
#define VMH_OPTIONS_INTERNAL_H

#include "options.h"

#include <stddef.h>

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
    /* Given by name after the rest (.step = ...), in the few rows that have them: */
    size_t step;       /* K_SIZE, K_GRAN (as a size): a multiple of it, 0 = any; checked
                          when the options are read, by the library and vmmhook --check */
    const char *later; /* what only the run can check, on the GPU, that vmmhook --check says
                          it leaves (NULL = nothing) */
} opt_row_t;

/* A word row's accepted words as the warnings list them ("none, posix_fd, fabric"). */
const char *vmh_option_word_forms(const opt_row_t *r);

/* THE options table (options_table.c), in the order the tools and docs/OPTIONS.md list it. */
extern const opt_row_t vmh_option_rows[];
extern const size_t vmh_option_nrows;

#endif
