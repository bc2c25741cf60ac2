"""The layout kernels' own source (mooncake-ep/src/elastic_layout.cu) built
for the host over ``_cuda_emulation/`` (one OS thread per CUDA thread, the
blocks of a launch one after another), so that CI, which has no GPU, runs
the kernels' code on CPU tensors: the launches and dynamic shared memory are
rewritten to the emulation's calls, the rest is compiled as it is. It checks
the kernels' logic (indices, scans, ballots, barriers); a GPU's memory model,
resources and speed are left to the GPU tests."""

from __future__ import annotations

import ctypes
import os
import pathlib
import re
import shutil
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[3]
SOURCE = ROOT / "mooncake-ep" / "src" / "elastic_layout.cu"
EMULATION = pathlib.Path(__file__).resolve().parent / "_cuda_emulation"

_LAUNCH = re.compile(r"(\w+)<<<(.*?),\s*([^,]*?),\s*([^,]*?),\s*(\w+)>>>\((.*?)\);", re.S)
_SHARED = re.compile(r"extern __shared__ (\w+) (\w+)\[\];")

# The C entry points of _cuda_emulation/emulation.cpp: argument names (as
# KernelLayout passes them) and C types, in order.
_U, _I, _L = ctypes.c_size_t, ctypes.c_int, ctypes.c_int64
_CALLS = {
    "layout_send": [("topk_idx", _U), ("num_tokens", _I), ("num_topk", _I), ("num_local", _I), ("num_ranks", _I),
                    ("dest", _U), ("dest_slots", _U), ("token_index", _U), ("counts", _U), ("count_words", _I), ("shape", _U),
                    ("shape_words", _I), ("tile_counts", _U), ("tile_count_words", _L), ("offer_word", _I),
                    ("active_ranks", _U), ("payload", _U), ("payload_bytes", _L), ("scales", _U), ("scale_bytes", _L),
                    ("weights", _U), ("head_bytes", _L), ("ids_at", _L), ("tail", _U), ("tail_bytes", _L),
                    ("zeroed", _U), ("zeroed_words", _L), ("topk_copy", _U)],
    "send_tail": [("payload", _U), ("payload_bytes", _L), ("scales", _U), ("scale_bytes", _L), ("topk_idx", _U),
                  ("weights", _U), ("num_tokens", _I), ("num_topk", _I), ("head_bytes", _L), ("ids_at", _L),
                  ("tail", _U), ("tail_bytes", _L)],
    "layout_receive": [("topk_idx", _U), ("token_index", _U), ("gathered", _U), ("gathered_stride", _L),
                       ("gathered_ranges", _U), ("num_tokens", _I),
                       ("ranges", _U), ("src_token", _U), ("recv_tail", _U), ("tail_bytes", _L), ("ids_at", _L),
                       ("weights_at", _L), ("capacity", _L), ("num_topk", _I), ("num_local", _I), ("num_ranks", _I),
                       ("rank", _I), ("tokens_per_rank", _I), ("slots", _U), ("real", _U), ("local", _U),
                       ("weights", _U), ("metadata", _U), ("per_expert", _U), ("expert_psum", _U),
                       ("scaleup_psum", _U), ("finished_blocks", _U)],
}


def host_source(text: str) -> str:
    """A kernel source with its launches and dynamic shared memory in the emulation's terms."""
    text, launches = _LAUNCH.subn(
        lambda m: f"emulatedLaunch({m[2]}, {m[3]}, {m[4]}, [=] {{ {m[1]}({m[6]}); }});", text)
    text = _SHARED.sub(lambda m: f"{m[1]}* {m[2]} = emulatedDynamicShared<{m[1]}>();", text)
    if not launches:
        raise RuntimeError(f"{SOURCE}: no kernel launch of the form kernel<<<grid, block, shared, stream>>>(...)")
    return text


def compiler_missing() -> str | None:
    """Why the emulation cannot be built here, or None."""
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        return f"needs a C++20 compiler ({cxx}) to build the layout kernels for the host"
    return None


def _send_outputs(a: dict) -> list[tuple[int, int]]:
    picks = a["num_tokens"] * a["num_topk"]
    return [(a["zeroed"], 8 * a["zeroed_words"]), (a["topk_copy"], 8 * picks), (a["dest"], 8 * picks),
            (a["dest_slots"], 4 * picks), (a["token_index"], 4 * picks)]


def _receive_outputs(a: dict) -> list[tuple[int, int]]:
    picks, rows, k = a["num_tokens"] * a["num_topk"], a["capacity"], a["num_topk"]
    return [(a["slots"], 4 * picks), (a["real"], rows), (a["local"], 8 * rows * k), (a["weights"], 4 * rows * k),
            (a["metadata"], 4 * rows * (k + 2)), (a["expert_psum"], 4 * a["num_local"]),
            (a["scaleup_psum"], 4 * a["num_ranks"])]


# Outputs a launch must write whole, as (address, bytes) of its arguments:
# poisoned before it runs, since a GPU's fresh memory holds old bytes where a
# CPU allocator's often holds zeros (layout_send zeroes what layout_receive
# adds to: unpoisoned, a missing zeroing would pass).
_OUTPUTS = {"layout_send": _send_outputs, "layout_receive": _receive_outputs}


class EmulatedKernels:
    """layout_send, send_tail and layout_receive, as mooncake._ep_ipc has them, on host memory."""

    def __init__(self, library: ctypes.CDLL):
        self._library = library

    def __getattr__(self, name: str):
        if name not in _CALLS:
            raise AttributeError(name)
        function = getattr(self._library, f"emulated_{name}")
        function.argtypes = [kind for _, kind in _CALLS[name]]
        function.restype = ctypes.c_int
        names = [n for n, _ in _CALLS[name]]

        def call(*, stream: int, **kwargs):
            assert stream == 0, "the emulation has no streams"
            assert set(kwargs) == set(names), f"{name}: arguments {sorted(set(kwargs) ^ set(names))}"
            for address, size in _OUTPUTS.get(name, lambda _: [])(kwargs):
                if address and size > 0:
                    ctypes.memset(address, 0x5A, size)
            if not function(*(kwargs[n] for n in names)):
                raise RuntimeError(f"{name}: refused (the reason is on stderr)")

        return call


def library_in(folder: pathlib.Path) -> pathlib.Path:
    return folder / "libelastic_layout_host.so"


def build(folder: pathlib.Path) -> EmulatedKernels:
    """Builds the library in ``folder`` (``library_in(folder)``); a RuntimeError carries the compiler's output."""
    source = folder / "elastic_layout_host.cpp"
    source.write_text(host_source(SOURCE.read_text()))
    library = library_in(folder)
    command = [os.environ.get("CXX") or "g++", "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-w",
               f"-I{EMULATION}", f"-I{ROOT / 'mooncake-ep' / 'include'}", f"-I{ROOT / 'mooncake-ep' / 'src'}",
               f"-I{ROOT / 'python' / 'ep_ipc'}", str(source), str(EMULATION / "emulation.cpp"), "-o", str(library)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"building the emulated layout kernels failed:\n{' '.join(command)}\n{done.stderr}")
    return load(library)


def load(library: pathlib.Path) -> EmulatedKernels:
    """The kernels of a library ``build`` made (in another process, say)."""
    return EmulatedKernels(ctypes.CDLL(str(library)))
