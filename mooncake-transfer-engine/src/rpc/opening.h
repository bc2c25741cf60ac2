// How a connection to the engine's port opens: the kind of connection (a
// 4-byte magic: handshake RPC, TCP data, ...), or, when the engine has a
// secret, the authenticated opening of te/auth_opening.h that names it.
//
// A server with a secret serves only connections that complete the
// challenge; one without serves only open ones. A mismatch either way fails
// the opening (kHandshakeRejected on the side that can tell) before any
// request is read, and is logged with the reason.
#pragma once

#include <cstdint>
#include <string>

#include "net/socket.h"

namespace mooncake::te::rpc {

// What a user does about a secret that differs between two engines, for the
// messages of a refused opening.
inline constexpr const char* kSetTheSameSecret =
    "give both engines the same secret: MC_TE_AUTH_SECRET, or initialize_ext(..., auth_secret=...)";

// Client: opens `socket` (connected) as a connection of `kind`. On failure
// `why` says what was wrong; for a secret the peer does not share it says so
// and how to set it.
int openAs(net::Socket& socket, uint32_t kind, const std::string& secret, net::Deadline deadline, std::string& why);

// Server: reads the opening. kOk with `kind` set for a connection to serve;
// otherwise an error, with `why` saying what was wrong.
int acceptOpening(net::Socket& socket, const std::string& secret, net::Deadline deadline, uint32_t& kind,
                  std::string& why);

}  // namespace mooncake::te::rpc
