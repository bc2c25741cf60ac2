// pg.MooncakeBackendOptions: what init_process_group(pg_options=...) /
// new_group(pg_options=...) pass to the backend creator.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <stdexcept>

namespace mooncake::pg {

struct MooncakeBackendOptions {
  std::optional<at::Tensor> active_ranks;  // int32 mask the group keeps in sync (a user-provided mirror)
  bool is_extension = false;               // this process joins an existing group later (elastic)
  int max_group_size = 0;                  // seats; <= 0 means the group's size
  bool auto_deactivate_on_failure = true;
  bool auto_sync_on_failure = true;

  void validate() const {
    if (!auto_deactivate_on_failure && auto_sync_on_failure) {
      throw std::invalid_argument("auto_sync_on_failure requires auto_deactivate_on_failure=true");
    }
    if (active_ranks) {
      const at::Tensor& t = *active_ranks;
      if (t.scalar_type() != at::kInt || !t.is_contiguous()) {
        throw std::invalid_argument("active_ranks must be a contiguous int32 tensor");
      }
      if (max_group_size > 0 && t.numel() < max_group_size) {
        throw std::invalid_argument("active_ranks must have at least max_group_size elements");
      }
    }
  }
};

}  // namespace mooncake::pg
