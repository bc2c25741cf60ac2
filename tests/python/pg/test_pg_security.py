"""A process group's sockets (docs/security.md): with MASTER_ADDR=127.0.0.1
every listening socket a rank opened (its transfer engine, its control
plane) is bound to 127.0.0.1, torch's own store on MASTER_PORT aside; and
its transfer engine, authenticated with the job's secret drawn through the
store, answers nothing to a descriptor request that skips the challenge
(an open engine would send back the addresses of its registered memory)."""

import os
import socket
import struct

import pytest
import torch
import torch.distributed as dist

from _harness import World

pytestmark = pytest.mark.timeout(120)


def _own_listeners() -> list[tuple[str, int]]:
    """(local address hex, port) of the listening TCP sockets of this process."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                address, port = fields[1].split(":")
                if fields[3] == "0A" and fields[9] in inodes:
                    out.append((address, int(port, 16)))
    return out


def _descriptor_request_reply(port: int) -> bytes:
    name = b"127.0.0.1:1"
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        try:
            c.sendall(struct.pack("<III", 0x5052434D, 1, len(name)) + name)
            c.settimeout(2.0)
            while chunk := c.recv(4096):
                got += chunk
        except (TimeoutError, ConnectionResetError, BrokenPipeError):
            pass
    return got


def _sockets_of_a_rank(ctx):
    t = torch.ones(1 << 16)
    dist.all_reduce(t)  # the transfer engine and the control plane are up
    store_port = int(os.environ["MASTER_PORT"])
    listeners = [(a, p) for a, p in _own_listeners() if p != store_port]
    replies = {p: _descriptor_request_reply(p) for _, p in listeners}
    return listeners, replies, float(t[0])


def test_a_groups_listeners_are_bound_to_master_addr_and_its_engine_wants_the_secret():
    with World(2, gloo=False) as world:
        got = world.run(_sockets_of_a_rank, timeout=60)
    for rank, (listeners, replies, value) in enumerate(got):
        assert value == 2.0
        assert listeners, f"rank {rank}: no listening socket found"
        assert all(address in ("0100007F", "0000000000000000FFFF00000100007F") for address, _ in listeners), \
            (rank, listeners)
        assert all(reply == b"" for reply in replies.values()), (rank, replies)
