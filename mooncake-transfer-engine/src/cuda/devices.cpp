#include "cuda/devices.h"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <vector>

namespace mooncake::te::cuda {
namespace {

struct Gpu {
  std::string uuid;
  std::string pci_address;
};

const std::vector<Gpu>& gpus() {
  static const std::vector<Gpu> table = [] {
    std::vector<Gpu> out;
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      cudaGetLastError();  // not sticky, but leave no error behind for the application
      return out;
    }
    for (int device = 0; device < count; ++device) {
      cudaDeviceProp prop{};
      if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) break;
      char pci[32];
      std::snprintf(pci, sizeof(pci), "%04x:%02x:%02x.0", static_cast<unsigned>(prop.pciDomainID),
                    static_cast<unsigned>(prop.pciBusID), static_cast<unsigned>(prop.pciDeviceID));
      out.push_back(Gpu{std::string(prop.uuid.bytes, sizeof(prop.uuid.bytes)), pci});
    }
    return out;
  }();
  return table;
}

}  // namespace

int deviceCount() { return static_cast<int>(gpus().size()); }

std::string deviceUuid(int device) {
  const auto& table = gpus();
  return device >= 0 && device < static_cast<int>(table.size()) ? table[device].uuid : std::string();
}

int deviceWithUuid(const std::string& uuid) {
  const auto& table = gpus();
  for (size_t i = 0; i < table.size(); ++i) {
    if (table[i].uuid == uuid) return static_cast<int>(i);
  }
  return -1;
}

std::string devicePciAddress(int device) {
  const auto& table = gpus();
  return device >= 0 && device < static_cast<int>(table.size()) ? table[device].pci_address : std::string();
}

}  // namespace mooncake::te::cuda
