"""benchmarks/pgbench.py with the reference's flags (issue 19 §2): the backend
follows --device, -d all sweeps every dtype (skipping those the backend does
not reduce, saying so), -C/-S/-J (CPU time, timestamps, a JSON file), and
every row checked (#wrong 0)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.mark.timeout(120)
def test_reference_flags_sweep_every_dtype_into_a_json_file(tmp_path):
    out = tmp_path / "rows.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "python"), os.environ.get("PYTHONPATH", ""))
                                                       if p))
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pgbench.py"), "--collective", "all_reduce",
                           "--device", "cpu", "-g", "2", "-b", "1K", "-e", "4K", "-f", "4", "-n", "2", "-d", "all",
                           "--report_cputime", "--report_timestamps", "--output_file", str(out)],
                          env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "backend=mooncake-cpu" in proc.stdout  # from --device cpu
    rows = json.loads(out.read_text())
    skipped = {line.split()[3] for line in proc.stdout.splitlines() if line.startswith("# -d all:")}
    assert skipped == {"f8e4m3", "f8e5m2"}, proc.stdout  # moved, not reduced
    assert {r["dtype"] for r in rows} == {"int8", "uint8", "int32", "uint32", "int64", "uint64", "half", "float",
                                         "double", "bfloat16"}
    assert {r["bytes"] for r in rows} == {1024, 4096}
    for r in rows:
        assert r["out-of-place"]["wrong"] == 0 and r["in-place"]["wrong"] == 0, r
        assert r["out-of-place"]["time_us"] > 0 and "timestamp" in r, r


@pytest.mark.timeout(120)
def test_the_references_command_line_and_all_gather_sizes(tmp_path):
    """The reference's path (mooncake-pg/benchmark/pgbench.py) with only
    PYTHONPATH=mooncake-pg, and -b meaning the gathered output: 4 KiB of
    float over 2 ranks is 512 elements sent per rank (nccl-tests' rule)."""
    out = tmp_path / "rows.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "mooncake-pg"))
    env.pop("RANK", None)
    proc = subprocess.run([sys.executable, str(ROOT / "mooncake-pg" / "benchmark" / "pgbench.py"), "--collective",
                           "all_gather", "--device", "cpu", "-g", "2", "-b", "4K", "-e", "4K", "-n", "2",
                           "-J", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["bytes"] == 4096 and row["count"] == 512, row
    assert row["out-of-place"]["wrong"] == 0 and row["in-place"]["wrong"] == 0, row
