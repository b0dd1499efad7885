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
#include "cuda_mem.h"
#include "rdma_probe.h"
#include "shared_lib.h"
#include "transport_common.h"
#include "verbs_abi.h"

namespace moe_ep {

namespace ibv {
const Api* load_verbs(std::string* why) {
  auto bind = [](void* h, const std::string& name, Api* api) {
    std::string err;
    auto sym = [&](auto& fn, const char* s) { set_symbol(fn, dlsym(h, s), name + " has no symbol " + s, &err); };
    sym(api->get_device_list, "ibv_get_device_list");
    sym(api->free_device_list, "ibv_free_device_list");
    sym(api->get_device_name, "ibv_get_device_name");
    sym(api->open_device, "ibv_open_device");
    sym(api->close_device, "ibv_close_device");
    sym(api->query_port, "ibv_query_port");
    sym(api->query_gid, "ibv_query_gid");
    sym(api->alloc_pd, "ibv_alloc_pd");
    sym(api->dealloc_pd, "ibv_dealloc_pd");
    sym(api->reg_mr, "ibv_reg_mr");
    sym(api->dereg_mr, "ibv_dereg_mr");
    sym(api->create_comp_channel, "ibv_create_comp_channel");
    sym(api->destroy_comp_channel, "ibv_destroy_comp_channel");
    sym(api->create_cq, "ibv_create_cq");
    sym(api->destroy_cq, "ibv_destroy_cq");
    sym(api->get_cq_event, "ibv_get_cq_event");
    sym(api->ack_cq_events, "ibv_ack_cq_events");
    sym(api->create_qp, "ibv_create_qp");
    sym(api->modify_qp, "ibv_modify_qp");
    sym(api->destroy_qp, "ibv_destroy_qp");
    sym(api->wc_status_str, "ibv_wc_status_str");
    // optional: GPU memory through dma-buf (rdma-core 34+); the device listing
    api->reg_dmabuf_mr = reinterpret_cast<decltype(api->reg_dmabuf_mr)>(dlsym(h, "ibv_reg_dmabuf_mr"));
    api->query_device = reinterpret_cast<decltype(api->query_device)>(dlsym(h, "ibv_query_device"));
    return err;
  };
  return load_table<Api>("MOE_EP_IBVERBS_LIB", "libibverbs.so.1", "rdma-core's libibverbs is not installed?", why, bind);
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

// Opens the device `want_dev` ("": the first usable one not in `skip`); on failure returns false
// with *why naming what is missing.
bool select_device(const ibv::Api& v, const std::string& want_dev, int want_port, int want_gid, Selection* out,
                   std::string* why, const std::vector<std::string>& skip = {}) {
  int n = 0;
  ibv::device** list = v.get_device_list(&n);
  if (!list || n <= 0) {
    if (list) v.free_device_list(list);
    *why = "no RDMA device found (libibverbs lists none; is a NIC driver or rdma_rxe loaded?)";
    return false;
  }
  const std::string& dev = want_dev;
  const int port = want_port > 0 ? want_port : env_int("MOE_EP_IB_PORT", 1);
  std::string names, reasons;
  bool ok = false;
  for (int i = 0; i < n && !ok; ++i) {
    const std::string name = v.get_device_name(list[i]);
    names += (names.empty() ? "" : ", ") + name;
    if (!dev.empty() && name != dev) continue;
    if (dev.empty() && std::find(skip.begin(), skip.end(), name) != skip.end()) continue;  // already chosen
    if (dev.empty() && is_efa_device(name)) {  // RC does not run on EFA: libfabric's efa provider does
      reasons += "; " + name + " is an EFA device (MOE_EP_TRANSPORT=efa: libfabric's efa provider)";
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
      *why = "RDMA device '" + dev + "' not found; devices: " + names;
    else
      *why = "no usable RDMA device (devices: " + names + ")" + reasons;
  }
  return ok;
}

constexpr uint64_t kRecvTag = 1ull << 62;   // receive wr_id: kRecvTag | peer (the NIC: the CQ it is on)
constexpr uint64_t kHelloTag = 1ull << 61;  // hello send wr_id: kHelloTag | attempt << 20 | peer
constexpr uint64_t kByeTag = 1ull << 60;    // goodbye send wr_id: kByeTag | peer (the NIC: the CQ it is on)
constexpr uint64_t kProbeTag = 1ull << 59;  // keepalive write wr_id: kProbeTag | peer (the NIC: the CQ it is on)
// RC has no keepalive: a peer whose process or node died is noticed only by a write to it. So a
// peer nothing was written to for kKeepaliveNs (transport_common.h) gets a zero-byte write from
// each NIC's completion thread (C9-88: it touches no memory); failing, it loses the peer within
// the retry time (timeout x retry_cnt), where a wait for that peer's immediates would run to its
// deadline. It needs no liveness window of its own (libfabric's is the op timeout): the NIC
// completes every write, a keepalive as any other, with an error once its retries are spent.
constexpr uint32_t kPsnMask = 0xFFFFFF;
constexpr int kMaxNics = kMaxLanes;
constexpr uint64_t kShardAlign = 64;  // shards start at multiples of a cache line
// Per NIC and peer, kHelloSlot bytes of the NIC's hello buffer: [0, 64) where the peer's hello
// or goodbye lands (every receive of that queue pair points there), [64, 64 + sizeof(WireHello))
// the hello this rank sends it, [128, 192) its goodbye.
constexpr size_t kHelloSlot = 192, kHelloRecv = 64, kByeSend = 128;
static_assert(sizeof(WireGoodbye) <= kHelloRecv && kByeSend + sizeof(WireGoodbye) <= kHelloSlot, "hello buffer slots");

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}

// "mlx5_0,mlx5_1:2" -> (name, port) entries; port 0: the default. Empty entries are skipped.
struct NicSpec {
  std::string name;
  int port = 0;
};

bool parse_nic_specs(const std::string& s, std::vector<NicSpec>* out, std::string* why) {
  for (const auto& e : split(s, ',')) {
    if (e.empty()) continue;
    NicSpec n;
    const auto colon = e.find(':');
    n.name = e.substr(0, colon);
    if (colon != std::string::npos) {
      char* end = nullptr;
      const long pt = std::strtol(e.c_str() + colon + 1, &end, 10);
      if (!end || *end || pt < 1 || pt > 255) {
        *why = "bad NIC entry '" + e + "' (expected NAME or NAME:PORT)";
        return false;
      }
      n.port = int(pt);
    }
    out->push_back(n);
  }
  return true;
}

std::string nic_desc(const Selection& s) {
  return "device " + s.dev + " port " + std::to_string(s.port) + " GID index " + std::to_string(s.gid_index);
}

// The NICs of an engine (§9, "Several NICs"): `device` ("" = MOE_EP_IB_DEVICE) lists them ("a,b",
// "a:2"; a name listed twice is opened twice); `nics` (0 = MOE_EP_IB_NICS, else as many as
// listed, else 1) says how many to open: the first `nics` listed, or, with none listed, the first
// `nics` distinct usable devices. On failure every context opened is closed again.
bool open_nics(const ibv::Api& v, const std::string& device, int port, int gid_index, int nics,
               std::vector<Selection>* out, std::string* why) {
  std::string list = device;
  if (list.empty())
    if (const char* e = std::getenv("MOE_EP_IB_DEVICE")) list = e;
  std::vector<NicSpec> specs;
  if (!parse_nic_specs(list, &specs, why)) return false;
  int n = nics > 0 ? nics : env_int("MOE_EP_IB_NICS", 0);
  if (n <= 0) n = specs.empty() ? 1 : int(specs.size());
  if (n > kMaxNics) {
    *why = std::to_string(n) + " NICs asked for; at most " + std::to_string(kMaxNics);
    return false;
  }
  if (!specs.empty() && n > int(specs.size())) {
    *why = std::to_string(n) + " NICs asked for (MOE_EP_IB_NICS) but " + std::to_string(specs.size()) +
           " listed ('" + list + "')";
    return false;
  }
  if (!specs.empty()) specs.resize(size_t(n));
  std::vector<std::string> chosen;
  for (int i = 0; i < n; ++i) {
    Selection sel;
    std::string w;
    const bool listed = !specs.empty();
    if (!select_device(v, listed ? specs[size_t(i)].name : "", listed && specs[size_t(i)].port ? specs[size_t(i)].port : port,
                       gid_index, &sel, &w, chosen)) {
      for (auto& s : *out) v.close_device(s.ctx);
      out->clear();
      *why = n > 1 ? "NIC " + std::to_string(i) + " of " + std::to_string(n) + ": " + w : w;
      if (!listed && i > 0)
        *why += " (" + std::to_string(n) + " NICs asked for, " + std::to_string(i) + " usable: " + join(chosen, ", ") +
                "; list a device twice, e.g. MOE_EP_IB_DEVICE=" + chosen[0] + "," + chosen[0] + ", to open it twice)";
      return false;
    }
    chosen.push_back(sel.dev);
    out->push_back(sel);
  }
  return true;
}

// One NIC of an engine: its context (in sel), PD, completion channel, CQ and completion thread.
struct Nic {
  Selection sel;
  std::string where;  // "verbs device D port N GID index G" (+ " (NIC i of k)" when k > 1)
  ibv::pd* pd = nullptr;
  ibv::comp_channel* ch = nullptr;
  ibv::cq* cq = nullptr;
  std::vector<char> hello;   // kHelloSlot bytes per peer, registered as hello_mr
  ibv::mr* hello_mr = nullptr;
  unsigned events_unacked = 0;  // its completion thread only
  std::thread thr;
};

struct Region {
  char* ptr = nullptr;
  uint64_t len = 0;
  std::vector<ibv::mr*> mr;  // one per NIC (none for a 0-byte region)
  std::string how;           // per NIC, '/'-joined: "host", "dma-buf" or "gpu address" (register_memory)
};

struct RemoteRegion {
  uint64_t addr = 0, len = 0;
  std::vector<uint32_t> rkey;  // one per NIC
};

struct RemoteNic {
  std::string dev;
  int port = 1, mtu = 0;
  uint16_t lid = 0;
  ibv::gid gid{};
};

struct Remote {
  int rank = -1, world = 0;
  uint32_t psn = 0;
  std::vector<RemoteNic> nic;
  std::vector<std::vector<uint32_t>> qpn;  // [rank][nic]
  std::vector<RemoteRegion> mr;
};

// One RC queue pair: to one peer through one NIC.
struct Link {
  ibv::qp* qp = nullptr;
  std::atomic<bool> up{false};          // connect finished for this queue pair
  std::atomic<bool> hello_recv{false};  // the peer's hello landed
  std::atomic<int> hello_status{-1};    // own hello: -1 pending, else its wc status
  std::atomic<uint32_t> hello_attempt{0};
  std::string hello_refused;            // why the peer's last hello was refused (under conn_mu_)
  std::atomic<int> bye_status{-2};      // own goodbye: -2 not sent, -1 pending, else its wc status
  std::atomic<bool> probing{false};     // a keepalive write is posted and not completed
};

struct Peer {
  explicit Peer(int nics) {
    for (int i = 0; i < nics; ++i) link.emplace_back(new Link);
  }
  std::vector<std::unique_ptr<Link>> link;  // [nic]
  Remote remote;
  std::atomic<bool> lost{false};
  std::atomic<int64_t> writes_posted{0};
  std::atomic<int64_t> last_post_ns{0};  // the latest write posted to the peer (keepalives included)
  std::mutex mu;  // guards err and the goodbye fields
  std::string err;
  bool said_bye = false;  // the peer's goodbye came before it was lost: it said `bye`
  Goodbye bye;
  std::string bye_text;
};

class VerbsTransport final : public LaneTransport {
 public:
  VerbsTransport(int rank, int world, const ibv::Api& v, const JobIdentity& id)
      : LaneTransport(rank, world), v_(v), id_(id) {}

  // Takes the opened NICs (closed by the destructor from here on, even when start fails).
  int start(const std::vector<Selection>& sels) {
    const int k = int(sels.size());
    for (int i = 0; i < k; ++i) {
      nics_.emplace_back(new Nic);
      nics_.back()->sel = sels[size_t(i)];
      nics_.back()->where = "verbs " + nic_desc(sels[size_t(i)]) +
                            (k > 1 ? " (NIC " + std::to_string(i) + " of " + std::to_string(k) + ")" : "");
    }
    for (int p = 0; p < world_; ++p) peers_.emplace_back(new Peer(k));
    const int peers = std::max(world_ - 1, 1);
    depth_ = std::max(16, std::min(512, 16384 / peers));
    for (size_t lane = 0; lane < nics_.size(); ++lane) {
      Nic& n = *nics_[lane];
      n.pd = v_.alloc_pd(n.sel.ctx);
      if (!n.pd) return set_error(kErrSystem, prefix() + n.where + ": ibv_alloc_pd failed: " + strerror(errno));
      n.ch = v_.create_comp_channel(n.sel.ctx);
      if (!n.ch) return set_error(kErrSystem, prefix() + n.where + ": ibv_create_comp_channel failed: " + strerror(errno));
      fcntl(n.ch->fd, F_SETFL, fcntl(n.ch->fd, F_GETFL) | O_NONBLOCK);
      n.cq = v_.create_cq(n.sel.ctx, 2 * depth_ * peers + 16, nullptr, n.ch, 0);
      if (!n.cq) return set_error(kErrSystem, prefix() + n.where + ": ibv_create_cq failed: " + strerror(errno));
      n.hello.assign(size_t(world_) * kHelloSlot, 0);
      for (int p = 0; p < world_; ++p) {
        const WireHello h = make_hello(id_, rank_, p, world_, int(lane));
        std::memcpy(n.hello.data() + size_t(p) * kHelloSlot + kHelloRecv, &h, sizeof(h));
      }
      n.hello_mr = v_.reg_mr(n.pd, n.hello.data(), n.hello.size(), ibv::ACCESS_LOCAL_WRITE);
      if (!n.hello_mr) return set_error(kErrSystem, prefix() + n.where + ": ibv_reg_mr of the hello buffer failed: " + strerror(errno));
    }
    std::mt19937 rng{std::random_device{}()};
    psn_ = rng() & kPsnMask;
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      for (int i = 0; i < k; ++i) {
        ibv::qp_init_attr ia{};
        ia.send_cq = nics_[size_t(i)]->cq;
        ia.recv_cq = nics_[size_t(i)]->cq;
        ia.cap.max_send_wr = uint32_t(depth_ + 3);  // + the hello, the goodbye and a keepalive
        ia.cap.max_recv_wr = uint32_t(depth_);
        ia.cap.max_send_sge = 1;
        ia.cap.max_recv_sge = 1;
        ia.qp_type = ibv::QPT_RC;
        peers_[size_t(p)]->link[size_t(i)]->qp = v_.create_qp(nics_[size_t(i)]->pd, &ia);
        if (!peers_[size_t(p)]->link[size_t(i)]->qp)
          return set_error(kErrSystem, prefix() + nics_[size_t(i)]->where + ": ibv_create_qp for peer " +
                                           std::to_string(p) + " failed: " + strerror(errno));
        if (int rc = to_init(p, i); rc != kOk) return rc;
      }
    }
    for (int i = 0; i < k; ++i)
      if (int rc = start_thread(&nics_[size_t(i)]->thr, [this, i] { cq_loop(i); }, prefix() + "verbs completion thread");
          rc != kOk)
        return rc;
    return kOk;
  }

  ~VerbsTransport() override {
    say_goodbye(Goodbye{});  // a clean close, unless the owner said otherwise (needs the threads)
    stop_ = true;
    for (auto& n : nics_)
      if (n->thr.joinable()) n->thr.join();
    for (auto& pr : peers_)
      for (auto& l : pr->link)
        if (l->qp) v_.destroy_qp(l->qp);
    for (auto& n : nics_) {
      if (n->cq) {
        if (n->events_unacked) v_.ack_cq_events(n->cq, n->events_unacked);
        v_.destroy_cq(n->cq);
      }
      if (n->ch) v_.destroy_comp_channel(n->ch);
    }
    for (auto& r : regions_.snapshot())
      for (ibv::mr* m : r.mr)
        if (m) v_.dereg_mr(m);
    for (auto& n : nics_) {
      if (n->hello_mr) v_.dereg_mr(n->hello_mr);
      if (n->pd) v_.dealloc_pd(n->pd);
      if (n->sel.ctx) v_.close_device(n->sel.ctx);
    }
  }

  // Every write with an immediate is one shard per NIC, each counted by the receiver.
  int imm_per_write() const override { return int(nics_.size()); }

  // Every region on every NIC (any shard may go through any NIC). Host memory: ibv_reg_mr.
  // Device memory (the CUDA driver says so, cuda_mem.h): ibv_reg_dmabuf_mr on a dma-buf of the
  // page-aligned range (addressed by its offset inside the dma-buf; iova = ptr, the address peers
  // write to), else ibv_reg_mr on the GPU address (works where nvidia-peermem is loaded), else an
  // error naming both failures.
  int register_memory(void* ptr, uint64_t len, uint32_t* key) override {
    if (ptr == nullptr && len > 0) return set_error(kErrInvalid, prefix() + "register: null pointer");
    Region r{static_cast<char*>(ptr), len, {}, ""};
    if (int rc = make_mrs(&r); rc != kOk) return rc;
    *key = regions_.add(r);
    return kOk;
  }

  bool try_register(void* ptr, uint64_t len, std::string* how) override {
    Region r{static_cast<char*>(ptr), len, {}, ""};
    if (make_mrs(&r) != kOk) {
      *how = thread_error();
      return false;
    }
    for (ibv::mr* m : r.mr) v_.dereg_mr(m);
    *how = len > 0 ? r.how : "host";
    return true;
  }

  // r's memory registered on every NIC (r.mr, r.how): host memory with ibv_reg_mr; GPU memory
  // through dma-buf where it can, else ibv_reg_mr on its address (nvidia-peermem).
  int make_mrs(Region* rp) {
    Region& r = *rp;
    void* ptr = r.ptr;
    const uint64_t len = r.len;
    if (len > 0) {
      constexpr int access = ibv::ACCESS_LOCAL_WRITE | ibv::ACCESS_REMOTE_WRITE | ibv::ACCESS_REMOTE_READ;
      const bool gpu = memory_type(ptr) == MemType::Device;
      int fd = -1;
      uint64_t fd_off = 0;
      std::string dmabuf_why;
      if (gpu && !v_.reg_dmabuf_mr)
        dmabuf_why = "libibverbs has no ibv_reg_dmabuf_mr (rdma-core older than 34)";
      else if (gpu)
        cuda_dmabuf_fd(ptr, len, &fd, &fd_off, &dmabuf_why);
      std::vector<std::string> how;
      for (auto& np : nics_) {
        ibv::mr* m = nullptr;
        std::string h = gpu ? "gpu address" : "host";
        if (fd >= 0) {
          m = v_.reg_dmabuf_mr(np->pd, fd_off, size_t(len), reinterpret_cast<uintptr_t>(ptr), fd, access);
          if (m) h = "dma-buf";
          else dmabuf_why = "ibv_reg_dmabuf_mr failed: " + std::string(strerror(errno));
        }
        if (!m) m = v_.reg_mr(np->pd, ptr, size_t(len), access);
        if (!m) {
          const std::string err = strerror(errno);
          if (fd >= 0) close(fd);
          for (ibv::mr* done : r.mr) v_.dereg_mr(done);
          std::ostringstream at;
          at << std::hex << reinterpret_cast<uintptr_t>(ptr);
          if (gpu)
            return set_error(kErrSystem, prefix() + np->where + ": registering " + std::to_string(len) +
                                             " bytes of GPU memory at 0x" + at.str() + " failed: dma-buf: " +
                                             dmabuf_why + "; ibv_reg_mr on the GPU address: " + err +
                                             " (needs nvidia-peermem)");
          return set_error(kErrSystem, prefix() + np->where + ": ibv_reg_mr of " + std::to_string(len) +
                                           " bytes failed: " + err + " (locked-memory limit? ulimit -l)");
        }
        r.mr.push_back(m);
        how.push_back(h);
      }
      if (fd >= 0) close(fd);  // each MR holds its own reference to the dma-buf
      r.how = join(how, "/");
    }
    return kOk;
  }

  // How region `key` was registered on each NIC ("host", "dma-buf", "gpu address"; '/'-joined).
  std::string region_how(uint32_t key) const {
    const auto regs = regions_.snapshot();
    return key >= 1 && key <= regs.size() ? regs[key - 1].how : "";
  }

  // "verbs1;rank=R;world=W;nics=K;dev=D0/D1;port=N0/N1;lid=L0/L1;gid=HEX32/HEX32;mtu=M0/M1;psn=P;
  //  qpn=Q0,Q1,..;mr=ADDR:LEN:RKEY,.." (numbers decimal; per-NIC values joined by '/', in NIC
  // order; qpn has one entry per rank, 0 for its own, each with a QPN per NIC; mr lists the
  // regions registered so far, in key order, each with an rkey per NIC). One NIC: the format of
  // a single-NIC engine, nics=1 (a peer that leaves nics out has as many as dev lists).
  std::string endpoint() const override {
    std::ostringstream s;
    auto per_nic = [&](auto f) {
      for (size_t i = 0; i < nics_.size(); ++i) s << (i ? "/" : "") << f(*nics_[i], i);
    };
    s << "verbs1;rank=" << rank_ << ";world=" << world_ << ";nics=" << nics_.size() << ";dev=";
    per_nic([](const Nic& n, size_t) { return n.sel.dev; });
    s << ";port=";
    per_nic([](const Nic& n, size_t) { return std::to_string(n.sel.port); });
    s << ";lid=";
    per_nic([](const Nic& n, size_t) { return std::to_string(n.sel.attr.lid); });
    s << ";gid=";
    per_nic([](const Nic& n, size_t) { return hex(n.sel.gid.raw, 16); });
    s << ";mtu=";
    per_nic([](const Nic& n, size_t) { return std::to_string(n.sel.attr.active_mtu); });
    s << ";psn=" << psn_ << ";qpn=";
    for (int p = 0; p < world_; ++p) {
      s << (p ? "," : "");
      per_nic([&](const Nic&, size_t i) {
        const ibv::qp* q = peers_[size_t(p)]->link[i]->qp;
        return std::to_string(q ? q->qp_num : 0);
      });
    }
    s << ";mr=";
    const auto regs = regions_.snapshot();
    for (size_t r = 0; r < regs.size(); ++r) {
      s << (r ? "," : "") << reinterpret_cast<uintptr_t>(regs[r].ptr) << ":" << regs[r].len << ":";
      per_nic([&](const Nic&, size_t i) { return std::to_string(i < regs[r].mr.size() ? regs[r].mr[i]->rkey : 0); });
    }
    return s.str();
  }

  int connect(const std::vector<std::string>& endpoints, int64_t timeout_ns) override {
    if (int rc = check_connect(rank_, world_, connected_, endpoints.size()); rc != kOk) return rc;
    const int64_t deadline = now_ns() + timeout_ns;
    const int k = int(nics_.size());
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      if (int rc = parse(p, endpoints[size_t(p)], &peers_[size_t(p)]->remote); rc != kOk) return rc;
    }
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      for (int i = 0; i < k; ++i) {
        if (int rc = to_rts(p, i, false); rc != kOk) return rc;
        if (int rc = send_hello(p, i); rc != kOk) return rc;
      }
    }
    // Every queue pair: own hello acknowledged and the peer's hello received. A hello that fails
    // (the peer's QP not yet ready to receive: retries exhausted) resets the QP and tries again.
    std::unique_lock<std::mutex> lk(conn_mu_);
    auto scan = [&](int* wp, int* wi) -> int {  // *wp, *wi: the first queue pair still waited for
      for (int p = 0; p < world_; ++p) {
        if (p == rank_) continue;
        Peer& pr = *peers_[size_t(p)];
        if (pr.lost) return set_error(kErrPeer, peer_error(p));
        for (int i = 0; i < k; ++i) {
          Link& l = *pr.link[size_t(i)];
          if (l.up) continue;
          const int hs = l.hello_status.load();
          if (hs == ibv::WC_SUCCESS && l.hello_recv) {
            l.up = true;
            continue;
          }
          if (hs > 0) {  // failed: bring the QP up again (receives re-posted) and resend
            lk.unlock();
            int rc = to_reset(p, i);
            if (rc == kOk) rc = to_init(p, i);
            if (rc == kOk) rc = to_rts(p, i, l.hello_recv);
            if (rc == kOk) rc = send_hello(p, i);
            lk.lock();
            if (rc != kOk) return rc;
          }
          if (*wp < 0) *wp = p, *wi = i;
        }
      }
      return kOk;
    };
    auto timed_out = [&](int wp, int wi) {
      const Link& l = *peers_[size_t(wp)]->link[size_t(wi)];
      return connect_timed_out(prefix(), wp, timeout_ns, nics_[size_t(wi)]->where, l, "not acknowledged yet",
                               "acknowledged", v_.wc_status_str,
                               l.hello_recv                ? "received"
                               : l.hello_refused.empty() ? "not received"
                                                         : "refused: " + l.hello_refused);
    };
    if (int rc = wait_links_up(lk, conn_cv_, deadline, scan, timed_out); rc != kOk) return rc;
    connected_ = true;
    return kOk;
  }

