// The libibverbs provider: verbs.h on a real NIC through rdma-core.
//
// Built where rdma-core's headers are (MOONCAKE_WITH_RDMA); libibverbs itself
// is opened at run time (ibverbs_api.h). No machine this project's CI runs
// on has an RDMA device, so this file is compiled there but runs only on
// hosts with a NIC; the transport above it is tested through the software
// provider, which enforces the same rules (soft/).
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <net/if.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>

#include "mooncake/te/log.h"
#include "mooncake/te/status.h"
#include "transport/rdma/ibverbs_api.h"
#include "transport/rdma/verbs.h"
#if MOONCAKE_WITH_CUDA
#include "cuda/cuda_driver.h"
#endif

namespace mooncake::te::rdma {
namespace {

int errorOfErrno(int e) {
  switch (e) {
    case 0:
      return kOk;
    case ENOMEM:
      return kTooManyRequests;
    case EINVAL:
      return kInvalidArgument;
    case ENODEV:
    case ENOENT:
      return kDeviceNotFound;
    default:
      return kEndpointError;
  }
}

uint32_t mtuBytes(ibv_mtu mtu) { return 128u << static_cast<int>(mtu); }  // IBV_MTU_256 = 1 ... IBV_MTU_4096 = 5

ibv_mtu mtuEnum(uint32_t bytes) {
  if (bytes >= 4096) return IBV_MTU_4096;
  if (bytes >= 2048) return IBV_MTU_2048;
  if (bytes >= 1024) return IBV_MTU_1024;
  if (bytes >= 512) return IBV_MTU_512;
  return IBV_MTU_256;
}

Completion completionOf(ibv_wc_status status) {
  switch (status) {
    case IBV_WC_SUCCESS:
      return Completion::kSuccess;
    case IBV_WC_LOC_LEN_ERR:
      return Completion::kLocalLength;
    case IBV_WC_LOC_PROT_ERR:
      return Completion::kLocalProtection;
    case IBV_WC_REM_ACCESS_ERR:
    case IBV_WC_REM_INV_REQ_ERR:
      return Completion::kRemoteAccess;
    case IBV_WC_REM_OP_ERR:
      return Completion::kRemoteOperation;
    case IBV_WC_RETRY_EXC_ERR:
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return Completion::kRetryExceeded;
    case IBV_WC_WR_FLUSH_ERR:
      return Completion::kFlushed;
    default:
      return Completion::kOther;
  }
}

class IbverbsQueuePair : public QueuePair {
 public:
  IbverbsQueuePair(const IbverbsApi& api, ibv_qp* qp, uint8_t port, uint32_t path_mtu, const ibv_device_attr& attr)
      : api_(api), qp_(qp), port_(port), path_mtu_(path_mtu), max_rd_atomic_(attr.max_qp_rd_atom),
        max_dest_rd_atomic_(attr.max_qp_init_rd_atom) {}
  ~IbverbsQueuePair() override { api_.destroy_qp(qp_); }

  uint32_t number() const override { return qp_->qp_num; }

