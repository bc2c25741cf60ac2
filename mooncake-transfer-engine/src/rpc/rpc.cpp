#include "rpc/rpc.h"

#include "mooncake/te/log.h"
#include "mooncake/te/status.h"
#include "rpc/opening.h"

namespace mooncake::te::rpc {
namespace {

struct FrameHeader {
  uint32_t word;    // request: type; reply: status
  uint32_t length;  // payload bytes
};
static_assert(sizeof(FrameHeader) == 8);

int sendFrame(int fd, uint32_t word, const std::string& payload, net::Deadline deadline) {
  FrameHeader h{word, static_cast<uint32_t>(payload.size())};
  if (int rc = net::sendAll(fd, &h, sizeof(h), deadline); rc != kOk) return rc;
  return net::sendAll(fd, payload.data(), payload.size(), deadline);
}

int recvFrame(int fd, uint32_t& word, std::string& payload, size_t max_message, net::Deadline deadline) {
  FrameHeader h{};
  if (int rc = net::recvAll(fd, &h, sizeof(h), deadline); rc != kOk) return rc;
  if (h.length > max_message) {
    MC_LOG(Warning) << "refusing a " << h.length << "-byte handshake message (MC_HANDSHAKE_MAX_LENGTH=" << max_message
                    << ")";
    return kMalformedMessage;
  }
  word = h.word;
  payload.resize(h.length);
  return net::recvAll(fd, payload.data(), h.length, deadline);
}

}  // namespace

void serveRpc(net::Socket& socket, const RpcDispatcher& dispatch, size_t max_message,
              std::chrono::milliseconds timeout) {
  uint32_t type = 0;
  std::string request, reply;
  if (recvFrame(socket.fd(), type, request, max_message, net::after(timeout)) != kOk) return;
  int status = dispatch(type, request, reply);
  sendFrame(socket.fd(), static_cast<uint32_t>(status), status == kOk ? reply : std::string(), net::after(timeout));
}

int call(const std::string& host, uint16_t port, uint32_t type, const std::string& request, std::string& reply,
         const CallOptions& options, std::string* why) {
  std::string failure;
  // After the connection was accepted: an engine with a secret closes an
  // open (unauthenticated) connection without a word, so this side cannot be
  // sure why it closed; an engine without one always replies to a
  // well-formed request. The code stays kPeerUnreachable (callers read it as
  // "the peer is gone"); the words point at the likely cause.
  auto closedByThePeer = [&](int rc) {
    if (rc == kPeerUnreachable && options.secret.empty()) {
      failure = std::string(
                    "the peer accepted the connection, then closed it without replying, as an engine that "
                    "requires authentication does with one that has no secret; if it has one, ") +
                kSetTheSameSecret;
    }
    return rc;
  };
  const int result = [&] {
    net::Socket socket;
    if (int rc = net::connectTo(host, port, net::after(options.connect_timeout), socket); rc != kOk) return rc;
    net::Deadline deadline = net::after(options.reply_timeout);
    if (int rc = openAs(socket, kRpcMagic, options.secret, deadline, failure); rc != kOk) return closedByThePeer(rc);
    if (int rc = sendFrame(socket.fd(), type, request, deadline); rc != kOk) return closedByThePeer(rc);
    uint32_t status = 0;
    if (int rc = recvFrame(socket.fd(), status, reply, options.max_message, deadline); rc != kOk) {
      return closedByThePeer(rc);
    }
    return static_cast<int>(static_cast<int32_t>(status));
  }();
  if (why) *why = result == kOk ? std::string() : std::move(failure);
  return result;
}

}  // namespace mooncake::te::rpc
