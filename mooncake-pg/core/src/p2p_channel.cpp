#include "mooncake/pg/p2p_channel.h"

#include <algorithm>
#include <cstddef>
#include <condition_variable>
#include <cstring>
#include <future>
#include <list>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "mooncake/pg/test_faults.h"
#include "mooncake/te/shared_memory.h"
#include "mooncake/te/transfer_engine.h"
#include "p2p_slots.h"

namespace mooncake::pg {

using namespace p2p;
using Clock = std::chrono::steady_clock;

std::string P2pEndpoint::encode() const {
  std::ostringstream s;
  s << segment << ' ' << credit_region << ' ' << ack_region << ' ' << notice_region;
  return s.str();
}

bool P2pEndpoint::decode(const std::string& text, P2pEndpoint& out) {
  std::istringstream s(text);
  return static_cast<bool>(s >> out.segment >> out.credit_region >> out.ack_region >> out.notice_region);
}

class P2pChannel::Impl {
 public:
  Impl(te::TransferEngine& engine, int rank, int size, const P2pOptions& options);
  ~Impl();

  P2pEndpoint localEndpoint() const {
    return P2pEndpoint{engine_.segmentName(), addr(credits_), addr(acks_), addr(notices_)};
  }
  void connect(const std::vector<P2pEndpoint>& peers);
  void post(bool is_send, int peer, int tag, char* data, size_t bytes, Done done);
  void abort(const std::string& why, const std::vector<int>& failed_ranks, bool mismatch);
  void reopen(int peer, const P2pEndpoint& endpoint, uint32_t epoch);
  void close(int peer, const std::string& why);
  bool isOpen(int peer);
  bool reachable(const P2pEndpoint& endpoint, std::chrono::milliseconds timeout) {
    if (test_faults::trafficCut()) return false;
    return engine_.probe(endpoint.segment, timeout) == te::kOk;
  }

 private:
  struct RecvOp {
    int tag;
    char* data;
    size_t total;
    Done done;
    uint32_t op_id = 0;
    size_t credited = 0;
    size_t received = 0;
    std::string error;      // set when the sender refused the pair; completes once credits drain
    bool credits_done = false;  // every credit this message needs was issued
    int in_flight = 0;          // its credits not acknowledged yet
  };
  struct SendOp {
    int tag;
    const char* data;
    size_t total;
    Done done;
    bool bound = false;
    uint32_t op_id = 0;
    size_t sent = 0;    // bytes handed to writes
    size_t landed = 0;  // bytes whose writes completed
    int in_flight = 0;  // its writes not completed yet
  };
  // A data write in flight: a chunk's bytes from a staging slot into the
  // receiver's pool, with its acknowledgement as the write's trailer (the
  // engine writes it once the bytes are in place), so the data of several
  // chunks streams without a round trip per chunk and nothing waits.
  struct PendingWrite {
    te::BatchId batch;
    int peer;
    int staging;      // the slot its bytes come from, reused once it settles
    uint32_t length;
    SendOp* op;       // null once the message ended otherwise (its peer failed)
  };
  struct Outstanding {
    uint32_t seq;
    int chunk;  // -1 for the credit of an empty message
    size_t offset;
    uint32_t length;
    RecvOp* op;
  };
  // Receives are credited in post order but may complete in any order
  // (different tags), so both lists keep element addresses stable.
  struct RecvLane {
    std::list<RecvOp> ops;
    std::list<Outstanding> outstanding;
    uint32_t issue_seq = 0;
    uint32_t next_op_id = 0;
  };
  struct SendLane {
    std::list<SendOp> ops;
    uint32_t consume_seq = 0;              // lowest credit not consumed yet
    std::vector<bool> consumed = std::vector<bool>(kSlotsPerLane);  // credits taken ahead of consume_seq
    uint32_t rejected_op_id = ~0u;  // credits of this receiver message get a mismatch ack
    // Until then, keep polling without posted sends: the refused message's
    // remaining credits must be acknowledged (as mismatches) for the
    // receiver to finish, even when this rank posts nothing more.
    Clock::time_point drain_until{};
  };
  struct Peer {
    P2pEndpoint endpoint;
    te::SegmentHandle handle = te::kInvalidSegment;
    std::string failure;  // non-empty once the peer is known gone (or closed)
    std::vector<int> failure_ranks;  // whom that failure names: the peer, unless closed for another rank's fault
    bool failure_mismatch = false;   // that failure was ranks disagreeing, not a rank failing
    bool failure_blames_peer = true;  // false when the lanes were reopened: nobody is at fault
    bool failure_timed_out = false;   // the lanes were closed for lack of progress (OpResult::timed_out)
    Clock::time_point last_progress;
    Clock::time_point last_probe;
    // The membership epoch of the lane pair (both sides open it at the same
    // one): every slot token carries it, so slots of an earlier epoch are
    // never taken for current ones.
    uint32_t epoch = 0;
    // Pool chunks credited to this peer before the lanes were closed or
    // reopened: a peer still serving an old credit may write into them, so
    // they are reused only once the peer is known to have moved on (its
    // OpenSlot of the current epoch), to be gone, or to be replaced.
    std::vector<int> quarantined;
  };
  struct Posted {
    bool is_send;
    int peer;
    int tag;
    char* data;
    size_t bytes;
    Done done;
  };

