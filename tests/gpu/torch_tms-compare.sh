#!/bin/sh
# torch_tms.py under both hook modes, with libvmmhook's drop-in and, where it is installed, with
# torch_memory_saver itself; then the R lines (outcomes) of the two compared per mode.
#   tests/gpu/torch_tms-compare.sh PYTHON LIBVMMHOOK [OUTDIR]
# PYTHON: an interpreter with torch (and torch_memory_saver to compare); LIBVMMHOOK: the
# library the drop-in uses (the package comes from python/ of this tree unless installed).
# Prints one line per run and per comparison, then PASS or FAIL. Exit 0 when every vmmhook run
# passed and, where TMS ran, its R lines are the same; 1 otherwise; 77 when nothing could run.
set -u
py=$1
lib=$2
out=${3:-$(mktemp -d)}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
fail=0
ran=0
for mode in preload torch; do
    for impl in vmmhook tms; do
        (cd "$root" && env -u LD_PRELOAD LIBVMMHOOK="$lib" PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" \
            PYTHONUNBUFFERED=1 timeout 300 "$py" "$here/torch_tms.py" "$mode" "$impl") \
            >"$out/$mode.$impl.out" 2>"$out/$mode.$impl.err"
        rc=$?
        echo "$rc" >"$out/$mode.$impl.rc"
        last=$(grep -E '^(PASS|FAIL|SKIP)' "$out/$mode.$impl.out" | tail -1)
        echo "torch_tms $mode $impl: exit $rc: ${last:-$(tail -c 300 "$out/$mode.$impl.err")}"
        grep '^I ' "$out/$mode.$impl.out" | sed 's/^/    /'
        [ "$rc" = 77 ] || ran=1
        if [ "$impl" = vmmhook ] && [ "$rc" != 0 ]; then
            fail=1
            grep '^FAIL' "$out/$mode.$impl.out" | sed 's/^/    /'
        fi
    done
    if [ "$(cat "$out/$mode.tms.rc")" != 77 ]; then
        grep '^R ' "$out/$mode.tms.out" >"$out/$mode.tms.R"
        grep '^R ' "$out/$mode.vmmhook.out" >"$out/$mode.vmmhook.R"
        if diff -u "$out/$mode.tms.R" "$out/$mode.vmmhook.R" >"$out/$mode.diff"; then
            echo "compare $mode: the same R lines as torch_memory_saver ($(wc -l <"$out/$mode.tms.R") lines)"
        else
            echo "compare $mode: R lines differ from torch_memory_saver:"
            sed 's/^/    /' "$out/$mode.diff"
            fail=1
        fi
    else
        echo "compare $mode: torch_memory_saver did not run (not installed in $py?)"
    fi
done
[ "$ran" = 1 ] || { echo "SKIP: torch_tms: nothing ran (outputs in $out)"; exit 77; }
if [ "$fail" = 0 ]; then echo "PASS: torch_tms-compare (outputs in $out)"; else echo "FAIL: torch_tms-compare (outputs in $out)"; fi
exit "$fail"
