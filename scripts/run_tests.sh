#!/usr/bin/env bash
# Sets up a fresh machine (scripts/setup.sh), then runs every test: the C++
# suites through CTest and the Python suites through pytest. Each test has a
# hard timeout, so a hang fails instead of blocking.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
scripts/setup.sh

echo "== C++ tests (ctest)"
ctest --test-dir build --output-on-failure -j2 --timeout 300

echo "== Python tests (pytest)"
PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m pytest -q -ra tests/python
