// Internals of the software verbs provider (soft_provider.h): the wire
// format, the memory-region table, the completion queue, the device (its
// listener and responders) and the queue pair (its requester).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "net/socket.h"
#include "transport/rdma/soft/soft_provider.h"
#include "transport/rdma/verbs.h"

namespace mooncake::te::rdma::soft {

// ---- Wire format ------------------------------------------------------------
// Host byte order: both ends are this program (one byte order per cluster);
// the magic of the hello tells a foreign or a misordered peer apart.
//
// A requester QP opens one connection to the responder's NIC and sends a
// Hello, then Requests (a WRITE's payload right behind its header). The
// responder serves them one at a time, in order, and sends one Answer per
// WRITE, and one or more per READ (each with up to kChunk bytes of data; the
// last one has `last` set). An error Answer ends the request; the responder
// then reads and drops everything until the requester closes.

constexpr uint32_t kHelloMagic = 0x31425653;  // "SVB1"

struct Hello {
  uint32_t magic = kHelloMagic;
  uint32_t destination_qp_num = 0;
  uint32_t source_qp_num = 0;
  uint32_t source_psn = 0;      // the requester's first PSN: the responder's QP must expect it
  uint8_t source_gid[16] = {};  // the requester's GID: the responder's QP must be aimed at it
  uint32_t wait_ms = 0;         // how long the responder may wait for its QP to reach RTS (0: no bound):
                                // half the requester's retry window
  uint32_t reserved = 0;
};
static_assert(sizeof(Hello) == 40);

enum class Opcode : uint8_t { kWrite = 1, kRead = 2 };

struct Request {
  uint64_t seq = 0;
  uint64_t remote = 0;
  uint32_t rkey = 0;
  uint32_t length = 0;
  uint8_t opcode = 0;
  uint8_t reserved[7] = {};
};
static_assert(sizeof(Request) == 32);

struct Answer {
  uint64_t seq = 0;
  uint32_t length = 0;  // bytes of READ data that follow
  uint8_t status = 0;   // a Completion
  uint8_t reason = 0;   // a VendorError
  uint8_t last = 1;     // the request's last answer
  uint8_t reserved = 0;
};
static_assert(sizeof(Answer) == 16);

// The unit in which payloads are staged and copied: bounds the buffers of a
// connection and how long a registration stays pinned for one copy.
constexpr size_t kChunk = 256 * 1024;

// Limits a queue pair is created within (a ConnectX reports about these).
constexpr uint32_t kMaxSendWr = 32768;
constexpr uint32_t kMaxInline = 1024;
constexpr uint32_t kQpsPerDevice = 256;  // the low 8 bits of qp_num

// ---- Memory regions ---------------------------------------------------------

enum class KeyKind { kLocal, kRemote };

// The cuda_device of a host-memory registration.
constexpr int kHostMemory = -1;

// The registrations of one device, host memory or GPU memory of a CUDA
// device. Every byte moves into or out of a registration through copyIn() or
// copyOut(): a memcpy for host memory, a synchronous CUDA copy
// (cuda/host_staging.h) for GPU memory. A copy runs under a pin, and
// deregistration waits for the pins to go: once remove() returns nothing
// touches the range again.
class RegionTable {
 public:
  // `cuda_device`: kHostMemory, or the CUDA device whose memory [addr, addr +
  // length) is (the caller has checked that it is).
  int add(void* addr, size_t length, MemoryKeys& keys, int cuda_device = kHostMemory);
  int remove(void* addr);

  enum class Check { kOk, kUnknownKey, kOutOfRange };
  // Whether [addr, addr + length) lies inside a live registration with `key`.
  Check covers(KeyKind kind, uint32_t key, uint64_t addr, uint64_t length) const;

  enum class Copy {
    kOk,
    kNotCovered,  // no live registration with `key` covers the range: nothing copied
    kFailed,      // the CUDA copy failed (logged): its destination holds undefined bytes
  };
  // n bytes of host memory at `from` into [addr, addr + n) of the
  // registration with `key`, and out of it into host memory at `to`.
  Copy copyIn(KeyKind kind, uint32_t key, uint64_t addr, const void* from, size_t n);
  Copy copyOut(KeyKind kind, uint32_t key, uint64_t addr, void* to, size_t n);

