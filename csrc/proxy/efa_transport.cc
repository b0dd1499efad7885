// efa transport: AWS EFA through libibverbs + libefa (efadv), both opened at run time
// (efa_abi.h), so nothing here needs rdma-core to build. One SRD queue pair per engine (SRD is
// a reliable, unordered datagram service: one QP reaches every peer through an address handle
// per peer), writes and writes with immediates through the ibv_qp_ex send-ops API
// (ibv_wr_rdma_write[_imm] + ibv_wr_set_ud_addr), receives of writes with immediates without
// consuming receive requests where the device supports it. docs/ARCHITECTURE.md §9, "efa
// transport". Written from the documented API; it cannot run without an EFA device.
#include <arpa/inet.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "efa_abi.h"
#include "rdma_probe.h"
#include "transport.h"
#include "transport_common.h"
#include "verbs_abi.h"

namespace moe_ep {

const RdmaExtra* load_rdma_extra(std::string* why) {
  static std::mutex mu;
  static RdmaExtra api{};
  static int state = 0;  // 0 not tried, 1 loaded, -1 failed
  static std::string err;
  std::lock_guard<std::mutex> lk(mu);
  if (state == 0) {
    state = -1;
    const char* venv = std::getenv("MOE_EP_IBVERBS_LIB");
    const std::string vname = venv && *venv ? venv : "libibverbs.so.1";
    void* hv = ibv::load_verbs(&err) ? dlopen(vname.c_str(), RTLD_NOW | RTLD_LOCAL) : nullptr;  // the loaded one
    if (hv) {
      api.query_device = reinterpret_cast<decltype(api.query_device)>(dlsym(hv, "ibv_query_device"));
      api.create_ah = reinterpret_cast<decltype(api.create_ah)>(dlsym(hv, "ibv_create_ah"));
      api.destroy_ah = reinterpret_cast<decltype(api.destroy_ah)>(dlsym(hv, "ibv_destroy_ah"));
      api.qp_to_qp_ex = reinterpret_cast<decltype(api.qp_to_qp_ex)>(dlsym(hv, "ibv_qp_to_qp_ex"));
      if (!api.query_device || !api.create_ah || !api.destroy_ah)
        err = vname + " lacks ibv_query_device, ibv_create_ah or ibv_destroy_ah";
      else
        state = 1;
    }
    const char* eenv = std::getenv("MOE_EP_EFA_LIB");
    const std::string ename = eenv && *eenv ? eenv : "libefa.so.1";
    void* he = state == 1 ? dlopen(ename.c_str(), RTLD_NOW | RTLD_LOCAL) : nullptr;
    if (state == 1 && !he) {
      const char* e = dlerror();
      api.efa_why = "cannot load " + ename + " (rdma-core's EFA provider library is not installed?): " +
                    (e ? e : "dlopen failed");
    } else if (he) {
      api.efadv_query_device = reinterpret_cast<decltype(api.efadv_query_device)>(dlsym(he, "efadv_query_device"));
      api.efadv_create_qp_ex = reinterpret_cast<decltype(api.efadv_create_qp_ex)>(dlsym(he, "efadv_create_qp_ex"));
      if (!api.efadv_query_device || !api.efadv_create_qp_ex) {
        api.efa_why = ename + " lacks efadv_query_device or efadv_create_qp_ex (rdma-core 25 or newer needed)";
        api.efadv_query_device = nullptr;
        api.efadv_create_qp_ex = nullptr;
      } else if (!api.qp_to_qp_ex) {
        api.efa_why = vname + " lacks ibv_qp_to_qp_ex (rdma-core 24 or newer needed)";
        api.efadv_query_device = nullptr;
        api.efadv_create_qp_ex = nullptr;
      }
    }
  }
  if (state != 1) {
    if (why) *why = err;
    return nullptr;
  }
  return &api;
}

std::string efa_missing_caps(uint32_t caps) {
  std::string out;
  auto need = [&](bool ok, const char* what) {
    if (!ok) out += (out.empty() ? "" : ", ") + std::string(what);
  };
  need(caps & efadv::CAPS_RDMA_WRITE, "RDMA write (EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE)");
  need(caps & (efadv::CAPS_UNSOLICITED_WRITE_RECV | efadv::CAPS_RNR_RETRY),
       "unsolicited write receive or RNR retry (EFADV_DEVICE_ATTR_CAPS_UNSOLICITED_WRITE_RECV, _RNR_RETRY)");
  return out;
}

std::string efa_caps_names(uint32_t caps) {
  static const std::pair<uint32_t, const char*> names[] = {
      {efadv::CAPS_RDMA_READ, "rdma read"},
      {efadv::CAPS_RNR_RETRY, "rnr retry"},
      {efadv::CAPS_CQ_WITH_SGID, "cq with sgid"},
      {efadv::CAPS_RDMA_WRITE, "rdma write"},
      {efadv::CAPS_UNSOLICITED_WRITE_RECV, "unsolicited write recv"},
  };
  std::string out;
  for (const auto& [bit, name] : names)
    if (caps & bit) out += (out.empty() ? "" : ", ") + std::string(name);
  return out.empty() ? "none" : out;
}

namespace {

constexpr uint64_t kRecvTag = 1ull << 62;   // receive wr_id: kRecvTag | its slot of the scratch buffer
constexpr uint64_t kHelloTag = 1ull << 61;  // hello send wr_id: kHelloTag | attempt << 20 | peer
constexpr uint64_t kByeTag = 1ull << 60;    // goodbye send wr_id: kByeTag | peer
constexpr uint32_t kQkey = 0x4d455041;      // "MEPA": the Q_Key every engine's QP uses
// The scratch buffer: one slot per receive (where a hello or a goodbye lands), then one per peer
// (the hello this rank sends it), then one per peer (its goodbye).
constexpr size_t kSlot = 64;
static_assert(sizeof(WireHello) <= kSlot && sizeof(WireGoodbye) <= kSlot, "a hello and a goodbye fit a slot");

std::string gid_hex(const ibv::gid& g) {
  char s[33];
  for (int i = 0; i < 16; ++i) std::snprintf(s + 2 * i, 3, "%02x", g.raw[i]);
  return std::string(s, 32);
}

bool gid_from_hex(const std::string& s, ibv::gid* g) {
  if (s.size() != 32 || s.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos) return false;
  for (int i = 0; i < 16; ++i) g->raw[i] = uint8_t(std::stoul(s.substr(2 * i, 2), nullptr, 16));
  return true;
}

int env_or(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : dflt;
}

// A device, port and GID for the efa transport, with the device's efadv attributes.
struct EfaSelection {
  ibv::context* ctx = nullptr;
  std::string dev;
  int port = 1;
  int gid_index = 0;
  ibv::gid gid{};
  ibv::port_attr attr{};
  efadv::device_attr efa{};
};

bool select_efa(const ibv::Api& v, const RdmaExtra& x, const std::string& want, EfaSelection* out, std::string* why) {
  if (!x.efadv_query_device) {
    *why = x.efa_why;
    return false;
  }
  int n = 0;
  ibv::device** list = v.get_device_list(&n);
  if (!list || n <= 0) {
    if (list) v.free_device_list(list);
    *why = "no EFA device (libibverbs lists no RDMA device)";
    return false;
  }
  const char* env_dev = std::getenv("MOE_EP_IB_DEVICE");
  const std::string dev = !want.empty() ? want : (env_dev ? env_dev : "");
  const int port = env_or("MOE_EP_IB_PORT", 1);
  std::string names, reasons;
  bool ok = false, named_seen = false;
  for (int i = 0; i < n && !ok; ++i) {
    const std::string name = v.get_device_name(list[i]);
    names += (names.empty() ? "" : ", ") + name;
    if (!dev.empty() && name != dev) continue;
    named_seen = true;
    ibv::context* ctx = v.open_device(list[i]);
    if (!ctx) {
      reasons += "; " + name + ": ibv_open_device failed: " + strerror(errno);
      continue;
    }
    efadv::device_attr ea{};
    std::string bad;
    ibv::port_attr pa{};
    ibv::gid g{};
    const int gidx = env_or("MOE_EP_IB_GID_INDEX", 0);
    if (x.efadv_query_device(ctx, &ea, sizeof(ea)) != 0)
      bad = name + " is not an EFA device";
    else if (const std::string miss = efa_missing_caps(ea.device_caps); !miss.empty())
      bad = name + " lacks " + miss + " (it has: " + efa_caps_names(ea.device_caps) + ")";
    else if (int rc = v.query_port(ctx, uint8_t(port), &pa); rc != 0)
      bad = name + ": ibv_query_port(" + std::to_string(port) + ") failed: " + strerror(rc > 0 ? rc : errno);
    else if (pa.state != ibv::PORT_ACTIVE)
      bad = name + " port " + std::to_string(port) + " is not active (state " + std::to_string(pa.state) + ")";
    else if (v.query_gid(ctx, uint8_t(port), gidx, &g) != 0)
      bad = name + " port " + std::to_string(port) + ": GID index " + std::to_string(gidx) + " is not valid";
    if (!bad.empty()) {
      reasons += "; " + bad;
      v.close_device(ctx);
      continue;
    }
    *out = EfaSelection{ctx, name, port, gidx, g, pa, ea};
    ok = true;
  }
  v.free_device_list(list);
  if (!ok)
    *why = !dev.empty() && !named_seen ? "EFA device '" + dev + "' (MOE_EP_IB_DEVICE) not found; devices: " + names
                                       : "no usable EFA device (devices: " + names + ")" + reasons;
  return ok;
}

struct Region {
  char* ptr = nullptr;
  uint64_t len = 0;
  ibv::mr* mr = nullptr;
};

struct RemoteRegion {
  uint64_t addr = 0, len = 0;
  uint32_t rkey = 0;
};

struct EfaPeer {
  ibv::ah* ah = nullptr;
  int rank = -1, world = 0;
  ibv::gid gid{};
  uint32_t qpn = 0, qkey = kQkey;
  std::vector<RemoteRegion> mr;
  std::atomic<bool> lost{false};
  std::atomic<bool> up{false};
  std::atomic<bool> hello_recv{false};
  std::atomic<int> hello_status{-1};  // own hello: -1 pending, else its wc status
  std::atomic<uint32_t> hello_attempt{0};
  std::atomic<int> bye_status{-2};  // own goodbye: -2 not sent, -1 pending, else its wc status
  std::atomic<int64_t> writes_posted{0};
  std::mutex mu;  // guards err and the goodbye fields
  std::string err;
  bool said_bye = false;  // the peer's goodbye came before it was lost: it said `bye`
  Goodbye bye;
  std::string bye_text;
};

class EfaTransport final : public Transport {
 public:
  EfaTransport(int rank, int world, const ibv::Api& v, const RdmaExtra& x, const JobIdentity& id)
      : rank_(rank), world_(world), v_(v), x_(x), id_(id) {
    for (int p = 0; p < world; ++p) peers_.emplace_back(new EfaPeer);
  }

