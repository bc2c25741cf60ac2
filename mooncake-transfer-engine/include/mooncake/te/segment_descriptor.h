// What a segment tells its peers about itself in the P2P handshake: its name,
// where it runs (to decide whether a same-host transport can reach it), which
// transports it accepts, and the buffers it has registered.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace mooncake::te {

struct BufferDescriptor {
  uint64_t addr = 0;
  uint64_t length = 0;
  std::string location;
  // Transport-specific data for this buffer (RDMA keys, CUDA IPC handles, ...),
  // keyed by "<transport>.<field>".
  std::map<std::string, std::string> attrs;

  bool contains(uint64_t a, uint64_t len) const {
    return a >= addr && len <= length && a - addr <= length - len;
  }
};

// Two words an engine keeps at a fixed address for its whole life and beyond:
// stamps are never freed, and a destroyed engine zeroes its nonce, so a peer
// holding an old descriptor reads a mismatch, never freed memory.
struct SegmentStamp {
  uint64_t nonce = 0;
  uint64_t registration_version = 0;
};
static_assert(sizeof(SegmentStamp) == 16);

struct SegmentDescriptor {
  std::string name;       // "host:port" of the handshake listener
  std::string host_id;    // equal for processes that can use same-host transports
  int32_t pid = 0;
  uint64_t process_start_ticks = 0;  // /proc/<pid>/stat start time: guards against pid reuse
  // Address (in the owner's address space) of its SegmentStamp: same-host
  // peers read it to notice a stale descriptor without asking the owner.
  uint64_t stamp_addr = 0;
  uint64_t engine_nonce = 0;          // random per engine instance
  uint64_t registration_version = 0;  // bumped on every (un)registration
  std::vector<std::string> transports;  // names of transports this segment serves
  std::map<std::string, std::string> attrs;
  std::vector<BufferDescriptor> buffers;

  // The buffer covering [addr, addr + length), or null. Binary search once
  // index() was called after the last change to `buffers`, linear otherwise.
  const BufferDescriptor* findBuffer(uint64_t addr, uint64_t length) const;
  void index();
  bool servesTransport(const std::string& transport) const;

  std::string encode() const;
  // Returns kOk, or kMalformedMessage for truncated or corrupt input.
  static int decode(const std::string& bytes, SegmentDescriptor& out);

 private:
  std::vector<uint32_t> by_addr_;  // positions in `buffers`, ordered by address
};

}  // namespace mooncake::te
