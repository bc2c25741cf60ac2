// ScatterTransferTicket: one submitted scatter batch, kept alive until every
// request of it has ended ("drained"), as the reference's ticket is. The
// status is COMPLETED or FAILED_DRAINED once drained, COMPLETION_UNKNOWN
// while anything may still be in flight. Destroying an undrained ticket waits
// for the batch (bounded by the engine's budget for its bytes) and frees it,
// so no transport ever writes into memory its caller believes released.
#pragma once

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>

#include "mooncake/te/log.h"
#include "mooncake/te/transfer_engine.h"

namespace mooncake::binding {

enum class ScatterStatus : int { kCompleted = 0, kFailedDrained = -1, kCompletionUnknown = -2 };

class ScatterTicket {
 public:
  // A ticket for nothing in flight: empty (completed) or refused before submission (failed).
  explicit ScatterTicket(ScatterStatus settled) : status_(settled), drained_(true) {}
  // `budget`: how long the transports may take for the batch's bytes.
  ScatterTicket(std::shared_ptr<te::TransferEngine> engine, te::BatchId batch, std::chrono::nanoseconds budget)
      : engine_(std::move(engine)), batch_(batch), budget_end_(std::chrono::steady_clock::now() + budget) {}
  ScatterTicket(const ScatterTicket&) = delete;
  ScatterTicket& operator=(const ScatterTicket&) = delete;

  // Waits for the batch (up to the engine's budget for its bytes, after
  // which the transports have ended it); one still undrained then is left
  // allocated rather than freed under a live request.
  ~ScatterTicket() {
    if (drain(std::chrono::milliseconds(-1)) == ScatterStatus::kCompletionUnknown) {
      MC_LOG(Error) << "ScatterTransferTicket: batch " << batch_ << " still in flight at release; left allocated";
    }
  }

  // Waits up to `timeout` (negative: the engine's budget for the batch) and
  // returns the status then. Call without the GIL.
  ScatterStatus drain(std::chrono::milliseconds timeout) {
    {
      std::lock_guard lock(mutex_);
      if (drained_) return status_;
    }
    // Wait without the lock, so that a short drain() (or status) next to a
    // long one returns in its own time.
    const auto now = std::chrono::steady_clock::now();
    const auto deadline = timeout.count() < 0 ? budget_end_ : now + std::min(timeout, kLongest);
    te::TransferStatus status;
    engine_->waitBatch(batch_, status, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now));
    if (engine_->getBatchTransferStatus(batch_, status) != te::kOk) status.state = te::TransferState::kFailed;
    if (status.state == te::TransferState::kPending) return ScatterStatus::kCompletionUnknown;
    const ScatterStatus outcome =
        status.state == te::TransferState::kCompleted ? ScatterStatus::kCompleted : ScatterStatus::kFailedDrained;
    // A failed batch may still have requests in flight: drained only once it can be freed.
    for (;;) {
      {
        std::lock_guard lock(mutex_);
        if (drained_) return status_;
        if (engine_->freeBatchID(batch_) != te::kBatchBusy) {
          status_ = outcome;
          drained_ = true;
          return status_;
        }
      }
      if (std::chrono::steady_clock::now() >= deadline) return ScatterStatus::kCompletionUnknown;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  ScatterStatus status() { return drain(std::chrono::milliseconds(0)); }
  bool drained() {
    status();
    std::lock_guard lock(mutex_);
    return drained_;
  }

 private:
  // A bound on one wait, so that a huge timeout cannot overflow the clock.
  static constexpr std::chrono::milliseconds kLongest{std::chrono::hours(24 * 365)};

  std::mutex mutex_;  // guards status_ and drained_, and the freeing of the batch
  std::shared_ptr<te::TransferEngine> engine_;
  te::BatchId batch_ = 0;
  std::chrono::steady_clock::time_point budget_end_;
  ScatterStatus status_ = ScatterStatus::kCompletionUnknown;
  bool drained_ = false;
};

}  // namespace mooncake::binding
