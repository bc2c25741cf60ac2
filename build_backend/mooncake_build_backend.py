"""The package's build backend: scikit-build-core, plus torch as a build requirement.

The process-group and EP modules are compiled against torch's headers and
libraries, so an isolated build (plain ``pip install .``) needs torch in its
build environment. Which torch: the one installed where pip installs to, so
that the module built is the one that loads there (its ABI is tied to one torch
version; see ``python/mooncake/_torch_ext.py``). pip runs these hooks with the
target environment's interpreter, whose site-packages it hides from the build
but which can still be read here. Without a torch there, the pinned version
below (the same as the ``torch`` extra's) is used; ``MOONCAKE_BUILD_TORCH``
picks another one. ``pip install --no-build-isolation .`` skips all this and
builds against whatever torch the build environment has.
"""

from __future__ import annotations

import os
import re
import sysconfig
from importlib import metadata

from scikit_build_core import build as _skbuild
from scikit_build_core.build import (  # noqa: F401 - the hooks pip calls, re-exported as they are
    build_editable,
    build_sdist,
    build_wheel,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

PINNED_TORCH = "2.11.0"
_RELEASE = re.compile(r"^\d+(\.\d+)*")


def _installed_torch() -> str | None:
    """The release of torch installed in the environment pip installs to, if any."""
    paths = sorted({sysconfig.get_paths()[key] for key in ("purelib", "platlib")})
    for dist in metadata.distributions(path=paths):
        if (dist.metadata["Name"] or "").lower() == "torch":
            # A local label (+cu130) names an index, not a release on PyPI.
            match = _RELEASE.match(dist.version)
            return match.group(0) if match else None
    return None


def torch_requirement() -> str:
    wanted = os.environ.get("MOONCAKE_BUILD_TORCH") or _installed_torch() or PINNED_TORCH
    return f"torch=={wanted}"


def get_requires_for_build_wheel(config_settings=None):
    return [*_skbuild.get_requires_for_build_wheel(config_settings), torch_requirement()]


def get_requires_for_build_editable(config_settings=None):
    return [*_skbuild.get_requires_for_build_editable(config_settings), torch_requirement()]
