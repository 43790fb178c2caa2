#!/usr/bin/env bash
# python-tests.sh — build the Python extension and run the Python tests (tests/python).
#
# For CI (fresh clone, no GPU, PyPI reachable) and developers alike: creates a virtual
# environment under the build directory, installs the pinned test dependencies, builds flare and
# the extension module with CMake (CPU only: the CUDA kernels are built and tested elsewhere),
# and runs pytest with PYTHONPATH pointing at the build tree. Exits non-zero on any failure,
# including a pytest run that collected no tests.
#
# Environment: FLARE_PY_BUILD_DIR (default build-python), PYTHON (default python3),
# FLARE_PY_JOBS (default 2). Extra arguments go to pytest.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${FLARE_PY_BUILD_DIR:-$root/build-python}"
python="${PYTHON:-python3}"
jobs="${FLARE_PY_JOBS:-2}"

# Pinned so a CI run today and one next month test the same thing.
deps=(numpy==2.4.6 pytest==8.4.2 nanobind==3.1.0)

venv="$build/venv"
if [[ ! -x "$venv/bin/python" ]]; then
  echo "python-tests: creating $venv"
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${deps[@]}"

generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
if [[ ! -f "$build/CMakeCache.txt" ]]; then
  cmake -S "$root" -B "$build" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DFLARE_CUDA=OFF \
    -DFLARE_BUILD_TESTS=OFF \
    -DFLARE_BUILD_APPS=OFF \
    -DFLARE_BUILD_PYTHON=ON \
    -DPython_EXECUTABLE="$venv/bin/python"
fi
cmake --build "$build" -j "$jobs"

cd "$root"
set +e
PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" \
  "$venv/bin/python" -m pytest tests/python -p no:cacheprovider -ra "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "python-tests: pytest collected no tests; counting that as a failure" >&2
  exit 1
fi
exit $rc