  int start(const std::string& dev) {
    std::string why;
    if (!select_efa(v_, x_, dev, &sel_, &why)) return set_error(kErrInvalid, prefix() + "efa: " + why);
    unsolicited_ = (sel_.efa.device_caps & efadv::CAPS_UNSOLICITED_WRITE_RECV) != 0;
    where_ = "efa device " + sel_.dev + " port " + std::to_string(sel_.port) + " GID index " +
             std::to_string(sel_.gid_index);
    sq_depth_ = int(std::clamp<uint32_t>(sel_.efa.max_sq_wr, 16, 1024));
    rq_depth_ = int(std::clamp<uint32_t>(sel_.efa.max_rq_wr, 16, 1024));
    per_peer_ = std::max(1, std::min(sq_depth_, rq_depth_) / std::max(1, world_ - 1));
    pd_ = v_.alloc_pd(sel_.ctx);
    if (!pd_) return sys_error("ibv_alloc_pd");
    ibcq_ = v_.create_cq(sel_.ctx, sq_depth_ + rq_depth_ + 16, nullptr, nullptr, 0);
    if (!ibcq_) return sys_error("ibv_create_cq");
    scratch_.assign((size_t(rq_depth_) + 2 * size_t(world_)) * kSlot, 0);
    for (int p = 0; p < world_; ++p) {
      const WireHello h = make_hello(id_, rank_, p, world_, 0);
      std::memcpy(hello_slot(p), &h, sizeof(h));
    }
    scratch_mr_ = v_.reg_mr(pd_, scratch_.data(), scratch_.size(), ibv::ACCESS_LOCAL_WRITE);
    if (!scratch_mr_) return sys_error("ibv_reg_mr of the receive buffer");
    ibv::qp_init_attr_ex a{};
    a.send_cq = ibcq_;
    a.recv_cq = ibcq_;
    a.cap.max_send_wr = uint32_t(sq_depth_);
    a.cap.max_recv_wr = uint32_t(rq_depth_);
    a.cap.max_send_sge = 1;
    a.cap.max_recv_sge = 1;
    a.qp_type = ibv::QPT_DRIVER;
    a.comp_mask = ibv::QP_INIT_ATTR_PD | ibv::QP_INIT_ATTR_SEND_OPS_FLAGS;
    a.pd_ = pd_;
    a.send_ops_flags = ibv::QP_EX_WITH_RDMA_WRITE | ibv::QP_EX_WITH_RDMA_WRITE_WITH_IMM | ibv::QP_EX_WITH_SEND |
                       ibv::QP_EX_WITH_SEND_WITH_IMM;
    efadv::qp_init_attr e{};
    e.driver_qp_type = efadv::QP_DRIVER_TYPE_SRD;
    e.flags = unsolicited_ ? efadv::QP_FLAGS_UNSOLICITED_WRITE_RECV : 0;
    qp_ = x_.efadv_create_qp_ex(sel_.ctx, &a, &e, sizeof(e));
    if (!qp_) return sys_error("efadv_create_qp_ex (SRD)");
    qpx_ = x_.qp_to_qp_ex(qp_);
    if (!qpx_) return sys_error("ibv_qp_to_qp_ex");
    // SRD, like UD: INIT (P_Key index, port, Q_Key), RTR, RTS (send PSN; RNR retry where supported).
    ibv::qp_attr s{};
    s.qp_state = ibv::QPS_INIT;
    s.port_num = uint8_t(sel_.port);
    s.qkey = kQkey;
    if (int rc = modify(s, ibv::QP_STATE | ibv::QP_PKEY_INDEX | ibv::QP_PORT | ibv::QP_QKEY, "INIT"); rc != kOk) return rc;
    s = ibv::qp_attr{};
    s.qp_state = ibv::QPS_RTR;
    if (int rc = modify(s, ibv::QP_STATE, "RTR"); rc != kOk) return rc;
    s = ibv::qp_attr{};
    s.qp_state = ibv::QPS_RTS;
    s.sq_psn = std::mt19937{std::random_device{}()}() & 0xFFFFFF;
    int mask = ibv::QP_STATE | ibv::QP_SQ_PSN;
    if (sel_.efa.device_caps & efadv::CAPS_RNR_RETRY) {
      s.rnr_retry = 7;  // a receiver without a posted receive is retried without limit
      mask |= ibv::QP_RNR_RETRY;
    }
    if (int rc = modify(s, mask, "RTS"); rc != kOk) return rc;
    for (int i = 0; i < rq_depth_; ++i)
      if (!post_recv(uint64_t(i))) return sys_error("ibv_post_recv");
    try {
      thr_ = std::thread([this] { cq_loop(); });
    } catch (const std::exception& ex) {
      return set_error(kErrSystem, prefix() + "efa completion thread: " + ex.what());
    }
    return kOk;
  }

