"""Separate hosts on one machine, for tests and benchmarks: one network
namespace per host, each with its own address, all joined by one switch.

    with VirtualHosts(3, rate="10gbit") as hosts:
        subprocess.run(hosts.command(1, ["python3", "job.py"]), env=...)
        hosts.address(0)    # "10.231.0.1": where host 0 listens

Each host namespace has ``lo`` and ``eth0``; ``eth0`` is one end of a veth
pair whose other end is a port of a bridge in a switch namespace of its own,
so every host reaches every other over a real link with its own address and
nothing of the machine's network. With ``rate`` every link is shaped in both
directions (``tc tbf`` on the host's and the switch port's egress): a
full-duplex link of that bandwidth per host, as a switched cluster has. The
kernel here has no ``netem``, so no delay is added.

Processes in different network namespaces are different hosts to the
transfer engine (te::hostIdentity includes the network namespace): they
talk over TCP, never through shared memory.

Needs root (or CAP_NET_ADMIN) and ``ip``; :func:`unavailable` says why not
where it cannot work, so a test can skip with that reason. Namespaces are
named after this process and removed on exit, also after an error.
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import subprocess

_counter = itertools.count()


def _ip(*args: str, netns: str | None = None) -> None:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")


def _tc(netns: str, *args: str) -> None:
    argv = ["ip", "netns", "exec", netns, "tc", *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise OSError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")


def unavailable() -> str | None:
    """Why virtual hosts cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    name = f"mcprobe{os.getpid()}x{next(_counter)}"
    try:
        _ip("netns", "add", name)
        _ip("link", "add", "br0", "type", "bridge", netns=name)
    except OSError as e:
        return f"cannot make a network namespace with a bridge: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


class VirtualHosts:
    """`count` hosts at 10.231.0.1, .2, ...; `rate` a tc rate ("10gbit") or None."""

    def __init__(self, count: int, rate: str | None = None, subnet: str = "10.231.0"):
        if count < 1 or count > 200:
            raise ValueError(f"count must be in [1, 200], got {count}")
        self.count = count
        self.rate = rate
        self.subnet = subnet
        tag = f"mc{os.getpid()}x{next(_counter)}"
        self.switch = f"{tag}sw"
        self.names = [f"{tag}h{h}" for h in range(count)]
        self._made: list[str] = []

    def address(self, host: int) -> str:
        return f"{self.subnet}.{host + 1}"

    def command(self, host: int, argv: list[str]) -> list[str]:
        """argv run inside host `host`. Gloo is pointed at the host's link
        (GLOO_SOCKET_IFNAME): it would otherwise take the address of the
        machine's hostname, which is no address of this host."""
        return ["ip", "netns", "exec", self.names[host], "env", "GLOO_SOCKET_IFNAME=eth0", *argv]

    def __enter__(self) -> "VirtualHosts":
        atexit.register(self.close)  # also when the caller never reaches __exit__
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        _ip("link", "set", "br0", "up", netns=self.switch)
        for h, name in enumerate(self.names):
            _ip("netns", "add", name)
            self._made.append(name)
            port = f"p{h}"
            # Made in the host namespace, then its far end moved to the switch.
            _ip("link", "add", "eth0", "type", "veth", "peer", "name", port, netns=name)
            _ip("link", "set", port, "netns", self.switch, netns=name)
            _ip("link", "set", port, "master", "br0", netns=self.switch)
            _ip("link", "set", port, "up", netns=self.switch)
            _ip("addr", "add", f"{self.address(h)}/24", "dev", "eth0", netns=name)
            _ip("link", "set", "eth0", "up", netns=name)
            _ip("link", "set", "lo", "up", netns=name)
            if self.rate:
                # burst: a few ms of the rate, so the shaper holds the rate
                # without stalling a TCP window; limit: queueing of ~20 ms.
                for ns, dev in ((name, "eth0"), (self.switch, port)):
                    _tc(ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", "4mb",
                        "latency", "20ms")

    def close(self) -> None:
        # Deleting a namespace kills its links; processes still inside keep it
        # alive until they end, which the callers' timeouts see to.
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()
        atexit.unregister(self.close)
