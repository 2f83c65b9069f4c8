/* Pause and resume of tags (vmm_pause, vmm_resume in include/vmmhook.h; docs/SLEEP.md): the
 * layer above the heap that gives a tag's physical memory back and maps it again at the same
 * addresses. See pause.c for how it walks the heap. */
#ifndef VMH_PAUSE_H
#define VMH_PAUSE_H

#include "driver.h"
#include "vmmhook.h"

/* pin_limit: VMMHOOK_PIN_LIMIT (staging.h); also hands the per-tag memory figures of the
 * statistics to tags.h. Called by the front at start (tests call it again). */
void vmh_pause_configure(size_t pin_limit);

/* vmm_pause / vmm_resume_flags (include/vmmhook.h) under the entry points (api.c), which check
 * first that the library serves and keep the thread's last driver error: *driver_rc is set to the
 * driver's code when the result is VMM_ERR_DRIVER, and left alone otherwise. */
vmm_status vmh_pause_tags(const char *tag, unsigned flags, CUresult *driver_rc);
vmm_status vmh_resume_tags(const char *tag, unsigned flags, CUresult *driver_rc);

#ifdef VMH_TESTING
/* Tests: gives back the host memory kept for backups, zeroes the count below and restores the
 * staging ring's sizes. */
void vmh_pause_reset(void);
/* Tests: bytes of backups copied through the staging ring since the reset. */
size_t vmh_pause_staged_bytes(void);
/* Tests: the staging ring's slot size, and the pageable backup bytes a pause needs to use it
 * (0: the library's values, 16 MiB and 64 MiB), so that a test reaches many slots cheaply. */
void vmh_pause_set_staging(size_t slot, size_t min_total);
#endif

#endif
