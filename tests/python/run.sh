#!/usr/bin/env bash
# The Python module's tests, part of `make test`: `pip install .` through the in-tree build backend (offline,
# nothing downloaded) into $BUILD/python-site, building in $BUILD/python-module (kept, so a later run only
# rebuilds what changed), then pytest on tests/python with that folder on PYTHONPATH. Extra arguments go to
# pytest. The interpreter: $PYTHON, else the first of python3 and /usr/bin/python3 that has pytest, NumPy,
# FastAPI and httpx, else the first with pytest (the Debian packages of scripts/setup.sh belong to
# /usr/bin/python3; a pyenv python3 on PATH usually lacks them).
# `run.sh --interpreter` prints that choice.
set -euo pipefail
cd "$(dirname "$0")/../.."

find_interpreter() {
  local candidate modules
  # First one with every test dependency (else the NumPy and FastAPI tests skip), then one with pytest.
  for modules in "pytest, numpy, fastapi, httpx" "pytest"; do
    for candidate in python3 /usr/bin/python3; do
      if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import $modules" >/dev/null 2>&1; then
        command -v "$candidate"
        return 0
      fi
    done
  done
  return 1
}
if [ "${1:-}" = --interpreter ]; then
  find_interpreter
  exit
fi

BUILD=${BUILD:-build}
PYTHON=${PYTHON:-$(find_interpreter || true)}
if [ -z "$PYTHON" ]; then
  echo "tests/python: no python3 with pytest found; run make setup (it installs python3-pytest)" >&2
  exit 1
fi
site=$(realpath -m "$BUILD/python-site")
rm -rf "$site"
echo "tests/python: pip install . with $PYTHON ($("$PYTHON" --version 2>&1))"
# Warnings are errors here, as in the main build (pip install elsewhere builds without -Werror).
DEEPINFER_PYTHON_CMAKE_ARGS=${DEEPINFER_PYTHON_CMAKE_ARGS:--DDEEPINFER_WERROR=ON} \
  "$PYTHON" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --no-index \
  --target "$site" --config-settings build-dir="$BUILD/python-module" .
PYTHONPATH="$site" "$PYTHON" -m pytest tests/python -q -p no:cacheprovider "$@"
