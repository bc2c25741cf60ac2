#include "process_group.h"

namespace mooncake::pg {

MooncakeProcessGroup::MooncakeProcessGroup(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                           c10::intrusive_ptr<MooncakeCpuBackend> backend,
                                           const MooncakeBackendOptions& options)
    : c10d::ProcessGroup(store, rank, size), max_group_size_(backend->maxGroupSize()) {
  // The user may hand us the mirror tensor to keep in sync; otherwise we own one.
  active_ranks_ = options.active_ranks ? *options.active_ranks
                                       : at::zeros({max_group_size_}, at::TensorOptions().dtype(at::kInt));
  active_ranks_.narrow(0, 0, size).fill_(1);
  setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
  setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
}

}  // namespace mooncake::pg
