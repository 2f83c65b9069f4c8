#!/usr/bin/env bash
# tools/gpu-suite/issue-checks.sh: the PyTorch checks of issues 28 and 29 that the suite does not
# run (each needs minutes, or TMS's source), in one call of the device tool after the suite:
#   1. tests/gpu/tms_examples.py: torch_memory_saver's own examples against the drop-in (needs a
#      checkout of TMS at .tms-src: carry it), both modes;
#   2. tests/gpu/torch_tms_settings.py: each public TMS setting, "preload" and "torch" modes;
#   3. tests/gpu/torch_overflow_sum.py cache / nocache under VMMHOOK_OVERFLOW=host.
# Builds the library first (meson, as tools/probe/round15-diag.sh). Each step has its own time
# limit and runs only while the whole stays under ISSUE_CHECKS_BUDGET_S (default 540).
#   OUT=/dir bash tools/gpu-suite/issue-checks.sh [STEP ...]   (steps: tms settings overflow)
# Writes $OUT/<step>.txt; prints the PASS/FAIL/T lines. Exit 0 when every step run passed.
set -u
cd "$(dirname "$0")/../.." || exit 2
OUT=${OUT:-/tmp/issue-checks}
mkdir -p "$OUT"
T0=$(date +%s)
BUDGET=${ISSUE_CHECKS_BUDGET_S:-540}
PY=${TORCH_PYTHON:-/opt/torch/.venv/bin/python3}
B=build-checks
mkdir -p "$B/pc"
printf 'Name: cmocka\nDescription: stand-in\nVersion: 1.1.7\nLibs:\nCflags:\n' >"$B/pc/cmocka.pc"
{
    PKG_CONFIG_PATH="$PWD/$B/pc" meson setup "$B" -Dwerror=false -Dbuildtype=debugoptimized \
        -Dunit_tests=disabled -Dfuzz=disabled -Dgpu_tests=disabled -Dgpu_arch=native &&
        ninja -C "$B" src/libvmmhook.so
} >"$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 2; }
L=$PWD/$B/src/libvmmhook.so
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" LIBVMMHOOK="$L"
rc=0
step() { # name limit command...
    local name=$1 limit=$2 left
    shift 2
    left=$((BUDGET - ($(date +%s) - T0)))
    if [ "$left" -lt 30 ]; then
        echo "== $name: not run (${left} s left)" | tee -a "$OUT/$name.txt"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name ($(($(date +%s) - T0)) s): $*" >>"$OUT/$name.txt"
    local t=$(date +%s)
    timeout -k 5 "$limit" "$@" >>"$OUT/$name.txt" 2>&1
    local r=$?
    echo "== $name: exit $r in $(($(date +%s) - t)) s" >>"$OUT/$name.txt"
    [ "$r" = 0 ] || rc=1
}
steps=${*:-tms settings overflow}
for s in $steps; do
    case $s in
    tms) step tms 240 "$PY" tests/gpu/tms_examples.py .tms-src ;;
    settings)
        step settings 150 "$PY" tests/gpu/torch_tms_settings.py preload vmmhook
        step settings 150 "$PY" tests/gpu/torch_tms_settings.py torch vmmhook ;;
    overflow)
        for m in cache nocache; do
            step overflow 120 env LD_PRELOAD="$L" VMMHOOK_OVERFLOW=host \
                "$PY" tests/gpu/torch_overflow_sum.py "$m"
        done ;;
    esac
done
grep -hE '^(==|PASS|FAIL|T |SKIP|I .*(GiB/s|spill))' "$OUT"/*.txt | grep -v '^== .*: /' | cut -c1-300
exit "$rc"
