#include "cuda_fast_path.h"

#include <c10/util/Logging.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "../settings.h"

namespace mooncake::pg {
namespace {

bool requireIpcFromEnv() {
  const char* value = std::getenv("MOONCAKE_PG_REQUIRE_CUDA_IPC");
  return value != nullptr && std::strcmp(value, "1") == 0;
}

}  // namespace

CudaFastPath::CudaFastPath(MooncakeCpuBackend& host)
    : host_(host),
      require_ipc_(requireIpcFromEnv()),
      staging_bytes_(envBytes("MOONCAKE_PG_CUDA_STAGING_BYTES", cuda::CudaIpcGroupOptions{}.staging_bytes)),
      fused_bytes_(envBytes("MOONCAKE_PG_CUDA_FUSED_BYTES", cuda::CudaIpcGroupOptions{}.fused_bytes, 0)),
      watcher_([this] { watch(); }) {}

CudaFastPath::~CudaFastPath() { shutdown(); }

std::shared_ptr<cuda::CudaIpcGroup> CudaFastPath::groupFor(int device) {
  const std::shared_ptr<const ActiveConfig> shared = host_.membership().activeConfig();
  const ActiveConfig& config = *shared;
  const int n = static_cast<int>(config.active.size());
  const bool dense = n > 0 && config.active.back() == n - 1;
  if (config.isolated || !dense || !config.one_host) return nullptr;
  const std::string key = config.uid + "-e" + std::to_string(config.active_epoch);

  std::lock_guard lock(group_mutex_);
  if (device_ < 0) device_ = device;
  if (key != group_key_) {
    // A new configuration: close the old group (its last barrier, when it is
    // healthy, meets the peers closing theirs) and open this one's.
    group_.reset();
    unusable_ = false;
    open_error_.clear();
    group_key_ = key;
    cuda::CudaIpcGroupOptions options;
    options.device = device_;
    options.timeout = host_.collectiveTimeout();
    options.rank_names = config.active;
    options.staging_bytes = staging_bytes_;
    options.fused_bytes = fused_bytes_;
    std::string error;
    const int seat = host_.getRank();
    group_ = std::shared_ptr<cuda::CudaIpcGroup>(cuda::CudaIpcGroup::open("/mooncake-pg-cuda-" + key, seat, n, options,
                                                                          &error));
    if (!group_) {
      unusable_ = true;
      open_error_ = error.empty() ? "unknown error" : error;
      LOG(WARNING) << "mooncake: the CUDA IPC plane of active configuration " << config.active_epoch
                   << " could not be opened (" << error << "); its operations stage through host memory";
    }
  }
  if (require_ipc_ && !open_error_.empty()) {
    throw std::runtime_error("MOONCAKE_PG_REQUIRE_CUDA_IPC=1 and the CUDA IPC plane of active configuration " +
                             std::to_string(config.active_epoch) + " could not be opened: " + open_error_);
  }
  if (unusable_ || !group_) return nullptr;
  if (group_->broken()) {
    // The staged path takes over this configuration: it reruns collectives
    // over the survivors and names the failed ranks.
    unusable_ = true;
    return nullptr;
  }
  return group_;
}

void CudaFastPath::track(std::shared_ptr<cuda::CudaIpcGroup> group, uint64_t id,
                         c10::intrusive_ptr<MooncakeCudaWork> work) {
  {
    std::lock_guard lock(mutex_);
    tracked_.push_back({std::move(group), id, std::move(work)});
  }
  cv_.notify_one();
}

void CudaFastPath::watch() {
  for (;;) {
    Tracked next;
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [this] { return stopping_ || !tracked_.empty(); });
      if (tracked_.empty()) return;
      next = std::move(tracked_.front());
      tracked_.pop_front();
    }
    // Bounded: a peer that dies or stalls breaks the group within its timeout.
    const OpResult result = next.group->wait(next.id);
    if (result.ok) {
      next.work->complete(result);
    } else {
      auto work = next.work;
      host_.settleThen(result, [work, result] { work->complete(result); });
    }
  }
}

void CudaFastPath::shutdown() {
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
  }
  cv_.notify_one();
  if (watcher_.joinable()) watcher_.join();
  std::lock_guard lock(group_mutex_);
  group_.reset();
}

}  // namespace mooncake::pg
