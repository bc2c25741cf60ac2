// The c10d::Backend of "mooncake-cpu": validates arguments on the calling
// thread, then runs each operation on the group's OpQueue over the data plane
// of the current membership configuration (GroupMembership): shared memory
// inside hosts, the transfer engine between them.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <functional>
#include <memory>

#include "backend_options.h"
#include "group_membership.h"
#include "mooncake/pg/p2p_channel.h"
#include "op_queue.h"
#include "work.h"

namespace mooncake::pg {

// Who this group is, as torch created it.
struct GroupIdentity {
  int rank = 0;                      // this process's seat
  int size = 0;                      // the declared group size
  std::string group_name;            // torch's name: equal on every process for the same group
  std::vector<int> global_ranks;     // global rank of each seat torch knows of
  std::string key_prefix = "cpu:";   // the control-plane key is key_prefix + group_name
};

// While alive on a thread, every operation that thread queues on a
// MooncakeCpuBackend first runs `wait` on the operation thread (the CUDA
// backend's wait for the host copies of device tensors); it returns "" or why
// the data never became ready, which fails the operation. Such operations
// never run inline on the caller's thread, which must not block on `wait`.
class OpGate {
 public:
  explicit OpGate(std::function<std::string()> wait);
  ~OpGate();
  OpGate(const OpGate&) = delete;
  OpGate& operator=(const OpGate&) = delete;
  static std::function<std::string()> current();

 private:
  std::function<std::string()> previous_;
};

class MooncakeCpuBackend : public c10d::Backend {
 public:
  MooncakeCpuBackend(const c10::intrusive_ptr<c10d::Store>& store, const GroupIdentity& identity,
                     std::chrono::milliseconds timeout, const MooncakeBackendOptions& options);
  ~MooncakeCpuBackend() override;

  const std::string getBackendName() const override { return "mooncake"; }
  int maxGroupSize() const { return max_group_size_; }
  // The world size torch reports: follows membership (see GroupMembership).
  int worldSize() const { return membership_->worldSize(); }
  // A collective sized for `wanted` ranks where the view has more: when a
  // failure is pending (a rank just died, its deactivation not yet seen
  // here), settling it gives that world, and the ranks that saw it first
  // are already running the collective sized so. Waits (bounded by the
  // failure detection and reconciliation times) until the world is
  // `wanted`; the caller's size check then passes or fails as before.
  void awaitWorldOf(int64_t wanted) const;
  // The same for a call whose `whole` tensor holds world-size times the
  // elements of `per_rank` (all_gather's output, reduce_scatter's input).
  void awaitWorldFor(const at::Tensor& per_rank, const at::Tensor& whole) const {
    if (per_rank.defined() && whole.defined() && per_rank.numel() > 0 && whole.numel() % per_rank.numel() == 0) {
      awaitWorldOf(whole.numel() / per_rank.numel());
    }
  }
  GroupMembership& membership() { return *membership_; }
  std::chrono::milliseconds collectiveTimeout() const { return collective_timeout_; }
  // Reports a failed operation's ranks to the control plane on the operation
  // thread (with auto-sync, the reconciled view is applied there), then runs
  // `done`: how operations that end on another thread (P2P, the CUDA
  // plane's) settle before their Work completes.
  void settleThen(const OpResult& result, const std::function<void()>& done);

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  void shutdown() override;

 private:
  // Queues `body` and returns its Work; `outputs` become the Work's result.
  // A synchronous call (opts.asyncOp false: the caller waits right away)
  // runs on the calling thread when the queue is idle, saving two thread
  // hand-offs; asynchronous ones, and any issued behind pending work, queue.
  c10::intrusive_ptr<c10d::Work> enqueue(c10d::OpType type, std::vector<at::Tensor> outputs,
                                         std::function<OpResult()> body, bool may_run_inline = false);
  c10::intrusive_ptr<c10d::Work> allgatherPairs(std::vector<at::Tensor> outputs, std::vector<at::Tensor> inputs,
                                                const char* op, bool may_run_inline);
  c10::intrusive_ptr<c10d::Work> reduceScatterPairs(std::vector<at::Tensor> outputs, std::vector<at::Tensor> inputs,
                                                    const c10d::ReduceOp& reduce_op, const char* op, bool may_run_inline);

  static P2pOptions p2pOptionsFromEnv();
  // The collectives of the current membership configuration (operation thread).
  Collectives& plane() { return membership_->plane(); }
  // Runs one collective on the operation thread, and again over the
  // survivors when ranks fail (see the .cpp); never throws.
  OpResult runCollective(const std::function<OpResult()>& body);
  static constexpr int kCollectiveRetries = 3;
  // A failed operation's report to the control plane (and, with auto-sync,
  // the reconciled view applied) before its Work completes.
  void settleFailure(const OpResult& result);
  // P2P with an inactive seat fails at once (false: `work` completed so).
  bool peerIsActive(int peer, const c10::intrusive_ptr<MooncakeWork>& work);
  void finishP2p(const c10::intrusive_ptr<MooncakeWork>& work, const OpResult& result);
  // The reference's contract for P2P (pg.md §4, "Failure handling"): a
  // peer's failure is reported through the Work's failure hint and
  // local_success, and wait() returns. A P2P Work raises only for what the
  // program must fix (a size mismatch), when nobody is named (the group
  // shut down), or when this rank is the one named (cut off from the
  // control plane).
  static OpResult asReported(const OpResult& result, int self);
  P2pChannel& p2p(const char* op);

  int max_group_size_;
  std::chrono::milliseconds collective_timeout_;
  std::shared_ptr<P2pChannel> p2p_;
  std::string p2p_error_;  // why P2P is unavailable, when it is
  std::unique_ptr<GroupMembership> membership_;
  OpQueue queue_;  // last: its thread stops before the group goes away
};

}  // namespace mooncake::pg
