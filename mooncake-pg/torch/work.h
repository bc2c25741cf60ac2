// The Work returned by every operation: completion, the exception of a
// failed operation, a future, and the failure hint (which ranks this rank saw
// fail, one int32 per seat).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <vector>

#include "mooncake/pg/shm_group.h"

namespace mooncake::pg {

class MooncakeWork : public c10d::Work {
 public:
  // `label` starts the message of a failed operation's exception.
  MooncakeWork(int rank, c10d::OpType type, int max_group_size, std::vector<at::Tensor> outputs,
               const char* label = "mooncake-cpu");

  // Called once by the executor when the operation ended.
  void complete(const OpResult& result);
  // The operation's outcome as complete() was given it (ok until then).
  OpResult outcome() const;
  // Blocks until the outcome is known, without throwing: what the failure
  // hint and local_success read. Immediate for work that completes on the
  // host; CUDA work may complete on its stream first.
  virtual void awaitOutcome() {}

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }

  // One int32 per seat, 1 where this rank saw the seat fail. Made on first
  // use (a failure, or a caller asking), not with every Work: an operation
  // that nobody asks about costs no tensor.
  at::Tensor failedRanksHint() const;
  bool localSuccess();

 private:
  // The hint, made if it was not yet; Work::mutex_ held.
  at::Tensor& hintLocked() const;

  std::vector<at::Tensor> outputs_;
  const char* label_;
  int max_group_size_;
  OpResult outcome_;            // guarded by Work::mutex_
  mutable at::Tensor hint_;     // guarded by Work::mutex_; undefined until first use
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace mooncake::pg
