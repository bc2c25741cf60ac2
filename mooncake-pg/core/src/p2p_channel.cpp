#include "mooncake/pg/p2p_channel.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <condition_variable>
#include <cstring>
#include <future>
#include <list>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <unordered_map>

#include <sys/prctl.h>

#include "mooncake/pg/test_faults.h"
#include "mooncake/te/shared_memory.h"
#include "mooncake/te/transfer_engine.h"
#include "p2p_eager.h"
#include "p2p_slots.h"

namespace mooncake::pg {

using namespace p2p;
using Clock = std::chrono::steady_clock;

std::string P2pEndpoint::encode() const {
  std::ostringstream s;
  s << segment << ' ' << credit_region << ' ' << ack_region << ' ' << notice_region << ' ' << eager_region << ' '
    << release_region << ' ' << eager_bytes << ' ' << eager_slots;
  return s.str();
}

bool P2pEndpoint::decode(const std::string& text, P2pEndpoint& out) {
  std::istringstream s(text);
  return static_cast<bool>(s >> out.segment >> out.credit_region >> out.ack_region >> out.notice_region >>
                           out.eager_region >> out.release_region >> out.eager_bytes >> out.eager_slots) &&
         out.eager_slots <= kMaxEagerSlots && (out.eager_slots & (out.eager_slots - 1)) == 0;
}

class P2pChannel::Impl {
 public:
  Impl(te::TransferEngine& engine, int rank, int size, const P2pOptions& options);
  ~Impl();

  P2pEndpoint localEndpoint() const {
    return P2pEndpoint{engine_.segmentName(), addr(credits_), addr(acks_),      addr(notices_),
                       addr(eager_ring_),     addr(releases_), eager_bytes_, eager_slots_};
  }
  size_t chunkBytes() const { return options_.chunk_bytes; }
  void connect(const std::vector<P2pEndpoint>& peers);
  void post(bool is_send, int peer, int tag, char* data, size_t bytes, Done done, Sink sink, bool caller_drives,
            bool ends_when_sent = false);
  void drive(const std::function<bool()>& finished, size_t largest_bytes);
  void abort(const std::string& why, const std::vector<int>& failed_ranks, bool mismatch);
  void reopen(int peer, const P2pEndpoint& endpoint, uint32_t epoch);
  void close(int peer, const std::string& why);
  bool isOpen(int peer);
  P2pCounters counters() const {
    return P2pCounters{eager_sent_.load(std::memory_order_relaxed), spilled_.load(std::memory_order_relaxed),
                       received_in_place_.load(std::memory_order_relaxed),
                       ended_when_sent_.load(std::memory_order_relaxed)};
  }
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
    Sink sink;  // set: the bytes go there, not to `data`
    uint32_t op_id = 0;
    uint32_t tag_seq = 0;  // which message of its tag: pairs with the send of the same number
    // Waits for an eager message (no credits) unless the sender announces
    // that it sends by credits after all.
    bool eager = false;
    size_t credited = 0;
    size_t received = 0;
    std::string error;      // set when the sender refused the pair; completes once credits drain
    bool credits_done = false;  // every credit this message needs was issued
    // A mismatch this side found: one credit of our size tells the sender,
    // which then refuses the pair too.
    bool refusal_owed = false;
    int in_flight = 0;          // its credits not acknowledged yet
    // Its bytes land in `data` itself, opened to the peer as a receive
    // window (P2pOptions::recv_in_place) until the receive ends.
    bool in_place = false;
  };
  enum class SendPath : uint8_t { kUndecided, kEager, kCredited };
  struct SendOp {
    int tag;
    const char* data;
    size_t total;
    Done done;
    uint32_t tag_seq = 0;
    SendPath path = SendPath::kUndecided;
    // Its eager write (kEager) or its announcement (kCredited) started, or
    // none is needed any more; at eager sequence number eager_seq.
    bool eager_written = false;
    uint32_t eager_seq = 0;
    bool eager_landed = false;  // its eager write completed: the message is in the peer's ring
    // Sent eagerly, it ends once its write is on the wire (P2pOptions::eager_ends_when_sent).
    bool ends_when_sent = false;
    bool bound = false;
    uint32_t op_id = 0;
    size_t sent = 0;    // bytes handed to writes
    size_t landed = 0;  // bytes whose writes completed
    int in_flight = 0;  // its writes not completed yet
    bool in_place = false;  // some of its writes read `data` itself (no staging)
    // Ended while writes still read `data`: it waits in `settling_` with its
    // outcome until they settled.
    bool settling = false;
    OpResult outcome;
  };
  // A data write in flight: a chunk's bytes from a staging slot into the
  // receiver's pool, with its acknowledgement as the write's trailer (the
  // engine writes it once the bytes are in place), so the data of several
  // chunks streams without a round trip per chunk and nothing waits.
  struct PendingWrite {
    te::BatchId batch;
    int peer;
    int staging;      // the slot its bytes come from, reused once it settles (-1: none)
    uint32_t length;
    SendOp* op;       // the credited send it carries bytes of; null for other writes and once that ended
    uint32_t epoch;   // of the lanes it was written for: a failure of a stale write fails nothing
    bool release = false;  // a ReleaseSlot (one per peer in flight at a time)
  };
  struct Outstanding {
    uint32_t seq;
    int chunk;  // -1 for the credit of an empty message or of the receive's own buffer
    size_t offset;
    uint32_t length;
    RecvOp* op;
    bool in_place = false;  // it names op->data + offset (a receive window), not a pool chunk
  };
  // Receives are credited in post order but may complete in any order
  // (different tags), so both lists keep element addresses stable.
  // An eager message seen in the ring, not taken yet: it waits there for
  // its receive, or (once the ring is full) in `spilled`.
  struct Arrival {
    uint32_t seq;
    EagerHeader head;
    bool spilled = false;
    std::vector<char> bytes;  // its payload once spilled
  };
  struct RecvLane {
    std::list<RecvOp> ops;
    std::list<Outstanding> outstanding;
    uint32_t issue_seq = 0;
    uint32_t next_op_id = 0;
    std::unordered_map<int, uint32_t> next_tag_seq;
    EagerWindow eager;
    std::list<Arrival> arrivals;
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
    std::unordered_map<int, uint32_t> next_tag_seq;
    uint32_t eager_next = 0;      // the next eager sequence number
    uint32_t eager_released = 0;  // the receiver took every eager message below this
    uint32_t release_version = 0;  // of the last release read
    // Bit seq % 64: eager message seq ended once its write was on the wire,
    // and the release that takes it is still to come (it may say that the
    // message did not match its receive: then the peer fails).
    uint64_t ended_unconfirmed = 0;
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
    // The same for receive windows: [begin, end) of callers' buffers this
    // peer had credits into when the lanes were closed. Closing a window
    // refuses later writes into it, but a range is not opened again while
    // such a write may still come (it would land in the next receive there).
    std::vector<std::pair<uint64_t, uint64_t>> tainted;
    // Eager writes into the peer's ring may start: at epoch 0, or once the
    // peer said it reopened at ours (its OpenSlot) and no write of an
    // earlier epoch is still in flight to it (a stale write must not land
    // on a slot of the new epoch).
    bool eager_open = true;
    int release_writes = 0;  // ReleaseSlot writes to it in flight
    bool open_owed = false;  // our OpenSlot of this epoch has not reached it yet
    bool sends_in_place = false;  // its transport writes credited chunks from the sender's buffer as it is
    bool recv_in_place = false;   // it is reached over tcp: its writes may land in receive windows
    Clock::time_point open_since{}, open_tried{};
  };
  struct Posted {
    bool is_send;
    int peer;
    int tag;
    char* data;
    size_t bytes;
    Done done;
    Sink sink;
    bool ends_when_sent = false;
  };