  ~EfaTransport() override {
    say_goodbye(Goodbye{});  // a clean close, unless the owner said otherwise (needs the thread)
    stop_ = true;
    if (thr_.joinable()) thr_.join();
    if (qp_) v_.destroy_qp(qp_);
    for (auto& p : peers_)
      if (p->ah) x_.destroy_ah(p->ah);
    if (ibcq_) v_.destroy_cq(ibcq_);
    if (scratch_mr_) v_.dereg_mr(scratch_mr_);
    for (auto& r : regions_.snapshot())
      if (r.mr) v_.dereg_mr(r.mr);
    if (pd_) v_.dealloc_pd(pd_);
    if (sel_.ctx) v_.close_device(sel_.ctx);
  }

  int rank() const override { return rank_; }
  int world() const override { return world_; }
  ImmCounter& imm_counter() override { return imm_; }

  int register_memory(void* ptr, uint64_t len, uint32_t* key) override {
    if (ptr == nullptr && len > 0) return set_error(kErrInvalid, prefix() + "register: null pointer");
    Region r{static_cast<char*>(ptr), len, nullptr};
    if (len > 0) {
      r.mr = v_.reg_mr(pd_, ptr, size_t(len), ibv::ACCESS_LOCAL_WRITE | ibv::ACCESS_REMOTE_WRITE);
      if (!r.mr) return sys_error("ibv_reg_mr of " + std::to_string(len) + " bytes");
    }
    *key = regions_.add(r);
    return kOk;
  }

