// The part of the libfabric ABI the libfabric transport uses, declared here so the package builds
// without libfabric headers; libfabric.so.1 is opened at run time (dlopen) by load_fabric().
//
// Which ABI: fi_getinfo, fi_dupinfo and fi_freeinfo are taken with dlvsym at version FABRIC_1.3,
// the fi_info layout below (with `nic`, and domain_attr ending in mr_cnt and tclass), current from
// libfabric 1.9 to at least 1.22 and kept by every libfabric.so.1; fi_fabric at FABRIC_1.1 and
// fi_strerror / fi_version at FABRIC_1.0. Everything else is an inline wrapper in the real
// headers that calls through the ops tables declared here (fi_writedata is ep->rma->writedata,
// fi_cq_read cq->ops->read, ...); an ops table only grows at its end, so the members used here
// keep their offsets. tests/test_fabric_transport.py compiles a check of every size, offset and
// constant used here against <rdma/fabric.h> and friends, where they are installed.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>

namespace moe_ep {
namespace fi {

using addr_t = uint64_t;  // fi_addr_t

constexpr uint32_t version(uint32_t major, uint32_t minor) { return (major << 16) | minor; }

// fi_info::caps and operation flags (fabric.h)
constexpr uint64_t MSG = 1ull << 1, RMA = 1ull << 2, WRITE = 1ull << 9, RECV = 1ull << 10, SEND = 1ull << 11,
                   TRANSMIT = SEND, REMOTE_WRITE = 1ull << 13, REMOTE_CQ_DATA = 1ull << 17, HMEM = 1ull << 47,
                   LOCAL_COMM = 1ull << 51, REMOTE_COMM = 1ull << 52;
// Operation flags of fi_writemsg: more posts follow at once (the provider may hold the doorbell).
constexpr uint64_t MORE = 1ull << 18;
// fi_info::mode bits the transport supports: a struct fi_context2 (here: the first 64 bytes of
// every operation's context) per operation.
constexpr uint64_t CONTEXT = 1ull << 59, CONTEXT2 = 1ull << 52;
// domain_attr.mr_mode
constexpr int MR_LOCAL = 1 << 2, MR_VIRT_ADDR = 1 << 4, MR_ALLOCATED = 1 << 5, MR_PROV_KEY = 1 << 6,
              MR_ENDPOINT = 1 << 9, MR_HMEM = 1 << 10;
constexpr int MR_BASIC = 1, MR_SCALABLE = 2;  // the enum fi_mr_mode of API 1.0-1.4 (not requested)

enum ep_type : int { EP_UNSPEC = 0, EP_MSG = 1, EP_DGRAM = 2, EP_RDM = 3 };
enum av_type : int { AV_UNSPEC = 0, AV_MAP = 1, AV_TABLE = 2 };
enum progress : int { PROGRESS_UNSPEC = 0, PROGRESS_AUTO = 1, PROGRESS_MANUAL = 2 };
enum threading : int { THREAD_UNSPEC = 0, THREAD_SAFE = 1 };
enum cq_format : int { CQ_FORMAT_UNSPEC = 0, CQ_FORMAT_CONTEXT = 1, CQ_FORMAT_MSG = 2, CQ_FORMAT_DATA = 3 };
enum wait_obj : int { WAIT_NONE = 0, WAIT_UNSPEC = 1 };
enum hmem_iface : int { HMEM_SYSTEM = 0, HMEM_CUDA = 1 };

constexpr int CONTROL_ENABLE = 6;  // fi_control command FI_ENABLE (fi_enable, fi_mr_enable)

// errno values libfabric returns negated (fi_errno.h); the rest are the system's
constexpr int EAGAIN_ = 11, ENODATA_ = 61, ENOSYS_ = 38, EACCES_ = 13, EAVAIL = 259;

struct fid;
struct fid_fabric;
struct fid_domain;
struct fid_ep;
struct fid_cq;
struct fid_av;
struct fid_mr;
struct info;
struct cq_err_entry;

struct fid_ops {
  size_t size;
  int (*close)(fid*);
  int (*bind)(fid*, fid* bfid, uint64_t flags);
  int (*control)(fid*, int command, void* arg);
  void* ops_open;
  void* tostr;
  void* ops_set;
};

struct fid {
  size_t fclass;
  void* context;
  fid_ops* ops;
};

struct tx_attr {
  uint64_t caps, mode, op_flags, msg_order, comp_order;
  size_t inject_size, size, iov_limit, rma_iov_limit;
  uint32_t tclass;
};

struct rx_attr {
  uint64_t caps, mode, op_flags, msg_order, comp_order;
  size_t total_buffered_recv, size, iov_limit;
};

struct ep_attr {
  ep_type type;
  uint32_t protocol, protocol_version;
  size_t max_msg_size, msg_prefix_size, max_order_raw_size, max_order_war_size, max_order_waw_size;
  uint64_t mem_tag_format;
  size_t tx_ctx_cnt, rx_ctx_cnt, auth_key_size;
  uint8_t* auth_key;
};

struct domain_attr {
  fid_domain* domain;
  char* name;
  threading threading_;
  progress control_progress, data_progress;
  int resource_mgmt;
  av_type av_type_;
  int mr_mode;
  size_t mr_key_size, cq_data_size, cq_cnt, ep_cnt, tx_ctx_cnt, rx_ctx_cnt, max_ep_tx_ctx, max_ep_rx_ctx,
      max_ep_stx_ctx, max_ep_srx_ctx, cntr_cnt, mr_iov_limit;
  uint64_t caps, mode;
  uint8_t* auth_key;
  size_t auth_key_size, max_err_data, mr_cnt;
  uint32_t tclass;
};

struct fabric_attr {
  fid_fabric* fabric;
  char* name;
  char* prov_name;
  uint32_t prov_version, api_version;
};

struct info {
  info* next;
  uint64_t caps, mode;
  uint32_t addr_format;
  size_t src_addrlen, dest_addrlen;
  void* src_addr;
  void* dest_addr;
  fid* handle;
  tx_attr* tx;
  rx_attr* rx;
  ep_attr* ep;
  domain_attr* domain;
  fabric_attr* fabric;
  void* nic;
};

struct ops_fabric {
  size_t size;
  int (*domain)(fid_fabric*, info*, fid_domain**, void* context);
  void* passive_ep;
  void* eq_open;
  void* wait_open;
  void* trywait;
};

struct fid_fabric {
  fid fid_;
  ops_fabric* ops;
  uint32_t api_version;
};

struct av_attr {
  av_type type;
  int rx_ctx_bits;
  size_t count, ep_per_node;
  const char* name;
  void* map_addr;
  uint64_t flags;
};

struct cq_attr {
  size_t size;
  uint64_t flags;
  cq_format format;
  wait_obj wait_obj_;
  int signaling_vector;
  int wait_cond;
  void* wait_set;
};

struct mr_attr {
  const iovec* mr_iov;
  size_t iov_count;
  uint64_t access, offset, requested_key;
  void* context;
  size_t auth_key_size;
  uint8_t* auth_key;
  hmem_iface iface;
  union {
    uint64_t reserved;
    int cuda;
  } device;
};

struct ops_domain {
  size_t size;
  int (*av_open)(fid_domain*, av_attr*, fid_av**, void* context);
  int (*cq_open)(fid_domain*, cq_attr*, fid_cq**, void* context);
  int (*endpoint)(fid_domain*, info*, fid_ep**, void* context);
};

struct ops_mr {
  size_t size;
  void* reg;
  void* regv;
  int (*regattr)(fid*, const mr_attr*, uint64_t flags, fid_mr**);
};

struct fid_domain {
  fid fid_;
  ops_domain* ops;
  ops_mr* mr;
};

struct fid_mr {
  fid fid_;
  void* mem_desc;
  uint64_t key;
};

struct ops_av {
  size_t size;
  int (*insert)(fid_av*, const void* addr, size_t count, addr_t* fi_addr, uint64_t flags, void* context);
};

struct fid_av {
  fid fid_;
  ops_av* ops;
};

struct ops_cm {
  size_t size;
  void* setname;
  int (*getname)(fid*, void* addr, size_t* addrlen);
};

struct ops_msg {
  size_t size;
  ssize_t (*recv)(fid_ep*, void* buf, size_t len, void* desc, addr_t src, void* context);
  void* recvv;
  void* recvmsg;
  ssize_t (*send)(fid_ep*, const void* buf, size_t len, void* desc, addr_t dest, void* context);
};

struct rma_iov {
  uint64_t addr;
  size_t len;
  uint64_t key;
};
struct msg_rma {
  const iovec* msg_iov;
  void** desc;
  size_t iov_count;
  addr_t addr;
  const rma_iov* rma_iov_;
  size_t rma_iov_count;
  void* context;
  uint64_t data;
};

struct ops_rma {
  size_t size;
  void* read;
  void* readv;
  void* readmsg;
  ssize_t (*write)(fid_ep*, const void* buf, size_t len, void* desc, addr_t dest, uint64_t addr, uint64_t key,
                   void* context);
  void* writev;
  ssize_t (*writemsg)(fid_ep*, const msg_rma* msg, uint64_t flags);
  void* inject;
  ssize_t (*writedata)(fid_ep*, const void* buf, size_t len, void* desc, uint64_t data, addr_t dest, uint64_t addr,
                       uint64_t key, void* context);
};

struct fid_ep {
  fid fid_;
  void* ops;
  ops_cm* cm;
  ops_msg* msg;
  ops_rma* rma;
  void* tagged;
  void* atomic;
  void* collective;
};

struct cq_data_entry {
  void* op_context;
  uint64_t flags;
  size_t len;
  void* buf;
  uint64_t data;
};

struct cq_err_entry {
  void* op_context;
  uint64_t flags;
  size_t len;
  void* buf;
  uint64_t data, tag;
  size_t olen;
  int err, prov_errno;
  void* err_data;
  size_t err_data_size;
};

struct ops_cq {
  size_t size;
  ssize_t (*read)(fid_cq*, void* buf, size_t count);
  void* readfrom;
  ssize_t (*readerr)(fid_cq*, cq_err_entry* buf, uint64_t flags);
  void* sread;
  void* sreadfrom;
  void* signal;
  const char* (*strerror)(fid_cq*, int prov_errno, const void* err_data, char* buf, size_t len);
};

struct fid_cq {
  fid fid_;
  ops_cq* ops;
};

// The exported functions the transport calls (load_fabric).
struct Api {
  int (*getinfo)(uint32_t version, const char* node, const char* service, uint64_t flags, const info* hints,
                 info** out);
  void (*freeinfo)(info*);
  info* (*dupinfo)(const info*);
  int (*fabric)(fabric_attr*, fid_fabric**, void* context);
  const char* (*strerror)(int errnum);
  uint32_t (*version)();
};

}  // namespace fi
}  // namespace moe_ep
