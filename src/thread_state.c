/* The calling thread's state (thread_state.h): the library's only thread-local. */
#include "thread_state.h"

__thread vmh_thread_state_t vmh_thread __attribute__((tls_model("initial-exec")));
