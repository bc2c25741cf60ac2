// Which verbs provider the RDMA transport uses (MC_RDMA_PROVIDER).
#include <cstdlib>
#include <string>

#include "mooncake/te/log.h"
#include "transport/rdma/verbs.h"

namespace mooncake::te::rdma {

std::unique_ptr<Provider> makeConfiguredProvider() {
  const char* value = std::getenv("MC_RDMA_PROVIDER");
  const std::string wanted = value != nullptr ? value : "";
  if (wanted == "software") return makeSoftwareProvider();
  if (!wanted.empty() && wanted != "libibverbs") {
    MC_LOG(Warning) << "MC_RDMA_PROVIDER='" << wanted << "' is not a provider (\"libibverbs\", \"software\"); "
                    << "using libibverbs";
  }
  return makeIbverbsProvider();
}

}  // namespace mooncake::te::rdma