  static uint64_t addr(const void* p) { return reinterpret_cast<uint64_t>(p); }
  void loop();
  // Puts posted messages on their lanes (under step_mutex_, which also
  // keeps them in post order whichever thread takes them).
  void intake(std::vector<Posted>& incoming);
  // Reaps writes and steps every lane once; whether anything moved.
  bool stepLanes();
  // Whether the lanes have work that needs polling (under step_mutex_).
  // Writes in flight alone do not count: they need reaping, but nothing
  // waits for that (writes_in_flight_).
  bool lanesBusy() const;
  bool stepRecv(int peer);
  bool harvestAcks(int peer);
  bool stepSend(int peer);
  // The eager path (p2p_eager.h). Sender: completes the sends the peer
  // took, then starts eager writes (and announcements) in post order while
  // the peer's ring has room.
  bool stepEager(int peer);
  bool harvestReleases(int peer);
  void startEagerWrite(int peer, SendOp& op);
  bool eagerWritable(int peer);
  // Receiver: notes the messages that landed in the peer's ring and pairs
  // them with receives; a message without its receive stays in the ring
  // until the ring is full, then waits in memory (so a sender is never held
  // up by messages this rank takes later). Matched receives end in
  // harvestAcks, after the caller told the sender (startRelease). False in
  // `intact` when a slot was found overwritten (a stale write) or malformed.
  bool pollEager(int peer);
  bool matchEager(int peer, bool& intact);
  bool takeEagerArrivals(int peer, bool& intact) {
    const bool polled = pollEager(peer);
    return matchEager(peer, intact) || polled;
  }
  // Whether message `tag_seq` of `tag` was posted on this side already
  // (`next_tag_seq` of its lane holds the next number of each tag).
  static bool postedBefore(const std::unordered_map<int, uint32_t>& next_tag_seq, int tag, uint32_t tag_seq) {
    auto next = next_tag_seq.find(tag);
    return next != next_tag_seq.end() && seqBefore(tag_seq, next->second);
  }
  // The writes in flight of a send that ends now settle without it.
  void forgetWritesOf(const SendOp* op) {
    for (PendingWrite& w : writes_) {
      if (w.op == op) w.op = nullptr;
    }
  }
  // Ends the send at `it` with `outcome`: at once, or, while writes still
  // read the caller's buffer, once they settled (`cancel`: canceled first,
  // as for a failed peer, so that a silent peer holds nothing up).
  void endSend(std::list<SendOp>& lane_ops, std::list<SendOp>::iterator it, OpResult outcome, bool cancel);
  void finishSettling(SendOp* op);
  // Whether `peer`'s transport carries credited chunks from the caller's buffer.
  bool sendsInPlace(te::SegmentHandle handle) const;
  // Whether receives from `peer` may land in the caller's buffer (it is
  // reached over tcp, whose writes a closed window cuts short).
  bool receivesInPlace(te::SegmentHandle handle) const;
  // Opens `op`'s buffer to `peer` as a receive window if the receive suits
  // one; false: it goes through the pool.
  bool openWindow(int peer, RecvOp& op);
  // Closes `op`'s window, if it has one: nothing lands there any more.
  void closeWindow(RecvOp& op);
  bool taintedByAnyPeer(uint64_t begin, uint64_t end) const;
  // Copies an arrival's payload to `to`; false if the slot no longer holds it.
  bool copyPayload(int peer, const Arrival& arrival, char* to) const;
  // Hands a piece of a receive's bytes to its sink, or copies it into its buffer.
  static void deliver(RecvOp& op, size_t offset, const char* bytes, size_t length) {
    if (op.sink) {
      op.sink(offset, bytes, length);
    } else {
      std::memcpy(op.data + offset, bytes, length);
    }
  }
  // A size mismatch found on this side (`sent`: the sender's size, when
  // known): the receive fails, takes no more credits, and the sender learns
  // by a credit of our size, unless credits already went out or it learns
  // anyway (`sender_told`: the release of its eager message says so).
  void refuse(int peer, RecvOp& op, bool sender_told = false, std::optional<uint64_t> sent = std::nullopt);
  // The error of a receive whose matching send has another size.
  static std::string receiveMismatch(int peer, const RecvOp& op, std::optional<uint64_t> sent = std::nullopt) {
    return "message size mismatch with rank " + std::to_string(peer) + ": this rank receives " +
           std::to_string(op.total) + " bytes, the matching send has " +
           (sent ? std::to_string(*sent) : std::string("a different size"));
  }
  // Tells the sender what was taken, when that is due (EagerWindow::
  // releaseDue), or whenever something was taken (`now`: at shutdown).
  void startRelease(int peer, bool now = false);
  static bool senderWaits(const EagerHeader& head) { return (head.flags & kEagerEndsWhenSent) == 0; }
  uint64_t eagerSlotRemote(int peer, uint32_t seq) const;
  const char* eagerSlot(int peer, uint32_t seq) const;
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
  // `into_window`: the credit names the receiver's own buffer, which only
  // tcp may write (kCreditInPlace).
  void startWrite(int peer, SendOp& op, const char* src, uint64_t remote, uint32_t length, const AckSlot& ack,
                  uint64_t ack_remote, bool into_window);
  // Submits one write from `staging` (a staging slot, or -1) on behalf of
  // `op` (a credited send, or null); one that cannot start is recorded as
  // failed, as above.
  void submitWrite(int peer, const te::TransferRequest& request, int staging, SendOp* op, bool release = false,
                   const std::string& transport = "");
  // Settles the writes that completed: messages whose bytes all landed
  // complete; a failed write fails its peer. An eager send that ends when
  // sent ends here once its write is on the wire; the write stays to be
  // reaped (its staging slot, its failure).
  bool reapWrites();
  void endWhenSent(int peer, SendOp& op);
  // Waits (bounded by the engine's deadlines) until no write is in flight,
  // so that the staging memory can go.
  void drainWrites();
  // Ends every message with `peer` and closes its lanes. Chunks it was
  // credited stay quarantined unless it is `gone` (see Peer::quarantined).
  // A peer that is `gone` had every eager message that landed in its ring:
  // those sends end well, as a credited send ends once its bytes landed (a
  // receiver that takes its last message and exits at once may never tell).
  void failPeer(int peer, const std::string& why, bool gone = false);
  void applyAbort(const std::string& why, const std::vector<int>& failed_ranks, bool mismatch);
  bool closedByPeer(int peer);
  // Returns to the pool the quarantined chunks of peers that told us they
  // reopened at our epoch (OpenSlot).
  void releaseQuarantine();
  // Writes the OpenSlot of the lanes' epoch to `peer` if it is owed; one
  // that fails is tried again (sendOpenNotices): the peer's eager writes
  // wait for it, and its receives of small messages with them.
  void sendOpenNotice(int peer);
  void sendOpenNotices();
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

  // Registered shared memory: [credits | acks | notices | outbox | staging | recv pool |
  // releases | release outbox | eager heads | credit outbox | eager rings].
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
  std::list<SendOp> settling_;  // sends that ended while in-place writes still read their buffers
  char* recv_pool_ = nullptr;      // pool_chunks chunks
  std::vector<int> free_chunks_;
  // The eager path: this rank's rings ([size][eager_slots_] slots of
  // eagerSlotStride(eager_bytes_)), the peers' releases of what it sent
  // them, the sources of its release writes, and of its header-only eager
  // writes ([size][kMaxEagerSlots]).
  uint64_t eager_bytes_ = 0;
  uint64_t eager_slots_ = 0;
  char* eager_ring_ = nullptr;
  ReleaseSlot* releases_ = nullptr;
  ReleaseSlot* release_outbox_ = nullptr;
  EagerHeader* eager_heads_ = nullptr;
  // The sources of credit writes in flight ([size][kSlotsPerLane], by the
  // credit's slot): a credit is not awaited, so its bytes must stay put
  // until the sender acknowledges it, which frees its slot.
  CreditSlot* credit_outbox_ = nullptr;
  std::atomic<uint64_t> eager_sent_{0};
  std::atomic<uint64_t> spilled_{0};
  std::atomic<uint64_t> received_in_place_{0};
  std::atomic<uint64_t> ended_when_sent_{0};