  // One logical write: its bytes split into contiguous shards, one per NIC (shard_bounds), each
  // posted on its NIC's queue pair to the peer with the write's immediate; a write with an
  // immediate posts every shard, empty ones included (0 bytes, the immediate only), so the
  // receiver counts exactly imm_per_write() immediates per write; one without posts only the
  // shards with bytes (at least one). The write completes when all its posts have.
  int post_write(const WriteOp& w, uint64_t* wr_id) override {
    Region r;
    if (int rc = check_post(rank_, world_, connected_, regions_, w, &r); rc != kOk) return rc;
    const int k = int(nics_.size());
    const WriteShards sh(w.len, k, min_shard_.load(), kShardAlign, w.has_imm);
    if (sh.bytes(0) > 0xFFFFFFFFull)
      return set_error(kErrInvalid, prefix() + "post_write to peer " + std::to_string(w.peer) + ": a shard of " +
                                        std::to_string(sh.bytes(0)) + " bytes is more than one verbs write carries (4 GiB)");
    Peer& pr = *peers_[size_t(w.peer)];
    const uint64_t wr = next_wr_++;
    *wr_id = wr;
    const int64_t n = pr.writes_posted++;
    pr.last_post_ns.store(now_ns(), std::memory_order_relaxed);
    if (std::string why = cut_.cuts(w.peer, n); !why.empty()) lose_peer(w.peer, why);
    // The peer's advertised regions: a bad key or range fails the write here, as a remote access
    // error, instead of sending it (a real one would break the queue pair).
    const RemoteRegion* rr = remote_region(pr.remote.mr, w.remote_key, w.remote_off, w.len);
    if (!rr) return complete_now(wr, w.peer, kCqRemoteAccess);
    // A full send queue (depth_ writes pending to this peer) waits for completions, up to the op
    // timeout. A write takes at most one entry of each of the peer's queue pairs.
    const int added = cq_.add(wr, w.peer, uint32_t(sh.posts()), pr.lost, depth_,
                              now_ns() + op_timeout_ns_.load());
    if (added == 0) return kOk;  // lost: completed as such
    if (added < 0)
      return set_error(kErrTimeout, prefix() + "post_write to peer " + std::to_string(w.peer) + ": send queue (" +
                                        std::to_string(depth_) + " writes) still full after the op timeout");
    // Shard s goes to NIC (s + n) % k: a write smaller than the minimum shard (one shard with
    // bytes) goes to a different NIC than the peer's previous one.
    for (int s = 0; s < k; ++s) {
      if (!sh.posted(s)) continue;
      const uint64_t off = sh.at(s), bytes = sh.bytes(s);
      const int i = int((uint64_t(s) + uint64_t(n)) % uint64_t(k));
      ibv::sge sg{reinterpret_cast<uint64_t>(r.ptr + w.local_off + off), uint32_t(bytes),
                  r.mr.empty() ? 0 : r.mr[size_t(i)]->lkey};
      ibv::send_wr sw{};
      sw.wr_id = wr;
      sw.sg_list = &sg;
      sw.num_sge = bytes > 0 ? 1 : 0;
      sw.opcode = w.has_imm ? ibv::WR_RDMA_WRITE_WITH_IMM : ibv::WR_RDMA_WRITE;
      sw.send_flags = ibv::SEND_SIGNALED;
      sw.imm_data = htonl(w.imm);
      sw.wr.rdma.remote_addr = rr->addr + w.remote_off + off;
      sw.wr.rdma.rkey = rr->rkey[size_t(i)];
      ibv::send_wr* bad = nullptr;
      if (int rc = post_send(w.peer, i, &sw, &bad); rc != 0) {
        cq_.remove(wr);  // shards already posted flush; their completions find nothing pending
        const std::string why = "ibv_post_send failed: " + std::string(strerror(rc));
        lose_peer(w.peer, why, kCqPeerLost, i);
        return set_error(kErrPeer, prefix() + "post_write to peer " + std::to_string(w.peer) + " (" +
                                       nics_[size_t(i)]->where + "): " + why);
      }
    }
    return kOk;
  }

