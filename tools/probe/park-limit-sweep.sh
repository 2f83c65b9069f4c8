#!/usr/bin/env bash
# park-limit-sweep: PyTorch training with its caching allocator off (tests/gpu/torch_step.py
# nocache) under the hook at several VMMHOOK_PARK_LIMIT values, one run at a time, to choose the
# default: a higher limit lets the reclaim thread fall further behind before an application
# thread waits itself (fewer blocking synchronizations), at the cost of parked memory (a higher
# peak). Prints each run's STEP, SYNC and MEM lines. GPU machine only.
#
#   bash tools/probe/park-limit-sweep.sh [LIMIT ...]      # default: 256M 1G 4G
#   PACE_NS=1000000 bash tools/probe/park-limit-sweep.sh  # the reclaim thread's pause between
#                                                         # two waits (VMH_BG_PACE_NS, reclaim.c)
set -u
cd "$(dirname "$0")/../.."
export PATH=$PATH:/opt/torch/.venv/bin
B=build-sweep${PACE_NS:+-pace$PACE_NS}
[ -f $B/build.ninja ] || meson setup $B -Dunit_tests=disabled -Dgpu_tests=disabled -Dfuzz=disabled \
  ${PACE_NS:+-Dc_args=-DVMH_BG_PACE_NS=${PACE_NS}L} >/dev/null
ninja -C $B src/libvmmhook.so >/dev/null || exit 2
lib=$PWD/$B/src/libvmmhook.so
for limit in "${@:-256M 1G 4G}"; do
  for l in $limit; do
    echo "== VMMHOOK_PARK_LIMIT=$l${PACE_NS:+ VMH_BG_PACE_NS=$PACE_NS}"
    LD_PRELOAD=$lib VMMHOOK_PARK_LIMIT=$l timeout 120 python3 tests/gpu/torch_step.py nocache |
      grep -E '^(STEP|SYNC|COUNTS|MEM|FAIL)'
  done
done
