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
#include "layout_call_args.h"
#include "mooncake/ep/cuda/elastic_layout.h"
#include "mooncake/ep/cuda/ep_ipc_group.h"
#include "mooncake/ep/cuda/trace.h"

namespace py = pybind11;
using namespace mooncake::ep::cuda;
using mooncake::ep::python::addSendExtras;
using mooncake::ep::python::defineKernelCalls;
using mooncake::ep::python::KernelCalls;
using mooncake::ep::python::receiveLayoutArgs;
using mooncake::ep::python::sendLayoutArgs;
using mooncake::ep::python::sendTailArgs;
using mooncake::ep::python::streamOf;

namespace {

// Holds the group; close() ends it early (collective), as the destructor would.
class PyEpIpcGroup : public KernelCalls<PyEpIpcGroup> {
 public:
  PyEpIpcGroup(const std::string& name, int rank, int num_ranks, int max_tokens_per_rank, int hidden, int num_experts,
               int device, int attach_timeout_ms, uint32_t absent, int output_slots) {
    EpIpcGroupOptions options;
    options.absent = absent;
    options.output_slots = output_slots;
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

  // The region's memory, kept while the returned object lives (outputs handed out in slots).
  struct RegionLease {
    std::shared_ptr<void> memory;
  };
  RegionLease lease() { return RegionLease{group().lease()}; }

 private:
  std::unique_ptr<EpIpcGroup> group_;
};

void raiseUnless(bool ok, const std::string& error) {
  if (!ok) throw std::runtime_error(error);
}

// ElasticBuffer's IPC-path layout kernels (mooncake/ep/cuda/elastic_layout.h),
// called by python/mooncake/_ep_elastic/layout_kernels.py.
void defineLayoutKernels(py::module_& m) {
  m.def(
      "layout_send",
      [](uintptr_t topk_idx, int num_tokens, int num_topk, int num_local, int num_ranks, uintptr_t dest,
         uintptr_t dest_slots, uintptr_t token_index, uintptr_t counts, int count_words, uintptr_t shape,
         int shape_words, uintptr_t tile_counts, int64_t tile_count_words, uintptr_t stream, int offer_word,
         uintptr_t active_ranks, uintptr_t payload, int64_t payload_bytes, uintptr_t scales, int64_t scale_bytes,
         uintptr_t weights, int64_t head_bytes, int64_t ids_at, uintptr_t tail, int64_t tail_bytes, uintptr_t zeroed,
         int64_t zeroed_words, uintptr_t topk_copy) {
        std::string error;
        SendLayoutArgs a =
            sendLayoutArgs(topk_idx, num_tokens, num_topk, num_local, num_ranks, dest, dest_slots, token_index, counts,
                           count_words, shape, shape_words, tile_counts, tile_count_words, offer_word, active_ranks);
        addSendExtras(a, payload, payload_bytes, scales, scale_bytes, weights, head_bytes, ids_at, tail, tail_bytes,
                      zeroed, zeroed_words, topk_copy);
        raiseUnless(layoutSend(a, streamOf(stream), &error), error);
      },
      py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("num_local"), py::arg("num_ranks"),
      py::arg("dest"), py::arg("dest_slots"), py::arg("token_index"), py::arg("counts"), py::arg("count_words"),
      py::arg("shape"), py::arg("shape_words"), py::arg("tile_counts"), py::arg("tile_count_words"), py::arg("stream"),
      py::arg("offer_word") = -1, py::arg("active_ranks") = 0, py::arg("payload") = 0, py::arg("payload_bytes") = 0,
      py::arg("scales") = 0, py::arg("scale_bytes") = 0, py::arg("weights") = 0, py::arg("head_bytes") = 0,
      py::arg("ids_at") = 0, py::arg("tail") = 0, py::arg("tail_bytes") = 0, py::arg("zeroed") = 0,
      py::arg("zeroed_words") = 0, py::arg("topk_copy") = 0,
      "Destinations per token (int64 [N, k]) and their rows there (int32 [N, k]), each pick's token index among those "
      "sent to its rank (int32 [N, k]), "
      "and the row the counts are gathered in (int32 [count_words]: tokens per rank, then shape, then zeros); "
      "tile_counts: int32 scratch of tile_count_words >= ceil(N / 256) * num_ranks (num_ranks when N = 0); "
      "offer_word (-1: none) of the counts row is written -1 while any of active_ranks (int32 [num_ranks]) is 0. "
      "In the same launch (each when given): the rows' tails as send_tail stages them (payload .. tail_bytes, with "
      "these picks), zeroed_words int64 zeros at zeroed, and a copy of topk_idx at topk_copy");
  m.def(
      "send_tail",
      [](uintptr_t payload, int64_t payload_bytes, uintptr_t scales, int64_t scale_bytes, uintptr_t topk_idx,
         uintptr_t weights, int num_tokens, int num_topk, int64_t head_bytes, int64_t ids_at, uintptr_t tail,
         int64_t tail_bytes, uintptr_t stream) {
        std::string error;
        raiseUnless(sendTail(sendTailArgs(payload, payload_bytes, scales, scale_bytes, topk_idx, weights, num_tokens,
                                          num_topk, head_bytes, ids_at, tail, tail_bytes),
                             streamOf(stream), &error),
                    error);
      },
      py::arg("payload"), py::arg("payload_bytes"), py::arg("scales"), py::arg("scale_bytes"), py::arg("topk_idx"),
      py::arg("weights"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("head_bytes"), py::arg("ids_at"),
      py::arg("tail"), py::arg("tail_bytes"), py::arg("stream"),
      "The rows' staged tails (bytes [head_bytes, head_bytes + tail_bytes) of each row); 0 for an absent input");
  m.def(
      "layout_receive",
      [](uintptr_t topk_idx, uintptr_t token_index, uintptr_t gathered, int64_t gathered_stride,
         uintptr_t gathered_ranges, int num_tokens, uintptr_t ranges, uintptr_t src_token, uintptr_t recv_tail,
         int64_t tail_bytes, int64_t ids_at, int64_t weights_at, int64_t capacity, int num_topk, int num_local,
         int num_ranks, int rank, int tokens_per_rank, uintptr_t slots, uintptr_t real, uintptr_t local,
         uintptr_t weights, uintptr_t metadata, uintptr_t per_expert, uintptr_t expert_psum, uintptr_t scaleup_psum,
         uintptr_t finished_blocks, uintptr_t stream) {
        std::string error;
        raiseUnless(layoutReceive(
                        receiveLayoutArgs(topk_idx, token_index, gathered, gathered_stride, gathered_ranges, num_tokens,
                                          ranges, src_token, recv_tail, tail_bytes, ids_at, weights_at, capacity,
                                          num_topk, num_local, num_ranks, rank, tokens_per_rank, slots, real, local,
                                          weights, metadata, per_expert, expert_psum, scaleup_psum, finished_blocks),
                        streamOf(stream), &error),
                    error);
      },
      py::arg("topk_idx"), py::arg("token_index"), py::arg("gathered"), py::arg("gathered_stride"),
      py::arg("gathered_ranges"), py::arg("num_tokens"), py::arg("ranges"), py::arg("src_token"), py::arg("recv_tail"),
      py::arg("tail_bytes"), py::arg("ids_at"), py::arg("weights_at"), py::arg("capacity"), py::arg("num_topk"),
      py::arg("num_local"), py::arg("num_ranks"), py::arg("rank"), py::arg("tokens_per_rank"), py::arg("slots"),
      py::arg("real"), py::arg("local"), py::arg("weights"), py::arg("metadata"), py::arg("per_expert"),
      py::arg("expert_psum"), py::arg("scaleup_psum"), py::arg("finished_blocks"), py::arg("stream"),
      "The received rows' layout (offsets in the tail; weights 0 / weights_at -1 without weights), with every "
      "rank's counts as gathered (rows of gathered_stride int32, gathered_ranges per source); per_expert is added to "
      "and finished_blocks counted in (zero both first), expert_psum is per_expert's inclusive prefix sums");
}

// The kernels' step stamps (mooncake/ep/cuda/trace.h), for
// benchmarks/ep_graph_probe.py --trace: present in every build, and they
// raise where the build does not stamp.
void defineTrace(py::module_& m) {
  m.def("trace_enabled", &trace::enabled, "Whether this build stamps the kernels' steps (MOONCAKE_EP_TRACE=ON)");
  m.def(
      "trace_points",
      [] {
        py::list names;
        for (const std::string& name : trace::pointNames()) names.append(name);
        return names;
      },
      "The stamped points' names, in order");
  m.def(
      "trace_reset",
      [] {
        raiseUnless(trace::reset(), "trace_reset: this build does not stamp (MOONCAKE_EP_TRACE=OFF) or CUDA failed");
      },
      "Clears the stamps (synchronous): call with the device idle, before the call to look at");
  m.def(
      "trace_read",
      [] {
        trace::Stamps stamps{};
        raiseUnless(trace::read(&stamps),
                    "trace_read: this build does not stamp (MOONCAKE_EP_TRACE=OFF) or CUDA failed");
        py::list points;
        for (int p = 0; p < trace::kPoints; ++p) points.append(py::make_tuple(stamps.first[p], stamps.last[p]));
        return points;
      },
      "Per point (trace_points' order), (first, last) %globaltimer ns of the blocks that reached it since "
      "trace_reset: first 2**64 - 1 and last 0 where none did");
}

}  // namespace

PYBIND11_MODULE(_ep_ipc, m) {
  m.doc() = "EP dispatch/combine kernels over CUDA IPC between the processes of one host (docs/ep-kernels.md)";
  m.attr("MAX_RANKS") = kMaxEpRanks;
  py::class_<PyEpIpcGroup::RegionLease> lease_class(m, "RegionLease");
  lease_class.doc() = "Keeps an EP IPC group's receive region allocated while it lives";
  py::class_<PyEpIpcGroup> group_class(m, "EpIpcGroup");
  group_class
      .def(py::init<const std::string&, int, int, int, int, int, int, int, uint32_t, int>(), py::arg("name"),
           py::arg("rank"), py::arg("num_ranks"), py::arg("max_tokens_per_rank"), py::arg("hidden"),
           py::arg("num_experts"), py::arg("device"), py::arg("attach_timeout_ms"), py::arg("absent") = 0,
           py::arg("output_slots") = 0,
           "Collective: every rank of the host group but the `absent` ones (bit r: rank r takes no part) opens "
           "the same name with the same sizes, the same `absent` and the same `output_slots` (receive buffers for "
           "outputs, with one expert per rank).")
      .def("close", &PyEpIpcGroup::close)
      .def_property_readonly("output_slots", [](PyEpIpcGroup& g) { return g.group().outputSlots(); })
      .def_property_readonly("output_slot_bytes", [](PyEpIpcGroup& g) { return g.group().outputSlotBytes(); })
      .def(
          "output_slot",
          [](PyEpIpcGroup& g, int slot) { return reinterpret_cast<uintptr_t>(g.group().outputSlot(slot)); },
          py::arg("slot"), "Slot's device address (0 outside [0, output_slots))")
      .def("lease", &PyEpIpcGroup::lease,
           "An object that keeps the receive region (and its output slots) allocated while it lives, after close too");
  defineKernelCalls<PyEpIpcGroup>(group_class);
  defineLayoutKernels(m);
  defineTrace(m);
}
