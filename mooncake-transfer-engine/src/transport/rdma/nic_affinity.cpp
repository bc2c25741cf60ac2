#include "transport/rdma/nic_affinity.h"

#include <dirent.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <cstdlib>
#include <fstream>

#include "mooncake/te/memory_region.h"
#if MOONCAKE_WITH_CUDA
#include "cuda/devices.h"
#endif

namespace mooncake::te::rdma {
namespace {

// How many leading path components two sysfs paths share.
size_t sharedComponents(const std::string& a, const std::string& b) {
  size_t shared = 0, i = 0;
  while (i < a.size() && i < b.size()) {
    const size_t end_a = a.find('/', i), end_b = b.find('/', i);
    const std::string part_a = a.substr(i, end_a - i), part_b = b.substr(i, end_b - i);
    if (part_a != part_b) break;
    if (!part_a.empty()) ++shared;
    if (end_a == std::string::npos || end_b == std::string::npos) break;
    i = end_a + 1;
  }
  return shared;
}

Place placeOfSysfs(const std::string& path) {
  Place place;
  char resolved[PATH_MAX];
  if (::realpath(path.c_str(), resolved) == nullptr) return place;
  place.pci_path = resolved;
  std::ifstream numa(place.pci_path + "/numa_node");
  int node = -1;
  if (numa >> node && node >= 0) place.numa_node = node;
  return place;
}

}  // namespace

std::vector<size_t> nearestNics(const std::vector<Place>& nics, const Place& memory) {
  std::vector<size_t> chosen;
  // By PCIe path: the NICs sharing the most of it, if any shares more than
  // "/sys/devices" (a common root complex at least).
  if (!memory.pci_path.empty()) {
    size_t best = 2;
    for (size_t i = 0; i < nics.size(); ++i) {
      if (nics[i].pci_path.empty()) continue;
      const size_t shared = sharedComponents(nics[i].pci_path, memory.pci_path);
      if (shared > best) {
        best = shared;
        chosen.clear();
      }
      if (shared == best && best > 2) chosen.push_back(i);
    }
    if (!chosen.empty()) return chosen;
  }
  // By NUMA node.
  if (memory.numa_node >= 0) {
    for (size_t i = 0; i < nics.size(); ++i) {
      if (nics[i].numa_node == memory.numa_node) chosen.push_back(i);
    }
    if (!chosen.empty()) return chosen;
  }
  for (size_t i = 0; i < nics.size(); ++i) chosen.push_back(i);
  return chosen;
}

std::vector<int> numaNodes() {
  std::vector<int> nodes;
  if (DIR* dir = ::opendir("/sys/devices/system/node")) {
    while (dirent* e = ::readdir(dir)) {
      if (std::strncmp(e->d_name, "node", 4) == 0 && e->d_name[4] >= '0' && e->d_name[4] <= '9') {
        nodes.push_back(std::atoi(e->d_name + 4));
      }
    }
    ::closedir(dir);
  }
  if (nodes.empty()) nodes.push_back(0);
  std::sort(nodes.begin(), nodes.end());
  return nodes;
}

Place nicPlace(const std::string& device) { return placeOfSysfs("/sys/class/infiniband/" + device + "/device"); }

Place memoryPlace(const std::string& location) {
  Place place;
  const int gpu = cudaDeviceOfLocation(location);
  if (gpu >= 0) {
#if MOONCAKE_WITH_CUDA
    const std::string pci = cuda::devicePciAddress(gpu);
    if (!pci.empty()) place = placeOfSysfs("/sys/bus/pci/devices/" + pci);
#endif
    return place;
  }
  if (location.rfind("cpu:", 0) == 0) {
    char* end = nullptr;
    const long node = std::strtol(location.c_str() + 4, &end, 10);
    if (end != location.c_str() + 4 && *end == '\0' && node >= 0) place.numa_node = static_cast<int>(node);
  }
  return place;
}

}  // namespace mooncake::te::rdma
