// HostSpanningGroup: the layout, failure bookkeeping, and the collectives
// that only move bytes. The reducing ones are in host_spanning_group_reduce.cpp.
#include "mooncake/pg/host_spanning_group.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>

#include "host_spanning_internal.h"

namespace mooncake::pg {
namespace {

// Broadcasts of at least this size over more than two hosts go down a chain
// of leaders in segments (at least kChainSegmentBytes, at most
// kMaxChainSegments of them); smaller ones go from the root's leader to
// every other at once (one network latency).
constexpr size_t kChainBroadcastBytes = 1u << 20;
constexpr size_t kChainSegmentBytes = 256u << 10;
constexpr size_t kMaxChainSegments = 16;

}  // namespace

HostLayout HostLayout::fromIdentities(const std::vector<std::string>& identity_of_rank) {
  HostLayout layout;
  std::map<std::string, int> host_of_identity;
  for (const std::string& id : identity_of_rank) {
    auto [it, fresh] = host_of_identity.emplace(id, static_cast<int>(layout.ranks_of_host_.size()));
    if (fresh) layout.ranks_of_host_.emplace_back();
    layout.ranks_of_host_[it->second].push_back(layout.ranks());
    layout.host_of_rank_.push_back(it->second);
  }
  return layout;
}

int HostLayout::localIndexOf(int rank) const {
  const std::vector<int>& mates = ranksOn(hostOf(rank));
  return static_cast<int>(std::find(mates.begin(), mates.end(), rank) - mates.begin());
}

HostSpanningGroup::HostSpanningGroup(int rank, HostLayout layout, std::unique_ptr<ShmGroup> local,
                                     std::shared_ptr<P2pChannel> channel, std::vector<int> channel_rank_of)
    : rank_(rank), layout_(std::move(layout)), host_(layout_.hostOf(rank)), local_(std::move(local)),
      channel_(std::move(channel)), channel_rank_of_(std::move(channel_rank_of)) {
  if (local_->size() != static_cast<int>(layout_.ranksOn(host_).size()) ||
      local_->rank() != layout_.localIndexOf(rank_)) {
    throw std::invalid_argument("HostSpanningGroup: the local ShmGroup does not match the host layout");
  }
}

HostSpanningGroup::~HostSpanningGroup() = default;

bool HostSpanningGroup::broken() const { return failed_.load(std::memory_order_acquire) || local_->broken(); }

OpResult HostSpanningGroup::fromLocal(OpResult r) const {
  for (int& q : r.failed_ranks) q = layout_.ranksOn(host_)[q];
  if (!r.ok) {
    for (int q : local_->outsideFailedRanks()) {
      if (std::find(r.failed_ranks.begin(), r.failed_ranks.end(), q) == r.failed_ranks.end()) r.failed_ranks.push_back(q);
    }
  }
  return r;
}

OpResult HostSpanningGroup::settle(OpResult r) {
  if (r.ok) return r;
  if (failed_.load(std::memory_order_relaxed)) return r;
  first_error_ = r.error;
  failed_.store(true, std::memory_order_release);
  // Local ranks may be waiting for our part in the arena: release them with
  // the reason (a no-op when the arena is what failed) and the ranks at
  // fault; other hosts' leaders may be waiting for us: tell them.
  std::vector<int> local_failed, outside_failed;
  for (int q : r.failed_ranks) {
    if (layout_.hostOf(q) == host_) local_failed.push_back(layout_.localIndexOf(q));
    else outside_failed.push_back(q);
  }
  const std::string why = "rank " + std::to_string(rank_) + " failed its part: " + r.error;
  local_->abort(why, local_failed, outside_failed, r.mismatch);
  std::vector<int> at_fault = r.failed_ranks;  // the channel names ranks its own way
  for (int& q : at_fault) {
    if (!channel_rank_of_.empty() && q >= 0 && q < static_cast<int>(channel_rank_of_.size())) q = channel_rank_of_[q];
  }
  channel_->abort(why, at_fault, r.mismatch);
  return r;
}

bool HostSpanningGroup::failedBefore(OpResult& r) const {
  if (!failed_.load(std::memory_order_acquire)) return false;
  r.ok = false;
  r.error = "the group is unusable after an earlier failure: " + first_error_;
  return true;
}

OpResult HostSpanningGroup::barrier() {
  OpResult r;
  if (failedBefore(r)) return r;
  if (!(r = fromLocal(local_->barrier())).ok) return settle(r);
  if (isLeader() && layout_.hosts() > 1) {
    // Zero-byte messages: every leader has heard from every other one.
    char none = 0;
    P2pExchange x(*channel_, tagOf(OpCode::kBarrier), channel_rank_of_);
    for (int h = 0; h < layout_.hosts(); ++h) {
      if (h == host_) continue;
      x.send(layout_.leaderOf(h), &none, 0);
      x.recv(layout_.leaderOf(h), &none, 0);
    }
    if (!(r = x.wait()).ok) return settle(r);
  }
  return settle(fromLocal(local_->barrier()));
}

OpResult HostSpanningGroup::broadcast(void* data, size_t bytes, int root) {
  OpResult r;
  if (failedBefore(r)) return r;
  const int root_host = layout_.hostOf(root);
  if (host_ == root_host && !(r = fromLocal(local_->broadcast(data, bytes, layout_.localIndexOf(root)))).ok) {
    return settle(r);
  }
  if (isLeader() && layout_.hosts() > 2 && bytes >= kChainBroadcastBytes) {
    if (!(r = leadersChainBroadcast(data, bytes, root_host)).ok) return settle(r);
  } else if (isLeader() && layout_.hosts() > 1) {
    P2pExchange x(*channel_, tagOf(OpCode::kBroadcast), channel_rank_of_);
    if (host_ == root_host) {
      for (int h = 0; h < layout_.hosts(); ++h) {
        if (h != host_) x.send(layout_.leaderOf(h), data, bytes);
      }
    } else {
      x.recv(layout_.leaderOf(root_host), data, bytes);
    }
    if (!(r = x.wait()).ok) return settle(r);
  }
  if (host_ != root_host) r = fromLocal(local_->broadcast(data, bytes, 0));
  return settle(r);
}

OpResult HostSpanningGroup::leadersChainBroadcast(void* buf, size_t bytes, int root_host) {
  const int hosts = layout_.hosts();
  auto* data = static_cast<char*>(buf);
  // The leaders in a chain from the root's: each receives a segment from the
  // one before it and passes it on at once, so every link carries the
  // buffer once and the chain's length adds only one segment's time.
  const int position = (host_ - root_host + hosts) % hosts;
  const bool first = position == 0, last = position == hosts - 1;
  const int prev = layout_.leaderOf((host_ + hosts - 1) % hosts);
  const int next = layout_.leaderOf((host_ + 1) % hosts);
  const size_t segment = std::max(kChainSegmentBytes, (bytes + kMaxChainSegments - 1) / kMaxChainSegments);
  const int tag = tagOf(OpCode::kBroadcast);
  std::vector<std::unique_ptr<P2pExchange>> incoming;
  if (!first) {
    for (size_t begin = 0; begin < bytes; begin += segment) {
      incoming.push_back(std::make_unique<P2pExchange>(*channel_, tag, channel_rank_of_));
      incoming.back()->recv(prev, data + begin, std::min(segment, bytes - begin));
    }
  }
  P2pExchange outgoing(*channel_, tag, channel_rank_of_);
  OpResult result;
  for (size_t k = 0, begin = 0; begin < bytes; ++k, begin += segment) {
    if (!first) {
      OpResult r = incoming[k]->wait();  // every posted receive is awaited, also after a failure
      if (!r.ok && result.ok) result = r;
    }
    if (!last && result.ok) outgoing.send(next, data + begin, std::min(segment, bytes - begin));
  }
  OpResult sent = outgoing.wait();
  return result.ok ? sent : result;
}

OpResult HostSpanningGroup::allgather(const void* input, void* output, size_t bytes) {
  OpResult r;
  if (failedBefore(r)) return r;
  auto* out = static_cast<char*>(output);
  const std::vector<int>& mine = layout_.ranksOn(host_);
  if (!isLeader()) {
    if (!(r = fromLocal(local_->gather(input, nullptr, bytes, 0))).ok) return settle(r);
    return settle(fromLocal(local_->broadcast(output, bytes * size(), 0)));
  }
  // The leader collects its host's blocks, trades them for every other
  // host's, and hands the whole result to its local ranks.
  // A leader alone on its host sends its input as it is.
  const bool alone = mine.size() == 1;
  Scratch packed(alone ? 0 : bytes * mine.size());
  const char* own = alone ? static_cast<const char*>(input) : packed.data();
  if (!(r = fromLocal(local_->gather(input, alone ? out + rank_ * bytes : packed.data(), bytes, 0))).ok) {
    return settle(r);
  }
  if (!alone) scatterBlocks(packed.data(), mine, bytes, out);
  if (layout_.hosts() > 1) {
    P2pExchange x(*channel_, tagOf(OpCode::kAllgather), channel_rank_of_);
    std::vector<Scratch> theirs(layout_.hosts());
    for (int h = 0; h < layout_.hosts(); ++h) {
      if (h == host_) continue;
      const std::vector<int>& ranks = layout_.ranksOn(h);
      x.send(layout_.leaderOf(h), own, bytes * mine.size());
      if (isConsecutive(ranks)) {
        x.recv(layout_.leaderOf(h), out + ranks[0] * bytes, ranks.size() * bytes);
      } else {
        theirs[h].resize(ranks.size() * bytes);
        x.recv(layout_.leaderOf(h), theirs[h].data(), theirs[h].size());
      }
    }
    if (!(r = x.wait()).ok) return settle(r);
    for (int h = 0; h < layout_.hosts(); ++h) {
      if (!theirs[h].empty()) scatterBlocks(theirs[h].data(), layout_.ranksOn(h), bytes, out);
    }
  }
  return settle(fromLocal(local_->broadcast(output, bytes * size(), 0)));
}

OpResult HostSpanningGroup::gather(const void* input, void* output, size_t bytes, int root) {
  OpResult r;
  if (failedBefore(r)) return r;
  P2pExchange x(*channel_, tagOf(OpCode::kGather), channel_rank_of_);
  if (rank_ == root) {
    auto* out = static_cast<char*>(output);
    std::memmove(out + root * bytes, input, bytes);
    for (int q = 0; q < size(); ++q) {
      if (q != root) x.recv(q, out + q * bytes, bytes);
    }
  } else {
    x.send(root, input, bytes);
  }
  return settle(x.wait());
}

OpResult HostSpanningGroup::scatter(const void* input, void* output, size_t bytes, int root) {
  OpResult r;
  if (failedBefore(r)) return r;
  P2pExchange x(*channel_, tagOf(OpCode::kScatter), channel_rank_of_);
  if (rank_ == root) {
    const auto* in = static_cast<const char*>(input);
    for (int q = 0; q < size(); ++q) {
      if (q != root) x.send(q, in + q * bytes, bytes);
    }
    std::memmove(output, in + root * bytes, bytes);
  } else {
    x.recv(root, output, bytes);
  }
  return settle(x.wait());
}

OpResult HostSpanningGroup::alltoall(const void* input, const std::vector<size_t>& send_offsets,
                                     const std::vector<size_t>& send_bytes, void* output,
                                     const std::vector<size_t>& recv_offsets, const std::vector<size_t>& recv_bytes) {
  OpResult r;
  if (failedBefore(r)) return r;
  if (send_bytes[rank_] != recv_bytes[rank_]) {
    r.ok = false;
    r.error = "all_to_all: this rank sends itself " + std::to_string(send_bytes[rank_]) + " bytes but expects " +
              std::to_string(recv_bytes[rank_]);
    return settle(r);
  }
  const auto* in = static_cast<const char*>(input);
  auto* out = static_cast<char*>(output);
  // Every pair at once: the channel moves each peer's messages independently.
  P2pExchange x(*channel_, tagOf(OpCode::kAlltoall), channel_rank_of_);
  for (int q = 0; q < size(); ++q) {
    if (q == rank_) continue;
    x.send(q, in + send_offsets[q], send_bytes[q]);
    x.recv(q, out + recv_offsets[q], recv_bytes[q]);
  }
  std::memcpy(out + recv_offsets[rank_], in + send_offsets[rank_], send_bytes[rank_]);
  return settle(x.wait());
}

}  // namespace mooncake::pg
