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
  MooncakeWork(int rank, c10d::OpType type, int max_group_size, std::vector<at::Tensor> outputs);

  // Called once by the executor when the operation ended.
  void complete(const OpResult& result);

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  std::vector<at::Tensor> result() override { return outputs_; }

  at::Tensor failedRanksHint() const { return hint_; }
  bool localSuccess();

 private:
  std::vector<at::Tensor> outputs_;
  at::Tensor hint_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace mooncake::pg
