#include "work.h"

#include <c10/util/Exception.h>

namespace mooncake::pg {

namespace {

// The type of every Work's future value (a list of tensors), made once.
const c10::TypePtr& tensorListType() {
  static const c10::TypePtr type = c10::ListType::create(c10::TensorType::get());
  return type;
}

}  // namespace

MooncakeWork::MooncakeWork(int rank, c10d::OpType type, int max_group_size, std::vector<at::Tensor> outputs,
                           const char* label)
    : c10d::Work(rank, type),
      outputs_(std::move(outputs)),
      label_(label),
      max_group_size_(max_group_size),
      future_(c10::make_intrusive<c10::ivalue::Future>(tensorListType())) {}

at::Tensor& MooncakeWork::hintLocked() const {
  if (!hint_.defined()) hint_ = at::zeros({max_group_size_}, at::TensorOptions().dtype(at::kInt));
  return hint_;
}

at::Tensor MooncakeWork::failedRanksHint() const {
  std::lock_guard lock(mutex_);
  return hintLocked();
}

void MooncakeWork::complete(const OpResult& result) {
  {
    std::lock_guard lock(mutex_);
    outcome_ = result;
    if (!result.failed_ranks.empty()) {
      at::Tensor& hint = hintLocked();
      int32_t* seats = hint.data_ptr<int32_t>();
      for (int r : result.failed_ranks) {
        if (r >= 0 && r < hint.numel()) seats[r] = 1;
      }
    }
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
  std::lock_guard lock(mutex_);
  return !hint_.defined() || hint_.count_nonzero().item<int64_t>() == 0;
}

}  // namespace mooncake::pg
