// Small formatting helpers for the control plane's error and log messages.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "mooncake/pg/control_plane.h"

namespace mooncake::pg::control {

std::string listText(const std::vector<int>& values);              // "[1, 2, 3]"
std::string millisecondsText(std::chrono::milliseconds duration);  // "250 ms"
const char* memberStateName(MemberState state);                    // "AwaitingActivation"
const char* rankStateName(RankState state);                        // "Healthy"

}  // namespace mooncake::pg::control
