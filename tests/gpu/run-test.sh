#!/bin/sh
# Runs one GPU-suite program for meson: run-test.sh PROGRAM [ARGS...]
# GPUTEST_PRELOAD=<libvmmhook.so>, when set, is preloaded into the program alone (not into this
# shell). A program linked with -lcuda that cannot start because libcuda.so.1 is missing is a
# skip (no driver), reported as such, never a pass or a failure.
prog=$1
shift
err=$(mktemp "${TMPDIR:-/tmp}/gputest.XXXXXX") || exit 1
if [ -n "${GPUTEST_PRELOAD:-}" ]; then
    LD_PRELOAD="$GPUTEST_PRELOAD${LD_PRELOAD:+:$LD_PRELOAD}" "$prog" "$@" 2>"$err"
else
    "$prog" "$@" 2>"$err"
fi
rc=$?
cat "$err" >&2
if [ "$rc" -eq 127 ] && grep -q 'libcuda\.so\.1' "$err"; then
    echo "SKIP: no CUDA driver: libcuda.so.1 cannot be loaded ($(basename "$prog") is linked with -lcuda)"
    rc=77
fi
rm -f "$err"
exit "$rc"
