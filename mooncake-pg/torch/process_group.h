// The ProcessGroup torch hands to users for "mooncake-cpu" (and, later,
// "mooncake"). It subclasses c10d::ProcessGroup rather than only providing a
// c10d::Backend, so that getSize() can follow membership changes at run time
// (elastic groups); the operations themselves go through the c10d dispatcher
// to the backend registered here for each device type.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "backend_options.h"
#include "cpu_backend.h"

namespace mooncake::pg {

class MooncakeProcessGroup : public c10d::ProcessGroup {
 public:
  MooncakeProcessGroup(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       c10::intrusive_ptr<MooncakeCpuBackend> backend, const MooncakeBackendOptions& options);

  const std::string getBackendName() const override { return "mooncake"; }
  int maxGroupSize() const { return max_group_size_; }
  // int32[max_group_size]: 1 for each active seat. Returned by get_active_ranks.
  at::Tensor activeRanks() const { return active_ranks_; }
  int64_t epoch() const { return 0; }  // membership views arrive with the elastic control plane

 private:
  int max_group_size_;
  at::Tensor active_ranks_;
};

}  // namespace mooncake::pg
