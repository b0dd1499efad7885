// libfabric transport: FI_EP_RDM endpoints of any provider with RMA and remote CQ data (efa,
// tcp;ofi_rxm, udp;ofi_rxd, shm), fi_writedata carrying the immediate as remote CQ data (fi_write
// without one), hellos and goodbyes as messages (fi_send), one completion thread per endpoint
// (progress is manual on most providers), endpoints on one domain or spread over several (one per
// EFA device near the GPU). libfabric is opened at run time (fabric_load.cc), so nothing here
// needs it to build. Endpoint format, mr_mode, progress, hellos and errors:
// docs/ARCHITECTURE.md §9, "libfabric transport".
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#ifdef __linux__
#include <sys/prctl.h>
#endif

#include "cuda_mem.h"
#include "fabric_abi.h"
#include "fabric_load.h"
#include "transport.h"
#include "transport_common.h"

namespace moe_ep {
namespace {

constexpr int kMaxEndpoints = kMaxLanes;
constexpr uint64_t kShardAlign = 64;
constexpr int kAvInsertTries = 20;  // fi_av_insert calls for one address that insert nothing, 1 ms apart
constexpr size_t kSlot = 128;  // a receive's buffer (a hello, a goodbye or a keepalive lands there)
constexpr uint32_t kMagicPing = 0x4950454d;  // "MEPI": a keepalive message (its receiver ignores it)
// Keepalive (§9): a message to every peer from each endpoint's completion thread once per
// kKeepaliveNs (transport_common.h); one that fails loses the peer, and so does none delivered for
// the op timeout (see keepalive()).
constexpr int64_t kSpinNs = 100'000;  // a completion thread's spin after its last completion or post
constexpr int64_t kSleepNs = 20'000;  // then its sleep between reads

enum class OpKind : uint8_t { Write, Recv, Hello, Bye, Ping };

// The context of every posted operation: its first 64 bytes belong to the provider (FI_CONTEXT2).
struct Op {
  alignas(8) uint8_t prov[64];
  OpKind kind;
  int peer = -1;
  int slot = -1;
  uint32_t attempt = 0;
  uint64_t wr = 0;
};

// One endpoint of an engine: its domain, completion queue, address vector, endpoint, receive
// slots (then a send slot per peer for the hello, the goodbye and the keepalive) and thread.
struct Lane {
  fi::info* info = nullptr;
  fi::fid_fabric* fabric = nullptr;  // not owned (FabricTransport::fabrics_)
  fi::fid_domain* domain = nullptr;
  fi::fid_cq* cq = nullptr;
  fi::fid_av* av = nullptr;
  fi::fid_ep* ep = nullptr;
  std::vector<char> buf;
  fi::fid_mr* buf_mr = nullptr;
  void* buf_desc = nullptr;
  std::vector<Op> recv;  // one per receive slot, reposted as each completes
  std::vector<uint8_t> addr;
  std::vector<fi::addr_t> peer_addr;  // per rank (FI_AV_TABLE)
  std::string where;
  std::thread thr;
  std::atomic<int64_t> kicked_ns{0};  // the latest post on this lane: its completion thread spins again
};

struct MrOnLane {
  fi::fid_mr* mr = nullptr;
  void* desc = nullptr;
  uint64_t key = 0;
};

struct Region {
  char* ptr = nullptr;
  uint64_t len = 0;
  uint64_t base = 0;  // what peers address byte 0 of the region as (virtual address or 0)
  std::vector<MrOnLane> mr;  // one per endpoint (none for a 0-byte region)
};

struct RemoteRegion {
  uint64_t base = 0, len = 0;
  std::vector<uint64_t> key;  // one per endpoint
};

// This rank's state of one peer on one endpoint.
struct Link {
  std::atomic<bool> hello_recv{false};
  std::atomic<int> hello_status{-1};  // own hello: -1 pending, 0 delivered, else the error
  std::atomic<uint32_t> hello_attempt{0};
  std::atomic<int> bye_status{-2};    // own goodbye: -2 not sent, -1 pending, else its status
  std::atomic<bool> probing{false};   // a keepalive is posted and not completed
  std::atomic<int64_t> probe_ns{0};   // when it was posted
  std::atomic<int64_t> alive_ns{0};   // the latest keepalive delivered (or when connected)
};

struct Peer {
  explicit Peer(int k) {
    for (int i = 0; i < k; ++i) link.emplace_back(new Link);
  }
  std::vector<std::unique_ptr<Link>> link;
  std::vector<RemoteRegion> mr;
  std::atomic<bool> up{false};
  std::atomic<bool> lost{false};
  std::atomic<int64_t> writes_posted{0};
  std::mutex mu;  // guards err and the goodbye fields
  std::string err;
  bool said_bye = false;
  Goodbye bye;
  std::string bye_text;
};

class FabricTransport final : public LaneTransport {
 public:
  FabricTransport(int rank, int world, const fi::Api& api, const JobIdentity& id, int force_mr_mode)
      : LaneTransport(rank, world), api_(api), id_(id), force_(force_mr_mode) {}

