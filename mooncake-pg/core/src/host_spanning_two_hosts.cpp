// HostSpanningGroup: the leaders' all_reduce when there are exactly two
// hosts. Two sources fold to the same bits in either order, so the leaders
// agree without ordering anything, and the other leader's bytes are folded
// where they land in the receive pool (a sink), with no copy in between.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <vector>

#include "host_spanning_internal.h"
#include "mooncake/pg/host_spanning_group.h"

namespace mooncake::pg {
namespace {

// From this size the leaders reduce by halves (each folds one half and
// sends it back whole): half the folding, and a working set of the tensor
// and the pools, as Gloo's ring of two has.
constexpr size_t kHalvesBytes = 1u << 20;

// Piece `j` of `pieces` of the half [begin, begin + length): its first
// element and its element count.
struct Piece {
  size_t at, count;
};
Piece pieceOf(size_t begin, size_t length, size_t j, size_t pieces) {
  const size_t from = length * j / pieces, to = length * (j + 1) / pieces;
  return Piece{begin + from, to - from};
}

}  // namespace

bool HostSpanningGroup::foldsWhereItLands(DataType type) const {
  // A sink's pieces start at multiples of the channel's chunk: whole elements only.
  return channel_->chunkBytes() % elementSize(type) == 0;
}

bool HostSpanningGroup::byHalves(size_t count, DataType type) const {
  // Only with one rank on each host. Both leaders must take the same form,
  // so it depends on the whole layout, never on this host's size alone.
  // With host mates on either host, the leaders fold in one exchange.
  return layout_.hosts() == 2 && layout_.ranks() == 2 && foldsWhereItLands(type) &&
         count * elementSize(type) >= kHalvesBytes;
}

OpResult HostSpanningGroup::leadersAcrossTwoHosts(const void* mine, void* buf, size_t count, DataType type,
                                                 ReduceOp op, bool* wrote) {
  if (byHalves(count, type)) return leadersByHalves(mine, buf, count, type, op, wrote);
  if (foldsWhereItLands(type) && mine != buf) return leadersFoldExchange(mine, buf, count, type, op);
  return leadersExchangeAndFold(mine, buf, count, type, op, tagOf(OpCode::kAllreduce));
}

OpResult HostSpanningGroup::leadersFoldExchange(const void* mine, void* buf, size_t count, DataType type,
                                               ReduceOp op) {
  const size_t esize = elementSize(type);
  const auto* own = static_cast<const char*>(mine);
  auto* data = static_cast<char*>(buf);
  const int other = layout_.leaderOf(1 - host_);
  P2pExchange x(*channel_, tagOf(OpCode::kAllreduce), channel_rank_of_);
  x.send(other, own, count * esize);
  x.recv(other, count * esize, [own, data, esize, type, op](size_t at, const char* theirs, size_t n) {
    const void* sources[] = {own + at, theirs};
    reduceInto(data + at, sources, 2, n / esize, type, op);
  });
  return x.wait();
}

OpResult HostSpanningGroup::leadersByHalves(const void* mine, void* buf, size_t count, DataType type, ReduceOp op,
                                           bool* wrote) {
  const size_t esize = elementSize(type);
  const auto* in = static_cast<const char*>(mine);
  auto* out = static_cast<char*>(buf);
  const int other = layout_.leaderOf(1 - host_);
  // Host 0 folds the first half, host 1 the second; each half goes in
  // `pieces` pieces, so that a folded piece travels back while later ones
  // are still coming in.
  const size_t half_begin[] = {0, count / 2}, half_length[] = {count / 2, count - count / 2};
  const size_t own_begin = half_begin[host_], own_length = half_length[host_];
  const size_t their_begin = half_begin[1 - host_], their_length = half_length[1 - host_];
  const size_t piece_bytes = std::max(kFoldSegmentBytes, half_length[1] * esize / kMaxFoldSegments);
  const size_t pieces = std::max<size_t>(1, (half_length[1] * esize + piece_bytes - 1) / piece_bytes);
  auto folded = std::make_shared<std::atomic<bool>>(false);  // shared with the sinks
  std::vector<std::unique_ptr<P2pExchange>> folds, returns;
  // 1. Every piece of their half goes to them; every piece of ours comes in
  //    and is folded with our own bytes into `buf` (in place: the same bytes).
  for (size_t j = 0; j < pieces; ++j) {
    auto x = std::make_unique<P2pExchange>(*channel_, tagOf(OpCode::kAllreduce), channel_rank_of_);
    const Piece theirs = pieceOf(their_begin, their_length, j, pieces), ours = pieceOf(own_begin, own_length, j, pieces);
    x->send(other, in + theirs.at * esize, theirs.count * esize);
    const char* own = in + ours.at * esize;
    char* into = out + ours.at * esize;
    x->recv(other, ours.count * esize, [own, into, esize, type, op, folded](size_t at, const char* theirs, size_t n) {
      const void* sources[] = {own + at, theirs};
      reduceInto(into + at, sources, 2, n / esize, type, op);
      folded->store(true, std::memory_order_relaxed);
    });
    folds.push_back(std::move(x));
  }
  // 2. Once piece j is folded here and sent there, our folded piece j goes
  //    back, and their folded piece j may land over what we sent (in place,
  //    it is the same memory).
  OpResult result;
  for (size_t j = 0; j < pieces; ++j) {
    OpResult r = folds[j]->wait();  // every message is awaited, also after a failure
    if (!r.ok && result.ok) result = r;
    if (!result.ok) continue;
    auto x = std::make_unique<P2pExchange>(*channel_, tagOf(OpCode::kAllreduce), channel_rank_of_);
    const Piece ours = pieceOf(own_begin, own_length, j, pieces), theirs = pieceOf(their_begin, their_length, j, pieces);
    x->send(other, out + ours.at * esize, ours.count * esize);
    x->recv(other, out + theirs.at * esize, theirs.count * esize);
    returns.push_back(std::move(x));
  }
  for (auto& x : returns) {
    OpResult r = x->wait();
    if (!r.ok && result.ok) result = r;
  }
  if (wrote != nullptr) *wrote = folded->load(std::memory_order_relaxed) || !returns.empty();
  return result;
}

}  // namespace mooncake::pg