  int poll(Completion* out, int max, int64_t timeout_ns) override {
    return cq_.poll(out, max, timeout_ns, [this] { check_op_timeouts(); });
  }

  int64_t cpu_ns() override { return threads_cpu_ns(nics_); }
  std::string peer_error(int peer) override { return loss_of(peers_, peer); }

  // A SEND of the goodbye on every queue pair of every peer not gone (RC delivers it before any
  // failure of a later write to this rank; with several NICs each completion thread sees its
  // own), then waits until each completed (the peer's NIC has it) or the peer went.
  void say_goodbye(const Goodbye& g) override {
    if (bye_said_.exchange(true) || !connected_) return;
    goodbye_every_link(peers_, rank_, conn_mu_, conn_cv_, [&](int p, int i, int64_t) { send_goodbye(p, i, g); });
  }

  bool peer_goodbye(int peer, Goodbye* out) override { return said_goodbye(peers_, peer, out); }

#ifdef MOE_EP_TEST_HOOKS
  // Test hook: destroys the queue pairs to `peer` as a crashed process would (its peer then
  // sees its writes fail); this side marks the peer lost.
  int destroy_qp(int peer) {
    if (peer < 0 || peer >= world_ || peer == rank_ || !peers_[size_t(peer)]->link[0]->qp)
      return set_error(kErrInvalid, prefix() + "destroy_qp: bad peer " + std::to_string(peer));
    lose_peer(peer, "queue pair destroyed (test hook)");
    std::unique_lock<std::shared_mutex> lk(qp_mu_);
    for (auto& l : peers_[size_t(peer)]->link) {
      if (l->qp) v_.destroy_qp(l->qp);
      l->qp = nullptr;
    }
    return kOk;
  }
#endif

