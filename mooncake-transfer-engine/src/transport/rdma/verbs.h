// The narrow seam between the RDMA transport and a verbs provider.
//
// The transport (rdma_transport.h) needs eight things of an RDMA device:
// list devices, open one (its protection domain, one completion queue, the
// port's addresses), register memory, create a reliable-connected queue
// pair, connect it to a remote one, post chains of one-sided WRITE/READ
// work requests, and poll completions. This header says exactly that, in
// the transport's own terms, so that two providers can sit behind it:
// - libibverbs (ibverbs_provider.cpp): rdma-core's verbs on a real NIC
//   (InfiniBand or RoCE), built where rdma-core's headers are
//   (MOONCAKE_WITH_RDMA).
// - software (soft/): the same semantics over TCP, for machines without an
//   RDMA device (every machine this project's CI runs on), chosen only by
//   MC_RDMA_PROVIDER=software. It enforces what a NIC enforces: queue-pair
//   states, keys and ranges on both sides, the send queue's depth, per-QP
//   ordering, retry exhaustion when the peer is gone, flushing after an
//   error. Test-only: it moves bytes over unauthenticated TCP.
//
// Error conventions: calls return kOk or an ErrorCode (te/status.h);
// per-request failures arrive as completions.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mooncake/te/status.h"

