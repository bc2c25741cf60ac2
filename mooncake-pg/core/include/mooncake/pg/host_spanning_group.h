// Collectives for a group whose ranks run on several hosts: hierarchical.
// Inside each host the ranks meet in their host's ShmGroup (shared memory,
// no sockets); across hosts only one rank per host, its leader (the host's
// lowest rank), moves data, through a P2pChannel over the transfer engine.
//
//   all_reduce:     local reduce to the leader -> leaders' all-reduce -> local broadcast
//   leaders' all-reduce: two hosts: by halves from 1 MiB for leaders alone
//                   on their hosts (each folds one half and sends it back),
//                   else one exchange, folded where it lands; more hosts: one
//                   exchange of whole buffers
//                   when the buffer is small (one network latency), a ring
//                   (reduce-scatter + all-gather, 2(H-1)/H of the buffer per
//                   leader) otherwise
//   broadcast:      local broadcast on the root's host -> root's leader to the
//                   other leaders (at once; down a pipelined chain of leaders
//                   from 1 MiB over more than two hosts) -> local broadcasts
//   reduce:         local reduce to the leader -> leaders to the root's leader -> root
//   all_gather:     local gather -> leaders exchange host blocks -> local broadcast
//   reduce_scatter: local reduce -> leaders' all-reduce -> local scatter
//   gather/scatter/all_to_all: direct messages between the ranks concerned
//
// So each host sends O(size) bytes per reduction whatever the number of
// ranks on it, and same-host traffic never touches a socket.
//
// Failures: a rank whose part fails breaks its host's arena, so the local
// ranks fail at once with the reason, and aborts its channel, which tells
// every peer (P2pChannel::abort): whoever waits for a message from it fails
// at once too, instead of waiting for the timeout on a rank that is alive
// but has given up. Every rank's failure hint names the ranks at fault. After a failure the group fails fast,
// like a ShmGroup. Messages carry a tag per collective kind, so ranks that
// disagree on the operation never pair their messages: they get errors, not
// mixed data.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "mooncake/pg/collectives.h"
#include "mooncake/pg/p2p_channel.h"
#include "mooncake/pg/shm_group.h"

namespace mooncake::pg {

// Which host each rank runs on. Hosts are numbered in the order of their
// lowest rank, so every rank derives the same numbering from the same facts.
class HostLayout {
 public:
  // `identity_of_rank[r]`: anything equal exactly for ranks on one host
  // (te::hostIdentity()).
  static HostLayout fromIdentities(const std::vector<std::string>& identity_of_rank);

  int ranks() const { return static_cast<int>(host_of_rank_.size()); }
  int hosts() const { return static_cast<int>(ranks_of_host_.size()); }
  int hostOf(int rank) const { return host_of_rank_[rank]; }
  const std::vector<int>& ranksOn(int host) const { return ranks_of_host_[host]; }  // ascending
  int leaderOf(int host) const { return ranks_of_host_[host][0]; }
  int localIndexOf(int rank) const;  // position among the ranks of its host

 private:
  std::vector<int> host_of_rank_;
  std::vector<std::vector<int>> ranks_of_host_;
};

class HostSpanningGroup : public Collectives {
 public:
  // `local`: the ShmGroup of this host's ranks, in layout order (its rank i
  // is layout.ranksOn(host)[i]). `channel`: connected, over every rank of
  // the group, used by nothing else (so user P2P never pairs with ours).
  // `channel_rank_of[r]`: the channel's rank for rank r, when the channel
  // numbers ranks differently (an elastic group's channel has a rank per
  // seat; this group only the active ones); empty: the same numbering.
  HostSpanningGroup(int rank, HostLayout layout, std::unique_ptr<ShmGroup> local,
                    std::shared_ptr<P2pChannel> channel, std::vector<int> channel_rank_of = {});
  ~HostSpanningGroup() override;

  int rank() const override { return rank_; }
  int size() const override { return layout_.ranks(); }
  bool broken() const override;
  const HostLayout& layout() const { return layout_; }

  OpResult barrier() override;
  OpResult broadcast(void* data, size_t bytes, int root) override;
  OpResult allreduce(const void* input, void* output, size_t count, DataType type, ReduceOp op) override;
  OpResult reduce(const void* input, void* output, size_t count, DataType type, ReduceOp op, int root) override;
  OpResult allgather(const void* input, void* output, size_t bytes) override;
  OpResult reduceScatter(const void* input, void* output, size_t count, DataType type, ReduceOp op) override;
  OpResult alltoall(const void* input, const std::vector<size_t>& send_offsets, const std::vector<size_t>& send_bytes,
                    void* output, const std::vector<size_t>& recv_offsets,
                    const std::vector<size_t>& recv_bytes) override;
  OpResult gather(const void* input, void* output, size_t bytes, int root) override;
  OpResult scatter(const void* input, void* output, size_t bytes, int root) override;

 private:
  bool isLeader() const { return rank_ == layout_.leaderOf(host_); }
  // The local ShmGroup's result with its ranks renamed to group ranks.
  OpResult fromLocal(OpResult r) const;
  // Passes r through; a failure also breaks the group (later operations fail
  // fast) and the local arena, so local ranks waiting for this rank's
  // cross-host part stop waiting, with the reason.
  OpResult settle(OpResult r);
  // Fails fast once broken.
  bool failedBefore(OpResult& r) const;

  // Among leaders only: `buf` of the root host's leader reaches every
  // other leader down a pipelined chain.
  OpResult leadersChainBroadcast(void* buf, size_t bytes, int root_host);
  // Among leaders only: every leader's `buf` becomes the reduction of all
  // of them; `mine` is this leader's part (it may be `buf`). `wrote`: set
  // when `buf` was written before a failure.
  OpResult leadersAllreduce(const void* mine, void* buf, size_t count, DataType type, ReduceOp op, int tag,
                            bool* wrote = nullptr);
  // Its one-exchange form: every leader sends its buffer to every other, in
  // segments, folding each segment as soon as it is in while the next ones
  // are on the wire.
  OpResult leadersExchangeAndFold(const void* mine, void* buf, size_t count, DataType type, ReduceOp op, int tag);
  // Its forms for two hosts (host_spanning_two_hosts.cpp): by halves where
  // byHalves() (each leader folds one half and sends it back), else one
  // exchange folded where it lands (where `mine` is not `buf`).
  OpResult leadersAcrossTwoHosts(const void* mine, void* buf, size_t count, DataType type, ReduceOp op,
                                 bool* wrote);
  OpResult leadersByHalves(const void* mine, void* buf, size_t count, DataType type, ReduceOp op, bool* wrote);
  OpResult leadersFoldExchange(const void* mine, void* buf, size_t count, DataType type, ReduceOp op);
  bool byHalves(size_t count, DataType type) const;
  // Whether the channel can hand a received `type` buffer to a sink.
  bool foldsWhereItLands(DataType type) const;

  const int rank_;
  const HostLayout layout_;
  const int host_;
  std::unique_ptr<ShmGroup> local_;
  std::shared_ptr<P2pChannel> channel_;  // shared: an elastic group keeps it across epochs
  const std::vector<int> channel_rank_of_;
  // Kept across calls (operations on a group run one at a time): large
  // reductions do not fault in fresh pages on every call.
  // (Grown, never shrunk: zero-filled once, when they grow.)
  std::vector<char> leaders_incoming_;  // the other leaders' buffers (two hosts: this host's part)
  std::vector<char> in_place_sum_;      // an in-place all_reduce's partial result
  std::atomic<bool> failed_{false};
  std::string first_error_;  // written once, before failed_ is set
};

}  // namespace mooncake::pg
