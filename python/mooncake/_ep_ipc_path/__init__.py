"""The fast path of the expert-parallel ``Buffer``: dispatch and combine as
GPU kernels that write straight into the peers' memory through CUDA IPC
(``mooncake._ep_ipc``, the library of docs/ep-kernels.md), used when every
rank of the group runs on one host with CUDA tensors.

- ``choice``: whether a connection may use it: every rank's own conditions,
  agreed through the job's store so that all ranks pick the same path.
- ``path``: the calls: checks that never synchronise with the GPU, output
  allocation, the kernels on the caller's stream, hooks, events.

See docs/ep.md ("Two paths") for what differs between the two paths.
"""

from .choice import PathChoice, choose_path, local_statement
from .path import IpcPath

__all__ = ["IpcPath", "PathChoice", "choose_path", "local_statement"]
