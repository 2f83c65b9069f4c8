/* Layer "utilities": room for one more element at the end of an array that doubles, written once
 * (span.c's free intervals, carved.c's export list, carved_idle.c's free runs, IPC's export and
 * import tables).
 *
 * vmh_grow(arr, &cap, n, sizeof *arr, first) returns arr when n < cap; otherwise a realloc of it
 * to twice cap (first when cap is 0) elements, with cap updated. NULL: out of memory (or the size
 * overflows), and arr and cap are unchanged, so the caller keeps what it had. The caller stores
 * the result back; this takes no lock. */
#ifndef VMH_GROW_H
#define VMH_GROW_H

#include <stdint.h>
#include <stdlib.h>

static inline void *vmh_grow(void *arr, size_t *cap, size_t n, size_t elem, size_t first)
{
    if (n < *cap)
        return arr;
    size_t c = *cap ? 2 * *cap : first;
    if (c < *cap || c > SIZE_MAX / elem)
        return NULL;
    void *grown = realloc(arr, c * elem);
    if (grown)
        *cap = c;
    return grown;
}

#endif