 private:
  struct Region {
    uintptr_t base = 0;
    size_t length = 0;
    uint32_t lkey = 0;
    uint32_t rkey = 0;
    int cuda_device = kHostMemory;
    int pins = 0;  // guarded by mutex_
  };
  std::shared_ptr<Region> find(KeyKind kind, uint32_t key) const;  // under mutex_
  std::shared_ptr<Region> pin(KeyKind kind, uint32_t key, uint64_t addr, uint64_t length);
  void unpin(Region& region);
  uint32_t freshKey();  // under mutex_

  mutable std::mutex mutex_;
  std::condition_variable unpinned_;
  std::map<uintptr_t, std::shared_ptr<Region>> by_base_;
  std::unordered_map<uint32_t, std::shared_ptr<Region>> by_lkey_;
  std::unordered_map<uint32_t, std::shared_ptr<Region>> by_rkey_;
  std::mt19937 random_{std::random_device{}()};
};

// ---- Completion queue -------------------------------------------------------

class CompletionQueue {
 public:
  explicit CompletionQueue(uint32_t capacity) : capacity_(capacity) {}
  void push(const WorkCompletion& completion);
  int poll(WorkCompletion* out, int capacity, std::chrono::milliseconds timeout);
  void wake();
  void setName(std::string name) { name_ = std::move(name); }

 private:
  const uint32_t capacity_;
  std::string name_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<WorkCompletion> entries_;
  bool overrun_ = false;
  bool wake_pending_ = false;
};

// ---- Queue pair (the requester) ---------------------------------------------

class DeviceCore;

enum class QpState : uint8_t { kReset, kReadyToSend, kError };

// What a connected QP was aimed at: the responder side compares it with the
// hello of an incoming connection.
struct PeerBinding {
  uint32_t qp_num = 0;
  Gid gid;
  uint32_t psn = 0;  // the first PSN the peer sends with
};

class QpCore {
 public:
  QpCore(std::shared_ptr<DeviceCore> device, uint8_t index, uint32_t qp_num, uint32_t max_send_wr, uint32_t max_inline);
  ~QpCore();
  QpCore(const QpCore&) = delete;
  QpCore& operator=(const QpCore&) = delete;

  uint32_t number() const { return qp_num_; }
  uint8_t index() const { return index_; }
  int connect(const QpAddress& remote, uint32_t psn, const ConnectOptions& options);
  int post(const WorkRequest* requests, size_t count, size_t& posted);
  // Closes the connection and joins the threads; no completion of this QP
  // enters the queue afterwards. Idempotent.
  void stop();

  // For this device's responders.
  QpState state() const { return state_.load(std::memory_order_acquire); }
  bool stopped() const { return stopping_.load(std::memory_order_acquire); }
  PeerBinding peer() const;  // meaningful once state() left kReset
  // The responder NAK'd an access violation on this QP: error state, every
  // outstanding WR flushed.
  void failFromResponder();

 private:
  enum class Phase : uint8_t { kQueued, kOnWire };
  struct Slot {
    uint64_t seq = 0;
    WorkRequest wr;
    std::vector<char> inline_bytes;
    Phase phase = Phase::kQueued;
    // Fails when it becomes the oldest, without going out (and stops the
    // sender there): its local range was not covered by its lkey.
    bool prefailed = false;
    // Why a local copy failed mid-way (a VendorError; kNoVendorError: none
    // did): completes with kLocalProtection.
    uint32_t local_error = 0;
    net::Clock::time_point sent_at{};
  };

  bool startThreadsLocked();
  template <typename Body>
  void runGuarded(const char* what, Body&& body);
  void senderLoop();
  void receiverLoop();
  // The oldest outstanding WR completes with `status` (kFlushed: none is to
  // blame), every other one with kFlushed; the QP enters the error state.
  void failLocked(Completion status, uint32_t reason);
  void failUnlessStopped(Completion status, uint32_t reason);
  Slot* slotLocked(uint64_t seq);
  // A local copy of WR `seq` did not happen (`outcome`): it completes with
  // kLocalProtection once answered.
  void localCopyFailedLocked(uint64_t seq, RegionTable::Copy outcome);
  net::Deadline answerDeadlineLocked(const Slot& oldest) const;
  net::Deadline progressDeadline() const;
  int openConnection(net::Socket& out);
  bool sendWrite(int fd, const Request& header, const Slot& copy, std::vector<char>& scratch);
  // Reads the answers of the oldest WR; false when the loop is to end.
  bool receiveAnswers(int fd, uint64_t seq, const WorkRequest& wr, std::vector<char>& scratch);

