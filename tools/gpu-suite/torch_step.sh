# shellcheck shell=bash
# Sourced by tools/gpu-suite.sh (uses its W, LOG, launch, row, note, tmo, say, rc_of, rcname,
# first_fail): PyTorch step time (issue 14). tests/gpu/torch_step.py three times, one after
# the other and alone on the GPU (times are compared): caching off under the hook, caching on
# natively, caching off natively. torch_step_table.py turns their STEP/SYNC/MEM lines and the
# hooked run's stats JSON into $W/torch_step.md (appended to the summary) and the row's note.

torch_step_run() {
    [ -f tests/gpu/torch_step.py ] || return 0
    local t runs=(nocache.hooked cache.native nocache.native) r
    t=$(tmo 75 60)
    if [ "$t" = 0 ]; then
        row "torch_step (step time)" python "-" "-" SKIP "no time left in the budget"
        return 0
    fi
    say "torch_step: caching off hooked, caching on native, caching off native, one at a time, timeout ${t}s each ($(elapsed) s)"
    for r in "${runs[@]}"; do
        t=$(tmo 75 45)
        [ "$t" = 0 ] && break
        launch "torch_step.$r" "${r#*.}" "$t" python3 tests/gpu/torch_step.py "${r%.*}"
        wait
    done
    local res=PASS rcs="" line
    for r in "${runs[@]}"; do
        local rc
        rc=$(rc_of "torch_step.$r")
        rcs="$rcs $r=$(rcname "$rc")"
        [ "$rc" = 0 ] || res=FAIL
    done
    [ "$(rc_of torch_step.cache.native)" = 77 ] && res=SKIP
    python3 tools/gpu-suite/torch_step_table.py "$LOG" >"$W/torch_step.md" 2>"$LOG/torch_step_table.err"
    line=$(sed -n 's/^ROW|//p' "$W/torch_step.md")
    sed -i '/^ROW|/d' "$W/torch_step.md"
    row "torch_step (step time, 3 runs)" python "$(rcname "$(rc_of torch_step.cache.native)")/$(rcname "$(rc_of torch_step.nocache.native)")" \
        "$(rcname "$(rc_of torch_step.nocache.hooked)")" "$res" "${line:-no figures}; exits:$rcs"
    if [ "$res" = FAIL ]; then
        for r in "${runs[@]}"; do
            echo "--- $r: $(first_fail "torch_step.$r")"
            tail -5 "$LOG/torch_step.$r.err" 2>/dev/null
        done | note "torch_step failures"
    fi
}
