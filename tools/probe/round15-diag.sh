#!/usr/bin/env bash
# tools/probe/round15-diag.sh: the diagnostic call of round 15 on the GPU machine (one call of the
# device tool, about 2-3 minutes), before any fix was built:
#   1. copy_paths.cu: which copy path moves host-located VMM memory back at the link's speed
#      (issue 29's vmm_prefetch at 27.6 GiB/s vs a bare copy's 51.6), and whether making device
#      memory right after releasing as much is slow (issue 27's second-cycle resume: 68-78 ms);
#   2. the bench's alloc+free pairs (workload a), natively and under the hook, the hooked run also
#      under strace -c (syscalls per pair: ioctls are driver calls into the kernel, futexes wakes)
#      and with VMMHOOK_STATS=1 (the hook's driver call counts at exit).
#   OUT=/dir bash tools/probe/round15-diag.sh
set -u
cd "$(dirname "$0")/../.." || exit 2
OUT=${OUT:-/tmp/round15-diag}
mkdir -p "$OUT"
{
    date -u; git rev-parse --short HEAD 2>/dev/null; nvidia-smi -L
    nvidia-smi topo -m 2>&1 | head -5; command -v numactl && numactl -H | head -4
    command -v strace perf ltrace
} >"$OUT/machine.txt" 2>&1
nvcc -O2 -o "$OUT/copy_paths.bin" tools/probe/copy_paths.cu -lcuda >"$OUT/copy_paths.txt" 2>&1 &&
    timeout 150 "$OUT/copy_paths.bin" 4 >>"$OUT/copy_paths.txt" 2>&1
rm -f "$OUT/copy_paths.bin"
B=build-diag
mkdir -p "$B/pc"
printf 'Name: cmocka\nDescription: stand-in\nVersion: 1.1.7\nLibs:\nCflags:\n' >"$B/pc/cmocka.pc"
{
    PKG_CONFIG_PATH="$PWD/$B/pc" meson setup "$B" -Dwerror=false -Dbuildtype=debugoptimized \
        -Dunit_tests=disabled -Dfuzz=disabled -Dgpu_tests=disabled -Dgpu_arch=native &&
        ninja -C "$B" src/libvmmhook.so tools/bench/bench
} >"$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
L=$PWD/$B/src/libvmmhook.so
{
    echo "== native"; timeout 60 "$B/tools/bench/bench" --only a
    echo "== hook"; VMMHOOK_STATS=1 LD_PRELOAD=$L timeout 60 "$B/tools/bench/bench" --only a --expect-hook
    if command -v strace >/dev/null; then
        echo "== hook under strace -f -c"
        LD_PRELOAD=$L timeout 120 strace -f -c -o "$OUT/strace-hook.txt" "$B/tools/bench/bench" --only a --expect-hook | grep -E 'pair|RESULT'
        echo "== native under strace -f -c"
        timeout 120 strace -f -c -o "$OUT/strace-native.txt" "$B/tools/bench/bench" --only a | grep -E 'pair|RESULT'
    fi
} >"$OUT/pairs.txt" 2>&1
cat "$OUT/copy_paths.txt"; grep -E 'RESULT .*pair|^==' "$OUT/pairs.txt"
head -25 "$OUT"/strace-*.txt 2>/dev/null
