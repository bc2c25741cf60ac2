"""Which path a Buffer connection uses, decided once per connect() and
identically on every rank.

Each rank states whether it can take the fast path (the native module is
built, CUDA works, the group's collectives take CUDA tensors, the caller did
not turn it off), where it runs (host name and boot id), its GPU (by UUID,
the same in every process whatever CUDA_VISIBLE_DEVICES says) and the GPUs
its GPU reaches through peer access; it writes that to the job's store and
reads everybody else's. The fast path is chosen only when every rank can
take it, all of them on one host, each rank's GPU reaching every other
rank's. Every rank reads the same entries, so every rank decides the same,
and the reason for the collective path names the rank and the condition.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch

from mooncake._ep_collective.presence import ranks_of

ENV_SWITCH = "MOONCAKE_EP_FAST_PATH"  # "auto" (default) or "0"/"off": always the collective path
STORE_WAIT = timedelta(seconds=60)


@dataclass(frozen=True)
class PathChoice:
    fast: bool
    reason: str  # why the collective path (or, for the fast path, what it spans)


@dataclass(frozen=True)
class RankStatement:
    """What one rank tells the others."""

    able: bool
    why: str  # why not, when not able
    host: str
    device: int  # this process's index of its GPU (for messages)
    gpu: str = ""  # the GPU's UUID ("": not stated, nothing is checked against it)
    reaches: tuple[str, ...] = ()  # UUIDs of the GPUs this rank's GPU has peer access to


def _gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _reachable_gpus(device: int) -> tuple[str, ...]:
    """The GPUs visible here that `device` can access as a peer (itself included)."""
    return tuple(_gpu_uuid(d) for d in range(torch.cuda.device_count())
                 if d == device or torch.cuda.can_device_access_peer(device, d))


def host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _native_module():
    try:
        from mooncake import _ep_ipc  # noqa: PLC0415
    except ImportError as err:
        return None, f"the native module mooncake._ep_ipc is not built ({err})"
    return _ep_ipc, ""


def local_conditions(group_size: int, disable_p2p: bool) -> tuple[bool, str]:
    """(able, why not) for this rank alone."""
    setting = os.environ.get(ENV_SWITCH, "auto").strip().lower()
    if setting in ("0", "off", "false", "no", "collective"):
        return False, f"{ENV_SWITCH}={os.environ[ENV_SWITCH]}"
    if disable_p2p:
        return False, "disable_p2p=True"
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    native, why = _native_module()
    if native is None:
        return False, why
    if group_size > native.MAX_RANKS:
        return False, f"{group_size} ranks, more than the fast path's {native.MAX_RANKS}"
    return True, ""


def local_statement(group_size: int, disable_p2p: bool) -> RankStatement:
    """This rank's statement: its own conditions and where it runs."""
    able, why = local_conditions(group_size, disable_p2p)
    if not able:
        return RankStatement(able, why, host_id(), -1)
    device = torch.cuda.current_device()
    return RankStatement(able, why, host_id(), device, _gpu_uuid(device), _reachable_gpus(device))


def choose_path(store, rank: int, group_size: int, *, cuda_group: bool, alive: int, mine: RankStatement,
                wait: timedelta = STORE_WAIT) -> PathChoice:
    """Collective over the group's ranks (through ``store``, a prefix store
    private to this connection): every rank posts ``mine`` and reads all.
    ``alive``: the group's active mask as bits; the fast path needs every
    rank, so with a rank missing the answer is the collective path, without
    waiting for it."""
    if not cuda_group:  # the same on every rank: no need to ask the others
        return PathChoice(False, "the group's collectives take no CUDA tensors (not a 'mooncake' CUDA group)")
    store.set(f"ipc/{rank}", json.dumps(mine.__dict__))
    missing = ranks_of(((1 << group_size) - 1) & ~alive)
    if missing:
        return PathChoice(False, f"rank(s) {missing} inactive in the group at connect()")
    keys = [f"ipc/{r}" for r in range(group_size)]
    try:
        store.wait(keys, wait)
    except RuntimeError as err:  # a rank never stated its conditions
        return PathChoice(False, f"not every rank stated its conditions within {wait} ({err})")
    states = [_statement_of(json.loads(store.get(k))) for k in keys]
    for r, s in enumerate(states):
        if not s.able:
            return PathChoice(False, f"rank {r}: {s.why}")
    hosts = {s.host for s in states}
    if len(hosts) > 1:
        return PathChoice(False, f"the ranks run on {len(hosts)} hosts; CUDA IPC reaches one host only")
    unreachable = _first_unreachable(states)
    if unreachable:
        return PathChoice(False, unreachable)
    devices = sorted({s.device for s in states})
    return PathChoice(True, f"{group_size} rank(s) on one host, GPU(s) {devices}")


def _statement_of(posted: dict) -> RankStatement:
    return RankStatement(**{**posted, "reaches": tuple(posted.get("reaches", ()))})


def _first_unreachable(states: list[RankStatement]) -> str:
    """Why the ranks' GPUs cannot all map each other's memory ("" when they
    can): rank a's GPU must reach rank b's for every pair on different GPUs
    (each rank writes into every other's receive region)."""
    for a, sa in enumerate(states):
        for b, sb in enumerate(states):
            if not sa.gpu or not sb.gpu or sa.gpu == sb.gpu:
                continue
            if sb.gpu not in sa.reaches:
                return (f"rank {a}'s GPU (cuda:{sa.device} there) has no peer access to rank {b}'s "
                        f"(cuda:{sb.device} there); CUDA IPC between them would fail")
    return ""