 private:
  std::string prefix() const { return "rank " + std::to_string(rank_) + ": "; }
  std::string peer_where(int p, int i) const {
    const ibv::qp* q = peers_[size_t(p)]->link[size_t(i)]->qp;
    const auto& rq = peers_[size_t(p)]->remote.qpn;
    const uint32_t theirs = rq.size() > size_t(rank_) && rq[size_t(rank_)].size() > size_t(i) ? rq[size_t(rank_)][size_t(i)] : 0;
    return nics_[size_t(i)]->where + ", QP " + std::to_string(q ? q->qp_num : 0) + " -> " + std::to_string(theirs);
  }
  Link& link(int p, int i) { return *peers_[size_t(p)]->link[size_t(i)]; }

  int complete_now(uint64_t wr, int peer, int32_t status) {
    cq_.push(wr, peer, peers_[size_t(peer)]->lost ? int32_t(kCqPeerLost) : status);
    return kOk;
  }

  int parse(int p, const std::string& ep, Remote* out) {
    const std::string bad = prefix() + "connect: bad verbs endpoint of peer " + std::to_string(p) + " '" + ep + "'";
    std::unordered_map<std::string, std::string> kv;
    if (int rc = endpoint_fields(ep, "verbs1", bad, &kv); rc != kOk) return rc;
    const size_t k = nics_.size();
    const auto devs = split(kv["dev"], '/');
    size_t theirs = devs.size();
    try {
      if (kv.count("nics")) theirs = size_t(std::stoul(kv["nics"]));
      out->rank = std::stoi(kv["rank"]);
      out->world = std::stoi(kv["world"]);
      out->psn = uint32_t(std::stoul(kv["psn"])) & kPsnMask;
    } catch (const std::exception&) {
      return set_error(kErrInvalid, bad + " (bad number)");
    }
    if (theirs != k)
      return set_error(kErrInvalid, prefix() + "connect: peer " + std::to_string(p) + " opened " + std::to_string(theirs) +
                                        " NICs (" + join(devs, ", ") + "), this rank " + std::to_string(k) + " (" +
                                        nic_names() + "): every rank must open the same number of NICs "
                                        "(MOE_EP_IB_DEVICE lists them, MOE_EP_IB_NICS counts them)");
    auto per_nic = [&](const std::string& key, std::vector<std::string>* v) {
      *v = split(kv[key], '/');
      return v->size() == k;
    };
    std::vector<std::string> ports, lids, gids, mtus;
    if (devs.size() != k || !per_nic("port", &ports) || !per_nic("lid", &lids) || !per_nic("gid", &gids) ||
        !per_nic("mtu", &mtus))
      return set_error(kErrInvalid, bad + " (dev/port/lid/gid/mtu need one entry per NIC)");
    try {
      out->nic.assign(k, RemoteNic{});
      for (size_t i = 0; i < k; ++i) {
        RemoteNic& n = out->nic[i];
        n.dev = devs[i];
        n.port = std::stoi(ports[i]);
        n.lid = uint16_t(std::stoul(lids[i]));
        n.mtu = std::stoi(mtus[i]);
        std::vector<uint8_t> gid;
        if (!unhex(gids[i], &gid) || gid.size() != sizeof(n.gid.raw)) return set_error(kErrInvalid, bad + " (bad gid)");
        std::memcpy(n.gid.raw, gid.data(), gid.size());
      }
      out->qpn.clear();
      for (const auto& q : split(kv["qpn"], ',')) {
        std::vector<uint32_t> per;
        for (const auto& x : split(q, '/')) per.push_back(uint32_t(std::stoul(x)));
        if (per.size() != k) return set_error(kErrInvalid, bad + " (a qpn entry needs one QPN per NIC)");
        out->qpn.push_back(per);
      }
      out->mr.clear();
      for (const auto& m : split(kv["mr"], ',')) {
        auto parts = split(m, ':');
        if (parts.size() != 3) return set_error(kErrInvalid, bad + " (bad mr entry)");
        RemoteRegion rr{std::stoull(parts[0]), std::stoull(parts[1]), {}};
        for (const auto& x : split(parts[2], '/')) rr.rkey.push_back(uint32_t(std::stoul(x)));
        if (rr.rkey.size() != k) return set_error(kErrInvalid, bad + " (an mr entry needs one rkey per NIC)");
        out->mr.push_back(rr);
      }
    } catch (const std::exception&) {
      return set_error(kErrInvalid, bad + " (bad number)");
    }
    bool qpn_ok = out->qpn.size() == size_t(world_);
    for (size_t i = 0; qpn_ok && i < k; ++i) qpn_ok = out->qpn[size_t(rank_)][i] != 0;
    if (out->rank != p || out->world != world_ || !qpn_ok)
      return set_error(kErrInvalid, bad + " (rank/world/qpn do not match: expected rank " + std::to_string(p) +
                                        " of world " + std::to_string(world_) + ")");
    return kOk;
  }

