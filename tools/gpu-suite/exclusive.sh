# shellcheck shell=bash
# Sourced by tools/gpu-suite.sh (uses its W, LOG, launch, judge, row, info_row, note, tmo, say,
# rc_of, rcname, stats_of, first_fail, and quickstart_wait of quickstart.sh): the programs that
# need the GPU to themselves, one at a time, static cudart only:
#   mallocasync_after_free  (issue 14) takes 70% of the device, then 30% from other allocators;
#   pause_resume            (issue 15) 40 GiB paused and resumed, a second process takes it; its
#                           "T" lines (timings against the issue's targets) become a table;
#   backup_rate             (issue 15) tools/probe/backup_rate.c beside pause_resume: the rate of
#                           the first pause's mechanism (a staging ring into fresh host memory)
#                           and its alternatives, without the library, in the same run;
#   torch_sleep.py          (issue 15) a second process fills the whole GPU while paused;
#   overflow_gpu            (issue 23) the device filled, 4 GiB served from host memory
#                           (VMMHOOK_OVERFLOW=host), moved back by vmm_prefetch; its "T" lines
#                           join the timing table's INFO row;
#   torch_overflow.py       (issue 23) tensors of 1.3x a GPU made smaller by a holder process:
#                           natively out of memory, under the hook with VMMHOOK_OVERFLOW=host
#                           the same R lines as a run on the whole GPU;
#   torch_overflow_sum.py   (issue 29) the whole GPU filled to about 1.3x with tensors, each
#                           summed on the GPU, caching on and off: exact sums, the rate;
#   holes_gpu               (issue 27) chunks inside extents unmapped by the tidy after the
#                           frees, one mapped again; its "I holes:" lines join an INFO row.
# Natively pause_resume and torch_sleep only skip (the API is the hook's): pause_resume's native
# run checks that (a second); torch_sleep's native run is left out (a PyTorch start for a skip).

