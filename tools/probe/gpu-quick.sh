#!/usr/bin/env bash
# tools/probe/gpu-quick.sh: a few GPU checks without the whole suite, for the GPU machine when
# little device time is left (round 16). From the repository root:
#   OUT=/some/dir bash tools/probe/gpu-quick.sh churn [N=6] [churn_mt args: 8 2000, the suite's]
#       tests/gpu/churn_mt under the hook N times with static and shared cudart (its freed-
#       address check failed once in tools/gpu-suite.sh at 0257894); one line per run and the
#       count of failed runs.
#   OUT=/some/dir bash tools/probe/gpu-quick.sh varlen [steps=60]
#       tests/gpu/torch_varlen.py hooked alone (its MEM and DROP lines); judge it against a
#       stored expandable_segments run with `python3 tests/gpu/torch_varlen.py compare`.
# Builds only libvmmhook.so (meson, a stand-in cmocka.pc: the unit suites are not built).
set -u
OUT=${OUT:-/tmp/gpu-quick}
what=${1:-churn}
shift || true
mkdir -p "$OUT/pc" "$OUT/bin"
[ -f .gpu-deps/env.sh ] && . .gpu-deps/env.sh
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
printf 'Name: cmocka\nDescription: stand-in\nVersion: 1.1.7\nLibs:\nCflags:\n' >"$OUT/pc/cmocka.pc"
PKG_CONFIG_PATH="$OUT/pc" meson setup build-quick -Dwerror=false -Dbuildtype=debugoptimized \
    -Dunit_tests=disabled -Dfuzz=disabled -Dgpu_tests=disabled >"$OUT/build.log" 2>&1 &&
    ninja -C build-quick src/libvmmhook.so >>"$OUT/build.log" 2>&1 || {
    echo "gpu-quick: library build failed"
    tail -20 "$OUT/build.log"
    exit 1
}
LIB=$PWD/build-quick/src/libvmmhook.so

case $what in
churn)
    N=${1:-6}
    shift || true
    if [ $# -ge 1 ]; then ARGS=("$@"); else ARGS=(8 2000); fi
    for v in static shared; do
        c=()
        [ $v = shared ] && c=(-cudart shared)
        "$CUDA_HOME/bin/nvcc" -O2 -std=c++17 -Iinclude -Itests/gpu "${c[@]}" tests/gpu/churn_mt.cu \
            -o "$OUT/bin/churn_mt.$v" -ldl -lpthread >>"$OUT/build.log" 2>&1 || {
            echo "gpu-quick: nvcc failed"
            tail -20 "$OUT/build.log"
            exit 1
        }
    done
    fails=0
    for i in $(seq 1 "$N"); do
        for v in static shared; do
            log=$OUT/run.$v.$i.txt
            env LD_PRELOAD="$LIB" GPUTEST_EXPECT_HOOK=1 timeout 120 "$OUT/bin/churn_mt.$v" \
                "${ARGS[@]}" >"$log" 2>&1
            rc=$?
            [ $rc -eq 0 ] || fails=$((fails + 1))
            echo "run $i $v rc=$rc $(grep -h '^R leftover' "$log" | tr '\n' ' ')"
        done
    done
    echo "gpu-quick churn: $fails of $((2 * N)) runs failed"
    ;;
varlen)
    PY=${PY:-/opt/torch/.venv/bin/python3}
    env PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/python" LIBVMMHOOK="$LIB" LD_PRELOAD="$LIB" \
        GPUTEST_EXPECT_HOOK=1 VMMHOOK_STATS_JSON="$OUT/torch_varlen.hooked.json" \
        timeout 300 "$PY" tests/gpu/torch_varlen.py hooked "$@" >"$OUT/torch_varlen.hooked.out" \
        2>"$OUT/torch_varlen.hooked.err"
    echo "gpu-quick varlen: rc=$?"
    cat "$OUT/torch_varlen.hooked.out"
    ;;
*)
    echo "usage: gpu-quick.sh churn [N] [args...] | varlen [steps]" >&2
    exit 2
    ;;
esac
