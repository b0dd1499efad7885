// verbs transport: libibverbs RC queue pairs, one per peer, RDMA_WRITE_WITH_IMM (RDMA_WRITE
// without an immediate); libibverbs is opened at run time (verbs_abi.h), so nothing here needs
// rdma-core to build. Endpoint format, QP setup, hello handshake, immediates and errors:
// docs/ARCHITECTURE.md §9, "verbs transport".
#include <arpa/inet.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <deque>
#include <fstream>
#include <memory>
#include <mutex>
#include <random>
#include <shared_mutex>
#include <sstream>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "transport.h"
#include "rdma_probe.h"
#include "transport_common.h"
#include "verbs_abi.h"

namespace moe_ep {

namespace ibv {
const Api* load_verbs(std::string* why) {
  static std::mutex mu;
  static Api api;
  static int state = 0;  // 0 not tried, 1 loaded, -1 failed
  static std::string err;
  std::lock_guard<std::mutex> lk(mu);
  if (state == 0) {
    const char* env = std::getenv("MOE_EP_IBVERBS_LIB");
    const std::string name = env && *env ? env : "libibverbs.so.1";
    void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      err = "cannot load " + name + " (rdma-core's libibverbs is not installed?): " + (e ? e : "dlopen failed");
      state = -1;
    } else {
      state = 1;
      auto sym = [&](auto& fn, const char* s) {
        if (state != 1) return;
        void* p = dlsym(h, s);
        if (!p) {
          err = name + " has no symbol " + s;
          state = -1;
        }
        fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
      };
      sym(api.get_device_list, "ibv_get_device_list");
      sym(api.free_device_list, "ibv_free_device_list");
      sym(api.get_device_name, "ibv_get_device_name");
      sym(api.open_device, "ibv_open_device");
      sym(api.close_device, "ibv_close_device");
      sym(api.query_port, "ibv_query_port");
      sym(api.query_gid, "ibv_query_gid");
      sym(api.alloc_pd, "ibv_alloc_pd");
      sym(api.dealloc_pd, "ibv_dealloc_pd");
      sym(api.reg_mr, "ibv_reg_mr");
      sym(api.dereg_mr, "ibv_dereg_mr");
      sym(api.create_comp_channel, "ibv_create_comp_channel");
      sym(api.destroy_comp_channel, "ibv_destroy_comp_channel");
      sym(api.create_cq, "ibv_create_cq");
      sym(api.destroy_cq, "ibv_destroy_cq");
      sym(api.get_cq_event, "ibv_get_cq_event");
      sym(api.ack_cq_events, "ibv_ack_cq_events");
      sym(api.create_qp, "ibv_create_qp");
      sym(api.modify_qp, "ibv_modify_qp");
      sym(api.destroy_qp, "ibv_destroy_qp");
      sym(api.wc_status_str, "ibv_wc_status_str");
    }
  }
  if (state != 1) {
    if (why) *why = err;
    return nullptr;
  }
  return &api;
}
}  // namespace ibv

namespace {

int64_t now_ns() { return steady_now_ns(); }

int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  return (end && *end == 0) ? int(x) : dflt;
}

std::string hex(const uint8_t* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) s += d[p[i] >> 4], s += d[p[i] & 15];
  return s;
}

