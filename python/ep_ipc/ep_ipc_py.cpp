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

#include "mooncake/ep/cuda/ep_ipc_group.h"

namespace py = pybind11;
using namespace mooncake::ep::cuda;

namespace {

template <typename T>
T* pointer(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

cudaStream_t streamOf(uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

EpStages stagesOf(const std::string& stages) {
  if (stages == "all") return EpStages::kAll;
  if (stages == "send") return EpStages::kSendOnly;
  if (stages == "receive") return EpStages::kReceiveOnly;
  throw py::value_error("stages: must be 'all', 'send' or 'receive', got '" + stages + "'");
}

// Holds the group; close() ends it early (collective), as the destructor would.
class PyEpIpcGroup {
 public:
  PyEpIpcGroup(const std::string& name, int rank, int num_ranks, int max_tokens_per_rank, int hidden,
               int num_experts, int device, int attach_timeout_ms, uint32_t absent) {
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

  // The arguments both forms of dispatch take.
  static DispatchArgs dispatchArgs(uintptr_t x, uintptr_t topk_idx, int num_tokens, int num_topk,
                                   uintptr_t active_ranks, int64_t timeout_us, uintptr_t recv_x, uintptr_t recv_count,
                                   uintptr_t src_info, uintptr_t layout_range) {
    DispatchArgs a;
    a.x = pointer<const void>(x);
    a.topk_idx = pointer<const int64_t>(topk_idx);
    a.num_tokens = num_tokens;
    a.num_topk = num_topk;
    a.active_ranks = pointer<int32_t>(active_ranks);
    a.timeout_us = timeout_us;
    a.recv_x = pointer<void>(recv_x);
    a.recv_count = pointer<int32_t>(recv_count);
    a.src_info = pointer<int32_t>(src_info);
    a.layout_range = pointer<int64_t>(layout_range);
    return a;
  }

  void enqueueDispatch(const DispatchArgs& a, uintptr_t stream, const std::string& stages) {
    std::string error;
    if (!group().dispatch(a, streamOf(stream), &error, stagesOf(stages))) throw std::runtime_error(error);
  }

  EpIpcGroup& group() {
    if (!group_) throw std::runtime_error("EP IPC group: already closed");
    return *group_;
  }

  void dispatch(uintptr_t x, uintptr_t topk_idx, int num_tokens, int num_topk, uintptr_t active_ranks,
                int64_t timeout_us, bool use_fp8, uintptr_t recv_x, uintptr_t recv_scales, uintptr_t recv_count,
                uintptr_t src_info, uintptr_t layout_range, uintptr_t stream, const std::string& stages) {
    DispatchArgs a = dispatchArgs(x, topk_idx, num_tokens, num_topk, active_ranks, timeout_us, recv_x, recv_count,
                                  src_info, layout_range);
    a.use_fp8 = use_fp8;
    a.recv_scales = pointer<float>(recv_scales);
    enqueueDispatch(a, stream, stages);
  }

  // Rows as bytes in two parts (ByteRows): the head from x, the tail from `tail`.
  void dispatchBytes(uintptr_t x, size_t head_bytes, uintptr_t tail, size_t tail_bytes, uintptr_t topk_idx,
                     int num_tokens, int num_topk, uintptr_t active_ranks, int64_t timeout_us, uintptr_t recv_x,
                     uintptr_t recv_tail, int zeroed_rows, uintptr_t recv_count, uintptr_t src_info,
                     uintptr_t layout_range, uintptr_t stream, const std::string& stages) {
    DispatchArgs a = dispatchArgs(x, topk_idx, num_tokens, num_topk, active_ranks, timeout_us, recv_x, recv_count,
                                  src_info, layout_range);
    a.bytes = ByteRows{true, head_bytes, pointer<const void>(tail), tail_bytes, pointer<void>(recv_tail), zeroed_rows};
    enqueueDispatch(a, stream, stages);
  }

  void combine(uintptr_t y, uintptr_t src_info, uintptr_t layout_range, uintptr_t topk_idx, uintptr_t topk_weights,
               int num_tokens, int num_topk, uintptr_t active_ranks, int64_t timeout_us, uintptr_t out,
               uintptr_t stream, const std::string& stages, int channels) {
    CombineArgs a;
    a.y = pointer<const void>(y);
    a.src_info = pointer<const int32_t>(src_info);
    a.layout_range = pointer<const int64_t>(layout_range);
    a.topk_idx = pointer<const int64_t>(topk_idx);
    a.topk_weights = pointer<const float>(topk_weights);
    a.num_tokens = num_tokens;
    a.num_topk = num_topk;
    a.active_ranks = pointer<int32_t>(active_ranks);
    a.timeout_us = timeout_us;
    a.out = pointer<void>(out);
    a.channels = channels;
    std::string error;
    if (!group().combine(a, streamOf(stream), &error, stagesOf(stages))) throw std::runtime_error(error);
  }

 private:
  std::unique_ptr<EpIpcGroup> group_;
};

}  // namespace

PYBIND11_MODULE(_ep_ipc, m) {
  m.doc() = "EP dispatch/combine kernels over CUDA IPC between the processes of one host (docs/ep-kernels.md)";
  m.attr("MAX_RANKS") = kMaxEpRanks;
  py::class_<PyEpIpcGroup>(m, "EpIpcGroup")
      .def(py::init<const std::string&, int, int, int, int, int, int, int, uint32_t>(), py::arg("name"),
           py::arg("rank"), py::arg("num_ranks"), py::arg("max_tokens_per_rank"), py::arg("hidden"),
           py::arg("num_experts"), py::arg("device"), py::arg("attach_timeout_ms"), py::arg("absent") = 0,
           "Collective: every rank of the host group but the `absent` ones (bit r: rank r takes no part) opens "
           "the same name with the same sizes and the same `absent`.")
      .def("close", &PyEpIpcGroup::close)
      .def("dispatch", &PyEpIpcGroup::dispatch, py::arg("x"), py::arg("topk_idx"), py::arg("num_tokens"),
           py::arg("num_topk"), py::arg("active_ranks"), py::arg("timeout_us"), py::arg("use_fp8"), py::arg("recv_x"),
           py::arg("recv_scales"), py::arg("recv_count"), py::arg("src_info"), py::arg("layout_range"),
           py::arg("stream"), py::arg("stages") = "all")
      .def("combine", &PyEpIpcGroup::combine, py::arg("y"), py::arg("src_info"), py::arg("layout_range"),
           py::arg("topk_idx"), py::arg("topk_weights"), py::arg("num_tokens"), py::arg("num_topk"),
           py::arg("active_ranks"), py::arg("timeout_us"), py::arg("out"), py::arg("stream"), py::arg("stages") = "all",
           py::arg("channels") = 0, "channels: bf16 channels of y's and out's rows, their row stride (0: hidden)")
      .def("dispatch_bytes", &PyEpIpcGroup::dispatchBytes, py::arg("x"), py::arg("head_bytes"), py::arg("tail"),
           py::arg("tail_bytes"), py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"),
           py::arg("active_ranks"), py::arg("timeout_us"), py::arg("recv_x"), py::arg("recv_tail"),
           py::arg("zeroed_rows"), py::arg("recv_count"), py::arg("src_info"), py::arg("layout_range"),
           py::arg("stream"), py::arg("stages") = "all",
           "Rows as bytes in two parts: head_bytes of each row of x, then tail_bytes of each row of tail; "
           "received into recv_x [L, S, head_bytes] and recv_tail [L, S, tail_bytes]; each local expert's rows "
           "from its count up to zeroed_rows are zeros. Sizes are multiples of 16 adding up to at most 2 * hidden.");
}
