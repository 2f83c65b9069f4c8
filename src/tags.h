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

/* Per-tag byte gauges (each keeps its peak). */
#define VMH_TAG_GAUGES(X)                                                                          \
    X(requested, "bytes requested by live buffers")                                                \
    X(mapped, "bytes of device memory mapped")                                                     \
    X(paused, "bytes of buffers paused (address kept, memory released)")                           \
    X(backed_up, "bytes of paused buffers held in host memory")

#define VMH_TAG_GAUGE_ITEM(name, help) VMH_TAG_##name,
typedef enum vmh_tag_gauge { VMH_TAG_GAUGES(VMH_TAG_GAUGE_ITEM) VMH_TAG_GAUGE_COUNT } vmh_tag_gauge_t;
#undef VMH_TAG_GAUGE_ITEM

void vmh_tag_gauge_add(unsigned tag, vmh_tag_gauge_t g, int64_t delta);
int64_t vmh_tag_gauge_get(unsigned tag, vmh_tag_gauge_t g);
int64_t vmh_tag_gauge_peak(unsigned tag, vmh_tag_gauge_t g);

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

/* Monotonic nanoseconds, for timing pauses. */
uint64_t vmh_tags_now_ns(void);

#ifdef VMH_TESTING
/* Tests: forgets every tag but "default", this thread's stack and all figures. Only while no
 * other thread uses tags. */
void vmh_tags_reset(void);
#endif

#endif
