// The decision taken when a group's reconciliation window closes: which
// seats to deactivate given the failure evidence collected meanwhile.
#pragma once

#include <map>
#include <set>
#include <vector>

namespace mooncake::pg::control {

struct SeatHealth {
  bool active = false;  // the seat is Active
  bool online = false;  // its process is connected and heartbeating
};

// evidence: reporter seat -> seats it failed an operation with.
// Returns the seats to deactivate, sorted:
//  - every Active seat whose process is offline;
//  - among the Active, online seats reported by an Active reporter, those
//    reported by at least one reporter that is not itself reported (a
//    trustworthy witness);
//  - if no reported seat has such a witness (every reporter is itself
//    reported: mutual or circular accusations), only the highest-numbered
//    seat among those that are both reporter and reported, so that one
//    broken link costs one seat and not both ends.
// Evidence from reporters that are not Active (or not online) is ignored.
std::vector<int> seatsToDeactivate(const std::vector<SeatHealth>& seats, const std::map<int, std::set<int>>& evidence);

}  // namespace mooncake::pg::control
