#!/usr/bin/env bash
# Sets up a fresh machine (scripts/setup.sh), then runs the main job: a
# data-parallel training demo on the "mooncake-cpu" torch.distributed
# backend, launched through torchrun with 4 ranks (scripts/pg_demo.py).
# scripts/te_demo.py is the transfer engine's own three-process demo.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
scripts/setup.sh
port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m torch.distributed.run \
  --nproc_per_node="${NPROC:-4}" --master_addr=127.0.0.1 --master_port="$port" scripts/pg_demo.py "$@"
