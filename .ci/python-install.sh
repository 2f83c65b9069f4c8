#!/usr/bin/env bash
# CI: the Python package installed the two ways a user installs it, on a machine without a GPU
# and without PyPI (Debian's packages only):
#   (a) README.md's Python install block, run as written (issue 37): the block after the line
#       '<!-- .ci/python-install.sh runs the next block ... -->' is run in one bash, line by
#       line, from this clone's top directory, with HOME a fresh temporary directory (so its
#       `~/.venvs/vmmhook` is a fresh virtual environment; when run as root a leading `sudo ` is
#       dropped, nothing else is changed). It names the apt packages (python3-mesonpy,
#       python3-venv, ...), makes a venv with --system-site-packages from Debian's
#       /usr/bin/python3 and runs `pip install --no-build-isolation .` there (meson-python
#       builds libvmmhook.so and vmmhook-config into the package). Then, from another
#       directory with no variable set, that venv's `import vmmhook` must report a library
#       path inside the venv's package that exists, `available()` must be True, and
#       `python -m vmmhook --check` runs the packaged launcher;
#   (b) meson install: `meson install --destdir` of a build of this tree, then the import from
#       the staged site directory with the system Python (tests/python/test-install.sh, which
#       also checks that directory is one the system Python searches under the prefix).
# Why the README does it that way (PEP 668's externally-managed-environment, Debian's
# python3-mesonpy importable only by /usr/bin/python3, no PyPI): README.md, "Python".
# (a) runs the README's apt-get lines first, before anything here installs a package, so that
# they are what makes a fresh Debian 12 able to build the package. About 1.5 minutes for (a) on
# 2 busy cores (measured here, the wheel build compiles the library only), then (b) builds the
# tree without its tests.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "ci: == (a) README.md's Python install block, as written, in a fresh HOME =="
marker='<!-- .ci/python-install.sh runs the next block'
# The first ```sh block after the marker line, its backslash-continued lines joined.
awk -v m="$marker" '
  index($0, m) == 1 { found = 1; next }
  found == 1 && /^```sh[[:space:]]*$/ { found = 2; next }
  found == 2 && /^```[[:space:]]*$/ { exit }
  found == 2 { print }' README.md |
  awk '{ if (sub(/\\$/, "")) { held = held $0; next } print held $0; held = "" }' >"$work/block"
[ -s "$work/block" ] || { echo "ci: FAIL: no sh block after '$marker' in README.md"; exit 1; }
grep -q -- '--no-build-isolation' "$work/block" ||
  { echo "ci: FAIL: README's install block has no pip install:"; cat "$work/block"; exit 1; }
# Each line echoed, then run as written (the same shell: an activated venv stays active).
{
  echo 'set -eo pipefail'
  while IFS= read -r line; do
    case $line in '' | '#'*) continue ;; esac
    [ "$(id -u)" -eq 0 ] && line=${line#sudo }
    printf 'printf "%%s\\n" %q\n' "ci: README \$ $line"
    printf '%s\n' "$line"
  done <"$work/block"
  # What the block left active, for the checks below.
  printf 'command -v python >%q\n' "$work/python"
} >"$work/block.sh"
mkdir "$work/home"
HOME=$work/home DEBIAN_FRONTEND=noninteractive bash "$work/block.sh" ||
  { echo "ci: FAIL: README.md's Python install block failed (above)"; exit 1; }
vpy=$(cat "$work/python")
case $vpy in
  "$work/home/"*) ;;
  *) echo "ci: FAIL: after the README's block, python is $vpy, not the fresh venv's"; exit 1 ;;
esac
"$vpy" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' ||
  { echo "ci: FAIL: $vpy is not a virtual environment's"; exit 1; }

# Another directory, no variable: the package must find its own library.
out=$(cd "$work" && env -u LIBVMMHOOK -u LD_PRELOAD "$vpy" -c \
  'import vmmhook; print(vmmhook.library_path()); print(vmmhook.available())')
echo "$out"
lib=$(printf '%s\n' "$out" | sed -n 1p)
site=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
[ "$lib" = "$site/vmmhook/libvmmhook.so" ] || { echo "ci: FAIL: library_path() is $lib, not in $site/vmmhook"; exit 1; }
[ -f "$lib" ] || { echo "ci: FAIL: library_path() $lib does not exist"; exit 1; }
[ "$(printf '%s\n' "$out" | sed -n 2p)" = True ] || { echo "ci: FAIL: available() is not True"; exit 1; }
(cd "$work" && env -u LD_PRELOAD "$vpy" -m vmmhook --cache-limit 2G --check) |
  grep -qE '^ +VMMHOOK_CACHE_LIMIT +=  *2G$' || { echo "ci: FAIL: python -m vmmhook --check"; exit 1; }
# The wheel build built no tests, tools or GPU programs: its files are the package's only.
extra=$("$vpy" -m pip show -f vmmhook | sed -n '/^Files:/,$p' | tail -n +2 |
  grep -v -e 'vmmhook/' -e 'vmmhook-0\..*dist-info/' || true)
[ -z "$extra" ] || { echo "ci: FAIL: the wheel installed files outside the package: $extra"; exit 1; }

# (b) needs meson and ninja (the README's python3-mesonpy brought them; checked all the same).
need=()
command -v meson >/dev/null || need+=(meson)
command -v ninja >/dev/null || need+=(ninja-build)
if [ ${#need[@]} -gt 0 ]; then
  echo "ci: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi

echo "ci: == (b) meson install --destdir, imported with the system Python =="
meson setup "$work/build" -Dunit_tests=disabled -Dgpu_tests=disabled -Dfuzz=disabled >/dev/null
meson compile -C "$work/build" >/dev/null  # meson install needs every installed target
meson test -C "$work/build" --no-rebuild python-install --print-errorlogs
echo "ci: python install: passed"
