"""The peers of an elastic-mode Buffer: one transfer engine per Buffer, its
memory registered once, pairwise connections made through a TCPStore, and
``step()``: every connected, active pair swaps one block of bytes.

A step with peer q (``Link.seq`` counts the steps of the pair since it was
connected, the same on both sides as long as both take part in every step):

1. all outgoing blocks are copied into the send area (and, on CUDA, the
   stream is synchronised: the engine reads device memory from its own
   threads);
2. each block is written into q's slot (parity = step number % 2, source =
   this rank), then, once the engine answered, the step's flag;
3. q's flag for the same step is awaited in this rank's flags, and its
   block copied out of the slot.

Why two parities are enough: this rank writes step n + 2 into q's slot of
step n only after it saw q's flag of step n + 1, which q writes after it
copied out step n (and synchronised its stream, step 1 above).

A peer that cannot be written to, misses liveness probes, sends a block of
another size, or whose flag does not come within the timeout is dropped
from the step and masked (the caller's ``active`` tensor), as the reference
masks a rank that timed out, and told so through a notice in its flags. Its
pair numbering stops there, so the link is broken until both sides call
``disconnect_ranks`` and ``connect_ranks`` again (a fresh incarnation: flags
of the old connection are never read).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch

from .wire import LEAVING_COUNT, WORDS_PER_FLAG, Flag, PeerMetadata, Region, expected, leaving, metadata_key, read_flag

_log = logging.getLogger("mooncake.ep")

PROBE_EVERY_S = 0.2  # a peer not heard from is checked for life this often
PROBE_MISSES = 2  # probes missed in a row before a peer counts as gone
POLL_MIN_S = 20e-6
POLL_MAX_S = 1e-3


def _engine_host(store) -> str:
    """This process's address for its peers: MC_TCP_BIND_ADDRESS, else the
    address on the route to the store's host (as the process group picks),
    else loopback."""
    own = os.environ.get("MC_TCP_BIND_ADDRESS")
    if own:
        return own
    host = getattr(store, "host", None)
    if not host or host in ("localhost",) or host.startswith("127."):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(host), 9))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _job_secret(store) -> str:
    """The secret the job's connections prove (docs/security.md): MC_TE_AUTH_SECRET,
    else the one the store holds for the job (the process group's key, so a
    process group and these buffers in one job share it), drawn by whoever
    comes first."""
    own = os.environ.get("MC_TE_AUTH_SECRET")
    if own:
        return own
    try:
        agreed = store.compare_set("mooncake/job_secret", "", secrets.token_hex(16))
    except (RuntimeError, AttributeError) as err:
        _log.warning("elastic Buffer: the store cannot share a secret (%s); its connections are not "
                     "authenticated (docs/security.md)", err)
        return ""
    return agreed.decode() if isinstance(agreed, bytes) else str(agreed)


@dataclass
class Link:
    """A connected peer."""

    meta: PeerMetadata
    mine: int  # this rank's incarnation on the link (its flags carry it)
    seq: int = 0  # steps done with this peer since the connection
    # Dropped from a step: the two sides' step numbers may differ from now on,
    # so the link carries nothing more until it is connected afresh.
    broken: bool = False


class PeerLinks:
    """Memory, engine and connections of one elastic-mode Buffer (rank ``rank`` of capacity ``ranks``)."""

    def __init__(self, rank: int, ranks: int, total_bytes: int, device: torch.device, store, transport_hint: str):
        from mooncake.engine import TransferEngine  # noqa: PLC0415

        self.rank = rank
        self.region = Region(ranks, total_bytes)
        self.device = device
        self.memory = torch.zeros(total_bytes, dtype=torch.uint8, device=device)
        self.flags = torch.zeros(2 * ranks * WORDS_PER_FLAG, dtype=torch.int64)
        self._outbox = torch.zeros(ranks * WORDS_PER_FLAG, dtype=torch.int64)  # sources of flag writes
        self._hint = transport_hint
        self._links: dict[int, Link] = {}
        # The copies out of the slots of the last step (CUDA): the next step's
        # writes may reuse those slots only once they are done, whatever stream
        # the caller is on then.
        self._copied = None
        self._engine = TransferEngine()
        host = _engine_host(store)
        if self._engine.initialize_ext(host, "P2PHANDSHAKE", "", "", "P2PHANDSHAKE", _job_secret(store)
                                       if store is not None else "") != 0:
            raise RuntimeError(f"update_memory_buffers: the transfer engine could not start on {host} "
                               "(set MC_TCP_BIND_ADDRESS to this host's address)")
        self.segment = f"{host}:{self._engine.get_rpc_port()}"
        location = f"cuda:{device.index}" if device.type == "cuda" else "cpu"
        for tensor, where in ((self.memory, location), (self.flags, "cpu"), (self._outbox, "cpu")):
            if self._engine.register_memory(tensor.data_ptr(), tensor.numel() * tensor.element_size(), where) != 0:
                raise RuntimeError(f"update_memory_buffers: registering {tensor.numel() * tensor.element_size()} "
                                   f"bytes of {where} memory with the transfer engine failed")

    # ----------------------------------------------------------- connections
    def metadata(self, incarnation: int) -> PeerMetadata:
        return PeerMetadata(segment=self.segment, memory=self.memory.data_ptr(), flags=self.flags.data_ptr(),
                            capacity=self.region.ranks, total=self.region.total, incarnation=incarnation,
                            hostname=socket.gethostname())

    def connected(self, peer: int) -> bool:
        return peer in self._links

    def broken(self, peer: int) -> bool:
        """Dropped from a step since it was connected (see Link.broken)."""
        link = self._links.get(peer)
        return link is not None and link.broken

    def connected_ranks(self) -> list[int]:
        return sorted(self._links)

    def connect(self, store, peers: list[int], timeout_s: float) -> None:
        """Swaps metadata with ``peers`` through ``store`` (each side posts
        for the other; both must call) and links them, numbering afresh."""
        incarnation = secrets.randbits(31) + 1
        mine = self.metadata(incarnation).encode()
        outgoing = [metadata_key(self.rank, peer) for peer in peers]
        for key in outgoing:
            store.set(key, mine)
        incoming = [metadata_key(peer, self.rank) for peer in peers]
        try:
            try:
                store.wait(incoming, timedelta(seconds=timeout_s))
            except RuntimeError as err:
                raise RuntimeError(f"connect_ranks: ranks {peers} did not all post their metadata within "
                                   f"metadata_timeout_ms={int(timeout_s * 1000)} ({err}); each must call "
                                   f"connect_ranks with rank {self.rank} in its remote_ranks") from err
            got = store.multi_get(incoming)
            for key in incoming:
                store.delete_key(key)
            metas = [PeerMetadata.decode(data) for data in got]
            for peer, meta in zip(peers, metas):
                if meta.capacity != self.region.ranks or meta.total != self.region.total:
                    raise RuntimeError(f"connect_ranks: rank {peer} has capacity {meta.capacity} and num_rdma_bytes "
                                       f"{meta.total}, this rank {self.region.ranks} and {self.region.total}: every "
                                       "rank must call update_memory_buffers with the same values")
        except BaseException:
            # Nothing half done: no link, and no post of ours left for a later reader.
            for key in outgoing:
                store.delete_key(key)
            raise
        for peer, meta in zip(peers, metas):
            self._links[peer] = Link(meta, incarnation)

    def disconnect(self, peers: list[int]) -> None:
        for peer in peers:
            self._links.pop(peer, None)

    # ------------------------------------------------------------------ step
    def step(self, blocks: dict[int, torch.Tensor], active: torch.Tensor, timeout_s: float | None, what: str,
             expected: dict[int, int]) -> dict[int, torch.Tensor]:
        """Swaps ``blocks[q]`` (uint8, on this Buffer's device; may be empty)
        with every peer q in ``blocks``; returns what each sent back, which
        must be ``expected[q]`` bytes. Peers dropped on the way (a block of
        another size included: the two disagree on the call or its arguments)
        are masked in ``active`` and missing from the result."""
        peers = [q for q in blocks if q != self.rank]
        for q in peers:
            if blocks[q].numel() > self.region.slot_bytes:
                raise ValueError(f"{what}: {blocks[q].numel()} bytes for rank {q} do not fit the "
                                 f"{self.region.slot_bytes}-byte slot of num_rdma_bytes={self.region.total} "
                                 "(size it with Buffer.get_low_latency_buffer_size_hint)")
        offsets, at = {}, 0
        for q in peers:
            n = blocks[q].numel()
            if at + n > self.region.send_bytes:
                raise ValueError(f"{what}: {at + n} outgoing bytes do not fit the send area of "
                                 f"num_rdma_bytes={self.region.total} (size it with "
                                 "Buffer.get_low_latency_buffer_size_hint)")
            if n:
                self.memory[at:at + n].copy_(blocks[q].reshape(-1))
            offsets[q] = at
            at = (at + n + 63) // 64 * 64
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
            if self._copied is not None:
                self._copied.synchronize()

        dropped: dict[int, str] = {}
        writes = {}
        for q in peers:
            link = self._links[q]
            if blocks[q].numel():
                writes[q] = (self.memory.data_ptr() + offsets[q],
                             link.meta.memory + self.region.slot_offset((link.seq + 1) % 2, self.rank),
                             blocks[q].numel())
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._write_all(writes, "this rank's bytes to it", dropped, deadline)
        self._send_flags([q for q in peers if q not in dropped], blocks, dropped, deadline)
        got = self._await_flags([q for q in peers if q not in dropped], timeout_s, dropped)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.device))
        for q, block in list(got.items()):
            if block.numel() != expected[q]:
                dropped[q] = (f"it sent {block.numel()} bytes where this call expects {expected[q]}; the two ranks "
                              "disagree on the call or its arguments")
                del got[q]
        for q, why in dropped.items():
            self.drop(q, f"{what}: {why}", active)
        if self.rank in blocks:
            got[self.rank] = blocks[self.rank].reshape(-1).clone()
        return got

    def drop(self, peer: int, why: str, active: torch.Tensor) -> None:
        """Masks ``peer`` and breaks the link (the two sides' step numbers may
        differ from here on): it takes part again only once both sides
        disconnect_ranks and connect_ranks it. The peer is told at once, so
        that it does not wait for this rank until its timeout."""
        active[peer] = 0
        link = self._links[peer]
        if link.broken:
            return
        link.broken = True
        _log.warning("elastic Buffer: rank %d masks rank %d (%s); it takes part again after disconnect_ranks and "
                     "connect_ranks on both sides", self.rank, peer, why)
        source = self._stage_flag(peer, Flag(seq=0, incarnation=link.mine, count=LEAVING_COUNT))
        for parity in (0, 1):  # best effort, briefly: a peer that is gone needs no notice
            self._write_all({peer: (source, self._flag_address(link, parity), WORDS_PER_FLAG * 8)}, "a notice", {},
                            time.monotonic() + PROBE_EVERY_S)

    def _stage_flag(self, peer: int, flag: Flag) -> int:
        """Puts ``flag`` in the peer's outbox words; returns their address (a write's source)."""
        base = peer * WORDS_PER_FLAG
        self._outbox[base:base + WORDS_PER_FLAG] = torch.tensor(flag.words(), dtype=torch.int64)
        return self._outbox.data_ptr() + base * 8

    def _flag_address(self, link: Link, parity: int) -> int:
        """Where this rank's flags of that parity land in the peer's memory."""
        return link.meta.flags + self.region.flag_index(parity, self.rank) * 8

    def _send_flags(self, peers: list[int], blocks, dropped: dict[int, str], deadline: float | None) -> None:
        writes = {}
        for q in peers:
            link = self._links[q]
            seq = link.seq + 1
            source = self._stage_flag(q, Flag(seq=seq, incarnation=link.mine, count=blocks[q].numel()))
            writes[q] = (source, self._flag_address(link, seq % 2), WORDS_PER_FLAG * 8)
        self._write_all(writes, "this rank's flag to it", dropped, deadline)

    def _write_all(self, writes: dict[int, tuple[int, int, int]], what: str, dropped: dict[int, str],
                   deadline: float | None) -> None:
        """Writes (local address, remote address, length) to each peer at
        once, then waits for all until ``deadline`` (None: the engine's own
        bound); a peer whose write fails or is not done by then goes in ``dropped``."""
        pending = {}
        for q, (local, remote, length) in writes.items():
            batch = self._engine.batch_transfer_async_write(self._links[q].meta.segment, [local], [remote], [length],
                                                            self._hint)
            if batch == 0:
                dropped[q] = f"writing {what} could not be submitted"
            else:
                pending[q] = batch
        if deadline is None:
            for q, batch in pending.items():
                if self._engine.get_batch_transfer_status([batch]) != 0:
                    dropped[q] = f"writing {what} failed"
            return
        pause = POLL_MIN_S
        while pending:
            for q, batch in list(pending.items()):
                state = self._engine.transfer_check_status(batch)  # 1 done, 0 pending, < 0 failed (released)
                if state != 0:
                    del pending[q]
                    if state < 0:
                        dropped[q] = f"writing {what} failed"
            if pending and time.monotonic() > deadline:
                for q in pending:  # left to the engine, which ends it within its own bound
                    dropped[q] = f"writing {what} did not end within the timeout"
                return
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)

    def _await_flags(self, peers: list[int], timeout_s: float | None, dropped: dict[int, str]) -> dict[int, torch.Tensor]:
        got: dict[int, torch.Tensor] = {}
        waiting = set(peers)
        start = time.monotonic()
        last_probe = start
        misses = dict.fromkeys(waiting, 0)
        pause = POLL_MIN_S
        while waiting:
            for q in sorted(waiting):
                link = self._links[q]
                seq = link.seq + 1
                index = self.region.flag_index(seq % 2, q)
                flag = read_flag(self.flags[index:index + WORDS_PER_FLAG].tolist())
                if leaving(flag, link.meta.incarnation):
                    dropped[q] = "it dropped this rank"
                    waiting.discard(q)
                    continue
                if not expected(flag, seq, link.meta.incarnation):
                    continue
                offset = self.region.slot_offset(seq % 2, q)
                got[q] = self.memory[offset:offset + flag.count].clone()
                link.seq = seq
                waiting.discard(q)
                pause = POLL_MIN_S
            if not waiting:
                break
            now = time.monotonic()
            if timeout_s is not None and now - start > timeout_s:
                for q in waiting:
                    dropped[q] = f"nothing came within the timeout ({timeout_s * 1000:.0f} ms)"
                break
            if now - last_probe > PROBE_EVERY_S:
                last_probe = now
                for q in sorted(waiting):
                    misses[q] = misses[q] + 1 if self._engine.send_probe(self._links[q].meta.segment) != 0 else 0
                    if misses[q] >= PROBE_MISSES:
                        dropped[q] = "it is gone (its engine does not answer)"
                        waiting.discard(q)
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)
        return got

    def close(self) -> None:
        """Unregisters the memory and drops the engine (its listener closes)."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        for tensor in (self.memory, self.flags, self._outbox):
            engine.unregister_memory(tensor.data_ptr())
        self._links.clear()