  const std::shared_ptr<DeviceCore> device_;
  const uint8_t index_;
  const uint32_t qp_num_;
  const uint32_t max_send_wr_;
  const uint32_t max_inline_;

  std::mutex stop_mutex_;  // serializes stop()
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::atomic<QpState> state_{QpState::kReset};
  std::atomic<bool> stopping_{false};
  bool connected_once_ = false;
  PeerBinding peer_;
  Gid local_gid_;
  std::string remote_host_;
  uint16_t remote_port_ = 0;
  uint32_t local_psn_ = 0;
  bool retry_window_bounded_ = true;
  std::chrono::nanoseconds retry_window_{};
  std::deque<Slot> queue_;  // posted, not yet answered; seqs consecutive from the front
  uint64_t next_post_seq_ = 1;
  uint64_t next_send_seq_ = 1;
  net::Clock::time_point last_progress_{};
  net::Socket socket_;  // opened by the sender; shut down on error, closed by stop()
  std::thread sender_;
  std::thread receiver_;
};

// ---- Device (the NIC: listener, responders, CQ, keys) -----------------------

class DeviceCore : public std::enable_shared_from_this<DeviceCore> {
 public:
  static int open(const std::string& name, const DeviceOptions& options, std::shared_ptr<DeviceCore>& out);
  DeviceCore(std::string name, uint32_t cq_entries);
  ~DeviceCore();
  DeviceCore(const DeviceCore&) = delete;
  DeviceCore& operator=(const DeviceCore&) = delete;

  // Stops the listener, every responder and every queue pair still open.
  void shutdown();

  const PortInfo& port() const { return port_; }
  const std::string& name() const { return port_.device; }
  RegionTable& regions() { return regions_; }
  CompletionQueue& completions() { return completions_; }

  int createQueuePair(uint32_t max_send_wr, uint32_t max_inline, std::shared_ptr<QpCore>& out);
  void releaseQueuePair(const QpCore& qp);
  // Wakes responders waiting for a queue pair of this device to be connected.
  void queuePairStateChanged();
  // Ends every responder connection addressed to `qp` (it was destroyed).
  void shutdownInboundTo(const QpCore* qp);

 private:
  struct Inbound {
    net::Socket socket;
    std::thread thread;
    std::atomic<bool> closing{false};
    std::atomic<bool> done{false};
    const QpCore* target = nullptr;  // guarded by inbound_mutex_
  };

  int startListening();
  void acceptLoop();
  void reapFinishedLocked(std::list<std::unique_ptr<Inbound>>& finished);
  // The responder of one incoming connection (soft_responder.cpp).
  void serve(Inbound& in);
  std::shared_ptr<QpCore> findQueuePair(uint32_t qp_num);
  // Waits while the queue pair is in RESET (up to `deadline`); its state then.
  QpState waitUntilConnected(const QpCore& qp, net::Deadline deadline, const std::atomic<bool>& closing);
  static bool waitWhileStalled(const Inbound& in);
  static void drain(Inbound& in, std::vector<char>& scratch);

  PortInfo port_;
  RegionTable regions_;
  CompletionQueue completions_;
  net::Listener listener_;
  uint16_t listen_port_ = 0;
  std::thread acceptor_;

  std::mutex qps_mutex_;
  std::condition_variable qp_state_changed_;
  std::vector<std::weak_ptr<QpCore>> qps_ = std::vector<std::weak_ptr<QpCore>>(kQpsPerDevice);
  std::vector<bool> qp_index_used_ = std::vector<bool>(kQpsPerDevice, false);

  std::mutex inbound_mutex_;
  std::list<std::unique_ptr<Inbound>> inbound_;
  bool stopping_ = false;  // guarded by inbound_mutex_
  std::atomic<bool> shut_down_{false};
};

// IPv4 address of an IPv4-mapped GID (::ffff:a.b.c.d); false for any other.
bool ipv4OfGid(const Gid& gid, std::string& out);

}  // namespace mooncake::te::rdma::soft
