"""``mooncake.ep``: the names of the reference's EP extension module.

The reference's ``mooncake.ep`` imports a compiled runtime (``mooncake._ep``:
the GPU buffer, IBGDA/NVLink bootstrap, kernels) and the torch-versioned
``mooncake.pg_<torch version>``, and re-exports both. Here:

- ``mooncake.pg`` is loaded the same way, so importing this module without a
  build for the running torch raises ``ImportError("Mooncake PG was not built
  against torch==X ...")`` with the rebuild command;
- the parts that need no native code are plain Python and always present:
  ``get_ep_buffer_size_hint``, ``get_ep_elastic_buffer_size_hint(T, H, R,
  experts per rank)`` (the Buffer's fixed-capacity mode) and
  ``calculate_elastic_buffer_size`` (ElasticBuffer's), the same formulas,
  ``has_nccl_device_support()``, ``EventHandle(stream_ptr=0)`` (the native
  class's contract, on torch's CUDA events), ``MAX_QP_COUNT``, ``DEVICE_TYPE``;
- the native runtime's own classes (``Buffer(rank, num_ranks, bytes)`` and the
  rest) exist only when a compiled ``mooncake._ep`` is installed; without it,
  asking for one raises an AttributeError saying so, as for any absent name
  (``hasattr`` is false, ``getattr(ep, name, default)`` gives the default, and
  ``from mooncake.ep import Buffer`` is an ImportError). The user-facing
  ``mooncake.mooncake_ep_buffer.Buffer`` and
  ``mooncake.mooncake_elastic_buffer.ElasticBuffer`` do not need them (docs/ep.md).
"""

from __future__ import annotations

import importlib

from mooncake import pg as _pg  # noqa: F401 - the loading rule (version-suffixed PG module)
from mooncake._ep_collective.events import StreamEventHandle as EventHandle
from mooncake._ep_collective.sizes import ep_buffer_size_hint as get_ep_buffer_size_hint
from mooncake._ep_collective.sizes import ep_elastic_buffer_size_hint as get_ep_elastic_buffer_size_hint
from mooncake._ep_elastic import nccl_support as _nccl_support
from mooncake._ep_elastic.sizes import elastic_buffer_size as calculate_elastic_buffer_size

MAX_QP_COUNT = 256
DEVICE_TYPE = "cuda"  # the torch device type of the EP runtime (the reference's buffer reads it)

# Names only the compiled runtime provides.
NATIVE_NAMES = frozenset({"Buffer", "ElasticBuffer", "_LegacyBufferPerfTensors", "_LegacyBufferPerfConfig",
                          "_benchmark_legacy_buffer"})


def has_nccl_device_support() -> bool:
    """Whether ElasticBuffer's ``"nccl"`` transport can run in this process:
    the build has it (``-DMOONCAKE_WITH_NCCL_DEVICE=ON``) and the NCCL loaded
    here goes with the headers it was built against (>= 2.30.4; torch 2.11
    loads 2.28.9, so preload the newer one: docs/ep-elastic.md).
    ``mooncake._ep_elastic.nccl_support.problem()`` says why not."""
    return not _nccl_support.problem()


def _load_native():
    try:
        return importlib.import_module("mooncake._ep")
    except ModuleNotFoundError as err:
        if err.name != "mooncake._ep":
            raise
        return None


_native = _load_native()
HAS_NATIVE_RUNTIME = _native is not None
if _native is not None:
    globals().update({n: getattr(_native, n) for n in dir(_native) if not n.startswith("__")})
# The PG module's names, as the reference re-exports them.
globals().update({n: getattr(_pg, n) for n in _pg.__all__ if n not in globals()})


def __getattr__(name: str):
    if name in NATIVE_NAMES:
        # AttributeError, as for any absent name (hasattr, getattr with a
        # default, and `from mooncake.ep import Buffer` failing as an import).
        raise AttributeError(
            f"mooncake.ep.{name} is part of the native EP runtime (mooncake._ep), which this build does not "
            "include. Use mooncake.mooncake_ep_buffer.Buffer (the collective path, CPU and CUDA tensors); "
            "see docs/ep.md.")
    raise AttributeError(f"module 'mooncake.ep' has no attribute {name!r}")