  std::string nic_names() const {
    std::vector<std::string> v;
    for (auto& n : nics_) v.push_back(n->sel.dev);
    return join(v, ", ");
  }

  int modify(int p, int i, ibv::qp_attr& a, int mask, const char* what) {
    std::unique_lock<std::shared_mutex> lk(qp_mu_);
    ibv::qp* q = link(p, i).qp;
    if (!q) return set_error(kErrPeer, prefix() + "peer " + std::to_string(p) + ": queue pair destroyed");
    if (int rc = v_.modify_qp(q, &a, mask); rc != 0)
      return set_error(kErrSystem, prefix() + "peer " + std::to_string(p) + " (" + nics_[size_t(i)]->where +
                                       "): ibv_modify_qp to " + what + " failed: " + strerror(rc > 0 ? rc : errno));
    return kOk;
  }

  int to_reset(int p, int i) {
    ibv::qp_attr a{};
    a.qp_state = ibv::QPS_RESET;
    return modify(p, i, a, ibv::QP_STATE, "RESET");
  }

  // RESET -> INIT, then the receives (one per expected write with an immediate, re-posted as
  // each completes).
  int to_init(int p, int i) {
    ibv::qp_attr a{};
    a.qp_state = ibv::QPS_INIT;
    a.pkey_index = 0;
    a.port_num = uint8_t(nics_[size_t(i)]->sel.port);
    a.qp_access_flags = ibv::ACCESS_LOCAL_WRITE | ibv::ACCESS_REMOTE_WRITE | ibv::ACCESS_REMOTE_READ;
    if (int rc = modify(p, i, a, ibv::QP_STATE | ibv::QP_PKEY_INDEX | ibv::QP_PORT | ibv::QP_ACCESS_FLAGS, "INIT"); rc != kOk)
      return rc;
    for (int j = 0; j < depth_; ++j)
      if (!post_recv(p, i))
        return set_error(kErrSystem, prefix() + "peer " + std::to_string(p) + " (" + nics_[size_t(i)]->where +
                                         "): ibv_post_recv failed");
    return kOk;
  }

