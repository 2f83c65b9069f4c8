# shellcheck shell=bash
# Sourced by tools/gpu-suite.sh (uses its W, LOG, launch, row, note, tmo, say, rc_of, rcname,
# first_fail): PyTorch step time (issues 14, 21). tests/gpu/torch_step.py three times per model,
# one after the other and alone on the GPU (times are compared): caching off under the hook,
# caching on natively, caching off natively; the big model (~100 ms a step, target 1.00x caching
# on) and the small one (~20 ms, target 1.05x). torch_step_table.py turns their
# STEP/SYNC/CALLS/MEM lines and the hooked run's stats JSON into $W/<prefix>.md (appended to the
# summary) and the row's note.

torch_step_run() {
    torch_step_model torch_step big 1.00
    torch_step_model torch_step_small small 1.05
}

# torch_step_model PREFIX SIZE MAX_OVER
torch_step_model() {
    [ -f tests/gpu/torch_step.py ] || return 0
    local P=$1 size=$2 max_over=$3
    local t runs=(nocache.hooked cache.native nocache.native) r
    t=$(tmo 75 60)
    if [ "$t" = 0 ]; then
        row "$P (step time)" python "-" "-" SKIP "no time left in the budget"
        return 0
    fi
    say "$P ($size): caching off hooked, caching on native, caching off native, one at a time, timeout ${t}s each ($(elapsed) s)"
    for r in "${runs[@]}"; do
        t=$(tmo 75 45)
        [ "$t" = 0 ] && break
        launch "$P.$r" "${r#*.}" "$t" python3 tests/gpu/torch_step.py "${r%.*}" 65 "$size"
        wait
    done
    local res=PASS rcs="" line
    for r in "${runs[@]}"; do
        local rc
        rc=$(rc_of "$P.$r")
        rcs="$rcs $r=$(rcname "$rc")"
        [ "$rc" = 0 ] || res=FAIL
    done
    [ "$(rc_of "$P.cache.native")" = 77 ] && res=SKIP
    python3 tools/gpu-suite/torch_step_table.py "$LOG" "$P" "$max_over" >"$W/$P.md" 2>"$LOG/$P.table.err"
    line=$(sed -n 's/^ROW|//p' "$W/$P.md")
    sed -i '/^ROW|/d' "$W/$P.md"
    row "$P ($size model, step time, 3 runs)" python "$(rcname "$(rc_of "$P.cache.native")")/$(rcname "$(rc_of "$P.nocache.native")")" \
        "$(rcname "$(rc_of "$P.nocache.hooked")")" "$res" "${line:-no figures}; exits:$rcs"
    if [ "$res" = FAIL ]; then
        for r in "${runs[@]}"; do
            echo "--- $r: $(first_fail "$P.$r")"
            tail -5 "$LOG/$P.$r.err" 2>/dev/null
        done | note "$P failures"
    fi
}