  // "efa1;rank=R;world=W;dev=NAME;gid=HEX32;qpn=Q;qkey=K;mr=ADDR:LEN:RKEY,..": one QP per engine.
  std::string endpoint() const override {
    std::ostringstream s;
    s << "efa1;rank=" << rank_ << ";world=" << world_ << ";dev=" << sel_.dev << ";gid=" << gid_hex(sel_.gid)
      << ";qpn=" << (qp_ ? qp_->qp_num : 0) << ";qkey=" << kQkey << ";mr=";
    const auto regs = regions_.snapshot();
    for (size_t i = 0; i < regs.size(); ++i)
      s << (i ? "," : "") << reinterpret_cast<uintptr_t>(regs[i].ptr) << ":" << regs[i].len << ":"
        << (regs[i].mr ? regs[i].mr->rkey : 0);
    return s.str();
  }

  int connect(const std::vector<std::string>& endpoints, int64_t timeout_ns) override {
    if (int rc = check_connect(rank_, world_, connected_, endpoints.size()); rc != kOk) return rc;
    const int64_t deadline = steady_now_ns() + timeout_ns;
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      if (int rc = parse(p, endpoints[p]); rc != kOk) return rc;
      ibv::ah_attr aa{};
      aa.is_global = 1;
      aa.grh.dgid = peers_[p]->gid;
      aa.grh.sgid_index = uint8_t(sel_.gid_index);
      aa.port_num = uint8_t(sel_.port);
      peers_[p]->ah = x_.create_ah(pd_, &aa);
      if (!peers_[p]->ah) return sys_error("ibv_create_ah for peer " + std::to_string(p));
      if (int rc = send_hello(p); rc != kOk) return rc;
    }
    // Every peer: own hello delivered (SRD is reliable: a successful send completion) and the
    // peer's hello received. A failed hello is sent again every 50 ms until the deadline.
    std::unique_lock<std::mutex> lk(conn_mu_);
    for (;;) {
      int waiting = -1;
      for (int p = 0; p < world_; ++p) {
        EfaPeer& pr = *peers_[p];
        if (p == rank_ || pr.up) continue;
        if (pr.lost) return set_error(kErrPeer, peer_error(p));
        const int hs = pr.hello_status.load();
        if (hs == ibv::WC_SUCCESS && pr.hello_recv) {
          pr.up = true;
          continue;
        }
        if (hs > 0) {
          lk.unlock();
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
          const int rc = send_hello(p);
          lk.lock();
          if (rc != kOk) return rc;
        }
        if (waiting < 0) waiting = p;
      }
      if (waiting < 0) break;
      const int64_t now = steady_now_ns();
      if (now >= deadline) {
        EfaPeer& pr = *peers_[waiting];
        const int hs = pr.hello_status.load();
        return set_error(kErrTimeout, prefix() + "connect: peer " + std::to_string(waiting) + " never connected within " +
                                          std::to_string(double(timeout_ns) / 1e9) + " s (" + where_ + "; own hello: " +
                                          (hs < 0 ? "not acknowledged yet" : hs == 0 ? "acknowledged" : v_.wc_status_str(hs)) +
                                          " (attempt " + std::to_string(pr.hello_attempt.load()) + "); the peer's hello: " +
                                          (pr.hello_recv ? "received" : "not received") + ")" + refused_note());
      }
      conn_cv_.wait_for(lk, std::chrono::nanoseconds(std::min<int64_t>(deadline - now, 20'000'000)));
    }
    connected_ = true;
    return kOk;
  }

