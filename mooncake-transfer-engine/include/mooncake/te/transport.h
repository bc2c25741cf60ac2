// The interface every transport implements (tcp/, shm/, cuda_ipc/, and later
// rdma/), and the two objects the engine hands to it: the peer being talked to
// and the tasks to carry out.
//
// A transport owns how bytes move; the engine owns everything around that:
// registration bookkeeping, descriptor caching and refresh, choosing a
// transport per peer, batches, deadlines and status. A new transport is a new
// folder with a class implementing this header and one line in the engine's
// transport table (kTransports in transfer_engine.cpp).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "mooncake/te/config.h"
#include "mooncake/te/memory_region.h"
#include "mooncake/te/segment_descriptor.h"
#include "mooncake/te/status.h"
#include "mooncake/te/transfer_request.h"

namespace mooncake::te {

class Batch;

// One request inside a batch. A transport may split it into slices; each
// slice ends in exactly one completeSlice() call, from any thread.
class TransferTask {
 public:
  // Keeps a copy of the request's trailer (the caller's may be gone by the
  // time a transport sends it); request().trailer points at the copy.
  TransferTask(Batch* batch, const TransferRequest& request) : batch_(batch), request_(request) {
    if (request_.trailer != nullptr && request_.trailer_length > 0 && request_.trailer_length <= kMaxTrailerBytes) {
      std::memcpy(trailer_, request_.trailer, request_.trailer_length);
      request_.trailer = trailer_;
    }
  }
  TransferTask(const TransferTask&) = delete;
  TransferTask& operator=(const TransferTask&) = delete;

  const TransferRequest& request() const { return request_; }

  // Declares how many completeSlice() calls will follow. Called once by the
  // transport before it starts the first slice.
  void expectSlices(uint32_t count) {
    slices_.store(count, std::memory_order_relaxed);
    slices_left_.store(count, std::memory_order_relaxed);
  }
  // Records that one slice's bytes are all on the wire, its answer still
  // due (TransferStatus::sent). At most once per slice: a slice sent again
  // on another connection after a failure does not count twice.
  void sliceSent() { sent_slices_.fetch_add(1, std::memory_order_release); }
  // Records the end of one slice; the last one settles the task's state.
  void completeSlice(uint64_t bytes, int error);
  // Fails the whole task before any slice was started.
  void fail(int error);

  // Cancellation (TransferEngine::cancelBatch): a slice that is about to
  // move bytes over a connection announces it with onConnection(fd) (false:
  // canceled, do not start), and withdraws it with offConnection(fd) before
  // the connection is used for anything else. The slices of one task run on
  // several connections at once, so every announced one is kept. cancel()
  // shuts them all down, so a send or receive blocked on a silent peer
  // returns at once, and later slices see canceled() and end with kCanceled.
  void cancel();
  bool canceled() const { return canceled_.load(std::memory_order_acquire); }
  bool onConnection(int fd);
  void offConnection(int fd);

  TransferStatus status() const;

 private:
  void settle();

  Batch* batch_;
  TransferRequest request_;
  unsigned char trailer_[kMaxTrailerBytes];
  std::atomic<uint32_t> slices_{0};
  std::atomic<uint32_t> slices_left_{0};
  std::atomic<uint32_t> sent_slices_{0};
  std::atomic<uint64_t> transferred_{0};
  std::atomic<int> first_error_{kOk};
  std::atomic<TransferState> state_{TransferState::kPending};
  std::atomic<bool> canceled_{false};
  std::mutex connection_mutex_;      // orders cancel() against the announced connections' release
  std::vector<int> connection_fds_;  // one per slice on the wire now
};

// A remote (or local) segment opened by name, with its cached descriptor.
class PeerSegment {
 public:
  PeerSegment(SegmentHandle handle, std::string name, std::string host, uint16_t port)
      : handle_(handle), name_(std::move(name)), host_(std::move(host)), port_(port) {}

  SegmentHandle handle() const { return handle_; }
  const std::string& name() const { return name_; }
  const std::string& host() const { return host_; }
  uint16_t port() const { return port_; }

