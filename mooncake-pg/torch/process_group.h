// The ProcessGroup torch hands to users for "mooncake-cpu" and "mooncake". It subclasses c10d::ProcessGroup rather than only providing a
// c10d::Backend, so that getSize() follows membership at run time (elastic
// groups: the highest active seat + 1); the operations themselves go through
// the c10d dispatcher to the backend registered here for each device type.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "backend_options.h"
#include "cpu_backend.h"

namespace mooncake::pg {

class MooncakeProcessGroup : public c10d::ProcessGroup {
 public:
  // `backend` serves CPU tensors and owns the membership; `cuda_backend`,
  // when given ("mooncake"), serves CUDA tensors on top of it.
  MooncakeProcessGroup(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       c10::intrusive_ptr<MooncakeCpuBackend> backend,
                       const c10::intrusive_ptr<c10d::Backend>& cuda_backend = {});

  const std::string getBackendName() const override { return "mooncake"; }
  int getSize() const override { return backend_->worldSize(); }
  int maxGroupSize() const { return backend_->maxGroupSize(); }
  // int32[max_group_size]: 1 for each active seat, kept up to date as views
  // arrive (the user's tensor when one was given). Returned by get_active_ranks.
  at::Tensor activeRanks() const { return backend_->membership().activeRanks(); }
  int64_t epoch() const { return backend_->membership().epoch(); }
  GroupMembership& membership() { return backend_->membership(); }

 private:
  c10::intrusive_ptr<MooncakeCpuBackend> backend_;
};

}  // namespace mooncake::pg
