// Point-to-point messages between the ranks of a group, receiver-driven:
// the receiver grants credits (a chunk of its receive pool, by address), the
// sender writes that chunk one-sidedly through the transfer engine and then
// writes an acknowledgement; the receiver copies the chunk out and reuses it.
// Nothing is sent before the receiver has room, so messages of any size flow
// through fixed pools, chunk by chunk.
//
// Small messages (up to the receiver's eager size) skip the credit: every
// receiver keeps a ring of eager slots per sender, which the sender writes
// at once (message and header in one write); the receiver copies a message
// out when its receive is posted and frees slots in order, telling the
// sender. A send completes when the receiver took it, so a size mismatch
// still fails both ends; a collective's may end once its write is on the
// wire instead (P2pOptions::eager_ends_when_sent).
//
// Order: FIFO per (peer, direction); among one peer's messages, a receive
// matches the oldest unmatched send with the same tag. Sends and receives
// progress independently, so any order inside a batch is deadlock-free.
// Every slot token carries the membership epoch and a sequence number.
// Failures (peer gone, size mismatch, no progress before the deadline) end
// the operation with an error naming the peer; nothing else is affected.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mooncake/pg/collectives.h"

namespace mooncake::te {
class TransferEngine;
}

namespace mooncake::pg {

struct P2pOptions {
  size_t chunk_bytes = 1u << 20;  // MOONCAKE_P2P_CHUNK_SIZE
  size_t pool_chunks = 8;         // MOONCAKE_P2P_POOL_SIZE / chunk
  std::chrono::milliseconds timeout{std::chrono::seconds(600)};  // without progress
  // Largest message sent eagerly (MOONCAKE_P2P_EAGER_SIZE; 0: none), at most
  // a chunk; slots per sender (a power of two, at most 32). The ring memory is
  // size × eager_slots × eager_bytes, so large groups get smaller slots.
  size_t eager_bytes = 64u << 10;
  size_t eager_slots = 8;
  // Credited chunks go from the sender's buffer as it is, without a staging
  // copy, to peers whose transport reads host memory in place (tcp, shm):
  // MOONCAKE_P2P_SEND_IN_PLACE=0 stages them. A send then ends only once no
  // write reads its buffer any more: writes to a failed peer are canceled.
  bool send_in_place = true;
  // Receives of at least recv_in_place_min_bytes from peers reached over
  // tcp land straight in the caller's buffer, opened to the peer as a
  // receive window for the call, without the pool's copy-out
  // (MOONCAKE_P2P_RECV_IN_PLACE=0: through the pool always). A window is
  // closed before its receive ends, cutting short writes still landing.
  bool recv_in_place = true;
  size_t recv_in_place_min_bytes = 256u << 10;
  // A caller waiting for messages of at most the eager size moves them on
  // its own thread (P2pChannel::drive) until none progressed for this long,
  // then sleeps and leaves them to the progress thread
  // (MOONCAKE_P2P_CALLER_POLL_US; 0: never).
  std::chrono::microseconds caller_poll{250};
  // A send posted with `ends_when_sent` (a collective's) that goes eagerly
  // ends once its write is on the wire (te::TransferStatus::sent), without
  // waiting for the receiver to take it: a size mismatch then fails only the
  // receive, and the sender learns of it (or of a failed write) on a later
  // message (MOONCAKE_P2P_EAGER_ENDS_WHEN_SENT=0: such sends end when taken,
  // as every other send).
  bool eager_ends_when_sent = true;
};

// What a rank publishes so peers can reach its slots (exchanged by the caller).
struct P2pEndpoint {
  std::string segment;        // transfer engine segment "host:port"
  uint64_t credit_region = 0;  // CreditSlot[size][64]: peers (as receivers) write here
  uint64_t ack_region = 0;     // AckSlot[size][64]: peers (as senders) write here
  uint64_t notice_region = 0;  // PeerNotices[size]: a peer that gives up or reopens writes here
  uint64_t eager_region = 0;   // eager slots [size][eager_slots]: peers (as senders) write here
  uint64_t release_region = 0;  // ReleaseSlot[size]: peers (as receivers of eager messages) write here
  uint64_t eager_bytes = 0;    // largest message this rank receives eagerly (0: none)
  uint64_t eager_slots = 0;