  // Opens `k` endpoints, endpoint i on the fi_info chosen[i % n] (one per domain, all of one
  // provider; taken over: freed by the destructor).
  int start(const std::vector<fi::info*>& chosen, int k) {
    chosen_ = chosen;
    const fi::info* first = chosen.front();
    prov_ = first->fabric->prov_name ? first->fabric->prov_name : "?";
    prov_mode_ = first->domain->mr_mode;
    mode_ = prov_mode_ | force_;
    max_msg_ = first->ep->max_msg_size;
    for (const fi::info* c : chosen) {
      const std::string name = c->domain->name ? c->domain->name : "?";
      dom_ += (dom_.empty() ? "" : ",") + name;
      domains_.push_back(name);
      if (c->domain->mr_mode != prov_mode_)
        return set_error(kErrInvalid, prefix() + "libfabric " + prov_ + ": domain " + name + " asks for mr_mode " +
                                          fi::mr_mode_names(c->domain->mr_mode) + ", domain " + domains_.front() +
                                          " for " + fi::mr_mode_names(prov_mode_) + ": expected the same on every domain");
      if (c->ep->max_msg_size > 0 && (max_msg_ == 0 || c->ep->max_msg_size < max_msg_)) max_msg_ = c->ep->max_msg_size;
    }
    // rxm hands its core (tcp) domain an mr_mode of its own: a forced FI_MR_VIRT_ADDR would
    // change only this side's addresses, and every write would fail at the target.
    if ((force_ & fi::MR_VIRT_ADDR) && !(prov_mode_ & fi::MR_VIRT_ADDR) && prov_.find("ofi_rxm") != std::string::npos)
      return set_error(kErrInvalid, prefix() + "libfabric " + prov_ + ": a forced FI_MR_VIRT_ADDR is not honoured by "
                                               "rxm (its tcp domain keeps offset addressing); force it on udp;ofi_rxd");
    for (int p = 0; p < world_; ++p) peers_.emplace_back(new Peer(k));
    // One fabric per fabric name among the domains (efa: all of them on one).
    std::vector<fi::fid_fabric*> lane_fabric;
    for (const fi::info* c : chosen) {
      const std::string fname = c->fabric->name ? c->fabric->name : "";
      size_t f = 0;
      while (f < fabric_names_.size() && fabric_names_[f] != fname) ++f;
      if (f == fabric_names_.size()) {
        fi::fid_fabric* fab = nullptr;
        if (int rc = api_.fabric(c->fabric, &fab, nullptr); rc != 0) return fi_error(rc, "fi_fabric (" + fname + ")");
        fabrics_.push_back(fab);
        fabric_names_.push_back(fname);
      }
      lane_fabric.push_back(fabrics_[f]);
    }
    const size_t n = chosen.size();
    nrecv_ = 2 * world_ + 32;
    for (int i = 0; i < k; ++i) {
      lanes_.emplace_back(new Lane);
      Lane& l = *lanes_.back();
      l.where = "libfabric " + prov_ + " domain " + domains_[size_t(i) % n] +
                (k > 1 ? " (endpoint " + std::to_string(i) + " of " + std::to_string(k) + ")" : "");
      l.fabric = lane_fabric[size_t(i) % n];
      l.info = api_.dupinfo(chosen[size_t(i) % n]);
      if (!l.info) return set_error(kErrSystem, prefix() + "fi_dupinfo failed");
      l.info->domain->mr_mode = mode_;  // the forced bits too (the provider may refuse them)
      if (int rc = l.fabric->ops->domain(l.fabric, l.info, &l.domain, nullptr); rc != 0)
        return fi_error(rc, l.where + ": fi_domain (mr_mode " + fi::mr_mode_names(mode_) + ")");
      fi::cq_attr ca{};
      ca.size = size_t(nrecv_ + 4096);
      ca.format = fi::CQ_FORMAT_DATA;
      ca.wait_obj_ = fi::WAIT_NONE;
      if (int rc = l.domain->ops->cq_open(l.domain, &ca, &l.cq, nullptr); rc != 0) return fi_error(rc, l.where + ": fi_cq_open");
      fi::av_attr aa{};
      aa.type = fi::AV_TABLE;
      aa.count = size_t(world_);
      if (int rc = l.domain->ops->av_open(l.domain, &aa, &l.av, nullptr); rc != 0) return fi_error(rc, l.where + ": fi_av_open");
      if (int rc = l.domain->ops->endpoint(l.domain, l.info, &l.ep, nullptr); rc != 0) return fi_error(rc, l.where + ": fi_endpoint");
      if (int rc = l.ep->fid_.ops->bind(&l.ep->fid_, &l.cq->fid_, fi::TRANSMIT | fi::RECV); rc != 0)
        return fi_error(rc, l.where + ": fi_ep_bind of the CQ");
      if (int rc = l.ep->fid_.ops->bind(&l.ep->fid_, &l.av->fid_, 0); rc != 0) return fi_error(rc, l.where + ": fi_ep_bind of the AV");
      if (int rc = l.ep->fid_.ops->control(&l.ep->fid_, fi::CONTROL_ENABLE, nullptr); rc != 0) return fi_error(rc, l.where + ": fi_enable");
      uint8_t name[256];
      size_t len = sizeof(name);
      if (int rc = l.ep->cm->getname(&l.ep->fid_, name, &len); rc != 0) return fi_error(rc, l.where + ": fi_getname");
      l.addr.assign(name, name + len);
      l.peer_addr.assign(size_t(world_), ~0ull);
      l.buf.assign((size_t(nrecv_) + 3 * size_t(world_)) * kSlot, 0);
      for (int p = 0; p < world_; ++p) {
        const WireHello h = make_hello(id_, rank_, p, world_, i);
        std::memcpy(hello_slot(l, p), &h, sizeof(h));
        std::memcpy(ping_slot(l, p), &kMagicPing, sizeof(kMagicPing));
      }
      MrOnLane m;
      if (int rc = reg(i, l.buf.data(), l.buf.size(), fi::SEND | fi::RECV, 0, &m); rc != kOk) return rc;
      l.buf_mr = m.mr;
      l.buf_desc = m.desc;
      l.recv.resize(size_t(nrecv_));
      for (int s = 0; s < nrecv_; ++s) {
        l.recv[size_t(s)].kind = OpKind::Recv;
        l.recv[size_t(s)].slot = s;
        if (int rc = post_recv(i, s); rc != 0) return fi_error(rc, l.where + ": fi_recv");
      }
    }
    for (int i = 0; i < k; ++i)
      if (int rc = start_thread(&lanes_[size_t(i)]->thr, [this, i] { cq_loop(i); }, prefix() + "libfabric completion thread");
          rc != kOk)
        return rc;
    return kOk;
  }

  ~FabricTransport() override {
    say_goodbye(Goodbye{});
    stop_ = true;
    for (auto& l : lanes_)
      if (l->thr.joinable()) l->thr.join();
    auto close = [](fi::fid* f) {
      if (f) f->ops->close(f);
    };
    for (auto& l : lanes_) close(l->ep ? &l->ep->fid_ : nullptr);
    for (auto& r : regions_.snapshot())
      for (auto& m : r.mr) close(m.mr ? &m.mr->fid_ : nullptr);
    for (auto& l : lanes_) {
      close(l->buf_mr ? &l->buf_mr->fid_ : nullptr);
      close(l->av ? &l->av->fid_ : nullptr);
      close(l->cq ? &l->cq->fid_ : nullptr);
      close(l->domain ? &l->domain->fid_ : nullptr);
      if (l->info) api_.freeinfo(l->info);
    }
    for (fi::fid_fabric* f : fabrics_) close(&f->fid_);
    for (fi::info* c : chosen_) api_.freeinfo(c);
    std::lock_guard<std::mutex> lk(ops_mu_);
    for (Op* o : ops_) delete o;
  }

  int imm_per_write() const override { return int(lanes_.size()); }

  // Every region on every endpoint's domain (any shard may go through any endpoint).
  int register_memory(void* ptr, uint64_t len, uint32_t* key) override {
    if (ptr == nullptr && len > 0) return set_error(kErrInvalid, prefix() + "register: null pointer");
    Region r{static_cast<char*>(ptr), len, (mode_ & fi::MR_VIRT_ADDR) ? reinterpret_cast<uint64_t>(ptr) : 0, {}};
    std::lock_guard<std::mutex> lk(reg_mu_);
    const uint64_t requested = uint64_t(regions_.snapshot().size()) + 1;  // unique per domain (the buffer: 0)
    if (len > 0) {
      for (size_t i = 0; i < lanes_.size(); ++i) {
        MrOnLane m;
        if (int rc = reg(int(i), ptr, len, fi::WRITE | fi::REMOTE_WRITE, requested, &m); rc != kOk) {
          for (auto& done : r.mr) done.mr->fid_.ops->close(&done.mr->fid_);
          return rc;
        }
        r.mr.push_back(m);
      }
    }
    *key = regions_.add(r);
    return kOk;
  }

