// The handshake protocol spoken on a connection opened with kRpcMagic: one
// request frame, one reply frame, then the connection closes.
//
//   request: u32 type, u32 length, payload
//   reply:   i32 status (ErrorCode), u32 length, payload
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "net/socket.h"

namespace mooncake::te::rpc {

constexpr uint32_t kRpcMagic = 0x5052434d;      // "MCRP" on the wire
constexpr uint32_t kTcpDataMagic = 0x5444434d;  // "MCDT": TCP transport data connections

enum RpcType : uint32_t {
  kGetDescriptor = 1,  // payload: caller's segment name; reply: encoded SegmentDescriptor
  kProbe = 2,          // payload: empty; reply: empty
  kNotify = 3,         // payload: Notify (name, msg); reply: empty
  kRdmaConnect = 4,    // payload: rdma::ConnectRequest; reply: the responder's rdma::QpAddress
};

// Server side: returns the status to send back and fills `reply`.
using RpcDispatcher = std::function<int(uint32_t type, const std::string& request, std::string& reply)>;

// Serves one request on a connection whose magic was already read.
void serveRpc(net::Socket& socket, const RpcDispatcher& dispatch, size_t max_message,
              std::chrono::milliseconds timeout);

struct CallOptions {
  std::chrono::milliseconds connect_timeout{5000};
  std::chrono::milliseconds reply_timeout{10000};
  size_t max_message = 64u << 20;
  std::string secret;  // "" = an open connection (rpc/opening.h)
};

// Client side: kOk with `reply` filled, the peer's non-zero status, or a
// transport error (kPeerUnreachable, kTimeout, kDnsFailed, kMalformedMessage,
// kHandshakeRejected when the secrets differ). `why`, when given, is set on a
// failure the error's name does not explain: a secret the peer does not
// share, in words that say how to set it, for the caller's log line.
int call(const std::string& host, uint16_t port, uint32_t type, const std::string& request, std::string& reply,
         const CallOptions& options, std::string* why = nullptr);

}  // namespace mooncake::te::rpc
