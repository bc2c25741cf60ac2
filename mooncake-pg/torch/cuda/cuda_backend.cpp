#include "cuda_backend.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../tensor_checks.h"
#include "../without_gil.h"

namespace mooncake::pg {
namespace {

// CPU tensors of a "mooncake" group go to the host backend, as they would to
// Gloo beside NCCL (torch's object collectives use them, e.g.
// broadcast_object_list): torch gives every device of a group the one backend.
bool onCpu(const std::vector<at::Tensor>& tensors) {
  return !tensors.empty() && tensors[0].defined() && tensors[0].device().is_cpu();
}

bool allContiguous(const std::vector<at::Tensor>& tensors) {
  return std::all_of(tensors.begin(), tensors.end(), [](const at::Tensor& t) { return t.is_contiguous(); });
}

std::vector<at::Tensor> concat(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  std::vector<at::Tensor> out = a;
  out.insert(out.end(), b.begin(), b.end());
  return out;
}

// The host backend's options for a staged call: always asynchronous (the
// operation thread runs it once the input copies are done).
template <typename Options>
Options asyncCopy(const Options& opts) {
  Options o = opts;
  o.asyncOp = true;
  return o;
}

}  // namespace

MooncakeCudaBackend::MooncakeCudaBackend(c10::intrusive_ptr<MooncakeCpuBackend> host)
    : c10d::Backend(host->getRank(), host->getSize()),
      host_(std::move(host)),
      staging_(*host_),
      fast_(std::make_unique<CudaFastPath>(*host_)) {}

MooncakeCudaBackend::~MooncakeCudaBackend() {
  try {
    shutdown();
  } catch (const std::exception& e) {  // a destructor must not throw: the process would end
    LOG(WARNING) << "mooncake: shutting the group down failed: " << e.what();
  }
}

void MooncakeCudaBackend::shutdown() {
  runWithoutGil([this] {
    if (fast_) fast_->shutdown();  // its watcher completes Works that Python holds
  });
}

void MooncakeCudaBackend::checkTensor(const at::Tensor& t, const char* op, const char* arg) {
  checkCudaDense(t, device_.load(), op, arg);
  int unset = -1;
  device_.compare_exchange_strong(unset, t.device().index());
  checkCudaDense(t, device_.load(), op, arg);
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::onStream(const std::vector<at::Tensor>& tensors, c10d::OpType type,
                                                             std::vector<at::Tensor> outputs, const StreamBody& body) {
  if (!allContiguous(tensors)) return {};
  std::shared_ptr<cuda::CudaIpcGroup> group = fast_->groupFor(device_.load());
  if (!group) return {};
  const c10::DeviceIndex device = static_cast<c10::DeviceIndex>(group->device());
  c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device);
  cuda::CudaOp op = body(*group, stream.stream());
  if (!op.result.ok) return {};  // broke at launch: every rank's staged path takes it from here
  auto work = c10::make_intrusive<MooncakeCudaWork>(getRank(), type, host_->maxGroupSize(), std::move(outputs), device,
                                                    MooncakeCudaWork::Kind::kOnStream);
  if (op.id == 0) {  // captured into a graph: it runs at replay, ordered by the graph
    work->complete(OpResult{});
    return work;
  }
  work->recordDone(stream);
  fast_->track(std::move(group), op.id, work);
  return work;
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::alone(c10d::OpType type, std::vector<at::Tensor> outputs) {
  // A reduction or broadcast over one rank leaves the tensor as it is (as
  // NCCL does for one rank): nothing to enqueue, nothing to wait for.
  if (worldSize() != 1 || host_->membership().activeConfig()->active != std::vector<int>{0}) return {};
  auto work = c10::make_intrusive<MooncakeCudaWork>(getRank(), type, host_->maxGroupSize(), std::move(outputs),
                                                    static_cast<c10::DeviceIndex>(device_.load()),
                                                    MooncakeCudaWork::Kind::kOnStream);
  work->complete(OpResult{});
  return work;
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                              const c10d::AllreduceOptions& opts) {
  if (onCpu(tensors)) return host_->allreduce(tensors, opts);
  at::Tensor t = checkOne(tensors, "all_reduce", "tensor");
  checkTensor(t, "all_reduce", "tensor");
  const WireType w = wireTypeOf(t, "all_reduce", "tensor");
  const ReduceOp op = reduceOpOf(opts.reduceOp, t, w, "all_reduce");
  if (auto work = alone(c10d::OpType::ALLREDUCE, {t})) return work;
  if (auto work = onStream({t}, c10d::OpType::ALLREDUCE, {t}, [&](cuda::CudaIpcGroup& g, cudaStream_t s) {
        return g.allreduce(t.data_ptr(), t.data_ptr(), t.numel() * w.lanes, w.type, op, s);
      })) {
    return work;
  }
  return staged(c10d::OpType::ALLREDUCE, "all_reduce", {t}, {t}, [&](auto&, auto& out) {
    return host_->allreduce(out, asyncCopy(opts));
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                        const c10d::AllreduceCoalescedOptions& opts) {
  if (onCpu(tensors)) return host_->allreduce_coalesced(tensors, opts);
  std::vector<WireType> wires;
  std::vector<ReduceOp> ops;
  for (const at::Tensor& t : tensors) {
    checkTensor(t, "all_reduce_coalesced", "tensors");
    wires.push_back(wireTypeOf(t, "all_reduce_coalesced", "tensors"));
    ops.push_back(reduceOpOf(opts.reduceOp, t, wires.back(), "all_reduce_coalesced"));
  }
  if (auto work = onStream(tensors, c10d::OpType::ALLREDUCE_COALESCED, tensors,
                           [&](cuda::CudaIpcGroup& g, cudaStream_t s) {
                             cuda::CudaOp last;
                             for (size_t i = 0; i < tensors.size() && last.result.ok; ++i) {
                               last = g.allreduce(tensors[i].data_ptr(), tensors[i].data_ptr(),
                                                  tensors[i].numel() * wires[i].lanes, wires[i].type, ops[i], s);
                             }
                             return last;
                           })) {
    return work;
  }
  return staged(c10d::OpType::ALLREDUCE_COALESCED, "all_reduce_coalesced", tensors, tensors,
                [&](auto&, auto& out) { return host_->allreduce_coalesced(out, opts); });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                              const c10d::BroadcastOptions& opts) {
  if (onCpu(tensors)) return host_->broadcast(tensors, opts);
  at::Tensor t = checkOne(tensors, "broadcast", "tensor");
  checkTensor(t, "broadcast", "tensor");
  wireTypeOf(t, "broadcast", "tensor");
  checkRank(opts.rootRank, worldSize(), "broadcast", "src");
  const int root = static_cast<int>(opts.rootRank);
  if (auto work = alone(c10d::OpType::BROADCAST, {t})) return work;
  if (auto work = onStream({t}, c10d::OpType::BROADCAST, {t}, [&](cuda::CudaIpcGroup& g, cudaStream_t s) {
        return g.broadcast(t.data_ptr(), bytesOf(t), root, s);
      })) {
    return work;
  }
  return staged(c10d::OpType::BROADCAST, "broadcast", {t}, {t},
                [&](auto&, auto& out) { return host_->broadcast(out, asyncCopy(opts)); });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::reduce(std::vector<at::Tensor>& tensors,
                                                           const c10d::ReduceOptions& opts) {
  if (onCpu(tensors)) return host_->reduce(tensors, opts);
  at::Tensor t = checkOne(tensors, "reduce", "tensor");
  checkTensor(t, "reduce", "tensor");
  const WireType w = wireTypeOf(t, "reduce", "tensor");
  const ReduceOp op = reduceOpOf(opts.reduceOp, t, w, "reduce");
  checkRank(opts.rootRank, worldSize(), "reduce", "dst");
  const int root = static_cast<int>(opts.rootRank);
  if (auto work = alone(c10d::OpType::REDUCE, {t})) return work;
  if (auto work = onStream({t}, c10d::OpType::REDUCE, {t}, [&](cuda::CudaIpcGroup& g, cudaStream_t s) {
        return g.reduce(t.data_ptr(), t.data_ptr(), t.numel() * w.lanes, w.type, op, root, s);
      })) {
    return work;
  }
  return staged(c10d::OpType::REDUCE, "reduce", {t}, {t},
                [&](auto&, auto& out) { return host_->reduce(out, asyncCopy(opts)); });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                    const c10d::AllgatherOptions& opts) {
  if (onCpu({input})) return host_->_allgather_base(output, input, opts);
  std::vector<at::Tensor> outputs{output}, inputs{input};
  return allgather_into_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                    std::vector<at::Tensor>& inputs,
                                                                                    const c10d::AllgatherOptions& opts) {
  if (onCpu(inputs)) return host_->allgather_into_tensor_coalesced(outputs, inputs, opts);
  const char* op = "all_gather_into_tensor";
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), op, ": ", outputs.size(), " output tensors but ", inputs.size(),
                    " inputs");
  if (!inputs.empty()) host_->awaitWorldFor(inputs[0], outputs[0]);  // sized for the view a pending failure gives
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], op, "input_tensor");
    checkTensor(outputs[i], op, "output_tensor");
    wireTypeOf(inputs[i], op, "input_tensor");
    TORCH_CHECK_TYPE(inputs[i].scalar_type() == outputs[i].scalar_type(), op,
                     ": input_tensor and output_tensor must have the same dtype");
    TORCH_CHECK_VALUE(outputs[i].numel() == inputs[i].numel() * worldSize(), op,
                      ": output_tensor must have world_size (", worldSize(), ") times the elements of input_tensor (",
                      inputs[i].numel(), "), got ", outputs[i].numel());
  }
  if (auto work = onStream(concat(inputs, outputs), c10d::OpType::_ALLGATHER_BASE, outputs,
                           [&](cuda::CudaIpcGroup& g, cudaStream_t s) {
                             cuda::CudaOp last;
                             for (size_t i = 0; i < inputs.size() && last.result.ok; ++i) {
                               last = g.allgather(inputs[i].data_ptr(), outputs[i].data_ptr(), bytesOf(inputs[i]), s);
                             }
                             return last;
                           })) {
    return work;
  }
  return staged(c10d::OpType::_ALLGATHER_BASE, op, inputs, outputs, [&](auto& in, auto& out) {
    return host_->allgather_into_tensor_coalesced(out, in, asyncCopy(opts));
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                              std::vector<at::Tensor>& inputs,
                                                              const c10d::AllgatherOptions& opts) {
  if (onCpu(inputs)) return host_->allgather(outputs, inputs, opts);
  TORCH_CHECK_VALUE(inputs.size() == 1 && outputs.size() == 1, "all_gather: expects one input and one output list");
  at::Tensor in = inputs[0];
  std::vector<at::Tensor> list = outputs[0];
  checkTensor(in, "all_gather", "tensor");
  wireTypeOf(in, "all_gather", "tensor");
  TORCH_CHECK_VALUE(static_cast<int>(list.size()) == worldSize(), "all_gather: tensor_list must have world_size (",
                    worldSize(), ") tensors, got ", list.size());
  for (const at::Tensor& o : list) {
    checkTensor(o, "all_gather", "tensor_list[i]");
    TORCH_CHECK_TYPE(o.scalar_type() == in.scalar_type(), "all_gather: tensor_list[i] must have the input's dtype");
    TORCH_CHECK_VALUE(o.numel() == in.numel(), "all_gather: every tensor in tensor_list must have ", in.numel(),
                      " elements like the input, got ", o.numel());
  }
  if (auto work = onStream({in}, c10d::OpType::ALLGATHER, list, [&](cuda::CudaIpcGroup& g, cudaStream_t s) {
        // One block per rank in a stream-ordered scratch tensor, then into the list.
        at::Tensor flat = at::empty({static_cast<int64_t>(list.size()) * in.numel()}, in.options());
        cuda::CudaOp r = g.allgather(in.data_ptr(), flat.data_ptr(), bytesOf(in), s);
        for (size_t p = 0; r.result.ok && p < list.size(); ++p) {
          list[p].copy_(flat.narrow(0, p * in.numel(), in.numel()).view_as(list[p]), /*non_blocking=*/true);
        }
        return r;
      })) {
    return work;
  }
  return staged(c10d::OpType::ALLGATHER, "all_gather", {in}, list, [&](auto& hin, auto& hout) {
    std::vector<std::vector<at::Tensor>> lists{hout};
    return host_->allgather(lists, hin, asyncCopy(opts));
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                        std::vector<at::Tensor>& inputs,
                                                                        const c10d::AllgatherOptions& opts) {
  if (onCpu(inputs)) return host_->allgather_coalesced(outputs, inputs, opts);
  const char* op = "all_gather_coalesced";
  std::vector<at::Tensor> flat_outputs;
  for (const at::Tensor& t : inputs) checkTensor(t, op, "input_list[i]");
  for (const auto& list : outputs) {
    for (const at::Tensor& t : list) {
      checkTensor(t, op, "output_lists[i][j]");
      flat_outputs.push_back(t);
    }
  }
  return staged(c10d::OpType::ALLGATHER_COALESCED, op, inputs, flat_outputs, [&](auto& hin, auto& hout) {
    std::vector<std::vector<at::Tensor>> lists;
    size_t next = 0;
    for (const auto& list : outputs) {
      lists.emplace_back(hout.begin() + next, hout.begin() + next + list.size());
      next += list.size();
    }
    return host_->allgather_coalesced(lists, hin, opts);
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                         const c10d::ReduceScatterOptions& opts) {
  if (onCpu({input})) return host_->_reduce_scatter_base(output, input, opts);
  std::vector<at::Tensor> outputs{output}, inputs{input};
  return reduce_scatter_tensor_coalesced(outputs, inputs, opts);
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  if (onCpu(inputs)) return host_->reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  const char* op = "reduce_scatter_tensor";
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), op, ": ", outputs.size(), " output tensors but ", inputs.size(),
                    " inputs");
  if (!outputs.empty()) host_->awaitWorldFor(outputs[0], inputs[0]);  // sized for the view a pending failure gives
  std::vector<WireType> wires;
  std::vector<ReduceOp> ops;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkTensor(inputs[i], op, "input");
    checkTensor(outputs[i], op, "output");
    TORCH_CHECK_TYPE(inputs[i].scalar_type() == outputs[i].scalar_type(), op,
                     ": input and output must have the same dtype");
    wires.push_back(wireTypeOf(inputs[i], op, "input"));
    ops.push_back(reduceOpOf(opts.reduceOp, inputs[i], wires.back(), op));
    TORCH_CHECK_VALUE(inputs[i].numel() == outputs[i].numel() * worldSize(), op, ": input must have world_size (",
                      worldSize(), ") times the elements of output (", outputs[i].numel(), "), got ",
                      inputs[i].numel());
  }
  if (auto work = onStream(concat(inputs, outputs), c10d::OpType::_REDUCE_SCATTER_BASE, outputs,
                           [&](cuda::CudaIpcGroup& g, cudaStream_t s) {
                             cuda::CudaOp last;
                             for (size_t i = 0; i < inputs.size() && last.result.ok; ++i) {
                               last = g.reduceScatter(inputs[i].data_ptr(), outputs[i].data_ptr(),
                                                      outputs[i].numel() * wires[i].lanes, wires[i].type, ops[i], s);
                             }
                             return last;
                           })) {
    return work;
  }
  return staged(c10d::OpType::_REDUCE_SCATTER_BASE, op, inputs, outputs, [&](auto& in, auto& out) {
    return host_->reduce_scatter_tensor_coalesced(out, in, asyncCopy(opts));
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                   std::vector<std::vector<at::Tensor>>& inputs,
                                                                   const c10d::ReduceScatterOptions& opts) {
  if (onCpu(outputs)) return host_->reduce_scatter(outputs, inputs, opts);
  TORCH_CHECK_VALUE(outputs.size() == 1 && inputs.size() == 1, "reduce_scatter: expects one output and one input list");
  at::Tensor out = outputs[0];
  checkTensor(out, "reduce_scatter", "output");
  TORCH_CHECK_VALUE(static_cast<int>(inputs[0].size()) == worldSize(), "reduce_scatter: input_list must have "
                    "world_size (", worldSize(), ") tensors, got ", inputs[0].size());
  std::vector<at::Tensor> parts;
  for (const at::Tensor& in : inputs[0]) {
    checkTensor(in, "reduce_scatter", "input_list[i]");
    TORCH_CHECK_VALUE(in.numel() == out.numel(), "reduce_scatter: every tensor in input_list must have ", out.numel(),
                      " elements like output, got ", in.numel());
    parts.push_back(in.reshape({-1}));
  }
  // One input tensor with a block per rank, built on the current stream.
  std::vector<at::Tensor> flat{at::cat(parts)}, outs{out};
  return reduce_scatter_tensor_coalesced(outs, flat, opts);
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                  std::vector<int64_t>& output_split_sizes,
                                                                  std::vector<int64_t>& input_split_sizes,
                                                                  const c10d::AllToAllOptions& opts) {
  if (onCpu({input})) return host_->alltoall_base(output, input, output_split_sizes, input_split_sizes, opts);
  const char* op = "all_to_all_single";
  checkTensor(input, op, "input");
  checkTensor(output, op, "output");
  TORCH_CHECK_TYPE(input.scalar_type() == output.scalar_type(), op, ": input and output must have the same dtype");
  wireTypeOf(input, op, "input");
  std::vector<size_t> so, sb, ro, rb;
  splitLayout(input, input_split_sizes, worldSize(), op, "input", so, sb);
  splitLayout(output, output_split_sizes, worldSize(), op, "output", ro, rb);
  if (auto work = onStream({input, output}, c10d::OpType::ALLTOALL_BASE, {output},
                           [&](cuda::CudaIpcGroup& g, cudaStream_t s) {
                             return g.alltoall(input.data_ptr(), so, sb, output.data_ptr(), ro, rb, s);
                           })) {
    return work;
  }
  return staged(c10d::OpType::ALLTOALL_BASE, op, {input}, {output}, [&](auto& in, auto& out) {
    return host_->alltoall_base(out[0], in[0], output_split_sizes, input_split_sizes, asyncCopy(opts));
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllToAllOptions& opts) {
  if (onCpu(inputs)) return host_->alltoall(outputs, inputs, opts);
  const char* op = "all_to_all";
  for (const at::Tensor& t : inputs) checkTensor(t, op, "input_tensor_list[i]");
  for (const at::Tensor& t : outputs) checkTensor(t, op, "output_tensor_list[i]");
  return staged(c10d::OpType::ALLTOALL, op, inputs, outputs,
                [&](auto& in, auto& out) { return host_->alltoall(out, in, opts); });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                           std::vector<at::Tensor>& inputs,
                                                           const c10d::GatherOptions& opts) {
  if (onCpu(inputs)) return host_->gather(outputs, inputs, opts);
  checkOne(inputs, "gather", "tensor");
  checkTensor(inputs[0], "gather", "tensor");
  std::vector<at::Tensor> list = outputs.empty() ? std::vector<at::Tensor>{} : outputs[0];
  for (const at::Tensor& t : list) checkTensor(t, "gather", "gather_list[i]");
  return staged(c10d::OpType::GATHER, "gather", inputs, list, [&](auto& in, auto& out) {
    std::vector<std::vector<at::Tensor>> lists;
    if (!outputs.empty()) lists.push_back(out);
    return host_->gather(lists, in, opts);
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::scatter(std::vector<at::Tensor>& outputs,
                                                            std::vector<std::vector<at::Tensor>>& inputs,
                                                            const c10d::ScatterOptions& opts) {
  if (onCpu(outputs)) return host_->scatter(outputs, inputs, opts);
  checkOne(outputs, "scatter", "tensor");
  checkTensor(outputs[0], "scatter", "tensor");
  std::vector<at::Tensor> list = inputs.empty() ? std::vector<at::Tensor>{} : inputs[0];
  for (const at::Tensor& t : list) checkTensor(t, "scatter", "scatter_list[i]");
  return staged(c10d::OpType::SCATTER, "scatter", list, outputs, [&](auto& in, auto& out) {
    std::vector<std::vector<at::Tensor>> lists;
    if (!inputs.empty()) lists.push_back(in);
    return host_->scatter(out, lists, opts);
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::barrier(const c10d::BarrierOptions& opts) {
  // As with NCCL and the reference: when barrier() returns, every rank's
  // work queued before it on its current stream has run. Each rank waits for
  // its own stream, then the ranks meet on the host (a failed peer fails
  // that meeting; the stream's own work ends even when a peer died, see the
  // watchdog of the IPC plane). During graph capture nothing can wait: the
  // barrier is then the host's alone, at capture time, as before.
  int device = device_.load();
  if (device < 0 && !opts.device_ids.empty()) device = static_cast<int>(opts.device_ids.front());
  if (device < 0 && c10::cuda::device_count() > 0) {
    // No CUDA operation on this group yet: the current device's stream, if
    // this process uses CUDA at all (no context is created just to wait).
    const c10::DeviceIndex current = c10::cuda::current_device();
    if (c10::cuda::hasPrimaryContext(current)) device = current;
  }
  if (device >= 0) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    if (c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None) {
      const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream();
      runWithoutGil([&] { current.synchronize(); });
    }
  }
  return host_->barrier(opts);
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  if (onCpu(tensors)) return host_->send(tensors, dst_rank, tag);
  checkOne(tensors, "send", "tensor");
  checkTensor(tensors[0], "send", "tensor");
  return staged(c10d::OpType::SEND, "send", tensors, {}, [&](auto& in, auto&) {
    return host_->send(in, dst_rank, tag);
  }, HostStaging::Start::kNow);
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  if (onCpu(tensors)) return host_->recv(tensors, src_rank, tag);
  checkOne(tensors, "recv", "tensor");
  checkTensor(tensors[0], "recv", "tensor");
  return staged(c10d::OpType::RECV, "recv", {}, tensors, [&](auto&, auto& out) {
    return host_->recv(out, src_rank, tag);
  }, HostStaging::Start::kNow);
}

c10::intrusive_ptr<c10d::Work> MooncakeCudaBackend::recvAnysource(std::vector<at::Tensor>&, int) {
  TORCH_CHECK(false, "mooncake: receiving from any source is not supported; name the source rank");
}

}  // namespace mooncake::pg
