#include "mooncake/pg/control_plane.h"

namespace mooncake::pg {

std::vector<int> GroupView::activeRanks() const {
  std::vector<int> ranks;
  for (size_t rank = 0; rank < members.size(); ++rank) {
    if (members[rank] == MemberState::kActive) ranks.push_back(static_cast<int>(rank));
  }
  return ranks;
}

}  // namespace mooncake::pg