  bool try_register(void* ptr, uint64_t len, std::string* how) override {
    if (len == 0 || ptr == nullptr) {
      *how = "host";
      return true;
    }
    std::lock_guard<std::mutex> lk(reg_mu_);
    std::vector<MrOnLane> done;
    for (size_t i = 0; i < lanes_.size(); ++i) {
      MrOnLane m;  // (a requested key no region uses: regions take 1, 2, ...)
      if (reg(int(i), ptr, len, fi::WRITE | fi::REMOTE_WRITE, (uint64_t(1) << 31) + i, &m) != kOk) {
        *how = thread_error();
        for (auto& d : done) d.mr->fid_.ops->close(&d.mr->fid_);
        return false;
      }
      done.push_back(m);
    }
    for (auto& d : done) d.mr->fid_.ops->close(&d.mr->fid_);
    *how = memory_type(ptr) == MemType::Device ? "FI_HMEM_CUDA" : "host";
    return true;
  }

  // "fabric1;rank=R;world=W;prov=P;eps=K;addr=HEX/HEX;mr=BASE:LEN:KEY/KEY,..": the provider
  // (';' written as '+': "tcp+ofi_rxm"), fi_getname's address of each endpoint, the regions registered so far (in key order) with the address
  // peers write byte 0 of each at (its virtual address under FI_MR_VIRT_ADDR, else 0) and its key
  // on each endpoint (fi_mr_key).
  std::string endpoint() const override {
    std::ostringstream s;
    s << "fabric1;rank=" << rank_ << ";world=" << world_ << ";prov=" << wire_prov() << ";eps=" << lanes_.size() << ";addr=";
    for (size_t i = 0; i < lanes_.size(); ++i) s << (i ? "/" : "") << hex(lanes_[i]->addr.data(), lanes_[i]->addr.size());
    s << ";mr=";
    const auto regs = regions_.snapshot();
    for (size_t r = 0; r < regs.size(); ++r) {
      s << (r ? "," : "") << regs[r].base << ":" << regs[r].len << ":";
      for (size_t i = 0; i < lanes_.size(); ++i) s << (i ? "/" : "") << (i < regs[r].mr.size() ? regs[r].mr[i].key : 0);
    }
    return s.str();
  }

  int connect(const std::vector<std::string>& endpoints, int64_t timeout_ns) override {
    if (int rc = check_connect(rank_, world_, connected_, endpoints.size()); rc != kOk) return rc;
    const int64_t deadline = steady_now_ns() + timeout_ns;
    const int k = int(lanes_.size());
    std::vector<std::vector<std::vector<uint8_t>>> addrs(static_cast<size_t>(world_));
    for (int p = 0; p < world_; ++p)
      if (p != rank_)
        if (int rc = parse(p, endpoints[size_t(p)], &addrs[size_t(p)]); rc != kOk) return rc;
    for (int i = 0; i < k; ++i) {
      Lane& l = *lanes_[size_t(i)];
      for (int p = 0; p < world_; ++p) {
        if (p == rank_) continue;
        // An insert that inserts nothing is tried again: rxd (libfabric 1.17) inserts a peer's
        // address itself when its first packet arrives, and an insert racing with that fails
        // once (measured: 1 pair in 150 with the peer's hello landing during the insert); the
        // next finds the address in place.
        int n = 0;
        for (int attempt = 0; attempt < kAvInsertTries && n == 0; ++attempt) {
          if (attempt) std::this_thread::sleep_for(std::chrono::milliseconds(1));
          n = l.av->ops->insert(l.av, addrs[size_t(p)][size_t(i)].data(), 1, &l.peer_addr[size_t(p)], 0, nullptr);
        }
        if (n < 0) return fi_error(n, l.where + ": fi_av_insert of peer " + std::to_string(p));
        if (n != 1)
          return set_error(kErrSystem, prefix() + l.where + ": fi_av_insert of peer " + std::to_string(p) +
                                           " inserted no address in " + std::to_string(kAvInsertTries) + " tries");
      }
    }
    for (int p = 0; p < world_; ++p)
      for (int i = 0; i < k && p != rank_; ++i)
        if (int rc = send_hello(p, i, deadline); rc != kOk) return rc;
    // Every peer on every endpoint: own hello delivered and the peer's hello received; a failed
    // hello is sent again every 50 ms until the deadline.
    std::unique_lock<std::mutex> lk(conn_mu_);
    auto scan = [&](int* wp, int* wi) -> int {
      for (int p = 0; p < world_; ++p) {
        Peer& pr = *peers_[size_t(p)];
        if (p == rank_ || pr.up) continue;
        if (pr.lost) return set_error(kErrPeer, peer_error(p));
        bool all = true;
        for (int i = 0; i < k; ++i) {
          Link& ln = *pr.link[size_t(i)];
          const int hs = ln.hello_status.load();
          if (hs == 0 && ln.hello_recv) continue;
          all = false;
          if (hs > 0) {
            lk.unlock();
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
            const int rc = send_hello(p, i, deadline);
            lk.lock();
            if (rc != kOk) return rc;
          }
          if (*wp < 0) *wp = p, *wi = i;
        }
        if (all) {
          for (auto& ln : pr.link) ln->alive_ns = steady_now_ns();
          pr.up = true;
        }
      }
      return kOk;
    };
    auto timed_out = [&](int wp, int wi) {
      const Link& ln = *peers_[size_t(wp)]->link[size_t(wi)];
      return connect_timed_out(prefix(), wp, timeout_ns, lanes_[size_t(wi)]->where, ln, "not delivered yet", "delivered",
                               api_.strerror, ln.hello_recv ? "received" : "not received",
                               last_refused_.empty() ? "" : "; a hello was refused: " + last_refused_);
    };
    if (int rc = wait_links_up(lk, conn_cv_, deadline, scan, timed_out); rc != kOk) return rc;
    connected_ = true;
    return kOk;
  }

  // One logical write cut into contiguous shards, one per endpoint (shard_bounds), each posted
  // with the write's immediate as remote CQ data (fi_writemsg with FI_REMOTE_CQ_DATA), as the
  // verbs transport cuts them over its NICs. -FI_EAGAIN (rxm connects lazily, queues are full)
  // is retried while the completion threads progress, until the op timeout.
  int post_write(const WriteOp& w, uint64_t* wr_id) override {
    Staged st;
    if (int rc = stage(w, wr_id, &st); rc != kOk) return rc;
    return issue(st, 0);
  }

