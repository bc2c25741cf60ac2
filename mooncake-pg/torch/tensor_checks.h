// Argument checks shared by the operations: each failure raises on the
// calling rank with a message naming the argument and the rule, before
// anything is queued, so the group stays usable.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <string>
#include <vector>

#include "mooncake/pg/types.h"

namespace mooncake::pg {

// The core's element type for a tensor, with the element count multiplier
// (complex tensors travel as pairs of reals).
struct WireType {
  DataType type;
  int64_t lanes = 1;
};

WireType wireTypeOf(const at::Tensor& t, const char* op, const char* arg);
ReduceOp reduceOpOf(const c10d::ReduceOp& op, const at::Tensor& t, const WireType& w, const char* opname);

void checkCpuDense(const at::Tensor& t, const char* op, const char* arg);
// The one tensor of `tensors` (torch passes lists where an operation takes one).
const at::Tensor& checkOne(const std::vector<at::Tensor>& tensors, const char* op, const char* arg);
// checkOne, and the tensor is a dense CPU tensor.
const at::Tensor& checkSingle(const std::vector<at::Tensor>& tensors, const char* op, const char* arg);
size_t bytesOf(const at::Tensor& t);
void checkSameKind(const at::Tensor& a, const at::Tensor& b, const char* op, const char* arg_a, const char* arg_b);
void checkRank(int64_t rank, int size, const char* op, const char* arg);

// A CUDA tensor of device `device` (-1: any CUDA device), dense (the checks
// of the "mooncake" backend).
void checkCudaDense(const at::Tensor& t, int device, const char* op, const char* arg);

// The byte offset and length of each rank's piece of `t` for all_to_all_single:
// `splits` rows per rank (empty: size(0) split evenly over `world` ranks).
void splitLayout(const at::Tensor& t, const std::vector<int64_t>& splits, int world, const char* op, const char* arg,
                 std::vector<size_t>& offsets, std::vector<size_t>& bytes);

}  // namespace mooncake::pg
