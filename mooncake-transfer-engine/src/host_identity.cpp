#include "mooncake/te/host_identity.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <fstream>
#include <sstream>

#include "mooncake/te/log.h"
#include "mooncake/te/memory_region.h"
#if MOONCAKE_WITH_CUDA
#include "cuda/cuda_driver.h"
#endif

namespace mooncake::te {
namespace {

std::string readFirstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string readLink(const char* path) {
  char buf[PATH_MAX];
  ssize_t n = ::readlink(path, buf, sizeof(buf) - 1);
  if (n <= 0) return {};
  return std::string(buf, static_cast<size_t>(n));
}

}  // namespace

std::string hostIdentity() {
  static const std::string identity = [] {
    std::string boot = readFirstLine("/proc/sys/kernel/random/boot_id");
    // Namespaces split one machine into hosts: a pid namespace (its own
    // /proc, so no cross-memory attach by pid) or a network namespace (its
    // own addresses: a separate host on a network, as tests and benchmarks
    // build them) make a separate host, which peers reach over the network.
    std::string pidns = readLink("/proc/self/ns/pid");
    std::string netns = readLink("/proc/self/ns/net");
    if (boot.empty()) {
      char host[256] = {};
      ::gethostname(host, sizeof(host) - 1);
      boot = host;
    }
    return boot + "/" + pidns + "/" + netns;
  }();
  return identity;
}

uint64_t processStartTicks(pid_t pid) {
  std::string stat = readFirstLine("/proc/" + std::to_string(pid) + "/stat");
  // The command name (field 2) may contain spaces and parentheses: count
  // fields from the last ')'. Field 3 (state) follows it; start time is 22.
  size_t close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(stat.substr(close + 1));
  std::string field;
  for (int index = 3; rest >> field; ++index) {
    if (index == 22) return std::stoull(field);
  }
  return 0;
}

namespace {

// The CUDA device holding `addr`, -1 for host memory (always, without CUDA).
int gpuOf(const void* addr) {
#if MOONCAKE_WITH_CUDA
  return cuda::deviceOfPointer(addr);
#else
  (void)addr;
  return -1;
#endif
}

std::string hostLocation(const void* addr) {
  // get_mempolicy(MPOL_F_NODE | MPOL_F_ADDR) reports the node backing the
  // page at addr; called through syscall() to avoid a libnuma dependency.
  constexpr unsigned long kMpolFNode = 1ul << 0;
  constexpr unsigned long kMpolFAddr = 1ul << 1;
  int node = -1;
  long rc = ::syscall(SYS_get_mempolicy, &node, nullptr, 0ul, const_cast<void*>(addr), kMpolFNode | kMpolFAddr);
  if (rc != 0 || node < 0) node = 0;
  return "cpu:" + std::to_string(node);
}

}  // namespace

std::string detectMemoryLocation(const void* addr) {
  int device = gpuOf(addr);
  return device >= 0 ? "cuda:" + std::to_string(device) : hostLocation(addr);
}

std::string resolveMemoryLocation(const void* addr, const std::string& requested) {
  if (requested.empty() || requested == "*") return detectMemoryLocation(addr);
#if MOONCAKE_WITH_CUDA
  const int device = gpuOf(addr);
  const bool labeled_gpu = cudaDeviceOfLocation(requested) >= 0;
  if (device >= 0 && cudaDeviceOfLocation(requested) != device) {
    std::string actual = "cuda:" + std::to_string(device);
    MC_LOG(Warning) << "register: memory at " << addr << " is on " << actual << ", not '" << requested
                    << "'; registering it as " << actual;
    return actual;
  }
  if (device < 0 && labeled_gpu) {
    std::string actual = hostLocation(addr);
    MC_LOG(Warning) << "register: memory at " << addr << " is host memory, not '" << requested
                    << "'; registering it as " << actual;
    return actual;
  }
#endif
  return requested;
}

}  // namespace mooncake::te