  static uint64_t addr(const void* p) { return reinterpret_cast<uint64_t>(p); }
  void loop();
  bool stepRecv(int peer);
  bool harvestAcks(int peer);
  bool stepSend(int peer);
  // `cut` (test only, test_faults.h): nothing is read from the peers'
  // notices and nobody is probed; only the P2P timeout still applies.
  void checkPeers(bool cut);
  int writeSlot(int peer, const void* slot, uint64_t remote);
  // Where this rank's ack for credit slot `index` goes at `peer`.
  uint64_t ackRemote(int peer, size_t index) const;
  // Marks credit slot `index` served and moves the lane's window on.
  static void consume(SendLane& lane, size_t index);
  // Starts writing `length` bytes of `src` at `remote`, then `ack` at
  // `ack_remote`, from a free staging slot (the caller checked there is
  // one). A write that cannot start is recorded as failed, for reapWrites
  // to fail the peer: failing it here would end the lane's messages under
  // the caller, which is iterating over them.
  void startWrite(int peer, SendOp& op, const char* src, uint64_t remote, uint32_t length, const AckSlot& ack,
                  uint64_t ack_remote);
  // Settles the writes that completed: messages whose bytes all landed
  // complete; a failed write fails its peer.
  bool reapWrites();
  // Waits (bounded by the engine's deadlines) until no write is in flight,
  // so that the staging memory can go.
  void drainWrites();
  // Ends every message with `peer` and closes its lanes. Chunks it was
  // credited stay quarantined unless it is `gone` (see Peer::quarantined).
  void failPeer(int peer, const std::string& why, bool gone = false);
  void applyAbort(const std::string& why, const std::vector<int>& failed_ranks, bool mismatch);
  bool closedByPeer(int peer);
  // Returns to the pool the quarantined chunks of peers that told us they
  // reopened at our epoch (OpenSlot).
  void releaseQuarantine();
  void applyReopen(int peer, const P2pEndpoint& endpoint, uint32_t epoch);
  // Reopens, at the peer's epoch, lanes a peer reopened at a later epoch.
  void followReopens();
  OpResult failure(int peer, const std::string& why) const {
    OpResult r = OpResult::failure(why, peers_[peer].failure_ranks);
    if (r.failed_ranks.empty() && peers_[peer].failure_blames_peer) r.failed_ranks.push_back(peer);
    r.mismatch = peers_[peer].failure_mismatch;
    r.timed_out = peers_[peer].failure_timed_out;
    return r;
  }

  te::TransferEngine& engine_;
  const int rank_, size_;
  const P2pOptions options_;

  // Registered shared memory: [credits | acks | closes | outbox | staging | recv pool].
  char* memory_ = nullptr;
  size_t memory_bytes_ = 0;
  CreditSlot* credits_ = nullptr;  // [size][kSlotsPerLane], written by receivers
  AckSlot* acks_ = nullptr;        // [size][kSlotsPerLane], written by senders
  PeerNotices* notices_ = nullptr;  // [size], written by peers that give up or reopen
  char* outbox_ = nullptr;          // one CloseSlot's room: source of control writes
  char* staging_ = nullptr;        // staging_slots_ chunks: sources of data writes in flight
  size_t staging_slots_ = 0;
  std::vector<int> free_staging_;
  std::list<PendingWrite> writes_;
  char* recv_pool_ = nullptr;      // pool_chunks chunks
  std::vector<int> free_chunks_;

