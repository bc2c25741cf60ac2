// Which GID of a port a queue pair uses as its source address. Pure logic
// over PortInfo (tested without a device), plus the one lookup it needs of
// the host: the network interface that carries the engine's address.
#pragma once

#include <string>

#include "transport/rdma/verbs.h"

namespace mooncake::te::rdma {

// The GID index to use, or -1 when the port has none.
// - `forced` >= 0 (MC_GID_INDEX): that index, if the port has it.
// - InfiniBand: index 0 (the port GID; peers are addressed by LID anyway).
// - RoCE: a RoCE v2 IPv4 GID on `interface` (the one carrying the engine's
//   address, so RDMA takes the path the handshake took), else any RoCE v2
//   IPv4 GID off loopback, else any RoCE v2 GID, else the first.
int chooseGidIndex(const PortInfo& port, const std::string& interface, int forced = -1);

// Whether a GID is an IPv4-mapped address (::ffff:a.b.c.d).
bool isIpv4Mapped(const Gid& gid);

// The interface holding IP address `host` ("10.0.0.2"); "" if none does
// (a host name, or an address of another machine).
std::string interfaceOfAddress(const std::string& host);

}  // namespace mooncake::te::rdma
