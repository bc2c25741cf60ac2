#include "cuda/devices.h"

#include <cuda_runtime_api.h>

#include <vector>

namespace mooncake::te::cuda {
namespace {

const std::vector<std::string>& uuids() {
  static const std::vector<std::string> table = [] {
    std::vector<std::string> out;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      cudaGetLastError();  // not sticky, but leave no error behind for the application
      return out;
    }
    for (int device = 0; device < count; ++device) {
      cudaDeviceProp prop{};
      if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) break;
      out.emplace_back(prop.uuid.bytes, sizeof(prop.uuid.bytes));
    }
    return out;
  }();
  return table;
}

}  // namespace

int deviceCount() { return static_cast<int>(uuids().size()); }

std::string deviceUuid(int device) {
  const auto& table = uuids();
  return device >= 0 && device < static_cast<int>(table.size()) ? table[device] : std::string();
}

int deviceWithUuid(const std::string& uuid) {
  const auto& table = uuids();
  for (size_t i = 0; i < table.size(); ++i) {
    if (table[i] == uuid) return static_cast<int>(i);
  }
  return -1;
}

}  // namespace mooncake::te::cuda
