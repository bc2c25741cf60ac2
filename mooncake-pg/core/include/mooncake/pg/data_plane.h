// The data plane of one active configuration of an elastic group: which
// seats are active, where each runs, and the view epoch at which that set
// was formed. Every change of the active set gives a new plane: its shared-
// memory arenas are named after (group uid, epoch, host), so ranks that
// disagree on the configuration never meet in the same arena, and the
// group's collective channel reopens its lanes at that epoch (so nothing of
// an earlier configuration is taken for current traffic).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mooncake/pg/member_collectives.h"
#include "mooncake/pg/p2p_channel.h"
#include "mooncake/pg/shm_group.h"

namespace mooncake::pg {

struct PlaneConfig {
  std::string uid;        // the group incarnation: names its arenas
  uint32_t epoch = 0;     // the view epoch of this active configuration (channel lanes reopen at it)
  std::string variant;    // distinguishes planes of one epoch (seats left out after a failure), "" for none
  int my_seat = 0;
  std::vector<int> active;                 // ascending seats, including my_seat
  std::vector<std::string> host_of_seat;   // per seat: host identity
  ShmGroupOptions shm;                     // timeouts and slot size (rank_names is filled here)
  // The group's collective channel (one rank per seat) and every seat's
  // endpoint of it; used only when the active seats span several hosts.
  std::shared_ptr<P2pChannel> channel;
  std::vector<P2pEndpoint> channel_endpoints;
};

// Forms the plane; every active seat must form the same one (they meet in
// its arenas, within shm.attach_timeout). Null with *error on failure.
std::unique_ptr<MemberCollectives> formPlane(const PlaneConfig& config, std::string* error);

}  // namespace mooncake::pg
