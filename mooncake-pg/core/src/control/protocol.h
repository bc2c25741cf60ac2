// The wire protocol between Agents and the Coordinator: typed messages and
// their length-prefixed binary frames.
//
// A frame is a 12-byte header (magic, version, message tag, payload length,
// all little-endian) followed by the payload. Decoding checks the header and
// every length against what is left, so a malformed, truncated or hostile
// frame is reported as an error, never read past its end, and never makes
// the decoder allocate more than the frame's own size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "mooncake/pg/control_plane.h"

namespace mooncake::pg::control {

constexpr uint32_t kFrameMagic = 0x4350434d;  // "MCPC" in memory order
// The connection kind an authenticated opening (te/auth_opening.h) names.
constexpr uint32_t kControlPlaneKind = kFrameMagic;
constexpr uint16_t kProtocolVersion = 4;
constexpr size_t kFrameHeaderBytes = 12;
constexpr uint32_t kMaxPayloadBytes = 16u << 20;

using RequestId = uint64_t;

// Agent -> Coordinator, first message of a connection. Answered by a Reply
// with request_id 0.
struct Hello {
  int32_t global_rank = -1;
  int32_t pid = 0;  // for log lines only
  // The address of this process's standby coordinator ("" for none): a
  // candidate successor should the coordinator be lost.
  std::string standby;
  // Failover: this process was registered with a coordinator that was lost,
  // and rejoins a successor. `rejoins` Rejoin messages follow the Hello; the
  // Hello is answered once the successor has rebuilt its state.
  bool resume = false;
  uint32_t rejoins = 0;
};
// The answer to Hello, registerGroup, unregisterGroup and joinGroup. An empty
// error means success.
struct Reply {
  RequestId request_id = 0;
  std::string error;
  std::optional<GroupView> view;
};
struct Heartbeat {};
struct RegisterGroupRequest {
  RequestId request_id = 0;
  GroupRegistration registration;
};
struct UnregisterGroupRequest {
  RequestId request_id = 0;
  std::string key;
};
// Fire and forget: nobody waits for an answer.
struct FailureReport {
  std::string key;
  std::vector<int32_t> ranks;
};
struct SyncRequest {
  RequestId request_id = 0;
  std::string key;
  std::vector<int32_t> ranks;  // failure evidence sent along, may be empty
};
struct SyncReply {
  RequestId request_id = 0;
  SyncAfterFailureResponse response;
  std::optional<GroupView> view;
};
struct JoinRequest {
  RequestId request_id = 0;
  std::string key;
};
struct ProposeRequest {
  RequestId request_id = 0;
  std::string key;
  bool activate = false;
  std::vector<int32_t> ranks;
};
struct ProposeReply {
  RequestId request_id = 0;
  ProposeViewUpdateResponse response;
};
// Coordinator -> Agent: a new view of a group the process holds a seat of.
struct ViewPush {
  GroupView view;
};
// Agent -> Coordinator, after the listener returned: the newest epoch of
// the group this Agent has (>= the pushed one).
struct ViewAck {
  std::string key;
  uint64_t epoch = 0;
};

// Fire and forget: link evidence (Agent::reportLinks).
struct LinkReport {
  std::string key;
  std::vector<int32_t> reached;
  std::vector<int32_t> unreached;
};

// Agent -> successor coordinator, after a Hello with resume: one group this
// process holds a seat of, as registered, and the newest view it has.
struct Rejoin {
  GroupRegistration registration;
  GroupView view;
};

// Coordinator -> Agent, whenever the set of online processes changes: the
// candidate successors (online processes with a standby, but the
// coordinator's own), by ascending global rank, and the global rank of the
// process that hosts the coordinator (-1: unknown).
struct Standbys {
  int32_t coordinator_rank = -1;
  std::vector<int32_t> ranks;
  std::vector<std::string> addresses;
};

// Either way, last words of a process that ends normally (not a failure):
// an Agent's process leaving, or the coordinator's process leaving (its
// Agents then take over without raising the alarm).
struct Goodbye {};

// The index of a message in this variant is its tag on the wire: append new
// messages at the end and never reorder.
using Message = std::variant<Hello, Reply, Heartbeat, RegisterGroupRequest, UnregisterGroupRequest, FailureReport,
                             SyncRequest, SyncReply, JoinRequest, ProposeRequest, ProposeReply, ViewPush, ViewAck,
                             LinkReport, Rejoin, Standbys, Goodbye>;

const char* messageName(const Message& message);

std::vector<uint8_t> encodeFrame(const Message& message);

enum class DecodeResult { kFrame, kNeedMore, kError };

// Decodes the frame at the start of [data, data + size). kFrame: *message
// and *frame_bytes are set; kNeedMore: the frame is not complete yet (the
// header, when present, is valid); kError: *error says why.
DecodeResult decodeFrame(const uint8_t* data, size_t size, Message* message, size_t* frame_bytes, std::string* error);

// Splits a byte stream into messages.
class FrameDecoder {
 public:
  void append(const uint8_t* data, size_t size);
  // The next complete message; once it has returned kError the stream is
  // unusable and every later call returns kError again.
  DecodeResult next(Message* message, std::string* error);

 private:
  std::vector<uint8_t> buffer_;
  size_t consumed_ = 0;  // bytes of buffer_ already decoded
  std::string error_;
};

}  // namespace mooncake::pg::control