exclusive_run() {
    local ex=$W/bin/mallocasync_after_free.static t
    quickstart_wait 90
    if [ -x "$ex" ]; then
        t=$(tmo 90 60)
        if [ "$t" = 0 ]; then
            row "mallocasync_after_free" static "-" "-" SKIP "no time left in the budget"
        else
            say "mallocasync_after_free: native, then hooked, alone on the GPU, timeout ${t}s ($(elapsed) s)"
            launch mallocasync_after_free.static.native native "$t" "$ex"
            wait
            launch mallocasync_after_free.static.hooked hooked "$t" "$ex"
            wait
            judge "mallocasync_after_free" static mallocasync_after_free.static.native \
                mallocasync_after_free.static.hooked 0 served 1
        fi
    fi

    if hooked_only pause_resume "pause_resume [defaults]" 150 "the defaults"; then
        pause_table
        backup_probe
    fi

    if hooked_only holes_gpu "holes_gpu [defaults]" 60 "the defaults"; then
        info_row "holes_gpu (issue 27: mapped bytes after the tidy, a hole mapped again)" static "-" \
            "$(rcname "$(rc_of holes_gpu.static.hooked)")" \
            "$(grep -E '^I holes:' "$LOG/holes_gpu.static.hooked.out" 2>/dev/null | cut -c10- | tr '\n' ';')"
    fi

    local ov=$W/bin/overflow_gpu.static
    # VMMHOOK_VERBOSE: each move back logs where its time went (copies, wait, swaps).
    if hooked_only overflow_gpu "overflow_gpu [VMMHOOK_OVERFLOW=host]" 120 \
        "VMMHOOK_OVERFLOW=host" VMMHOOK_OVERFLOW=host VMMHOOK_VERBOSE=1; then
        info_row "overflow_gpu timings (targets of issues 23, 29)" static "-" \
            "$(rcname "$(rc_of overflow_gpu.static.hooked)")" \
            "$(awk '/^T /{printf "%s=%s%s (%s %s); ", $2, $3, $4, $5, $6}' "$LOG/overflow_gpu.static.hooked.out" 2>/dev/null)$(grep -o 'moved [0-9]* bytes of .*\|move back of .*' "$LOG/overflow_gpu.static.hooked.err" 2>/dev/null | tr '\n' ';')"
    fi

    if ! skipped torch && [ -f tests/gpu/torch_overflow.py ] && [ -x "$ov" ]; then
        t=$(tmo 240 60)
        if [ "$t" = 0 ]; then
            row "torch_overflow" python "-" "-" SKIP "no time left in the budget"
        else
            say "torch_overflow: whole GPU, smaller GPU natively, smaller GPU hooked with overflow ($(elapsed) s)"
            launch torch_overflow.large native "$t" python3 tests/gpu/torch_overflow.py large
            wait
            launch torch_overflow.small native "$t" env OVERFLOW_GPU="$ov" python3 tests/gpu/torch_overflow.py small
            wait
            launch torch_overflow.hooked hooked "$t" env OVERFLOW_GPU="$ov" VMMHOOK_OVERFLOW=host python3 tests/gpu/torch_overflow.py small-hook
            wait
            judge "torch_overflow (1.3x the GPU, VMMHOOK_OVERFLOW=host, vs the whole GPU)" python \
                torch_overflow.large torch_overflow.hooked 0 any 1
            info_row "torch_overflow natively on the smaller GPU" python "$(rcname "$(rc_of torch_overflow.small)")" "-" \
                "$(grep -E '^(R|I) ' "$LOG/torch_overflow.small.out" 2>/dev/null | tr '\n' ';' | cut -c1-200); hooked: $(grep -E '^I (spilled|prefetch|built)' "$LOG/torch_overflow.hooked.out" 2>/dev/null | tr '\n' ';' | cut -c1-300)"
        fi
    fi

    if ! skipped torch && [ -f tests/gpu/torch_overflow_sum.py ]; then
        overflow_sum_run
    fi

    if ! skipped torch && [ -f tests/gpu/torch_sleep.py ]; then
        t=$(tmo 150 60)
        if [ "$t" = 0 ]; then
            row "torch_sleep" python "-" "-" SKIP "no time left in the budget"
        else
            say "torch_sleep: hooked, alone on the GPU, timeout ${t}s ($(elapsed) s)"
            launch torch_sleep.hooked hooked "$t" env VMMHOOK_PIN_LIMIT=1G python3 tests/gpu/torch_sleep.py
            wait
            local hrc res=PASS st
            hrc=$(rc_of torch_sleep.hooked)
            [ "$hrc" = 0 ] || res=FAIL
            # Without PyTorch or a GPU it skips (77); without the hook it fails (expected hook).
            [ "$hrc" = 77 ] && res=SKIP
            st=$(stats_of torch_sleep.hooked any)
            row "torch_sleep (pause weights+kv, GPU filled, resume)" python "(skips)" "$(rcname "$hrc")" "$res" \
                "$(grep -E '^(R|SKIP:) ' "$LOG/torch_sleep.hooked.out" | sed 's/^R //' | tr '\n' ';' | cut -c1-300)$([ "$res" = FAIL ] && echo " $(first_fail torch_sleep.hooked)") [${st##*|}]"
            [ "$res" = FAIL ] && { tail -20 "$LOG/torch_sleep.hooked.out"; tail -20 "$LOG/torch_sleep.hooked.err"; } |
                note "torch_sleep (hooked, end)"
        fi
    fi
}

# torch_overflow_sum.py, caching on and off, each alone on the whole GPU under the hook with
# VMMHOOK_OVERFLOW=host: a row each (its PASS/FAIL line: exact sums, something spilled) with its
# T line (the rate over all tensors against issue 29's 100 GiB/s) and its I lines.
overflow_sum_run() {
    local v t hrc res id
    for v in cache nocache; do
        id=torch_overflow_sum.$v
        t=$(tmo 90 60)
        if [ "$t" = 0 ]; then
            row "torch_overflow_sum $v" python "-" "-" SKIP "no time left in the budget"
            continue
        fi
        say "torch_overflow_sum $v: hooked (VMMHOOK_OVERFLOW=host), alone on the GPU," \
            "timeout ${t}s ($(elapsed) s)"
        launch "$id" hooked "$t" env VMMHOOK_OVERFLOW=host \
            python3 tests/gpu/torch_overflow_sum.py "$v"
        wait
        hrc=$(rc_of "$id")
        res=FAIL
        [ "$hrc" = 0 ] && grep -q '^PASS' "$LOG/$id.out" && res=PASS
        [ "$hrc" = 77 ] && res=SKIP
        row "torch_overflow_sum $v (1.3x the GPU summed, VMMHOOK_OVERFLOW=host)" python "-" \
            "$(rcname "$hrc")" "$res" \
            "$(grep -E '^(T|I|FAIL|SKIP:) ' "$LOG/$id.out" 2>/dev/null | tr '\n' ';' | cut -c1-400)$([ "$res" = FAIL ] && echo " $(first_fail "$id")")"
    done
}

