"""Whether this process can run ElasticBuffer's ``"nccl"`` transport.

Two things must hold: the build has it (``mooncake._ep_nccl``, built with
``-DMOONCAKE_WITH_NCCL_DEVICE=ON`` against NCCL >= 2.30.4 headers), and the
NCCL library loaded in this process goes with those headers. The module
opens NCCL at run time and says so itself (``RUNTIME_PROBLEM``): torch 2.11
loads NCCL 2.28.9 first, so the NCCL the module was built against must be
preloaded (``LD_PRELOAD=.../nvidia/nccl/lib/libnccl.so.2`` of
``nvidia-nccl-cu13==2.32.6``; docs/ep-elastic.md).
"""

from __future__ import annotations

import importlib
from types import ModuleType

NO_BUILD = ("this build has no NCCL transport (mooncake._ep_nccl): rebuild with -DMOONCAKE_WITH_NCCL_DEVICE=ON "
            "against NCCL >= 2.30.4 headers (scripts/build_nccl_device.sh; docs/ep-elastic.md)")


def native() -> ModuleType | None:
    """``mooncake._ep_nccl``, or None in a build without it."""
    try:
        return importlib.import_module("mooncake._ep_nccl")
    except ModuleNotFoundError as err:
        if err.name != "mooncake._ep_nccl":
            raise
        return None


def problem() -> str:
    """"" when this process can run the transport, else why not (and what to do)."""
    module = native()
    if module is None:
        return NO_BUILD
    return module.RUNTIME_PROBLEM
