"""The build backend (build_backend/mooncake_build_backend.py): the torch it
puts into an isolated build's requirements is the one installed in the
environment being installed into, so that the module it builds loads there."""

import importlib.util
import pathlib
import re

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("scikit_build_core", reason="scikit-build-core is not installed")

_ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def backend(monkeypatch):
    monkeypatch.chdir(_ROOT)  # scikit-build-core reads ./pyproject.toml
    monkeypatch.delenv("MOONCAKE_BUILD_TORCH", raising=False)
    spec = importlib.util.spec_from_file_location("mooncake_build_backend",
                                                  _ROOT / "build_backend" / "mooncake_build_backend.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_installed_torch_is_required_by_its_release(backend):
    release = re.match(r"^\d+(\.\d+)*", torch.__version__).group(0)  # "2.11.0+cu130" -> "2.11.0"
    assert backend.torch_requirement() == f"torch=={release}"
    assert f"torch=={release}" in backend.get_requires_for_build_wheel()
    assert f"torch=={release}" in backend.get_requires_for_build_editable()


def test_the_environment_variable_picks_another_torch(backend, monkeypatch):
    monkeypatch.setenv("MOONCAKE_BUILD_TORCH", "2.10.1")
    assert backend.torch_requirement() == "torch==2.10.1"


def test_without_an_installed_torch_the_pinned_one_is_used(backend, monkeypatch):
    monkeypatch.setattr(backend, "_installed_torch", lambda: None)
    assert backend.torch_requirement() == f"torch=={backend.PINNED_TORCH}"
    pyproject = (_ROOT / "pyproject.toml").read_text()
    assert f'torch = ["torch=={backend.PINNED_TORCH}"]' in pyproject, "the torch extra and the pin differ"
