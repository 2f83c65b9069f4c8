#!/bin/sh
# meson install into a staging directory (DESTDIR), then the Python package from there, with
# the Python this build was set up with (the system's): it is in the site directory that
# Python searches under the prefix, `import vmmhook` from another directory finds the staged
# library (relative to the package: no variable set), and `python -m vmmhook` runs the staged
# launcher. Also python/sitedir.py's choice for the prefixes Debian's Python knows.
#   test-install.sh BUILD_DIR PYTHON PREFIX SITE_DIR SITEDIR_PY
set -eu
build=$1
python=$2
prefix=$3
site=$4
sitedir_py=$5
fail() {
    printf 'FAIL: %s\n' "$*" >&2
    exit 1
}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
meson install -C "$build" --no-rebuild --quiet --destdir "$stage" >"$stage/install.log" 2>&1 ||
    { cat "$stage/install.log" >&2; fail "meson install failed"; }

pkg=$stage$site/vmmhook
[ -f "$pkg/__init__.py" ] || fail "no package at $pkg (meson chose $site)"
for f in __main__.py _paths.py _stats.py _tms.py; do
    [ -f "$pkg/$f" ] || fail "$pkg/$f is not installed"
done
lib=$(find "$stage$prefix" -name libvmmhook.so -type f | head -1)
[ -n "$lib" ] || fail "no installed libvmmhook.so under $stage$prefix"

# The site directory is one this Python searches (a prefix it never searches is said at setup).
case $prefix in
/usr | /usr/local)
    "$python" -c 'import sys; sys.exit(0 if sys.argv[1] in sys.path else 1)' "$site" ||
        fail "$python does not search $site (sys.path: $("$python" -c 'import sys; print(sys.path)'))"
    ;;
esac

# From another directory, with only PYTHONPATH pointing at the staged site directory.
out=$(cd / && env -u LD_PRELOAD -u LIBVMMHOOK PYTHONPATH="$stage$site" "$python" -c \
    'import vmmhook; print(vmmhook.__file__); print(vmmhook.library_path()); print(vmmhook.available())') ||
    fail "import from the staged site directory failed: $out"
[ "$(printf '%s\n' "$out" | sed -n 1p)" = "$pkg/__init__.py" ] || fail "imported another vmmhook: $out"
[ "$(printf '%s\n' "$out" | sed -n 2p)" = "$lib" ] || fail "library_path() is not the staged $lib: $out"
[ "$(printf '%s\n' "$out" | sed -n 3p)" = "True" ] || fail "available() is not True: $out"

# python -m vmmhook: the staged launcher, with the staged library.
out=$(cd / && env -u LD_PRELOAD -u LIBVMMHOOK PYTHONPATH="$stage$site" "$python" -m vmmhook \
    --cache-limit 2G --check) || fail "python -m vmmhook --check failed: $out"
printf '%s\n' "$out" | grep -qx '  VMMHOOK_CACHE_LIMIT  *= 2G' || fail "--check output: $out"
out=$(cd / && env -u LD_PRELOAD -u LIBVMMHOOK PYTHONPATH="$stage$site" "$python" -m vmmhook \
    --stats -- /bin/sh -c 'echo "P=$LD_PRELOAD S=$VMMHOOK_STATS"') || fail "python -m vmmhook PROGRAM failed"
[ "$out" = "P=$lib S=1" ] || fail "the program saw: $out"
err=$(cd / && env -u LD_PRELOAD PYTHONPATH="$stage$site" "$python" -m vmmhook --stats 2>&1 >/dev/null) &&
    fail "python -m vmmhook without a program succeeded"
printf '%s\n' "$err" | grep -q '^python -m vmmhook: no program to run' || fail "no-program message: $err"

# sitedir.py for the prefixes of a Debian system Python: /usr is meson's own choice,
# /usr/local is where site.py looks (lib/python3.X/dist-packages, not lib/python3/...).
if "$python" -c 'import sysconfig, sys; sys.exit(0 if "deb_system" in sysconfig.get_scheme_names() else 1)'; then
    v=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    got=$("$python" "$sitedir_py" /usr /usr/lib/python3/dist-packages /usr/lib/x86_64-linux-gnu /usr/bin | sed -n 1p)
    [ "$got" = /usr/lib/python3/dist-packages ] || fail "sitedir for /usr: $got"
    got=$("$python" "$sitedir_py" /usr/local /usr/local/lib/python3/dist-packages /usr/local/lib /usr/local/bin | sed -n 1p)
    [ "$got" = "/usr/local/lib/python$v/dist-packages" ] || fail "sitedir for /usr/local: $got"
    got=$("$python" "$sitedir_py" /opt/x /opt/x/lib/python3/dist-packages /opt/x/lib /opt/x/bin)
    [ "$(printf '%s\n' "$got" | sed -n 1p)" = /opt/x/lib/python3/dist-packages ] &&
        [ "$(printf '%s\n' "$got" | sed -n 4p)" = not-searched ] || fail "sitedir for /opt/x: $got"
fi
echo "python install: the package in $site works from the staging directory ($python)"
