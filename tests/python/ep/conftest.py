"""The EP tests reuse the process-group tests' multi-process scaffolding
(``tests/python/pg/_harness.py``): put that folder on the import path, here
and (through multiprocessing's spawn, which copies sys.path) in every rank."""

import pathlib
import sys

PG_TESTS = str(pathlib.Path(__file__).resolve().parents[1] / "pg")
if PG_TESTS not in sys.path:
    sys.path.insert(0, PG_TESTS)