  // A batch, write by write, each shard with FI_MORE where the next write puts a shard on the
  // same endpoint (the provider may then ring one doorbell for the run: the proxy's batch of a
  // phase is a header to every peer, or the rows to each remote peer); the last post on an
  // endpoint goes without it, which hands over what was held. Should the next write then post
  // nothing after all (a bad remote range, a peer lost: the proxy fails the phase on either), the
  // held post goes with the endpoint's next post (at the latest its keepalive).
  int post_writes(const WriteOp* ops, int n, uint64_t* wr_ids, int* posted) override {
    for (int i = 0; i < n; ++i) {
      uint64_t wr = 0;
      Staged st;
      int rc = stage(ops[i], wr_ids ? &wr_ids[i] : &wr, &st);
      if (rc == kOk) rc = issue(st, i + 1 < n ? lanes_of(ops[i + 1]) : 0);
      if (rc != kOk) return *posted = i, rc;
    }
    *posted = n;
    return kOk;
  }

  int poll(Completion* out, int max, int64_t timeout_ns) override {
    return cq_.poll(out, max, timeout_ns, [this] {
      cq_.expire(op_timeout_ns_.load(), [this](int p, const std::string& why) { lose_peer(p, why, kCqTimeout); });
    });
  }

  int64_t cpu_ns() override { return threads_cpu_ns(lanes_); }
  std::string peer_error(int peer) override { return loss_of(peers_, peer); }

  // The goodbye to every peer that is up and not gone, on every endpoint, then a wait until each
  // was delivered or its peer went.
  void say_goodbye(const Goodbye& g) override {
    if (bye_said_.exchange(true) || !connected_) return;
    goodbye_every_link(peers_, rank_, conn_mu_, conn_cv_, [&](int p, int i, int64_t deadline) { send_goodbye(p, i, g, deadline); });
  }

  bool peer_goodbye(int peer, Goodbye* out) override { return said_goodbye(peers_, peer, out); }

  // {"provider", "domain" (','-joined), "domains" (endpoint i on domains[i % n]), "mr_mode" (in
  // use), "provider_mr_mode", "forced_mr_mode", "endpoints", "max_msg_size"} as JSON.
  std::string describe() const {
    std::ostringstream s;
    s << "{\"provider\": \"" << prov_ << "\", \"domain\": \"" << dom_ << "\", \"domains\": [";
    for (size_t i = 0; i < domains_.size(); ++i) s << (i ? ", " : "") << "\"" << domains_[i] << "\"";
    s << "], \"mr_mode\": " << mode_
      << ", \"provider_mr_mode\": " << prov_mode_ << ", \"forced_mr_mode\": " << force_ << ", \"mr_mode_names\": \""
      << fi::mr_mode_names(mode_) << "\", \"endpoints\": " << lanes_.size() << ", \"max_msg_size\": " << max_msg_ << "}";
    return s.str();
  }

 private:
  std::string prefix() const { return "rank " + std::to_string(rank_) + ": "; }
  // A write checked and entered in the completion queue, its shards not posted yet (stage), or
  // nothing to post (shards 0: it completed already, a bad remote range or a lost peer).
  struct Staged {
    uint64_t wr = 0;
    int peer = -1;
    bool has_imm = false;
    uint32_t imm = 0;
    int shards = 0;
    uint64_t lanes = 0;  // bit i: a shard goes out on endpoint i
    struct Shard {
      int lane;
      char* src;
      uint64_t bytes;
      void* desc;
      uint64_t addr, key;
    } shard[kMaxEndpoints];
  };
  int stage(const WriteOp& w, uint64_t* wr_id, Staged* st) {
    st->shards = 0;
    st->lanes = 0;
    Region r;
    if (int rc = check_post(rank_, world_, connected_, regions_, w, &r); rc != kOk) return rc;
    const int k = int(lanes_.size());
    const WriteShards sh(w.len, k, min_shard_.load(), kShardAlign, w.has_imm);
    if (max_msg_ > 0 && sh.bytes(0) > max_msg_)
      return set_error(kErrInvalid, prefix() + "post_write to peer " + std::to_string(w.peer) + ": a shard of " +
                                        std::to_string(sh.bytes(0)) + " bytes is more than " + prov_ +
                                        " carries in one write (" + std::to_string(max_msg_) + ")");
    Peer& pr = *peers_[size_t(w.peer)];
    const uint64_t wr = next_wr_++;
    *wr_id = wr;
    st->wr = wr, st->peer = w.peer, st->has_imm = w.has_imm, st->imm = w.imm;
    const int64_t n = pr.writes_posted++;
    if (std::string why = cut_.cuts(w.peer, n); !why.empty()) lose_peer(w.peer, why);
    const RemoteRegion* rr = remote_region(pr.mr, w.remote_key, w.remote_off, w.len);
    if (!rr) {
      cq_.push(wr, w.peer, pr.lost ? int32_t(kCqPeerLost) : int32_t(kCqRemoteAccess));
      return kOk;
    }
    const int added = cq_.add(wr, w.peer, uint32_t(sh.posts()), pr.lost, 1024, steady_now_ns() + op_timeout_ns_.load());
    if (added == 0) return kOk;
    if (added < 0)
      return set_error(kErrTimeout, prefix() + "post_write to peer " + std::to_string(w.peer) +
                                        ": 1024 writes still pending after the op timeout");
    static char zero[1];
    for (int s = 0; s < k; ++s) {
      if (!sh.posted(s)) continue;
      const uint64_t off = sh.at(s);
      const int i = int((uint64_t(s) + uint64_t(n)) % uint64_t(k));
      st->shard[st->shards++] = Staged::Shard{i, r.len ? r.ptr + w.local_off + off : zero, sh.bytes(s),
                                              (mode_ & fi::MR_LOCAL) && !r.mr.empty() ? r.mr[size_t(i)].desc : nullptr,
                                              rr->base + w.remote_off + off, rr->key[size_t(i)]};
      st->lanes |= uint64_t(1) << i;
    }
    return kOk;
  }
  // The endpoints write w's shards will go out on, should it be posted next (bit i: endpoint i).
  uint64_t lanes_of(const WriteOp& w) const {
    if (w.peer < 0 || size_t(w.peer) >= peers_.size() || w.peer == rank_) return 0;
    const int k = int(lanes_.size());
    const WriteShards sh(w.len, k, min_shard_.load(), kShardAlign, w.has_imm);
    const int64_t n = peers_[size_t(w.peer)]->writes_posted;
    uint64_t m = 0;
    for (int s = 0; s < k; ++s)
      if (sh.posted(s)) m |= uint64_t(1) << ((uint64_t(s) + uint64_t(n)) % uint64_t(k));
    return m;
  }
  // Posts a staged write's shards; FI_MORE on those whose endpoint is in `more`.
  int issue(const Staged& st, uint64_t more) {
    if (st.shards == 0) return kOk;
    Peer& pr = *peers_[size_t(st.peer)];
    const int64_t deadline = steady_now_ns() + op_timeout_ns_.load();
    for (int j = 0; j < st.shards; ++j) {
      const Staged::Shard& x = st.shard[j];
      Lane& l = *lanes_[size_t(x.lane)];
      Op* op = new_op(OpKind::Write, st.peer);
      op->wr = st.wr;
      iovec iov{x.src, size_t(x.bytes)};
      void* desc = x.desc;
      const fi::rma_iov riov{x.addr, size_t(x.bytes), x.key};
      const fi::msg_rma msg{&iov, &desc, 1, l.peer_addr[size_t(st.peer)], &riov, 1, op, st.imm};
      // (fi_writemsg's flags replace the endpoint's default op_flags, which fi_writedata uses: kept)
      const uint64_t flags = (l.info && l.info->tx ? l.info->tx->op_flags : 0) | (st.has_imm ? fi::REMOTE_CQ_DATA : 0) |
                             ((more >> x.lane) & 1 ? fi::MORE : 0);
      ssize_t rc;
      for (;;) {
        rc = l.ep->rma->writemsg(l.ep, &msg, flags);
        if (rc != -fi::EAGAIN_ || pr.lost || steady_now_ns() >= deadline) break;
        std::this_thread::sleep_for(std::chrono::microseconds(5));
      }
      if (rc == 0) l.kicked_ns.store(steady_now_ns(), std::memory_order_relaxed);
      if (rc != 0 && pr.lost) {  // lost meanwhile: lose_peer completed the write as lost
        free_op(op);
        return kOk;
      }
      if (rc != 0) {
        free_op(op);
        cq_.remove(st.wr);
        const std::string why = "fi_writemsg failed: " +
                                (rc == -fi::EAGAIN_ && !pr.lost ? std::string("still -FI_EAGAIN at the op timeout")
                                                                : api_.strerror(int(-rc)));
        lose_peer(st.peer, why, kCqPeerLost, x.lane);
        return set_error(kErrPeer, prefix() + "post_write to peer " + std::to_string(st.peer) + " (" + l.where + "): " + why);
      }
    }
    return kOk;
  }
  // The provider name in an endpoint string: ';' (a layering, "tcp;ofi_rxm") written as '+'.
  std::string wire_prov() const {
    std::string s = prov_;
    std::replace(s.begin(), s.end(), ';', '+');
    return s;
  }
  int fi_error(int rc, const std::string& what) {
    return set_error(kErrSystem, prefix() + what + " failed: " + api_.strerror(rc < 0 ? -rc : rc) + " (" +
                                     std::to_string(rc) + ")");
  }
  char* hello_slot(Lane& l, int p) { return l.buf.data() + (size_t(nrecv_) + size_t(p)) * kSlot; }
  char* bye_slot(Lane& l, int p) { return l.buf.data() + (size_t(nrecv_) + size_t(world_) + size_t(p)) * kSlot; }
  char* ping_slot(Lane& l, int p) { return l.buf.data() + (size_t(nrecv_) + 2 * size_t(world_) + size_t(p)) * kSlot; }

