// The stream-ordered data plane of a "mooncake" group: a CudaIpcGroup over
// the active seats, when they are seats 0..n-1 of one host (the group's
// seats are then the CudaIpcGroup's ranks). Elsewhere (holes in the active
// set, several hosts, a joiner before activation) the backend stages through
// host memory instead.
//
// A CudaIpcGroup is opened per active configuration, named after (group
// incarnation, active epoch), so every rank that applied the same view meets
// in the same one; a configuration whose group cannot be opened, or broke,
// is served by the staged path until the configuration changes (the staged
// path carries the failure semantics: survivors rerun, failure hints).
// With MOONCAKE_PG_REQUIRE_CUDA_IPC=1 a group that cannot be opened is an
// error instead (tests and benchmarks of the IPC plane set it, so that they
// never pass, or time, the staged path by mistake).
//
// Operations enqueued on the group complete on their stream; a watcher
// thread waits for each in issue order and completes its Work (after the
// failure, if any, was settled with the control plane), so the host learns
// the outcome without ever blocking the caller.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "../cpu_backend.h"
#include "cuda_work.h"
#include "mooncake/pg/cuda/cuda_ipc_group.h"

namespace mooncake::pg {

class CudaFastPath {
 public:
  // `host` carries the membership, the control plane and failure settling.
  explicit CudaFastPath(MooncakeCpuBackend& host);
  ~CudaFastPath();
  CudaFastPath(const CudaFastPath&) = delete;
  CudaFastPath& operator=(const CudaFastPath&) = delete;

  // The group for the current configuration on `device`, or null when the
  // operation must take the staged path. Collective on first use of a
  // configuration (every active rank opens the group).
  std::shared_ptr<cuda::CudaIpcGroup> groupFor(int device);

  // Completes `work` once operation `id` of `group` ran on its stream.
  void track(std::shared_ptr<cuda::CudaIpcGroup> group, uint64_t id, c10::intrusive_ptr<MooncakeCudaWork> work);

  // Stops the watcher (after completing what it tracks) and closes the group.
  void shutdown();

 private:
  struct Tracked {
    std::shared_ptr<cuda::CudaIpcGroup> group;
    uint64_t id;
    c10::intrusive_ptr<MooncakeCudaWork> work;
  };
  void watch();

  MooncakeCpuBackend& host_;
  std::mutex group_mutex_;  // callers may issue from several threads
  std::shared_ptr<cuda::CudaIpcGroup> group_;
  std::string group_key_;        // configuration group_ (or the failure to open it) belongs to
  bool unusable_ = false;        // the configuration group_key_ cannot use the fast path
  std::string open_error_;       // why group_key_'s group could not be opened ("" if it was)
  const bool require_ipc_;       // MOONCAKE_PG_REQUIRE_CUDA_IPC=1
  const size_t staging_bytes_;   // MOONCAKE_PG_CUDA_STAGING_BYTES (CudaIpcGroupOptions::staging_bytes)
  const size_t fused_bytes_;     // MOONCAKE_PG_CUDA_FUSED_BYTES (CudaIpcGroupOptions::fused_bytes)
  int device_ = -1;              // the GPU of this rank's fast groups

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Tracked> tracked_;
  bool stopping_ = false;
  std::thread watcher_;
};

}  // namespace mooncake::pg
