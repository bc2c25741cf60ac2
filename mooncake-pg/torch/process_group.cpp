#include "process_group.h"

namespace mooncake::pg {

MooncakeProcessGroup::MooncakeProcessGroup(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                           c10::intrusive_ptr<MooncakeCpuBackend> backend,
                                           const c10::intrusive_ptr<c10d::Backend>& cuda_backend)
    : c10d::ProcessGroup(store, rank, size), backend_(std::move(backend)) {
  // torch keeps one backend per backend type: the first one set serves every
  // device registered with that type. "mooncake": the CUDA backend, which
  // hands CPU tensors to the host backend. "mooncake-cpu": the CPU backend,
  // whose argument checks give CUDA tensors a clear error instead of torch's
  // "no backend for device".
  const c10::intrusive_ptr<c10d::Backend> serving =
      cuda_backend ? cuda_backend : c10::intrusive_ptr<c10d::Backend>(backend_);
  setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::CUSTOM, serving);
  setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, serving);
  setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
}

}  // namespace mooncake::pg
