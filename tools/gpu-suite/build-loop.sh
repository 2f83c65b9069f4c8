#!/usr/bin/env bash
# Clean builds of the whole tree in a row (issue 20: "a user's build must not fail at random";
# the target is 20 in a row with `ninja -j 16` on the 16-core GPU machine).
#
#   tools/gpu-suite/build-loop.sh [N [BUDGET_S [JOBS]]] [-- MESON_SETUP_ARGS...]
#
# N builds (default 20), each from an empty scratch build directory (meson setup, then
# `ninja -j JOBS`, default 16), stopping early when the time budget (seconds, default 1500) would
# not hold another build as long as the longest so far. A failed build is not retried: its log
# is kept and the loop goes on. Run from the repository root (or anywhere: it finds it).
#
# Writes to $OUT (default ./build-loop-out): summary.md (pass/fail counts, each build's time and
# result, how many ran of the N asked and why it stopped), build-<i>.log for each failed build
# (the last 200 lines), and setup.log of the first setup. Exit status: 0 when every build that
# ran passed and at least one ran, 1 when one failed, 2 on a usage or setup error.
#
# The lead runs it on the GPU machine, e.g. through the device tool:
#   tools/gpu-suite/build-loop.sh 20 540 16        (one 600 s call; several calls for all 20)
# Tested here (2 cores, nvcc, no GPU) with a small N, e.g. `build-loop.sh 2 900 2`.
set -u

here=$(cd "$(dirname "$0")/../.." && pwd)
n=20 budget=1500 jobs=16
pos=()
while [ $# -gt 0 ]; do
    case $1 in
    --) shift; break ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) pos+=("$1"); shift ;;
    esac
done
[ ${#pos[@]} -ge 1 ] && n=${pos[0]}
[ ${#pos[@]} -ge 2 ] && budget=${pos[1]}
[ ${#pos[@]} -ge 3 ] && jobs=${pos[2]}
setup_args=("$@")
for v in "$n" "$budget" "$jobs"; do
    case $v in ''|*[!0-9]*) echo "build-loop: N, BUDGET_S and JOBS are whole numbers (got '$v')" >&2; exit 2 ;; esac
done

out=${OUT:-$PWD/build-loop-out}
mkdir -p "$out" || exit 2
scratch=$(mktemp -d "${TMPDIR:-/tmp}/build-loop.XXXXXX") || exit 2
trap 'rm -rf "$scratch"' EXIT

start=$(date +%s)
pass=0 fail=0 ran=0 longest=0 stopped="all $n ran"
rows=()
nvccv=$( (command -v nvcc >/dev/null && nvcc --version || /usr/local/cuda/bin/nvcc --version) 2>/dev/null | tail -1)
for i in $(seq 1 "$n"); do
    now=$(date +%s)
    left=$((budget - (now - start)))
    if [ "$ran" -gt 0 ] && [ "$left" -lt "$longest" ]; then
        stopped="stopped after $ran of $n: ${left}s of the ${budget}s budget left, the longest build took ${longest}s"
        break
    fi
    bdir=$scratch/b$i
    t0=$(date +%s.%N)
    log=$scratch/build-$i.log
    if ! meson setup "$bdir" "$here" "${setup_args[@]}" >"$log" 2>&1; then
        cp "$log" "$out/setup.log"
        echo "build-loop: meson setup failed (see $out/setup.log)" >&2
        rows+=("| $i | setup failed | - |")
        fail=$((fail + 1)) ran=$((ran + 1))
        stopped="stopped: meson setup failed"
        break
    fi
    [ "$i" = 1 ] && cp "$log" "$out/setup.log"
    if timeout $((left > 60 ? left : 60)) ninja -C "$bdir" -j "$jobs" >>"$log" 2>&1; then
        res=PASS pass=$((pass + 1))
    else
        res="**FAIL** (build-$i.log)" fail=$((fail + 1))
        tail -n 200 "$log" >"$out/build-$i.log"
        grep -m3 -E "fatal|error|FAILED" "$log" | sed 's/^/  /' >&2
    fi
    t1=$(date +%s.%N)
    secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.0f", b - a }')
    [ "$secs" -gt "$longest" ] && longest=$secs
    ran=$((ran + 1))
    rows+=("| $i | $res | $secs |")
    echo "build-loop: build $i of $n: $res in ${secs}s (pass $pass, fail $fail)" >&2
    rm -rf "$bdir"
done
total=$(( $(date +%s) - start ))

{
    echo "# build-loop: $pass passed, $fail failed, $ran of $n ran"
    echo
    echo "- clean builds of the whole tree: meson setup ${setup_args[*]:-(defaults)}, then ninja -j $jobs"
    echo "- host: $(nproc) cores, $(uname -srm); nvcc: ${nvccv:-not found}"
    echo "- budget ${budget}s, took ${total}s; $stopped"
    echo
    echo "| build | result | seconds |"
    echo "| --- | --- | --- |"
    printf '%s\n' "${rows[@]}"
} >"$out/summary.md"
cat "$out/summary.md"
[ "$ran" -gt 0 ] && [ "$fail" = 0 ] && exit 0
[ "$fail" -gt 0 ] && exit 1
exit 2
