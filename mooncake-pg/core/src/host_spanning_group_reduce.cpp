// HostSpanningGroup: the reducing collectives. Each host first reduces its
// ranks' inputs in shared memory, so only one buffer per host crosses the
// network. AVG is summed in parts and divided once at the end.
#include <algorithm>
#include <cstring>
#include <memory>

#include "host_spanning_internal.h"
#include "mooncake/pg/host_spanning_group.h"

namespace mooncake::pg {
namespace {

// Up to this size the leaders of more than two hosts reduce in one
// exchange of whole buffers: one network latency, instead of 2(H-1) ring
// steps.
constexpr size_t kLeadersOneExchangeBytes = 256 * 1024;

ReduceOp partialOp(ReduceOp op) { return op == ReduceOp::kAvg ? ReduceOp::kSum : op; }

}  // namespace

OpResult HostSpanningGroup::leadersExchangeAndFold(const void* mine, void* buf, size_t count, DataType type,
                                                  ReduceOp op, int tag) {
  const int hosts = layout_.hosts();
  const size_t esize = elementSize(type);
  const size_t bytes = count * esize;
  const auto* own = static_cast<const char*>(mine);
  auto* data = static_cast<char*>(buf);
  char* theirs = atLeast(leaders_incoming_, (hosts - 1) * bytes);
  const size_t segment = std::max<size_t>(1, std::max(kFoldSegmentBytes, bytes / kMaxFoldSegments) / esize);
  // Every segment's messages are posted at once; the channel moves them in
  // order (FIFO per peer and tag), so segment k is in long before the last.
  std::vector<std::unique_ptr<P2pExchange>> steps;
  for (size_t begin = 0; begin < count; begin += segment) {
    const size_t n = std::min(segment, count - begin);
    auto x = std::make_unique<P2pExchange>(*channel_, tag, channel_rank_of_);
    for (int h = 0, slot = 0; h < hosts; ++h) {
      if (h == host_) continue;
      x->send(layout_.leaderOf(h), own + begin * esize, n * esize);
      x->recv(layout_.leaderOf(h), theirs + (slot++) * bytes + begin * esize, n * esize);
    }
    steps.push_back(std::move(x));
  }
  // Every leader folds the same sources in host order, so all leaders
  // compute bit-identical results. A segment's fold writes only that
  // segment, whose sends have ended with its exchange.
  OpResult result;
  std::vector<const void*> sources(hosts);
  for (size_t k = 0; k < steps.size(); ++k) {
    OpResult r = steps[k]->wait();  // every step is awaited, also after a failure
    if (!r.ok && result.ok) result = r;
    if (!result.ok) continue;
    const size_t begin = k * segment, n = std::min(segment, count - begin);
    for (int h = 0, slot = 0; h < hosts; ++h) {
      sources[h] = h == host_ ? own + begin * esize : theirs + (slot++) * bytes + begin * esize;
    }
    reduceInto(data + begin * esize, sources.data(), hosts, n, type, op);
  }
  return result;
}

OpResult HostSpanningGroup::leadersAllreduce(const void* mine, void* buf, size_t count, DataType type, ReduceOp op,
                                             int tag, bool* wrote) {
  const int hosts = layout_.hosts();
  const size_t esize = elementSize(type);
  auto* data = static_cast<char*>(buf);
  if (hosts == 2) return leadersAcrossTwoHosts(mine, buf, count, type, op, wrote);
  if (count * esize <= kLeadersOneExchangeBytes || count < static_cast<size_t>(hosts)) {
    return leadersExchangeAndFold(mine, buf, count, type, op, tag);
  }
  if (mine != buf) std::memcpy(buf, mine, count * esize);
  // Ring: segment i is reduced on its way around, then passed on whole.
  auto begin = [&](int i) { return count * static_cast<size_t>(i) / hosts; };
  auto length = [&](int i) { return begin(i + 1) - begin(i); };
  const int next = layout_.leaderOf((host_ + 1) % hosts);
  const int prev = layout_.leaderOf((host_ + hosts - 1) % hosts);
  Scratch incoming((count / hosts + 1) * esize);
  for (int s = 0; s < hosts - 1; ++s) {  // reduce-scatter
    const int out = (host_ - s + hosts) % hosts, in = (host_ - s - 1 + 2 * hosts) % hosts;
    P2pExchange x(*channel_, tag, channel_rank_of_);
    x.send(next, data + begin(out) * esize, length(out) * esize);
    x.recv(prev, incoming.data(), length(in) * esize);
    OpResult r = x.wait();
    if (!r.ok) return r;
    const void* sources[] = {data + begin(in) * esize, incoming.data()};
    reduceInto(data + begin(in) * esize, sources, 2, length(in), type, op);
  }
  for (int s = 0; s < hosts - 1; ++s) {  // all-gather of the reduced segments
    const int out = (host_ + 1 - s + hosts) % hosts, in = (host_ - s + hosts) % hosts;
    P2pExchange x(*channel_, tag, channel_rank_of_);
    x.send(next, data + begin(out) * esize, length(out) * esize);
    x.recv(prev, data + begin(in) * esize, length(in) * esize);
    OpResult r = x.wait();
    if (!r.ok) return r;
  }
  return {};
}

OpResult HostSpanningGroup::allreduce(const void* input, void* output, size_t count, DataType type, ReduceOp op) {
  OpResult r;
  if (failedBefore(r)) return r;
  const ReduceOp part = partialOp(op);
  const size_t bytes = count * elementSize(type);
  const bool alone = local_->size() == 1;
  // In place, the leader sums into a scratch buffer, so that its input is
  // intact until the result is complete: a failed all_reduce can then be
  // run again over the survivors. In a world of two ranks on two hosts,
  // reducing by halves, each folds in its tensor instead (a copy of its
  // size less, and a working set that stays in the cache); once it folded,
  // a failure reports the output written, and the call raises. Only there:
  // the survivor is alone, while with more survivors some could run the
  // call again and others not, and the ones running it again would pair it
  // with the others' next call.
  const bool in_tensor = layout_.ranks() == 2 && byHalves(count, type);
  const bool via_scratch = isLeader() && input == output && !in_tensor;
  void* sum = via_scratch ? atLeast(in_place_sum_, bytes) : output;
  // A rank alone on its host skips the local reduction (a copy): its
  // input is its host's part as it is. Across two hosts a leader with host
  // mates reduces its host's part apart from the sum, which the other
  // host's part is then folded into where it lands.
  const bool part_apart = isLeader() && !alone && layout_.hosts() == 2 && foldsWhereItLands(type);
  void* host_part = alone ? const_cast<void*>(input) : part_apart ? atLeast(leaders_incoming_, bytes) : sum;
  if (!alone && !(r = fromLocal(local_->reduce(input, host_part, count, type, part, 0))).ok) return settle(r);
  if (isLeader() && layout_.hosts() > 1) {
    bool wrote = false;
    r = leadersAllreduce(host_part, sum, count, type, part, tagOf(OpCode::kAllreduce), &wrote);
    if (!r.ok) {
      r.output_written = wrote && sum == input;
      return settle(r);
    }
  }
  if (alone && layout_.hosts() == 1 && sum != input) std::memcpy(sum, input, bytes);
  if (!(r = fromLocal(local_->broadcast(sum, bytes, 0))).ok) return settle(r);  // says if it wrote part of it
  if (via_scratch) std::memcpy(output, sum, bytes);
  if (op == ReduceOp::kAvg) divideBy(output, count, type, size());
  return r;
}

OpResult HostSpanningGroup::reduce(const void* input, void* output, size_t count, DataType type, ReduceOp op,
                                   int root) {
  OpResult r;
  if (failedBefore(r)) return r;
  const ReduceOp part = partialOp(op);
  const size_t bytes = count * elementSize(type);
  const int root_host = layout_.hostOf(root);
  // On the root's host the root itself collects (no extra hop); elsewhere
  // the leader does, and sends its host's partial result to the root.
  const int collector = host_ == root_host ? root : layout_.leaderOf(host_);
  // The root collects in place only out of place: otherwise its input must
  // stay intact until the result is complete (see allreduce).
  const bool root_in_place = rank_ == root && input == output;
  Scratch partial(rank_ == collector && (rank_ != root || root_in_place) ? bytes : 0);
  void* into = rank_ == root && !root_in_place ? output : partial.data();
  if (!(r = fromLocal(local_->reduce(input, into, count, type, part, layout_.localIndexOf(collector)))).ok) {
    return settle(r);
  }
  if (rank_ == root && layout_.hosts() > 1) {
    Scratch theirs((layout_.hosts() - 1) * bytes);
    std::vector<const void*> sources(layout_.hosts());
    P2pExchange x(*channel_, tagOf(OpCode::kReduce), channel_rank_of_);
    for (int h = 0, slot = 0; h < layout_.hosts(); ++h) {
      if (h == host_) {
        sources[h] = into;
        continue;
      }
      char* from = theirs.data() + (slot++) * bytes;
      x.recv(layout_.leaderOf(h), from, bytes);
      sources[h] = from;
    }
    if (!(r = x.wait()).ok) return settle(r);
    reduceInto(output, sources.data(), layout_.hosts(), count, type, part);
  } else if (root_in_place) {
    std::memcpy(output, partial.data(), bytes);
  } else if (rank_ == collector && rank_ != root) {
    P2pExchange x(*channel_, tagOf(OpCode::kReduce), channel_rank_of_);
    x.send(root, partial.data(), bytes);
    if (!(r = x.wait()).ok) return settle(r);
  }
  if (rank_ == root && op == ReduceOp::kAvg) divideBy(output, count, type, size());
  return r;
}

OpResult HostSpanningGroup::reduceScatter(const void* input, void* output, size_t count, DataType type, ReduceOp op) {
  OpResult r;
  if (failedBefore(r)) return r;
  const ReduceOp part = partialOp(op);
  const size_t block = count * elementSize(type);
  const std::vector<int>& mine = layout_.ranksOn(host_);
  Scratch host_sum(isLeader() ? block * size() : 0);
  Scratch for_mine(isLeader() ? block * mine.size() : 0);
  if (!(r = fromLocal(local_->reduce(input, host_sum.data(), count * size(), type, part, 0))).ok) return settle(r);
  if (isLeader()) {
    // Each leader receives, from every other leader, only the blocks of its
    // own host's ranks, and folds them in host order.
    gatherBlocks(host_sum.data(), mine, block, for_mine.data());
    std::vector<Scratch> outgoing(layout_.hosts()), incoming(layout_.hosts());
    std::vector<const void*> sources(layout_.hosts());
    P2pExchange x(*channel_, tagOf(OpCode::kReduceScatter), channel_rank_of_);
    for (int h = 0; h < layout_.hosts(); ++h) {
      if (h == host_) {
        sources[h] = for_mine.data();
        continue;
      }
      const std::vector<int>& theirs = layout_.ranksOn(h);
      if (isConsecutive(theirs)) {
        x.send(layout_.leaderOf(h), host_sum.data() + theirs[0] * block, theirs.size() * block);
      } else {
        outgoing[h].resize(theirs.size() * block);
        gatherBlocks(host_sum.data(), theirs, block, outgoing[h].data());
        x.send(layout_.leaderOf(h), outgoing[h].data(), outgoing[h].size());
      }
      incoming[h].resize(for_mine.size());
      x.recv(layout_.leaderOf(h), incoming[h].data(), incoming[h].size());
      sources[h] = incoming[h].data();
    }
    if (!(r = x.wait()).ok) return settle(r);
    reduceInto(for_mine.data(), sources.data(), layout_.hosts(), count * mine.size(), type, part);
  }
  if (!(r = fromLocal(local_->scatter(for_mine.data(), output, block, 0))).ok) return settle(r);
  if (op == ReduceOp::kAvg) divideBy(output, count, type, size());
  return r;
}

}  // namespace mooncake::pg
