"""Loading of extension modules that are built against torch.

Such a module carries the torch version in its name, ``mooncake.<component>_<major>_<minor>_<patch>``
(``pg_2_11_0`` for torch 2.11.0+cu130), because its ABI is tied to that torch:
builds for several torch versions can sit side by side, and the one matching
the running torch is picked. ``cmake/MooncakeTorch.cmake`` applies the same
naming rule at build time; keep the two in step.
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType

_VERSION_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)")

REBUILD_COMMAND = "pip install . (builds against the installed torch; or: scripts/build.sh)"


def torch_version_suffix(version: str) -> str:
    """``"2.11.0+cu130"`` -> ``"2_11_0"``; raises ValueError for anything else."""
    match = _VERSION_RE.match(str(version))
    if match is None:
        raise ValueError(f"cannot parse torch version {version!r}: expected 'MAJOR.MINOR.PATCH[...]'")
    return "_".join(match.groups())


def load_torch_extension(component: str, torch_version: str | None = None) -> ModuleType:
    """Import ``mooncake.<component>_<suffix>`` for the running (or given) torch.

    Raises ImportError naming the torch version and the rebuild command when no
    module was built for it.
    """
    if torch_version is None:
        import torch  # noqa: PLC0415 - only the torch-dependent components need it

        torch_version = torch.__version__
    suffix = torch_version_suffix(torch_version)
    name = f"mooncake.{component}_{suffix}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != name:
            raise  # the module exists but something it imports is missing
        raise ImportError(
            f"Mooncake {component.upper()} was not built against torch=={torch_version} "
            f"(no module {name}). Rebuild in this environment: {REBUILD_COMMAND}"
        ) from None
