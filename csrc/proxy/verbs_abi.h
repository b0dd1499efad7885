// The part of the libibverbs ABI the verbs transport uses, declared here so the package builds
// without rdma-core headers; libibverbs.so.1 is opened at run time (dlopen) by load_verbs().
//
// Layouts follow <infiniband/verbs.h> of rdma-core (stable since libibverbs 1.1: the structs
// below are the ABI every provider implements). tests/test_verbs_transport.py compiles a check
// of every size and offset used here against the system header, where there is one. Fast-path calls (post_send, post_recv, poll_cq, req_notify_cq) are inline in
// the real header and go through ibv_context::ops; the rest are exported functions (dlsym).
#pragma once

#include <pthread.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace moe_ep {
namespace ibv {

struct device;  // opaque
struct pd;      // opaque
struct ah;      // opaque
struct srq;     // opaque
struct mw;      // opaque
struct context;
struct cq;
struct qp;
struct wc;
struct send_wr;
struct recv_wr;

union gid {
  uint8_t raw[16];
  struct {
    uint64_t subnet_prefix;  // big endian
    uint64_t interface_id;
  } global;
};

struct context_ops {
  void* compat_[11];  // _compat_query_device .. _compat_create_cq
  int (*poll_cq)(cq*, int num_entries, wc*);
  int (*req_notify_cq)(cq*, int solicited_only);
  void* compat2_[7];  // _compat_cq_event .. _compat_destroy_srq
  void* post_srq_recv;
  void* compat3_[4];  // _compat_create_qp .. _compat_destroy_qp
  int (*post_send)(qp*, send_wr*, send_wr** bad);
  int (*post_recv)(qp*, recv_wr*, recv_wr** bad);
  void* compat4_[5];  // _compat_create_ah .. _compat_async_event
};

struct context {
  device* dev;
  context_ops ops;
  int cmd_fd;
  int async_fd;
  int num_comp_vectors;
  pthread_mutex_t mutex;
  void* abi_compat;
};

struct comp_channel {
  context* ctx;
  int fd;
  int refcnt;
};

struct cq {
  context* ctx;
  comp_channel* channel;
  void* cq_context;
  uint32_t handle;
  int cqe;
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  uint32_t comp_events_completed;
  uint32_t async_events_completed;
};

struct qp {
  context* ctx;
  void* qp_context;
  pd* pd_;
  cq* send_cq;
  cq* recv_cq;
  srq* srq_;
  uint32_t handle;
  uint32_t qp_num;
  int state;
  int qp_type;
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  uint32_t events_completed;
};

struct mr {
  context* ctx;
  pd* pd_;
  void* addr;
  size_t length;
  uint32_t handle;
  uint32_t lkey;
  uint32_t rkey;
};

// ibv_query_port (the exported IBVERBS_1.1 symbol) fills this, the _compat_ibv_port_attr prefix
// of struct ibv_port_attr; `spare` leaves room should a library write the newer tail too.
struct port_attr {
  int state;
  int max_mtu;
  int active_mtu;
  int gid_tbl_len;
  uint32_t port_cap_flags;
  uint32_t max_msg_sz;
  uint32_t bad_pkey_cntr;
  uint32_t qkey_viol_cntr;
  uint16_t pkey_tbl_len;
  uint16_t lid;
  uint16_t sm_lid;
  uint8_t lmc;
  uint8_t max_vl_num;
  uint8_t sm_sl;
  uint8_t subnet_timeout;
  uint8_t init_type_reply;
  uint8_t active_width;
  uint8_t active_speed;
  uint8_t phys_state;
  uint8_t link_layer;
  uint8_t flags;
  uint8_t spare[64];
};

struct wc {
  uint64_t wr_id;
  int status;
  int opcode;
  uint32_t vendor_err;
  uint32_t byte_len;
  uint32_t imm_data;  // network byte order
  uint32_t qp_num;
  uint32_t src_qp;
  unsigned int wc_flags;
  uint16_t pkey_index;
  uint16_t slid;
  uint8_t sl;
  uint8_t dlid_path_bits;
};

struct sge {
  uint64_t addr;
  uint32_t length;
  uint32_t lkey;
};

struct send_wr {
  uint64_t wr_id;
  send_wr* next;
  sge* sg_list;
  int num_sge;
  int opcode;
  unsigned int send_flags;
  uint32_t imm_data;  // network byte order
  union {
    struct {
      uint64_t remote_addr;
      uint32_t rkey;
    } rdma;
    struct {
      uint64_t remote_addr;
      uint64_t compare_add;
      uint64_t swap;
      uint32_t rkey;
    } atomic;
  } wr;
  uint32_t qp_type_xrc;
  // bind_mw / tso union: ibv_mw*, rkey, ibv_mw_bind_info {ibv_mr*, addr, length, access}
  struct {
    void* mw_;
    uint32_t rkey;
    void* mr_;
    uint64_t addr;
    uint64_t length;
    unsigned int access;
  } tail;
};

struct recv_wr {
  uint64_t wr_id;
  recv_wr* next;
  sge* sg_list;
  int num_sge;
};

struct qp_cap {
  uint32_t max_send_wr;
  uint32_t max_recv_wr;
  uint32_t max_send_sge;
  uint32_t max_recv_sge;
  uint32_t max_inline_data;
};

struct qp_init_attr {
  void* qp_context;
  cq* send_cq;
  cq* recv_cq;
  srq* srq_;
  qp_cap cap;
  int qp_type;
  int sq_sig_all;
};

struct global_route {
  gid dgid;
  uint32_t flow_label;
  uint8_t sgid_index;
  uint8_t hop_limit;
  uint8_t traffic_class;
};

struct ah_attr {
  global_route grh;
  uint16_t dlid;
  uint8_t sl;
  uint8_t src_path_bits;
  uint8_t static_rate;
  uint8_t is_global;
  uint8_t port_num;
};

struct qp_attr {
  int qp_state;
  int cur_qp_state;
  int path_mtu;
  int path_mig_state;
  uint32_t qkey;
  uint32_t rq_psn;
  uint32_t sq_psn;
  uint32_t dest_qp_num;
  unsigned int qp_access_flags;
  qp_cap cap;
  ah_attr ah;
  ah_attr alt_ah;
  uint16_t pkey_index;
  uint16_t alt_pkey_index;
  uint8_t en_sqd_async_notify;
  uint8_t sq_draining;
  uint8_t max_rd_atomic;
  uint8_t max_dest_rd_atomic;
  uint8_t min_rnr_timer;
  uint8_t port_num;
  uint8_t timeout;
  uint8_t retry_cnt;
  uint8_t rnr_retry;
  uint8_t alt_port_num;
  uint8_t alt_timeout;
  uint32_t rate_limit;
};

// enum values (verbs.h)
enum : int { QPS_RESET = 0, QPS_INIT = 1, QPS_RTR = 2, QPS_RTS = 3, QPS_ERR = 6 };
enum : int { QPT_RC = 2 };
enum : int { PORT_ACTIVE = 4 };
enum : int { LINK_LAYER_INFINIBAND = 1, LINK_LAYER_ETHERNET = 2 };
enum : int { WR_RDMA_WRITE = 0, WR_RDMA_WRITE_WITH_IMM = 1, WR_SEND = 2 };
enum : unsigned { SEND_SIGNALED = 2 };
enum : int { WC_SUCCESS = 0, WC_WR_FLUSH_ERR = 5, WC_REM_ACCESS_ERR = 10 };
enum : int { WC_RECV = 128, WC_RECV_RDMA_WITH_IMM = 129 };
enum : int { ACCESS_LOCAL_WRITE = 1, ACCESS_REMOTE_WRITE = 2, ACCESS_REMOTE_READ = 4 };
enum : int {
  QP_STATE = 1 << 0,
  QP_ACCESS_FLAGS = 1 << 3,
  QP_PKEY_INDEX = 1 << 4,
  QP_PORT = 1 << 5,
  QP_AV = 1 << 7,
  QP_PATH_MTU = 1 << 8,
  QP_TIMEOUT = 1 << 9,
  QP_RETRY_CNT = 1 << 10,
  QP_RNR_RETRY = 1 << 11,
  QP_RQ_PSN = 1 << 12,
  QP_MAX_QP_RD_ATOMIC = 1 << 13,
  QP_MIN_RNR_TIMER = 1 << 15,
  QP_SQ_PSN = 1 << 16,
  QP_MAX_DEST_RD_ATOMIC = 1 << 17,
  QP_DEST_QPN = 1 << 20,
};

// ibv_query_device's attributes (the device listing, rdma_probe.cc).
struct device_attr {
  char fw_ver[64];
  uint64_t node_guid;       // big endian
  uint64_t sys_image_guid;  // big endian
  uint64_t max_mr_size;
  uint64_t page_size_cap;
  uint32_t vendor_id;
  uint32_t vendor_part_id;
  uint32_t hw_ver;
  int max_qp;
  int max_qp_wr;
  unsigned int device_cap_flags;
  int max_sge;
  int max_sge_rd;
  int max_cq;
  int max_cqe;
  int max_mr;
  int max_pd;
  int max_qp_rd_atom;
  int max_ee_rd_atom;
  int max_res_rd_atom;
  int max_qp_init_rd_atom;
  int max_ee_init_rd_atom;
  int atomic_cap;
  int max_ee;
  int max_rdd;
  int max_mw;
  int max_raw_ipv6_qp;
  int max_raw_ethy_qp;
  int max_mcast_grp;
  int max_mcast_qp_attach;
  int max_total_mcast_qp_attach;
  int max_ah;
  int max_fmr;
  int max_map_per_fmr;
  int max_srq;
  int max_srq_wr;
  int max_srq_sge;
  uint16_t max_pkeys;
  uint8_t local_ca_ack_delay;
  uint8_t phys_port_cnt;
};

// The exported functions, resolved with dlsym.
struct Api {
  device** (*get_device_list)(int* num);
  void (*free_device_list)(device** list);
  const char* (*get_device_name)(device* dev);
  context* (*open_device)(device* dev);
  int (*close_device)(context* ctx);
  int (*query_port)(context* ctx, uint8_t port, port_attr* attr);
  int (*query_gid)(context* ctx, uint8_t port, int index, gid* out);
  pd* (*alloc_pd)(context* ctx);
  int (*dealloc_pd)(pd* p);
  mr* (*reg_mr)(pd* p, void* addr, size_t len, int access);
  int (*dereg_mr)(mr* m);
  comp_channel* (*create_comp_channel)(context* ctx);
  int (*destroy_comp_channel)(comp_channel* ch);
  cq* (*create_cq)(context* ctx, int cqe, void* cq_context, comp_channel* ch, int comp_vector);
  int (*destroy_cq)(cq* c);
  int (*get_cq_event)(comp_channel* ch, cq** c, void** cq_context);
  void (*ack_cq_events)(cq* c, unsigned int n);
  qp* (*create_qp)(pd* p, qp_init_attr* attr);
  int (*modify_qp)(qp* q, qp_attr* attr, int mask);
  int (*destroy_qp)(qp* q);
  const char* (*wc_status_str)(int status);
  // Optional: null when the library lacks it (the device listing then says so).
  int (*query_device)(context* ctx, device_attr* attr);
  // Optional (rdma-core 34+, IBVERBS_1.12); null when the library lacks it.
  mr* (*reg_dmabuf_mr)(pd* p, uint64_t offset, size_t len, uint64_t iova, int fd, int access);
};

// Opens libibverbs (MOE_EP_IBVERBS_LIB overrides the name libibverbs.so.1) once per process.
// Null when it cannot be loaded or lacks a symbol; *why then says what is missing.
const Api* load_verbs(std::string* why);

}  // namespace ibv
}  // namespace moe_ep