  std::vector<Peer> peers_;
  std::vector<RecvLane> recv_lanes_;
  std::vector<SendLane> send_lanes_;

  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Posted> posted_;
  // Work that must run on the progress thread, which alone touches lanes
  // (abort, reopen); the caller waits for it.
  struct ControlTask {
    std::function<void()> run;
    std::promise<void> done;
  };
  std::vector<ControlTask*> control_;
  void runOnProgressThread(std::function<void()> task);
  bool stopping_ = false;
  bool stopped_ = false;  // the progress thread has ended
  std::thread thread_;
};

P2pChannel::Impl::Impl(te::TransferEngine& engine, int rank, int size, const P2pOptions& options)
    : engine_(engine), rank_(rank), size_(size), options_(options), peers_(size), recv_lanes_(size),
      send_lanes_(size) {
  const size_t slots = static_cast<size_t>(size) * kSlotsPerLane;
  const size_t chunk = options_.chunk_bytes;
  // As many writes in flight as a receiver's pool has chunks: enough to keep
  // a peer's pool busy, and to spread over the engine's connections.
  staging_slots_ = std::max<size_t>(options_.pool_chunks, 2);
  memory_bytes_ = slots * sizeof(CreditSlot) + slots * sizeof(AckSlot) + size * sizeof(PeerNotices) + sizeof(CloseSlot) +
                  chunk * staging_slots_ + chunk * options_.pool_chunks;
  // Shared memory: same-host peers write it through a mapping (a memcpy).
  memory_ = static_cast<char*>(te::allocateSharedMemory(memory_bytes_));
  if (memory_ == nullptr) throw std::runtime_error("P2P: cannot allocate " + std::to_string(memory_bytes_) + " bytes");
  credits_ = reinterpret_cast<CreditSlot*>(memory_);
  acks_ = reinterpret_cast<AckSlot*>(memory_ + slots * sizeof(CreditSlot));
  notices_ = reinterpret_cast<PeerNotices*>(memory_ + slots * (sizeof(CreditSlot) + sizeof(AckSlot)));
  outbox_ = reinterpret_cast<char*>(notices_ + size);
  staging_ = outbox_ + sizeof(CloseSlot);
  recv_pool_ = staging_ + chunk * staging_slots_;
  for (size_t i = 0; i < slots; ++i) {
    reset(&credits_[i]);
    reset(&acks_[i]);
  }
  for (int p = 0; p < size; ++p) {
    reset(&notices_[p].close);
    reset(&notices_[p].open);
  }
  for (int c = static_cast<int>(options_.pool_chunks) - 1; c >= 0; --c) free_chunks_.push_back(c);
  for (int c = static_cast<int>(staging_slots_) - 1; c >= 0; --c) free_staging_.push_back(c);
  if (int rc = engine_.registerLocalMemory(memory_, memory_bytes_); rc != te::kOk) {
    te::freeSharedMemory(memory_);
    throw std::runtime_error(std::string("P2P: cannot register its buffers with the transfer engine: ") +
                             te::errorName(rc));
  }
  thread_ = std::thread([this] { loop(); });
}

P2pChannel::Impl::~Impl() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
  engine_.unregisterLocalMemory(memory_);
  te::freeSharedMemory(memory_);
}

void P2pChannel::Impl::connect(const std::vector<P2pEndpoint>& peers) {
  std::lock_guard lock(mutex_);
  for (int p = 0; p < size_; ++p) {
    peers_[p].endpoint = peers[p];
    peers_[p].handle = engine_.openSegment(peers[p].segment);
    if (peers_[p].handle == te::kInvalidSegment) peers_[p].failure = "cannot reach rank " + std::to_string(p) + " at " + peers[p].segment;
  }
}

void P2pChannel::Impl::runOnProgressThread(std::function<void()> run) {
  ControlTask task{std::move(run), {}};
  std::future<void> done = task.done.get_future();
  {
    std::lock_guard lock(mutex_);
    if (stopped_) return;  // nothing left to change
    control_.push_back(&task);
  }
  cv_.notify_all();
  done.wait();  // the progress thread always answers, also when it stops
}

void P2pChannel::Impl::abort(const std::string& why, const std::vector<int>& failed_ranks, bool mismatch) {
  runOnProgressThread([&] { applyAbort(why, failed_ranks, mismatch); });
}

void P2pChannel::Impl::reopen(int p, const P2pEndpoint& endpoint, uint32_t epoch) {
  runOnProgressThread([&] { applyReopen(p, endpoint, epoch); });
}

void P2pChannel::Impl::close(int p, const std::string& why) {
  runOnProgressThread([&] {
    Peer& peer = peers_[p];
    if (peer.failure.empty()) {  // the peer is at fault, and nobody else
      peer.failure_ranks.clear();
      peer.failure_blames_peer = true;
      peer.failure_mismatch = false;
      peer.failure_timed_out = false;
    }
    failPeer(p, why);
  });
}

bool P2pChannel::Impl::isOpen(int p) {
  bool open = false;
  runOnProgressThread([&] { open = peers_[p].failure.empty() && peers_[p].handle != te::kInvalidSegment; });
  return open;
}

void P2pChannel::Impl::followReopens() {
  for (int p = 0; p < size_; ++p) {
    // A peer that reopened our lanes at a later epoch than ours: follow it
    // (what is pending on the lanes belongs to the earlier epoch).
    auto* header = reinterpret_cast<const std::atomic<uint64_t>*>(&notices_[p].open.header);
    const uint64_t token = header->load(std::memory_order_acquire);
    if ((token >> 32) != (openToken(0) >> 32)) continue;
    const uint32_t epoch = static_cast<uint32_t>(token ^ openToken(0));
    OpenSlot notice;
    if (epoch > peers_[p].epoch && tryLoad(&notices_[p].open, openToken(epoch), notice)) {
      applyReopen(p, peers_[p].endpoint, epoch);
    }
  }
}

