// Where the engine's listener binds, from the host it was initialized with:
// that host's address, never every interface unless asked (MC_LISTEN_ALL=1,
// or the wildcard itself as the host), so that loopback stays loopback and a
// job's engines answer only on the network they were told to use.
#pragma once

#include <string>

namespace mooncake::te::net {

struct ListenChoice {
  std::string address;    // an IP literal for Listener::open
  bool every_interface;   // the wildcard ("0.0.0.0" or "::")
  std::string reason;     // why, for the log
};

// `host`: the initialize() host without a port. An IP literal is bound as it
// is, an IPv6 one with its zone ("fe80::1%eth0"); "localhost" is 127.0.0.1. Any other name binds every interface (its
// resolution here, often 127.0.1.1, may differ from what peers resolve), and
// the reason says to pass an address instead.
ListenChoice listenAddressFor(const std::string& host, bool listen_all);

}  // namespace mooncake::te::net
