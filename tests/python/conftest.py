"""Shared setup for the Python tests.

Makes the in-tree package (``python/mooncake``, where the build places the
compiled ``engine`` module) importable even when PYTHONPATH is not set, and
passes it on to the processes the multi-process tests spawn.
"""

import os
import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
PYTHON_DIR = str(REPO_ROOT / "python")

if PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)

# Children started with subprocess (not multiprocessing) see only the
# environment, so put the package there too.
_pythonpath = os.environ.get("PYTHONPATH", "")
if PYTHON_DIR not in _pythonpath.split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (PYTHON_DIR, _pythonpath) if p)
