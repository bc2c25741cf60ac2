"""Mooncake-compatible communication for PyTorch: a transfer engine
(``mooncake.engine``), torch.distributed backends (``mooncake.pg``) and
expert-parallel dispatch/combine buffers.

Submodules are imported on demand: ``import mooncake`` alone loads nothing
compiled, so the pure-Python parts (version helpers, loaders) work without a
build.
"""

__version__ = "0.1.0"