  Op* new_op(OpKind kind, int peer) {
    Op* o = new Op;
    std::memset(o->prov, 0, sizeof(o->prov));
    o->kind = kind;
    o->peer = peer;
    std::lock_guard<std::mutex> lk(ops_mu_);
    ops_.insert(o);
    return o;
  }
  void free_op(Op* o) {
    {
      std::lock_guard<std::mutex> lk(ops_mu_);
      ops_.erase(o);
    }
    delete o;
  }

  // fi_mr_regattr of [ptr, ptr + len) on endpoint i's domain, honouring the mr_mode in use:
  // requested key `requested` (unique per domain; FI_MR_PROV_KEY: the provider's, read with
  // fi_mr_key either way), device memory as FI_HMEM_CUDA, bound to the endpoint and enabled
  // under FI_MR_ENDPOINT (a forced bit the provider does without may answer -FI_ENOSYS).
  int reg(int i, void* ptr, uint64_t len, uint64_t access, uint64_t requested, MrOnLane* out) {
    Lane& l = *lanes_[size_t(i)];
    iovec iov{ptr, size_t(len)};
    fi::mr_attr a{};
    a.mr_iov = &iov;
    a.iov_count = 1;
    a.access = access;
    a.requested_key = requested;
    a.iface = fi::HMEM_SYSTEM;
    if (memory_type(ptr) == MemType::Device) {
      if (!(l.info->caps & fi::HMEM))
        return set_error(kErrInvalid, prefix() + l.where + ": registering GPU memory needs FI_HMEM, which " + prov_ +
                                          " does not offer");
      a.iface = fi::HMEM_CUDA;
    }
    fi::fid_mr* mr = nullptr;
    if (int rc = l.domain->mr->regattr(&l.domain->fid_, &a, 0, &mr); rc != 0)
      return fi_error(rc, l.where + ": fi_mr_regattr of " + std::to_string(len) + " bytes");
    if (mode_ & fi::MR_ENDPOINT) {
      const bool needed = prov_mode_ & fi::MR_ENDPOINT;
      int rc = mr->fid_.ops->bind(&mr->fid_, &l.ep->fid_, 0);
      if (rc == 0) rc = mr->fid_.ops->control(&mr->fid_, fi::CONTROL_ENABLE, nullptr);
      if (rc != 0 && (needed || rc != -fi::ENOSYS_)) {
        mr->fid_.ops->close(&mr->fid_);
        return fi_error(rc, l.where + ": binding a memory region to the endpoint (FI_MR_ENDPOINT)");
      }
    }
    out->mr = mr;
    out->desc = mr->mem_desc;
    out->key = mr->key;
    return kOk;
  }

  int post_recv(int i, int s) {
    Lane& l = *lanes_[size_t(i)];
    Op* op = &l.recv[size_t(s)];
    std::memset(op->prov, 0, sizeof(op->prov));
    ssize_t rc;
    do {
      rc = l.ep->msg->recv(l.ep, l.buf.data() + size_t(s) * kSlot, kSlot, (mode_ & fi::MR_LOCAL) ? l.buf_desc : nullptr,
                           ~0ull /* FI_ADDR_UNSPEC */, op);
    } while (rc == -fi::EAGAIN_ && !stop_);
    return int(rc);
  }

