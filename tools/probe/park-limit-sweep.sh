#!/usr/bin/env bash
# park-limit-sweep: PyTorch training with its caching allocator off (tests/gpu/torch_step.py
# nocache) under the hook at several VMMHOOK_PARK_LIMIT values, one run at a time, to choose the
# default: a higher limit lets the reclaim thread fall further behind before an application
# thread waits itself (fewer blocking synchronizations), at the cost of parked memory (a higher
# peak). Prints each run's STEP, SYNC and MEM lines. GPU machine only.
#
#   bash tools/probe/park-limit-sweep.sh [LIMIT ...]      # default: 256M 1G 4G
set -u
cd "$(dirname "$0")/../.."
export PATH=$PATH:/opt/torch/.venv/bin
B=build-sweep
[ -f $B/build.ninja ] || meson setup $B -Dunit_tests=disabled -Dgpu_tests=disabled -Dfuzz=disabled >/dev/null
ninja -C $B src/libvmmhook.so >/dev/null || exit 2
lib=$PWD/$B/src/libvmmhook.so
for limit in "${@:-256M 1G 4G}"; do
  for l in $limit; do
    echo "== VMMHOOK_PARK_LIMIT=$l"
    LD_PRELOAD=$lib VMMHOOK_PARK_LIMIT=$l timeout 120 python3 tests/gpu/torch_step.py nocache |
      grep -E '^(STEP|SYNC|MEM|FAIL)'
  done
done
