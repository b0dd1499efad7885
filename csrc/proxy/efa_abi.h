// The part of the libibverbs extended API and of libefa's efadv API that the efa transport and
// the device listing use, declared here (like verbs_abi.h) so the package builds without
// rdma-core headers; both libraries are opened at run time (load_rdma_extra()).
//
// Written from the documented API: verbs.h (ibv_qp_init_attr_ex, ibv_qp_ex and its ibv_wr_*
// send-ops iterator, ibv_device_attr) and the efadv man pages (efadv_query_device(3),
// efadv_create_qp_ex(3)). tests/test_efa.py compiles a check of the sizes, offsets and values
// against the system headers where they are installed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "verbs_abi.h"

namespace moe_ep {
namespace ibv {

struct xrcd;           // opaque
struct rwq_ind_table;  // opaque

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

struct rx_hash_conf {
  uint8_t rx_hash_function;
  uint8_t rx_hash_key_len;
  uint8_t* rx_hash_key;
  uint64_t rx_hash_fields_mask;
};

struct qp_init_attr_ex {
  void* qp_context;
  cq* send_cq;
  cq* recv_cq;
  srq* srq_;
  qp_cap cap;
  int qp_type;
  int sq_sig_all;
  uint32_t comp_mask;
  pd* pd_;
  xrcd* xrcd_;
  uint32_t create_flags;
  uint16_t max_tso_header;
  rwq_ind_table* rwq_ind_tbl;
  rx_hash_conf rx_hash;
  uint32_t source_qpn;
  uint64_t send_ops_flags;
};

// The send-ops iterator: ibv_wr_start, one operation, its setters, ibv_wr_complete. The ibv_wr_*
// calls are inline functions of verbs.h that call these members.
struct qp_ex {
  qp qp_base;
  uint64_t comp_mask;
  uint64_t wr_id;
  unsigned int wr_flags;
  void* wr_atomic_cmp_swp;
  void* wr_atomic_fetch_add;
  void* wr_bind_mw;
  void* wr_local_inv;
  void (*wr_rdma_read)(qp_ex*, uint32_t rkey, uint64_t remote_addr);
  void (*wr_rdma_write)(qp_ex*, uint32_t rkey, uint64_t remote_addr);
  void (*wr_rdma_write_imm)(qp_ex*, uint32_t rkey, uint64_t remote_addr, uint32_t imm_be);
  void (*wr_send)(qp_ex*);
  void (*wr_send_imm)(qp_ex*, uint32_t imm_be);
  void* wr_send_inv;
  void* wr_send_tso;
  void (*wr_set_ud_addr)(qp_ex*, ah*, uint32_t remote_qpn, uint32_t remote_qkey);
  void* wr_set_xrc_srqn;
  void* wr_set_inline_data;
  void* wr_set_inline_data_list;
  void (*wr_set_sge)(qp_ex*, uint32_t lkey, uint64_t addr, uint32_t length);
  void (*wr_set_sge_list)(qp_ex*, size_t num_sge, const sge* sg_list);
  void (*wr_start)(qp_ex*);
  int (*wr_complete)(qp_ex*);
  void (*wr_abort)(qp_ex*);
};

enum : int { QPT_DRIVER = 0xff };
enum : uint32_t { QP_INIT_ATTR_PD = 1u << 0, QP_INIT_ATTR_SEND_OPS_FLAGS = 1u << 6 };
enum : uint64_t {
  QP_EX_WITH_RDMA_WRITE = 1u << 0,
  QP_EX_WITH_RDMA_WRITE_WITH_IMM = 1u << 1,
  QP_EX_WITH_SEND = 1u << 2,
  QP_EX_WITH_SEND_WITH_IMM = 1u << 3,
};
enum : int { QP_QKEY = 1 << 6 };
enum : unsigned { WC_WITH_IMM = 1u << 1 };

}  // namespace ibv

namespace efadv {

// efadv_query_device(3)
struct device_attr {
  uint64_t comp_mask;
  uint32_t max_sq_wr;
  uint32_t max_rq_wr;
  uint16_t max_sq_sge;
  uint16_t max_rq_sge;
  uint16_t inline_buf_size;
  uint8_t reserved[2];
  uint32_t device_caps;
  uint32_t max_rdma_size;
};

enum : uint32_t {
  CAPS_RDMA_READ = 1u << 0,
  CAPS_RNR_RETRY = 1u << 1,
  CAPS_CQ_WITH_SGID = 1u << 2,
  CAPS_RDMA_WRITE = 1u << 3,
  CAPS_UNSOLICITED_WRITE_RECV = 1u << 4,
};

// efadv_create_qp_ex(3); `flags` and `sl` were `reserved` bytes in older libraries, which
// require them to be zero (so a flag is only set when the device reports the capability).
struct qp_init_attr {
  uint64_t comp_mask;
  uint32_t driver_qp_type;
  uint16_t flags;
  uint8_t sl;
  uint8_t reserved[1];
};

enum : uint32_t { QP_DRIVER_TYPE_SRD = 0 };
enum : uint16_t { QP_FLAGS_UNSOLICITED_WRITE_RECV = 1u << 0 };

}  // namespace efadv

// The functions beyond ibv::Api: libibverbs extras (always, when libibverbs loads) and libefa's
// efadv functions (null when libefa.so.1, MOE_EP_EFA_LIB overriding the name, cannot be loaded;
// efa_why then says why).
struct RdmaExtra {
  int (*query_device)(ibv::context*, ibv::device_attr*);
  ibv::ah* (*create_ah)(ibv::pd*, ibv::ah_attr*);
  int (*destroy_ah)(ibv::ah*);
  ibv::qp_ex* (*qp_to_qp_ex)(ibv::qp*);  // IBVERBS_1.6 (rdma-core 24); null if older
  int (*efadv_query_device)(ibv::context*, efadv::device_attr*, uint32_t inlen);
  ibv::qp* (*efadv_create_qp_ex)(ibv::context*, ibv::qp_init_attr_ex*, efadv::qp_init_attr*, uint32_t inlen);
  std::string efa_why;
};

// Loads once per process (after ibv::load_verbs succeeded); null with *why when libibverbs
// lacks one of the extras it always needs.
const RdmaExtra* load_rdma_extra(std::string* why);

}  // namespace moe_ep
