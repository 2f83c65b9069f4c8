#!/usr/bin/env bash
# tools/gpu-suite/selftest.sh: checks tools/gpu-suite.sh itself, without a GPU.
#
# The suite runs on a copy of the repository with a stand-in CUDA toolkit whose nvcc writes, for
# each program, a small shell script that prints what the real program would (R, I, T, STEP,
# SYNC lines; the stats JSON the hook would write), and with a python3 wrapper that does the
# same for tests/gpu/torch_*.py. The real library is built (the headers of the real toolkit are
# needed). Then the summary must hold the rows and tables each step writes: a deliberate
# native/hooked difference (two_ctx) must fail, the rest pass, the timing tables carry the
# stand-in figures, and the suite's own log must show no shell error.
#
# Usage: tools/gpu-suite/selftest.sh   (about 30-80 s on 2 cores; SELFTEST_KEEP=1 keeps the copy
# and its logs). Exit 0 pass, 1 fail, 77 skip (no CUDA headers, no git checkout).
set -u
src=$(cd "$(dirname "$0")/../.." && pwd)
real_cuda=${CUDA_HOME:-/usr/local/cuda}
if [ ! -f "$real_cuda/include/cuda.h" ]; then
    echo "SKIP: no cuda.h under $real_cuda/include (the library needs the CUDA headers)"
    exit 77
fi
if ! git -C "$src" rev-parse HEAD >/dev/null 2>&1; then
    echo "SKIP: $src is not a git checkout (the copy is made from git ls-files)"
    exit 77
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpu-suite-selftest.XXXXXX") || exit 1
[ -n "${SELFTEST_KEEP:-}" ] || trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/repo" "$tmp/cuda/bin" "$tmp/pybin"
(cd "$src" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$tmp/repo") || exit 1
ln -s "$real_cuda/include" "$tmp/cuda/include"
[ -d "$real_cuda/lib64" ] && ln -s "$real_cuda/lib64" "$tmp/cuda/lib64"

# ---------------------------------------------------------------- stand-in programs
cat >"$tmp/fake-program" <<'EOS'
# The body of every stand-in program; $name is set above this line.
hooked=0
[ -n "${LD_PRELOAD:-}" ] && [ -z "${VMMHOOK_DISABLE:-}" ] && hooked=1
json() { # what the hook's exit report would say: served, nothing left
    [ "$hooked" = 1 ] && [ -n "${VMMHOOK_STATS_JSON:-}" ] || return 0
    printf '{"counters": {"served_allocs": 3, "served_frees": 3, "syncs": 130, "syncs_blocking": 2, "syncs_background": 128}, "gauges": {"bytes_requested": {"current": 0, "peak": 1000}, "bytes_mapped": {"current": 0, "peak": 1100}, "bytes_reserved": {"current": 0, "peak": 2000}, "bytes_cached": {"current": 0, "peak": 0}}, "leaks": {"count": 0}}\n' >"$VMMHOOK_STATS_JSON"
}
echo "I device 0: STAND-IN H200"
case $name in
gpu_probe) echo "PASS: gpu_probe"; exit 0 ;;
realloc_gpu | pause_resume | holes_gpu)
    [ "$hooked" = 1 ] || { echo "SKIP: needs the hook"; exit 77; } ;;
overflow_gpu)
    [ "$hooked" = 1 ] && [ "${VMMHOOK_OVERFLOW:-}" = host ] || { echo "SKIP: needs the hook and VMMHOOK_OVERFLOW=host"; exit 77; } ;;
ipc_gpu)
    if [ "${VMMHOOK_HANDLE_TYPE:-}" = none ] && [ "$hooked" = 1 ]; then
        echo "vmmhook: IPC needs VMMHOOK_HANDLE_TYPE=posix_fd" >&2
        echo "SKIP: refused"
        exit 77
    fi ;;
