#!/usr/bin/env bash
# Sets up a fresh machine (scripts/setup.sh), then runs the main job: a
# multi-process transfer engine demo (a KV-cache holder and two clients moving
# blocks one-sidedly over shm and tcp, every byte checked).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
scripts/setup.sh
PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" scripts/te_demo.py "$@"
