"""mooncake._torch_ext: naming and loading of torch-versioned extension modules
(pure Python: needs neither torch nor a build), and ``python -m mooncake.pg
--report`` (needs both)."""

import sys

import pytest

from mooncake._torch_ext import load_torch_extension, torch_version_suffix


@pytest.mark.parametrize(
    "version, suffix",
    [
        ("2.11.0+cu130", "2_11_0"),
        ("2.11.0", "2_11_0"),
        ("2.4.1a0", "2_4_1"),
        ("2.6.0.dev20241112+cpu", "2_6_0"),
        ("10.0.12", "10_0_12"),
    ],
)
def test_torch_version_suffix(version, suffix):
    assert torch_version_suffix(version) == suffix


@pytest.mark.parametrize("version", ["", "2", "2.11", "v2.11.0", "2.x.0", "abc", " 2.11.0", "2..0"])
def test_torch_version_suffix_malformed(version):
    with pytest.raises(ValueError):
        torch_version_suffix(version)


def test_load_missing_build_names_the_version():
    torch_loaded = "torch" in sys.modules
    with pytest.raises(ImportError) as info:
        load_torch_extension("pg", torch_version="9.9.9")
    message = str(info.value)
    assert "was not built against torch==9.9.9" in message
    assert "mooncake.pg_9_9_9" in message
    # With the version given, torch itself is not imported.
    assert ("torch" in sys.modules) == torch_loaded


def test_load_with_malformed_version():
    with pytest.raises(ValueError):
        load_torch_extension("pg", torch_version="nightly")


def _report(*args):
    import subprocess

    return subprocess.run([sys.executable, "-m", "mooncake.pg", "--report", *args], capture_output=True, text=True,
                          timeout=120)


def test_pg_report_says_what_was_built_and_that_it_loads():
    import torch

    done = _report()
    assert done.returncode == 0, done.stdout + done.stderr
    suffix = torch_version_suffix(torch.__version__)
    assert f"torch: {torch.__version__}" in done.stdout
    assert f"wanted for torch {torch.__version__}: pg_{suffix}" in done.stdout
    assert f"pg_{suffix}" in done.stdout.split("built: ")[1].splitlines()[0]
    assert "loads: yes" in done.stdout and "SUPPORT_MULTI_PROTOCOL=True" in done.stdout


def test_pg_report_says_why_a_torch_without_a_build_cannot_load():
    done = _report("--torch-version", "0.0.1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "wanted for torch 0.0.1: pg_0_0_1" in done.stdout
    assert "loads: no: ImportError: Mooncake PG was not built against torch==0.0.1" in done.stdout
    assert "pip install ." in done.stdout
