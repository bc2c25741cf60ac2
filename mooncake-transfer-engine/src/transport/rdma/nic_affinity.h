// Which NICs suit a buffer: the ones nearest its memory. A GPU's nearest
// NICs are those sharing the most of its PCIe path (the same switch, then
// the same root port); host memory's are those on its NUMA node. Where
// nothing is known (the software provider's devices have no PCIe place),
// every NIC suits. The choice is pure logic over places, tested without
// devices; the sysfs reads that find the places are apart from it.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace mooncake::te::rdma {

struct Place {
  int numa_node = -1;    // -1: unknown
  std::string pci_path;  // sysfs path of the PCIe function, "" if none: "/sys/devices/pci0000:00/0000:00:02.0/..."
};

// Indices into `nics` of the nearest ones to `memory`; never empty when
// `nics` is not.
std::vector<size_t> nearestNics(const std::vector<Place>& nics, const Place& memory);

// Where a NIC is: /sys/class/infiniband/<device>/device.
Place nicPlace(const std::string& device);
// This host's NUMA nodes, in order; {0} where sysfs does not say.
std::vector<int> numaNodes();

// Where memory at `location` is ("cpu:N": NUMA node N; "cuda:K": GPU K's
// PCIe function and its node). Unknown parts stay unknown.
Place memoryPlace(const std::string& location);

}  // namespace mooncake::te::rdma
