#include "transport/rdma/ibverbs_api.h"

#include <dlfcn.h>

#include <cstring>

namespace mooncake::te::rdma {
namespace {

template <typename Fn>
bool load(void* library, const char* symbol, Fn& out) {
  out = reinterpret_cast<Fn>(::dlsym(library, symbol));
  return out != nullptr;
}

}  // namespace

const IbverbsApi* ibverbsApi() {
  static const IbverbsApi* loaded = []() -> const IbverbsApi* {
    void* library = ::dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) return nullptr;
    static IbverbsApi api;
    const bool complete =
        load(library, "ibv_get_device_list", api.get_device_list) &&
        load(library, "ibv_free_device_list", api.free_device_list) &&
        load(library, "ibv_get_device_name", api.get_device_name) &&
        load(library, "ibv_open_device", api.open_device) && load(library, "ibv_close_device", api.close_device) &&
        load(library, "ibv_query_device", api.query_device) &&
        load(library, "ibv_query_port", api.query_port_compat) &&
        load(library, "_ibv_query_gid_ex", api.query_gid_ex) && load(library, "ibv_alloc_pd", api.alloc_pd) &&
        load(library, "ibv_dealloc_pd", api.dealloc_pd) && load(library, "ibv_reg_mr", api.reg_mr) &&
        load(library, "ibv_dereg_mr", api.dereg_mr) &&
        load(library, "ibv_create_comp_channel", api.create_comp_channel) &&
        load(library, "ibv_destroy_comp_channel", api.destroy_comp_channel) &&
        load(library, "ibv_create_cq", api.create_cq) && load(library, "ibv_destroy_cq", api.destroy_cq) &&
        load(library, "ibv_get_cq_event", api.get_cq_event) &&
        load(library, "ibv_ack_cq_events", api.ack_cq_events) && load(library, "ibv_create_qp", api.create_qp) &&
        load(library, "ibv_modify_qp", api.modify_qp) && load(library, "ibv_destroy_qp", api.destroy_qp);
    if (!complete) return nullptr;
    load(library, "ibv_reg_dmabuf_mr", api.reg_dmabuf_mr);  // optional: GPU memory falls back to nvidia-peermem
    return &api;
  }();
  return loaded;
}

int queryPort(const IbverbsApi& api, ibv_context* context, uint8_t port, ibv_port_attr* attr) {
  // The device's extended query where it has one, else the compatible
  // call, as verbs.h's inline ibv_query_port does.
  if (verbs_context* vctx = verbs_get_ctx_op(context, query_port)) {
    return vctx->query_port(context, port, attr, sizeof(*attr));
  }
  std::memset(attr, 0, sizeof(*attr));
  return api.query_port_compat(context, port, reinterpret_cast<_compat_ibv_port_attr*>(attr));
}

}  // namespace mooncake::te::rdma
