#include "work.h"

#include <c10/util/Exception.h>

namespace mooncake::pg {

MooncakeWork::MooncakeWork(int rank, c10d::OpType type, int max_group_size, std::vector<at::Tensor> outputs,
                           const char* label)
    : c10d::Work(rank, type),
      outputs_(std::move(outputs)),
      label_(label),
      hint_(at::zeros({max_group_size}, at::TensorOptions().dtype(at::kInt))),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

void MooncakeWork::complete(const OpResult& result) {
  {
    std::lock_guard lock(mutex_);
    outcome_ = result;
  }
  int32_t* hint = hint_.data_ptr<int32_t>();
  for (int r : result.failed_ranks) {
    if (r >= 0 && r < hint_.numel()) hint[r] = 1;
  }
  if (result.ok) {
    finish();
    future_->markCompleted(c10::IValue(outputs_));
  } else {
    auto error = std::make_exception_ptr(c10::DistBackendError(std::string(label_) + ": " + result.error, {}));
    finish(error);
    future_->setError(error);
  }
}

OpResult MooncakeWork::outcome() const {
  std::lock_guard lock(mutex_);
  return outcome_;
}

bool MooncakeWork::localSuccess() {
  awaitOutcome();
  if (!isCompleted() || exception()) return false;
  return hint_.count_nonzero().item<int64_t>() == 0;
}

}  // namespace mooncake::pg
