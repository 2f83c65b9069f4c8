/* Layer "utilities", below the options table: the lexical parsers of option values. Exact text:
 * the callers trim blanks first where they want them ignored. ASCII only, no locale, no
 * allocation, no stdio streams (snprintf into a buffer only): the options are read inside the
 * driver and inside dlsym. */
#include "optparse.h"

#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static char lower(char c)
{
    return (c >= 'A' && c <= 'Z') ? (char)(c - 'A' + 'a') : c;
}

/* s[0..len) equals word (NUL-terminated), ignoring ASCII case. */
bool vmh_word_eq(const char *s, size_t len, const char *word)
{
    size_t i = 0;
    for (; i < len; i++)
        if (word[i] == '\0' || lower(s[i]) != word[i])
            return false;
    return word[i] == '\0';
}

static bool is_blank(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

void vmh_trim(const char **s, size_t *len)
{
    while (*len > 0 && is_blank(**s)) {
        (*s)++;
        (*len)--;
    }
    while (*len > 0 && is_blank((*s)[*len - 1]))
        (*len)--;
}

/* Decimal digits, no sign: strtoull would accept "-1" (as 2^64-1), "+5", " 5" and "0x10". */
static int parse_uint(const char *s, size_t len, size_t *used, unsigned long long max,
                      unsigned long long *out)
{
    unsigned long long v = 0;
    size_t i = 0;
    for (; i < len && s[i] >= '0' && s[i] <= '9'; i++) {
        unsigned d = (unsigned)(s[i] - '0');
        if (v > (max - d) / 10)
            return ERANGE;
        v = v * 10 + d;
    }
    if (i == 0)
        return EINVAL;
    *used = i;
    *out = v;
    return 0;
}

int vmh_parse_size(const char *s, size_t len, size_t *out)
{
    static const struct {
        const char *word;
        unsigned shift;
    } suffixes[] = {
        {"", 0},     {"b", 0},  {"k", 10},  {"kb", 10},  {"kib", 10}, {"m", 20},  {"mb", 20},
        {"mib", 20}, {"g", 30}, {"gb", 30}, {"gib", 30}, {"t", 40},   {"tb", 40}, {"tib", 40},
    };
    unsigned long long v;
    size_t used;
    int rc = parse_uint(s, len, &used, SIZE_MAX, &v);
    if (rc != 0)
        return rc;
    for (size_t i = 0; i < sizeof(suffixes) / sizeof(suffixes[0]); i++) {
        if (!vmh_word_eq(s + used, len - used, suffixes[i].word))
            continue;
        if (suffixes[i].shift > 0 && v > (SIZE_MAX >> suffixes[i].shift))
            return ERANGE;
        *out = (size_t)(v << suffixes[i].shift);
        return 0;
    }
    return EINVAL;
}

int vmh_parse_bool(const char *s, size_t len, bool *out)
{
    static const char *const yes[] = {"1", "true", "yes", "on"};
    static const char *const no[] = {"0", "false", "no", "off"};
    for (size_t i = 0; i < 4; i++) {
        if (vmh_word_eq(s, len, yes[i])) {
            *out = true;
            return 0;
        }
        if (vmh_word_eq(s, len, no[i])) {
            *out = false;
            return 0;
        }
    }
    return EINVAL;
}

int vmh_parse_devices(const char *s, size_t len, uint64_t *out)
{
    if (vmh_word_eq(s, len, "all")) {
        *out = UINT64_MAX;
        return 0;
    }
    if (vmh_word_eq(s, len, "none")) {
        *out = 0;
        return 0;
    }
    uint64_t mask = 0;
    size_t pos = 0;
    for (;;) {
        size_t end = pos;
        while (end < len && s[end] != ',')
            end++;
        const char *item = s + pos;
        size_t n = end - pos;
        vmh_trim(&item, &n);
        unsigned long long dev;
        size_t used;
        int rc = parse_uint(item, n, &used, ULLONG_MAX, &dev);
        if (rc == EINVAL || (rc == 0 && used != n))
            return EINVAL; /* empty item ("0,,1", "0,") or not a number */
        if (rc == ERANGE || dev > 63)
            return ERANGE;
        mask |= 1ULL << dev;
        if (end == len)
            break;
        pos = end + 1;
    }
    *out = mask;
    return 0;
}

bool vmh_expand_path(const char *tmpl, long pid, char *out, size_t len)
{
    size_t n = 0;
    for (const char *p = tmpl; *p; p++) {
        char num[24];
        const char *piece = p;
        size_t plen = 1;
        if (p[0] == '%' && p[1] == 'p') {
            plen = (size_t)snprintf(num, sizeof(num), "%ld", pid);
            piece = num;
            p++;
        } else if (p[0] == '%' && p[1] == '%') {
            p++; /* "%%" is one '%' */
        }
        if (n + plen >= len)
            return false;
        memcpy(out + n, piece, plen);
        n += plen;
    }
    out[n] = '\0';
    return true;
}

static char upper(char c)
{
    return c >= 'a' && c <= 'z' ? (char)(c - 'a' + 'A') : c;
}

/* The edit distance between a[0..na) and b[0..nb), ignoring ASCII case, with a transposition
 * of two neighbours counting one. Three rows on the stack; names of 64 bytes or more are never
 * near a known one (the longest option name has 24). */
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

size_t vmh_closest_name(const char *name, size_t len, size_t skip,
                        const char *(*at)(size_t i, void *arg), size_t n, void *arg)
{
    size_t best = n, best_d = SIZE_MAX;
    if (len <= skip)
        return n;
    for (size_t i = 0; i < n; i++) {
        const char *known = at(i, arg);
        size_t klen = strlen(known);
        if (klen < skip)
            continue;
        size_t d = name_distance(name + skip, len - skip, known + skip, klen - skip);
        if (d < best_d) {
            best_d = d;
            best = i;
        }
    }
    return best < n && 2 * best_d <= len - skip ? best : n;
}
