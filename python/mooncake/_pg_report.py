"""``python -m mooncake.pg --report``: what was built, against which torch,
and, when ``mooncake.pg`` cannot be loaded, why. Exit status 0 when it
loads, 1 when it does not.

    python -m mooncake.pg --report                         # for the installed torch
    python -m mooncake.pg --report --torch-version 2.9.1   # for another one
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import sys
import traceback


def _built_modules(component: str) -> list[str]:
    package = pathlib.Path(__file__).resolve().parent
    return sorted({p.name.split(".")[0] for p in package.glob(f"{component}_*.*so")})


def _engine_facts() -> list[str]:
    try:
        engine = importlib.import_module("mooncake.engine")
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return [f"mooncake.engine: cannot be loaded: {e}"]
    flags = sorted(name for name in dir(engine) if name.startswith("SUPPORT_"))
    return ["mooncake.engine: " + ", ".join(f"{name}={getattr(engine, name)}" for name in flags)]


def report(torch_version: str | None) -> int:
    from mooncake._torch_ext import REBUILD_COMMAND, load_torch_extension, torch_version_suffix

    lines, loaded = [], False
    try:
        import torch

        lines.append(f"torch: {torch.__version__} at {pathlib.Path(torch.__file__).parent}, "
                     f"CUDA {torch.version.cuda or 'none'}, GPUs visible: {torch.cuda.device_count()}")
    except Exception as e:  # noqa: BLE001
        lines.append(f"torch: cannot be imported: {e}")
        torch = None
    version = torch_version or (torch.__version__ if torch is not None else None)
    built = _built_modules("pg")
    lines.append("built: " + (", ".join(built) if built else f"no mooncake.pg_* module in {pathlib.Path(__file__).parent}"))
    if version is not None:
        try:
            wanted = f"pg_{torch_version_suffix(version)}"
        except ValueError as e:
            wanted = None
            lines.append(f"wanted: {e}")
        if wanted is not None:
            lines.append(f"wanted for torch {version}: {wanted}")
            try:
                module = load_torch_extension("pg", version)
                loaded = True
                lines.append(f"loads: yes ({module.__file__})")
            except Exception as e:  # noqa: BLE001 - the reason is the report
                reason = "".join(traceback.format_exception_only(type(e), e)).strip()
                lines.append(f"loads: no: {reason}")
                if REBUILD_COMMAND not in reason:
                    lines.append(f"rebuild for this torch: {REBUILD_COMMAND}")
    lines += _engine_facts()
    print("\n".join(lines))
    return 0 if loaded else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mooncake.pg", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", action="store_true", help="say what was built and whether it loads")
    parser.add_argument("--torch-version", help="report for this torch version instead of the installed one")
    args = parser.parse_args(argv)
    if not args.report:
        parser.print_help()
        return 2
    return report(args.torch_version)


if __name__ == "__main__":
    sys.exit(main())