peer_gpu) echo "SKIP: one GPU"; exit 77 ;;
hello) echo "vmmhook: allocations served 2"; json; exit 0 ;;
bench)
    [ "${1:-}" = --check ] && { echo "INFO gpu STAND-IN"; exit 0; }
    if [ "${1:-}" = --expect-hook ]; then
        echo "RESULT hook.churn1.us_per_step.p50 6 us"
        echo "RESULT hook.churn16.steps_per_s 150000 steps/s"
        echo "RESULT hook.churn16.scaling 1.5 x"
    else
        echo "RESULT native.churn1.us_per_step.p50 10 us"
        echo "RESULT async.churn1.us_per_step.p50 5 us"
        echo "RESULT native.churn16.steps_per_s 50000 steps/s"
        echo "RESULT async.churn16.steps_per_s 100000 steps/s"
    fi
    exit 0 ;;
esac
case $name in
two_ctx) echo "R total buffers_touched=$hooked of 80" ;; # a deliberate difference: must FAIL
pause_resume)
    echo "R pr40m cycle 0: vmm_pause -> 0"
    echo "T pr40m.pause.cycle0 80.000 ms <=100.000 MET"
    echo "T backup.first_pause_rate 5.000 GiB/s >=8.000 MISS"
    echo "I pinned cudaMemcpy 1 GiB: device to host 50.0 GiB/s, host to device 51.0 GiB/s" ;;
holes_gpu)
    echo "I holes: 10240 x 2 MiB, 1 in 512 kept: 20480 MiB used before the frees, 4072 MiB 3.5 s after (0.199)"
    echo "R idle chunks inside extents unmapped: yes" ;;
overflow_gpu)
    echo "R vmm_prefetch -> 0"
    echo "T spilled_kernel_read 47.00 GiB/s 40 MET"
    echo "T prefetch_back 30.00 GiB/s 40 MISS" ;;
ipc_cost) echo "COST malloc_free 2MiB median_us=60.1" ;;
replay) echo "RESULT replay 1.0" ;;
*) echo "R same answer" ;;
esac
json
echo "PASS: $name"
EOS
cat >"$tmp/cuda/bin/nvcc" <<EOS
#!/usr/bin/env bash
# stand-in nvcc: "-o OUT SRC" writes OUT, a script that plays the program SRC names.
out="" srcf=""
while [ \$# -gt 0 ]; do
    case \$1 in
    -o) out=\$2; shift ;;
    --version) echo "stand-in nvcc (gpu-suite selftest)"; exit 0 ;;
    *.cu | *.c) srcf=\$1 ;;
    esac
    shift
done
[ -n "\$out" ] || exit 0
{ echo '#!/usr/bin/env bash'; echo "name=\$(basename "\${srcf%.*}")"; cat "$tmp/fake-program"; } >"\$out"
chmod +x "\$out"
EOS
chmod +x "$tmp/cuda/bin/nvcc"

# python3: tests/gpu/torch_*.py played, anything else passed to the real python3.
real_py=$(command -v python3)
cat >"$tmp/pybin/python3" <<EOS
#!/usr/bin/env bash
# torch_varlen's compare mode is plain Python over the two runs' lines: the real one judges.
case \${1:-}.\${2:-} in *tests/gpu/torch_varlen.py.compare) exec "$real_py" "\$@" ;; esac
case \${1:-} in
*tests/gpu/torch_*.py) ;;
*) exec "$real_py" "\$@" ;;
esac
script=\$(basename "\$1" .py)
variant=\${2:-}
# The suite must run its Python checks with the package importable (issue 30).
"$real_py" -c 'import vmmhook' 2>/dev/null ||
    { echo "FAIL: \$script: No module named 'vmmhook' (PYTHONPATH=\${PYTHONPATH:-})"; exit 1; }
hooked=0
[ -n "\${LD_PRELOAD:-}" ] && [ -z "\${VMMHOOK_DISABLE:-}" ] && hooked=1
if [ "\$hooked" = 1 ] && [ -n "\${VMMHOOK_STATS_JSON:-}" ]; then
    printf '{"counters": {"served_allocs": 5, "syncs": 650}, "gauges": {"bytes_requested": {"current": 0, "peak": 1800000000}, "bytes_mapped": {"current": 0, "peak": 2000000000}}, "leaks": {"count": 0}}\n' >"\$VMMHOOK_STATS_JSON"