void P2pChannel::Impl::applyReopen(int p, const P2pEndpoint& endpoint, uint32_t epoch) {
  {
    Peer& peer = peers_[p];
    if (peer.failure.empty()) {
      peer.failure_ranks.clear();
      peer.failure_blames_peer = false;  // nobody failed: the configuration changed
    }
    failPeer(p, "point-to-point lanes with rank " + std::to_string(p) + " were reopened at membership epoch " +
                    std::to_string(epoch) + "; messages pending before that fail");
    if (endpoint.segment != peer.endpoint.segment) {
      // Another process now holds the seat; the old one wrote its last. Its
      // segment is closed (one engine serves the whole process: channels of
      // other groups still naming it fail as they would on a gone peer), so
      // replacing a rank again and again leaks nothing.
      for (int c : peer.quarantined) free_chunks_.push_back(c);
      peer.quarantined.clear();
      if (peer.handle != te::kInvalidSegment) engine_.closeSegment(peer.handle);
      peer.handle = engine_.openSegment(endpoint.segment);
    }
    peer.endpoint = endpoint;
    peer.epoch = epoch;
    peer.failure = peer.handle == te::kInvalidSegment ? "cannot reach rank " + std::to_string(p) + " at " + endpoint.segment
                                                      : std::string();
    peer.failure_ranks.clear();
    peer.failure_mismatch = false;
    peer.failure_blames_peer = true;
    peer.failure_timed_out = false;
    peer.last_progress = Clock::now();
    recv_lanes_[p] = RecvLane{};
    send_lanes_[p] = SendLane{};
    if (peer.failure.empty()) {  // tell the peer we serve no older credit (best effort)
      OpenSlot notice{};
      seal(notice, openToken(epoch));
      writeSlot(p, &notice, endpoint.notice_region + rank_ * sizeof(PeerNotices) + offsetof(PeerNotices, open));
    }
  }
}

void P2pChannel::Impl::applyAbort(const std::string& why, const std::vector<int>& failed_ranks, bool mismatch) {
  CloseSlot notice{};
  notice.mismatch = mismatch ? 1 : 0;
  for (int q : failed_ranks) {
    if (q >= 0 && q < 256) notice.failed_mask[q / 64] |= 1ull << (q % 64);
  }
  std::strncpy(notice.reason, why.c_str(), sizeof(notice.reason) - 1);
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    Peer& peer = peers_[p];
    seal(notice, closeToken(peer.epoch));
    std::memcpy(outbox_, &notice, sizeof(notice));
    const bool reachable = peer.failure.empty() && peer.handle != te::kInvalidSegment;
    if (peer.failure.empty()) {
      peer.failure_ranks = failed_ranks;
      peer.failure_mismatch = mismatch;
    }
    failPeer(p, why);
    if (reachable && !test_faults::trafficCut()) {  // best effort: a peer that is gone (or cut off) cannot be told
      engine_.transferSync({te::TransferRequest{te::Opcode::kWrite, outbox_, peer.handle,
                                                peer.endpoint.notice_region + rank_ * sizeof(PeerNotices),
                                                sizeof(CloseSlot)}});
    }
  }
}

void P2pChannel::Impl::releaseQuarantine() {
  for (int p = 0; p < size_; ++p) {
    Peer& peer = peers_[p];
    OpenSlot notice;
    if (peer.quarantined.empty() || !tryLoad(&notices_[p].open, openToken(peer.epoch), notice)) continue;
    free_chunks_.insert(free_chunks_.end(), peer.quarantined.begin(), peer.quarantined.end());
    peer.quarantined.clear();
  }
}

bool P2pChannel::Impl::closedByPeer(int p) {
  CloseSlot notice;
  if (!tryLoad(&notices_[p].close, closeToken(peers_[p].epoch), notice)) return false;
  peers_[p].failure_ranks.clear();
  peers_[p].failure_mismatch = notice.mismatch != 0;
  for (int q = 0; q < 256; ++q) {  // in the caller's numbering: not checked against ours
    if (notice.failed_mask[q / 64] & (1ull << (q % 64))) peers_[p].failure_ranks.push_back(q);
  }
  failPeer(p, "rank " + std::to_string(p) + " gave up: " +
                  std::string(notice.reason, strnlen(notice.reason, sizeof(notice.reason))));
  return true;
}

void P2pChannel::Impl::post(bool is_send, int peer, int tag, char* data, size_t bytes, Done done) {
  {
    std::lock_guard lock(mutex_);
    posted_.push_back(Posted{is_send, peer, tag, data, bytes, std::move(done)});
  }
  cv_.notify_all();
}

int P2pChannel::Impl::writeSlot(int peer, const void* slot, uint64_t remote) {
  if (test_faults::trafficCut()) return te::kTimeout;  // lost on the cut cable
  std::memcpy(outbox_, slot, 64);
  return engine_.transferSync({te::TransferRequest{te::Opcode::kWrite, outbox_, peers_[peer].handle, remote, 64}});
}

