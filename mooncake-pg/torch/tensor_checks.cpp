#include "tensor_checks.h"

#include <c10/util/Exception.h>

namespace mooncake::pg {

WireType wireTypeOf(const at::Tensor& t, const char* op, const char* arg) {
  switch (t.scalar_type()) {
    case at::kChar: return {DataType::kInt8};
    case at::kByte: return {DataType::kUInt8};
    case at::kShort: return {DataType::kInt16};
    case at::kUInt16: return {DataType::kUInt16};
    case at::kInt: return {DataType::kInt32};
    case at::kUInt32: return {DataType::kUInt32};
    case at::kLong: return {DataType::kInt64};
    case at::kUInt64: return {DataType::kUInt64};
    case at::kHalf: return {DataType::kFloat16};
    case at::kBFloat16: return {DataType::kBFloat16};
    case at::kFloat: return {DataType::kFloat32};
    case at::kDouble: return {DataType::kFloat64};
    case at::kBool: return {DataType::kBool};
    case at::kFloat8_e4m3fn: return {DataType::kFloat8E4M3};
    case at::kFloat8_e5m2: return {DataType::kFloat8E5M2};
    case at::kComplexHalf: return {DataType::kFloat16, 2};
    case at::kComplexFloat: return {DataType::kFloat32, 2};
    case at::kComplexDouble: return {DataType::kFloat64, 2};
    default:
      TORCH_CHECK_TYPE(false, op, ": ", arg, " has dtype ", t.scalar_type(), ", which mooncake-cpu does not support");
  }
}

ReduceOp reduceOpOf(const c10d::ReduceOp& op, const at::Tensor& t, const WireType& w, const char* opname) {
  ReduceOp out;
  switch (op.op_) {
    case c10d::ReduceOp::SUM: out = ReduceOp::kSum; break;
    case c10d::ReduceOp::AVG: out = ReduceOp::kAvg; break;
    case c10d::ReduceOp::PRODUCT: out = ReduceOp::kProduct; break;
    case c10d::ReduceOp::MIN: out = ReduceOp::kMin; break;
    case c10d::ReduceOp::MAX: out = ReduceOp::kMax; break;
    case c10d::ReduceOp::BAND: out = ReduceOp::kBand; break;
    case c10d::ReduceOp::BOR: out = ReduceOp::kBor; break;
    case c10d::ReduceOp::BXOR: out = ReduceOp::kBxor; break;
    default:
      TORCH_CHECK_VALUE(false, opname, ": op must be SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR or BXOR (PREMUL_SUM is not supported)");
  }
  TORCH_CHECK_VALUE(w.lanes == 1 || out == ReduceOp::kSum || out == ReduceOp::kAvg, opname,
                    ": complex tensors can only be reduced with SUM or AVG, got ", reduceOpName(out));
  std::string why = reductionUnsupportedReason(w.type, out);
  TORCH_CHECK_TYPE(why.empty(), opname, ": ", why, " (tensor dtype ", t.scalar_type(), ")");
  return out;
}

void checkCpuDense(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", arg, " is an undefined tensor");
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", arg, " is on ", t.device(),
                    "; the mooncake-cpu backend takes CPU tensors (use backend \"mooncake\" for CUDA)");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, op, ": ", arg, " must be a dense (strided) tensor, got layout ",
                    t.layout());
}

const at::Tensor& checkOne(const std::vector<at::Tensor>& tensors, const char* op, const char* arg) {
  TORCH_CHECK_VALUE(tensors.size() == 1, op, ": expects exactly one tensor in ", arg, ", got ", tensors.size());
  return tensors[0];
}

const at::Tensor& checkSingle(const std::vector<at::Tensor>& tensors, const char* op, const char* arg) {
  checkCpuDense(checkOne(tensors, op, arg), op, arg);
  return tensors[0];
}

size_t bytesOf(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

void checkSameKind(const at::Tensor& a, const at::Tensor& b, const char* op, const char* arg_a, const char* arg_b) {
  checkCpuDense(b, op, arg_b);
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), op, ": ", arg_a, " has dtype ", a.scalar_type(), " but ",
                   arg_b, " has dtype ", b.scalar_type(), "; they must match");
}

void checkRank(int64_t rank, int size, const char* op, const char* arg) {
  TORCH_CHECK_VALUE(rank >= 0 && rank < size, op, ": ", arg, " ", rank, " is not a rank of this group (size ", size,
                    ")");
}

void checkCudaDense(const at::Tensor& t, int device, const char* op, const char* arg) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", arg, " is an undefined tensor");
  TORCH_CHECK_VALUE(t.device().is_cuda(), op, ": ", arg, " is on ", t.device(),
                    "; the mooncake backend takes CUDA tensors (use backend \"mooncake-cpu\" for CPU tensors)");
  TORCH_CHECK_VALUE(device < 0 || t.device().index() == device, op, ": ", arg, " is on ", t.device(),
                    " but this group's other tensors are on cuda:", device, "; use one device per rank");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, op, ": ", arg, " must be a dense (strided) tensor, got layout ",
                    t.layout());
}

void splitLayout(const at::Tensor& t, const std::vector<int64_t>& splits, int world, const char* op, const char* arg,
                 std::vector<size_t>& offsets, std::vector<size_t>& bytes) {
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const size_t row_bytes = rows == 0 ? 0 : bytesOf(t) / rows;
  std::vector<int64_t> s = splits;
  if (s.empty()) {
    TORCH_CHECK_VALUE(rows % world == 0, op, ": without split sizes, ", arg, ".size(0) (", rows,
                      ") must be divisible by world_size (", world, ")");
    s.assign(world, rows / world);
  }
  TORCH_CHECK_VALUE(static_cast<int>(s.size()) == world, op, ": ", arg, "_split_sizes must have world_size (", world,
                    ") entries, got ", s.size());
  int64_t total = 0;
  for (int64_t v : s) {
    TORCH_CHECK_VALUE(v >= 0, op, ": ", arg, "_split_sizes must not be negative");
    total += v;
  }
  TORCH_CHECK_VALUE(total == rows, op, ": ", arg, "_split_sizes sum to ", total, " but ", arg, ".size(0) is ", rows);
  offsets.resize(world);
  bytes.resize(world);
  size_t off = 0;
  for (int p = 0; p < world; ++p) {
    offsets[p] = off;
    bytes[p] = static_cast<size_t>(s[p]) * row_bytes;
    off += bytes[p];
  }
}

}  // namespace mooncake::pg
