#!/usr/bin/env bash
# tools/probe/churn-repeat.sh: tests/gpu/churn_mt under the hook, N times with static and shared
# cudart, for a check that fails rarely (round 16: its freed-address check failed once, in
# tools/gpu-suite.sh at 0257894). For the GPU machine, from the repository root:
#   OUT=/some/dir bash tools/probe/churn-repeat.sh [N=6] [churn_mt args: 8 2000, the suite's]
# Prints one line per run (exit code, the leftover R lines) and a count of failed runs.
set -u
N=${1:-6}
shift || true
if [ $# -ge 1 ]; then ARGS=("$@"); else ARGS=(8 2000); fi
OUT=${OUT:-/tmp/churn-repeat}
mkdir -p "$OUT/pc" "$OUT/bin"
[ -f .gpu-deps/env.sh ] && . .gpu-deps/env.sh
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
printf 'Name: cmocka\nDescription: stand-in\nVersion: 1.1.7\nLibs:\nCflags:\n' >"$OUT/pc/cmocka.pc"
PKG_CONFIG_PATH="$OUT/pc" meson setup build-churn -Dwerror=false -Dbuildtype=debugoptimized \
    -Dunit_tests=disabled -Dfuzz=disabled -Dgpu_tests=disabled >"$OUT/build.log" 2>&1 &&
    ninja -C build-churn src/libvmmhook.so >>"$OUT/build.log" 2>&1 || {
    echo "churn-repeat: library build failed"; tail -20 "$OUT/build.log"; exit 1; }
LIB=$PWD/build-churn/src/libvmmhook.so
for v in static shared; do
    c=(); [ $v = shared ] && c=(-cudart shared)
    "$CUDA_HOME/bin/nvcc" -O2 -std=c++17 -Iinclude -Itests/gpu "${c[@]}" tests/gpu/churn_mt.cu \
        -o "$OUT/bin/churn_mt.$v" -ldl -lpthread >>"$OUT/build.log" 2>&1 || {
        echo "churn-repeat: nvcc failed"; tail -20 "$OUT/build.log"; exit 1; }
done
fails=0
for i in $(seq 1 "$N"); do
    for v in static shared; do
        log=$OUT/run.$v.$i.txt
        env LD_PRELOAD="$LIB" GPUTEST_EXPECT_HOOK=1 timeout 120 "$OUT/bin/churn_mt.$v" "${ARGS[@]}" >"$log" 2>&1
        rc=$?
        [ $rc -eq 0 ] || fails=$((fails + 1))
        echo "run $i $v rc=$rc $(grep -h '^R leftover' "$log" | tr '\n' ' ')"
    done
done
echo "churn-repeat: $fails of $((2 * N)) runs failed"
