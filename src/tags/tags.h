/* Tags: which part of a program a served buffer belongs to (docs/SLEEP.md).
 *
 * Three things live here, below the heap (which asks for the current tag and counts bytes):
 *   - the registry: a small fixed table of names -> ids (id 0 is "default"), filled once per
 *     name and never shrunk, so an id stays valid and its name readable without a lock;
 *   - the calling thread's tag stack (vmm_tag_push / vmm_tag_pop): which tag the thread's
 *     allocations go to. It is program state, like errno, hence thread-local; it is read once
 *     at the allocation entry points and passed down from there;
 *   - each tag's state (running, paused, or on its way between), which the pause layer
 *     (pause.c) changes and the heap reads to refuse allocations in a tag that is not running;
 *   - per-tag statistics (relaxed atomics), their JSON and their lines in the exit table.
 */
#ifndef VMH_TAGS_H
#define VMH_TAGS_H

#include "vmmhook.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define VMH_TAG_DEFAULT 0u
#define VMH_TAG_NONE ((unsigned)-1)

/* The calling thread's current tag (VMH_TAG_DEFAULT when its stack is empty). */
unsigned vmh_tag_current(void);

/* The id of a registered name, or VMH_TAG_NONE. */
unsigned vmh_tag_lookup(const char *name);

/* Registered tags: ids 0 .. vmh_tag_count() - 1; names stay valid for the process. */
unsigned vmh_tag_count(void);
const char *vmh_tag_name(unsigned tag);

/* A tag's state. Only RUNNING takes new memory; PAUSING and RESUMING last for one vmm_pause or
 * vmm_resume call (calls are serialized by pause.c). */
typedef enum vmh_tag_state {
    VMH_TAG_RUNNING,
    VMH_TAG_PAUSING,
    VMH_TAG_PAUSED,
    VMH_TAG_RESUMING,
    VMH_TAG_STATE_COUNT
} vmh_tag_state_t;

vmh_tag_state_t vmh_tag_state(unsigned tag);
/* Moves tag from `from` to `to`; false (nothing changed) when it was not in `from`. */
bool vmh_tag_transition(unsigned tag, vmh_tag_state_t from, vmh_tag_state_t to);
/* Whether tag may take new memory now (the heap asks, under the lock that makes the buffer
 * visible, so that a pause that changes the state and then walks under that lock sees it). */
bool vmh_tag_running(unsigned tag);

/* Bytes the program asked for, live buffers of the tag (kept by the heap's front at each
 * allocation, resize and free; with its peak). The one place bytes requested change: it moves
 * the overall gauge (stats.h's bytes_requested) by the same delta, so that the tags' figures
 * always sum to it (a resize that moved only the overall figure would send a tag's below
 * zero at the free). */
void vmh_tag_requested_add(unsigned tag, int64_t delta);
int64_t vmh_tag_requested(unsigned tag);
int64_t vmh_tag_requested_peak(unsigned tag);

/* A tag's device memory now, as the layer that holds it counts it (asked for when reported). */
typedef struct vmh_tag_memory {
    size_t mapped;    /* device memory mapped for the tag's buffers */
    size_t paused;    /* bytes of the tag's buffers that are paused */
    size_t backed_up; /* bytes of paused buffers held in host memory */
    size_t kept;      /* bytes left mapped by a pause (exported buffers) */
    size_t spilled;   /* host memory serving the tag's buffers (VMMHOOK_OVERFLOW=host) */
} vmh_tag_memory_t;
typedef void (*vmh_tag_memory_fn)(unsigned tag, vmh_tag_memory_t *out);
/* Who answers (the pause layer, which walks the heap); none: zeroes. Ownership as data: this
 * file never calls upwards. */
void vmh_tags_set_memory_source(vmh_tag_memory_fn fn);

/* A finished pause or resume of a tag and how long it took. */
void vmh_tag_note_pause(unsigned tag, uint64_t ns);
void vmh_tag_note_resume(unsigned tag, uint64_t ns);
uint64_t vmh_tag_pauses(unsigned tag);
uint64_t vmh_tag_resumes(unsigned tag);

/* Pinned host memory the pause layer keeps between pauses (VMMHOOK_PIN_LIMIT). */
void vmh_tags_pinned_add(int64_t delta);

/* The per-tag section as a JSON object ({"default": {...}, ...}), snprintf-like: writes at most
 * len bytes including the NUL, returns the length the whole text needs. indent is the number of
 * spaces before each tag line (the object's own braces are not indented). */
size_t vmh_tags_json(char *buf, size_t len, int indent);

/* The per-tag lines of the exit table (through vmh_log); nothing when only "default" exists
 * and it never paused. */
void vmh_tags_report_table(void);

#ifdef VMH_TESTING
/* Tests: forgets every tag but "default", this thread's stack and all figures. Only while no
 * other thread uses tags. */
void vmh_tags_reset(void);
#endif

#endif
