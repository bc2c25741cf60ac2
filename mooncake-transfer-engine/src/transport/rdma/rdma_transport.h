// RDMA transport: one-sided RDMA WRITE and READ over reliable-connected
// queue pairs, through a verbs provider (verbs.h: libibverbs on a NIC, or
// the TCP-backed software provider where there is none).
//
// - Devices: every device the provider lists (or those initialize()'s
//   device filter names), each on its first active port, each with its own
//   completion queue and progress thread. A host without one leaves the
//   transport idle (serving() is false) and tcp carries cross-host traffic.
// - Memory: each registration is registered on every device; the rkeys go
//   to peers in the buffer's "rdma.rkeys" attribute, the devices' addresses
//   in the segment's "rdma.devices" attribute.
// - Connections: one queue pair per (peer, local device, peer's device),
//   made on first use by a kRdmaConnect handshake on the peer's RPC port
//   (authenticated like every handshake), and made anew after a failure.
// - Data: requests are split into WRs of at most MC_RDMA_SLICE_SIZE bytes,
//   spread over the devices nearest the memory at each end; at most MC_MAX_WR are in flight per queue pair
//   and one in kSignalEvery asks for a completion (RC completes in order, so
//   one completion settles every WR before it). A trailer is one more WR on
//   the payload's queue pair, posted after it (RC places the WRs of one
//   queue pair in order) and inline (it is a copy, not registered memory).
// - Failures: an error completion fails its WR's request and everything
//   after it on that queue pair, which is then destroyed (a refused rkey
//   also has the peer's descriptor fetched again on next use); a WR not
//   completed by its request's deadline does the same with kTimeout, so no
//   WR outlives its deadline (the memory it targets may be reused).
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "mooncake/te/transport.h"
#include "net/socket.h"
#include "transport/rdma/rdma_wire.h"
#include "transport/rdma/verbs.h"

namespace mooncake::te {

class RdmaTransport : public Transport {
 public:
  RdmaTransport();
  ~RdmaTransport() override;

  const char* name() const override { return "rdma"; }
  int install(const TransportContext& context) override;
  void shutdown() override;
  bool serving() const override { return !devices_.empty(); }
  void describe(std::map<std::string, std::string>& segment_attrs) const override;
  int serveRpc(uint32_t type, const std::string& request, std::string& reply) override;
  int registerMemory(const MemoryRegion& region, BufferDescriptor& buffer) override;
  int unregisterMemory(const MemoryRegion& region) override;
  bool reaches(PeerSegment& peer) override;
  bool carries(PeerSegment& peer, const MemoryRegion& local, const BufferDescriptor& remote) override;
  void submit(PeerSegment& peer, const std::vector<TransferTask*>& tasks, bool caller_waits) override;
  bool ordersTrailers() const override { return true; }
  void forget(SegmentHandle handle) override;

  // One completion per this many WRs (and for the last WR of every post).
  static constexpr uint32_t kSignalEvery = 32;

 private:
  struct LocalDevice;
  struct Endpoint;
  // One WR's worth of a request.
  struct Slice {
    TransferTask* task = nullptr;
    bool read = false;
    bool trailer = false;  // the request's trailer: inline, from the task's copy
    char* local = nullptr;
    uint32_t length = 0;
    uint32_t lkey = 0;
    uint64_t remote = 0;
    uint32_t rkey = 0;
    net::Deadline deadline;
  };
  struct Posted {
    uint64_t wr_id;
    Slice slice;
  };
  // A slice's end, reported outside every lock.
  struct Outcome {
    TransferTask* task;
    uint64_t bytes;
    int error;
  };
  struct Registration {
    uint64_t length;
    std::vector<rdma::MemoryKeys> keys;  // per device, in devices_ order
    std::vector<uint32_t> nics;          // the devices nearest its memory (rdma/nic_affinity.h)
  };
  struct EndpointKey {
    SegmentHandle peer;
    size_t device;         // ours
    size_t remote_device;  // the peer's
    bool operator<(const EndpointKey& o) const {
      return std::tie(peer, device, remote_device) < std::tie(o.peer, o.device, o.remote_device);
    }
  };
  struct ResponderKey {
    std::string requester;
    uint32_t requester_device;
    uint32_t responder_device;
    bool operator<(const ResponderKey& o) const {
      return std::tie(requester, requester_device, responder_device) <
             std::tie(o.requester, o.requester_device, o.responder_device);
    }
  };

  std::shared_ptr<Endpoint> endpointFor(PeerSegment& peer, size_t device, size_t remote_device);
  int connect(const std::shared_ptr<Endpoint>& endpoint);
  // Posts what the send queue has room for; fills `failed` if the queue
  // pair refused it. Holds the endpoint's lock.
  void pumpLocked(Endpoint& endpoint, std::vector<Outcome>& failed);
  // Fails everything the endpoint holds with `error` and destroys its queue
  // pair (a new one is made on next use). Holds the endpoint's lock.
  void breakLocked(Endpoint& endpoint, int error, std::vector<Outcome>& failed);
  void progressLoop(LocalDevice& device);
  void onCompletion(LocalDevice& device, const rdma::WorkCompletion& completion);
  // Runs `visit` on each connected endpoint of `device`, under its lock;
  // reports what the visits ended.
  void forEachEndpoint(LocalDevice& device, const std::function<void(Endpoint&, std::vector<Outcome>&)>& visit);
  void expireDeadlines(LocalDevice& device);
  static void report(const std::vector<Outcome>& outcomes);
  static int errorOf(rdma::Completion status);

  TransportContext context_;
  uint32_t max_wr_ = 1;        // MC_MAX_WR, within what a queue pair can hold
  uint64_t slice_size_ = 4096;  // MC_RDMA_SLICE_SIZE, within what one WR can carry
  std::unique_ptr<rdma::Provider> provider_;
  std::vector<std::unique_ptr<LocalDevice>> devices_;
  std::vector<rdma::DeviceAddress> addresses_;  // devices_ as peers see them
  std::atomic<bool> stopping_{false};

  std::shared_mutex registrations_mutex_;
  std::map<uint64_t, Registration> registrations_;  // by base address

  std::mutex endpoints_mutex_;
  std::map<EndpointKey, std::shared_ptr<Endpoint>> endpoints_;
  std::atomic<uint64_t> next_spread_{0};  // rotates the device a request starts on

  std::mutex stale_mutex_;
  std::set<SegmentHandle> stale_peers_;  // a WR to them was refused: their descriptor is fetched again

  std::mutex responders_mutex_;
  std::map<ResponderKey, std::unique_ptr<rdma::QueuePair>> responders_;
};

}  // namespace mooncake::te
