"""IPv6 peers of the P2P handshake: engines initialized with an IPv6
address are reached as "[address]:port", loopback "::1" as well as a
link-local address with its zone ("[fe80::...%eth0]:port" or by the
interface's index, "%4"), which names the interface the address is on: every
interface has fe80::/64. A zone that names no interface of this host fails
initialize() with a message saying so.

The link-local case needs a link-local address on some interface of this
host (read from /proc/net/if_inet6; loopback has none) and skips, saying so,
where there is none."""

import numpy as np
import pytest

from _procs import addr, pattern
from mooncake.engine import TransferEngine

pytestmark = pytest.mark.timeout(120)


def _link_local_addresses():
    """(address, interface name, interface index) of each usable link-local
    IPv6 address of this host, from /proc/net/if_inet6."""
    found = []
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                hex_address, index, _prefix, scope, flags, name = line.split()
                unusable = int(flags, 16) & (0x40 | 0x08)  # tentative, or failed duplicate detection
                if scope == "20" and not unusable:  # 0x20: link scope
                    groups = [hex_address[i:i + 4] for i in range(0, 32, 4)]
                    found.append((":".join(groups), name, int(index, 16)))
    except OSError:
        pass
    return found


LINK_LOCAL = _link_local_addresses()


def _engine(host):
    e = TransferEngine()
    assert e.initialize(host, "P2PHANDSHAKE", "tcp", "") == 0, host
    return e


def _write_and_read_back(host):
    """An engine on `host` writes to and reads from another on `host`,
    naming it "[host]:port"."""
    a, b = _engine(host), _engine(host)
    s, d = pattern(1, 1 << 16), pattern(2, 1 << 16)
    assert a.register_memory(addr(s), s.size) == 0 and b.register_memory(addr(d), d.size) == 0
    target = f"[{host}]:{b.get_rpc_port()}"
    assert a.transfer_sync_write(target, addr(s, 10), addr(d, 100), 5000) == 0, target
    np.testing.assert_array_equal(d[100:5100], s[10:5010])
    back = np.zeros(5000, dtype=np.uint8)
    assert a.register_memory(addr(back), back.size) == 0
    assert a.transfer_sync_read(target, addr(back), addr(d, 100), 5000) == 0, target
    np.testing.assert_array_equal(back, s[10:5010])
    assert a.send_probe(target) == 0


def test_ipv6_loopback_is_reached_in_brackets():
    _write_and_read_back("::1")


@pytest.mark.skipif(not LINK_LOCAL, reason="no link-local IPv6 address on this host (/proc/net/if_inet6)")
@pytest.mark.parametrize("zone_by", ["name", "index"])
def test_a_link_local_address_is_reached_through_its_zone(zone_by):
    address, name, index = LINK_LOCAL[0]
    _write_and_read_back(f"{address}%{name if zone_by == 'name' else index}")


def test_a_zone_that_names_no_interface_fails_initialize_saying_so(capfd):
    assert TransferEngine().initialize("fe80::1%no-such-if9", "P2PHANDSHAKE", "tcp", "") == -1
    logged = capfd.readouterr().err
    assert "'fe80::1%no-such-if9': the zone after '%' must name an interface of this host" in logged, logged
