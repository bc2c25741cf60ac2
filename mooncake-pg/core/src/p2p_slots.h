// The 64-byte control slots of the P2P credit protocol. A slot is written by
// a peer through the transfer engine in one piece; its header and footer
// carry the same token, so a reader that sees them equal saw a whole slot
// (payload written between them), whatever order the bytes landed in.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>

namespace mooncake::pg::p2p {

constexpr uint64_t kEmptyToken = ~0ull;
constexpr int kSlotsPerLane = 64;  // credits in flight per (peer, direction)
constexpr uint32_t kAckSizeMismatch = 0xffffffffu;
// "The message this credit is for went through your eager ring": the
// credited chunk stays unused (the two ends chose paths differently).
constexpr uint32_t kAckSentEagerly = 0xfffffffeu;

inline uint64_t token(uint32_t epoch, uint32_t seq) { return (static_cast<uint64_t>(epoch) << 32) | seq; }

// Receiver -> sender: "write up to `length` bytes of your message at
// `recv_addr`". `total` is the receiver's whole message size, so the sender
// can refuse a mismatched pair instead of spilling into the next message.
struct alignas(64) CreditSlot {
  uint64_t header;
  uint64_t recv_addr;
  uint64_t total;
  uint64_t offset;  // where in that message the credited bytes start
  uint32_t length;
  int32_t tag;
  uint32_t op_id;   // which of the receiver's messages (per lane) this credit serves
  uint32_t tag_seq;  // which message of that tag (per lane): the send it pairs with
  uint32_t flags;    // kCreditInPlace
  uint8_t reserved[4];
  uint64_t footer;
};
static_assert(sizeof(CreditSlot) == 64);
// The credit names the receiver's own buffer (a receive window), which only
// writes over tcp may reach: closing the window cuts those short.
constexpr uint32_t kCreditInPlace = 1;

// Sender -> receiver: "the bytes of credit `seq` are in place" (or, with
// length == kAckSizeMismatch, "your message size does not match mine").
struct alignas(64) AckSlot {
  uint64_t header;
  uint32_t length;
  uint8_t reserved[44];
  uint64_t footer;
};
static_assert(sizeof(AckSlot) == 64);

// Sender -> receiver, the head of a slot of the receiver's eager ring (see
// p2p_eager.h). A data message's head is its write's trailer, so it lands
// after the payload; the payload is followed by the head's token too, which
// tells a slot whose bytes a stale write overwrote from a whole one.
enum class EagerKind : uint32_t {
  kData = 0,      // `length` bytes of payload follow the head
  kAnnounce = 1,  // no payload: "message `tag_seq` of `total` bytes comes by credits"
};
struct alignas(64) EagerHeader {
  uint64_t header;
  uint64_t length;  // payload bytes
  uint64_t total;   // the sender's message size
  int32_t tag;
  uint32_t tag_seq;
  EagerKind kind;
  uint32_t flags;  // kEagerEndsWhenSent
  uint8_t reserved[16];
  uint64_t footer;
};
static_assert(sizeof(EagerHeader) == 64);
// The sender's send ended once its write was on the wire: nobody waits for
// this message's release, so the receiver may gather releases (EagerWindow).
constexpr uint32_t kEagerEndsWhenSent = 1;
// Where a slot's payload starts, and how far apart slots of `eager_bytes` lie.
constexpr size_t kEagerPayloadOffset = sizeof(EagerHeader);
inline size_t eagerSlotStride(size_t eager_bytes) {
  return kEagerPayloadOffset + ((eager_bytes + sizeof(uint64_t) + 63) & ~size_t{63});
}

// Whether a head (whole, as tryLoad saw it) is one this protocol writes, for
// rings of `eager_bytes` per slot: then its payload and the token after it
// lie inside the slot. Anything else in a ring is never acted on.
inline bool wellFormed(const EagerHeader& head, uint64_t eager_bytes) {
  if (head.kind != EagerKind::kData && head.kind != EagerKind::kAnnounce) return false;
  if (head.length > eager_bytes) return false;
  return head.kind != EagerKind::kData || head.length == head.total;
}

// Receiver -> sender: "I took your eager messages below `count`, and those
// of `taken_ahead` (bit seq % 64) above it"; bit seq % 64 of `mismatch`:
// message seq did not match its receive's size. Sealed with token(epoch,
// version), a new version per release, so that a torn slot never passes.
struct alignas(64) ReleaseSlot {
  uint64_t header;
  uint32_t count;
  uint32_t reserved0;
  uint64_t taken_ahead;
  uint64_t mismatch;
  uint8_t reserved[24];
  uint64_t footer;
};
static_assert(sizeof(ReleaseSlot) == 64);

// A rank that gives up -> every peer: "fail what you have with me; these
// ranks are at fault, for this reason". Written once per lane epoch, sealed
// with closeToken(epoch): a notice of an earlier epoch does not close lanes
// reopened since.
inline uint64_t closeToken(uint32_t epoch) { return 0x436c6f7300000000ull ^ epoch; }  // "Clos" + epoch
struct alignas(64) CloseSlot {
  uint64_t header;
  uint64_t failed_mask[4];  // ranks at fault, below 256
  uint32_t mismatch;        // 1: ranks disagreed on an operation (OpResult::mismatch)
  uint32_t reserved;
  char reason[456];
  uint64_t footer;
};
static_assert(sizeof(CloseSlot) == 512);

// A rank that reopened its lanes with a peer at an epoch -> that peer: "I
// serve no credit of an earlier epoch any more", so the peer may reuse the
// pool chunks it had quarantined. Sealed with openToken(epoch).
struct alignas(64) OpenSlot {
  uint64_t header;
  uint8_t reserved[48];
  uint64_t footer;
};
static_assert(sizeof(OpenSlot) == 64);
inline uint64_t openToken(uint32_t epoch) { return 0x4f70656e00000000ull ^ epoch; }  // "Open" + epoch

// What each peer may write about its lanes with this rank: one per peer.
struct alignas(64) PeerNotices {
  CloseSlot close;
  OpenSlot open;
};

template <typename Slot>
void seal(Slot& slot, uint64_t tok) {
  slot.footer = tok;
  slot.header = tok;
}

// Copies the slot out if it holds `expected`, whole. Acquire on the header,
// then the payload, then an acquire fence before the footer.
template <typename Slot>
bool tryLoad(const Slot* shared, uint64_t expected, Slot& out) {
  auto* header = reinterpret_cast<const std::atomic<uint64_t>*>(&shared->header);
  if (header->load(std::memory_order_acquire) != expected) return false;
  std::memcpy(&out, shared, sizeof(Slot));
  std::atomic_thread_fence(std::memory_order_acquire);
  auto* footer = reinterpret_cast<const std::atomic<uint64_t>*>(&shared->footer);
  return footer->load(std::memory_order_relaxed) == expected && out.header == expected;
}

// Copies the slot out if it holds a whole token of `epoch` (any sequence
// number), for slots that carry a count rather than an expected token.
template <typename Slot>
bool tryLoadOfEpoch(const Slot* shared, uint32_t epoch, Slot& out) {
  auto* header = reinterpret_cast<const std::atomic<uint64_t>*>(&shared->header);
  const uint64_t seen = header->load(std::memory_order_acquire);
  if (seen == kEmptyToken || (seen >> 32) != epoch) return false;
  return tryLoad(shared, seen, out);
}

template <typename Slot>
void reset(Slot* shared) {
  reinterpret_cast<std::atomic<uint64_t>*>(&shared->header)->store(kEmptyToken, std::memory_order_relaxed);
  reinterpret_cast<std::atomic<uint64_t>*>(&shared->footer)->store(kEmptyToken, std::memory_order_release);
}

}  // namespace mooncake::pg::p2p