  // The cached descriptor: an immutable snapshot, replaced whole on refresh.
  std::shared_ptr<const SegmentDescriptor> descriptor() const;
  void setDescriptor(SegmentDescriptor descriptor);
  bool covers(uint64_t addr, uint64_t length) const { return descriptor()->findBuffer(addr, length) != nullptr; }

  // Fetches the descriptor again from the peer (installed by the engine).
  int refresh() { return refresher_ ? refresher_(*this) : kEndpointError; }
  void setRefresher(std::function<int(PeerSegment&)> refresher) { refresher_ = std::move(refresher); }

 private:
  const SegmentHandle handle_;
  const std::string name_;
  const std::string host_;
  const uint16_t port_;
  mutable std::mutex mutex_;
  std::shared_ptr<const SegmentDescriptor> descriptor_ = std::make_shared<SegmentDescriptor>();
  std::function<int(PeerSegment&)> refresher_;
};

// What a transport may use of its engine.
struct TransportContext {
  const EngineConfig* config = nullptr;
  const RegionTable* regions = nullptr;        // the local registrations
  const SegmentDescriptor* local = nullptr;    // identity fields of the local segment
  std::string local_host;     // the address initialize() was given (its port stripped)
  std::string device_filter;  // initialize()'s device list: comma-separated RDMA device names, "" = all
};

class Transport {
 public:
  virtual ~Transport() = default;

  // The protocol name users pass to initialize() and transport_hint ("tcp", "shm", ...).
  virtual const char* name() const = 0;

  // Starts whatever the transport serves (listeners, workers). kOk or an ErrorCode.
  virtual int install(const TransportContext& context) = 0;
  // Stops serving and finishes or fails every task it holds. Called once.
  virtual void shutdown() = 0;

  // Whether it has anything to serve with (RDMA without a device has not):
  // one that has not stays installed but is neither listed nor offered.
  virtual bool serving() const { return true; }
  // Segment-wide attributes peers need to use this transport (its devices,
  // say), keyed "<transport>.<field>"; asked once, after install().
  virtual void describe(std::map<std::string, std::string>& /*segment_attrs*/) const {}
  // A handshake request of a type the engine does not serve itself (a
  // transport's connection setup, rpc/rpc.h). kNotImplemented: not this one's.
  virtual int serveRpc(uint32_t /*type*/, const std::string& /*request*/, std::string& /*reply*/) {
    return kNotImplemented;
  }

  // Registration hooks, for transports that must prepare memory (RDMA memory
  // regions, CUDA IPC handles). The region is already in the region table.
  virtual int registerMemory(const MemoryRegion&, BufferDescriptor&) { return kOk; }
  virtual int unregisterMemory(const MemoryRegion&) { return kOk; }

  // Whether this transport can move bytes between us and `peer` (same host,
  // permissions, the peer serving it). May cache per-peer state.
  virtual bool reaches(PeerSegment& peer) = 0;
  // Whether it can move one request's bytes between these two memories: the
  // local registered region holding the source and the peer's buffer holding
  // the target (host or GPU memory, as their locations say; the transport's
  // attributes of the buffer). Asked before reaches(), so it must be cheap
  // and must not start anything (a CUDA context, say) for memory it refuses.
  virtual bool carries(PeerSegment& /*peer*/, const MemoryRegion& /*local*/, const BufferDescriptor& /*remote*/) {
    return true;
  }

  // Starts `tasks`, all aimed at `peer` and already checked against its
  // descriptor. Each task ends through TransferTask::completeSlice / fail.
  // `caller_waits` says the submitting thread blocks on the result right after,
  // so running a small task inline costs nothing.
  virtual void submit(PeerSegment& peer, const std::vector<TransferTask*>& tasks, bool caller_waits) = 0;

  // Whether it writes a request's trailer only after its payload is in
  // place (TransferRequest::trailer). The engine refuses trailers elsewhere.
  virtual bool ordersTrailers() const { return false; }

  // Drops per-peer state (connections, attachments) for a segment being closed.
  virtual void forget(SegmentHandle) {}

  // Ends at once, as kCanceled, the queued slices of canceled tasks that no
  // thread has started (TransferEngine::cancelBatch calls it after marking
  // the tasks): a canceled request behind workers that a silent peer holds
  // up must not wait for one of them to come free.
  virtual void dropCanceled() {}
};

}  // namespace mooncake::te