bool unhex(const std::string& s, uint8_t* out, size_t n) {
  if (s.size() != 2 * n) return false;
  auto nib = [](char c) { return std::isdigit(c) ? c - '0' : std::isxdigit(c) ? std::tolower(c) - 'a' + 10 : -1; };
  for (size_t i = 0; i < n; ++i) {
    const int hi = nib(s[2 * i]), lo = nib(s[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    out[i] = uint8_t(hi * 16 + lo);
  }
  return true;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream is(s);
  while (std::getline(is, cur, sep)) out.push_back(cur);
  return out;
}

std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

bool gid_zero(const ibv::gid& g) {
  for (uint8_t b : g.raw)
    if (b) return false;
  return true;
}

bool gid_ipv4_mapped(const ibv::gid& g) {
  for (int i = 0; i < 10; ++i)
    if (g.raw[i]) return false;
  return g.raw[10] == 0xff && g.raw[11] == 0xff;
}

// A device, port and GID chosen by the rules of §9 (env overrides, else the first device with
// an active port; GID: MOE_EP_IB_GID_INDEX, else the first RoCE v2 IPv4-mapped one).
struct Selection {
  ibv::context* ctx = nullptr;
  std::string dev;
  int port = 1;
  int gid_index = 0;
  ibv::gid gid{};
  ibv::port_attr attr{};
};

std::string gid_type(const std::string& dev, int port, int idx) {
  return read_line("/sys/class/infiniband/" + dev + "/ports/" + std::to_string(port) + "/gid_attrs/types/" +
                   std::to_string(idx));
}

// An EFA device (its PCI function bound to the efa driver): the verbs transport's default
// choice skips it (EFA has no RC queue pairs); naming it explicitly still tries it.
bool is_efa_device(const std::string& dev) {
  char buf[4096];
  const std::string link = "/sys/class/infiniband/" + dev + "/device/driver";
  const ssize_t n = readlink(link.c_str(), buf, sizeof(buf) - 1);
  if (n <= 0) return false;
  const std::string target(buf, size_t(n));
  return target.size() >= 4 && target.compare(target.size() - 4, 4, "/efa") == 0;
}

// Opens the device; on failure returns false with *why naming what is missing.
bool select_device(const ibv::Api& v, const std::string& want_dev, int want_port, int want_gid, Selection* out,
                   std::string* why) {
  int n = 0;
  ibv::device** list = v.get_device_list(&n);
  if (!list || n <= 0) {
    if (list) v.free_device_list(list);
    *why = "no RDMA device found (libibverbs lists none; is a NIC driver or rdma_rxe loaded?)";
    return false;
  }
  const char* env_dev = std::getenv("MOE_EP_IB_DEVICE");
  const std::string dev = !want_dev.empty() ? want_dev : (env_dev ? env_dev : "");
  const int port = want_port > 0 ? want_port : env_int("MOE_EP_IB_PORT", 1);
  std::string names, reasons;
  bool ok = false;
  for (int i = 0; i < n && !ok; ++i) {
    const std::string name = v.get_device_name(list[i]);
    names += (names.empty() ? "" : ", ") + name;
    if (!dev.empty() && name != dev) continue;
    if (dev.empty() && is_efa_device(name)) {  // RC does not run on EFA: that is the efa transport's
      reasons += "; " + name + " is an EFA device (MOE_EP_TRANSPORT=efa)";
      continue;
    }
    ibv::context* ctx = v.open_device(list[i]);
    if (!ctx) {
      reasons += "; " + name + ": ibv_open_device failed: " + strerror(errno);
      continue;
    }
    ibv::port_attr pa{};
    if (int rc = v.query_port(ctx, uint8_t(port), &pa); rc != 0) {
      reasons += "; " + name + ": ibv_query_port(" + std::to_string(port) + ") failed: " + strerror(rc > 0 ? rc : errno);
      v.close_device(ctx);
      continue;
    }
    if (pa.state != ibv::PORT_ACTIVE) {
      reasons += "; " + name + " port " + std::to_string(port) + " is not active (state " + std::to_string(pa.state) + ")";
      v.close_device(ctx);
      continue;
    }
    int gidx = want_gid >= 0 ? want_gid : env_int("MOE_EP_IB_GID_INDEX", -1);
    ibv::gid g{};
    if (gidx < 0) {
      int first_v2 = -1;
      for (int k = 0; k < pa.gid_tbl_len && gidx < 0; ++k) {
        ibv::gid t{};
        if (v.query_gid(ctx, uint8_t(port), k, &t) != 0 || gid_zero(t)) continue;
        const std::string type = gid_type(name, port, k);
        const bool v2 = type.find("v2") != std::string::npos;
        if (pa.link_layer != ibv::LINK_LAYER_ETHERNET) {
          gidx = k;  // InfiniBand: the first valid GID (index 0); routing is by LID
        } else if (gid_ipv4_mapped(t) && (v2 || type.empty())) {
          gidx = k;
        } else if (v2 && first_v2 < 0) {
          first_v2 = k;
        }
      }
      if (gidx < 0) gidx = first_v2;
      if (gidx < 0) {
        reasons += "; " + name + " port " + std::to_string(port) + " has no usable GID (set MOE_EP_IB_GID_INDEX)";
        v.close_device(ctx);
        continue;
      }
    }
    if (v.query_gid(ctx, uint8_t(port), gidx, &g) != 0 || (pa.link_layer == ibv::LINK_LAYER_ETHERNET && gid_zero(g))) {
      reasons += "; " + name + " port " + std::to_string(port) + ": GID index " + std::to_string(gidx) + " is not valid";
      v.close_device(ctx);
      continue;
    }
    out->ctx = ctx;
    out->dev = name;
    out->port = port;
    out->gid_index = gidx;
    out->gid = g;
    out->attr = pa;
    ok = true;
  }
  v.free_device_list(list);
  if (!ok) {
    if (!dev.empty() && names.find(dev) == std::string::npos)
      *why = "RDMA device '" + dev + "' (MOE_EP_IB_DEVICE) not found; devices: " + names;
    else
      *why = "no usable RDMA device (devices: " + names + ")" + reasons;
  }
  return ok;
}

constexpr uint64_t kRecvTag = 1ull << 62;   // receive wr_id: kRecvTag | peer
constexpr uint64_t kHelloTag = 1ull << 61;  // hello send wr_id: kHelloTag | attempt << 20 | peer
constexpr uint32_t kPsnMask = 0xFFFFFF;

struct Region {
  char* ptr = nullptr;
  uint64_t len = 0;
  ibv::mr* mr = nullptr;
};

struct RemoteRegion {
  uint64_t addr = 0, len = 0;
  uint32_t rkey = 0;
};

struct Remote {
  int rank = -1, world = 0, port = 1, mtu = 0;
  uint16_t lid = 0;
  ibv::gid gid{};
  uint32_t psn = 0;
  std::vector<uint32_t> qpn;
  std::vector<RemoteRegion> mr;
};

struct Peer {
  ibv::qp* qp = nullptr;
  Remote remote;
  std::atomic<bool> lost{false};
  std::atomic<bool> up{false};          // connect finished for this peer
  std::atomic<bool> hello_recv{false};  // the peer's hello landed
  std::atomic<int> hello_status{-1};    // own hello: -1 pending, else its wc status
  std::atomic<uint32_t> hello_attempt{0};
  std::atomic<int64_t> writes_posted{0};
  std::mutex mu;        // guards err
  std::string err;
};

class VerbsTransport final : public Transport {
 public:
  VerbsTransport(int rank, int world, const ibv::Api& v) : rank_(rank), world_(world), v_(v) {
    for (int p = 0; p < world; ++p) peers_.emplace_back(new Peer);
  }

  int start(const std::string& dev, int port, int gid_index) {
    std::string why;
    if (!select_device(v_, dev, port, gid_index, &sel_, &why)) return set_error(kErrInvalid, prefix() + "verbs: " + why);
    where_ = "verbs device " + sel_.dev + " port " + std::to_string(sel_.port) + " GID index " +
             std::to_string(sel_.gid_index);
    pd_ = v_.alloc_pd(sel_.ctx);
    if (!pd_) return set_error(kErrSystem, prefix() + where_ + ": ibv_alloc_pd failed: " + strerror(errno));
    ch_ = v_.create_comp_channel(sel_.ctx);
    if (!ch_) return set_error(kErrSystem, prefix() + where_ + ": ibv_create_comp_channel failed: " + strerror(errno));
    fcntl(ch_->fd, F_SETFL, fcntl(ch_->fd, F_GETFL) | O_NONBLOCK);
    const int peers = std::max(world_ - 1, 1);
    depth_ = std::max(16, std::min(512, 16384 / peers));
    ibcq_ = v_.create_cq(sel_.ctx, 2 * depth_ * peers + 16, nullptr, ch_, 0);
    if (!ibcq_) return set_error(kErrSystem, prefix() + where_ + ": ibv_create_cq failed: " + strerror(errno));
    std::mt19937 rng{std::random_device{}()};
    psn_ = rng() & kPsnMask;
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      ibv::qp_init_attr ia{};
      ia.send_cq = ibcq_;
      ia.recv_cq = ibcq_;
      ia.cap.max_send_wr = uint32_t(depth_);
      ia.cap.max_recv_wr = uint32_t(depth_);
      ia.cap.max_send_sge = 1;
      ia.cap.max_recv_sge = 1;
      ia.qp_type = ibv::QPT_RC;
      peers_[p]->qp = v_.create_qp(pd_, &ia);
      if (!peers_[p]->qp)
        return set_error(kErrSystem, prefix() + where_ + ": ibv_create_qp for peer " + std::to_string(p) +
                                         " failed: " + strerror(errno));
      if (int rc = to_init(p); rc != kOk) return rc;
    }
    try {
      thr_ = std::thread([this] { cq_loop(); });
    } catch (const std::exception& e) {
      return set_error(kErrSystem, prefix() + "verbs completion thread: " + e.what());
    }
    return kOk;
  }

  ~VerbsTransport() override {
    stop_ = true;
    if (thr_.joinable()) thr_.join();
    for (auto& pr : peers_)
      if (pr->qp) v_.destroy_qp(pr->qp);
    if (ibcq_) {
      if (events_unacked_) v_.ack_cq_events(ibcq_, events_unacked_);
      v_.destroy_cq(ibcq_);
    }
    if (ch_) v_.destroy_comp_channel(ch_);
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
      r.mr = v_.reg_mr(pd_, ptr, size_t(len), ibv::ACCESS_LOCAL_WRITE | ibv::ACCESS_REMOTE_WRITE | ibv::ACCESS_REMOTE_READ);
      if (!r.mr)
        return set_error(kErrSystem, prefix() + where_ + ": ibv_reg_mr of " + std::to_string(len) +
                                         " bytes failed: " + strerror(errno) + " (locked-memory limit? ulimit -l)");
    }
    *key = regions_.add(r);
    return kOk;
  }

  // "verbs1;rank=R;world=W;dev=NAME;port=N;lid=L;gid=HEX32;mtu=M;psn=P;qpn=Q0,Q1,..;mr=ADDR:LEN:RKEY,.."
  // (numbers decimal; qpn has one entry per rank, 0 for its own; mr lists the regions registered
  // so far, in key order).
  std::string endpoint() const override {
    std::ostringstream s;
    s << "verbs1;rank=" << rank_ << ";world=" << world_ << ";dev=" << sel_.dev << ";port=" << sel_.port
      << ";lid=" << sel_.attr.lid << ";gid=" << hex(sel_.gid.raw, 16) << ";mtu=" << sel_.attr.active_mtu
      << ";psn=" << psn_ << ";qpn=";
    for (int p = 0; p < world_; ++p) s << (p ? "," : "") << (peers_[p]->qp ? peers_[p]->qp->qp_num : 0);
    s << ";mr=";
    const auto regs = regions_.snapshot();
    for (size_t i = 0; i < regs.size(); ++i)
      s << (i ? "," : "") << reinterpret_cast<uintptr_t>(regs[i].ptr) << ":" << regs[i].len << ":"
        << (regs[i].mr ? regs[i].mr->rkey : 0);
    return s.str();
  }

  int connect(const std::vector<std::string>& endpoints, int64_t timeout_ns) override {
    if (int rc = check_connect(rank_, world_, connected_, endpoints.size()); rc != kOk) return rc;
    const int64_t deadline = now_ns() + timeout_ns;
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      if (int rc = parse(p, endpoints[p], &peers_[p]->remote); rc != kOk) return rc;
    }
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      if (int rc = to_rts(p, false); rc != kOk) return rc;
      if (int rc = send_hello(p); rc != kOk) return rc;
    }
    // Every peer: own hello acknowledged and the peer's hello received. A hello that fails
    // (the peer's QP not yet ready to receive: retries exhausted) resets the QP and tries again.
    std::unique_lock<std::mutex> lk(conn_mu_);
    for (;;) {
      int waiting = -1;
      for (int p = 0; p < world_; ++p) {
        if (p == rank_ || peers_[p]->up) continue;
        Peer& pr = *peers_[p];
        if (pr.lost) return set_error(kErrPeer, peer_error(p));
        const int hs = pr.hello_status.load();
        if (hs == ibv::WC_SUCCESS && pr.hello_recv) {
          pr.up = true;
          continue;
        }
        if (hs > 0) {  // failed: bring the QP up again (receives re-posted) and resend
          lk.unlock();
          int rc = to_reset(p);
          if (rc == kOk) rc = to_init(p);
          if (rc == kOk) rc = to_rts(p, pr.hello_recv);
          if (rc == kOk) rc = send_hello(p);
          lk.lock();
          if (rc != kOk) return rc;
        }
        if (waiting < 0) waiting = p;
      }
      if (waiting < 0) break;
      const int64_t now = now_ns();
      if (now >= deadline) {
        Peer& pr = *peers_[waiting];
        const int hs = pr.hello_status.load();
        return set_error(kErrTimeout,
                         prefix() + "connect: peer " + std::to_string(waiting) + " never connected within " +
                             std::to_string(double(timeout_ns) / 1e9) + " s (" + where_ + "; own hello: " +
                             (hs < 0 ? "not acknowledged yet" : hs == 0 ? "acknowledged" : v_.wc_status_str(hs)) +
                             " (attempt " + std::to_string(pr.hello_attempt.load()) + "); the peer's hello: " + (pr.hello_recv ? "received" : "not received") + ")");
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
    if (len > 0xFFFFFFFFull)
      return set_error(kErrInvalid, prefix() + "post_write to peer " + std::to_string(peer) + ": " +
                                        std::to_string(len) + " bytes is more than one verbs write carries (4 GiB)");
    Peer& pr = *peers_[peer];
    const uint64_t wr = next_wr_++;
    *wr_id = wr;
    const int64_t n = pr.writes_posted++;
    if (cut_peer_.load() == peer && n >= cut_after_.load())
      lose_peer(peer, "connection cut by fault injection after " + std::to_string(n) + " writes");
    // The peer's advertised regions: a bad key or range fails the write here, as a remote access
    // error, instead of sending it (a real one would break the queue pair).
    const auto& mrs = pr.remote.mr;
    if (remote_key == 0 || remote_key > mrs.size() || remote_off > mrs[remote_key - 1].len ||
        len > mrs[remote_key - 1].len - remote_off)
      return complete_now(wr, peer, kCqRemoteAccess);
    const RemoteRegion& rr = mrs[remote_key - 1];
    // A full send queue (depth_ writes pending to this peer) waits for completions, up to the op timeout.
    const int added = cq_.add(wr, peer, 1, pr.lost, depth_, now_ns() + op_timeout_ns_.load());
    if (added == 0) return kOk;  // lost: completed as such
    if (added < 0)
      return set_error(kErrTimeout, prefix() + "post_write to peer " + std::to_string(peer) + ": send queue (" +
                                        std::to_string(depth_) + " writes) still full after the op timeout");
    ibv::sge sg{reinterpret_cast<uint64_t>(r.ptr + local_off), uint32_t(len), r.mr ? r.mr->lkey : 0};
    ibv::send_wr w{};
    w.wr_id = wr;
    w.sg_list = &sg;
    w.num_sge = len > 0 ? 1 : 0;
    w.opcode = has_imm ? ibv::WR_RDMA_WRITE_WITH_IMM : ibv::WR_RDMA_WRITE;
    w.send_flags = ibv::SEND_SIGNALED;
    w.imm_data = htonl(imm);
    w.wr.rdma.remote_addr = rr.addr + remote_off;
    w.wr.rdma.rkey = rr.rkey;
    ibv::send_wr* bad = nullptr;
    if (int rc = post_send(peer, &w, &bad); rc != 0) {
      cq_.remove(wr);
      const std::string why = "ibv_post_send failed: " + std::string(strerror(rc));
      lose_peer(peer, why);
      return set_error(kErrPeer, prefix() + "post_write to peer " + std::to_string(peer) + " (" + where_ + "): " + why);
    }
    return kOk;
  }

  int poll(Completion* out, int max, int64_t timeout_ns) override {
    return cq_.poll(out, max, timeout_ns, [this] { check_op_timeouts(); });
  }

  // Only the cut is implemented; delay and reorder have no meaning on a NIC's queue pair.
  void set_fault(const FaultConfig& f) override {
    cut_after_ = f.cut_after;
    cut_peer_ = f.cut_peer;
  }
  void set_op_timeout(int64_t ns) override { op_timeout_ns_ = ns; }

  int64_t cpu_ns() override { return thread_cpu_ns(thr_); }

  std::string peer_error(int peer) override {
    if (peer < 0 || peer >= world_) return "";
    std::lock_guard<std::mutex> lk(peers_[peer]->mu);
    return peers_[peer]->err;
  }

  // Test hook: destroys the queue pair to `peer` as a crashed process would (its peer then sees
  // its writes fail); this side marks the peer lost.
  int destroy_qp(int peer) {
    if (peer < 0 || peer >= world_ || peer == rank_ || !peers_[peer]->qp)
      return set_error(kErrInvalid, prefix() + "destroy_qp: bad peer " + std::to_string(peer));
    lose_peer(peer, "queue pair destroyed (test hook)");
    std::unique_lock<std::shared_mutex> lk(qp_mu_);
    v_.destroy_qp(peers_[peer]->qp);
    peers_[peer]->qp = nullptr;
    return kOk;
  }

 private:
  std::string prefix() const { return "rank " + std::to_string(rank_) + ": "; }
  std::string peer_where(int p) const {
    const ibv::qp* q = peers_[p]->qp;
    return where_ + ", QP " + std::to_string(q ? q->qp_num : 0) + " -> " + std::to_string(peers_[p]->remote.qpn.size() > size_t(rank_) ? peers_[p]->remote.qpn[rank_] : 0);
  }

  int complete_now(uint64_t wr, int peer, int32_t status) {
    cq_.push(wr, peer, peers_[peer]->lost ? int32_t(kCqPeerLost) : status);
    return kOk;
  }

  int parse(int p, const std::string& ep, Remote* out) {
    const std::string bad = prefix() + "connect: bad verbs endpoint of peer " + std::to_string(p) + " '" + ep + "'";
    auto fields = split(ep, ';');
    if (fields.empty() || fields[0] != "verbs1") return set_error(kErrInvalid, bad + " (not a verbs1 endpoint)");
    try {
      std::string gid_hex;
      for (size_t i = 1; i < fields.size(); ++i) {
        const auto eq = fields[i].find('=');
        if (eq == std::string::npos) return set_error(kErrInvalid, bad);
        const std::string k = fields[i].substr(0, eq), val = fields[i].substr(eq + 1);
        if (k == "rank") out->rank = std::stoi(val);
        else if (k == "world") out->world = std::stoi(val);
        else if (k == "port") out->port = std::stoi(val);
        else if (k == "lid") out->lid = uint16_t(std::stoul(val));
        else if (k == "gid") gid_hex = val;
        else if (k == "mtu") out->mtu = std::stoi(val);
        else if (k == "psn") out->psn = uint32_t(std::stoul(val)) & kPsnMask;
        else if (k == "qpn") {
          for (const auto& q : split(val, ',')) out->qpn.push_back(uint32_t(std::stoul(q)));
        } else if (k == "mr") {
          for (const auto& m : split(val, ',')) {
            auto parts = split(m, ':');
            if (parts.size() != 3) return set_error(kErrInvalid, bad + " (bad mr entry)");
            out->mr.push_back(RemoteRegion{std::stoull(parts[0]), std::stoull(parts[1]), uint32_t(std::stoul(parts[2]))});
          }
        }
      }
      if (!unhex(gid_hex, out->gid.raw, 16)) return set_error(kErrInvalid, bad + " (bad gid)");
    } catch (const std::exception&) {
      return set_error(kErrInvalid, bad + " (bad number)");
    }
    if (out->rank != p || out->world != world_ || int(out->qpn.size()) != world_ || out->qpn[rank_] == 0)
      return set_error(kErrInvalid, bad + " (rank/world/qpn do not match: expected rank " + std::to_string(p) +
                                        " of world " + std::to_string(world_) + ")");
    return kOk;
  }

  int modify(int p, ibv::qp_attr& a, int mask, const char* what) {
    std::unique_lock<std::shared_mutex> lk(qp_mu_);
    ibv::qp* q = peers_[p]->qp;
    if (!q) return set_error(kErrPeer, prefix() + "peer " + std::to_string(p) + ": queue pair destroyed");
    if (int rc = v_.modify_qp(q, &a, mask); rc != 0)
      return set_error(kErrSystem, prefix() + "peer " + std::to_string(p) + " (" + where_ + "): ibv_modify_qp to " +
                                       what + " failed: " + strerror(rc > 0 ? rc : errno));
    return kOk;
  }

  int to_reset(int p) {
    ibv::qp_attr a{};
    a.qp_state = ibv::QPS_RESET;
    return modify(p, a, ibv::QP_STATE, "RESET");
  }

  // RESET -> INIT, then the receives (one per expected write with an immediate, re-posted as
  // each completes).
  int to_init(int p) {
    ibv::qp_attr a{};
    a.qp_state = ibv::QPS_INIT;
    a.pkey_index = 0;
    a.port_num = uint8_t(sel_.port);
    a.qp_access_flags = ibv::ACCESS_LOCAL_WRITE | ibv::ACCESS_REMOTE_WRITE | ibv::ACCESS_REMOTE_READ;
    if (int rc = modify(p, a, ibv::QP_STATE | ibv::QP_PKEY_INDEX | ibv::QP_PORT | ibv::QP_ACCESS_FLAGS, "INIT"); rc != kOk)
      return rc;
    for (int i = 0; i < depth_; ++i)
      if (!post_recv(p)) return set_error(kErrSystem, prefix() + "peer " + std::to_string(p) + " (" + where_ + "): ibv_post_recv failed");
    return kOk;
  }

  bool post_recv(int p) {
    ibv::recv_wr w{};
    w.wr_id = kRecvTag | uint64_t(p);
    w.num_sge = 0;  // writes with immediates land in registered memory; hellos carry no bytes
    ibv::recv_wr* bad = nullptr;
    std::shared_lock<std::shared_mutex> lk(qp_mu_);
    ibv::qp* q = peers_[p]->qp;
    return q && q->ctx->ops.post_recv(q, &w, &bad) == 0;
  }

  int post_send(int p, ibv::send_wr* w, ibv::send_wr** bad) {
    std::shared_lock<std::shared_mutex> lk(qp_mu_);
    ibv::qp* q = peers_[p]->qp;
    return q ? q->ctx->ops.post_send(q, w, bad) : ENOTCONN;
  }

  // INIT -> RTR -> RTS with the peer's QPN/PSN/GID/LID. `hello_seen`: the peer's hello already
  // landed on an earlier attempt, so its next packet has the PSN after it.
  int to_rts(int p, bool hello_seen) {
    const Remote& r = peers_[p]->remote;
    ibv::qp_attr a{};
    a.qp_state = ibv::QPS_RTR;
    a.path_mtu = std::max(1, std::min(sel_.attr.active_mtu, r.mtu > 0 ? r.mtu : sel_.attr.active_mtu));
    a.dest_qp_num = r.qpn[rank_];
    a.rq_psn = (r.psn + (hello_seen ? 1 : 0)) & kPsnMask;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;  // 0.64 ms
    a.ah.dlid = r.lid;
    a.ah.port_num = uint8_t(sel_.port);
    if (sel_.attr.link_layer == ibv::LINK_LAYER_ETHERNET || r.lid == 0) {
      a.ah.is_global = 1;
      a.ah.grh.dgid = r.gid;
      a.ah.grh.sgid_index = uint8_t(sel_.gid_index);
      a.ah.grh.hop_limit = 64;
    }
    int rc = modify(p, a,
                    ibv::QP_STATE | ibv::QP_AV | ibv::QP_PATH_MTU | ibv::QP_DEST_QPN | ibv::QP_RQ_PSN |
                        ibv::QP_MAX_DEST_RD_ATOMIC | ibv::QP_MIN_RNR_TIMER,
                    "RTR");
    if (rc != kOk) return rc;
    ibv::qp_attr b{};
    b.qp_state = ibv::QPS_RTS;
    b.timeout = uint8_t(std::clamp(env_int("MOE_EP_IB_TIMEOUT", 14), 1, 31));  // 4.096 us * 2^14 = 67 ms
    // 6, not 7: Soft-RoCE (rxe) treats 7 as "retry forever", so a dead peer would never fail.
    b.retry_cnt = uint8_t(std::clamp(env_int("MOE_EP_IB_RETRY_CNT", 6), 0, 7));
    b.rnr_retry = 7;  // receiver not ready (no receive posted yet): retry without limit
    b.sq_psn = psn_;
    b.max_rd_atomic = 1;
    return modify(p, b,
                  ibv::QP_STATE | ibv::QP_TIMEOUT | ibv::QP_RETRY_CNT | ibv::QP_RNR_RETRY | ibv::QP_SQ_PSN |
                      ibv::QP_MAX_QP_RD_ATOMIC,
                  "RTS");
  }

  // A zero-byte SEND: the peer sees a receive completion (not a write with an immediate), so
  // no immediate value is reserved for the handshake.
  int send_hello(int p) {
    Peer& pr = *peers_[p];
    const uint32_t attempt = ++pr.hello_attempt;
    pr.hello_status = -1;
    ibv::send_wr w{};
    w.wr_id = kHelloTag | (uint64_t(attempt) << 20) | uint64_t(p);
    w.num_sge = 0;
    w.opcode = ibv::WR_SEND;
    w.send_flags = ibv::SEND_SIGNALED;
    ibv::send_wr* bad = nullptr;
    if (int rc = post_send(p, &w, &bad); rc != 0)
      return set_error(kErrSystem, prefix() + "connect: peer " + std::to_string(p) + " (" + where_ +
                                       "): posting the hello failed: " + strerror(rc));
    return kOk;
  }

  // Marks the peer lost (first reason wins): its QP goes to the error state (pending writes
  // flush), its pending writes complete with `status`, the ImmCounter fails.
  void lose_peer(int p, const std::string& why, int32_t status = kCqPeerLost) {
    Peer& pr = *peers_[p];
    const std::string msg = prefix() + "connection with peer " + std::to_string(p) + " lost (" + peer_where(p) + "): " + why;
    {
      std::lock_guard<std::mutex> lk(pr.mu);
      if (pr.lost) return;
      pr.err = msg;
      pr.lost = true;
    }
    {
      std::unique_lock<std::shared_mutex> lk(qp_mu_);
      ibv::qp_attr a{};
      a.qp_state = ibv::QPS_ERR;
      if (pr.qp) v_.modify_qp(pr.qp, &a, ibv::QP_STATE);
    }
    cq_.fail_peer(p, status);
    conn_cv_.notify_all();
    imm_.fail(msg);
  }

  void check_op_timeouts() {
    cq_.expire(op_timeout_ns_.load(), [this](int p, const std::string& why) { lose_peer(p, why, kCqTimeout); });
  }

  // ---- the completion thread: polls the CQ, sleeps on the completion channel when idle ----

  void cq_loop() {
    ibv::wc wc[32];
    int64_t idle_since = now_ns();
    while (!stop_) {
      const int n = ibcq_->ctx->ops.poll_cq(ibcq_, 32, wc);
      if (n > 0) {
        for (int i = 0; i < n; ++i) handle(wc[i]);
        idle_since = now_ns();
        continue;
      }
      if (n < 0) {
        for (int p = 0; p < world_; ++p)
          if (p != rank_) lose_peer(p, "ibv_poll_cq failed");
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      if (now_ns() - idle_since < 20'000) continue;  // spin a little after the last completion
      ibcq_->ctx->ops.req_notify_cq(ibcq_, 0);
      if (ibcq_->ctx->ops.poll_cq(ibcq_, 1, wc) == 1) {  // arrived before the notification was armed
        handle(wc[0]);
        idle_since = now_ns();
        continue;
      }
      pollfd pf{ch_->fd, POLLIN, 0};
      if (::poll(&pf, 1, 10) > 0) {  // the timeout only bounds how late stop_ is seen
        ibv::cq* c = nullptr;
        void* ctx = nullptr;
        if (v_.get_cq_event(ch_, &c, &ctx) == 0 && ++events_unacked_ >= 64) {
          v_.ack_cq_events(ibcq_, events_unacked_);
          events_unacked_ = 0;
        }
      }
      idle_since = now_ns();  // woken: spin again
    }
  }

  std::string wc_error(const ibv::wc& w) const {
    std::ostringstream s;
    s << v_.wc_status_str(w.status) << " (wc status " << w.status << ", vendor error 0x" << std::hex << w.vendor_err << ")";
    return s.str();
  }

  void handle(const ibv::wc& w) {
    if (w.wr_id & kRecvTag) {
      const int p = int(w.wr_id & 0xFFFFF);
      if (p < 0 || p >= world_) return;
      Peer& pr = *peers_[p];
      if (w.status != ibv::WC_SUCCESS) {
        // Flushed receives of a QP that connect is resetting, or of a peer already lost.
        if (w.status == ibv::WC_WR_FLUSH_ERR && (!pr.up || pr.lost)) return;
        lose_peer(p, "receive failed: " + wc_error(w));
        return;
      }
      if (w.opcode == ibv::WC_RECV_RDMA_WITH_IMM) {
        imm_.add(ntohl(w.imm_data), 1);
      } else if (w.opcode == ibv::WC_RECV) {
        {
          std::lock_guard<std::mutex> lk(conn_mu_);
          pr.hello_recv = true;
        }
        conn_cv_.notify_all();
      }
      if (!pr.lost && !post_recv(p)) lose_peer(p, "re-posting a receive failed");
      return;
    }
    if (w.wr_id & kHelloTag) {
      const int p = int(w.wr_id & 0xFFFFF);
      if (p < 0 || p >= world_) return;
      Peer& pr = *peers_[p];
      if (uint32_t((w.wr_id >> 20) & 0xFFFFFFFFu) != pr.hello_attempt.load()) return;  // an older attempt
      {
        std::lock_guard<std::mutex> lk(conn_mu_);
        pr.hello_status = w.status;
      }
      conn_cv_.notify_all();
      return;
    }
    if (w.status == ibv::WC_SUCCESS) {
      bool completed = false;
      if (cq_.finish(w.wr_id, kCqOk, &completed) >= 0) cq_.notify();
      return;
    }
    // Failed: the peer's error is recorded before any of its writes completes with an error.
    const int peer = cq_.peer_of(w.wr_id);
    if (peer < 0) return;  // already failed (peer lost, op timeout)
    lose_peer(peer, "write " + std::to_string(w.wr_id) + " failed: " + wc_error(w),
              w.status == ibv::WC_REM_ACCESS_ERR ? kCqRemoteAccess : kCqPeerLost);
  }

  const int rank_, world_;
  const ibv::Api& v_;
  Selection sel_;
  std::string where_;
  ibv::pd* pd_ = nullptr;
  ibv::comp_channel* ch_ = nullptr;
  ibv::cq* ibcq_ = nullptr;
  int depth_ = 16;
  uint32_t psn_ = 0;
  unsigned events_unacked_ = 0;  // completion thread
  std::vector<std::unique_ptr<Peer>> peers_;
  std::shared_mutex qp_mu_;  // shared: posting to a QP; exclusive: modify/destroy
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
  std::thread thr_;
};

}  // namespace

Transport* create_verbs_transport(int rank, int world, const std::string& device, int port, int gid_index) {
  const std::string pre = "rank " + std::to_string(rank) + ": ";
  if (bad_rank(rank, world)) return nullptr;
  if (world > (1 << 20)) return set_error(kErrInvalid, pre + "verbs: world size too large"), nullptr;
  std::string why;
  const ibv::Api* v = ibv::load_verbs(&why);
  if (!v) return set_error(kErrInvalid, pre + "verbs transport not available: " + why), nullptr;
  auto* t = new VerbsTransport(rank, world, *v);
  if (t->start(device, port, gid_index) != kOk) {
    const std::string msg = thread_error();
    delete t;
    thread_error() = msg;
    return nullptr;
  }
  return t;
}

int verbs_destroy_qp(Transport* t, int peer) {
  auto* v = dynamic_cast<VerbsTransport*>(t);
  if (!v) return set_error(kErrInvalid, "destroy_qp: not a verbs engine");
  return v->destroy_qp(peer);
}

bool verbs_probe(std::string* what) { return verbs_probe_device("", 0, what); }

bool verbs_probe_device(const std::string& device, int port, std::string* what) {
  std::string why;
  const ibv::Api* v = ibv::load_verbs(&why);
  if (!v) {
    *what = why;
    return false;
  }
  Selection s;
  if (!select_device(*v, device, port, -1, &s, &why)) {
    *what = why;
    return false;
  }
  *what = "device " + s.dev + " port " + std::to_string(s.port) + " GID index " + std::to_string(s.gid_index) +
          (s.attr.link_layer == ibv::LINK_LAYER_ETHERNET ? " (RoCE)" : " (InfiniBand)");
  v->close_device(s.ctx);
  return true;
}

}  // namespace moe_ep
