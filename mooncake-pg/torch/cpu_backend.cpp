#include "cpu_backend.h"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <torch/csrc/utils/pybind.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "control_runtime.h"
#include "mooncake/pg/host_spanning_group.h"
#include "mooncake/te/host_identity.h"
#include "settings.h"
#include "tensor_checks.h"
#include "without_gil.h"

namespace mooncake::pg {
namespace {

// A tensor the core can read and write as one block: `t` itself when it is
// contiguous, else a contiguous copy (written back by the caller).
at::Tensor contiguousOf(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

thread_local std::function<std::string()> current_gate;

}  // namespace

OpGate::OpGate(std::function<std::string()> wait) : previous_(std::move(current_gate)) {
  current_gate = std::move(wait);
}

OpGate::~OpGate() { current_gate = std::move(previous_); }

std::function<std::string()> OpGate::current() { return current_gate; }

MooncakeCpuBackend::MooncakeCpuBackend(const c10::intrusive_ptr<c10d::Store>& store, const GroupIdentity& identity,
                                       std::chrono::milliseconds timeout, const MooncakeBackendOptions& options)
    : c10d::Backend(identity.rank, identity.size),
      max_group_size_(options.max_group_size > 0 ? options.max_group_size : identity.size) {
  TORCH_CHECK_VALUE(max_group_size_ >= identity.size, "MooncakeBackendOptions: max_group_size (", max_group_size_,
                    ") must be at least the group size (", identity.size, ")");
  TORCH_CHECK_VALUE(!options.active_ranks || options.active_ranks->numel() >= max_group_size_,
                    "MooncakeBackendOptions: active_ranks has ", options.active_ranks ? options.active_ranks->numel() : 0,
                    " elements but the group has ", max_group_size_,
                    " seats (max_group_size); it needs one int32 per seat");
  // Channels have a lane per seat: seats that join later are reached the
  // same way as founders. The collectives' channel is separate, so user P2P
  // never pairs with the collectives' messages (it carries traffic only
  // when the active seats span hosts).
  std::shared_ptr<P2pChannel> collectives;
  const int64_t override_us = settings().collective_timeout_us.load();
  const auto collective_timeout = override_us >= 0 ? std::chrono::milliseconds(override_us / 1000) : timeout;
  collective_timeout_ = collective_timeout;
  try {
    if (te::TransferEngine* engine = pgTransferEngine(&p2p_error_, jobSecret(store))) {
      P2pOptions o = p2pOptionsFromEnv();
      const int64_t p2p_us = settings().p2p_timeout_us.load();
      o.timeout = p2p_us >= 0 ? std::chrono::milliseconds(p2p_us / 1000) : timeout;
      p2p_ = std::make_shared<P2pChannel>(*engine, identity.rank, max_group_size_, o);
      o.timeout = collective_timeout;
      collectives = std::make_shared<P2pChannel>(*engine, identity.rank, max_group_size_, o);
    }
  } catch (const std::exception& e) {
    p2p_.reset();
    collectives.reset();
    p2p_error_ = e.what();
  }
  MembershipConfig m;
  m.key = identity.key_prefix + identity.group_name;
  m.seat = identity.rank;
  m.declared_size = identity.size;
  m.max_group_size = max_group_size_;
  m.rank_order = identity.global_ranks;
  m.global_rank = identity.global_ranks[identity.rank];
  m.is_extension = options.is_extension;
  m.auto_deactivate = options.auto_deactivate_on_failure;
  m.auto_sync = options.auto_sync_on_failure;
  m.timeout = timeout;
  m.shm.slot_bytes = envBytes("MOONCAKE_PG_SHM_SLOT_BYTES", 4u << 20);
  m.shm.timeout = collective_timeout;
  m.shm.attach_timeout = std::max(timeout, std::chrono::milliseconds(10000));
  m.mirror = options.active_ranks;
  membership_ = std::make_unique<GroupMembership>(store, std::move(m), p2p_, collectives);
}

P2pOptions MooncakeCpuBackend::p2pOptionsFromEnv() {
  P2pOptions o;
  o.chunk_bytes = envBytes("MOONCAKE_P2P_CHUNK_SIZE", o.chunk_bytes);
  size_t pool = envBytes("MOONCAKE_P2P_POOL_SIZE", o.chunk_bytes * o.pool_chunks);
  TORCH_CHECK_VALUE(pool >= o.chunk_bytes && pool % o.chunk_bytes == 0,
                    "MOONCAKE_P2P_POOL_SIZE must be a positive multiple of MOONCAKE_P2P_CHUNK_SIZE");
  o.pool_chunks = pool / o.chunk_bytes;
  // 0 turns the eager path off; otherwise capped by the chunk (p2p_channel.h).
  o.eager_bytes = envBytes("MOONCAKE_P2P_EAGER_SIZE", o.eager_bytes, 0);
  const char* in_place = std::getenv("MOONCAKE_P2P_SEND_IN_PLACE");
  if (in_place != nullptr && std::string(in_place) == "0") o.send_in_place = false;
  const char* recv_in_place = std::getenv("MOONCAKE_P2P_RECV_IN_PLACE");
  if (recv_in_place != nullptr && std::string(recv_in_place) == "0") o.recv_in_place = false;
  const char* ends_when_sent = std::getenv("MOONCAKE_P2P_EAGER_ENDS_WHEN_SENT");
  if (ends_when_sent != nullptr && std::string(ends_when_sent) == "0") o.eager_ends_when_sent = false;
  // Microseconds a caller waiting for small messages moves them itself (0: never).
  o.caller_poll =
      std::chrono::microseconds(envBytes("MOONCAKE_P2P_CALLER_POLL_US", static_cast<size_t>(o.caller_poll.count()), 0));
  return o;
}

P2pChannel& MooncakeCpuBackend::p2p(const char* op) {
  TORCH_CHECK(p2p_ != nullptr, "mooncake-cpu: ", op, " is unavailable in this group: ", p2p_error_);
  return *p2p_;
}

MooncakeCpuBackend::~MooncakeCpuBackend() {
  try {
    shutdown();
  } catch (const std::exception& e) {  // a destructor must not throw: the process would end
    LOG(WARNING) << "mooncake-cpu: shutting the group down failed: " << e.what();
  }
}

void MooncakeCpuBackend::shutdown() {
  runWithoutGil([this] {
    queue_.stop();
    if (membership_) membership_->shutdown();  // leaves the seat; drops the plane and the channels
    p2p_.reset();
  });
}

OpResult MooncakeCpuBackend::runCollective(const std::function<OpResult()>& body) {
  auto attempt = [&body] {
    try {
      return body();
    } catch (const std::exception& e) {  // never let an error escape the worker thread
      return OpResult::failure(e.what());
    }
  };
  OpResult result = attempt();
  if (result.ok) return result;
  std::vector<int> seen = result.failed_ranks;
  const std::vector<int> seats_first = membership_->planeSeats();
  // A collective that failed because ranks failed is run again over the
  // survivors (the reconciled view, or this plane without the failed seats),
  // unless it had already written part of its output. It then completes:
  // wait() returns the survivors' result, and the hint names the failed ranks.
  for (int tries = 0; !result.ok && !result.mismatch && tries < kCollectiveRetries; ++tries) {
    settleFailure(result);
    if (result.failed_ranks.empty() || result.output_written || !membership_->leaveOut(result.failed_ranks)) break;
    result = attempt();
    for (int q : result.failed_ranks) {
      if (std::find(seen.begin(), seen.end(), q) == seen.end()) seen.push_back(q);
    }
  }
  if (result.ok && !seen.empty()) {
    // The hint names every rank whose contribution the result lacks: also
    // those that failed at the same time as the one this rank saw.
    const std::vector<int> seats_now = membership_->planeSeats();
    for (int q : seats_first) {
      if (!std::binary_search(seats_now.begin(), seats_now.end(), q) &&
          std::find(seen.begin(), seen.end(), q) == seen.end()) {
        seen.push_back(q);
      }
    }
  }
  result.failed_ranks = seen;
  return result;
}

void MooncakeCpuBackend::settleFailure(const OpResult& result) {
  if (result.failed_ranks.empty()) return;  // nobody failed (lanes reopened by a view change): nothing to report
  // The failure reaches the control plane; with auto-sync, the reconciled
  // view is in place before the Work completes (a failed sync is reported,
  // never thrown: the Work already carries the operation's error).
  try {
    membership_->afterFailure(result);
  } catch (const std::exception& e) {
    LOG(WARNING) << "mooncake-cpu: reporting a failure to the control plane failed: " << e.what();
  }
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::enqueue(c10d::OpType type, std::vector<at::Tensor> outputs,
                                                           std::function<OpResult()> body, bool may_run_inline) {
  auto work = c10::make_intrusive<MooncakeWork>(getRank(), type, max_group_size_, std::move(outputs));
  std::function<std::string()> gate = OpGate::current();
  if (gate) may_run_inline = false;
  auto run = [this, work, gate = std::move(gate), body = std::move(body)] {
    if (gate) {
      std::string why = gate();
      if (!why.empty()) {
        work->complete(OpResult::failure(why));
        return;
      }
    }
    work->complete(runCollective(body));
  };
  if ((!may_run_inline || !queue_.runInlineIfIdle(run)) && !queue_.push(run)) {
    work->complete(OpResult::failure("the process group was shut down"));
  }
  return work;
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                             const c10d::AllreduceOptions& opts) {
  const at::Tensor& t = checkSingle(tensors, "all_reduce", "tensor");
  WireType w = wireTypeOf(t, "all_reduce", "tensor");
  ReduceOp op = reduceOpOf(opts.reduceOp, t, w, "all_reduce");
  at::Tensor io = contiguousOf(t);
  return enqueue(c10d::OpType::ALLREDUCE, {t}, [this, t, io, w, op] {
    OpResult r = plane().allreduce(io.data_ptr(), io.data_ptr(), io.numel() * w.lanes, w.type, op);
    if (r.ok && !io.is_same(t)) t.copy_(io);
    return r;
  }, !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                       const c10d::AllreduceCoalescedOptions& opts) {
  std::vector<at::Tensor> ios;
  std::vector<WireType> wires;
  std::vector<ReduceOp> ops;
  for (const at::Tensor& t : tensors) {
    checkCpuDense(t, "all_reduce_coalesced", "tensors");
    wires.push_back(wireTypeOf(t, "all_reduce_coalesced", "tensors"));
    ops.push_back(reduceOpOf(opts.reduceOp, t, wires.back(), "all_reduce_coalesced"));
    ios.push_back(contiguousOf(t));
  }
  return enqueue(c10d::OpType::ALLREDUCE_COALESCED, tensors, [this, tensors, ios, wires, ops] {
    OpResult r;
    for (size_t i = 0; i < ios.size() && r.ok; ++i) {
      r = plane().allreduce(ios[i].data_ptr(), ios[i].data_ptr(), ios[i].numel() * wires[i].lanes, wires[i].type,
                            ops[i]);
      if (r.ok && !ios[i].is_same(tensors[i])) tensors[i].copy_(ios[i]);
    }
    return r;
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                             const c10d::BroadcastOptions& opts) {
  const at::Tensor& t = checkSingle(tensors, "broadcast", "tensor");
  wireTypeOf(t, "broadcast", "tensor");
  checkRank(opts.rootRank, worldSize(), "broadcast", "src");
  TORCH_CHECK_VALUE(opts.rootTensor == 0, "broadcast: rootTensor must be 0 (one tensor per rank)");
  at::Tensor io = contiguousOf(t);
  int root = static_cast<int>(opts.rootRank);
  return enqueue(c10d::OpType::BROADCAST, {t}, [this, t, io, root] {
    OpResult r = plane().broadcast(io.data_ptr(), bytesOf(io), root);
    if (r.ok && !io.is_same(t)) t.copy_(io);
    return r;
  }, !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::reduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::ReduceOptions& opts) {
  const at::Tensor& t = checkSingle(tensors, "reduce", "tensor");
  WireType w = wireTypeOf(t, "reduce", "tensor");
  ReduceOp op = reduceOpOf(opts.reduceOp, t, w, "reduce");
  checkRank(opts.rootRank, worldSize(), "reduce", "dst");
  at::Tensor io = contiguousOf(t);
  int root = static_cast<int>(opts.rootRank);
  return enqueue(c10d::OpType::REDUCE, {t}, [this, t, io, w, op, root] {
    OpResult r = plane().reduce(io.data_ptr(), io.data_ptr(), io.numel() * w.lanes, w.type, op, root);
    if (r.ok && root == getRank() && !io.is_same(t)) t.copy_(io);
    return r;
  }, !opts.asyncOp);
}

void MooncakeCpuBackend::awaitWorldOf(int64_t wanted) const {
  if (wanted <= 0 || wanted >= worldSize()) return;
  static const std::chrono::milliseconds kSettleWithin = [] {
    const ControlOptions o = controlOptions();
    return o.heartbeat_timeout + o.reconciliation_window + std::chrono::milliseconds(1000);
  }();
  const auto until = std::chrono::steady_clock::now() + kSettleWithin;
  runWithoutGil([&] {  // views are applied on the Agent's thread; other Python threads go on
    while (worldSize() > wanted && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::allgatherPairs(std::vector<at::Tensor> outputs,
                                                                  std::vector<at::Tensor> inputs, const char* op,
                                                                  bool may_run_inline) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), op, ": ", outputs.size(), " output tensors but ", inputs.size(),
                    " inputs");
  std::vector<at::Tensor> ins, outs;
  if (!inputs.empty()) awaitWorldFor(inputs[0], outputs[0]);
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkCpuDense(inputs[i], op, "input_tensor");
    checkSameKind(inputs[i], outputs[i], op, "input_tensor", "output_tensor");
    wireTypeOf(inputs[i], op, "input_tensor");
    TORCH_CHECK_VALUE(outputs[i].numel() == inputs[i].numel() * worldSize(), op, ": output_tensor must have world_size (",
                      worldSize(), ") times the elements of input_tensor (", inputs[i].numel(), "), got ",
                      outputs[i].numel());
    ins.push_back(contiguousOf(inputs[i]));
    outs.push_back(contiguousOf(outputs[i]));
  }
  return enqueue(c10d::OpType::_ALLGATHER_BASE, outputs, [this, outputs, ins, outs] {
    OpResult r;
    for (size_t i = 0; i < ins.size() && r.ok; ++i) {
      r = plane().allgather(ins[i].data_ptr(), outs[i].data_ptr(), bytesOf(ins[i]));
      if (r.ok && !outs[i].is_same(outputs[i])) outputs[i].copy_(outs[i]);
    }
    return r;
  }, may_run_inline);
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                   const c10d::AllgatherOptions& opts) {
  return allgatherPairs({output}, {input}, "all_gather_into_tensor", !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                   std::vector<at::Tensor>& inputs,
                                                                                   const c10d::AllgatherOptions& opts) {
  return allgatherPairs(outputs, inputs, "all_gather_into_tensor_coalesced", !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                             std::vector<at::Tensor>& inputs,
                                                             const c10d::AllgatherOptions&) {
  const at::Tensor& in = checkSingle(inputs, "all_gather", "tensor");
  wireTypeOf(in, "all_gather", "tensor");
  TORCH_CHECK_VALUE(outputs.size() == 1, "all_gather: expects one output list, got ", outputs.size());
  std::vector<at::Tensor> list = outputs[0];
  TORCH_CHECK_VALUE(static_cast<int>(list.size()) == worldSize(), "all_gather: tensor_list must have world_size (",
                    worldSize(), ") tensors, got ", list.size());
  for (const at::Tensor& o : list) {
    checkSameKind(in, o, "all_gather", "tensor", "tensor_list[i]");
    TORCH_CHECK_VALUE(o.numel() == in.numel(), "all_gather: every tensor in tensor_list must have ", in.numel(),
                      " elements like the input, got ", o.numel());
  }
  at::Tensor src = contiguousOf(in);
  return enqueue(c10d::OpType::ALLGATHER, list, [this, list, src] {
    at::Tensor flat = at::empty({static_cast<int64_t>(list.size()) * src.numel()}, src.options());
    OpResult r = plane().allgather(src.data_ptr(), flat.data_ptr(), bytesOf(src));
    for (size_t i = 0; r.ok && i < list.size(); ++i) list[i].copy_(flat.narrow(0, i * src.numel(), src.numel()).view_as(list[i]));
    return r;
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                       std::vector<at::Tensor>& inputs,
                                                                       const c10d::AllgatherOptions&) {
  const char* op = "all_gather_coalesced";
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), op, ": ", outputs.size(), " output lists for ", inputs.size(),
                    " inputs");
  std::vector<at::Tensor> srcs, all_outputs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkCpuDense(inputs[i], op, "input_list[i]");
    wireTypeOf(inputs[i], op, "input_list[i]");
    TORCH_CHECK_VALUE(static_cast<int>(outputs[i].size()) == worldSize(), op, ": output list ", i,
                      " must have world_size (", worldSize(), ") tensors");
    for (const at::Tensor& o : outputs[i]) {
      checkSameKind(inputs[i], o, op, "input_list[i]", "output_lists[i][j]");
      TORCH_CHECK_VALUE(o.numel() == inputs[i].numel(), op, ": output tensors must match their input's size");
      all_outputs.push_back(o);
    }
    srcs.push_back(contiguousOf(inputs[i]));
  }
  return enqueue(c10d::OpType::ALLGATHER_COALESCED, all_outputs, [this, outputs, srcs] {
    OpResult r;
    for (size_t i = 0; r.ok && i < srcs.size(); ++i) {
      const int64_t n = srcs[i].numel();
      at::Tensor flat = at::empty({n * worldSize()}, srcs[i].options());
      r = plane().allgather(srcs[i].data_ptr(), flat.data_ptr(), bytesOf(srcs[i]));
      for (int p = 0; r.ok && p < worldSize(); ++p) outputs[i][p].copy_(flat.narrow(0, p * n, n).view_as(outputs[i][p]));
    }
    return r;
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::reduceScatterPairs(std::vector<at::Tensor> outputs,
                                                                      std::vector<at::Tensor> inputs,
                                                                      const c10d::ReduceOp& reduce_op, const char* op,
                                                                      bool may_run_inline) {
  TORCH_CHECK_VALUE(outputs.size() == inputs.size(), op, ": ", outputs.size(), " output tensors but ", inputs.size(),
                    " inputs");
  std::vector<at::Tensor> ins, outs;
  std::vector<WireType> wires;
  std::vector<ReduceOp> ops;
  if (!outputs.empty()) awaitWorldFor(outputs[0], inputs[0]);
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkCpuDense(inputs[i], op, "input");
    checkSameKind(inputs[i], outputs[i], op, "input", "output");
    wires.push_back(wireTypeOf(inputs[i], op, "input"));
    ops.push_back(reduceOpOf(reduce_op, inputs[i], wires.back(), op));
    TORCH_CHECK_VALUE(inputs[i].numel() == outputs[i].numel() * worldSize(), op, ": input must have world_size (",
                      worldSize(), ") times the elements of output (", outputs[i].numel(), "), got ", inputs[i].numel());
    ins.push_back(contiguousOf(inputs[i]));
    outs.push_back(contiguousOf(outputs[i]));
  }
  return enqueue(c10d::OpType::_REDUCE_SCATTER_BASE, outputs, [this, outputs, ins, outs, wires, ops] {
    OpResult r;
    for (size_t i = 0; i < ins.size() && r.ok; ++i) {
      r = plane().reduceScatter(ins[i].data_ptr(), outs[i].data_ptr(), outs[i].numel() * wires[i].lanes,
                                wires[i].type, ops[i]);
      if (r.ok && !outs[i].is_same(outputs[i])) outputs[i].copy_(outs[i]);
    }
    return r;
  }, may_run_inline);
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                        const c10d::ReduceScatterOptions& opts) {
  return reduceScatterPairs({output}, {input}, opts.reduceOp, "reduce_scatter_tensor", !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  return reduceScatterPairs(outputs, inputs, opts.reduceOp, "reduce_scatter_tensor_coalesced", !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                                  std::vector<std::vector<at::Tensor>>& inputs,
                                                                  const c10d::ReduceScatterOptions& opts) {
  const at::Tensor& out = checkSingle(outputs, "reduce_scatter", "output");
  TORCH_CHECK_VALUE(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == worldSize(),
                    "reduce_scatter: input_list must have world_size (", worldSize(), ") tensors");
  for (const at::Tensor& in : inputs[0]) {
    checkSameKind(out, in, "reduce_scatter", "output", "input_list[i]");
    TORCH_CHECK_VALUE(in.numel() == out.numel(), "reduce_scatter: every tensor in input_list must have ", out.numel(),
                      " elements like output, got ", in.numel());
  }
  std::vector<at::Tensor> flat_parts;
  for (const at::Tensor& in : inputs[0]) flat_parts.push_back(in.reshape({-1}));
  at::Tensor flat = at::cat(flat_parts);
  return reduceScatterPairs({out}, {flat}, opts.reduceOp, "reduce_scatter", !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                                 std::vector<int64_t>& output_split_sizes,
                                                                 std::vector<int64_t>& input_split_sizes,
                                                                 const c10d::AllToAllOptions& opts) {
  const char* op = "all_to_all_single";
  checkCpuDense(input, op, "input");
  checkSameKind(input, output, op, "input", "output");
  wireTypeOf(input, op, "input");
  const int W = worldSize();
  std::vector<size_t> so, sb, ro, rb;
  splitLayout(input, input_split_sizes, W, op, "input", so, sb);
  splitLayout(output, output_split_sizes, W, op, "output", ro, rb);
  at::Tensor in = contiguousOf(input), out = contiguousOf(output);
  return enqueue(c10d::OpType::ALLTOALL_BASE, {output}, [this, output, in, out, so, sb, ro, rb] {
    OpResult r = plane().alltoall(in.data_ptr(), so, sb, out.data_ptr(), ro, rb);
    if (r.ok && !out.is_same(output)) output.copy_(out);
    return r;
  }, !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::alltoall(std::vector<at::Tensor>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllToAllOptions&) {
  const char* op = "all_to_all";
  const int W = worldSize();
  TORCH_CHECK_VALUE(static_cast<int>(inputs.size()) == W && static_cast<int>(outputs.size()) == W, op,
                    ": input_tensor_list and output_tensor_list must have world_size (", W, ") tensors, got ",
                    inputs.size(), " and ", outputs.size());
  std::vector<size_t> so(W), sb(W), ro(W), rb(W);
  size_t soff = 0, roff = 0;
  for (int p = 0; p < W; ++p) {
    checkCpuDense(inputs[p], op, "input_tensor_list[i]");
    checkSameKind(inputs[0], inputs[p], op, "input_tensor_list[0]", "input_tensor_list[i]");
    checkSameKind(inputs[0], outputs[p], op, "input_tensor_list[0]", "output_tensor_list[i]");
    so[p] = soff;
    sb[p] = bytesOf(inputs[p]);
    soff += sb[p];
    ro[p] = roff;
    rb[p] = bytesOf(outputs[p]);
    roff += rb[p];
  }
  wireTypeOf(inputs[0], op, "input_tensor_list[0]");
  std::vector<at::Tensor> flat_in;
  for (const at::Tensor& t : inputs) flat_in.push_back(t.reshape({-1}));
  at::Tensor packed = at::cat(flat_in);
  return enqueue(c10d::OpType::ALLTOALL, outputs, [this, outputs, packed, so, sb, ro, rb, roff] {
    at::Tensor received = at::empty({static_cast<int64_t>(roff)}, packed.options().dtype(at::kByte));
    OpResult r = plane().alltoall(packed.data_ptr(), so, sb, received.data_ptr(), ro, rb);
    for (size_t p = 0; r.ok && p < outputs.size(); ++p) {
      at::Tensor bytes = received.narrow(0, ro[p], rb[p]);
      outputs[p].copy_(bytes.view(outputs[p].scalar_type()).view(outputs[p].sizes()));
    }
    return r;
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::GatherOptions& opts) {
  const at::Tensor& in = checkSingle(inputs, "gather", "tensor");
  wireTypeOf(in, "gather", "tensor");
  checkRank(opts.rootRank, worldSize(), "gather", "dst");
  const int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> list;
  if (getRank() == root) {
    TORCH_CHECK_VALUE(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == worldSize(),
                      "gather: on the destination rank, gather_list must have world_size (", worldSize(), ") tensors");
    list = outputs[0];
    for (const at::Tensor& o : list) {
      checkSameKind(in, o, "gather", "tensor", "gather_list[i]");
      TORCH_CHECK_VALUE(o.numel() == in.numel(), "gather: every tensor in gather_list must have ", in.numel(),
                        " elements, got ", o.numel());
    }
  } else {
    TORCH_CHECK_VALUE(outputs.empty() || outputs[0].empty(), "gather: gather_list must be empty on non-destination ranks");
  }
  at::Tensor src = contiguousOf(in);
  return enqueue(c10d::OpType::GATHER, list, [this, list, src, root] {
    at::Tensor flat = getRank() == root ? at::empty({src.numel() * worldSize()}, src.options()) : at::Tensor();
    OpResult r = plane().gather(src.data_ptr(), flat.defined() ? flat.data_ptr() : nullptr, bytesOf(src), root);
    for (size_t i = 0; r.ok && i < list.size(); ++i) list[i].copy_(flat.narrow(0, i * src.numel(), src.numel()).view_as(list[i]));
    return r;
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::scatter(std::vector<at::Tensor>& outputs,
                                                           std::vector<std::vector<at::Tensor>>& inputs,
                                                           const c10d::ScatterOptions& opts) {
  const at::Tensor& out = checkSingle(outputs, "scatter", "tensor");
  wireTypeOf(out, "scatter", "tensor");
  checkRank(opts.rootRank, worldSize(), "scatter", "src");
  const int root = static_cast<int>(opts.rootRank);
  at::Tensor packed;
  if (getRank() == root) {
    TORCH_CHECK_VALUE(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == worldSize(),
                      "scatter: on the source rank, scatter_list must have world_size (", worldSize(), ") tensors");
    std::vector<at::Tensor> parts;
    for (const at::Tensor& in : inputs[0]) {
      checkSameKind(out, in, "scatter", "tensor", "scatter_list[i]");
      TORCH_CHECK_VALUE(in.numel() == out.numel(), "scatter: every tensor in scatter_list must have ", out.numel(),
                        " elements, got ", in.numel());
      parts.push_back(in.reshape({-1}));
    }
    packed = at::cat(parts);
  } else {
    TORCH_CHECK_VALUE(inputs.empty() || inputs[0].empty(), "scatter: scatter_list must be empty on non-source ranks");
  }
  at::Tensor dst = contiguousOf(out);
  return enqueue(c10d::OpType::SCATTER, {out}, [this, out, dst, packed, root] {
    OpResult r = plane().scatter(packed.defined() ? packed.data_ptr() : nullptr, dst.data_ptr(), bytesOf(dst), root);
    if (r.ok && !dst.is_same(out)) out.copy_(dst);
    return r;
  });
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::barrier(const c10d::BarrierOptions& opts) {
  return enqueue(c10d::OpType::BARRIER, {}, [this] { return plane().barrier(); }, !opts.asyncOp);
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  const at::Tensor& t = checkSingle(tensors, "send", "tensor");
  wireTypeOf(t, "send", "tensor");
  checkRank(dst_rank, max_group_size_, "send", "dst");  // any seat: an inactive one fails the Work, not the call
  P2pChannel& channel = p2p("send");
  at::Tensor src = t.contiguous();  // kept alive by the callback until the bytes are out
  auto work = c10::make_intrusive<MooncakeWork>(getRank(), c10d::OpType::SEND, max_group_size_, std::vector<at::Tensor>{t});
  if (!peerIsActive(dst_rank, work)) return work;
  channel.send(dst_rank, tag, src.data_ptr(), bytesOf(src), [this, work, src](const OpResult& r) { finishP2p(work, r); });
  return work;
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  const at::Tensor& t = checkSingle(tensors, "recv", "tensor");
  wireTypeOf(t, "recv", "tensor");
  checkRank(src_rank, max_group_size_, "recv", "src");
  P2pChannel& channel = p2p("recv");
  at::Tensor dst = contiguousOf(t);
  auto work = c10::make_intrusive<MooncakeWork>(getRank(), c10d::OpType::RECV, max_group_size_, std::vector<at::Tensor>{t});
  if (!peerIsActive(src_rank, work)) return work;
  channel.recv(src_rank, tag, dst.data_ptr(), bytesOf(dst), [this, work, t, dst](const OpResult& r) {
    if (r.ok && !dst.is_same(t)) t.copy_(dst);  // only a complete message is copied back
    finishP2p(work, r);
  });
  return work;
}

bool MooncakeCpuBackend::peerIsActive(int peer, const c10::intrusive_ptr<MooncakeWork>& work) {
  if (membership_->isActive(peer)) return true;
  work->complete(asReported(OpResult::failure("rank " + std::to_string(peer) + " is not active in this group (epoch " +
                                                   std::to_string(membership_->epoch()) + ")",
                                               {peer}),
                            getRank()));
  return false;
}

OpResult MooncakeCpuBackend::asReported(const OpResult& result, int self) {
  if (result.ok || result.mismatch || result.failed_ranks.empty()) return result;
  for (int r : result.failed_ranks) {
    if (r == self) return result;  // this rank is the one at fault (cut off): it raises
  }
  OpResult reported = result;
  reported.ok = true;  // the hint names the peers; local_success is False
  return reported;
}

void MooncakeCpuBackend::finishP2p(const c10::intrusive_ptr<MooncakeWork>& work, const OpResult& result) {
  if (result.ok || result.mismatch || result.timed_out) {  // nothing for the membership to act on
    work->complete(asReported(result, getRank()));
    return;
  }
  // Runs on the channel's progress thread, which must not wait for the
  // control plane.
  settleThen(result, [this, work, result] { work->complete(asReported(result, getRank())); });
}

void MooncakeCpuBackend::settleThen(const OpResult& result, const std::function<void()>& done) {
  // The failure is settled on the operation thread, or not at all when the
  // group is going away.
  auto settle_then_done = [this, result, done] {
    settleFailure(result);
    done();
  };
  if (!queue_.push(settle_then_done)) done();
}

c10::intrusive_ptr<c10d::Work> MooncakeCpuBackend::recvAnysource(std::vector<at::Tensor>&, int) {
  TORCH_CHECK(false, "mooncake-cpu: receiving from any source is not supported; name the source rank");
}

}  // namespace mooncake::pg
