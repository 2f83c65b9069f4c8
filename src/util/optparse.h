/* Layer "utilities", below the options table (options.c): the lexical parsers of option values.
 * Exact text: no surrounding blanks (callers trim them with vmh_trim where they are to be
 * ignored). */
#ifndef VMH_OPTPARSE_H
#define VMH_OPTPARSE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* 0, EINVAL (syntax) or ERANGE (overflow / out of range); *out set only on 0.
 * Sizes: decimal digits, then an optional suffix (b, k/kb/kib, m..., g..., t..., any case;
 * powers of 1024). Booleans: 1/0, true/false, yes/no, on/off, any case. Devices: all, none, or a
 * comma-separated list of ordinals 0 to 63 (blanks around items ignored) as a bit mask. */
int vmh_parse_size(const char *s, size_t len, size_t *out);
int vmh_parse_bool(const char *s, size_t len, bool *out);
int vmh_parse_devices(const char *s, size_t len, uint64_t *out);

/* s[0..len) equals word (NUL-terminated, lower case), ignoring ASCII case. */
bool vmh_word_eq(const char *s, size_t len, const char *word);

/* Narrows *s, *len to the text without leading and trailing blanks. */
void vmh_trim(const char **s, size_t *len);

/* An output path's template (VMMHOOK_TRACE, VMMHOOK_STATS_JSON) with "%p" replaced by pid and
 * "%%" by '%' (any other '%' kept) into out; false when it does not fit. The library names its
 * files with it (stats.c), and vmmhook-config --check the files it checks. */
bool vmh_expand_path(const char *tmpl, long pid, char *out, size_t len);

/* Which of n known names `name` (len bytes) is most likely a misspelling of: the nearest by
 * edit distance, ignoring ASCII case, with a swap of two neighbours counting one
 * (GRANULARTY -> GRANULARITY is 1), comparing what follows the first `skip` bytes of each (a
 * prefix they share: "VMMHOOK_", "--"), and near enough only when at most half the letters of
 * name after it differ. at(i, arg) gives the i-th known name. Returns its index, or n when none
 * is near (also for a name of `skip` bytes or fewer, or of 64 or more). On the stack only: the
 * library's unknown-variable warnings (options.c) run inside dlsym; vmmhook-config's "did you
 * mean" for the launcher's flags uses it too. */
size_t vmh_closest_name(const char *name, size_t len, size_t skip,
                        const char *(*at)(size_t i, void *arg), size_t n, void *arg);

#endif
