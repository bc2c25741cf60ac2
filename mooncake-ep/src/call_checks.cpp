#include "call_checks.h"

#include <cstdint>

#include "elastic_layout.h"                      // tailFormatError
#include "mooncake/pg/cuda/common/cuda_calls.h"  // cudaWhat, DeviceScope

namespace mooncake::ep::cuda {

std::string checkGroupSizes(int rank, int num_ranks, const EpIpcGroupOptions& o) {
  if (num_ranks < 1 || num_ranks > kMaxEpRanks || rank < 0 || rank >= num_ranks) {
    return "invalid rank/size (at most " + std::to_string(kMaxEpRanks) + " ranks)";
  }
  if (o.max_tokens_per_rank < 1 || o.hidden < kChannelsPerScale || o.hidden % kChannelsPerScale != 0 ||
      o.hidden > 8192) {
    return "max_tokens_per_rank must be >= 1 and hidden a multiple of 128 up to 8192";
  }
  if (o.num_experts < num_ranks || o.num_experts % num_ranks != 0) {
    return "num_experts must be a positive multiple of the number of ranks";
  }
  if (o.output_slots < 0 || (o.output_slots > 0 && o.num_experts != num_ranks)) {
    return "output_slots must be >= 0, and 0 unless num_experts equals the number of ranks";
  }
  return {};
}

namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The rules of DispatchArgs::bytes (the kernels copy 16-byte vectors).
std::string checkByteRows(const DispatchArgs& args, const RegionLayout& layout) {
  const ByteRows& b = args.bytes;
  if (args.use_fp8) return "bytes rows are moved as given: use_fp8 (quantising in the kernel) does not apply";
  if (b.head_bytes % 16 != 0 || b.tail_bytes % 16 != 0 || b.head_bytes + b.tail_bytes > 2 * size_t(layout.H)) {
    return "bytes.head_bytes and bytes.tail_bytes must be multiples of 16 adding up to at most 2 * hidden";
  }
  if (b.tail_bytes > 0 && (b.recv_tail == nullptr || (args.num_tokens > 0 && b.tail == nullptr))) {
    return "bytes.tail and bytes.recv_tail are required with tail_bytes";
  }
  if (b.zeroed_rows < 0 || b.zeroed_rows > layout.R * layout.T) {
    return "bytes.zeroed_rows must be in [0, num_ranks * max_tokens_per_rank]";
  }
  if (!aligned16(args.x) || !aligned16(b.tail) || !aligned16(args.recv_x) || !aligned16(b.recv_tail)) {
    return "x, bytes.tail, recv_x and bytes.recv_tail must be 16-byte aligned";
  }
  return {};
}

// The rules of DispatchArgs::direct (ep_ipc_group.h).
std::string checkDirectHeads(const DispatchArgs& args, const RegionLayout& layout) {
  const DirectHeads& d = args.direct;
  if (layout.O == 0) return "direct heads need a group opened with output slots";
  if (!args.bytes.enabled || (args.num_tokens > 0 && args.pick_slots == nullptr)) {
    return "direct heads go with byte rows and pick_slots";
  }
  if (d.gathered_ranges == nullptr || d.gathered_stride < layout.R + 1 || d.slot_word < layout.R ||
      d.slot_word >= d.gathered_stride) {
    return "direct.gathered_ranges is required, and direct.slot_word must follow the R counts in rows of "
           "direct.gathered_stride words";
  }
  if (d.own_slot < -1 || d.own_slot >= layout.O) return "direct.own_slot must be -1 or an output slot";
  if (d.own_slot >= 0 && args.recv_x != nullptr && args.bytes.head_bytes > 0) {
    return "with direct.own_slot, recv_x is null: the heads arrive in that slot";
  }
  return {};
}

// The rules of DispatchArgs::receive_layout (ep_ipc_group.h).
std::string checkReceiveLayout(const DispatchArgs& args, const RegionLayout& layout) {
  const ReceiveLayoutArgs& r = args.receive_layout;
  if (!args.bytes.enabled || layout.L != 1) return "receive_layout goes with byte rows and one local expert per rank";
  if (r.num_ranks != layout.R || r.capacity > static_cast<int64_t>(layout.R) * layout.T ||
      r.tail_bytes != static_cast<int64_t>(args.bytes.tail_bytes) || r.num_tokens != args.num_tokens ||
      r.num_topk != args.num_topk) {
    return "receive_layout: num_ranks, tail_bytes, num_tokens and num_topk must be the call's, and capacity at most "
           "R * T";
  }
  // Tensors of no elements may be null (an empty tensor's address): the picks' without picks, the rows' without rows.
  const bool picks = r.num_tokens > 0 && r.num_topk > 0, rows = r.capacity > 0;
  if (picks && (r.topk_idx == nullptr || r.token_index == nullptr)) {
    return "receive_layout: topk_idx and token_index are required";
  }
  if (r.gathered == nullptr || r.gathered_ranges == nullptr || r.scaleup_psum == nullptr ||
      (picks && r.slots == nullptr) || (rows && (r.real == nullptr || r.metadata == nullptr)) ||
      (rows && r.num_topk > 0 && r.local == nullptr)) {
    return "receive_layout: gathered, gathered_ranges and every output with elements are required";
  }
  if (std::string why = receiveLayoutError(r); !why.empty()) return "receive_layout: " + why;
  return {};
}

// DispatchArgs::carried, when the call carries a row.
std::string checkCarriedRows(const DispatchArgs& args) {
  const CarriedRows& c = args.carried;
  if (c.bytes <= 0 || c.bytes % 16 != 0 || static_cast<size_t>(c.bytes) > kCarriedRowBytes) {
    return "carried_bytes must be a positive multiple of 16, at most " + std::to_string(kCarriedRowBytes);
  }
  if (c.received == nullptr || c.ranges == nullptr) return "a carried row needs carried_received and carried_ranges";
  if (!aligned16(c.mine) || !aligned16(c.received) || reinterpret_cast<uintptr_t>(c.ranges) % 8 != 0) {
    return "the carried rows must be 16-byte aligned, carried_ranges 8-byte aligned";
  }
  if (args.direct.gathered != nullptr) {
    return "a carried row and direct heads exclude each other (direct heads need the counts before the call)";
  }
  return {};
}

// DispatchArgs::own_send, when the send blocks build the rows from the caller's inputs.
std::string checkOwnSend(const DispatchArgs& args, const RegionLayout& layout) {
  const OwnSendInputs& o = args.own_send;
  if (!args.bytes.enabled || layout.L != 1 || args.direct.gathered != nullptr) {
    return "own_send goes with byte rows, one local expert per rank and no direct heads";
  }
  if (o.picks_per_rank < 1) return "own_send.picks_per_rank must be >= 1";
  const SendTailArgs& t = o.tail;
  if (t.head_bytes != static_cast<int64_t>(args.bytes.head_bytes) ||
      t.tail_bytes != static_cast<int64_t>(args.bytes.tail_bytes) || t.num_tokens != args.num_tokens ||
      t.num_topk != args.num_topk) {
    return "own_send.tail: head_bytes, tail_bytes, num_tokens and num_topk must be the call's";
  }
  if (std::string why = tailFormatError(t); !why.empty()) return "own_send.tail: " + why;
  // The tail holds the payload only where it is not the head.
  if (args.num_tokens > 0 && t.head_bytes == 0 && t.payload_bytes > 0 && t.payload == nullptr) {
    return "own_send.tail: payload is required";
  }
  return {};
}

}  // namespace