  int post_write(int peer, uint32_t local_key, uint64_t local_off, uint32_t remote_key, uint64_t remote_off,
                 uint64_t len, bool has_imm, uint32_t imm, uint64_t* wr_id) override {
    Region r;
    if (int rc = check_post(rank_, world_, connected_, regions_, peer, local_key, local_off, len, &r); rc != kOk) return rc;
    const std::string pre = prefix() + "post_write to peer " + std::to_string(peer);
    if (sel_.efa.max_rdma_size > 0 && len > sel_.efa.max_rdma_size)
      return set_error(kErrInvalid, pre + ": " + std::to_string(len) + " bytes is more than one EFA RDMA write carries (" +
                                        std::to_string(sel_.efa.max_rdma_size) + ", " + sel_.dev + ")");
    EfaPeer& pr = *peers_[peer];
    const uint64_t wr = next_wr_++;
    *wr_id = wr;
    const int64_t n = pr.writes_posted++;
    if (cut_peer_.load() == peer && n >= cut_after_.load())
      lose_peer(peer, "connection cut by fault injection after " + std::to_string(n) + " writes");
    if (remote_key == 0 || remote_key > pr.mr.size() || remote_off > pr.mr[remote_key - 1].len ||
        len > pr.mr[remote_key - 1].len - remote_off) {
      cq_.push(wr, peer, pr.lost ? int32_t(kCqPeerLost) : int32_t(kCqRemoteAccess));
      return kOk;
    }
    const RemoteRegion& rr = pr.mr[remote_key - 1];
    // per_peer_ writes in flight to a peer at most: the peer's receive queue (shared by all its
    // peers) then never runs dry, and this engine's send queue never overflows.
    const int added = cq_.add(wr, peer, 1, pr.lost, per_peer_, steady_now_ns() + op_timeout_ns_.load());
    if (added == 0) return kOk;
    if (added < 0)
      return set_error(kErrTimeout, pre + ": " + std::to_string(per_peer_) + " writes still pending after the op timeout");
    int rc;
    {
      std::lock_guard<std::mutex> lk(post_mu_);  // the send-ops iterator is one WR at a time
      qpx_->wr_id = wr;
      qpx_->wr_flags = ibv::SEND_SIGNALED;
      qpx_->wr_start(qpx_);
      if (has_imm)
        qpx_->wr_rdma_write_imm(qpx_, rr.rkey, rr.addr + remote_off, htonl(imm));
      else
        qpx_->wr_rdma_write(qpx_, rr.rkey, rr.addr + remote_off);
      qpx_->wr_set_ud_addr(qpx_, pr.ah, pr.qpn, pr.qkey);
      if (len > 0)
        qpx_->wr_set_sge(qpx_, r.mr->lkey, reinterpret_cast<uint64_t>(r.ptr + local_off), uint32_t(len));
      else
        qpx_->wr_set_sge_list(qpx_, 0, nullptr);
      rc = qpx_->wr_complete(qpx_);
    }
    if (rc != 0) {
      cq_.remove(wr);
      const std::string why = "ibv_wr_complete failed: " + std::string(strerror(rc));
      lose_peer(peer, why);
      return set_error(kErrPeer, pre + " (" + where_ + "): " + why);
    }
    return kOk;
  }

  int poll(Completion* out, int max, int64_t timeout_ns) override {
    return cq_.poll(out, max, timeout_ns, [this] {
      cq_.expire(op_timeout_ns_.load(), [this](int p, const std::string& why) { lose_peer(p, why, kCqTimeout); });
    });
  }

  void set_fault(const FaultConfig& f) override {
    cut_after_ = f.cut_after;
    cut_peer_ = f.cut_peer;
  }
  void set_op_timeout(int64_t ns) override { op_timeout_ns_ = ns; }
  std::vector<std::string> refused(int64_t* total) const override { return refusals_.lines(total); }
  int64_t cpu_ns() override { return thread_cpu_ns(thr_); }

  std::string peer_error(int peer) override {
    if (peer < 0 || peer >= world_) return "";
    std::lock_guard<std::mutex> lk(peers_[peer]->mu);
    return peers_[peer]->err;
  }

  // The goodbye to every peer that is up and not gone, then a wait until each was delivered (SRD
  // acknowledges it) or its peer went.
  void say_goodbye(const Goodbye& g) override {
    if (bye_said_.exchange(true) || !connected_) return;
    const int64_t deadline = steady_now_ns() + kGoodbyeTimeoutNs;
    for (int p = 0; p < world_; ++p)
      if (p != rank_ && peers_[p]->up && !peer_gone(*peers_[p])) send_goodbye(p, g);
    std::unique_lock<std::mutex> lk(conn_mu_);
    auto out = [this] {
      for (auto& pr : peers_)
        if (pr->bye_status == -1 && !peer_gone(*pr)) return false;
      return true;
    };
    while (!out() && steady_now_ns() < deadline) conn_cv_.wait_for(lk, std::chrono::milliseconds(10));
  }

  bool peer_goodbye(int peer, Goodbye* out) override {
    if (peer < 0 || peer >= world_) return false;
    EfaPeer& pr = *peers_[peer];
    std::lock_guard<std::mutex> lk(pr.mu);
    if (pr.said_bye) *out = pr.bye;
    return pr.said_bye;
  }

 private:
  std::string prefix() const { return "rank " + std::to_string(rank_) + ": "; }
  int sys_error(const std::string& what) {
    return set_error(kErrSystem, prefix() + where_ + ": " + what + " failed: " + strerror(errno));
  }

  int modify(ibv::qp_attr& a, int mask, const char* what) {
    if (int rc = v_.modify_qp(qp_, &a, mask); rc != 0)
      return set_error(kErrSystem, prefix() + where_ + ": ibv_modify_qp to " + what + " failed: " + strerror(rc > 0 ? rc : errno));
    return kOk;
  }

