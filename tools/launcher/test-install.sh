#!/bin/sh
# meson install into a staging directory, then the installed tools must work from there
# (meson test --suite tools): the launcher finds the installed library and vmmhook-config next
# to itself, --check resolves the options, the documentation (OPTIONS.md, PYTORCH.md, LICENSE)
# is installed, and run-bench.sh (when the GPU tools are built) finds the installed library.
#   test-install.sh BUILD_DIR PREFIX
set -eu
build=$1
prefix=$2
fail() {
    printf 'FAIL: %s\n' "$*" >&2
    exit 1
}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
meson install -C "$build" --no-rebuild --quiet --destdir "$stage" >"$stage/install.log" 2>&1 ||
    { cat "$stage/install.log" >&2; fail "meson install failed"; }
root=$stage$prefix

launcher=$root/bin/vmmhook
[ -x "$launcher" ] || fail "no installed launcher at $launcher"
[ -x "$root/bin/vmmhook-config" ] || fail "no installed vmmhook-config"
lib=$(find "$root" -name libvmmhook.so -type f | head -1)
[ -n "$lib" ] || fail "no installed libvmmhook.so under $root"
lib=$(cd "$(dirname "$lib")" && pwd)/libvmmhook.so

out=$(env -u LD_PRELOAD "$launcher" --cache-limit 2G --check) || fail "--check failed: $out"
printf '%s\n' "$out" | grep -qx '  VMMHOOK_CACHE_LIMIT  *= 2G' || fail "--check output: $out"
out=$(env -u LD_PRELOAD "$launcher" -n --stats -- /bin/true) || fail "dry run failed: $out"
printf '%s\n' "$out" | grep -qxF "LD_PRELOAD=$lib" ||
    fail "the installed launcher does not preload the installed library $lib: $out"
out=$(env -u LD_PRELOAD "$launcher" --stats -- /bin/sh -c 'echo "P=$LD_PRELOAD"') ||
    fail "running under the installed launcher failed"
[ "$out" = "P=$lib" ] || fail "the program saw $out"
"$launcher" --help | grep -q -- '--park-limit=SIZE' || fail "installed --help lacks --park-limit"

doc=$root/share/doc/libvmmhook
for f in docs/OPTIONS.md docs/PYTORCH.md docs/SLEEP.md LICENSE README.md BENCHMARKS.md; do
    [ -f "$doc/$f" ] || fail "$doc/$f is not installed"
done
grep -q 'VMMHOOK_PARK_LIMIT' "$doc/docs/OPTIONS.md" || fail "installed OPTIONS.md lacks the table"
"$launcher" --help | grep -qF "$(cd "$doc/docs" && pwd)/OPTIONS.md" ||
    fail "the installed launcher's help does not point at the installed OPTIONS.md"
# Every relative link of the installed pages leads to an installed file (issue 22).
broken=$(cd "$doc" && for f in *.md docs/*.md; do
    grep -o '](\([^)#:]*\)[)#]' "$f" | sed 's/^](//; s/[)#]$//' | while read -r target; do
        [ -e "$(dirname "$f")/$target" ] || printf '%s -> %s\n' "$f" "$target"
    done
done)
[ -z "$broken" ] || fail "installed docs link files not installed: $broken"

bench=$root/libexec/vmmhook/run-bench.sh
if [ -f "$bench" ]; then
    # No GPU needed: with a bench binary that prints its environment, the hook run must be
    # given the installed library.
    fake=$stage/fake-bench
    printf '#!/bin/sh\necho "LD_PRELOAD=$LD_PRELOAD"\nexit 0\n' >"$fake"
    chmod +x "$fake"
    out=$(cd "$stage" && BENCH_BIN=$fake bash "$bench" 2>&1 || true)
    printf '%s\n' "$out" | grep -qF "LD_PRELOAD=$lib" ||
        fail "the installed run-bench.sh does not use the installed library: $out"
fi
echo "install: the installed launcher, vmmhook-config, docs${bench:+ and run-bench.sh} work from $root"
