/* VMH_TESTABLE: internal functions and hooks that the unit tests and the fuzzer reach, without
 * exporting them from the shipped library. In the shipped build they are static (invisible even
 * to the version script); the test build (-DVMH_TESTING, see src/meson.build) makes them
 * external, as jemalloc's JET_EXTERN does. Their prototypes sit in the owning header inside
 * #ifdef VMH_TESTING, so that a shipped-build prototype never contradicts the static. */
#ifndef VMH_TESTABLE_H
#define VMH_TESTABLE_H

#ifdef VMH_TESTING
#define VMH_TESTABLE
#else
#define VMH_TESTABLE static
#endif

#endif
