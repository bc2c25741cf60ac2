#include "process_group.h"

namespace mooncake::pg {

MooncakeProcessGroup::MooncakeProcessGroup(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                           c10::intrusive_ptr<MooncakeCpuBackend> backend,
                                           const MooncakeBackendOptions& options)
    : c10d::ProcessGroup(store, rank, size), max_group_size_(backend->maxGroupSize()) {
  // The user may hand us the mirror tensor to keep in sync; otherwise we own one.
  if (options.active_ranks) {
    TORCH_CHECK_VALUE(options.active_ranks->numel() >= max_group_size_, "MooncakeBackendOptions: active_ranks has ",
                      options.active_ranks->numel(), " elements but the group has ", max_group_size_,
                      " seats (max_group_size); it needs one int32 per seat");
    active_ranks_ = *options.active_ranks;
  } else {
    active_ranks_ = at::zeros({max_group_size_}, at::TensorOptions().dtype(at::kInt));
  }
  active_ranks_.narrow(0, 0, size).fill_(1);
  setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
  // Also the CUDA device, so that a CUDA tensor reaches our argument checks
  // and gets a clear error instead of torch's "no backend for device".
  setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::CUSTOM, backend);
  setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
}

}  // namespace mooncake::pg