fi
case \$script in
torch_ipc)
    [ "\${VMMHOOK_HANDLE_TYPE:-}" = none ] && { echo "needs VMMHOOK_HANDLE_TYPE=posix_fd" >&2; exit 3; }
    [ "\$variant" = nocache ] && { echo "SKIP: not shareable"; exit 77; } ;;
torch_step)
    case \$variant.\$hooked in
    nocache.1) echo "STEP median_ms 35.100 p10_ms 34.000 p90_ms 40.000 steps 60"
        echo "SYNC syncs 0.50 syncs_blocking 0.20"
        echo "CALLS app_per_alloc 0.0150 allocs_per_step 12.0"
        echo "MEM peak_requested 1000000000 peak_device 1100000000 source hook-gauges(whole-run)" ;;
    cache.0) echo "STEP median_ms 18.200 p10_ms 18.000 p90_ms 19.000 steps 60"
        echo "MEM peak_requested 900000000 peak_device 1000000000 source torch(timed-steps)" ;;
    *) echo "STEP median_ms 60.000 p10_ms 59.000 p90_ms 61.000 steps 60" ;;
    esac ;;
torch_overflow_sum) [ "\$hooked" = 1 ] || { echo "SKIP: needs the hook"; exit 77; }
    echo "I spilled 42.00 GiB; spills 11, of them small 0"
    echo "T sum_rate_\$variant 150.0 GiB/s 100 MET" ;;
torch_varlen)
    case \$variant.\$hooked in
    hooked.1) echo "MEM hooked peak_mapped 2000000000 peak_requested 1800000000 peak_torch_allocated 1"
        echo "DROP hooked mapped 1050000000 requested 1000000000 ratio 1.050" ;;
    expandable.0) echo "MEM expandable peak_reserved 2100000000 peak_allocated 1800000000" ;;
    esac ;;
torch_sleep) [ "\$hooked" = 1 ] || { echo "SKIP: needs the hook"; exit 77; }
    echo "R graph replay bit-identical: True" ;;
*) echo "R step 0 loss 1.0" ;;
esac
echo "PASS: \$script \$variant"
EOS
chmod +x "$tmp/pybin/python3"
printf '#!/usr/bin/env bash\necho "quickstart: running tools/demo/hello under the hook"\necho "vmmhook: allocations served 12"\n' >"$tmp/repo/tools/quickstart"

# ---------------------------------------------------------------- run and judge
echo "selftest: running the suite on a copy in $tmp/repo with a stand-in nvcc and python3"
(cd "$tmp/repo" && PATH="$tmp/pybin:$tmp/cuda/bin:$PATH" CUDA_HOME="$tmp/cuda" GPU_SUITE_SKIP="shared" \
    GIT_COMMIT=selftest OUT="$tmp/out" bash tools/gpu-suite.sh >"$tmp/suite.log" 2>&1)
rc=$?
sum=$tmp/out/summary.md
fails=0
want() { # DESCRIPTION EXTENDED-REGEX: a line of the summary must match
    if grep -qE -- "$2" "$sum" 2>/dev/null; then
        echo "ok:   $1"
    else
        echo "FAIL: $1 (no line matching: $2)"
        fails=$((fails + 1))
    fi
}
if [ "$rc" = 1 ]; then
    echo "ok:   suite exit 1 (the deliberate two_ctx difference)"
else
    echo "FAIL: suite exit $rc, want 1"
    fails=$((fails + 1))
fi
want "one failure, nothing skipped" '^- result: \*\*FAIL\*\*: [0-9]+ passed, 1 failed, 0 skipped'

