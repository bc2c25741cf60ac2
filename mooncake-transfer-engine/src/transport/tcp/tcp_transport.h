// TCP transport: works between any two hosts. Serves data connections on the
// engine's listening port; as a client it keeps a pool of connections per
// peer and splits large requests into slices that worker threads move over
// several connections at once. Small asynchronous writes (control words: a
// credit, an ack) go on a lane of their own, so that they never wait behind
// the data slices that keep the workers busy. Every socket wait is bounded
// by the request's deadline (MC_TRANSFER_TIMEOUT + 1 ns/byte).
//
// GPU memory (a region whose location is "cuda:N"), on either side, is staged
// through a pinned host buffer a chunk at a time (cuda/host_staging.h): this
// is how GPU memory moves between hosts, and between processes of one host
// that CUDA IPC cannot connect.
#pragma once

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "mooncake/te/transport.h"
#include "net/socket.h"
#include "transport/tcp/tcp_protocol.h"

namespace mooncake::te {
namespace rpc {
class ConnectionServer;
}

class TcpTransport : public Transport {
 public:
  explicit TcpTransport(rpc::ConnectionServer& server) : server_(server) {}
  ~TcpTransport() override { shutdown(); }

  const char* name() const override { return "tcp"; }
  int install(const TransportContext& context) override;
  void shutdown() override;
  bool reaches(PeerSegment& peer) override;
  void submit(PeerSegment& peer, const std::vector<TransferTask*>& tasks, bool caller_waits) override;
  void forget(SegmentHandle handle) override;
  void dropCanceled() override;
  // A request with a trailer is one slice, and the trailer follows its
  // payload on the same connection.
  bool ordersTrailers() const override { return true; }

 private:
  class ConnectionPool;
  struct Slice {
    TransferTask* task;
    std::shared_ptr<ConnectionPool> pool;
    Opcode opcode;
    char* local;
    int local_device;  // CUDA device of `local`, -1 for host memory
    uint64_t remote;
    uint64_t length;
    net::Deadline deadline;
    // Set when the request already went out on this connection (sent by
    // the submitting thread): a worker only awaits the answer.
    std::shared_ptr<net::Socket> sent_on;
  };

  std::shared_ptr<ConnectionPool> poolFor(PeerSegment& peer);
  void run(const Slice& slice) const;
  // Sends the request and reads its answer. `sent`: whether the slice was
  // already counted as on the wire (TransferTask::sliceSent), set once it is.
  int exchange(net::Socket& socket, const Slice& slice, bool& sent) const;
  int sendRequest(int fd, const Slice& slice) const;
  int awaitAnswer(int fd, const Slice& slice) const;
  // A control write goes out from the calling thread on an idle pooled
  // connection, so that the bytes leave without waiting for a thread to
  // wake; the control lane only reads the answer. False (nothing sent) when
  // no connection is idle or the send failed.
  bool sendInline(Slice& slice) const;
  // Whether a slice is a control write (host memory, at most 8 KiB): it is
  // sent inline if it can be and goes to the control lane, not a worker.
  static bool isControl(const Slice& slice);
  // Server side, after a write's payload: reads its trailer, answers the
  // write with `status` (the payload's verdict, or the trailer's), then
  // writes the trailer if all went well. Returns the socket's result.
  int finishWithTrailer(int fd, net::Deadline deadline, tcp::DataStatus status) const;
  void workerLoop();
  void controlLoop();
  void wakeControl();  // more control writes are queued, or the transport stops
  void serveConnection(net::Socket& socket) const;

  rpc::ConnectionServer& server_;
  TransportContext context_;

  std::mutex pools_mutex_;
  std::map<SegmentHandle, std::shared_ptr<ConnectionPool>> pools_;

  std::mutex queue_mutex_;
  std::condition_variable queue_cv_;
  std::deque<Slice> queue_;
  std::deque<Slice> control_queue_;  // sent inline, or to send once a connection is idle
  bool stopping_ = false;
  std::vector<std::thread> workers_;
  std::thread control_worker_;
  int control_wake_ = -1;  // an eventfd: more control writes are queued
};

}  // namespace mooncake::te