namespace mooncake::te::rdma {

// A port's 16-byte global identifier. On RoCE v2 it is the interface's IP
// address (IPv4 as an IPv4-mapped IPv6 address, ::ffff:a.b.c.d).
struct Gid {
  std::array<uint8_t, 16> raw{};
  bool operator==(const Gid& o) const { return raw == o.raw; }
  bool empty() const;
  std::string str() const;                  // "fe80:0000:...": 8 groups of 4 hex digits
  static bool parse(const std::string& text, Gid& out);
};

struct GidEntry {
  int index = 0;
  Gid gid;
  std::string interface;  // the network interface it belongs to ("" on InfiniBand)
  bool rocev2 = false;    // RoCE v2 (routable, UDP/IP); else RoCE v1 or InfiniBand
};

// One opened device's port: what the transport publishes to peers and uses
// to address them.
struct PortInfo {
  std::string device;      // "mlx5_0", "soft0"
  uint8_t port = 1;
  bool ethernet = true;    // RoCE: peers addressed by GID; InfiniBand: by LID
  uint16_t lid = 0;
  uint32_t mtu = 1024;     // active MTU in bytes (256..4096)
  std::vector<GidEntry> gids;
};

// What one side of a reliable connection tells the other.
struct QpAddress {
  uint32_t qp_num = 0;  // 24 bits
  uint32_t psn = 0;     // first packet sequence number, 24 bits
  uint16_t lid = 0;
  Gid gid;
  uint32_t mtu = 1024;  // the sender's active MTU; the path uses the smaller
};

// How a queue pair is connected (INIT -> RTR -> RTS).
struct ConnectOptions {
  int gid_index = 0;          // local GID used as source (RoCE)
  uint8_t timeout = 14;       // ACK timeout exponent: 4.096 us * 2^timeout (14: 67 ms)
  uint8_t retry_count = 7;    // retransmissions before kRetryExceeded
  uint8_t rnr_retry = 7;      // 7: retry forever (one-sided ops never see RNR)
  uint8_t max_rd_atomic = 16; // outstanding READs, both directions
  uint8_t traffic_class = 0;
  uint8_t service_level = 0;
  uint8_t hop_limit = 64;
};

struct MemoryKeys {
  uint32_t lkey = 0;
  uint32_t rkey = 0;
};

// A work request's outcome, as the transport distinguishes them.
enum class Completion : uint8_t {
  kSuccess = 0,
  kLocalLength,       // local length / inline size error
  kLocalProtection,   // lkey does not cover the local range
  kRemoteAccess,      // rkey / range / access refused by the responder
  kRemoteOperation,   // responder could not carry it out (its QP not ready)
  kRetryExceeded,     // no answer after every retry: peer gone, link down
  kFlushed,           // QP in the error state: not carried out
  kOther,
};
const char* completionName(Completion c);

struct WorkCompletion {
  uint64_t wr_id = 0;
  Completion status = Completion::kSuccess;
  uint32_t qp_num = 0;
  uint32_t vendor_error = 0;
};

struct WorkRequest {
  uint64_t wr_id = 0;
  bool read = false;         // RDMA READ into `local`; else RDMA WRITE from it
  bool signaled = false;     // completes with a completion on success (errors always do)
  bool inline_data = false;  // WRITE only: bytes copied at post time, no lkey needed
  const void* local = nullptr;
  uint32_t length = 0;
  uint32_t lkey = 0;
  uint64_t remote = 0;
  uint32_t rkey = 0;
};

// One reliable-connected queue pair. Posts to one QP must not race each
// other (the transport serializes them); completions come through the
// device's pollCompletions(). Destroying it stops it: no completion of it
// enters the queue afterwards (ones already there stay).
class QueuePair {
 public:
  virtual ~QueuePair() = default;
  virtual uint32_t number() const = 0;
  // RESET -> INIT -> RTR -> RTS, aimed at `remote`. `psn` is our first PSN.
  virtual int connect(const QpAddress& remote, uint32_t psn, const ConnectOptions& options) = 0;
  // Posts `count` requests, in order, as one chain. On error, `posted` says
  // how many were accepted (the rest were not). Fails with kInvalidArgument
  // before connect(), with kTooManyRequests past the send queue's depth.
  virtual int post(const WorkRequest* requests, size_t count, size_t& posted) = 0;
};

struct DeviceOptions {
  uint32_t cq_entries = 4096;  // the transport never has more signaled WRs outstanding
};

// One opened device port with its protection domain and completion queue.
class Device {
 public:
  virtual ~Device() = default;
  virtual const PortInfo& port() const = 0;
  // Registers [addr, addr + length) for local writes and remote reads and
  // writes. One registration per base address.
  virtual int registerMemory(void* addr, size_t length, MemoryKeys& keys) = 0;
  // The same for GPU memory on CUDA device `cuda_device` (GPUDirect RDMA:
  // the NIC reads and writes it without host staging). kNotImplemented
  // where the provider or the build cannot. Ended by deregisterMemory().
  virtual int registerDeviceMemory(void* /*addr*/, size_t /*length*/, int /*cuda_device*/, MemoryKeys& /*keys*/) {
    return kNotImplemented;
  }
  // Ends the registration made at `addr`; the responder no longer serves
  // the range once this returns.
  virtual int deregisterMemory(void* addr) = 0;
  virtual int createQueuePair(uint32_t max_send_wr, uint32_t max_inline, std::unique_ptr<QueuePair>& out) = 0;
  // Completions of every queue pair of this device, at most `capacity`;
  // waits up to `timeout` for the first (zero: only polls). Returns the
  // count, or an ErrorCode (the queue overran: the device is unusable).
  virtual int pollCompletions(WorkCompletion* out, int capacity, std::chrono::milliseconds timeout) = 0;
  // Ends a pollCompletions() waiting now (shutdown).
  virtual void wake() = 0;
};

class Provider {
 public:
  virtual ~Provider() = default;
  virtual const char* name() const = 0;  // "libibverbs", "software"
  virtual std::vector<std::string> deviceNames() = 0;
  // Opens `device` on its first active port. kDeviceNotFound when it has none.
  virtual int open(const std::string& device, const DeviceOptions& options, std::unique_ptr<Device>& out) = 0;
};

// rdma-core's libibverbs; null in builds without it (MOONCAKE_WITH_RDMA=0).
std::unique_ptr<Provider> makeIbverbsProvider();
// The TCP-backed software provider (soft/soft_provider.h).
std::unique_ptr<Provider> makeSoftwareProvider();
// The one MC_RDMA_PROVIDER names ("software", "libibverbs"; default
// libibverbs), null when that one is not built.
std::unique_ptr<Provider> makeConfiguredProvider();

}  // namespace mooncake::te::rdma