  // fi_send of `len` bytes at `src` (a slot of endpoint i's buffer) to peer p; -FI_EAGAIN retried
  // until `deadline` (0: not retried). 0, or the negative libfabric error.
  ssize_t send_msg(int p, int i, char* src, size_t len, Op* op, int64_t deadline) {
    Lane& l = *lanes_[size_t(i)];
    for (;;) {
      const ssize_t rc = l.ep->msg->send(l.ep, src, len, (mode_ & fi::MR_LOCAL) ? l.buf_desc : nullptr,
                                         l.peer_addr[size_t(p)], op);
      if (rc != -fi::EAGAIN_ || steady_now_ns() >= deadline || stop_) return rc;
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  int send_hello(int p, int i, int64_t deadline) {
    Link& ln = *peers_[size_t(p)]->link[size_t(i)];
    const uint32_t attempt = ++ln.hello_attempt;
    ln.hello_status = -1;
    Op* op = new_op(OpKind::Hello, p);
    op->attempt = attempt;
    const ssize_t rc = send_msg(p, i, hello_slot(*lanes_[size_t(i)], p), sizeof(WireHello), op, deadline);
    if (rc != 0) {
      free_op(op);
      if (rc == -fi::EAGAIN_) {  // the deadline came first: connect reports the timeout
        ln.hello_status = fi::EAGAIN_;
        return kOk;
      }
      return fi_error(int(rc), "connect: peer " + std::to_string(p) + " (" + lanes_[size_t(i)]->where + "): sending the hello");
    }
    return kOk;
  }

  // The goodbye to peer p (if it is up) on endpoint i: a message from its slot of the buffer.
  void send_goodbye(int p, int i, const Goodbye& g, int64_t deadline) {
    if (!peers_[size_t(p)]->up) return;
    Link& ln = *peers_[size_t(p)]->link[size_t(i)];
    char* at = bye_slot(*lanes_[size_t(i)], p);
    const WireGoodbye w = make_goodbye(id_, rank_, p, world_, g);
    std::memcpy(at, &w, sizeof(w));
    ln.bye_status = -1;
    Op* op = new_op(OpKind::Bye, p);
    if (send_msg(p, i, at, sizeof(w), op, deadline) != 0) {
      free_op(op);
      ln.bye_status = -2;  // not sent: nothing to wait for
    }
  }

  int parse(int p, const std::string& ep, std::vector<std::vector<uint8_t>>* addrs) {
    const std::string bad = prefix() + "connect: bad libfabric endpoint of peer " + std::to_string(p) + " '" + ep + "'";
    std::unordered_map<std::string, std::string> kv;
    if (int rc = endpoint_fields(ep, "fabric1", bad, &kv); rc != kOk) return rc;
    const size_t k = lanes_.size();
    if (kv["prov"] != wire_prov())
      return set_error(kErrInvalid, prefix() + "connect: peer " + std::to_string(p) + " opened libfabric provider '" +
                                        kv["prov"] + "', this rank '" + wire_prov() + "': every rank must use the same one "
                                        "(MOE_EP_FI_PROVIDER)");
    Peer& pr = *peers_[size_t(p)];
    try {
      const size_t theirs = size_t(std::stoul(kv["eps"]));
      if (theirs != k)
        return set_error(kErrInvalid, prefix() + "connect: peer " + std::to_string(p) + " opened " + std::to_string(theirs) +
                                          " libfabric endpoints, this rank " + std::to_string(k) +
                                          ": every rank must open the same number");
      if (std::stoi(kv["rank"]) != p || std::stoi(kv["world"]) != world_)
        return set_error(kErrInvalid, bad + " (rank/world do not match: expected rank " + std::to_string(p) + " of world " +
                                          std::to_string(world_) + ")");
      addrs->clear();
      for (const auto& a : split(kv["addr"], '/')) {
        std::vector<uint8_t> raw;
        if (!unhex(a, &raw) || raw.empty()) return set_error(kErrInvalid, bad + " (bad addr)");
        addrs->push_back(raw);
      }
      if (addrs->size() != k) return set_error(kErrInvalid, bad + " (addr needs one entry per endpoint)");
      pr.mr.clear();
      for (const auto& m : split(kv["mr"], ',')) {
        auto parts = split(m, ':');
        if (parts.size() != 3) return set_error(kErrInvalid, bad + " (bad mr entry)");
        RemoteRegion rr{std::stoull(parts[0]), std::stoull(parts[1]), {}};
        for (const auto& x : split(parts[2], '/')) rr.key.push_back(std::stoull(x));
        if (rr.key.size() != k) return set_error(kErrInvalid, bad + " (an mr entry needs one key per endpoint)");
        pr.mr.push_back(rr);
      }
    } catch (const std::exception&) {
      return set_error(kErrInvalid, bad + " (a field is missing or not a number)");
    }
    return kOk;
  }

  // The peer is lost (first reason wins): its pending and later writes complete with `status`,
  // the ImmCounter fails. `lane`: the endpoint where it was noticed. `bye`: lost by its goodbye.
  void lose_peer(int p, const std::string& why, int32_t status = kCqPeerLost, int lane = 0, const Goodbye* bye = nullptr) {
    Peer& pr = *peers_[size_t(p)];
    std::string msg = loss_text(rank_, p, lanes_[size_t(lane)]->where, why);
    {
      std::lock_guard<std::mutex> lk(pr.mu);
      if (!mark_lost(pr, &msg, bye)) return;
    }
    cq_.fail_peer(p, status);
    conn_cv_.notify_all();
    imm_.fail(msg);
  }

  // ---- a completion thread per endpoint: reads its CQ (which is what progresses the provider),
  // spins kSpinNs after the last completion or post, then sleeps kSleepNs at a time, 200 us once
  // idle for 1 ms (between the phases of CPU ranks, whose kernels take milliseconds: their
  // wake-ups took the cores from the ranks), 1 ms once idle for 200 ms. Progress is manual on the
  // tcp, udp and efa providers: nothing lands in this rank's memory, and no write of its own
  // completes, between two reads, so a phase's latency is a few of these sleeps; the sleeps are
  // exact (1 us timer slack, not the default 50 us).

  void cq_loop(int i) {
#ifdef __linux__
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
#endif
    Lane& l = *lanes_[size_t(i)];
    fi::cq_data_entry e[32];
    int64_t idle_since = steady_now_ns();
    KeepaliveClock keepalive_clock(idle_since);
    while (!stop_) {
      const ssize_t n = l.cq->ops->read(l.cq, e, 32);
      const int64_t now = steady_now_ns();
      if (connected_ && keepalive_clock.due(now)) keepalive(i, now);
      if (n > 0) {
        for (ssize_t j = 0; j < n; ++j) handle(i, e[j]);
        idle_since = now;
        continue;
      }
      if (n == -fi::EAVAIL) {
        fi::cq_err_entry err{};
        if (l.cq->ops->readerr(l.cq, &err, 0) > 0) handle_error(i, err);
        idle_since = now;
        continue;
      }
      if (n != -fi::EAGAIN_) {
        for (int p = 0; p < world_; ++p)
          if (p != rank_) lose_peer(p, std::string("fi_cq_read failed: ") + api_.strerror(int(-n)), kCqPeerLost, i);
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      const int64_t idle = now - std::max(idle_since, l.kicked_ns.load(std::memory_order_relaxed));
      if (idle < kSpinNs) continue;
      std::this_thread::sleep_for(std::chrono::nanoseconds(idle < 1'000'000 ? kSleepNs : idle < 200'000'000 ? 200'000 : 1'000'000));
    }
  }

  // Keepalives of endpoint i (kKeepaliveNs): to each connected peer not lost, one at a time. A
  // peer none was delivered to for the op timeout is lost (rxd and efa complete one only once the
  // peer acknowledged it; rxm answers -FI_EAGAIN for good once the peer's socket is gone): the
  // rule a write is held to, so a peer slow enough to miss keepalives for a while but not lost by
  // its writes is not lost by them either, and one silent since before a wait as long as the op
  // timeout (the proxy's phase deadline: 30 s by default, as the op timeout) is lost, named as
  // such, by the time that wait would end. docs/ARCHITECTURE.md §9, "Lost peers".
  void keepalive(int i, int64_t now) {
    Lane& l = *lanes_[size_t(i)];
    const int64_t window = op_timeout_ns_.load();
    for (int p = 0; p < world_; ++p) {
      Peer& pr = *peers_[size_t(p)];
      if (p == rank_ || !pr.up || pr.lost) continue;
      Link& ln = *pr.link[size_t(i)];
      if (now - ln.alive_ns.load() > window) {
        char s[32];
        std::snprintf(s, sizeof(s), "%g", double(window) / 1e9);
        lose_peer(p, std::string("no keepalive message reached it for ") + s + " s, the op timeout (" +
                         (ln.probing ? "one is still not acknowledged" : "posting one answers -FI_EAGAIN") +
                         "; its process or node is gone)", kCqPeerLost, i);
        continue;
      }
      if (ln.probing || now - ln.probe_ns.load() < kKeepaliveNs) continue;
      Op* op = new_op(OpKind::Ping, p);
      ln.probing = true;
      ln.probe_ns = now;
      const ssize_t rc = send_msg(p, i, ping_slot(l, p), sizeof(kMagicPing), op, 0);
      if (rc != 0) {
        free_op(op);
        ln.probing = false;
        if (rc != -fi::EAGAIN_)
          lose_peer(p, std::string("sending a keepalive message failed: ") + api_.strerror(int(-rc)), kCqPeerLost, i);
        else
          ln.probe_ns = now - kKeepaliveNs + kKeepaliveNs / 8;  // try again soon
      }
    }
  }

  void handle(int i, const fi::cq_data_entry& e) {
    // A remote write with an immediate: only FI_REMOTE_CQ_DATA is relied on (rxm reports
    // FI_REMOTE_WRITE|FI_REMOTE_CQ_DATA with len 0, rxd and shm add FI_RMA and the length);
    // hellos, goodbyes and keepalives are sent without CQ data.
    if (e.flags & fi::REMOTE_CQ_DATA) {
      imm_.add(uint32_t(e.data), 1);
      return;
    }
    Op* op = static_cast<Op*>(e.op_context);
    if (!op) return;
    finish(i, op, 0, "", e.len);
  }

  std::string err_text(int i, const fi::cq_err_entry& e) const {
    char buf[256] = {0};
    const char* prov = lanes_[size_t(i)]->cq->ops->strerror(lanes_[size_t(i)]->cq, e.prov_errno, e.err_data, buf, sizeof(buf));
    return std::string(api_.strerror(e.err)) + " (error " + std::to_string(e.err) + ", provider error " +
           std::to_string(e.prov_errno) + (prov && *prov ? ": " + std::string(prov) : "") + ")";
  }

  void handle_error(int i, const fi::cq_err_entry& e) {
    Op* op = static_cast<Op*>(e.op_context);
    if (!op) return;
    finish(i, op, e.err ? e.err : 1, err_text(i, e), e.len);
  }

  // The completion of `op` on endpoint i: `err` 0, or the error with `text`.
  void finish(int i, Op* op, int err, const std::string& text, size_t len) {
    const int p = op->peer;
    switch (op->kind) {
      case OpKind::Recv:
        if (stop_) return;
        if (err == 0) on_message(i, op->slot, len);
        else if (err != 125 /* canceled */)
          refusals_.record(prefix() + "a message on " + lanes_[size_t(i)]->where + " failed to arrive: " + text);
        if (int rc = post_recv(i, op->slot); rc != 0 && !stop_)
          for (int q = 0; q < world_; ++q)
            if (q != rank_) lose_peer(q, "re-posting a receive failed", kCqPeerLost, i);
        return;
      case OpKind::Write: {
        const uint64_t wr = op->wr;
        free_op(op);
        if (err == 0) {
          bool completed = false;
          if (cq_.finish(wr, kCqOk, &completed) >= 0 && completed) cq_.notify();
          return;
        }
        if (cq_.peer_of(wr) < 0) return;  // already failed (peer lost, op timeout)
        lose_peer(p, "write " + std::to_string(wr) + " failed: " + text,
                  err == fi::EACCES_ ? kCqRemoteAccess : kCqPeerLost, i);
        return;
      }
      case OpKind::Hello: {
        Link& ln = *peers_[size_t(p)]->link[size_t(i)];
        const uint32_t attempt = op->attempt;
        free_op(op);
        if (attempt != ln.hello_attempt.load()) return;
        {
          std::lock_guard<std::mutex> lk(conn_mu_);
          ln.hello_status = err;
        }
        conn_cv_.notify_all();
        return;
      }
      case OpKind::Bye: {
        free_op(op);
        {
          std::lock_guard<std::mutex> lk(conn_mu_);
          peers_[size_t(p)]->link[size_t(i)]->bye_status = err;
        }
        conn_cv_.notify_all();
        return;
      }
      case OpKind::Ping: {
        free_op(op);
        Link& ln = *peers_[size_t(p)]->link[size_t(i)];
        if (err == 0) ln.alive_ns = steady_now_ns();
        ln.probing = false;
        if (err != 0 && !stop_)
          lose_peer(p, "keepalive message failed: " + text + " (its process or node is gone)", kCqPeerLost, i);
        return;
      }
    }
  }

  // A message landed in receive slot s of endpoint i: a hello, a goodbye or a keepalive. Any
  // process that knows this endpoint's address can send one (FI_EP_RDM has no connection to
  // vouch for it), so hellos and goodbyes carry and are checked for the job identity.
  void on_message(int i, int s, size_t len) {
    const char* at = lanes_[size_t(i)]->buf.data() + size_t(s) * kSlot;
    uint32_t magic = 0;
    if (len >= sizeof(magic)) std::memcpy(&magic, at, sizeof(magic));
    if (magic == kMagicPing && len == sizeof(magic)) return;
    if (magic == kMagicGoodbye) return on_goodbye(i, at, len);
    WireHello h{};
    std::memcpy(&h, at, std::min(len, sizeof(h)));
    std::string why = hello_mismatch(h, len, rank_, world_, id_);
    if (why.empty() && h.lane != i) why = "it says endpoint " + std::to_string(h.lane) + ", on endpoint " + std::to_string(i);
    if (!why.empty()) {
      refusals_.record(prefix() + "refused a hello on " + lanes_[size_t(i)]->where + ": " + why);
      std::lock_guard<std::mutex> lk(conn_mu_);
      last_refused_ = why;
      return;
    }
    {
      std::lock_guard<std::mutex> lk(conn_mu_);
      peers_[size_t(h.src_rank)]->link[size_t(i)]->hello_recv = true;
    }
    conn_cv_.notify_all();
  }

  // A goodbye: trusted from a rank whose hello passed on this endpoint, checked as a hello is.
  // After an error the peer is lost at once, by what it said; a clean one is remembered for the
  // loss that follows. Anything else is refused with one line.
  void on_goodbye(int i, const char* at, size_t len) {
    WireGoodbye g{};
    std::memcpy(&g, at, std::min(len, sizeof(g)));
    const int src = g.src_rank;
    std::string why = src < 0 || src >= world_ || src == rank_ ? "a goodbye saying rank " + std::to_string(src) + " (not a peer)"
                                                              : goodbye_mismatch(g, len, src, rank_, world_, id_);
    if (why.empty() && !peers_[size_t(src)]->link[size_t(i)]->hello_recv)
      why = "no hello of rank " + std::to_string(src) + " passed";
    if (!why.empty()) {
      refusals_.record(prefix() + "refused a goodbye on " + lanes_[size_t(i)]->where + ": " + why);
      return;
    }
    take_goodbye(g, world_, *peers_[size_t(src)],
                 [&](const std::string& text, const Goodbye& bye) { lose_peer(src, text, kCqPeerLost, i, &bye); });
  }

  const fi::Api& api_;
  const JobIdentity id_;
  const int force_;
  std::vector<fi::info*> chosen_;  // one per domain
  std::string prov_, dom_;         // dom_: the domains, ','-joined
  std::vector<std::string> domains_;
  std::vector<std::string> fabric_names_;
  std::vector<fi::fid_fabric*> fabrics_;  // one per fabric name
  int prov_mode_ = 0, mode_ = 0;
  uint64_t max_msg_ = 0;
  int nrecv_ = 0;
  std::vector<std::unique_ptr<Lane>> lanes_;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::string last_refused_;  // under conn_mu_
  std::mutex reg_mu_;
  RegionTable<Region> regions_;
  std::mutex ops_mu_;
  std::unordered_set<Op*> ops_;  // operations posted and not completed (freed by the destructor)
};

}  // namespace

namespace {

// "a,b" -> {"a", "b"}; "" -> {""} (the provider's first domain). Empty entries are dropped.
std::vector<std::string> domain_list(const std::string& domains) {
  std::vector<std::string> out;
  for (const auto& d : split(domains, ','))
    if (!d.empty()) out.push_back(d);
  if (out.empty()) out.push_back("");
  return out;
}

// The fi_info of every domain in `doms`, all of one provider (`prov`, or the one the first
// domain's choice took); empty with *why on failure (the caller frees what it got).
std::vector<fi::info*> choose_infos(const fi::Api& api, const std::string& prov, const std::vector<std::string>& doms,
                                    std::string* why) {
  std::vector<fi::info*> out;
  for (size_t i = 0; i < doms.size(); ++i) {
    const std::string p = prov.empty() && !out.empty() ? std::string(out.front()->fabric->prov_name) : prov;
    fi::info* info = fi::choose_info(api, p, doms[i], why);
    if (!info) {
      if (doms.size() > 1) *why = "domain " + std::to_string(i + 1) + " of " + std::to_string(doms.size()) + ": " + *why;
      for (fi::info* f : out) api.freeinfo(f);
      return {};
    }
    out.push_back(info);
  }
  return out;
}

}  // namespace

Transport* create_fabric_transport(int rank, int world, const std::string& provider, const std::string& domain,
                                   int endpoints, int force_mr_mode, const JobIdentity& id) {
  const std::string pre = "rank " + std::to_string(rank) + ": ";
  if (bad_rank(rank, world)) return nullptr;
  const std::string prov = fi::provider_wanted(provider);
  const std::vector<std::string> doms = domain_list(fi::domain_wanted(domain));
  const int n = int(doms.size());
  if (endpoints == 0) endpoints = n;
  if (endpoints < 1 || endpoints > kMaxEndpoints)
    return set_error(kErrInvalid, pre + "libfabric: " + std::to_string(endpoints) + " endpoints asked for (1.." +
                                      std::to_string(kMaxEndpoints) + ")"), nullptr;
  if (endpoints % n != 0)
    return set_error(kErrInvalid, pre + "libfabric: " + std::to_string(endpoints) + " endpoints over " +
                                      std::to_string(n) + " domains: expected a multiple of the domains listed"), nullptr;
  if (force_mr_mode & ~fi::kMrModeAsked)
    return set_error(kErrInvalid, pre + "libfabric: force_mr_mode " + std::to_string(force_mr_mode) +
                                      " has bits other than " + fi::mr_mode_names(fi::kMrModeAsked)), nullptr;
  std::string why;
  const fi::Api* api = fi::load_fabric(&why);
  if (!api) return set_error(kErrInvalid, pre + "libfabric transport not available: " + why), nullptr;
  const std::vector<fi::info*> infos = choose_infos(*api, prov, doms, &why);
  if (infos.empty()) return set_error(kErrInvalid, pre + "libfabric transport not available: " + why), nullptr;
  return started(new FabricTransport(rank, world, *api, id, force_mr_mode), infos, endpoints);
}

bool fabric_probe(const std::string& provider, const std::string& domain, std::string* what) {
  std::string why;
  const fi::Api* api = fi::load_fabric(&why);
  if (!api) {
    *what = why;
    return false;
  }
  const std::vector<fi::info*> infos = choose_infos(*api, fi::provider_wanted(provider),
                                                    domain_list(fi::domain_wanted(domain)), &why);
  if (infos.empty()) {
    *what = why;
    return false;
  }
  const fi::info* info = infos.front();
  std::string doms;
  for (const fi::info* i : infos) doms += (doms.empty() ? "" : ",") + std::string(i->domain->name);
  *what = std::string("provider ") + info->fabric->prov_name + (infos.size() > 1 ? " domains " : " domain ") + doms +
          " (mr_mode " + fi::mr_mode_names(info->domain->mr_mode) + ", cq_data_size " +
          std::to_string(info->domain->cq_data_size) + ")";
  for (fi::info* i : infos) api->freeinfo(i);
  return true;
}

std::string fabric_describe(Transport* t) {
  auto* f = dynamic_cast<FabricTransport*>(t);
  return f ? f->describe() : "";
}

}  // namespace moe_ep