  // A receive of the queue pair to peer p on NIC i: a write with an immediate consumes it
  // without using its buffer; the peer's hello lands in the buffer, its slot of the hello buffer.
  bool post_recv(int p, int i) {
    const Nic& n = *nics_[size_t(i)];
    ibv::sge sg{reinterpret_cast<uint64_t>(n.hello.data() + size_t(p) * kHelloSlot), uint32_t(kHelloRecv),
                n.hello_mr->lkey};
    ibv::recv_wr w{};
    w.wr_id = kRecvTag | uint64_t(p);
    w.sg_list = &sg;
    w.num_sge = 1;
    ibv::recv_wr* bad = nullptr;
    std::shared_lock<std::shared_mutex> lk(qp_mu_);
    ibv::qp* q = link(p, i).qp;
    return q && q->ctx->ops.post_recv(q, &w, &bad) == 0;
  }

  int post_send(int p, int i, ibv::send_wr* w, ibv::send_wr** bad) {
    std::shared_lock<std::shared_mutex> lk(qp_mu_);
    ibv::qp* q = link(p, i).qp;
    return q ? q->ctx->ops.post_send(q, w, bad) : ENOTCONN;
  }

  // INIT -> RTR -> RTS with the peer's QPN/PSN/GID/LID of the same NIC index. `hello_seen`: the
  // peer's hello already landed on an earlier attempt, so its next packet has the PSN after it.
  int to_rts(int p, int i, bool hello_seen) {
    const Remote& r = peers_[size_t(p)]->remote;
    const RemoteNic& rn = r.nic[size_t(i)];
    const Selection& sel = nics_[size_t(i)]->sel;
    ibv::qp_attr a{};
    a.qp_state = ibv::QPS_RTR;
    a.path_mtu = std::max(1, std::min(sel.attr.active_mtu, rn.mtu > 0 ? rn.mtu : sel.attr.active_mtu));
    a.dest_qp_num = r.qpn[size_t(rank_)][size_t(i)];
    a.rq_psn = (r.psn + (hello_seen ? 1 : 0)) & kPsnMask;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 12;  // 0.64 ms
    a.ah.dlid = rn.lid;
    a.ah.port_num = uint8_t(sel.port);
    if (sel.attr.link_layer == ibv::LINK_LAYER_ETHERNET || rn.lid == 0) {
      a.ah.is_global = 1;
      a.ah.grh.dgid = rn.gid;
      a.ah.grh.sgid_index = uint8_t(sel.gid_index);
      a.ah.grh.hop_limit = 64;
    }
    int rc = modify(p, i, a,
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
    return modify(p, i, b,
                  ibv::QP_STATE | ibv::QP_TIMEOUT | ibv::QP_RETRY_CNT | ibv::QP_RNR_RETRY | ibv::QP_SQ_PSN |
                      ibv::QP_MAX_QP_RD_ATOMIC,
                  "RTS");
  }

  // A SEND of this rank's WireHello to the peer on NIC i (the job identity, this rank, the peer,
  // the NIC index): the peer sees a receive completion, not a write with an immediate, so no
  // immediate value is reserved for the handshake.
  int send_hello(int p, int i) {
    Link& l = link(p, i);
    const uint32_t attempt = ++l.hello_attempt;
    l.hello_status = -1;
    const Nic& n = *nics_[size_t(i)];
    ibv::sge sg{reinterpret_cast<uint64_t>(n.hello.data() + size_t(p) * kHelloSlot + kHelloRecv),
                uint32_t(sizeof(WireHello)), n.hello_mr->lkey};
    ibv::send_wr w{};
    w.wr_id = kHelloTag | (uint64_t(attempt) << 20) | uint64_t(p);
    w.sg_list = &sg;
    w.num_sge = 1;
    w.opcode = ibv::WR_SEND;
    w.send_flags = ibv::SEND_SIGNALED;
    ibv::send_wr* bad = nullptr;
    if (int rc = post_send(p, i, &w, &bad); rc != 0)
      return set_error(kErrSystem, prefix() + "connect: peer " + std::to_string(p) + " (" + nics_[size_t(i)]->where +
                                       "): posting the hello failed: " + strerror(rc));
    return kOk;
  }

  // The goodbye to peer p on NIC i: a SEND of a WireGoodbye from its slot of the hello buffer.
  void send_goodbye(int p, int i, const Goodbye& g) {
    Link& l = link(p, i);
    if (!l.up) return;
    Nic& n = *nics_[size_t(i)];
    char* at = n.hello.data() + size_t(p) * kHelloSlot + kByeSend;
    const WireGoodbye w = make_goodbye(id_, rank_, p, world_, g);
    std::memcpy(at, &w, sizeof(w));
    ibv::sge sg{reinterpret_cast<uint64_t>(at), uint32_t(sizeof(w)), n.hello_mr->lkey};
    ibv::send_wr wr{};
    wr.wr_id = kByeTag | uint64_t(p);
    wr.sg_list = &sg;
    wr.num_sge = 1;
    wr.opcode = ibv::WR_SEND;
    wr.send_flags = ibv::SEND_SIGNALED;
    ibv::send_wr* bad = nullptr;
    l.bye_status = -1;
    if (post_send(p, i, &wr, &bad) != 0) l.bye_status = -2;  // not sent: nothing to wait for
  }

  // A goodbye landed on the queue pair of peer p, NIC i (`len` bytes in its hello slot). Trusted
  // only on a queue pair whose hello passed (bound to the peer's, proven to be this job's), and
  // checked as a hello is. After an error the peer is lost at once, by what it said (RC has no
  // keepalive: nothing else would tell this rank before its next write to it); a clean one is
  // remembered for the loss that follows, noticed as any loss is (so a healthy job never fails by
  // a goodbye). One failing the check there is a protocol error (the peer is lost, named as the
  // cause); on a queue pair without a hello, refused.
  void on_goodbye(int p, int i, uint32_t len) {
    WireGoodbye g{};
    std::memcpy(&g, nics_[size_t(i)]->hello.data() + size_t(p) * kHelloSlot, std::min<size_t>(len, sizeof(g)));
    const std::string why = goodbye_mismatch(g, len, p, rank_, world_, id_);
    if (!link(p, i).hello_recv) {
      refusals_.record(prefix() + "refused a goodbye on the queue pair of peer " + std::to_string(p) + " (" +
                       peer_where(p, i) + "): " + (why.empty() ? "no hello passed on it" : why));
      return;
    }
    if (!why.empty()) return lose_peer(p, "protocol error: " + why, kCqPeerLost, i);
    take_goodbye(g, world_, *peers_[size_t(p)],
                 [&](const std::string& text, const Goodbye& bye) { lose_peer(p, text, kCqPeerLost, i, &bye); });
  }

  // Marks the peer lost (first reason wins): its QPs (every NIC's) go to the error state
  // (pending writes flush), its pending writes complete with `status`, the ImmCounter fails.
  // `nic`: the NIC where it was noticed (named in the message). `bye`: lost by its goodbye.
  void lose_peer(int p, const std::string& why, int32_t status = kCqPeerLost, int nic = 0,
                 const Goodbye* bye = nullptr) {
    Peer& pr = *peers_[size_t(p)];
    std::string msg = loss_text(rank_, p, peer_where(p, nic), why);
    {
      std::lock_guard<std::mutex> lk(pr.mu);
      if (!mark_lost(pr, &msg, bye)) return;
    }
    {
      std::unique_lock<std::shared_mutex> lk(qp_mu_);
      ibv::qp_attr a{};
      a.qp_state = ibv::QPS_ERR;
      for (auto& l : pr.link)
        if (l->qp) v_.modify_qp(l->qp, &a, ibv::QP_STATE);
    }
    cq_.fail_peer(p, status);
    conn_cv_.notify_all();
    imm_.fail(msg);
  }

  // The keepalive writes of NIC i (kKeepaliveNs): one to each connected peer nothing was posted
  // to for that long, at most one pending per queue pair.
  void keepalive(int i, int64_t now) {
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      Peer& pr = *peers_[size_t(p)];
      Link& l = link(p, i);
      if (!l.up || pr.lost || l.probing || now - pr.last_post_ns.load(std::memory_order_relaxed) < kKeepaliveNs)
        continue;
      const auto& mrs = pr.remote.mr;  // (a zero-byte write needs no key; a real one where there is)
      ibv::send_wr w{};
      w.wr_id = kProbeTag | uint64_t(p);
      w.num_sge = 0;
      w.opcode = ibv::WR_RDMA_WRITE;
      w.send_flags = ibv::SEND_SIGNALED;
      w.wr.rdma.remote_addr = mrs.empty() ? 0 : mrs[0].addr;
      w.wr.rdma.rkey = mrs.empty() ? 0 : mrs[0].rkey[size_t(i)];
      ibv::send_wr* bad = nullptr;
      l.probing = true;
      pr.last_post_ns.store(now, std::memory_order_relaxed);
      if (post_send(p, i, &w, &bad) != 0) l.probing = false;  // (a QP being reset: the next look tries again)
    }
  }

