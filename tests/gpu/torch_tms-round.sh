#!/usr/bin/env bash
# On the GPU machine, in one call of the device tool: torch_memory_saver built from its source
# (when TMS_SRC, default .tms-src, holds it) into the PyTorch environment, the library built,
# then tests/gpu/torch_tms-compare.sh: tests/gpu/torch_tms.py with the drop-in and with TMS, in
# "preload" and "torch" modes, outcomes compared; then tests/gpu/torch_tms_settings.py (each
# public setting, PASS/FAIL per setting) with each, both modes; then tests/gpu/tms_examples.py:
# TMS's own examples from $TMS_SRC against the drop-in (pass/fail per example, not in the exit
# code). Unmeasured on an H200: more than one call's 10 minutes in all (8 GiB backed-up cycles;
# TMS_BENCH_GIB=2 for less; run the programs in separate calls if need be).
#   OUT=/some/dir [PYTHON=/opt/torch/.venv/bin/python3] [TMS_SRC=.tms-src] bash tests/gpu/torch_tms-round.sh
# Writes $OUT/tms-build.log, $OUT/build-lib.log and the runs' outputs under $OUT/tms/.
# Exit: torch_tms-compare.sh's (0 pass, 1 fail, 77 nothing ran), 1 also when a drop-in settings
# run failed, 2 when the library did not build.
set -u
cd "$(dirname "$0")/../.."
export PATH=$PATH:/opt/torch/.venv/bin
OUT=${OUT:-$PWD/tms-out}
mkdir -p "$OUT"
P=${PYTHON:-/opt/torch/.venv/bin/python3}
src=${TMS_SRC:-.tms-src}
if [ -f "$src/setup.py" ]; then
    if (cd "$src" && TMS_CUDA_MAJOR=13 "$P" -m pip install --no-build-isolation --no-deps .) \
        >"$OUT/tms-build.log" 2>&1; then
        echo "torch_memory_saver built from $src: $("$P" -m pip show torch_memory_saver 2>/dev/null | grep '^Version')"
    else
        echo "torch_memory_saver: the build from $src failed (tail of $OUT/tms-build.log):"
        tail -15 "$OUT/tms-build.log"
    fi
else
    echo "torch_memory_saver: no source in $src (the comparison runs only if it is installed already)"
fi
B=build-tms
{ [ -f $B/build.ninja ] || meson setup $B -Dunit_tests=disabled -Dgpu_tests=disabled -Dfuzz=disabled; } \
    >"$OUT/build-lib.log" 2>&1 && ninja -C $B src/libvmmhook.so >>"$OUT/build-lib.log" 2>&1 ||
    { echo "the library did not build:"; tail -20 "$OUT/build-lib.log"; exit 2; }
sh tests/gpu/torch_tms-compare.sh "$P" "$PWD/$B/src/libvmmhook.so" "$OUT/tms"
rc=$?
# Each public setting (tests/gpu/torch_tms_settings.py), both modes, the drop-in and, where it
# is installed, TMS itself: PASS/FAIL per setting, I lines with rates and VmRSS deltas.
for mode in preload torch; do
    for impl in vmmhook tms; do
        env -u LD_PRELOAD LIBVMMHOOK="$PWD/$B/src/libvmmhook.so" PYTHONPATH="$PWD/python" \
            PYTHONUNBUFFERED=1 timeout 600 "$P" tests/gpu/torch_tms_settings.py "$mode" "$impl" \
            >"$OUT/tms/settings.$mode.$impl.out" 2>&1
        src=$?
        echo "torch_tms_settings $mode $impl: exit $src"
        grep -E '^(PASS|FAIL|SKIP|  I |I )' "$OUT/tms/settings.$mode.$impl.out" | sed 's/^/    /'
        [ "$impl" = tms ] || [ "$src" = 0 ] || rc=1
    done
done
# TMS's own examples (its test suite) against the drop-in, from the checkout in $src.
env -u LD_PRELOAD LIBVMMHOOK="$PWD/$B/src/libvmmhook.so" PYTHONUNBUFFERED=1 timeout 1500 \
    "$P" tests/gpu/tms_examples.py "$src" >"$OUT/tms/examples.out" 2>&1
erc=$?
echo "tms_examples: exit $erc"
grep -E '^(PASS|FAIL|SKIP|I public)' "$OUT/tms/examples.out" | sed 's/^/    /'
exit $rc