std::string checkDispatchCall(const DispatchArgs& args, const RegionLayout& layout) {
  if (args.num_tokens < 0 || args.num_tokens > layout.T) return "num_tokens must be in [0, max_tokens_per_rank]";
  const bool needs_x = !args.bytes.enabled || args.bytes.head_bytes > 0;  // byte rows may be all tail
  if (args.num_topk < 0 || (args.num_tokens > 0 && args.num_topk > 0 && args.topk_idx == nullptr) ||
      (args.num_tokens > 0 && needs_x && args.x == nullptr)) {
    return "x and topk_idx are required";
  }
  if (args.bytes.enabled) {
    if (std::string why = checkByteRows(args, layout); !why.empty()) return why;
  }
  if (args.direct.gathered != nullptr) {
    if (std::string why = checkDirectHeads(args, layout); !why.empty()) return why;
  }
  if (args.with_receive_layout) {
    if (std::string why = checkReceiveLayout(args, layout); !why.empty()) return why;
  }
  if (args.own_send.picks != nullptr) {
    if (std::string why = checkOwnSend(args, layout); !why.empty()) return why;
  }
  if (args.carried.mine != nullptr) {
    if (std::string why = checkCarriedRows(args); !why.empty()) return why;
  } else if (args.carried.bytes != 0 || args.carried.received != nullptr || args.carried.ranges != nullptr) {
    return "carried_bytes, carried_received and carried_ranges go with a carried row (carried)";
  }
  const bool heads_in_slot = args.direct.gathered != nullptr && args.direct.own_slot >= 0;
  if (args.active_ranks == nullptr || (needs_x && !heads_in_slot && args.recv_x == nullptr) ||
      args.recv_count == nullptr || args.src_info == nullptr || args.layout_range == nullptr ||
      (args.use_fp8 && args.recv_scales == nullptr)) {
    return "active_ranks and every output are required (recv_scales with use_fp8)";
  }
  if (args.timeout_us < -1) return "timeout_us must be -1 or >= 0";
  return {};
}

std::string checkCombineCall(const CombineArgs& args, const RegionLayout& layout) {
  if (args.num_tokens < 0 || args.num_tokens > layout.T) return "num_tokens must be in [0, max_tokens_per_rank]";
  if (args.num_topk < 0 ||
      (args.num_tokens > 0 && (args.topk_idx == nullptr || args.topk_weights == nullptr || args.out == nullptr))) {
    return "topk_idx, topk_weights and out are required";
  }
  if (args.y == nullptr || args.src_info == nullptr || args.layout_range == nullptr || args.active_ranks == nullptr) {
    return "y, the dispatch handle (src_info, layout_range) and active_ranks are required";
  }
  if (args.channels < 0 || args.channels % 8 != 0 || args.channels > layout.H) {
    return "channels must be a multiple of 8 in [0, hidden] (0: hidden)";
  }
  if (args.timeout_us < -1) return "timeout_us must be -1 or >= 0";
  return {};
}

std::string LaunchGate::run(int device, const std::function<cudaError_t()>& launch,
                            const std::function<void()>& on_failure) {
  if (!broken_.empty()) return broken_;
  mooncake::pg::cuda::DeviceScope scope(device);
  cudaGetLastError();  // an earlier, unrelated error must not be taken for this launch's
  const cudaError_t err = launch();
  if (err == cudaSuccess) return {};
  broken_ = "the group is unusable after a failed launch (" + mooncake::pg::cuda::cudaWhat("launch", err) +
            "); open a new one";
  on_failure();
  return broken_;
}

}  // namespace mooncake::ep::cuda
