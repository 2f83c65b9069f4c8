#!/bin/sh
# Mechanical checks of the documentation against the code (meson test --suite tools):
#   1. docs/OPTIONS.md's options table is exactly `vmmhook-config --markdown` (the table in
#      src/util/options_table.c): names, launcher flags, defaults, forms, text; its stats fields are
#      `vmmhook-config --stats-fields` (src/util/stats.h's counters and gauges);
#   2. every VMMHOOK_* name written anywhere in README.md and docs/*.md is an option of the table
#      (a renamed or removed option leaves no stale mention);
#   3. a table row "| `VMMHOOK_X` | `default` |" anywhere else states the table's default;
#   4. README.md's list of interposed entry points (between its markers) equals the cu* and dlsym
#      symbols that the built libvmmhook.so exports, when $3 (the library) is given.
#
#   check-docs.sh VMMHOOK_CONFIG SOURCE_ROOT [LIBVMMHOOK_SO] [--update]
# --update rewrites the generated parts in place instead of failing (meson compile -C build
# update-docs runs it so).
set -eu
config=$1
root=$2
lib=${3:-}
update=0
for a in "$@"; do [ "$a" = --update ] && update=1; done
[ "$lib" = --update ] && lib=
fail=0
bad() {
    printf 'FAIL: %s\n' "$*" >&2
    fail=1
}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Replaces (or compares) the lines between "<!-- BEGIN $2" and "<!-- END $2" in file $1 with
# the content of file $3.
section() {
    file=$1 tag=$2 want=$3
    awk -v tag="$tag" '
        index($0, "<!-- BEGIN " tag) == 1 { inside = 1; next }
        index($0, "<!-- END " tag) == 1 { inside = 0 }
        inside' "$file" >"$tmp/have"
    grep -q "<!-- BEGIN $tag" "$file" || { bad "$file has no '<!-- BEGIN $tag' marker"; return; }
    if cmp -s "$tmp/have" "$want"; then return; fi
    if [ "$update" = 1 ]; then
        awk -v tag="$tag" -v want="$want" '
            index($0, "<!-- BEGIN " tag) == 1 { print; while ((getline l < want) > 0) print l; skip = 1; next }
            index($0, "<!-- END " tag) == 1 { skip = 0 }
            !skip' "$file" >"$tmp/new"
        cat "$tmp/new" >"$file"
        echo "updated the $tag of $file"
    else
        bad "the $tag of $file differs from the code (run with --update):"
        diff "$tmp/have" "$want" >&2 || true
    fi
}

# 1. The options table.
"$config" --markdown >"$tmp/table"
section "$root/docs/OPTIONS.md" "options table" "$tmp/table"
# ... and the counters and gauges of the stats JSON (src/util/stats.h's table).
"$config" --stats-fields >"$tmp/stats-fields"
section "$root/docs/OPTIONS.md" "stats fields" "$tmp/stats-fields"

# 2. Every VMMHOOK_* name mentioned is an option ("VMMHOOK_*" and "VMMHOOK_X" as placeholders;
# VMMHOOK_GRANULARTY is the misspelling docs/OPTIONS.md shows the warning of).
"$config" --list | cut -d' ' -f1 | sort -u >"$tmp/names"
for f in "$root/README.md" "$root"/docs/*.md; do
    grep -o 'VMMHOOK_[A-Z][A-Z0-9_]*' "$f" | sort -u | while read -r n; do
        case $n in VMMHOOK_X | VMMHOOK_NAME | VMMHOOK_GRANULARTY) continue ;; esac
        grep -qxF "$n" "$tmp/names" || echo "$f: $n"
    done
done >"$tmp/unknown"
[ ! -s "$tmp/unknown" ] || bad "names that are not options of src/util/options_table.c: $(cat "$tmp/unknown")"

# 3. Defaults stated in any other table row.
"$config" --list | while read -r name kind flag; do
    : "$kind" "$flag"
    def=$(grep -F "| \`$name\` |" "$tmp/table" | awk -F' [|] ' '{print $3}')
    for f in "$root/README.md" "$root"/docs/*.md; do
        [ "$f" = "$root/docs/OPTIONS.md" ] && continue
        grep -F "| \`$name\` |" "$f" | awk -F' [|] ' '{print $2}' | while read -r d; do
            [ "$d" = "$def" ] || echo "$f: $name default $d, the table says $def"
        done
    done
done >"$tmp/defaults"
[ ! -s "$tmp/defaults" ] || bad "$(cat "$tmp/defaults")"

# 4. The interposed entry points named in the README.
if [ -n "$lib" ]; then
    nm -D --defined-only "$lib" | awk '$2 == "T" || $2 == "W" { print $3 }' |
        grep -E '^(cu[A-Z]|dlsym$)' | sed 's/@.*//' | sort -u |
        awk '{ printf "`%s`%s", $0, "\n" }' >"$tmp/syms.list"
    # One paragraph, comma separated, as the README writes it.
    paste -sd, "$tmp/syms.list" | sed 's/,/, /g' | fold -s -w 96 | sed 's/ $//' >"$tmp/syms"
    section "$root/README.md" "interposed symbols" "$tmp/syms"
fi

[ "$fail" = 0 ] || exit 1
echo "check-docs: the docs agree with the options table${lib:+ and the exported symbols}"
