// The c10d::Backend of "mooncake" (CUDA tensors). Each operation runs on one
// of two paths, chosen the same way on every rank from the current view:
//   the CUDA IPC plane (CudaFastPath), ordered on the caller's current
//     stream and capturable into CUDA graphs, when the active seats are
//     0..n-1 of one host and the tensors are contiguous;
//   the staged path (HostStaging) through the host backend otherwise, and
//     for P2P.
// Membership, the control plane, failure hints and the module functions
// (pg.get_active_ranks, ...) belong to the host backend, which this one
// wraps; a "mooncake" group registers with the control plane under its own
// key, apart from a "mooncake-cpu" group of the same name.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <memory>

#include "../cpu_backend.h"
#include "cuda_fast_path.h"
#include "host_staging.h"

namespace mooncake::pg {

class MooncakeCudaBackend : public c10d::Backend {
 public:
  explicit MooncakeCudaBackend(c10::intrusive_ptr<MooncakeCpuBackend> host);
  ~MooncakeCudaBackend() override;

  const std::string getBackendName() const override { return "mooncake"; }

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
  // Enqueues an operation on the CUDA IPC plane: `body` launches it on the
  // stream and returns the last CudaOp. Null when the plane does not serve
  // the current configuration (or broke at launch): take the staged path.
  using StreamBody = std::function<cuda::CudaOp(cuda::CudaIpcGroup& group, cudaStream_t stream)>;
  c10::intrusive_ptr<c10d::Work> onStream(const std::vector<at::Tensor>& tensors, c10d::OpType type,
                                          std::vector<at::Tensor> outputs, const StreamBody& body);
  c10::intrusive_ptr<c10d::Work> staged(c10d::OpType type, const char* op, const std::vector<at::Tensor>& reads,
                                        const std::vector<at::Tensor>& writes, const HostStaging::HostCall& call,
                                        HostStaging::Start start = HostStaging::Start::kOnOperationThread) {
    return staging_.run(type, op, reads, writes, call, start);
  }
  // A completed Work when this rank is the whole group (an in-place
  // operation then has nothing to do); null otherwise.
  c10::intrusive_ptr<c10d::Work> alone(c10d::OpType type, std::vector<at::Tensor> outputs);
  int worldSize() const { return host_->worldSize(); }
  // The checks of every tensor argument: CUDA, dense, on this rank's device.
  void checkTensor(const at::Tensor& t, const char* op, const char* arg);

  c10::intrusive_ptr<MooncakeCpuBackend> host_;
  std::atomic<int> device_{-1};  // the GPU of this rank, fixed by its first operation
  HostStaging staging_;
  std::unique_ptr<CudaFastPath> fast_;
};

}  // namespace mooncake::pg
