// The functions of rdma-core's libibverbs that the libibverbs provider
// calls, opened at run time (dlopen "libibverbs.so.1") rather than linked:
// a build with RDMA must still load on a host without rdma-core, as a CUDA
// build loads without a GPU driver (there the provider lists no device).
// The data path's calls (ibv_post_send, ibv_poll_cq, ibv_req_notify_cq) are
// inline in verbs.h, through the device's own function table: none here.
#pragma once

#include <infiniband/verbs.h>

namespace mooncake::te::rdma {

struct IbverbsApi {
  ibv_device** (*get_device_list)(int*);
  void (*free_device_list)(ibv_device**);
  const char* (*get_device_name)(ibv_device*);
  ibv_context* (*open_device)(ibv_device*);
  int (*close_device)(ibv_context*);
  int (*query_device)(ibv_context*, ibv_device_attr*);
  // The fallback of the port query where the device has no extended one
  // (see queryPort below).
  int (*query_port_compat)(ibv_context*, uint8_t, _compat_ibv_port_attr*);
  int (*query_gid_ex)(ibv_context*, uint32_t, uint32_t, ibv_gid_entry*, uint32_t, size_t);
  ibv_pd* (*alloc_pd)(ibv_context*);
  int (*dealloc_pd)(ibv_pd*);
  ibv_mr* (*reg_mr)(ibv_pd*, void*, size_t, int);
  ibv_mr* (*reg_dmabuf_mr)(ibv_pd*, uint64_t, size_t, uint64_t, int, int);  // null before rdma-core 34
  int (*dereg_mr)(ibv_mr*);
  ibv_comp_channel* (*create_comp_channel)(ibv_context*);
  int (*destroy_comp_channel)(ibv_comp_channel*);
  ibv_cq* (*create_cq)(ibv_context*, int, void*, ibv_comp_channel*, int);
  int (*destroy_cq)(ibv_cq*);
  int (*get_cq_event)(ibv_comp_channel*, ibv_cq**, void**);
  void (*ack_cq_events)(ibv_cq*, unsigned int);
  ibv_qp* (*create_qp)(ibv_pd*, ibv_qp_init_attr*);
  int (*modify_qp)(ibv_qp*, ibv_qp_attr*, int);
  int (*destroy_qp)(ibv_qp*);
};

// Null where libibverbs cannot be opened or lacks a function above.
const IbverbsApi* ibverbsApi();

// What verbs.h's ibv_query_port does, through the table.
int queryPort(const IbverbsApi& api, ibv_context* context, uint8_t port, ibv_port_attr* attr);

}  // namespace mooncake::te::rdma