# A program that only runs under the hook (natively it skips, which its native run checks in a
# few seconds), static cudart, alone on the GPU: hooked_only NAME TITLE CAP WHAT [VAR=VALUE...]
# (the variables set for the hooked run). False when it was not run (not built, no time).
hooked_only() {
    local name=$1 title=$2 cap=$3 what=$4 bin=$W/bin/$1.static t
    shift 4
    [ -x "$bin" ] || return 1
    t=$(tmo "$cap" 60)
    if [ "$t" = 0 ]; then
        row "$name" static "-" "-" SKIP "no time left in the budget"
        return 1
    fi
    say "$name: hooked ($what), alone on the GPU, timeout ${t}s ($(elapsed) s)"
    launch "$name.static.native" native 30 "$bin"
    wait
    launch "$name.static.hooked" hooked "$t" env "$@" "$bin"
    wait
    judge "$title" static "$name.static.native" "$name.static.hooked" 77 served 0
}

# The "T name value unit target verdict" lines of pause_resume: a table for the summary
# ($W/pause.md) and an INFO row with the misses.
pause_table() {
    local out=$LOG/pause_resume.static.hooked.out
    grep -q '^T ' "$out" 2>/dev/null || return 0
    {
        echo "| timing | value | target | verdict |"
        echo "| --- | --- | --- | --- |"
        awk '/^T /{printf "| %s | %s %s | %s | %s |\n", $2, $3, $4, $5, $6}' "$out"
        echo
        echo "Pinned copy rate of this run and the details:"
        echo
        grep -E '^I (pinned|bk cycle|pr40m|pr2m|tag|ballast|cudaHostAlloc)' "$out" | cut -c3- | sed 's/^/    /'
    } >"$W/pause.md"
    local met miss
    met=$(grep -c '^T .* MET$' "$out")
    miss=$(grep '^T .* MISS$' "$out" | awk '{printf "%s=%s%s (%s); ", $2, $3, $4, $5}')
    info_row "pause_resume timings (targets of issues 15, 22)" static "-" "$(rcname "$(rc_of pause_resume.static.hooked)")" \
        "$met met; misses: ${miss:-none} (table below)"
}

# tools/probe/backup_rate.c (8 GiB device to fresh host memory, several ways): an INFO row with
# its rates, to compare the library's first pause (pause_resume's first_pause line) with the
# mechanism it copies through, measured in the same run.
backup_probe() {
    local bin=$W/bin/backup_rate t
    gcc -O2 -o "$bin" tools/probe/backup_rate.c -I"${CUDA_HOME:-/usr/local/cuda}/include" \
        -lcuda -lpthread >"$LOG/backup_rate.build" 2>&1 || {
        info_row "backup_rate probe" static "-" "-" "did not build: $(tail -1 "$LOG/backup_rate.build")"
        return 0
    }
    t=$(tmo 60 30)
    [ "$t" = 0 ] && return 0
    say "backup_rate probe: alone on the GPU, timeout ${t}s ($(elapsed) s)"
    timeout "$t" "$bin" 8 >"$LOG/backup_rate.out" 2>&1
    info_row "backup_rate probe (8 GiB, GiB/s)" static "$(rcname $?)" "-" \
        "$(awk '/GiB\/s/{printf "%s %s; ", $1, $2}' "$LOG/backup_rate.out")"
}
