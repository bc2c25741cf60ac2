// The EP kernels' calls as Python makes them (device addresses as integers,
// the stream as its raw handle, the stages by name): one spelling for every
// binding of a group that runs the kernels (mooncake._ep_ipc's EpIpcGroup,
// mooncake._ep_nccl's EpNcclGroup), which derives from KernelCalls and
// declares them with defineKernelCalls.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "layout_call_args.h"
#include "mooncake/ep/cuda/ep_ipc_group.h"

namespace mooncake::ep::python {

using cuda::CombineArgs;
using cuda::DispatchArgs;
using cuda::EpStages;

template <typename T>
T* pointer(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

inline cudaStream_t streamOf(uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

inline EpStages stagesOf(const std::string& stages) {
  if (stages == "all") return EpStages::kAll;
  if (stages == "send") return EpStages::kSendOnly;
  if (stages == "receive") return EpStages::kReceiveOnly;
  throw pybind11::value_error("stages: must be 'all', 'send' or 'receive', got '" + stages + "'");
}

inline DispatchArgs dispatchArgs(uintptr_t x, uintptr_t topk_idx, int num_tokens, int num_topk, uintptr_t active_ranks,
                                 int64_t timeout_us, bool use_fp8, uintptr_t recv_x, uintptr_t recv_scales,
                                 uintptr_t recv_count, uintptr_t src_info, uintptr_t layout_range) {
  DispatchArgs a;
  a.x = pointer<const void>(x);
  a.topk_idx = pointer<const int64_t>(topk_idx);
  a.num_tokens = num_tokens;
  a.num_topk = num_topk;
  a.active_ranks = pointer<int32_t>(active_ranks);
  a.timeout_us = timeout_us;
  a.use_fp8 = use_fp8;
  a.recv_x = pointer<void>(recv_x);
  a.recv_scales = pointer<float>(recv_scales);
  a.recv_count = pointer<int32_t>(recv_count);
  a.src_info = pointer<int32_t>(src_info);
  a.layout_range = pointer<int64_t>(layout_range);
  return a;
}

inline CombineArgs combineArgs(uintptr_t y, uintptr_t src_info, uintptr_t layout_range, uintptr_t topk_idx,
                               uintptr_t topk_weights, int num_tokens, int num_topk, uintptr_t active_ranks,
                               int64_t timeout_us, uintptr_t out) {
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
  return a;
}

// Keyword arguments handed over as a dict: each read names the dict
// (`what`) and the key in the ValueError of a missing key.
class DictArgs {
 public:
  DictArgs(const pybind11::dict& d, const char* what) : d_(d), what_(what) {}
  uintptr_t address(const char* key) const { return at(key).cast<uintptr_t>(); }
  int64_t i64(const char* key) const { return at(key).cast<int64_t>(); }
  int i32(const char* key) const { return at(key).cast<int>(); }

 private:
  pybind11::handle at(const char* key) const {
    if (!d_.contains(key)) throw pybind11::value_error(std::string(what_) + ": '" + key + "' is missing");
    return d_[key];
  }
  const pybind11::dict& d_;
  const char* what_;
};

// DispatchArgs::receive_layout from layout_receive's keyword arguments (a
// dict, ReceivePlan.args of python/mooncake/_ep_elastic/layout_kernels.py)
// less ranges, src_token and recv_tail, which are the call's own.
inline cuda::ReceiveLayoutArgs receiveLayoutOf(const pybind11::dict& d) {
  const DictArgs a(d, "receive_layout");
  return receiveLayoutArgs(a.address("topk_idx"), a.address("token_index"), a.address("gathered"),
                           a.i64("gathered_stride"), a.address("gathered_ranges"), a.i32("num_tokens"), 0, 0, 0,
                           a.i64("tail_bytes"), a.i64("ids_at"), a.i64("weights_at"), a.i64("capacity"),
                           a.i32("num_topk"), a.i32("num_local"), a.i32("num_ranks"), a.i32("rank"),
                           a.i32("tokens_per_rank"), a.address("slots"), a.address("real"), a.address("local"),
                           a.address("weights"), a.address("metadata"), a.address("per_expert"),
                           a.address("expert_psum"), a.address("scaleup_psum"), a.address("finished_blocks"));
}

// DispatchArgs::own_send from a dict (SendLayout.own_send of
// python/mooncake/_ep_elastic/layout_kernels.py): the picks and how many
// experts a rank has, then the tail's sources as layout_send names them
// (sendTailArgs; the picks are its ids, and no staged tail is written).
inline cuda::OwnSendInputs ownSendOf(const pybind11::dict& d) {
  const DictArgs a(d, "own_send");
  cuda::OwnSendInputs o;
  o.picks = pointer<const int64_t>(a.address("picks"));
  o.picks_per_rank = a.i32("picks_per_rank");
  o.tail = sendTailArgs(a.address("payload"), a.i64("payload_bytes"), a.address("scales"), a.i64("scale_bytes"),
                        a.address("picks"), a.address("weights"), a.i32("num_tokens"), a.i32("num_topk"),
                        a.i64("head_bytes"), a.i64("ids_at"), 0, a.i64("tail_bytes"));
  return o;
}

// dispatch() and combine() of a binding `Binding` whose group() returns the
// native group; a refused call raises RuntimeError with the group's words.
template <typename Binding>
class KernelCalls {
 public:
  void dispatch(uintptr_t x, uintptr_t topk_idx, int num_tokens, int num_topk, uintptr_t active_ranks,
                int64_t timeout_us, bool use_fp8, uintptr_t recv_x, uintptr_t recv_scales, uintptr_t recv_count,
                uintptr_t src_info, uintptr_t layout_range, uintptr_t stream, const std::string& stages) {
    enqueue(dispatchArgs(x, topk_idx, num_tokens, num_topk, active_ranks, timeout_us, use_fp8, recv_x, recv_scales,
                         recv_count, src_info, layout_range),
            stream, stages);
  }

  // Rows as bytes in two parts (cuda::ByteRows): the head from x, the tail from `tail`.
  void dispatchBytes(uintptr_t x, size_t head_bytes, uintptr_t tail, size_t tail_bytes, uintptr_t topk_idx,
                     int num_tokens, int num_topk, uintptr_t active_ranks, int64_t timeout_us, uintptr_t recv_x,
                     uintptr_t recv_tail, int zeroed_rows, uintptr_t recv_count, uintptr_t src_info,
                     uintptr_t layout_range, uintptr_t stream, const std::string& stages, uintptr_t pick_slots,
                     uintptr_t gathered, int gathered_stride, uintptr_t gathered_ranges, int slot_word, int own_slot,
                     const pybind11::object& receive_layout, uintptr_t carried, int carried_bytes,
                     uintptr_t carried_received, uintptr_t carried_ranges, bool follows_layout_send,
                     const pybind11::object& own_send) {
    DispatchArgs a = dispatchArgs(x, topk_idx, num_tokens, num_topk, active_ranks, timeout_us, false, recv_x, 0,
                                  recv_count, src_info, layout_range);
    a.bytes =
        cuda::ByteRows{true, head_bytes, pointer<const void>(tail), tail_bytes, pointer<void>(recv_tail), zeroed_rows};
    a.pick_slots = pointer<const int32_t>(pick_slots);
    a.direct = cuda::DirectHeads{pointer<const int32_t>(gathered), gathered_stride,
                                 pointer<const int64_t>(gathered_ranges), slot_word, own_slot};
    a.carried = cuda::CarriedRows{pointer<const void>(carried), carried_bytes, pointer<void>(carried_received),
                                  pointer<int64_t>(carried_ranges)};
    a.follows_layout_send = follows_layout_send;
    if (!own_send.is_none()) a.own_send = ownSendOf(own_send.cast<pybind11::dict>());
    if (!receive_layout.is_none()) {
      a.with_receive_layout = true;
      a.receive_layout = receiveLayoutOf(receive_layout.cast<pybind11::dict>());
    }
    enqueue(a, stream, stages);
  }

  void combine(uintptr_t y, uintptr_t src_info, uintptr_t layout_range, uintptr_t topk_idx, uintptr_t topk_weights,
               int num_tokens, int num_topk, uintptr_t active_ranks, int64_t timeout_us, uintptr_t out,
               uintptr_t stream, const std::string& stages, int channels) {
    CombineArgs a = combineArgs(y, src_info, layout_range, topk_idx, topk_weights, num_tokens, num_topk, active_ranks,
                                timeout_us, out);
    a.channels = channels;
    std::string error;
    if (!self().group().combine(a, streamOf(stream), &error, stagesOf(stages))) throw std::runtime_error(error);
  }

 private:
  Binding& self() { return static_cast<Binding&>(*this); }

  void enqueue(const DispatchArgs& a, uintptr_t stream, const std::string& stages) {
    std::string error;
    if (!self().group().dispatch(a, streamOf(stream), &error, stagesOf(stages))) throw std::runtime_error(error);
  }
};

// The Python names and arguments of KernelCalls on `cls`.
template <typename Binding, typename Class>
void defineKernelCalls(Class& cls) {
  namespace py = pybind11;
  cls.def("dispatch", &Binding::dispatch, py::arg("x"), py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"),
          py::arg("active_ranks"), py::arg("timeout_us"), py::arg("use_fp8"), py::arg("recv_x"), py::arg("recv_scales"),
          py::arg("recv_count"), py::arg("src_info"), py::arg("layout_range"), py::arg("stream"),
          py::arg("stages") = "all");
  cls.def("combine", &Binding::combine, py::arg("y"), py::arg("src_info"), py::arg("layout_range"), py::arg("topk_idx"),
          py::arg("topk_weights"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("active_ranks"),
          py::arg("timeout_us"), py::arg("out"), py::arg("stream"), py::arg("stages") = "all", py::arg("channels") = 0,
          "channels: bf16 channels of y's and out's rows, their row stride (0: hidden)");
  cls.def("dispatch_bytes", &Binding::dispatchBytes, py::arg("x"), py::arg("head_bytes"), py::arg("tail"),
          py::arg("tail_bytes"), py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"),
          py::arg("active_ranks"), py::arg("timeout_us"), py::arg("recv_x"), py::arg("recv_tail"),
          py::arg("zeroed_rows"), py::arg("recv_count"), py::arg("src_info"), py::arg("layout_range"),
          py::arg("stream"), py::arg("stages") = "all", py::arg("pick_slots") = 0, py::arg("gathered") = 0,
          py::arg("gathered_stride") = 0, py::arg("gathered_ranges") = 0, py::arg("slot_word") = 0,
          py::arg("own_slot") = -1, py::arg("receive_layout") = py::none(), py::arg("carried") = 0,
          py::arg("carried_bytes") = 0, py::arg("carried_received") = 0, py::arg("carried_ranges") = 0,
          py::arg("follows_layout_send") = false, py::arg("own_send") = py::none(),
          "Rows as bytes in two parts: head_bytes of each row of x, then tail_bytes of each row of tail; received "
          "into recv_x [L, S, head_bytes] and recv_tail [L, S, tail_bytes]; each local expert's rows from its count "
          "up to zeroed_rows are zeros. Sizes are multiples of 16 adding up to at most 2 * hidden. pick_slots: "
          "int32 [num_tokens, num_topk] or 0, each pick's slot at its expert (the token's index among this rank's "
          "tokens that picked it, in token order), so that the send blocks need not count them. gathered (0: none): "
          "every rank's counts row as gathered (rows of gathered_stride int32: counts per rank, that rank's output "
          "slot at slot_word; gathered_ranges per source): heads go straight into each destination's output slot, "
          "this rank's own (own_slot, -1: none) then holds recv_x, which must be 0. receive_layout (None: none): "
          "layout_receive's keyword arguments but ranges, src_token, recv_tail and stream, for the call's copy blocks "
          "to lay out the received rows as they copy them (one local expert per rank; capacity at most R * T). "
          "carried (0: none): carried_bytes (a multiple of 16, at most 512) that go to every rank with the call's "
          "signals; every rank's arrive in carried_received [R, carried_bytes] (zeros from a rank not heard), with "
          "carried_ranges int64 [R] = (r << 32) | heard; not with gathered. follows_layout_send: the call is enqueued "
          "straight after layout_send on the same stream, nothing between them (its launch may overlap that "
          "kernel's end); never after another call of the group. own_send (None: none): a dict of picks (int64 "
          "[num_tokens, num_topk] global expert ids), picks_per_rank, and the tail's sources as layout_send takes "
          "them (payload, payload_bytes, scales, scale_bytes, weights, head_bytes, ids_at, tail_bytes, num_tokens, "
          "num_topk): the send blocks build the rows from these instead of topk_idx, pick_slots and tail (byte rows, "
          "one expert per rank, not with gathered).");
}

}  // namespace mooncake::ep::python
