#!/usr/bin/env bash
# The install a user types, checked end to end: `pip wheel .` with build
# isolation (torch comes into the build environment through the build
# backend, build_backend/), the wheel installed into a fresh virtual
# environment, then the quick start on two ranks of "mooncake-cpu" and
# `python -m mooncake.pg --report`, run from outside the source tree so that
# only the installed package can be imported.
#
# The fresh environment sees the system's site-packages for torch only (a
# second copy of torch would be a 3 GB install); mooncake comes from the wheel.
# CUDA is left out of this build (MOONCAKE_WHEEL_CUDA=AUTO keeps it): its
# kernels take long to compile on a small machine and the check is on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/mooncake-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT

echo "wheel_smoke: pip wheel . (isolated build) into $work"
"$PYTHON" -m pip wheel -q --disable-pip-version-check --no-deps . -w "$work/dist" \
  --config-settings=cmake.define.MOONCAKE_WITH_CUDA="${MOONCAKE_WHEEL_CUDA:-OFF}"
"$PYTHON" -m venv --system-site-packages "$work/venv"
"$work/venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-index "$work"/dist/*.whl

cd "$work"
env -u PYTHONPATH "$work/venv/bin/python" - <<'PY'
import os, sys
import mooncake
where = os.path.dirname(mooncake.__file__)
assert where.startswith(sys.prefix), f"mooncake came from {where}, not the fresh environment {sys.prefix}"
print("wheel_smoke: mooncake imported from", where)
PY
env -u PYTHONPATH "$work/venv/bin/python" -m mooncake.pg --report
env -u PYTHONPATH timeout 120 "$work/venv/bin/python" -m torch.distributed.run --nproc-per-node 2 \
  --master-port "${WHEEL_SMOKE_PORT:-29517}" "$OLDPWD/examples/pg_quickstart.py"
echo "wheel_smoke: passed"
