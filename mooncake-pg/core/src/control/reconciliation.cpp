#include "control/reconciliation.h"

#include <algorithm>

namespace mooncake::pg::control {

std::vector<int> seatsToDeactivate(const std::vector<SeatHealth>& seats, const std::map<int, std::set<int>>& evidence) {
  auto valid = [&](int seat) { return seat >= 0 && seat < static_cast<int>(seats.size()); };
  auto liveActive = [&](int seat) { return valid(seat) && seats[seat].active && seats[seat].online; };

  std::set<int> deactivate;
  for (int seat = 0; seat < static_cast<int>(seats.size()); ++seat) {
    if (seats[seat].active && !seats[seat].online) deactivate.insert(seat);
  }

  std::set<int> reporters;
  std::set<int> reported;
  for (const auto& [reporter, targets] : evidence) {
    if (!liveActive(reporter)) continue;
    for (int target : targets) {
      if (target != reporter && liveActive(target)) {
        reporters.insert(reporter);
        reported.insert(target);
      }
    }
  }

  bool witnessed = false;
  for (int reporter : reporters) {
    if (reported.count(reporter) != 0) continue;  // accused itself: not a trustworthy witness
    for (int target : evidence.at(reporter)) {
      if (reported.count(target) != 0) {
        deactivate.insert(target);
        witnessed = true;
      }
    }
  }
  if (!witnessed && !reported.empty()) {
    // Every reporter is also reported. The accusations involve at least one
    // seat that is both; its highest goes (as the reference does for a
    // mutual pair).
    int highest = -1;
    for (int seat : reporters) {
      if (reported.count(seat) != 0) highest = std::max(highest, seat);
    }
    deactivate.insert(highest);
  }
  return std::vector<int>(deactivate.begin(), deactivate.end());
}

}  // namespace mooncake::pg::control
