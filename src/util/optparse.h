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

#endif
