#!/usr/bin/env python3
"""The reference's command line for its benchmark,

    PYTHONPATH=mooncake-pg python mooncake-pg/benchmark/pgbench.py --collective all_reduce ...

runs this project's benchmarks/pgbench.py (same flags, same output). The
package is found in ../../python when it is not installed."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
for path in (ROOT / "benchmarks", ROOT / "python"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import pgbench  # noqa: E402 - the path above first

if __name__ == "__main__":
    sys.exit(pgbench.main())