  std::vector<Peer> peers_;
  std::vector<RecvLane> recv_lanes_;
  std::vector<SendLane> send_lanes_;

  // Held by the thread moving the messages: the progress thread, or a
  // caller in drive(). Everything below the options that is not guarded by
  // mutex_ or atomic is touched only under it. Taken before mutex_.
  std::mutex step_mutex_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Posted> posted_;
  int drivers_ = 0;  // callers in drive() (mutex_): the progress thread stays out of their way
  // The lanes had work to poll when last stepped: the progress thread does
  // not sleep on the condition variable (written under step_mutex_).
  std::atomic<bool> lanes_busy_{false};
  // Writes are in flight that no message waits for (eager sends that ended
  // when sent, credits, releases): the progress thread reaps them about once
  // a millisecond, so that their staging slots come back and a failed one
  // fails its peer before the next call needs it (written under step_mutex_).
  std::atomic<bool> writes_in_flight_{false};
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
  // Eager slots: a message and its payload footer must fit a staging chunk;
  // the rings of all peers together stay within kEagerRingBudget.
  constexpr size_t kEagerRingBudget = 64u << 20;
  // A power of two: sequence numbers wrap at 2^32, and seq % slots must stay
  // in step across the wrap.
  eager_slots_ = std::min<size_t>(options_.eager_slots, kMaxEagerSlots);
  while (eager_slots_ & (eager_slots_ - 1)) eager_slots_ &= eager_slots_ - 1;
  eager_bytes_ = std::min(options_.eager_bytes, chunk > 128 ? chunk - 128 : 0);
  if (eager_slots_ > 0 && static_cast<size_t>(size) * eager_slots_ * eagerSlotStride(eager_bytes_) > kEagerRingBudget) {
    const size_t per_slot = kEagerRingBudget / (static_cast<size_t>(size) * eager_slots_);
    eager_bytes_ = per_slot > 128 ? (per_slot - 128) & ~size_t{63} : 0;
  }
  if (eager_bytes_ < 1024) eager_bytes_ = eager_slots_ = 0;  // too small to be worth a ring
  const size_t eager_ring_bytes = static_cast<size_t>(size) * eager_slots_ * eagerSlotStride(eager_bytes_);
  memory_bytes_ = slots * sizeof(CreditSlot) + slots * sizeof(AckSlot) + size * sizeof(PeerNotices) + sizeof(CloseSlot) +
                  chunk * staging_slots_ + chunk * options_.pool_chunks + 2 * size * sizeof(ReleaseSlot) +
                  size * kMaxEagerSlots * sizeof(EagerHeader) + slots * sizeof(CreditSlot) + eager_ring_bytes;
  // Shared memory: same-host peers write it through a mapping (a memcpy).
  memory_ = static_cast<char*>(te::allocateSharedMemory(memory_bytes_));
  if (memory_ == nullptr) throw std::runtime_error("P2P: cannot allocate " + std::to_string(memory_bytes_) + " bytes");
  credits_ = reinterpret_cast<CreditSlot*>(memory_);
  acks_ = reinterpret_cast<AckSlot*>(memory_ + slots * sizeof(CreditSlot));
  notices_ = reinterpret_cast<PeerNotices*>(memory_ + slots * (sizeof(CreditSlot) + sizeof(AckSlot)));
  outbox_ = reinterpret_cast<char*>(notices_ + size);
  staging_ = outbox_ + sizeof(CloseSlot);
  recv_pool_ = staging_ + chunk * staging_slots_;
  releases_ = reinterpret_cast<ReleaseSlot*>(recv_pool_ + chunk * options_.pool_chunks);
  release_outbox_ = releases_ + size;
  eager_heads_ = reinterpret_cast<EagerHeader*>(release_outbox_ + size);
  credit_outbox_ = reinterpret_cast<CreditSlot*>(eager_heads_ + static_cast<size_t>(size) * kMaxEagerSlots);
  eager_ring_ = reinterpret_cast<char*>(credit_outbox_ + slots);
  for (int p = 0; p < size; ++p) {
    reset(&releases_[p]);
    recv_lanes_[p].eager = EagerWindow(static_cast<uint32_t>(eager_slots_));
  }
  for (size_t i = 0; i < static_cast<size_t>(size) * eager_slots_; ++i) {
    reset(reinterpret_cast<EagerHeader*>(eager_ring_ + i * eagerSlotStride(eager_bytes_)));
  }
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
  std::lock_guard step(step_mutex_);
  std::lock_guard lock(mutex_);
  for (int p = 0; p < size_; ++p) {
    peers_[p].endpoint = peers[p];
    peers_[p].handle = engine_.openSegment(peers[p].segment);
    if (peers_[p].handle == te::kInvalidSegment) peers_[p].failure = "cannot reach rank " + std::to_string(p) + " at " + peers[p].segment;
    peers_[p].sends_in_place = sendsInPlace(peers_[p].handle);
    peers_[p].recv_in_place = receivesInPlace(peers_[p].handle);
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
      peer.tainted.clear();
      if (peer.handle != te::kInvalidSegment) engine_.closeSegment(peer.handle);
      peer.handle = engine_.openSegment(endpoint.segment);
      peer.sends_in_place = sendsInPlace(peer.handle);
      peer.recv_in_place = receivesInPlace(peer.handle);
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
    recv_lanes_[p].eager = EagerWindow(static_cast<uint32_t>(eager_slots_));
    send_lanes_[p] = SendLane{};
    peer.eager_open = false;  // until the peer says it reopened at this epoch too
    peer.open_owed = peer.failure.empty();  // tell the peer we serve no older credit
    peer.open_since = Clock::now();
    sendOpenNotice(p);
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

void P2pChannel::Impl::sendOpenNotice(int p) {
  Peer& peer = peers_[p];
  if (!peer.open_owed || !peer.failure.empty() || peer.handle == te::kInvalidSegment) return;
  peer.open_tried = Clock::now();
  OpenSlot notice{};
  seal(notice, openToken(peer.epoch));
  const uint64_t remote = peer.endpoint.notice_region + rank_ * sizeof(PeerNotices) + offsetof(PeerNotices, open);
  peer.open_owed = writeSlot(p, &notice, remote) != te::kOk;
}

void P2pChannel::Impl::sendOpenNotices() {
  const auto now = Clock::now();
  for (int p = 0; p < size_; ++p) {
    Peer& peer = peers_[p];
    if (!peer.open_owed) continue;
    // A peer unreachable for this long fails the messages posted to it by
    // its own checks (probes, timeouts): stop trying.
    if (now - peer.open_since > std::chrono::seconds(5)) {
      peer.open_owed = false;
    } else if (now - peer.open_tried > std::chrono::milliseconds(50)) {
      sendOpenNotice(p);
    }
  }
}

void P2pChannel::Impl::releaseQuarantine() {
  for (int p = 0; p < size_; ++p) {
    Peer& peer = peers_[p];
    OpenSlot notice;
    if (peer.quarantined.empty() && peer.tainted.empty()) continue;
    if (!tryLoad(&notices_[p].open, openToken(peer.epoch), notice)) continue;
    free_chunks_.insert(free_chunks_.end(), peer.quarantined.begin(), peer.quarantined.end());
    peer.quarantined.clear();
    peer.tainted.clear();
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

void P2pChannel::Impl::post(bool is_send, int peer, int tag, char* data, size_t bytes, Done done, Sink sink,
                            bool caller_drives, bool ends_when_sent) {
  {
    std::lock_guard lock(mutex_);
    posted_.push_back(Posted{is_send, peer, tag, data, bytes, std::move(done), std::move(sink),
                             ends_when_sent && options_.eager_ends_when_sent});
  }
  // A caller about to drive() moves it itself: waking the progress thread
  // would only have two threads compete for it (and for the cores).
  if (caller_drives && options_.caller_poll.count() > 0 && bytes <= eager_bytes_) return;
  cv_.notify_all();
}

int P2pChannel::Impl::writeSlot(int peer, const void* slot, uint64_t remote) {
  if (test_faults::trafficCut()) return te::kTimeout;  // lost on the cut cable
  std::memcpy(outbox_, slot, 64);
  return engine_.transferSync({te::TransferRequest{te::Opcode::kWrite, outbox_, peers_[peer].handle, remote, 64}});
}

void P2pChannel::Impl::startWrite(int peer, SendOp& op, const char* src, uint64_t remote, uint32_t length,
                                  const AckSlot& ack, uint64_t ack_remote, bool into_window) {
  int slot = -1;
  te::TransferRequest request{te::Opcode::kWrite, const_cast<char*>(src), peers_[peer].handle, remote, length};
  if (peers_[peer].sends_in_place) {
    request.unregistered_source = true;  // the caller's buffer, valid until the send ends
    op.in_place = true;
  } else {
    slot = free_staging_.back();
    free_staging_.pop_back();
    request.source = staging_ + static_cast<size_t>(slot) * options_.chunk_bytes;
    std::memcpy(request.source, src, length);
  }
  request.trailer = &ack;
  request.trailer_length = sizeof(AckSlot);
  request.trailer_target = ack_remote;
  request.remote_window = into_window;
  submitWrite(peer, request, slot, &op, /*release=*/false, into_window ? "tcp" : "");
}

bool P2pChannel::Impl::sendsInPlace(te::SegmentHandle handle) const {
  if (!options_.send_in_place || handle == te::kInvalidSegment) return false;
  const std::string transport = engine_.transportFor(handle);
  return transport == "tcp" || transport == "shm";
}

bool P2pChannel::Impl::receivesInPlace(te::SegmentHandle handle) const {
  return options_.recv_in_place && handle != te::kInvalidSegment && engine_.transportFor(handle) == "tcp";
}

bool P2pChannel::Impl::taintedByAnyPeer(uint64_t begin, uint64_t end) const {
  for (const Peer& peer : peers_) {
    for (const auto& [b, e] : peer.tainted) {
      if (b < end && begin < e) return true;
    }
  }
  return false;
}

bool P2pChannel::Impl::openWindow(int peer, RecvOp& op) {
  if (!peers_[peer].recv_in_place || op.sink || op.eager || op.total < options_.recv_in_place_min_bytes) return false;
  if (taintedByAnyPeer(addr(op.data), addr(op.data) + op.total)) return false;
  // Refused when the buffer overlaps registered memory (another receive's
  // window on the same buffer): then it goes through the pool.
  return engine_.openReceiveWindow(op.data, op.total) == te::kOk;
}

void P2pChannel::Impl::closeWindow(RecvOp& op) {
  if (!op.in_place) return;
  engine_.closeReceiveWindow(op.data);
  op.in_place = false;
}

void P2pChannel::Impl::endSend(std::list<SendOp>& lane_ops, std::list<SendOp>::iterator it, OpResult outcome,
                               bool cancel) {
  if (it->in_place && it->in_flight > 0) {
    if (cancel) {
      for (const PendingWrite& w : writes_) {
        if (w.op == &*it && w.batch != te::kInvalidBatch) engine_.cancelBatch(w.batch);
      }
    }
    it->settling = true;
    it->outcome = std::move(outcome);
    settling_.splice(settling_.end(), lane_ops, it);  // its writes keep pointing at it
    return;
  }
  forgetWritesOf(&*it);
  Done done = std::move(it->done);
  lane_ops.erase(it);
  done(outcome);
}

void P2pChannel::Impl::finishSettling(SendOp* op) {
  auto it = std::find_if(settling_.begin(), settling_.end(), [&](const SendOp& o) { return &o == op; });
  Done done = std::move(it->done);
  OpResult outcome = std::move(it->outcome);
  settling_.erase(it);
  done(outcome);
}

void P2pChannel::Impl::submitWrite(int peer, const te::TransferRequest& request, int staging, SendOp* op, bool release,
                                   const std::string& transport) {
  const te::BatchId batch = engine_.allocateBatchID(1);
  int rc = test_faults::trafficCut()    ? te::kTimeout  // lost on the cut cable
           : batch == te::kInvalidBatch ? te::kNotInitialized
                                        : engine_.submitTransfer(batch, {request}, transport);
  if (op != nullptr) op->in_flight++;
  if (release) peers_[peer].release_writes++;
  const auto length = static_cast<uint32_t>(request.length);
  if (rc != te::kOk) {  // not started: nothing to wait for, its slot is free again
    if (batch != te::kInvalidBatch) engine_.freeBatchID(batch);
    if (staging >= 0) free_staging_.push_back(staging);
    writes_.push_back(PendingWrite{te::kInvalidBatch, peer, -1, length, op, peers_[peer].epoch, release});
    return;
  }
  writes_.push_back(PendingWrite{batch, peer, staging, length, op, peers_[peer].epoch, release});
}

uint64_t P2pChannel::Impl::eagerSlotRemote(int peer, uint32_t seq) const {
  const P2pEndpoint& ep = peers_[peer].endpoint;
  return ep.eager_region + (static_cast<uint64_t>(rank_) * ep.eager_slots + seq % ep.eager_slots) *
                               eagerSlotStride(ep.eager_bytes);
}

const char* P2pChannel::Impl::eagerSlot(int peer, uint32_t seq) const {
  return eager_ring_ + (static_cast<size_t>(peer) * eager_slots_ + seq % eager_slots_) * eagerSlotStride(eager_bytes_);
}

bool P2pChannel::Impl::eagerWritable(int p) {
  Peer& peer = peers_[p];
  if (peer.eager_open) return true;
  OpenSlot notice;
  if (!tryLoad(&notices_[p].open, openToken(peer.epoch), notice)) return false;  // the peer has not reopened yet
  for (const PendingWrite& w : writes_) {
    if (w.peer == p && w.epoch != peer.epoch) return false;
  }
  peer.eager_open = true;
  return true;
}

void P2pChannel::Impl::startEagerWrite(int p, SendOp& op) {
  Peer& peer = peers_[p];
  const uint32_t seq = send_lanes_[p].eager_next++;
  const bool data = op.path == SendPath::kEager;
  EagerHeader head{};
  head.length = data ? op.total : 0;
  head.total = op.total;
  head.tag = op.tag;
  head.tag_seq = op.tag_seq;
  head.kind = data ? EagerKind::kData : EagerKind::kAnnounce;
  head.flags = data && op.ends_when_sent ? kEagerEndsWhenSent : 0;
  seal(head, token(peer.epoch, seq));
  op.eager_written = true;
  op.eager_seq = seq;
  const uint64_t remote = eagerSlotRemote(p, seq);
  if (data) eager_sent_.fetch_add(1, std::memory_order_relaxed);
  if (head.length == 0) {  // the head alone, whole in one 64-byte write
    EagerHeader* source = &eager_heads_[static_cast<size_t>(p) * kMaxEagerSlots + seq % kMaxEagerSlots];
    *source = head;
    submitWrite(p, te::TransferRequest{te::Opcode::kWrite, source, peer.handle, remote, sizeof(EagerHeader)}, -1,
                data ? &op : nullptr);
    return;
  }
  // The payload and its footer, then the head as the trailer: the receiver
  // sees the head only once the bytes are in place.
  const int slot = free_staging_.back();
  free_staging_.pop_back();
  char* staging = staging_ + static_cast<size_t>(slot) * options_.chunk_bytes;
  std::memcpy(staging, op.data, op.total);
  std::memcpy(staging + op.total, &head.header, sizeof(head.header));
  te::TransferRequest request{te::Opcode::kWrite, staging, peer.handle, remote + kEagerPayloadOffset,
                              op.total + sizeof(head.header)};
  request.trailer = &head;
  request.trailer_length = sizeof(EagerHeader);
  request.trailer_target = remote;
  submitWrite(p, request, slot, data ? &op : nullptr);
}

bool P2pChannel::Impl::harvestReleases(int p) {
  SendLane& lane = send_lanes_[p];
  ReleaseSlot release;
  if (!tryLoadOfEpoch(&releases_[p], peers_[p].epoch, release)) return false;
  const auto version = static_cast<uint32_t>(release.header);
  if (version == lane.release_version) return false;  // seen
  lane.release_version = version;
  const uint32_t count = release.count;
  if (seqBefore(count, lane.eager_released) || seqBefore(lane.eager_next, count)) return false;  // not one of ours
  // Messages that ended when sent and are taken by this release: one that
  // did not match its receive fails the peer, so the sender's next message
  // with it fails (its collective learns of the disagreement there).
  bool mismatch_learned = false;
  for (uint32_t seq = lane.eager_released; seq != lane.eager_next; ++seq) {
    const uint64_t bit = 1ull << (seq % 64);
    if ((lane.ended_unconfirmed & bit) == 0 || !releaseTook(count, release.taken_ahead, seq)) continue;
    lane.ended_unconfirmed &= ~bit;
    mismatch_learned = mismatch_learned || releasedAsMismatch(release.mismatch, seq);
  }
  lane.eager_released = count;
  for (auto it = lane.ops.begin(); it != lane.ops.end();) {
    if (it->path != SendPath::kEager || !it->eager_written || !releaseTook(count, release.taken_ahead, it->eager_seq)) {
      ++it;
      continue;
    }
    OpResult result;
    if (releasedAsMismatch(release.mismatch, it->eager_seq)) {
      result = failure(p, "message size mismatch with rank " + std::to_string(p) + ": this rank sends " +
                              std::to_string(it->total) + " bytes, the matching receive expects a different size");
      result.mismatch = true;
    }
    forgetWritesOf(&*it);  // its write may settle after the receiver took it
    Done done = std::move(it->done);
    it = lane.ops.erase(it);
    done(result);
  }
  peers_[p].last_progress = Clock::now();
  if (mismatch_learned && peers_[p].failure.empty()) {
    peers_[p].failure_ranks.clear();
    peers_[p].failure_blames_peer = true;
    peers_[p].failure_mismatch = true;
    failPeer(p, "message size mismatch with rank " + std::to_string(p) +
                    ": a message this rank sent earlier did not match the size of its receive there (the ranks "
                    "disagree on the operation); point-to-point with this rank is closed");
  }
  return true;
}

bool P2pChannel::Impl::stepEager(int p) {
  SendLane& lane = send_lanes_[p];
  const P2pEndpoint& ep = peers_[p].endpoint;
  if (lane.ops.empty() || ep.eager_slots == 0) return false;
  bool progressed = harvestReleases(p);
  if (!eagerWritable(p)) return progressed;
  for (SendOp& op : lane.ops) {
    if (op.path == SendPath::kUndecided) {
      const bool fits = op.total <= ep.eager_bytes && op.total + sizeof(uint64_t) <= options_.chunk_bytes;
      op.path = fits ? SendPath::kEager : SendPath::kCredited;
    }
    if (op.eager_written) continue;
    if (op.path == SendPath::kCredited && op.bound) {  // its receive credits it already: nothing to announce
      op.eager_written = true;
      continue;
    }
    // In post order: the ring is full, or a message waits for staging.
    if (lane.eager_next - lane.eager_released >= ep.eager_slots) break;
    if (op.path == SendPath::kEager && op.total > 0 && free_staging_.empty()) break;
    startEagerWrite(p, op);
    progressed = true;
  }
  return progressed;
}

bool P2pChannel::Impl::pollEager(int p) {
  RecvLane& lane = recv_lanes_[p];
  bool progressed = false;
  const uint32_t base = lane.eager.base();
  for (uint32_t seq = base; seq != base + lane.eager.slots(); ++seq) {
    if (!lane.eager.waiting(seq)) continue;
    EagerHeader head;
    if (!tryLoad(reinterpret_cast<const EagerHeader*>(eagerSlot(p, seq)), token(peers_[p].epoch, seq), head)) continue;
    lane.eager.arrived(seq);
    lane.arrivals.push_back(Arrival{seq, head, false, {}});
    progressed = true;
  }
  return progressed;
}

bool P2pChannel::Impl::copyPayload(int p, const Arrival& arrival, char* to) const {
  const size_t length = arrival.head.length;
  if (arrival.spilled) {
    if (length > 0) std::memcpy(to, arrival.bytes.data(), length);
    return true;
  }
  const char* slot = eagerSlot(p, arrival.seq);
  if (length > 0) std::memcpy(to, slot + kEagerPayloadOffset, length);
  std::atomic_thread_fence(std::memory_order_acquire);
  uint64_t footer = 0;
  if (arrival.head.kind == EagerKind::kData && length > 0) {
    std::memcpy(&footer, slot + kEagerPayloadOffset + length, sizeof(footer));
  } else {
    footer = arrival.head.header;
  }
  const uint64_t header = reinterpret_cast<const std::atomic<uint64_t>*>(slot)->load(std::memory_order_relaxed);
  return footer == arrival.head.header && header == arrival.head.header;
}

void P2pChannel::Impl::refuse(int p, RecvOp& op, bool sender_told, std::optional<uint64_t> sent) {
  if (op.error.empty()) op.error = receiveMismatch(p, op, sent);
  // A sender of credited bytes learns from a credit of our size; credits
  // already out tell it the same.
  if (!sender_told && (op.eager || (op.credited == 0 && op.in_flight == 0))) op.refusal_owed = true;
  op.eager = false;
  op.credits_done = true;
}

bool P2pChannel::Impl::matchEager(int p, bool& intact) {
  RecvLane& lane = recv_lanes_[p];
  bool progressed = false;
  for (auto it = lane.arrivals.begin(); it != lane.arrivals.end();) {
    const EagerHeader& head = it->head;
    if (!wellFormed(head, eager_bytes_)) {
      intact = false;  // not a head this protocol writes
      return progressed;
    }
    auto op = std::find_if(lane.ops.begin(), lane.ops.end(),
                           [&](const RecvOp& o) { return o.tag == head.tag && o.tag_seq == head.tag_seq; });
    if (op == lane.ops.end()) {
      if (!postedBefore(lane.next_tag_seq, head.tag, head.tag_seq)) {
        ++it;  // its receive is not posted yet
        continue;
      }
      // Its receive ended already (refused for a size mismatch): a message
      // with bytes counts as mismatched for the sender too.
      lane.eager.take(it->seq, head.kind == EagerKind::kData, senderWaits(head));
      it = lane.arrivals.erase(it);
      progressed = true;
      continue;
    }
    bool mismatch = false;
    if (head.kind == EagerKind::kAnnounce) {
      if (head.total != op->total) {
        refuse(p, *op);
      } else if (op->eager) {  // it comes by credits after all
        op->eager = false;
        op->credits_done = false;
      }
    } else if (head.length != op->total) {
      mismatch = true;  // the sender learns from the release
      refuse(p, *op, /*sender_told=*/true, head.length);
    } else {
      // A sink takes the bytes only once they are known intact.
      std::vector<char> taken(op->sink ? op->total : 0);
      if (!copyPayload(p, *it, op->sink ? taken.data() : op->data)) {
        intact = false;
        return progressed;
      }
      if (op->sink && op->total > 0) op->sink(0, taken.data(), op->total);
      op->received = op->total;
      op->eager = false;
      op->credits_done = true;  // credits already out are answered "sent eagerly"
    }
    lane.eager.take(it->seq, mismatch, senderWaits(head));
    it = lane.arrivals.erase(it);
    progressed = true;
  }
  // A full ring holds the sender up: move the oldest waiting message out.
  while (lane.eager.full()) {
    const uint32_t oldest = lane.eager.base();
    auto it = std::find_if(lane.arrivals.begin(), lane.arrivals.end(),
                           [&](const Arrival& a) { return a.seq == oldest && !a.spilled; });
    if (it == lane.arrivals.end()) break;
    std::vector<char> bytes(it->head.length);
    if (!copyPayload(p, *it, bytes.data())) {
      intact = false;
      return progressed;
    }
    it->bytes = std::move(bytes);
    it->spilled = true;
    lane.eager.take(oldest, false, senderWaits(it->head));
    spilled_.fetch_add(1, std::memory_order_relaxed);
    progressed = true;
  }
  return progressed;
}

void P2pChannel::Impl::startRelease(int p, bool now) {
  Peer& peer = peers_[p];
  RecvLane& lane = recv_lanes_[p];
  if (!(now ? lane.eager.releaseOwed() : lane.eager.releaseDue()) || peer.release_writes > 0 || !peer.failure.empty() ||
      peer.handle == te::kInvalidSegment) {
    return;
  }
  ReleaseSlot& source = release_outbox_[p];
  source = ReleaseSlot{};
  source.count = lane.eager.base();
  source.taken_ahead = lane.eager.takenAheadBits();
  source.mismatch = lane.eager.mismatchBits();
  seal(source, token(peer.epoch, lane.eager.tell()));
  submitWrite(p,
              te::TransferRequest{te::Opcode::kWrite, &source, peer.handle,
                                  peer.endpoint.release_region + static_cast<uint64_t>(rank_) * sizeof(ReleaseSlot),
                                  sizeof(ReleaseSlot)},
              -1, nullptr, /*release=*/true);
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
        SendOp* op = it->op;
        if (status.sent && op != nullptr && op->path == SendPath::kEager && op->ends_when_sent && !op->settling) {
          endWhenSent(it->peer, *op);  // forgets this write too: it is reaped later, as a write of nobody's
          progressed = true;
        }
        ++it;
        continue;
      }
      engine_.freeBatchID(it->batch);
      if (it->staging >= 0) free_staging_.push_back(it->staging);
      rc = status.state == te::TransferState::kCompleted ? te::kOk : status.error != te::kOk ? status.error : te::kTimeout;
    }
    const PendingWrite write = *it;
    it = writes_.erase(it);
    progressed = true;
    const int peer = write.peer;
    if (write.release) peers_[peer].release_writes--;
    if (write.op != nullptr) write.op->in_flight--;
    // A send that already ended waited for its last in-place write: it
    // completes now (and is gone after that).
    const bool of_an_ended_send = write.op != nullptr && write.op->settling;
    if (of_an_ended_send && write.op->in_flight == 0) finishSettling(write.op);
    if (rc == te::kCanceled) continue;  // asked for by this side, once the message had ended
    if (rc != te::kOk) {
      // A write of lanes since reopened (or already failed) fails nothing.
      if (write.epoch == peers_[peer].epoch && peers_[peer].failure.empty()) {
        failPeer(peer, "rank " + std::to_string(peer) + " is unreachable (" + te::errorName(rc) + ")");
      }
      continue;
    }
    if (write.op == nullptr || of_an_ended_send) continue;  // not a send's bytes, or its message already ended
    SendOp& op = *write.op;
    if (op.path == SendPath::kEager) {  // it ends when the receiver takes it, or now
      op.eager_landed = true;
      if (op.ends_when_sent) endWhenSent(peer, op);
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
      endSend(lane.ops, mine, OpResult{}, /*cancel=*/false);  // no write of it is in flight: it ends now
    }
    // Test only: the write's reply is lost after it landed; the message
    // stands, the peer counts as unreachable for what comes next.
    if (test_faults::ackRepliesLost()) {
      failPeer(peer, "rank " + std::to_string(peer) + " is unreachable (" + te::errorName(te::kPeerUnreachable) + ")");
    }
  }
  return progressed;
}

void P2pChannel::Impl::endWhenSent(int peer, SendOp& op) {
  SendLane& lane = send_lanes_[peer];
  lane.ended_unconfirmed |= 1ull << (op.eager_seq % 64);
  peers_[peer].last_progress = Clock::now();
  ended_when_sent_.fetch_add(1, std::memory_order_relaxed);
  auto mine = std::find_if(lane.ops.begin(), lane.ops.end(), [&](const SendOp& o) { return &o == &op; });
  endSend(lane.ops, mine, OpResult{}, /*cancel=*/false);  // its write read the eager ring, not the caller's buffer
}

void P2pChannel::Impl::drainWrites() {
  while (!writes_.empty()) {
    reapWrites();
    if (!writes_.empty()) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

void P2pChannel::Impl::failPeer(int peer, const std::string& why, bool gone) {
  Peer& p = peers_[peer];
  if (p.failure.empty() && eager_slots_ > 0) {  // what had fully arrived completes; the rest fails below
    bool intact = true;  // a slot found overwritten fails nothing more: the peer fails below
    takeEagerArrivals(peer, intact);
  }
  if (p.failure.empty()) harvestReleases(peer);
  if (p.failure.empty()) p.failure = why;
  harvestAcks(peer);
  RecvLane& rl = recv_lanes_[peer];
  for (const Outstanding& o : rl.outstanding) {
    if (o.chunk >= 0) p.quarantined.push_back(o.chunk);
  }
  for (const RecvOp& op : rl.ops) {  // windows the peer holds credits into
    if (op.in_place && op.in_flight > 0) p.tainted.emplace_back(addr(op.data), addr(op.data) + op.total);
  }
  if (gone) {  // nobody can write into them any more
    for (int c : p.quarantined) free_chunks_.push_back(c);
    p.quarantined.clear();
    p.tainted.clear();
    // Nor answer the writes of nobody's (credits, acks, releases) still on
    // their way to it: canceled, they stop holding the engine's workers
    // (which other peers' writes need) until their deadlines.
    for (const PendingWrite& w : writes_) {
      if (w.peer == peer && w.op == nullptr && w.batch != te::kInvalidBatch) engine_.cancelBatch(w.batch);
    }
  }
  rl.outstanding.clear();
  for (RecvOp& op : rl.ops) {
    closeWindow(op);  // before the receive ends: no write lands in its buffer after that
    op.done(failure(peer, p.failure));
  }
  rl.ops.clear();
  std::list<SendOp>& sends = send_lanes_[peer].ops;
  while (!sends.empty()) {
    const bool delivered = gone && sends.front().path == SendPath::kEager && sends.front().eager_landed;
    // A staged send's writes still settle without it, to free their staging slots.
    endSend(sends, sends.begin(), delivered ? OpResult{} : failure(peer, p.failure), /*cancel=*/true);
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
      if (op.error.empty()) op.error = receiveMismatch(peer, op);
      op.credits_done = true;  // issue nothing more for it
    } else if (ack.length == kAckSentEagerly) {
      // The bytes come (or came) through the eager ring; the chunk is unused.
    } else if (op.error.empty() && it->length > 0) {
      if (!it->in_place) deliver(op, it->offset, recv_pool_ + it->chunk * chunk, it->length);  // else it is there
      op.received += it->length;
    }
    if (it->chunk >= 0) free_chunks_.push_back(it->chunk);
    op.in_flight--;
    it = lane.outstanding.erase(it);
    progressed = true;
  }
  for (auto it = lane.ops.begin(); it != lane.ops.end();) {
    RecvOp& op = *it;
    bool finished = op.in_flight == 0 && op.credits_done && !op.eager && !op.refusal_owed &&
                    (op.received == op.total || !op.error.empty());
    if (!finished) {
      ++it;
      continue;
    }
    OpResult r = op.error.empty() ? OpResult{} : failure(peer, op.error);
    r.mismatch = !op.error.empty();  // the only error a receive keeps: the sender refused the pair (sizes differ)
    if (op.in_place && r.ok) received_in_place_.fetch_add(1, std::memory_order_relaxed);
    closeWindow(op);
    Done done = std::move(op.done);
    it = lane.ops.erase(it);
    done(r);
    progressed = true;
  }
  return progressed;
}

bool P2pChannel::Impl::stepRecv(int peer) {
  RecvLane& lane = recv_lanes_[peer];
  bool progressed = false;
  if (eager_slots_ > 0 && peers_[peer].failure.empty()) {
    bool intact = true;
    progressed |= takeEagerArrivals(peer, intact);
    if (!intact) {
      failPeer(peer, "an eager message from rank " + std::to_string(peer) +
                         " was overwritten in its slot or malformed; point-to-point with this rank is closed");
      return true;
    }
    startRelease(peer);  // before the receives complete: the sender's sends end with them
  }
  if (lane.ops.empty()) return progressed;
  const size_t chunk = options_.chunk_bytes;
  // Grant credits to every posted receive, in post order: a sender may only
  // have the message of a later receive ready (another tag).
  for (RecvOp& op : lane.ops) {
    while ((op.error.empty() && !op.credits_done) || op.refusal_owed) {
      uint32_t oldest = lane.outstanding.empty() ? lane.issue_seq : lane.outstanding.front().seq;
      for (const Outstanding& o : lane.outstanding) oldest = std::min(oldest, o.seq);
      if (lane.issue_seq - oldest >= static_cast<uint32_t>(kSlotsPerLane)) break;  // its slot is still in use
      const bool refusal = op.refusal_owed;  // no bytes: it only carries our size
      const uint32_t length = refusal ? 0 : static_cast<uint32_t>(std::min(chunk, op.total - op.credited));
      const bool in_place = op.in_place && length > 0;
      // Into its own buffer as many chunks at once as two pools hold.
      if (in_place && op.in_flight >= static_cast<int>(2 * options_.pool_chunks)) break;
      if (length > 0 && !in_place && free_chunks_.empty()) break;
      const int c = length > 0 && !in_place ? free_chunks_.back() : -1;
      if (c >= 0) free_chunks_.pop_back();
      const uint32_t seq = lane.issue_seq++;
      CreditSlot credit{};
      credit.recv_addr = in_place ? addr(op.data + op.credited) : c >= 0 ? addr(recv_pool_ + c * chunk) : 0;
      credit.flags = in_place ? kCreditInPlace : 0;
      credit.total = op.total;
      credit.length = length;
      credit.tag = op.tag;
      credit.op_id = op.op_id;
      credit.tag_seq = op.tag_seq;
      credit.offset = refusal ? 0 : op.credited;
      seal(credit, token(peers_[peer].epoch, seq));
      const uint64_t remote = peers_[peer].endpoint.credit_region +
                              (static_cast<uint64_t>(rank_) * kSlotsPerLane + seq % kSlotsPerLane) * sizeof(CreditSlot);
      lane.outstanding.push_back(Outstanding{seq, c, credit.offset, length, &op, in_place});
      op.in_flight++;
      if (refusal) {
        op.refusal_owed = false;
      } else {
        op.credited += length;
        op.credits_done = op.credited == op.total;
      }
      // Not awaited: across hosts a credit's round trip would hold up this
      // thread (and every other lane) for each chunk. A failed credit fails
      // the peer when reapWrites finds it, as a failed data write does.
      CreditSlot* source = &credit_outbox_[static_cast<size_t>(peer) * kSlotsPerLane + seq % kSlotsPerLane];
      *source = credit;
      submitWrite(peer, te::TransferRequest{te::Opcode::kWrite, source, peers_[peer].handle, remote, sizeof(CreditSlot)},
                  -1, nullptr);
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
      // else the send with the credit's tag and number.
      auto it = std::find_if(lane.ops.begin(), lane.ops.end(),
                             [&](const SendOp& op) { return op.bound && op.op_id == credit.op_id; });
      bool sent_eagerly = false;
      if (it == lane.ops.end()) {
        it = std::find_if(lane.ops.begin(), lane.ops.end(), [&](const SendOp& op) {
          return !op.bound && op.tag == credit.tag && op.tag_seq == credit.tag_seq;
        });
        if (it == lane.ops.end()) {
          if (!postedBefore(lane.next_tag_seq, credit.tag, credit.tag_seq)) continue;  // not posted yet
          sent_eagerly = true;  // it went through the eager ring and was taken
        } else if (it->path == SendPath::kEager && it->eager_written) {
          sent_eagerly = it->total == credit.total;  // else refused below
        } else {
          it->path = SendPath::kCredited;  // the receive credits it: its bytes go by credits
          it->eager_written = true;         // and nothing needs announcing
          it->bound = true;
          it->op_id = credit.op_id;
        }
      }
      // Credits may be served out of order (the window is scanned), so the
      // bytes come from the offset the credit names, not from a cursor.
      if (sent_eagerly) {
        ack.length = kAckSentEagerly;  // the receiver releases the chunk; the send ends with its release
      } else if (it->total != credit.total || credit.offset > it->total || credit.length > it->total - credit.offset) {
        lane.rejected_op_id = credit.op_id;
        lane.drain_until = Clock::now() + std::chrono::seconds(1);
        ack.length = kAckSizeMismatch;
        OpResult refused = failure(peer, "message size mismatch with rank " + std::to_string(peer) +
                                             ": this rank sends " + std::to_string(it->total) +
                                             " bytes, the matching receive expects " + std::to_string(credit.total));
        refused.mismatch = true;
        if (it->in_place && it->in_flight > 0) {
          // Its writes still read the caller's buffer: it ends once they
          // settled (the peer is alive: they are not canceled, so that
          // their acks still reach it).
          endSend(lane.ops, it, refused, /*cancel=*/false);
        } else {
          finished = std::move(it->done);
          finished_result = refused;
          forgetWritesOf(&*it);  // what it wrote before the refusal no longer counts
          lane.ops.erase(it);
        }
      } else if (credit.length > 0) {
        // Data: the write carries its ack as trailer and completes later
        // (reapWrites). Without a free staging slot, the credit waits
        // (unless its bytes go in place).
        if (!peers_[peer].sends_in_place && free_staging_.empty()) break;
        ack.length = credit.length;
        seal(ack, token(peers_[peer].epoch, seq));
        reset(slot);  // before the ack can land: the ack lets the receiver reuse the slot
        startWrite(peer, *it, it->data + credit.offset, credit.recv_addr, credit.length, ack, ackRemote(peer, index),
                   (credit.flags & kCreditInPlace) != 0);
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

bool P2pChannel::Impl::lanesBusy() const {
  if (!settling_.empty()) return true;  // sends that end once their writes settled
  const auto now = Clock::now();
  for (int p = 0; p < size_; ++p) {
    if (!recv_lanes_[p].ops.empty() || !send_lanes_[p].ops.empty() || now < send_lanes_[p].drain_until ||
        (recv_lanes_[p].eager.releaseDue() && peers_[p].failure.empty()) || peers_[p].open_owed) {
      return true;
    }
  }
  return false;
}

void P2pChannel::Impl::intake(std::vector<Posted>& incoming) {
  for (Posted& op : incoming) {
    Peer& peer = peers_[op.peer];
    if (!peer.failure.empty()) {
      op.done(failure(op.peer, peer.failure));
    } else if (op.is_send) {
      SendLane& lane = send_lanes_[op.peer];
      SendOp send{};
      send.tag = op.tag;
      send.data = op.data;
      send.total = op.bytes;
      send.done = std::move(op.done);
      send.tag_seq = lane.next_tag_seq[op.tag]++;
      send.ends_when_sent = op.ends_when_sent;
      lane.ops.push_back(std::move(send));
    } else {
      RecvLane& lane = recv_lanes_[op.peer];
      RecvOp recv{};
      recv.tag = op.tag;
      recv.data = op.data;
      recv.total = op.bytes;
      recv.done = std::move(op.done);
      recv.sink = std::move(op.sink);
      recv.op_id = lane.next_op_id++;
      recv.tag_seq = lane.next_tag_seq[op.tag]++;
      recv.eager = eager_slots_ > 0 && op.bytes <= eager_bytes_;
      recv.credits_done = recv.eager;  // it waits for an eager message, not credits
      recv.in_place = openWindow(op.peer, recv);
      lane.ops.push_back(std::move(recv));
    }
    if (recv_lanes_[op.peer].ops.size() + send_lanes_[op.peer].ops.size() == 1) peer.last_progress = Clock::now();
  }
}

bool P2pChannel::Impl::stepLanes() {
  bool progressed = reapWrites();
  for (int p = 0; p < size_; ++p) {
    progressed |= stepRecv(p);
    progressed |= stepEager(p);
    progressed |= stepSend(p);
  }
  return progressed;
}

void P2pChannel::Impl::drive(const std::function<bool()>& finished, size_t largest_bytes) {
  if (options_.caller_poll.count() <= 0 || largest_bytes > eager_bytes_ || finished()) {
    bool posted = false;
    {
      std::lock_guard lock(mutex_);
      posted = !posted_.empty();
    }
    if (posted) cv_.notify_all();  // messages posted for a driving caller are the progress thread's after all
    return;
  }
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return;
    ++drivers_;
  }
  auto last_progress = Clock::now();
  std::vector<Posted> incoming;
  bool pending = true;  // something on the lanes that the progress thread must see to
  while (!finished()) {
    bool progressed = false;
    if (step_mutex_.try_lock()) {
      {
        std::lock_guard lock(mutex_);
        if (stopping_) {
          step_mutex_.unlock();
          break;  // the progress thread ends what is pending
        }
        incoming.swap(posted_);
      }
      progressed = !incoming.empty();
      intake(incoming);
      incoming.clear();
      // Test only: a cut process neither reads its slots nor writes the
      // peers'. The progress thread's checks (timeouts, probes, notices)
      // stay with it: it looks in while callers drive.
      if (!test_faults::trafficCut()) progressed |= stepLanes();
      pending = lanesBusy();
      lanes_busy_.store(pending, std::memory_order_relaxed);
      writes_in_flight_.store(!writes_.empty(), std::memory_order_relaxed);
      step_mutex_.unlock();
    }
    const auto now = Clock::now();
    if (progressed) {
      last_progress = now;
    } else if (now - last_progress > options_.caller_poll) {
      break;
    } else {
      std::this_thread::yield();  // the bytes come through this host's TCP threads: let them run
    }
  }
  {
    std::lock_guard lock(mutex_);
    --drivers_;
    pending |= !posted_.empty();
  }
  // What is left on the lanes is the progress thread's again. Writes that
  // are only in flight (no message waits for them) are reaped by the next
  // caller or round, or by the progress thread's next look (about once a
  // millisecond): waking the thread for them alone would cost a core's time
  // on every call.
  if (pending) cv_.notify_all();
}

void P2pChannel::Impl::loop() {
  // Sleeps of a few microseconds must be that short: the default timer
  // slack (50 us) would add a network round trip to every wake-up.
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  int idle_rounds = 0;
  Clock::time_point idle_since = Clock::now();
  std::vector<ControlTask*> control;
  std::vector<Posted> incoming;
  // While callers drive the lanes, this thread only looks in this often:
  // timeouts, probes, the peers' notices.
  constexpr auto kDriverWatch = std::chrono::milliseconds(1);
  // How often it reaps writes that no message waits for when nothing else
  // is to do: their staging slots come back, and a failed write fails its
  // peer, well before a caller's next message with it is due to fail.
  constexpr auto kReapEvery = std::chrono::milliseconds(1);
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      if (drivers_ > 0) {
        cv_.wait_for(lock, kDriverWatch, [this] { return stopping_ || !control_.empty() || drivers_ == 0; });
      }
      if (drivers_ == 0 && !lanes_busy_.load(std::memory_order_relaxed)) {
        auto wake = [this] {
          return stopping_ || !posted_.empty() || !control_.empty() ||
                 (drivers_ == 0 && lanes_busy_.load(std::memory_order_relaxed));
        };
        // Writes nobody waits for: reaped at the next look.
        if (writes_in_flight_.load(std::memory_order_relaxed)) {
          cv_.wait_for(lock, kReapEvery, wake);
        } else {
          cv_.wait(lock, wake);
        }
      }
    }
    std::unique_lock step(step_mutex_);
    bool stopping = false;
    {
      std::lock_guard lock(mutex_);
      incoming.swap(posted_);
      control.swap(control_);
      stopping = stopping_;
    }
    for (ControlTask* task : control) {
      task->run();
      task->done.set_value();
    }
    control.clear();
    if (stopping) {
      std::lock_guard lock(mutex_);
      posted_.insert(posted_.begin(), std::make_move_iterator(incoming.begin()),
                     std::make_move_iterator(incoming.end()));
      break;
    }
    bool progressed = !incoming.empty();
    intake(incoming);
    incoming.clear();
    // Test only: a cut process neither reads its slots nor writes the peers'.
    const bool cut = test_faults::trafficCut();
    progressed |= cut ? reapWrites() : stepLanes();
    checkPeers(cut);
    if (!cut) {
      releaseQuarantine();
      sendOpenNotices();
      followReopens();
    }
    lanes_busy_.store(lanesBusy(), std::memory_order_relaxed);
    writes_in_flight_.store(!writes_.empty(), std::memory_order_relaxed);
    step.unlock();
    // Nothing moved: back off from spinning to short sleeps, so that waiting
    // for a slow peer does not burn a core.
    // A reply is due within about a round trip: keep polling (yielding the
    // core) for kPollFor, then sleep in steps that grow to 200 us.
    constexpr auto kPollFor = std::chrono::microseconds(500);
    if (progressed) {
      idle_rounds = 0;
      idle_since = Clock::now();
    } else {
      ++idle_rounds;
    }
    if (idle_rounds > 20 && Clock::now() - idle_since > kPollFor) {
      std::this_thread::sleep_for(std::chrono::microseconds(std::min((idle_rounds - 20) / 8 + 1, 200)));
    } else if (idle_rounds > 20) {
      std::this_thread::yield();
    }
  }
  // Shutting down (this thread holds step_mutex_ to the end): the peers
  // learn what this rank took (their sends of it end well), whatever is
  // pending fails, and no abort() waits forever.
  std::lock_guard step(step_mutex_);
  drainWrites();
  for (int p = 0; p < size_ && !test_faults::trafficCut(); ++p) startRelease(p, /*now=*/true);
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
size_t P2pChannel::chunkBytes() const { return impl_->chunkBytes(); }
void P2pChannel::connect(const std::vector<P2pEndpoint>& peers) { impl_->connect(peers); }
void P2pChannel::send(int peer, int tag, const void* data, size_t bytes, Done done, bool caller_drives,
                      bool ends_when_sent) {
  impl_->post(true, peer, tag, const_cast<char*>(static_cast<const char*>(data)), bytes, std::move(done), {},
              caller_drives, ends_when_sent);
}
void P2pChannel::recv(int peer, int tag, void* data, size_t bytes, Done done, bool caller_drives) {
  impl_->post(false, peer, tag, static_cast<char*>(data), bytes, std::move(done), {}, caller_drives);
}
void P2pChannel::recv(int peer, int tag, size_t bytes, Sink sink, Done done, bool caller_drives) {
  impl_->post(false, peer, tag, nullptr, bytes, std::move(done), std::move(sink), caller_drives);
}
void P2pChannel::drive(const std::function<bool()>& finished, size_t largest_bytes) {
  impl_->drive(finished, largest_bytes);
}
void P2pChannel::abort(const std::string& why, const std::vector<int>& failed_ranks, bool mismatch) {
  impl_->abort(why, failed_ranks, mismatch);
}
void P2pChannel::reopen(int peer, const P2pEndpoint& endpoint, uint32_t epoch) { impl_->reopen(peer, endpoint, epoch); }
void P2pChannel::close(int peer, const std::string& why) { impl_->close(peer, why); }
bool P2pChannel::isOpen(int peer) { return impl_->isOpen(peer); }
P2pCounters P2pChannel::counters() const { return impl_->counters(); }
bool P2pChannel::reachable(const P2pEndpoint& endpoint, std::chrono::milliseconds timeout) {
  return impl_->reachable(endpoint, timeout);
}

}  // namespace mooncake::pg
