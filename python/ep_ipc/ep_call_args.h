// The EP kernels' call arguments from what Python passes (device addresses
// as integers, the stream as its raw handle, the stages by name): one
// spelling for every binding of a group that runs the kernels (mooncake._ep_ipc,
// mooncake._ep_nccl).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

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

}  // namespace mooncake::ep::python
