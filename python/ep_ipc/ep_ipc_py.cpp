// mooncake._ep_ipc: the Python face of EpIpcGroup (mooncake-ep), for the
// fast path of mooncake_ep_buffer.Buffer. Torch-free on purpose: tensors
// arrive as device addresses (tensor.data_ptr()) and the stream as its raw
// handle (torch.cuda.current_stream().cuda_stream), so this module builds
// quickly and never ties itself to a torch ABI. The Python caller owns every
// check of shapes, dtypes and devices (mooncake/_ep_ipc_path.py); this layer
// checks what the C++ library checks and raises RuntimeError with its words.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>

#include "ep_call_args.h"
#include "mooncake/ep/cuda/ep_ipc_group.h"

namespace py = pybind11;
using namespace mooncake::ep::cuda;
using mooncake::ep::python::defineKernelCalls;
using mooncake::ep::python::KernelCalls;

namespace {

// Holds the group; close() ends it early (collective), as the destructor would.
class PyEpIpcGroup : public KernelCalls<PyEpIpcGroup> {
 public:
  PyEpIpcGroup(const std::string& name, int rank, int num_ranks, int max_tokens_per_rank, int hidden, int num_experts,
               int device, int attach_timeout_ms, uint32_t absent) {
    EpIpcGroupOptions options;
    options.absent = absent;
    options.max_tokens_per_rank = max_tokens_per_rank;
    options.hidden = hidden;
    options.num_experts = num_experts;
    options.device = device;
    options.attach_timeout = std::chrono::milliseconds(attach_timeout_ms);
    std::string error;
    {
      py::gil_scoped_release release;  // waits for the peers
      group_ = EpIpcGroup::open(name, rank, num_ranks, options, &error);
    }
    if (!group_) throw std::runtime_error(error);
  }

  // Closing is a handshake with the peers: never with the GIL held, also
  // when the garbage collector drops a group nobody closed.
  ~PyEpIpcGroup() {
    try {
      close();
    } catch (const std::exception& e) {  // a destructor must not throw: the process would end
      std::fprintf(stderr, "mooncake EP: closing a group failed: %s\n", e.what());
    }
  }
  PyEpIpcGroup(const PyEpIpcGroup&) = delete;
  PyEpIpcGroup& operator=(const PyEpIpcGroup&) = delete;

  void close() {
    if (!group_) return;
    py::gil_scoped_release release;
    group_.reset();
  }

  EpIpcGroup& group() {
    if (!group_) throw std::runtime_error("EP IPC group: already closed");
    return *group_;
  }

 private:
  std::unique_ptr<EpIpcGroup> group_;
};

}  // namespace

PYBIND11_MODULE(_ep_ipc, m) {
  m.doc() = "EP dispatch/combine kernels over CUDA IPC between the processes of one host (docs/ep-kernels.md)";
  m.attr("MAX_RANKS") = kMaxEpRanks;
  py::class_<PyEpIpcGroup> group_class(m, "EpIpcGroup");
  group_class
      .def(py::init<const std::string&, int, int, int, int, int, int, int, uint32_t>(), py::arg("name"),
           py::arg("rank"), py::arg("num_ranks"), py::arg("max_tokens_per_rank"), py::arg("hidden"),
           py::arg("num_experts"), py::arg("device"), py::arg("attach_timeout_ms"), py::arg("absent") = 0,
           "Collective: every rank of the host group but the `absent` ones (bit r: rank r takes no part) opens "
           "the same name with the same sizes and the same `absent`.")
      .def("close", &PyEpIpcGroup::close);
  defineKernelCalls<PyEpIpcGroup>(group_class);
}