  void check_op_timeouts() {
    cq_.expire(op_timeout_ns_.load(), [this](int p, const std::string& why) { lose_peer(p, why, kCqTimeout); });
  }

  // ---- a completion thread per NIC: polls its CQ, sleeps on its completion channel when idle ----

  void cq_loop(int i) {
    Nic& nic = *nics_[size_t(i)];
    ibv::cq* cq = nic.cq;
    ibv::wc wc[32];
    int64_t idle_since = now_ns();
    KeepaliveClock keepalive_clock(idle_since);
    while (!stop_) {
      if (connected_ && keepalive_clock.due(idle_since)) keepalive(i, idle_since);  // (idle_since: the latest time read)
      const int n = cq->ctx->ops.poll_cq(cq, 32, wc);
      if (n > 0) {
        for (int j = 0; j < n; ++j) handle(i, wc[j]);
        idle_since = now_ns();
        continue;
      }
      if (n < 0) {
        for (int p = 0; p < world_; ++p)
          if (p != rank_) lose_peer(p, "ibv_poll_cq failed", kCqPeerLost, i);
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      if (now_ns() - idle_since < 20'000) continue;  // spin a little after the last completion
      cq->ctx->ops.req_notify_cq(cq, 0);
      if (cq->ctx->ops.poll_cq(cq, 1, wc) == 1) {  // arrived before the notification was armed
        handle(i, wc[0]);
        idle_since = now_ns();
        continue;
      }
      pollfd pf{nic.ch->fd, POLLIN, 0};
      if (::poll(&pf, 1, 10) > 0) {  // the timeout only bounds how late stop_ is seen
        ibv::cq* c = nullptr;
        void* ctx = nullptr;
        if (v_.get_cq_event(nic.ch, &c, &ctx) == 0 && ++nic.events_unacked >= 64) {
          v_.ack_cq_events(cq, nic.events_unacked);
          nic.events_unacked = 0;
        }
      }
      idle_since = now_ns();  // woken: spin again
    }
  }

  // "" when the `len` bytes that landed in peer p's hello slot on NIC i are its hello for this
  // job, this rank and this NIC; else what is wrong (never the secret).
  std::string hello_problem(int p, int i, uint32_t len) const {
    WireHello h{};
    std::memcpy(&h, nics_[size_t(i)]->hello.data() + size_t(p) * kHelloSlot, std::min<size_t>(len, sizeof(h)));
    std::string why = hello_mismatch(h, len, rank_, world_, id_);
    if (why.empty() && h.src_rank != p)
      why = "it says rank " + std::to_string(h.src_rank) + ", on the queue pair of rank " + std::to_string(p);
    if (why.empty() && h.lane != i) why = "it says NIC " + std::to_string(h.lane) + ", on NIC " + std::to_string(i);
    return why;
  }

  std::string wc_error(const ibv::wc& w) const {
    std::ostringstream s;
    s << v_.wc_status_str(w.status) << " (wc status " << w.status << ", vendor error 0x" << std::hex << w.vendor_err << ")";
    return s.str();
  }

  void handle(int i, const ibv::wc& w) {
    if (w.wr_id & kRecvTag) {
      const int p = int(w.wr_id & 0xFFFFF);
      if (p < 0 || p >= world_ || p == rank_) return;
      Peer& pr = *peers_[size_t(p)];
      Link& l = link(p, i);
      if (w.status != ibv::WC_SUCCESS) {
        // Flushed receives of a QP that connect is resetting, or of a peer already lost.
        if (w.status == ibv::WC_WR_FLUSH_ERR && (!l.up || pr.lost)) return;
        lose_peer(p, "receive failed: " + wc_error(w), kCqPeerLost, i);
        return;
      }
      uint32_t magic = 0;
      std::memcpy(&magic, nics_[size_t(i)]->hello.data() + size_t(p) * kHelloSlot, sizeof(magic));
      if (w.opcode == ibv::WC_RECV_RDMA_WITH_IMM) {
        imm_.add(ntohl(w.imm_data), 1);  // one shard of a write: imm_per_write() of them make it
      } else if (w.opcode == ibv::WC_RECV && magic == kMagicGoodbye && w.byte_len >= sizeof(magic)) {
        on_goodbye(p, i, w.byte_len);
      } else if (w.opcode == ibv::WC_RECV) {
        const std::string why = hello_problem(p, i, w.byte_len);
        {
          std::lock_guard<std::mutex> lk(conn_mu_);
          if (why.empty()) l.hello_recv = true;
          else l.hello_refused = why;
        }
        if (!why.empty())
          refusals_.record(prefix() + "refused the hello on the queue pair of peer " + std::to_string(p) + " (" +
                           peer_where(p, i) + "): " + why);
        conn_cv_.notify_all();
      }
      if (!pr.lost && !post_recv(p, i)) lose_peer(p, "re-posting a receive failed", kCqPeerLost, i);
      return;
    }
    if (w.wr_id & kByeTag) {
      const int p = int(w.wr_id & 0xFFFFF);
      if (p < 0 || p >= world_ || p == rank_) return;
      {
        std::lock_guard<std::mutex> lk(conn_mu_);
        link(p, i).bye_status = w.status;
      }
      conn_cv_.notify_all();
      return;
    }
    if (w.wr_id & kProbeTag) {
      const int p = int(w.wr_id & 0xFFFFF);
      if (p < 0 || p >= world_ || p == rank_) return;
      link(p, i).probing = false;
      // (flushed: its queue pair went to the error state, the peer lost or this rank closing)
      if (w.status != ibv::WC_SUCCESS && w.status != ibv::WC_WR_FLUSH_ERR)
        lose_peer(p, "keepalive write failed: " + wc_error(w) + " (nothing was written to it for " +
                         std::to_string(kKeepaliveNs / 1'000'000'000) + " s; its process or node is gone)",
                  kCqPeerLost, i);
      return;
    }
    if (w.wr_id & kHelloTag) {
      const int p = int(w.wr_id & 0xFFFFF);
      if (p < 0 || p >= world_ || p == rank_) return;
      Link& l = link(p, i);
      if (uint32_t((w.wr_id >> 20) & 0xFFFFFFFFu) != l.hello_attempt.load()) return;  // an older attempt
      {
        std::lock_guard<std::mutex> lk(conn_mu_);
        l.hello_status = w.status;
      }
      conn_cv_.notify_all();
      return;
    }
    if (w.status == ibv::WC_SUCCESS) {
      bool completed = false;
      if (cq_.finish(w.wr_id, kCqOk, &completed) >= 0 && completed) cq_.notify();
      return;
    }
    // Failed: the peer's error is recorded before any of its writes completes with an error.
    const int peer = cq_.peer_of(w.wr_id);
    if (peer < 0) return;  // already failed (peer lost, op timeout)
    lose_peer(peer, "write " + std::to_string(w.wr_id) + " failed: " + wc_error(w),
              w.status == ibv::WC_REM_ACCESS_ERR ? kCqRemoteAccess : kCqPeerLost, i);
  }

  const ibv::Api& v_;
  const JobIdentity id_;
  std::vector<std::unique_ptr<Nic>> nics_;
  int depth_ = 16;
  uint32_t psn_ = 0;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::shared_mutex qp_mu_;  // shared: posting to a QP; exclusive: modify/destroy
  RegionTable<Region> regions_;
};

}  // namespace

Transport* create_verbs_transport(int rank, int world, const std::string& device, int port, int gid_index, int nics,
                                  const JobIdentity& id) {
  const std::string pre = "rank " + std::to_string(rank) + ": ";
  if (bad_rank(rank, world)) return nullptr;
  if (world > (1 << 20)) return set_error(kErrInvalid, pre + "verbs: world size too large"), nullptr;
  std::string why;
  const ibv::Api* v = ibv::load_verbs(&why);
  if (!v) return set_error(kErrInvalid, pre + "verbs transport not available: " + why), nullptr;
  std::vector<Selection> sels;
  if (!open_nics(*v, device, port, gid_index, nics, &sels, &why))
    return set_error(kErrInvalid, pre + "verbs: " + why), nullptr;
  return started(new VerbsTransport(rank, world, *v, id), sels);
}

std::string verbs_region_how(Transport* t, uint32_t key) {
  auto* v = dynamic_cast<VerbsTransport*>(t);
  return v ? v->region_how(key) : "";
}

#ifdef MOE_EP_TEST_HOOKS
int verbs_destroy_qp(Transport* t, int peer) {
  auto* v = dynamic_cast<VerbsTransport*>(t);
  if (!v) return set_error(kErrInvalid, "destroy_qp: not a verbs engine");
  return v->destroy_qp(peer);
}
#endif

bool verbs_probe(std::string* what) { return verbs_probe_device("", 0, what); }

bool verbs_probe_device(const std::string& device, int port, std::string* what) {
  std::string why;
  const ibv::Api* v = ibv::load_verbs(&why);
  if (!v) {
    *what = why;
    return false;
  }
  std::vector<Selection> sels;
  if (!open_nics(*v, device, port, -1, 0, &sels, &why)) {
    *what = why;
    return false;
  }
  std::vector<std::string> d;
  for (const Selection& s : sels) {
    d.push_back(nic_desc(s) + (s.attr.link_layer == ibv::LINK_LAYER_ETHERNET ? " (RoCE)" : " (InfiniBand)"));
    v->close_device(s.ctx);
  }
  *what = (d.size() > 1 ? std::to_string(d.size()) + " NICs: " : "") + join(d, "; ");
  return true;
}

}  // namespace moe_ep
