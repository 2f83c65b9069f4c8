/* Layer "utilities": the intrusive doubly-linked list, written once.
 *
 * A node is any struct with `prev` and `next` pointers to its own type; a list is a `head`
 * pointer, and a `tail` pointer where the list has one (the cache's idle ranges, the reclaim
 * queue, the own-chunk lists; the carved shards' extents and handle.c's mappings have a head only).
 * The caller holds the list's lock; the macros take no lock and allocate nothing. A removal clears
 * the node's prev and next, so no pointer into the list outlives its membership (an owner may
 * then chain the node elsewhere through next: the cache's evictions, carved_idle.c's empty
 * extents).
 *
 * Macros, so that every node type gets them checked by its own member types: their arguments
 * are evaluated more than once, so pass names and member accesses (l->head, e), nothing with a
 * side effect. A count or a byte total the owner keeps beside its list is the owner's to
 * update.
 */
#ifndef VMH_LIST_H
#define VMH_LIST_H

#include <stddef.h>

/* A head-only list: n goes first. */
#define VMH_HLIST_PUSH(head, n)                                                                    \
    do {                                                                                           \
        (n)->prev = NULL;                                                                          \
        (n)->next = (head);                                                                        \
        if (head)                                                                                  \
            (head)->prev = (n);                                                                    \
        (head) = (n);                                                                              \
    } while (0)

/* A head-only list: n leaves it, wherever it stands. */
#define VMH_HLIST_REMOVE(head, n)                                                                  \
    do {                                                                                           \
        if ((n)->prev)                                                                             \
            (n)->prev->next = (n)->next;                                                           \
        else                                                                                       \
            (head) = (n)->next;                                                                    \
        if ((n)->next)                                                                             \
            (n)->next->prev = (n)->prev;                                                           \
        (n)->prev = (n)->next = NULL;                                                              \
    } while (0)

/* A list with a tail: n goes first (into an empty list it is the tail too). */
#define VMH_LIST_PUSH(head, tail, n)                                                               \
    do {                                                                                           \
        if (!(head))                                                                               \
            (tail) = (n);                                                                          \
        VMH_HLIST_PUSH(head, n);                                                                   \
    } while (0)

/* A list with a tail: n goes last (into an empty list it is the head too). */
#define VMH_LIST_APPEND(head, tail, n)                                                             \
    do {                                                                                           \
        (n)->next = NULL;                                                                          \
        (n)->prev = (tail);                                                                        \
        if (tail)                                                                                  \
            (tail)->next = (n);                                                                    \
        else                                                                                       \
            (head) = (n);                                                                          \
        (tail) = (n);                                                                              \
    } while (0)

/* A list with a tail: n leaves it; when n was last, its predecessor is the tail now (read
 * before the removal clears n's links). */
#define VMH_LIST_REMOVE(head, tail, n)                                                             \
    do {                                                                                           \
        if (!(n)->next)                                                                            \
            (tail) = (n)->prev;                                                                    \
        VMH_HLIST_REMOVE(head, n);                                                                 \
    } while (0)

#endif
