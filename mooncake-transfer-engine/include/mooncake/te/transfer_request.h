// Requests the engine carries out, and the handles naming peers and batches.
#pragma once

#include <cstdint>
#include <string>

namespace mooncake::te {

// READ moves remote bytes into local memory, WRITE local bytes into remote
// memory. Values match the Python TransferOpcode enum (Read=0, Write=1).
enum class Opcode : uint8_t { kRead = 0, kWrite = 1 };

using SegmentHandle = uint64_t;
constexpr SegmentHandle kInvalidSegment = ~0ull;

using BatchId = uint64_t;
constexpr BatchId kInvalidBatch = 0;

struct TransferRequest {
  Opcode opcode = Opcode::kWrite;
  void* source = nullptr;           // local buffer (inside a registered region)
  SegmentHandle target_id = kInvalidSegment;
  uint64_t target_offset = 0;       // remote virtual address in the target segment
  uint64_t length = 0;
  // Optional, WRITE only (ours; the reference has no such field): up to
  // kMaxTrailerBytes more bytes, written at `trailer_target` in the same
  // segment only once the whole payload is in place there. A peer that sees
  // the trailer sees the payload: the completion flag of a one-sided write
  // travels with it instead of a round trip later (as an RDMA write and a
  // flag write on one queue pair). `trailer` is copied when submitted; the
  // request is never split. Transports that cannot order the two refuse it.
  const void* trailer = nullptr;
  uint32_t trailer_length = 0;
  uint64_t trailer_target = 0;
  // Ours: the source is host memory outside any registered region, which
  // the caller keeps valid until the request settles (a send straight from
  // a caller's buffer, without a staging copy). Only transports that read
  // host memory as it is carry it (tcp, shm); others refuse the request.
  bool unregistered_source = false;
  // Ours: the target is a receive window the peer opened for this write
  // (TransferEngine::openReceiveWindow), which this engine's copy of the
  // peer's descriptor may not list: it is not looked up there (no
  // descriptor fetch on the submitting thread, which a silent peer would
  // hold up), and the peer refuses the write if the window is closed. Over
  // tcp only (whose writes a closing window cuts short); others refuse it.
  bool remote_window = false;
};

constexpr uint32_t kMaxTrailerBytes = 64;

struct Notify {
  std::string name;
  std::string msg;
};

}  // namespace mooncake::te