  int parse(int p, const std::string& ep) {
    const std::string bad = prefix() + "connect: bad efa endpoint of peer " + std::to_string(p) + " '" + ep + "'";
    std::map<std::string, std::string> kv;
    std::istringstream is(ep);
    std::string f;
    bool first = true;
    while (std::getline(is, f, ';')) {
      if (first && f != "efa1") return set_error(kErrInvalid, bad + " (not an efa1 endpoint)");
      const auto eq = f.find('=');
      if (!first && eq != std::string::npos) kv[f.substr(0, eq)] = f.substr(eq + 1);
      first = false;
    }
    EfaPeer& pr = *peers_[p];
    try {
      pr.rank = std::stoi(kv.at("rank"));
      pr.world = std::stoi(kv.at("world"));
      pr.qpn = uint32_t(std::stoul(kv.at("qpn")));
      pr.qkey = uint32_t(std::stoul(kv.at("qkey")));
      std::istringstream ms(kv.at("mr"));
      std::string m;
      while (std::getline(ms, m, ',')) {
        RemoteRegion rr;
        if (std::sscanf(m.c_str(), "%" SCNu64 ":%" SCNu64 ":%" SCNu32, &rr.addr, &rr.len, &rr.rkey) != 3)
          return set_error(kErrInvalid, bad + " (bad mr entry)");
        pr.mr.push_back(rr);
      }
      if (!gid_from_hex(kv.at("gid"), &pr.gid)) return set_error(kErrInvalid, bad + " (bad gid)");
    } catch (const std::exception&) {
      return set_error(kErrInvalid, bad + " (a field is missing or not a number)");
    }
    if (pr.rank != p || pr.world != world_ || pr.qpn == 0)
      return set_error(kErrInvalid, bad + " (rank/world/qpn do not match: expected rank " + std::to_string(p) +
                                        " of world " + std::to_string(world_) + ")");
    return kOk;
  }

  char* hello_slot(int p) { return scratch_.data() + (size_t(rq_depth_) + size_t(p)) * kSlot; }
  char* bye_slot(int p) { return scratch_.data() + (size_t(rq_depth_) + size_t(world_) + size_t(p)) * kSlot; }

  // Receives: each one a hello (a SEND of the sender's WireHello, its rank also as immediate) or,
  // unless the QP takes writes with immediates unsolicited, a write with an immediate. Each has
  // its own slot of the scratch buffer as its one SGE (where a hello lands).
  bool post_recv(uint64_t slot) {
    ibv::sge sg{reinterpret_cast<uint64_t>(scratch_.data() + slot * kSlot), uint32_t(kSlot), scratch_mr_->lkey};
    ibv::recv_wr w{};
    w.wr_id = kRecvTag | slot;
    w.sg_list = &sg;
    w.num_sge = 1;
    ibv::recv_wr* bad = nullptr;
    return qp_->ctx->ops.post_recv(qp_, &w, &bad) == 0;
  }

  // A hello: a SEND of this rank's WireHello for peer p (the job identity, this rank, the peer),
  // carrying this rank as its immediate too.
  int send_hello(int p) {
    EfaPeer& pr = *peers_[p];
    const uint32_t attempt = ++pr.hello_attempt;
    pr.hello_status = -1;
    int rc;
    {
      std::lock_guard<std::mutex> lk(post_mu_);
      qpx_->wr_id = kHelloTag | (uint64_t(attempt) << 20) | uint64_t(p);
      qpx_->wr_flags = ibv::SEND_SIGNALED;
      qpx_->wr_start(qpx_);
      qpx_->wr_send_imm(qpx_, htonl(uint32_t(rank_)));
      qpx_->wr_set_ud_addr(qpx_, pr.ah, pr.qpn, pr.qkey);
      qpx_->wr_set_sge(qpx_, scratch_mr_->lkey, reinterpret_cast<uint64_t>(hello_slot(p)), uint32_t(sizeof(WireHello)));
      rc = qpx_->wr_complete(qpx_);
    }
    if (rc != 0)
      return set_error(kErrSystem, prefix() + "connect: peer " + std::to_string(p) + " (" + where_ +
                                       "): posting the hello failed: " + strerror(rc));
    return kOk;
  }

  // The goodbye to peer p: a SEND of a WireGoodbye, this rank also as its immediate (as a hello).
  void send_goodbye(int p, const Goodbye& g) {
    EfaPeer& pr = *peers_[p];
    const WireGoodbye w = make_goodbye(id_, rank_, p, world_, g);
    std::memcpy(bye_slot(p), &w, sizeof(w));
    pr.bye_status = -1;
    std::lock_guard<std::mutex> lk(post_mu_);
    qpx_->wr_id = kByeTag | uint64_t(p);
    qpx_->wr_flags = ibv::SEND_SIGNALED;
    qpx_->wr_start(qpx_);
    qpx_->wr_send_imm(qpx_, htonl(uint32_t(rank_)));
    qpx_->wr_set_ud_addr(qpx_, pr.ah, pr.qpn, pr.qkey);
    qpx_->wr_set_sge(qpx_, scratch_mr_->lkey, reinterpret_cast<uint64_t>(bye_slot(p)), uint32_t(sizeof(w)));
    if (qpx_->wr_complete(qpx_) != 0) pr.bye_status = -2;  // not sent: nothing to wait for
  }

