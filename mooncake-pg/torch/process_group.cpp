#include "process_group.h"

namespace mooncake::pg {

MooncakeProcessGroup::MooncakeProcessGroup(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                           c10::intrusive_ptr<MooncakeCpuBackend> backend)
    : c10d::ProcessGroup(store, rank, size), backend_(std::move(backend)) {
  setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend_);
  // Also the CUDA device, so that a CUDA tensor reaches our argument checks
  // and gets a clear error instead of torch's "no backend for device".
  setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::CUSTOM, backend_);
  setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
}

}  // namespace mooncake::pg
