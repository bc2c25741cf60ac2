// Membership results shared with the elastic control plane: the statuses and
// responses of sync_after_failure and of view proposals (activate/deactivate).
// Names and values match the reference's Python enums.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mooncake::pg {

enum class SyncAfterFailureStatus : int { Reconciled = 0, NoPending = 1, Rejected = 2 };
enum class ProposalStatus : int { Rejected = 0, Applied = 1, AppliedWithDroppedRanks = 2 };

struct SyncAfterFailureResponse {
  SyncAfterFailureStatus status = SyncAfterFailureStatus::NoPending;
  std::string reject_reason;
};

struct ProposeViewUpdateResponse {
  ProposalStatus status = ProposalStatus::Rejected;
  int64_t new_epoch = 0;
  std::vector<int> dropped_ranks;  // sorted in-group ranks
  std::string reject_reason;
};

}  // namespace mooncake::pg