want "a row for the build" '^\| build GPU programs \(nvcc\) \| both \| - \| - \| \*\*PASS\*\*'
want "alloc_sizes passes" '^\| alloc_sizes \| static \| 0 \| 0 \| \*\*PASS\*\*'
want "hook stats split the syncs" '^\| alloc_sizes \| static \| 0 \| 0 \| \*\*PASS\*\* .*syncs 130 \(2 blocking, 128 background\)'
want "two_ctx: the difference fails" '^\| two_ctx \| static \| 0 \| 0 \| \*\*FAIL\*\* \| R lines differ'
want "capture passes" '^\| capture \| static \| 0 \| 0 \| \*\*PASS\*\*'
want "fork_churn passes" '^\| fork_churn \| static \| 0 \| 0 \| \*\*PASS\*\*'
want "mallocasync_after_free passes" '^\| mallocasync_after_free \| static \| 0 \| 0 \| \*\*PASS\*\*'
want "pause_resume passes (native skips)" '^\| pause_resume \[defaults\] \| static \| 77 \| 0 \| \*\*PASS\*\*'
want "holes_gpu passes (native skips)" '^\| holes_gpu \[defaults\] \| static \| 77 \| 0 \| \*\*PASS\*\*'
want "holes_gpu row" '^\| holes_gpu \(issue 27.* INFO \| 10240 x 2 MiB'
want "pause_resume timings row" '^\| pause_resume timings .* INFO \| 1 met; misses: backup.first_pause_rate'
want "overflow_gpu passes (native skips)" '^\| overflow_gpu \[VMMHOOK_OVERFLOW=host\] \| static \| 77 \| 0 \| \*\*PASS\*\*'
want "overflow_gpu timings row" '^\| overflow_gpu timings .* INFO \| spilled_kernel_read=47.00GiB/s \(40 MET\); prefetch_back=30.00GiB/s \(40 MISS\)'
want "the sleep table" '^\| backup.first_pause_rate \| 5.000 GiB/s \| >=8.000 \| MISS \|'
want "torch_overflow_sum rows" '^\| torch_overflow_sum nocache .* \| python \| - \| 0 \| \*\*PASS\*\* \| I spilled 42.00 GiB.*T sum_rate_nocache 150.0 GiB/s 100 MET'
want "torch_sleep passes" '^\| torch_sleep .* \*\*PASS\*\*'
want "torch_varlen runs pass" '^\| torch_varlen runs \(expandable native, nocache hooked\) \| python \| 0 \| 0 \| \*\*PASS\*\*'
want "torch_varlen memory row judges both targets" '^\| torch_varlen memory \(issue 27\) \| python \| 0 \| 0 \| \*\*PASS\*\* \| PASS peak: .*1907 MiB.*2003 MiB.*PASS drop: .*ratio 1.050'
want "torch_graph passes" '^\| torch_graph .* \| python \| 0 \| 0 \| \*\*PASS\*\*'
want "torch_step row" '^\| torch_step \(big model, step time, 3 runs\) .* \*\*PASS\*\* \| median ms: hook\(off\) 35.10, native on 18.20, native off 60.00; hook/on 1.93x \(<=1.00 MISS\)'
want "torch_step_small row" '^\| torch_step_small \(small model, step time, 3 runs\) .* \*\*PASS\*\* \| .*hook/on 1.93x \(<=1.05 MISS\)'
want "torch_step table" '^\| caching off, hook \| 35.10 \(34.00-40.00\) \| 1.93x \| syncs 0.50, syncs_blocking 0.20 \| 0.0150 \(12 allocations a step\)'
want "blocking syncs from syncs_blocking" '^\| blocking synchronizations per step: 0 \(syncs_blocking\) \| 0.20 \| MISS \|'
want "quickstart row" '^\| quickstart \(issue 17\) .* \*\*PASS\*\*'
want "bench row with the 16-thread figures" '^\| bench \(run-bench.sh\) .* \*\*PASS\*\* .*16-thread churn steps/s: native 50000, async 100000, hook 150000 \(hook/async 1.5'
want "bench target hook vs async on 16 threads" 'churn16.hook_over_async_steps_per_s>1 \| 1.50x \| > 1x \| PASS'
want "step times" '^## Step times'
want "commit recorded" '^- commit: selftest'
want "date recorded" '^- date: 20[0-9][0-9]-'
if grep -nE 'command not found|syntax error|unbound variable|No such file or directory.*gpu-suite' "$tmp/suite.log"; then
    echo "FAIL: shell errors in the suite's log (above)"
    fails=$((fails + 1))
fi
if [ "$fails" -gt 0 ]; then
    echo "--- the summary:"
    head -80 "$sum" 2>/dev/null
    echo "--- the end of the suite's log:"
    tail -30 "$tmp/suite.log"
    echo "FAIL: gpu-suite selftest ($fails checks failed)"
    exit 1
fi
echo "PASS: gpu-suite selftest"
exit 0