void P2pChannel::Impl::startWrite(int peer, SendOp& op, const char* src, uint64_t remote, uint32_t length,
                                  const AckSlot& ack, uint64_t ack_remote) {
  const int slot = free_staging_.back();
  free_staging_.pop_back();
  char* staging = staging_ + static_cast<size_t>(slot) * options_.chunk_bytes;
  std::memcpy(staging, src, length);
  te::TransferRequest request{te::Opcode::kWrite, staging, peers_[peer].handle, remote, length};
  request.trailer = &ack;
  request.trailer_length = sizeof(AckSlot);
  request.trailer_target = ack_remote;
  const te::BatchId batch = engine_.allocateBatchID(1);
  int rc = test_faults::trafficCut() ? te::kTimeout  // lost on the cut cable
           : batch == te::kInvalidBatch ? te::kNotInitialized
                                        : engine_.submitTransfer(batch, {request});
  op.in_flight++;
  if (rc != te::kOk) {  // not started: nothing to wait for, its slot is free again
    if (batch != te::kInvalidBatch) engine_.freeBatchID(batch);
    free_staging_.push_back(slot);
    writes_.push_back(PendingWrite{te::kInvalidBatch, peer, -1, length, &op});
    return;
  }
  writes_.push_back(PendingWrite{batch, peer, slot, length, &op});
}

bool P2pChannel::Impl::reapWrites() {
  bool progressed = false;
  for (auto it = writes_.begin(); it != writes_.end();) {
    te::TransferStatus status;
    int rc = te::kTimeout;  // a write never started counts as lost
    if (it->batch != te::kInvalidBatch) {
      if (engine_.getBatchTransferStatus(it->batch, status) != te::kOk) {
        status.state = te::TransferState::kFailed;
        status.error = te::kEndpointError;
      }
      if (status.state == te::TransferState::kPending) {
        ++it;
        continue;
      }
      engine_.freeBatchID(it->batch);
      free_staging_.push_back(it->staging);
      rc = status.state == te::TransferState::kCompleted ? te::kOk : status.error != te::kOk ? status.error : te::kTimeout;
    }
    const PendingWrite write = *it;
    it = writes_.erase(it);
    progressed = true;
    if (write.op == nullptr) continue;  // its message already ended
    const int peer = write.peer;
    SendOp& op = *write.op;
    op.in_flight--;
    if (rc != te::kOk) {
      failPeer(peer, "rank " + std::to_string(peer) + " is unreachable (" + te::errorName(rc) + ")");
      continue;
    }
    peers_[peer].last_progress = Clock::now();
    op.landed += write.length;
    // The message is complete once its bytes landed: the engine answers a
    // write only after its payload is in place and before its trailer (the
    // ack) is, so the receiver cannot finish (and exit) before we know.
    if (op.landed == op.total && op.in_flight == 0) {
      SendLane& lane = send_lanes_[peer];
      auto mine = std::find_if(lane.ops.begin(), lane.ops.end(), [&](const SendOp& o) { return &o == &op; });
      Done finished = std::move(op.done);
      lane.ops.erase(mine);
      finished(OpResult{});
    }
    // Test only: the write's reply is lost after it landed; the message
    // stands, the peer counts as unreachable for what comes next.
    if (test_faults::ackRepliesLost()) {
      failPeer(peer, "rank " + std::to_string(peer) + " is unreachable (" + te::errorName(te::kPeerUnreachable) + ")");
    }
  }
  return progressed;
}

