"""The typed stubs of the compiled modules (python/mooncake/engine.pyi,
pg.pyi) name exactly what the modules export, class by class, so that a
binding added or renamed without its stub fails here; and code in the
reference's style type-checks against them with `mypy --strict`."""

import ast
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "mooncake"


def _declared(body):
    out = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Assign):
            out.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in out if not n.startswith("_")}


def _stub_names(path):
    tree = ast.parse(path.read_text())
    members = {node.name: _declared(node.body) for node in tree.body if isinstance(node, ast.ClassDef)}
    return _declared(tree.body), members


def _public(obj):
    return {n for n in dir(obj) if not n.startswith("_")}


@pytest.mark.parametrize("module_name,stub", [("mooncake.engine", "engine.pyi"), ("mooncake.pg", "pg.pyi")])
def test_stubs_name_what_the_modules_export(module_name, stub):
    module = pytest.importorskip(module_name, reason="the compiled module is not built")
    names, members = _stub_names(PACKAGE / stub)
    exported = _public(module) - {"annotations"}
    if module_name == "mooncake.pg":
        exported = set(module.__all__)
    assert names == exported, f"in the stub only: {sorted(names - exported)}; in the module only: " \
                              f"{sorted(exported - names)}"
    for cls, declared in members.items():
        runtime = {n for n in vars(getattr(module, cls)) if not n.startswith("_")}  # its own, not inherited
        if module_name == "mooncake.engine" and cls == "TransferEngine" and not module.SUPPORT_CUDA:
            declared = {n for n in declared if not n.endswith("_on_cuda")}  # bound in CUDA builds only
        assert runtime == declared, f"{stub}: class {cls}: in the stub only {sorted(declared - runtime)}, in the " \
                                    f"module only {sorted(runtime - declared)}"


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("mypy") is None and subprocess.run(
    [sys.executable, "-m", "mypy", "--version"], capture_output=True).returncode != 0, reason="mypy is not installed")
def test_reference_style_code_type_checks_strictly():
    env = dict(os.environ, MYPYPATH=str(ROOT / "python"))
    proc = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent", "--no-incremental",
                           str(ROOT / "tests" / "typing" / "reference_style.py"),
                           str(ROOT / "examples" / "pg_quickstart.py")], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
