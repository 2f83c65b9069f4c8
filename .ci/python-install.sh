#!/usr/bin/env bash
# CI: the Python package installed the two ways a user installs it, on a machine without a GPU
# and without PyPI (Debian's packages only):
#   (a) pip: a fresh virtual environment, `pip install --no-build-isolation .` from this clone
#       (meson-python builds libvmmhook.so and vmmhook-config into the package), then
#       `import vmmhook` from another directory finds the library with no variable set, and
#       `python -m vmmhook --check` runs the packaged launcher;
#   (b) meson install: `meson install --destdir` of a build of this tree, then the import from
#       the staged site directory with the system Python (tests/python/test-install.sh, which
#       also checks that directory is one the system Python searches under the prefix).
# The virtual environment has --system-site-packages because the build backend is Debian's
# python3-mesonpy (and its pyproject-metadata), installed for the system Python: with
# --no-build-isolation pip uses the environment's packages, and PyPI is not reachable to fetch
# meson-python into an isolated one. The package itself needs nothing from the system site.
# About 1.5 minutes on 2 busy cores (measured here) (the wheel build compiles the library only; (b) builds the tree
# without its tests).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

need=()
command -v meson >/dev/null || need+=(meson)
command -v ninja >/dev/null || need+=(ninja-build)
python=/usr/bin/python3 # the system Python: Debian's python3-mesonpy is installed for it
[ -x "$python" ] || python=$(command -v python3)
"$python" -c 'import mesonpy' 2>/dev/null || need+=(python3-mesonpy)
"$python" -c 'import ensurepip' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  echo "ci: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "ci: == (a) pip install --no-build-isolation . into a fresh virtual environment =="
"$python" -m venv --system-site-packages "$work/venv"
"$work/venv/bin/python" -m pip install --no-build-isolation --no-index --no-deps \
  --disable-pip-version-check -q "$root"
# Another directory, no variable: the package must find its own library.
out=$(cd "$work" && env -u LIBVMMHOOK -u LD_PRELOAD "$work/venv/bin/python" -c \
  'import vmmhook; print(vmmhook.library_path()); print(vmmhook.available())')
echo "$out"
lib=$(printf '%s\n' "$out" | sed -n 1p)
site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
[ "$lib" = "$site/vmmhook/libvmmhook.so" ] || { echo "ci: FAIL: library_path() is $lib, not in $site/vmmhook"; exit 1; }
[ "$(printf '%s\n' "$out" | sed -n 2p)" = True ] || { echo "ci: FAIL: available() is not True"; exit 1; }
(cd "$work" && env -u LD_PRELOAD "$work/venv/bin/python" -m vmmhook --cache-limit 2G --check) |
  grep -qxF '  VMMHOOK_CACHE_LIMIT  = 2G' || { echo "ci: FAIL: python -m vmmhook --check"; exit 1; }
# The wheel build built no tests, tools or GPU programs: its files are the package's only.
extra=$("$work/venv/bin/python" -m pip show -f vmmhook | sed -n '/^Files:/,$p' | tail -n +2 |
  grep -v -e 'vmmhook/' -e 'vmmhook-0\..*dist-info/' || true)
[ -z "$extra" ] || { echo "ci: FAIL: the wheel installed files outside the package: $extra"; exit 1; }

echo "ci: == (b) meson install --destdir, imported with the system Python =="
meson setup "$work/build" -Dunit_tests=disabled -Dgpu_tests=disabled -Dfuzz=disabled >/dev/null
meson compile -C "$work/build" >/dev/null  # meson install needs every installed target
meson test -C "$work/build" --no-rebuild python-install --print-errorlogs
echo "ci: python install: passed"