void P2pChannel::Impl::drainWrites() {
  while (!writes_.empty()) {
    reapWrites();
    if (!writes_.empty()) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

void P2pChannel::Impl::failPeer(int peer, const std::string& why, bool gone) {
  Peer& p = peers_[peer];
  if (p.failure.empty()) p.failure = why;
  harvestAcks(peer);  // what had fully arrived completes; the rest fails below
  RecvLane& rl = recv_lanes_[peer];
  for (const Outstanding& o : rl.outstanding) {
    if (o.chunk >= 0) p.quarantined.push_back(o.chunk);
  }
  if (gone) {  // nobody can write into them any more
    for (int c : p.quarantined) free_chunks_.push_back(c);
    p.quarantined.clear();
  }
  rl.outstanding.clear();
  for (RecvOp& op : rl.ops) op.done(failure(peer, p.failure));
  rl.ops.clear();
  for (SendOp& op : send_lanes_[peer].ops) op.done(failure(peer, p.failure));
  send_lanes_[peer].ops.clear();
  for (PendingWrite& w : writes_) {
    if (w.peer == peer) w.op = nullptr;  // still settles, to free its staging slot
  }
}

// The receiver's side of acknowledgements: copies out the chunks whose
// acks arrived and completes every receive that has all its bytes (or a
// refusal). Also run before a peer is failed, so that a message whose last
// ack landed before the peer went away still completes.
bool P2pChannel::Impl::harvestAcks(int peer) {
  RecvLane& lane = recv_lanes_[peer];
  const size_t chunk = options_.chunk_bytes;
  bool progressed = false;
  // Acknowledgements may come in any order.
  for (auto it = lane.outstanding.begin(); it != lane.outstanding.end();) {
    AckSlot* slot = &acks_[static_cast<size_t>(peer) * kSlotsPerLane + it->seq % kSlotsPerLane];
    AckSlot ack;
    if (!tryLoad(slot, token(peers_[peer].epoch, it->seq), ack)) {
      ++it;
      continue;
    }
    reset(slot);
    RecvOp& op = *it->op;
    if (ack.length == kAckSizeMismatch) {
      if (op.error.empty()) {
        op.error = "message size mismatch with rank " + std::to_string(peer) + ": this rank receives " +
                   std::to_string(op.total) + " bytes, the matching send has a different size";
      }
      op.credits_done = true;  // issue nothing more for it
    } else if (op.error.empty() && it->length > 0) {
      std::memcpy(op.data + it->offset, recv_pool_ + it->chunk * chunk, it->length);
      op.received += it->length;
    }
    if (it->chunk >= 0) free_chunks_.push_back(it->chunk);
    op.in_flight--;
    it = lane.outstanding.erase(it);
    progressed = true;
  }
  for (auto it = lane.ops.begin(); it != lane.ops.end();) {
    RecvOp& op = *it;
    bool finished = op.in_flight == 0 && op.credits_done && (op.received == op.total || !op.error.empty());
    if (!finished) {
      ++it;
      continue;
    }
    OpResult r = op.error.empty() ? OpResult{} : failure(peer, op.error);
    r.mismatch = !op.error.empty();  // the only error a receive keeps: the sender refused the pair (sizes differ)
    Done done = std::move(op.done);
    it = lane.ops.erase(it);
    done(r);
    progressed = true;
  }
  return progressed;
}

bool P2pChannel::Impl::stepRecv(int peer) {
  RecvLane& lane = recv_lanes_[peer];
  if (lane.ops.empty()) return false;
  bool progressed = false;
  const size_t chunk = options_.chunk_bytes;
  // Grant credits to every posted receive, in post order: a sender may only
  // have the message of a later receive ready (another tag).
  for (RecvOp& op : lane.ops) {
    while (op.error.empty() && !op.credits_done) {
      uint32_t oldest = lane.outstanding.empty() ? lane.issue_seq : lane.outstanding.front().seq;
      for (const Outstanding& o : lane.outstanding) oldest = std::min(oldest, o.seq);
      if (lane.issue_seq - oldest >= static_cast<uint32_t>(kSlotsPerLane)) break;  // its slot is still in use
      const uint32_t length = static_cast<uint32_t>(std::min(chunk, op.total - op.credited));
      if (length > 0 && free_chunks_.empty()) break;
      const int c = length > 0 ? free_chunks_.back() : -1;
      if (c >= 0) free_chunks_.pop_back();
      const uint32_t seq = lane.issue_seq++;
      CreditSlot credit{};
      credit.recv_addr = c >= 0 ? addr(recv_pool_ + c * chunk) : 0;
      credit.total = op.total;
      credit.length = length;
      credit.tag = op.tag;
      credit.op_id = op.op_id;
      credit.offset = op.credited;
      seal(credit, token(peers_[peer].epoch, seq));
      const uint64_t remote = peers_[peer].endpoint.credit_region +
                              (static_cast<uint64_t>(rank_) * kSlotsPerLane + seq % kSlotsPerLane) * sizeof(CreditSlot);
      lane.outstanding.push_back(Outstanding{seq, c, op.credited, length, &op});
      op.in_flight++;
      op.credited += length;
      op.credits_done = op.credited == op.total;
      if (int rc = writeSlot(peer, &credit, remote); rc != te::kOk) {
        failPeer(peer, "rank " + std::to_string(peer) + " is unreachable (" + te::errorName(rc) + ")");
        return true;
      }
      progressed = true;
    }
  }
  progressed |= harvestAcks(peer);
  if (progressed) peers_[peer].last_progress = Clock::now();
  return progressed;
}

uint64_t P2pChannel::Impl::ackRemote(int peer, size_t index) const {
  return peers_[peer].endpoint.ack_region + (static_cast<uint64_t>(rank_) * kSlotsPerLane + index) * sizeof(AckSlot);
}

void P2pChannel::Impl::consume(SendLane& lane, size_t index) {
  lane.consumed[index] = true;
  while (lane.consumed[lane.consume_seq % kSlotsPerLane]) {
    lane.consumed[lane.consume_seq % kSlotsPerLane] = false;
    lane.consume_seq++;
  }
}

bool P2pChannel::Impl::stepSend(int peer) {
  SendLane& lane = send_lanes_[peer];
  bool progressed = false;
  // Look at every credit in the window, not only the oldest: the oldest may
  // be for a message this rank has not posted yet (another tag).
  for (uint32_t seq = lane.consume_seq; seq != lane.consume_seq + kSlotsPerLane; ++seq) {
    const size_t index = seq % kSlotsPerLane;
    if (lane.consumed[index]) continue;
    CreditSlot* slot = &credits_[static_cast<size_t>(peer) * kSlotsPerLane + index];
    CreditSlot credit;
    if (!tryLoad(slot, token(peers_[peer].epoch, seq), credit)) continue;
    AckSlot ack{};
    Done finished;
    OpResult finished_result;
    if (credit.op_id == lane.rejected_op_id) {
      ack.length = kAckSizeMismatch;  // drain the rest of a refused message's credits
      lane.drain_until = Clock::now() + std::chrono::seconds(1);
    } else {
      // The send this credit serves: the one bound to the receiver's message,
      // else the oldest unbound send with the credit's tag.
      auto it = std::find_if(lane.ops.begin(), lane.ops.end(),
                             [&](const SendOp& op) { return op.bound && op.op_id == credit.op_id; });
      if (it == lane.ops.end()) {
        it = std::find_if(lane.ops.begin(), lane.ops.end(),
                          [&](const SendOp& op) { return !op.bound && op.tag == credit.tag; });
        if (it == lane.ops.end()) continue;  // not posted yet: keep the credit for later
        it->bound = true;
        it->op_id = credit.op_id;
      }
      // Credits may be served out of order (the window is scanned), so the
      // bytes come from the offset the credit names, not from a cursor.
      if (it->total != credit.total || credit.offset > it->total || credit.length > it->total - credit.offset) {
        lane.rejected_op_id = credit.op_id;
        lane.drain_until = Clock::now() + std::chrono::seconds(1);
        ack.length = kAckSizeMismatch;
        finished = std::move(it->done);
        finished_result = failure(peer, "message size mismatch with rank " + std::to_string(peer) +
                                            ": this rank sends " + std::to_string(it->total) +
                                            " bytes, the matching receive expects " + std::to_string(credit.total));
        finished_result.mismatch = true;
        for (PendingWrite& w : writes_) {
          if (w.op == &*it) w.op = nullptr;  // what it wrote before the refusal no longer counts
        }
        lane.ops.erase(it);
      } else if (credit.length > 0) {
        // Data: the write carries its ack as trailer and completes later
        // (reapWrites). Without a free staging slot, the credit waits.
        if (free_staging_.empty()) break;
        ack.length = credit.length;
        seal(ack, token(peers_[peer].epoch, seq));
        reset(slot);  // before the ack can land: the ack lets the receiver reuse the slot
        startWrite(peer, *it, it->data + credit.offset, credit.recv_addr, credit.length, ack, ackRemote(peer, index));
        it->sent += credit.length;
        consume(lane, index);
        progressed = true;
        continue;
      } else {
        finished = std::move(it->done);  // an empty message: its ack is all there is
        lane.ops.erase(it);
      }
    }
    // Free the credit slot before acknowledging: the ack lets the receiver
    // reuse this slot for a new credit.
    reset(slot);
    seal(ack, token(peers_[peer].epoch, seq));
    int rc = writeSlot(peer, &ack, ackRemote(peer, index));
    if (rc == te::kOk && test_faults::ackRepliesLost()) rc = te::kPeerUnreachable;  // test only: it landed
    consume(lane, index);
    // The message is complete once the ack landed; a receiver that got it
    // may finish and exit before the write's reply reaches us, so a failed
    // reply fails the peer for what comes next, not this message.
    if (finished) finished(finished_result);
    if (rc != te::kOk) {
      failPeer(peer, "rank " + std::to_string(peer) + " is unreachable (" + te::errorName(rc) + ")");
      return true;
    }
    progressed = true;
  }
  if (progressed) peers_[peer].last_progress = Clock::now();
  return progressed;
}

void P2pChannel::Impl::checkPeers(bool cut) {
  const auto now = Clock::now();
  for (int p = 0; p < size_; ++p) {
    bool waiting = !recv_lanes_[p].ops.empty() || !send_lanes_[p].ops.empty();
    if (!waiting) continue;
    Peer& peer = peers_[p];
    if (!peer.failure.empty()) {
      failPeer(p, peer.failure);
      continue;
    }
    if (!cut && closedByPeer(p)) continue;
    if (now - peer.last_progress > options_.timeout) {
      // Credits already granted may still be used by a late sender: the only
      // safe way on is to close the lanes to this peer (as a failure does).
      if (peer.failure.empty()) peer.failure_timed_out = true;
      failPeer(p, "no progress with rank " + std::to_string(p) + " for " + std::to_string(options_.timeout.count()) +
                      " ms (P2P timeout); point-to-point with this rank is closed");
      continue;
    }
    // Waiting on a peer: make sure it is still there, a few times a second.
    if (!cut && now - peer.last_progress > std::chrono::milliseconds(200) &&
        now - peer.last_probe > std::chrono::milliseconds(200)) {
      peer.last_probe = now;
      if (engine_.probe(peer.endpoint.segment, std::chrono::milliseconds(500)) != te::kOk) {
        failPeer(p, "rank " + std::to_string(p) + " (" + peer.endpoint.segment + ") is gone", /*gone=*/true);
      }
    }
  }
}

void P2pChannel::Impl::loop() {
  int idle_rounds = 0;
  std::vector<ControlTask*> control;
  for (;;) {
    std::vector<Posted> incoming;
    {
      std::unique_lock lock(mutex_);
      bool busy = !writes_.empty();
      const auto now = Clock::now();
      for (int p = 0; p < size_ && !busy; ++p) {
        busy = !recv_lanes_[p].ops.empty() || !send_lanes_[p].ops.empty() || now < send_lanes_[p].drain_until;
      }
      if (!busy) cv_.wait(lock, [this] { return stopping_ || !posted_.empty() || !control_.empty(); });
      incoming.swap(posted_);
      control.swap(control_);
    }
    for (ControlTask* task : control) {
      task->run();
      task->done.set_value();
    }
    control.clear();
    {
      std::lock_guard lock(mutex_);
      if (stopping_) {
        posted_.insert(posted_.begin(), std::make_move_iterator(incoming.begin()), std::make_move_iterator(incoming.end()));
        break;
      }
    }
    for (Posted& op : incoming) {
      Peer& peer = peers_[op.peer];
      if (!peer.failure.empty()) {
        op.done(failure(op.peer, peer.failure));
      } else if (op.is_send) {
        send_lanes_[op.peer].ops.push_back(SendOp{op.tag, op.data, op.bytes, std::move(op.done), false, 0, 0});
      } else {
        RecvLane& lane = recv_lanes_[op.peer];
        lane.ops.push_back(RecvOp{op.tag, op.data, op.bytes, std::move(op.done), lane.next_op_id++, 0, 0, {}, false, 0});
      }
      if (recv_lanes_[op.peer].ops.size() + send_lanes_[op.peer].ops.size() == 1) peer.last_progress = Clock::now();
    }
    bool progressed = !incoming.empty();
    // Test only: a cut process neither reads its slots nor writes the peers'.
    const bool cut = test_faults::trafficCut();
    progressed |= reapWrites();
    for (int p = 0; p < size_ && !cut; ++p) {
      progressed |= stepRecv(p);
      progressed |= stepSend(p);
    }
    checkPeers(cut);
    if (!cut) {
      releaseQuarantine();
      followReopens();
    }
    // Nothing moved: back off from spinning to short sleeps, so that waiting
    // for a slow peer does not burn a core.
    idle_rounds = progressed ? 0 : idle_rounds + 1;
    if (idle_rounds > 200) {
      std::this_thread::sleep_for(std::chrono::microseconds(std::min(idle_rounds - 200, 200)));
    } else if (idle_rounds > 20) {
      std::this_thread::yield();
    }
  }
  // Shutting down: whatever is pending fails, and no abort() waits forever.
  for (int p = 0; p < size_; ++p) failPeer(p, "the process group was shut down");
  drainWrites();  // the engine may still be reading the staging memory
  std::vector<Posted> left;
  {
    std::lock_guard lock(mutex_);
    left.swap(posted_);
    control.swap(control_);
    stopped_ = true;
  }
  for (Posted& op : left) op.done(failure(op.peer, "the process group was shut down"));
  for (ControlTask* task : control) task->done.set_value();
}

P2pChannel::P2pChannel(te::TransferEngine& engine, int rank, int size, const P2pOptions& options)
    : impl_(std::make_unique<Impl>(engine, rank, size, options)) {}
P2pChannel::~P2pChannel() = default;
P2pEndpoint P2pChannel::localEndpoint() const { return impl_->localEndpoint(); }
void P2pChannel::connect(const std::vector<P2pEndpoint>& peers) { impl_->connect(peers); }
void P2pChannel::send(int peer, int tag, const void* data, size_t bytes, Done done) {
  impl_->post(true, peer, tag, const_cast<char*>(static_cast<const char*>(data)), bytes, std::move(done));
}
void P2pChannel::recv(int peer, int tag, void* data, size_t bytes, Done done) {
  impl_->post(false, peer, tag, static_cast<char*>(data), bytes, std::move(done));
}
void P2pChannel::abort(const std::string& why, const std::vector<int>& failed_ranks, bool mismatch) {
  impl_->abort(why, failed_ranks, mismatch);
}
void P2pChannel::reopen(int peer, const P2pEndpoint& endpoint, uint32_t epoch) { impl_->reopen(peer, endpoint, epoch); }
void P2pChannel::close(int peer, const std::string& why) { impl_->close(peer, why); }
bool P2pChannel::isOpen(int peer) { return impl_->isOpen(peer); }
bool P2pChannel::reachable(const P2pEndpoint& endpoint, std::chrono::milliseconds timeout) {
  return impl_->reachable(endpoint, timeout);
}

}  // namespace mooncake::pg
