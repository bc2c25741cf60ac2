#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine with Python 3 lacks, then builds
# everything into build/ (extension modules land in python/mooncake/).
# Safe to run again: it installs only what is missing and rebuilds incrementally.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# libibverbs-dev: rdma-core, for the RDMA transport's libibverbs provider.
debian_packages=(build-essential cmake ninja-build ccache pkg-config libgtest-dev libgmock-dev libbenchmark-dev
  libibverbs-dev)
missing=()
for p in "${debian_packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

# Python 3 headers: pyenv/python.org builds ship them; Debian's python3 needs python3-dev.
if ! "$PYTHON" -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
  SUDO=$([ "$(id -u)" -eq 0 ] && echo "" || echo sudo)
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-dev
fi

echo "setup: installing Python packages"
"$PYTHON" -m pip install -q --disable-pip-version-check -r requirements-dev.txt -r requirements.txt

echo "setup: building"
cmake -S . -B build -G Ninja -DPython_EXECUTABLE="$(command -v "$PYTHON")" >build-configure.log 2>&1 || {
  cat build-configure.log
  exit 1
}
rm -f build-configure.log
cmake --build build