  // A goodbye landed in receive slot `slot`. SRD has no connection to vouch for its sender, so it
  // is checked as a hello is (the job identity, this rank, its immediate naming the rank it says)
  // and taken only from a rank whose hello passed. After an error that peer is lost at once, by
  // what it said; a clean one is remembered for the loss that follows, noticed as any loss is.
  // Anything else is refused with one line, and no peer is touched.
  void on_goodbye(const ibv::wc& w, uint64_t slot) {
    WireGoodbye g{};
    std::memcpy(&g, scratch_.data() + slot * kSlot, std::min<size_t>(w.byte_len, sizeof(g)));
    const int src = g.src_rank;
    std::string why = src < 0 || src >= world_ || src == rank_
                          ? "a goodbye saying rank " + std::to_string(src) + " (not a peer)"
                          : goodbye_mismatch(g, w.byte_len, src, rank_, world_, id_);
    if (why.empty() && (!(w.wc_flags & ibv::WC_WITH_IMM) || int(ntohl(w.imm_data)) != src))
      why = "its immediate does not name rank " + std::to_string(src);
    if (why.empty() && !peers_[size_t(src)]->hello_recv) why = "no hello of rank " + std::to_string(src) + " passed";
    if (!why.empty()) {
      refusals_.record(prefix() + "refused a goodbye from QP " + std::to_string(w.src_qp) + " (" + where_ + "): " + why);
      return;
    }
    std::string text;
    const Goodbye bye = trusted_goodbye(g, world_, &text);
    if (!bye.error) return remember_goodbye(*peers_[size_t(src)], bye, text);
    lose_peer(src, text, kCqPeerLost, &bye);
  }

  // The peer is lost (first reason wins): its pending and later writes complete with `status`,
  // the ImmCounter fails. The QP serves the other peers and stays up. `bye`: lost by its goodbye.
  void lose_peer(int p, const std::string& why, int32_t status = kCqPeerLost, const Goodbye* bye = nullptr) {
    EfaPeer& pr = *peers_[p];
    std::string msg = prefix() + "connection with peer " + std::to_string(p) + " lost (" + where_ + ", QP " +
                      std::to_string(qp_ ? qp_->qp_num : 0) + " -> " + std::to_string(pr.qpn) + "): " + why;
    {
      std::lock_guard<std::mutex> lk(pr.mu);
      if (pr.lost) return;
      if (bye) pr.bye = *bye, pr.said_bye = true;
      else if (pr.said_bye) msg += "; its goodbye said: " + pr.bye_text;
      pr.err = msg;
      pr.lost = true;
    }
    cq_.fail_peer(p, status);
    conn_cv_.notify_all();
    imm_.fail(msg);
  }

