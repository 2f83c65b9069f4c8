#!/usr/bin/env bash
# run-bench.sh [libvmmhook.so] [out dir]
#
# The benchmark of issue 5 in one command, on one GPU: runs the bench binary twice,
#   1. plainly            -> native cudaMalloc/cudaFree and cudaMallocAsync (warm pool),
#   2. LD_PRELOAD=lib     -> the hook (the binary checks vmm_hook_available()),
# then joins both into markdown tables with PASS/MISS per target (combine.py).
#
# Defaults: lib = <repo>/build/src/libvmmhook.so, or PREFIX/lib*/libvmmhook.so when installed
# (when absent and not given: plain run only);
# out dir = ./bench-out. Writes OUT/plain.txt, OUT/hook.txt, OUT/summary.md.
# The bench binary: $BENCH_BIN, else <lib dir>/../tools/bench/bench (meson build), else
# <repo>/build/tools/bench/bench, else compiled here with nvcc into OUT/bench.
# Extra arguments for both runs: $BENCH_ARGS (e.g. "--quick", "--only abf").
# Time: about 20-40 s on an H200; each run is killed after $BENCH_TIMEOUT_S seconds (100), so
# the whole script stays under 4 minutes even if a run hangs.
# Exit: 0 done (targets may still MISS: read the table), 77 no CUDA GPU, 2 bad arguments,
# 1 a run failed or was killed (the summary shows what is missing).
set -u

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
lib_arg=${1:-}
out=${2:-bench-out}
timeout_s=${BENCH_TIMEOUT_S:-100}
read -r -a extra <<<"${BENCH_ARGS:-}"

lib=""
if [ -n "$lib_arg" ]; then
    if [ ! -f "$lib_arg" ]; then
        echo "run-bench: $lib_arg: no such file (give the path of libvmmhook.so)" >&2
        exit 2
    fi
    lib=$(cd "$(dirname "$lib_arg")" && pwd)/$(basename "$lib_arg")
elif [ -f "$root/build/src/libvmmhook.so" ]; then
    lib="$root/build/src/libvmmhook.so"
else
    # Installed (meson install): this script in PREFIX/libexec/vmmhook, the library in PREFIX/lib*.
    for c in "$root/lib/libvmmhook.so" "$root/lib64/libvmmhook.so" "$root"/lib/*-linux-gnu/libvmmhook.so; do
        if [ -f "$c" ]; then lib=$c; break; fi
    done
fi

mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)

bench=${BENCH_BIN:-}
if [ -z "$bench" ]; then
    # Beside this script (installed in libexec/vmmhook), or in a meson build tree.
    for c in "$here/bench" ${lib:+"$(dirname "$lib")/../tools/bench/bench"} "$root/build/tools/bench/bench"; do
        if [ -x "$c" ]; then
            bench=$c
            break
        fi
    done
fi
if [ -z "$bench" ]; then
    nvcc=${CUDA_HOME:-/usr/local/cuda}/bin/nvcc
    command -v "$nvcc" >/dev/null 2>&1 || nvcc=$(command -v nvcc || true)
    if [ -z "$nvcc" ]; then
        echo "run-bench: no bench binary (build it with meson, or set BENCH_BIN) and no nvcc" >&2
        exit 2
    fi
    echo "run-bench: compiling $here/bench.cu with $nvcc"
    "$nvcc" -O2 -std=c++17 -arch=sm_90 -I"$root/include" "$here/bench.cu" -o "$out/bench" \
        -ldl -lpthread || exit 2
    bench="$out/bench"
fi

# No GPU: say so at once.
"$bench" --check >"$out/check.txt" 2>&1
rc=$?
cat "$out/check.txt"
if [ $rc -eq 77 ]; then
    echo "run-bench: skipped: no CUDA GPU on this machine"
    exit 77
elif [ $rc -ne 0 ]; then
    echo "run-bench: $bench --check failed (exit $rc)" >&2
    exit 1
fi

status=0
echo "run-bench: [1/2] native + async: $bench ${extra[*]:-}"
timeout -k 5 "$timeout_s" "$bench" "${extra[@]}" 2>&1 | tee "$out/plain.txt"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
    echo "run-bench: the plain run exited with $rc$([ "$rc" -ge 124 ] && echo ' (timeout)')"
    status=1
fi

files=("$out/plain.txt")
if [ -n "$lib" ]; then
    echo "run-bench: [2/2] hook: LD_PRELOAD=$lib $bench --expect-hook ${extra[*]:-}"
    # env(1) sets LD_PRELOAD for the bench only, not for timeout or tee.
    timeout -k 5 "$timeout_s" env LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}" \
        "$bench" --expect-hook "${extra[@]}" 2>&1 | tee "$out/hook.txt"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        echo "run-bench: the hook run exited with $rc$([ "$rc" -ge 124 ] && echo ' (timeout)')"
        status=1
    fi
    files+=("$out/hook.txt")
else
    echo "run-bench: no libvmmhook.so given or found at $root/build/src: hook column left empty"
    status=1
fi

if command -v python3 >/dev/null 2>&1; then
    python3 "$here/combine.py" "${files[@]}" >"$out/summary.md" || status=1
    echo
    cat "$out/summary.md"
else
    echo "run-bench: python3 not found: raw RESULT lines only"
    grep -h '^RESULT' "${files[@]}" | tee "$out/summary.md"
fi
echo
echo "run-bench: wrote $out/summary.md (raw: ${files[*]})"
exit $status