  std::string encode() const;
  static bool decode(const std::string& text, P2pEndpoint& out);
};

// What went which way, since the channel was made (for tests and tuning).
struct P2pCounters {
  uint64_t eager_sent = 0;  // messages this rank wrote into a peer's eager ring
  uint64_t spilled = 0;     // eager messages this rank moved out of a full ring before their receive
  uint64_t received_in_place = 0;  // messages received straight into the caller's buffer (a receive window)
  uint64_t ended_when_sent = 0;    // eager sends that ended once their write was on the wire
};

class P2pChannel {
 public:
  using Done = std::function<void(const OpResult&)>;
  // Takes the bytes [offset, offset + length) of a received message from
  // where they landed, instead of a copy into a buffer: a collective folds
  // them straight into its result. Runs on the thread moving the messages
  // (the progress thread, or a caller in drive()), once per
  // piece, pieces in any order, each starting at a multiple of the chunk
  // size (chunkBytes()); it must not throw.
  using Sink = std::function<void(size_t offset, const char* bytes, size_t length)>;

  // Registers this rank's slots and pools with `engine` (which must outlive
  // the channel). Throws std::runtime_error when registration fails.
  P2pChannel(te::TransferEngine& engine, int rank, int size, const P2pOptions& options);
  ~P2pChannel();

  P2pEndpoint localEndpoint() const;
  size_t chunkBytes() const;
  // The peers' endpoints, indexed by rank. Before the first send/recv.
  void connect(const std::vector<P2pEndpoint>& peers);

  // Queue a message; `done` runs when it ends, on the thread moving the
  // messages (the progress thread, or a caller in drive()). The buffer must
  // stay valid until then. `caller_drives`: the caller waits for it in
  // drive() right after posting, so the progress thread is not woken for a
  // message drive() will move (one of at most the eager size).
  // `ends_when_sent`: if it goes eagerly, it ends once its write is on the
  // wire (P2pOptions::eager_ends_when_sent), for callers that learn of a
  // lost or refused message from their next one anyway (collectives).
  void send(int peer, int tag, const void* data, size_t bytes, Done done, bool caller_drives = false,
            bool ends_when_sent = false);
  void recv(int peer, int tag, void* data, size_t bytes, Done done, bool caller_drives = false);
  // A receive whose bytes go to `sink` (which must stay valid until `done`).
  void recv(int peer, int tag, size_t bytes, Sink sink, Done done, bool caller_drives = false);
  // Moves messages (every lane's, not only the caller's) on the calling
  // thread while `finished()` is false and something progressed within the
  // caller-poll time (P2pOptions::caller_poll), instead of handing each step
  // to the progress thread and back: a small message whose bytes are in
  // memory then costs no thread hand-off. Only for waits on messages of at
  // most the eager size (`largest_bytes`); returns at once otherwise. The
  // caller then waits as before; nothing here waits without a bound. Not
  // from a completion callback.
  void drive(const std::function<bool()>& finished, size_t largest_bytes);

  // Gives up for good: every pending and later message fails with `why`,
  // naming `failed_ranks` (the ranks at fault, which need not include this
  // one), and every peer is told, so that its messages with this rank fail
  // the same way at once instead of waiting for the timeout. Blocks until the
  // peers were told (each write bounded by the engine's timeouts); call it
  // from the thread that posts, never from a completion callback.
  // `mismatch`: the failure is ranks disagreeing (OpResult::mismatch), which
  // the peers' failed messages then say too.
  void abort(const std::string& why, const std::vector<int>& failed_ranks, bool mismatch = false);

  // Reopens the lanes with `peer` at membership epoch `epoch` (after a view
  // change: the peer replaced by a new process at `endpoint`, or lanes that
  // were closed by a failure). Messages still pending with the peer fail.
  // Both sides must reopen at the same epoch: slots carry it, so a side that
  // reopens first simply goes unheard until the other follows, and slots of
  // earlier epochs are never taken for current ones. Pool chunks the peer
  // might still write under an earlier epoch are reused only once it
  // acknowledges under the new one (or was replaced). Blocks until applied;
  // not from a completion callback.
  void reopen(int peer, const P2pEndpoint& endpoint, uint32_t epoch);
  // Closes the lanes with `peer` because the membership gave up on it (a
  // view deactivated it): its pending messages fail at once with `why`,
  // naming it, instead of waiting for the timeout on a peer that may be
  // alive but cut off; so do later ones until reopen(). Nothing is sent to
  // the peer. Blocks until applied; not from a completion callback.
  void close(int peer, const std::string& why);
  // Whether the transfer engine behind `endpoint` answers a probe within
  // `timeout` (link evidence for the membership). Any thread.
  bool reachable(const P2pEndpoint& endpoint, std::chrono::milliseconds timeout);
  // Whether the lanes with `peer` are usable (connected, not closed by a
  // failure). A side that reopens tells the peer, which follows at once if
  // its own lanes are at an earlier epoch (so one side's reopen is enough
  // after a one-sided failure). Not from a completion callback.
  bool isOpen(int peer);
  P2pCounters counters() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mooncake::pg
