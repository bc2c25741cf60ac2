#include "mooncake/pg/test_faults.h"

#include "mooncake/te/log.h"

namespace mooncake::pg::test_faults {

namespace detail {
std::atomic<bool> traffic_cut{false};
std::atomic<bool> control_cut{false};
std::atomic<bool> ack_replies_lost{false};
}  // namespace detail

void cutTraffic(bool control) {
  if (control) detail::control_cut.store(true);
  detail::traffic_cut.store(true);
  MC_LOG(Warning) << "TEST ONLY: this process's network traffic is cut ("
                  << (control ? "control and data planes" : "data plane only") << ")";
}

}  // namespace mooncake::pg::test_faults
