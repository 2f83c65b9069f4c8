#!/bin/sh
# sim-compare.sh LIB PROG [ARGS...]: runs PROG natively and with LIB preloaded (on whatever
# libcuda.so.1 the environment gives: meson's gpu-sim suite points LD_LIBRARY_PATH at the
# simulated driver) and passes when both pass (exit 0) and their "R " lines are identical, as
# tools/gpu-suite.sh does on a GPU. A run that skips (77) makes the whole test skip.
lib=$1
shift
d=$(mktemp -d "${TMPDIR:-/tmp}/simcmp.XXXXXX") || exit 1
trap 'rm -rf "$d"' EXIT
"$@" >"$d/native" 2>&1
nrc=$?
LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}" GPUTEST_EXPECT_HOOK=1 VMMHOOK_LEAKS=1 \
    VMMHOOK_STATS=1 "$@" >"$d/hooked" 2>&1
hrc=$?
echo "--- native (exit $nrc)"
cat "$d/native"
echo "--- hooked (exit $hrc)"
cat "$d/hooked"
if [ "$nrc" -eq 77 ] || [ "$hrc" -eq 77 ]; then
    echo "SKIP: a run skipped (native $nrc, hooked $hrc)"
    exit 77
fi
grep '^R ' "$d/native" >"$d/native.R"
grep '^R ' "$d/hooked" >"$d/hooked.R"
echo "--- R lines, native vs hooked (diff -u)"
if diff -u "$d/native.R" "$d/hooked.R"; then
    echo "(identical: $(wc -l <"$d/native.R") lines)"
    same=1
else
    same=0
fi
if [ "$nrc" -eq 0 ] && [ "$hrc" -eq 0 ] && [ "$same" -eq 1 ]; then
    echo "PASS: native and hooked agree"
    exit 0
fi
echo "FAIL: native exit $nrc, hooked exit $hrc, R lines $([ "$same" -eq 1 ] && echo identical || echo differ)"
exit 1
