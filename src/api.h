/* Layer 7c: the public API (api.c). What the other parts of the public API (pause.c) share with
 * it. */
#ifndef VMH_API_H
#define VMH_API_H

#include "driver.h"

/* Records rc as the calling thread's last driver error (vmm_last_driver_error), for a call of
 * the public API that returned VMM_ERR_DRIVER because of it. */
void vmh_api_note_driver_error(CUresult rc);

#endif