  // The completion thread: polls the CQ, sleeping 50 us at a time once idle for 20 us (EFA CQs
  // need not support completion events).
  void cq_loop() {
    ibv::wc wc[32];
    int64_t idle_since = steady_now_ns();
    while (!stop_) {
      const int n = ibcq_->ctx->ops.poll_cq(ibcq_, 32, wc);
      if (n > 0) {
        for (int i = 0; i < n; ++i) handle(wc[i]);
        idle_since = steady_now_ns();
      } else if (n < 0) {
        for (int p = 0; p < world_; ++p)
          if (p != rank_) lose_peer(p, "ibv_poll_cq failed");
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      } else if (steady_now_ns() - idle_since > 20'000) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  std::string wc_error(const ibv::wc& w) const {
    char tail[64];
    std::snprintf(tail, sizeof(tail), " (wc status %d, vendor error 0x%x)", w.status, w.vendor_err);
    return v_.wc_status_str(w.status) + std::string(tail);
  }

  void handle(const ibv::wc& w) {
    // A write with an immediate (opcode valid on success only): counted; it consumed a receive
    // unless the QP takes them unsolicited (its wr_id is then not ours).
    const uint64_t slot = w.wr_id & 0xFFFFF;
    if (w.status == ibv::WC_SUCCESS && w.opcode == ibv::WC_RECV_RDMA_WITH_IMM) {
      imm_.add(ntohl(w.imm_data), 1);
      if (!unsolicited_ && !post_recv(slot)) fail_all("re-posting a receive failed");
      return;
    }
    if (w.wr_id & kRecvTag) {
      if (w.status != ibv::WC_SUCCESS) {
        if (!stop_ && w.status != ibv::WC_WR_FLUSH_ERR) fail_all("receive failed: " + wc_error(w));
        return;
      }
      uint32_t magic = 0;
      std::memcpy(&magic, scratch_.data() + slot * kSlot, sizeof(magic));
      if (w.opcode == ibv::WC_RECV && magic == kMagicGoodbye && w.byte_len >= sizeof(magic))
        on_goodbye(w, slot);
      else if (w.opcode == ibv::WC_RECV)
        on_hello(w, slot);
      if (!post_recv(slot)) fail_all("re-posting a receive failed");
      return;
    }
    if (w.wr_id & kByeTag) {
      const int p = int(w.wr_id & 0xFFFFF);
      if (p < 0 || p >= world_) return;
      {
        std::lock_guard<std::mutex> lk(conn_mu_);
        peers_[p]->bye_status = w.status;
      }
      conn_cv_.notify_all();
      return;
    }
    if (w.wr_id & kHelloTag) {
      const int p = int(w.wr_id & 0xFFFFF);
      if (p < 0 || p >= world_ || uint32_t((w.wr_id >> 20) & 0xFFFFFFFFu) != peers_[p]->hello_attempt.load()) return;
      {
        std::lock_guard<std::mutex> lk(conn_mu_);
        peers_[p]->hello_status = w.status;
      }
      conn_cv_.notify_all();
      return;
    }
    if (w.status == ibv::WC_SUCCESS) {
      bool completed = false;
      if (cq_.finish(w.wr_id, kCqOk, &completed) >= 0) cq_.notify();
      return;
    }
    const int peer = cq_.peer_of(w.wr_id);
    if (peer < 0) return;
    lose_peer(peer, "write " + std::to_string(w.wr_id) + " failed: " + wc_error(w),
              w.status == ibv::WC_REM_ACCESS_ERR ? kCqRemoteAccess : kCqPeerLost);
  }

  // A hello landed in receive slot `slot`: the peer it names is connected when it is a hello of
  // this job for this rank (and its immediate names the same rank); else it is refused, with one
  // line naming the sending queue pair and what was wrong (any process that knows this QP's
  // number and Q_Key can send to it: SRD has no connection).
  void on_hello(const ibv::wc& w, uint64_t slot) {
    WireHello h{};
    std::memcpy(&h, scratch_.data() + slot * kSlot, std::min<size_t>(w.byte_len, sizeof(h)));
    std::string why = hello_mismatch(h, w.byte_len, rank_, world_, id_);
    if (why.empty() && (!(w.wc_flags & ibv::WC_WITH_IMM) || int(ntohl(w.imm_data)) != h.src_rank))
      why = "its immediate does not name rank " + std::to_string(h.src_rank);
    if (!why.empty()) {
      refusals_.record(prefix() + "refused a hello from QP " + std::to_string(w.src_qp) + " (" + where_ + "): " + why);
      std::lock_guard<std::mutex> lk(conn_mu_);
      last_refused_ = why;
      return;
    }
    {
      std::lock_guard<std::mutex> lk(conn_mu_);
      peers_[size_t(h.src_rank)]->hello_recv = true;
    }
    conn_cv_.notify_all();
  }

  // For connect's timeout: the last hello refused, if any (under conn_mu_).
  std::string refused_note() const {
    return last_refused_.empty() ? "" : "; a hello was refused: " + last_refused_;
  }

  // A failure no single peer can be blamed for (the shared receive queue): every peer is lost.
  void fail_all(const std::string& why) {
    for (int p = 0; p < world_; ++p)
      if (p != rank_) lose_peer(p, why);
  }

  const int rank_, world_;
  const ibv::Api& v_;
  const RdmaExtra& x_;
  EfaSelection sel_;
  std::string where_;
  bool unsolicited_ = false;
  int sq_depth_ = 16, rq_depth_ = 16, per_peer_ = 1;
  ibv::pd* pd_ = nullptr;
  ibv::cq* ibcq_ = nullptr;
  ibv::qp* qp_ = nullptr;
  ibv::qp_ex* qpx_ = nullptr;
  const JobIdentity id_;
  RefusalLog refusals_;
  std::string last_refused_;  // under conn_mu_
  std::vector<char> scratch_;  // kSlot bytes per receive, then per peer (hello_slot)
  ibv::mr* scratch_mr_ = nullptr;
  std::mutex post_mu_;
  std::vector<std::unique_ptr<EfaPeer>> peers_;
  RegionTable<Region> regions_;
  ImmCounter imm_;
  CompletionQueue cq_;
  std::mutex conn_mu_;
  std::condition_variable conn_cv_;
  std::atomic<uint64_t> next_wr_{1};
  std::atomic<int> cut_peer_{-1};
  std::atomic<int64_t> cut_after_{0};
  std::atomic<int64_t> op_timeout_ns_{30'000'000'000LL};
  std::atomic<bool> stop_{false};
  std::atomic<bool> connected_{false};
  std::atomic<bool> bye_said_{false};
  std::thread thr_;
};

// Both libraries, or null with *why.
const RdmaExtra* load_efa(const ibv::Api** v, std::string* why) {
  *v = ibv::load_verbs(why);
  if (!*v) return nullptr;
  const RdmaExtra* x = load_rdma_extra(why);
  if (x && !x->efadv_query_device) {
    *why = x->efa_why;
    return nullptr;
  }
  return x;
}

}  // namespace

Transport* create_efa_transport(int rank, int world, const std::string& device, const JobIdentity& id) {
  if (bad_rank(rank, world)) return nullptr;
  const std::string pre = "rank " + std::to_string(rank) + ": ";
  if (world > (1 << 20)) return set_error(kErrInvalid, pre + "efa: world size too large"), nullptr;
  const ibv::Api* v = nullptr;
  std::string why;
  const RdmaExtra* x = load_efa(&v, &why);
  if (!x) return set_error(kErrInvalid, pre + "efa transport not available: " + why), nullptr;
  auto* t = new EfaTransport(rank, world, *v, *x, id);
  if (t->start(device) != kOk) {
    const std::string msg = thread_error();
    delete t;
    thread_error() = msg;
    return nullptr;
  }
  return t;
}

bool efa_probe(const std::string& device, std::string* what) {
  const ibv::Api* v = nullptr;
  const RdmaExtra* x = load_efa(&v, what);
  if (!x) return false;
  EfaSelection s;
  std::string why;
  if (!select_efa(*v, *x, device, &s, &why)) {
    *what = why;
    return false;
  }
  *what = "device " + s.dev + " port " + std::to_string(s.port) + " GID index " + std::to_string(s.gid_index) +
          " (SRD; " + efa_caps_names(s.efa.device_caps) + "; max RDMA size " + std::to_string(s.efa.max_rdma_size) + ")";
  v->close_device(s.ctx);
  return true;
}

}  // namespace moe_ep
