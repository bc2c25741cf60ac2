// The live mask (get_active_ranks) when the user gave a CUDA tensor for it.
#pragma once

#include <ATen/ATen.h>

namespace mooncake::pg {

// Copies the int32 mask `host` (pinned) into `device` (CUDA) on a stream of
// its own and waits for that copy only: the device mask is in place once a
// view is applied, without waiting for the user's work on any stream.
void copyMaskToDevice(const at::Tensor& host, const at::Tensor& device);

}  // namespace mooncake::pg