  int connect(const QpAddress& remote, uint32_t psn, const ConnectOptions& options) override {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_INIT;
    attr.pkey_index = 0;
    attr.port_num = port_;
    attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    if (int e = api_.modify_qp(qp_, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
      return fail("INIT", e);
    }
    attr = {};
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = mtuEnum(std::min(path_mtu_, remote.mtu));
    attr.dest_qp_num = remote.qp_num;
    attr.rq_psn = remote.psn;
    attr.max_dest_rd_atomic = static_cast<uint8_t>(std::min<int>(options.max_rd_atomic, max_dest_rd_atomic_));
    attr.min_rnr_timer = 12;
    attr.ah_attr.port_num = port_;
    attr.ah_attr.dlid = remote.lid;
    attr.ah_attr.sl = options.service_level;
    if (!remote.gid.empty()) {  // RoCE always; InfiniBand across subnets
      attr.ah_attr.is_global = 1;
      std::memcpy(attr.ah_attr.grh.dgid.raw, remote.gid.raw.data(), sizeof(attr.ah_attr.grh.dgid.raw));
      attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(options.gid_index);
      attr.ah_attr.grh.hop_limit = options.hop_limit;
      attr.ah_attr.grh.traffic_class = options.traffic_class;
    }
    if (int e = api_.modify_qp(qp_, &attr,
                              IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                  IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)) {
      return fail("RTR", e);
    }
    attr = {};
    attr.qp_state = IBV_QPS_RTS;
    attr.timeout = options.timeout;
    attr.retry_cnt = options.retry_count;
    attr.rnr_retry = options.rnr_retry;
    attr.sq_psn = psn;
    attr.max_rd_atomic = static_cast<uint8_t>(std::min<int>(options.max_rd_atomic, max_rd_atomic_));
    if (int e = api_.modify_qp(qp_, &attr,
                              IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                  IBV_QP_MAX_QP_RD_ATOMIC)) {
      return fail("RTS", e);
    }
    return kOk;
  }

  int post(const WorkRequest* requests, size_t count, size_t& posted) override {
    posted = 0;
    if (count == 0) return kOk;
    wrs_.assign(count, ibv_send_wr{});
    sges_.assign(count, ibv_sge{});
    for (size_t i = 0; i < count; ++i) {
      const WorkRequest& r = requests[i];
      sges_[i].addr = reinterpret_cast<uint64_t>(r.local);
      sges_[i].length = r.length;
      sges_[i].lkey = r.lkey;
      ibv_send_wr& wr = wrs_[i];
      wr.wr_id = r.wr_id;
      wr.sg_list = &sges_[i];
      wr.num_sge = 1;
      wr.opcode = r.read ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE;
      wr.send_flags = (r.signaled ? IBV_SEND_SIGNALED : 0) | (r.inline_data ? IBV_SEND_INLINE : 0);
      wr.wr.rdma.remote_addr = r.remote;
      wr.wr.rdma.rkey = r.rkey;
      wr.next = i + 1 < count ? &wrs_[i + 1] : nullptr;
    }
    ibv_send_wr* bad = nullptr;
    const int e = ibv_post_send(qp_, wrs_.data(), &bad);
    posted = e == 0 || bad == nullptr ? (e == 0 ? count : 0) : static_cast<size_t>(bad - wrs_.data());
    return errorOfErrno(e);
  }

 private:
  int fail(const char* state, int e) {
    MC_LOG(Warning) << "rdma: moving queue pair " << qp_->qp_num << " to " << state << " failed: " << std::strerror(e);
    return errorOfErrno(e);
  }

  const IbverbsApi& api_;
  ibv_qp* const qp_;
  const uint8_t port_;
  const uint32_t path_mtu_;
  const int max_rd_atomic_;
  const int max_dest_rd_atomic_;
  std::vector<ibv_send_wr> wrs_;  // reused by every post (posts to one QP do not race)
  std::vector<ibv_sge> sges_;
};

class IbverbsDevice : public Device {
 public:
  explicit IbverbsDevice(const IbverbsApi& api) : api_(api) {}
  ~IbverbsDevice() override {
    for (auto& [addr, mr] : mrs_) api_.dereg_mr(mr);
    if (cq_ != nullptr) {
      if (unacked_ > 0) api_.ack_cq_events(cq_, unacked_);
      api_.destroy_cq(cq_);
    }
    if (channel_ != nullptr) api_.destroy_comp_channel(channel_);
    if (pd_ != nullptr) api_.dealloc_pd(pd_);
    if (context_ != nullptr) api_.close_device(context_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
  }

  int open(ibv_device* device, const DeviceOptions& options) {
    port_.device = api_.get_device_name(device);
    context_ = api_.open_device(device);
    if (context_ == nullptr) return kDeviceNotFound;
    if (api_.query_device(context_, &attr_) != 0) return kDeviceNotFound;
    ibv_port_attr port_attr{};
    uint8_t active = 0;
    for (uint8_t p = 1; p <= attr_.phys_port_cnt && active == 0; ++p) {
      if (queryPort(api_, context_, p, &port_attr) == 0 && port_attr.state == IBV_PORT_ACTIVE) active = p;
    }
    if (active == 0) return kDeviceNotFound;
    port_.port = active;
    port_.ethernet = port_attr.link_layer == IBV_LINK_LAYER_ETHERNET;
    port_.lid = port_attr.lid;
    port_.mtu = mtuBytes(port_attr.active_mtu);
    for (int index = 0; index < port_attr.gid_tbl_len; ++index) {
      ibv_gid_entry entry{};
      if (api_.query_gid_ex(context_, active, static_cast<uint32_t>(index), &entry, 0, sizeof(entry)) != 0) continue;
      GidEntry g;
      g.index = index;
      std::memcpy(g.gid.raw.data(), entry.gid.raw, g.gid.raw.size());
      if (g.gid.empty()) continue;
      g.rocev2 = entry.gid_type == IBV_GID_TYPE_ROCE_V2;
      char name[IF_NAMESIZE] = {};
      if (entry.ndev_ifindex != 0 && if_indextoname(entry.ndev_ifindex, name) != nullptr) g.interface = name;
      port_.gids.push_back(g);
    }
    pd_ = api_.alloc_pd(context_);
    channel_ = api_.create_comp_channel(context_);
    if (pd_ == nullptr || channel_ == nullptr) return kEndpointError;
    const int cqe = static_cast<int>(std::min<uint32_t>(options.cq_entries, static_cast<uint32_t>(attr_.max_cqe)));
    cq_ = api_.create_cq(context_, cqe, nullptr, channel_, 0);
    if (cq_ == nullptr) return kEndpointError;
    const int flags = ::fcntl(channel_->fd, F_GETFL);
    if (flags < 0 || ::fcntl(channel_->fd, F_SETFL, flags | O_NONBLOCK) < 0) return kEndpointError;
    wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    return wake_fd_ >= 0 ? kOk : kEndpointError;
  }

  const PortInfo& port() const override { return port_; }

  int registerMemory(void* addr, size_t length, MemoryKeys& keys) override {
    std::lock_guard lock(mrs_mutex_);
    if (addr == nullptr || length == 0 || mrs_.count(addr) != 0) return kInvalidArgument;
    ibv_mr* mr = api_.reg_mr(pd_, addr, length, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                                   IBV_ACCESS_REMOTE_READ);
    if (mr == nullptr) return errorOfErrno(errno);
    keys = MemoryKeys{mr->lkey, mr->rkey};
    mrs_.emplace(addr, mr);
    return kOk;
  }

  // GPU memory: as a dma-buf the driver exports (any recent kernel and
  // driver), else as a plain pointer, which nvidia-peermem lets the NIC
  // resolve.
  int registerDeviceMemory(void* addr, size_t length, int cuda_device, MemoryKeys& keys) override {
#if MOONCAKE_WITH_CUDA
    std::lock_guard lock(mrs_mutex_);
    if (addr == nullptr || length == 0 || mrs_.count(addr) != 0) return kInvalidArgument;
    constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    ibv_mr* mr = nullptr;
    int fd = -1;
    uint64_t offset = 0;
    {
      cuda::DeviceScope scope(cuda_device);
      if (scope.ok() && api_.reg_dmabuf_mr != nullptr && cuda::exportDmabuf(addr, length, fd, offset)) {
        mr = api_.reg_dmabuf_mr(pd_, offset, length, reinterpret_cast<uint64_t>(addr), fd, kAccess);
        ::close(fd);  // the registration holds its own reference
      }
    }
    if (mr == nullptr) mr = api_.reg_mr(pd_, addr, length, kAccess);
    if (mr == nullptr) return kNotImplemented;
    keys = MemoryKeys{mr->lkey, mr->rkey};
    mrs_.emplace(addr, mr);
    return kOk;
#else
    (void)addr, (void)length, (void)cuda_device, (void)keys;
    return kNotImplemented;
#endif
  }

  int deregisterMemory(void* addr) override {
    std::lock_guard lock(mrs_mutex_);
    auto it = mrs_.find(addr);
    if (it == mrs_.end()) return kInvalidArgument;
    api_.dereg_mr(it->second);
    mrs_.erase(it);
    return kOk;
  }

  int createQueuePair(uint32_t max_send_wr, uint32_t max_inline, std::unique_ptr<QueuePair>& out) override {
    ibv_qp_init_attr init{};
    init.send_cq = cq_;
    init.recv_cq = cq_;
    init.qp_type = IBV_QPT_RC;
    init.sq_sig_all = 0;
    init.cap.max_send_wr = std::min<uint32_t>(max_send_wr, static_cast<uint32_t>(attr_.max_qp_wr));
    init.cap.max_recv_wr = 1;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    init.cap.max_inline_data = max_inline;
    ibv_qp* qp = api_.create_qp(pd_, &init);
    if (qp == nullptr) return errorOfErrno(errno);
    out = std::make_unique<IbverbsQueuePair>(api_, qp, port_.port, port_.mtu, attr_);
    return kOk;
  }

  int pollCompletions(WorkCompletion* out, int capacity, std::chrono::milliseconds timeout) override {
    int n = drain(out, capacity);
    if (n != 0 || timeout.count() <= 0) return n;
    // Armed, then polled once more: a completion that arrived in between
    // is seen now instead of after the wait.
    if (ibv_req_notify_cq(cq_, 0) != 0) return kEndpointError;
    if ((n = drain(out, capacity)) != 0) return n;
    pollfd fds[2] = {{channel_->fd, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    ::poll(fds, 2, static_cast<int>(timeout.count()));
    if (fds[1].revents != 0) {
      uint64_t count;
      if (::read(wake_fd_, &count, sizeof(count)) < 0) {
        // Drained by another wake-up.
      }
    }
    if (fds[0].revents != 0) {
      ibv_cq* cq = nullptr;
      void* cq_context = nullptr;
      if (api_.get_cq_event(channel_, &cq, &cq_context) == 0 && ++unacked_ >= 64) {
        api_.ack_cq_events(cq_, unacked_);
        unacked_ = 0;
      }
    }
    return drain(out, capacity);
  }

  void wake() override {
    const uint64_t one = 1;
    if (::write(wake_fd_, &one, sizeof(one)) < 0) {
      // The counter is full: a wake-up is pending anyway.
    }
  }

 private:
  int drain(WorkCompletion* out, int capacity) {
    ibv_wc wcs[64];
    const int n = ibv_poll_cq(cq_, std::min(capacity, 64), wcs);
    if (n < 0) return kEndpointError;
    for (int i = 0; i < n; ++i) {
      out[i] = WorkCompletion{wcs[i].wr_id, completionOf(wcs[i].status), wcs[i].qp_num, wcs[i].vendor_err};
    }
    return n;
  }

  const IbverbsApi& api_;
  PortInfo port_;
  ibv_context* context_ = nullptr;
  ibv_device_attr attr_{};
  ibv_pd* pd_ = nullptr;
  ibv_comp_channel* channel_ = nullptr;
  ibv_cq* cq_ = nullptr;
  unsigned unacked_ = 0;
  int wake_fd_ = -1;
  std::mutex mrs_mutex_;
  std::map<void*, ibv_mr*> mrs_;  // by base address
};

class IbverbsProvider : public Provider {
 public:
  explicit IbverbsProvider(const IbverbsApi& api) : api_(api) {}
  const char* name() const override { return "libibverbs"; }

  std::vector<std::string> deviceNames() override {
    std::vector<std::string> names;
    int count = 0;
    ibv_device** list = api_.get_device_list(&count);
    if (list == nullptr) return names;
    for (int i = 0; i < count; ++i) names.emplace_back(api_.get_device_name(list[i]));
    api_.free_device_list(list);
    return names;
  }

  int open(const std::string& device, const DeviceOptions& options, std::unique_ptr<Device>& out) override {
    int count = 0;
    ibv_device** list = api_.get_device_list(&count);
    if (list == nullptr) return kDeviceNotFound;
    int rc = kDeviceNotFound;
    for (int i = 0; i < count; ++i) {
      if (device != api_.get_device_name(list[i])) continue;
      auto opened = std::make_unique<IbverbsDevice>(api_);
      rc = opened->open(list[i], options);
      if (rc == kOk) out = std::move(opened);
      break;
    }
    api_.free_device_list(list);
    return rc;
  }

 private:
  const IbverbsApi& api_;
};

}  // namespace

// Null where libibverbs cannot be opened (no rdma-core on this host).
std::unique_ptr<Provider> makeIbverbsProvider() {
  const IbverbsApi* api = ibverbsApi();
  return api != nullptr ? std::make_unique<IbverbsProvider>(*api) : nullptr;
}

}  // namespace mooncake::te::rdma
