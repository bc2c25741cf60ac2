"""Fixtures for the mooncake.engine tests: initialized engines and registered
numpy buffers, all released when the test ends."""

import pathlib
import sys

import numpy as np
import pytest

# The helper modules the spawned processes import (_procs.py) live here.
_HERE = str(pathlib.Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from _procs import HOST, PROTOCOL_IDS, PROTOCOLS, addr, pattern, session_of  # noqa: E402
from mooncake.engine import TransferEngine  # noqa: E402


class EngineFactory:
    """Makes initialized engines and registered buffers; `close` unregisters
    every buffer it registered (before the arrays can be freed)."""

    def __init__(self):
        self._engines = []
        self._registered = []  # (engine, array): arrays stay referenced while registered

    def engine(self, protocol=""):
        e = TransferEngine()
        rc = e.initialize(HOST, "P2PHANDSHAKE", protocol, "")
        assert rc == 0, f"initialize(protocol={protocol!r}) returned {rc}"
        self._engines.append(e)
        return e

    def buffer(self, engine, nbytes, *, seed=None, fill=0, register=True):
        """A uint8 array of `nbytes`: random bytes from `seed`, else `fill`.
        Registered with `engine` unless register=False."""
        if seed is not None:
            arr = pattern(seed, nbytes)
        else:
            arr = np.full(nbytes, fill, dtype=np.uint8)
        if register:
            rc = engine.register_memory(addr(arr), nbytes)
            assert rc == 0, f"register_memory returned {rc}"
            self._registered.append((engine, arr))
        else:
            self._registered.append((None, arr))  # keep it alive all the same
        return arr

    def close(self):
        for engine, arr in reversed(self._registered):
            if engine is not None:
                engine.unregister_memory(addr(arr))  # nonzero if the test already did it
        self._registered.clear()
        self._engines.clear()


@pytest.fixture
def factory():
    f = EngineFactory()
    yield f
    f.close()


@pytest.fixture(params=PROTOCOLS, ids=PROTOCOL_IDS)
def protocol(request, monkeypatch):
    if request.param == "rdma":
        monkeypatch.setenv("MC_RDMA_PROVIDER", "software")  # read when an engine initializes
    return request.param


class Pair:
    """Two engines in this process: `src` initiates, `dst` is the target."""

    def __init__(self, factory, protocol):
        self.factory = factory
        self.protocol = protocol
        self.src = factory.engine(protocol)
        self.dst = factory.engine(protocol)
        self.dst_session = session_of(self.dst)
        self.src_session = session_of(self.src)

    def buffers(self, src_bytes, dst_bytes, *, src_seed=1, dst_seed=2):
        """A random local buffer on src and a random (different) one on dst."""
        s = self.factory.buffer(self.src, src_bytes, seed=src_seed)
        d = self.factory.buffer(self.dst, dst_bytes, seed=dst_seed)
        return s, d


@pytest.fixture
def pair(factory, protocol):
    return Pair(factory, protocol)
