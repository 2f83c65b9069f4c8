# shellcheck shell=bash
# Sourced by tools/gpu-suite.sh (uses its LOG, row, say, rcname): issue 17's "on the H200 the
# README's first command shows the real demo". `bash tools/quickstart` runs as a user would run
# it, from its own build (it is what a new user sees, so it is not pointed at the suite's build),
# in the background while the GPU programs run; quickstart_judge waits for it (bounded) and
# writes the row.

QS_CAP_S=${GPU_SUITE_QUICKSTART_S:-240}

quickstart_start() {
    [ -f tools/quickstart ] || return 0
    say "quickstart: bash tools/quickstart in the background (cap ${QS_CAP_S}s)"
    (
        # cmocka packed by shared/tools/gpu-deps, where present: quickstart must not need the
        # network to find it.
        # shellcheck source=/dev/null
        [ -f .gpu-deps/env.sh ] && . .gpu-deps/env.sh
        s=$(date +%s)
        timeout -k 5 "$QS_CAP_S" bash tools/quickstart </dev/null >"$LOG/quickstart.out" 2>&1
        echo $? >"$LOG/quickstart.rc.tmp"
        echo $(($(date +%s) - s)) >"$LOG/quickstart.secs"
        mv "$LOG/quickstart.rc.tmp" "$LOG/quickstart.rc"
    ) &
    # Out of the job table: the suite's plain `wait`s must not wait for it.
    disown $! 2>/dev/null
    QS_STARTED=1
}

# quickstart_wait MAX_WAIT_S: waits up to MAX_WAIT_S for quickstart to end (before the steps
# that need the GPU alone: its demo must not run beside them).
quickstart_wait() {
    [ "${QS_STARTED:-0}" = 1 ] || return 0
    local waited=0 max=$1
    [ -f "$LOG/quickstart.rc" ] || say "waiting up to ${max}s for quickstart to end"
    while [ ! -f "$LOG/quickstart.rc" ] && [ "$waited" -lt "$max" ]; do
        sleep 1
        waited=$((waited + 1))
    done
}

# quickstart_judge MAX_WAIT_S: waits up to MAX_WAIT_S for quickstart to end, then one row.
quickstart_judge() {
    [ "${QS_STARTED:-0}" = 1 ] || return 0
    quickstart_wait "$1"
    if [ ! -f "$LOG/quickstart.rc" ]; then
        row "quickstart (issue 17)" "-" "-" "running" FAIL \
            "still running after the suite's wait ($max s more); last line: $(tail -1 "$LOG/quickstart.out" 2>/dev/null | cut -c1-160)"
        return 0
    fi
    local rc secs res=PASS why=()
    rc=$(cat "$LOG/quickstart.rc")
    secs=$(cat "$LOG/quickstart.secs" 2>/dev/null)
    [ "$rc" = 0 ] || { res=FAIL; why+=("exit $(rcname "$rc")"); }
    # The real demo: the hook's report of a run on the GPU; never the simulated driver's.
    # (lines that only say what it is not, "not simulated", do not count)
    if grep -i 'simulat' "$LOG/quickstart.out" | grep -qviE 'not (on )?(the )?simulat|instead of (the )?simulat'; then
        res=FAIL
        why+=("it ran the SIMULATED demo on a machine with a GPU")
    fi
    if ! grep -qiE 'allocations served|served' "$LOG/quickstart.out"; then
        res=FAIL
        why+=("no hook report (no 'served' line) in its output")
    fi
    # On a GPU it says it runs tools/demo/hello (an ordinary CUDA program) under the hook.
    if ! grep -q 'demo/hello' "$LOG/quickstart.out"; then
        res=FAIL
        why+=("it never said it ran tools/demo/hello (the GPU demo)")
    fi
    local IFS=' '
    row "quickstart (issue 17)" "-" "-" "$(rcname "$rc")" "$res" \
        "${why[*]:+${why[*]}; }${secs:-?} s from a fresh build; last lines: $(grep -v '^\s*$' "$LOG/quickstart.out" | tail -3 | tr '\n' ' ' | cut -c1-220)"
    [ "$res" = FAIL ] && tail -40 "$LOG/quickstart.out" | note "quickstart (end of its output)"
    return 0
}
