"""torch.distributed backends ``"mooncake-cpu"`` (CPU tensors) and ``"mooncake"``
(CUDA tensors), and the ``pg.*`` helpers.

``from mooncake import pg`` loads ``mooncake.pg_<torch version>`` for the
running torch, re-exports its names here, and registers the backends, so
that ``dist.init_process_group(backend="mooncake-cpu")`` works after it.
``python -m mooncake.pg --report`` says what was built, against which torch,
and why a load fails.
"""

from __future__ import annotations

if __name__ == "__main__":  # python -m mooncake.pg --report: works also where loading below fails
    import sys as _sys

    from mooncake._pg_report import main as _report_main

    _sys.exit(_report_main())

import functools as _functools

import torch.distributed as _dist

from mooncake._torch_ext import load_torch_extension as _load

_module = _load("pg")
globals().update({name: getattr(_module, name) for name in dir(_module) if not name.startswith("__")})

# The helpers that take a group also take None, for the default group, as
# torch.distributed's own calls do (dist.group.WORLD is typed Optional).
_GROUP_FIRST = ("activate_ranks", "deactivate_ranks", "extend_group_size_to", "get_active_ranks", "get_current_epoch",
                "get_num_synced_ranks", "get_peer_state", "join_group", "recover_ranks", "sync_after_failure")


def _default_group_for_none(fn):
    @_functools.wraps(fn)
    def call(backend, *args, **kwargs):
        if backend is None:
            backend = _dist.distributed_c10d._get_default_group()
        return fn(backend, *args, **kwargs)

    return call


globals().update({name: _default_group_for_none(getattr(_module, name)) for name in _GROUP_FIRST})


def _register(name: str, creator, devices: list[str]) -> None:
    # Registering twice raises in torch; importing this module twice must not.
    if name.upper() in _dist.Backend._plugins:
        return
    _dist.Backend.register_backend(name, creator, extended_api=True, devices=devices)


_register("mooncake-cpu", _module.createMooncakeCpuBackend, ["cpu"])
_register("mooncake", _module.createMooncakeBackend, ["cuda"])

__all__ = [name for name in dir(_module) if not name.startswith("_")]
