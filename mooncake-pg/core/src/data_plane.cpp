#include "mooncake/pg/data_plane.h"

#include <algorithm>

#include "mooncake/pg/host_spanning_group.h"

namespace mooncake::pg {

std::unique_ptr<MemberCollectives> formPlane(const PlaneConfig& config, std::string* error) {
  const std::vector<int>& active = config.active;
  auto me = std::find(active.begin(), active.end(), config.my_seat);
  if (me == active.end()) {
    *error = "seat " + std::to_string(config.my_seat) + " is not active";
    return nullptr;
  }
  const int dense_me = static_cast<int>(me - active.begin());
  std::vector<std::string> hosts;
  for (int seat : active) hosts.push_back(config.host_of_seat[seat]);
  HostLayout layout = HostLayout::fromIdentities(hosts);
  const int host = layout.hostOf(dense_me);

  ShmGroupOptions shm = config.shm;
  shm.rank_names.clear();
  for (int dense : layout.ranksOn(host)) shm.rank_names.push_back(active[dense]);
  // One arena per host of this configuration, named after its lowest seat.
  const std::string name = "/mooncake-pg-" + config.uid + "-e" + std::to_string(config.epoch) + config.variant +
                           "-s" + std::to_string(active[layout.leaderOf(host)]);
  std::unique_ptr<ShmGroup> local = ShmGroup::open(name, layout.localIndexOf(dense_me),
                                                   static_cast<int>(layout.ranksOn(host).size()), shm, error);
  if (!local) return nullptr;

  std::unique_ptr<Collectives> inner;
  if (layout.hosts() == 1) {
    inner = std::move(local);
  } else {
    if (!config.channel) {
      *error = "the active seats span " + std::to_string(layout.hosts()) + " hosts but the group has no channel";
      return nullptr;
    }
    for (int seat : active) {
      if (seat != config.my_seat) config.channel->reopen(seat, config.channel_endpoints[seat], config.epoch);
    }
    inner = std::make_unique<HostSpanningGroup>(dense_me, std::move(layout), std::move(local), config.channel, active);
  }
  return std::make_unique<MemberCollectives>(active, config.my_seat, std::move(inner));
}

}  // namespace mooncake::pg
