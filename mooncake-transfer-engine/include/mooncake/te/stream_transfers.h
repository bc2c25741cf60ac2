// Transfers ordered on a CUDA stream (the `*_on_cuda` calls of mooncake.engine):
// a transfer starts once the work queued on the stream before it has finished,
// and work queued after it waits until it has ended.
//
// How: a host function is queued on the stream. It runs when the stream gets
// there, hands the transfer to a worker thread and blocks the stream until the
// worker is done. The transfer itself cannot run inside the host function,
// because CUDA forbids CUDA calls there and the transports make them (staging
// copies, IPC copies). Every transfer is bounded by the engine's budget for its
// bytes, so a silent peer holds the stream up only until then.
//
// A transfer that fails does not stop the process (the reference's engine
// exits): it is logged at ERROR when it happens and reported, once, by
// takeFailure(); the work queued after it on the stream still runs.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mooncake/te/transfer_request.h"

namespace mooncake::te {

class TransferEngine;

class StreamTransfers {
 public:
  // Queues `fn(arg)` on `stream` (cudaLaunchHostFunc): kOk or an error code.
  // Tests replace it to run host functions without a GPU.
  using HostFunctionLauncher = std::function<int(void* stream, void (*fn)(void*), void* arg)>;

  // The CUDA launcher; one that fails with kNotImplemented in a build without CUDA.
  static HostFunctionLauncher cudaLauncher();

  explicit StreamTransfers(std::shared_ptr<TransferEngine> engine, HostFunctionLauncher launcher = cudaLauncher());
  // Does not wait for queued transfers: those still queued on a stream are
  // served by the worker, which lives until the last of them has ended.
  ~StreamTransfers();
  StreamTransfers(const StreamTransfers&) = delete;
  StreamTransfers& operator=(const StreamTransfers&) = delete;

  // Queues `requests` on `stream` (nullptr: the legacy default stream).
  // kOk once queued; the launcher's error otherwise (nothing queued).
  // `what` names the transfer in the failure message.
  int enqueue(void* stream, std::vector<TransferRequest> requests, std::string transport_hint, std::string what);

  // The first failure since the last call ("" when none), with the number of
  // failed transfers after it; clears it.
  std::string takeFailure();

  struct State;  // shared with the worker thread and the queued host functions

 private:
  std::shared_ptr<State> state_;
  HostFunctionLauncher launcher_;
};

}  // namespace mooncake::te
