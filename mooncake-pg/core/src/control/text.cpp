#include "control/text.h"

namespace mooncake::pg::control {

std::string listText(const std::vector<int>& values) {
  std::string text = "[";
  for (size_t i = 0; i < values.size(); ++i) text += (i == 0 ? "" : ", ") + std::to_string(values[i]);
  return text + "]";
}

std::string millisecondsText(std::chrono::milliseconds duration) { return std::to_string(duration.count()) + " ms"; }

const char* memberStateName(MemberState state) {
  switch (state) {
    case MemberState::kNone:
      return "None";
    case MemberState::kInactive:
      return "Inactive";
    case MemberState::kAwaitingActivation:
      return "AwaitingActivation";
    case MemberState::kActive:
      return "Active";
    case MemberState::kLeft:
      return "Left";
  }
  return "?";
}

const char* rankStateName(RankState state) {
  switch (state) {
    case RankState::kOffline:
      return "Offline";
    case RankState::kSynced:
      return "Synced";
    case RankState::kHealthy:
      return "Healthy";
  }
  return "?";
}

}  // namespace mooncake::pg::control
