// The clock of every deadline in the control plane.
#pragma once

#include <chrono>

namespace mooncake::pg::control {

using Clock = std::chrono::steady_clock;
using TimePoint = Clock::time_point;

}  // namespace mooncake::pg::control
