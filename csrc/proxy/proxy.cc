// Proxy: dispatch rounds D1/D2 and the combine write C, driven by mailbox doorbells
// (docs/ARCHITECTURE.md §10). See proxy.h.
#include "proxy.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <exception>
#include <algorithm>

#ifdef __linux__
#include <sys/prctl.h>
#endif

namespace moe_ep {

namespace {
int64_t mono_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
int64_t thread_cpu_ns() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return int64_t(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}
std::string seconds(int64_t ns) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", double(ns) / 1e9);
  return b;
}
const char* phase_name(int ph) { return ph == kPhaseD1 ? "dispatch round 1" : ph == kPhaseD2 ? "dispatch round 2" : "combine"; }
}  // namespace

void proxy_region_bytes(const ProxyConfig& c, uint64_t out[kNumRegions]) {
  const int64_t hdr = proxy_hdr_bytes(c.world_size, c.num_local_experts);
  const int64_t n_remote = c.world_size - c.node_size;
  out[kRegDispSend] = uint64_t((c.world_size - 1) * hdr + c.max_send_rows * c.row_bytes);
  // The three regions peers write into hold two copies each, picked by epoch & 1 (§10).
  out[kRegRound1] = uint64_t(2 * c.world_size * (hdr + c.private_capacity * c.row_bytes));
  out[kRegOverflow] = uint64_t(2 * c.overflow_capacity * c.row_bytes);
  out[kRegCombSend] = uint64_t((n_remote * c.private_capacity + c.overflow_capacity) * c.comb_row_bytes);
  out[kRegCombRecv] = uint64_t(2 * c.max_send_rows * c.comb_row_bytes);
}

Proxy* Proxy::create(Transport* t, const ProxyConfig& cfg, void* const regions[kNumRegions],
                     const uint64_t lens[kNumRegions], int64_t* mailbox, uint64_t mailbox_words) {
  const std::string pre = "rank " + std::to_string(cfg.rank) + ": proxy: ";
  if (!t) return set_error(kErrInvalid, pre + "no transport"), nullptr;
  if (cfg.world_size < 2 || cfg.rank < 0 || cfg.rank >= cfg.world_size || cfg.node_size < 1 ||
      cfg.world_size % cfg.node_size != 0 || cfg.num_local_experts < 0 || cfg.row_bytes < 0 ||
      cfg.comb_row_bytes < 0 || cfg.private_capacity < 0 || cfg.overflow_capacity < 0 || cfg.max_send_rows < 0 ||
      cfg.timeout_ns <= 0 || cfg.spin_ns < 0 || cfg.sleep_ns < 0)
    return set_error(kErrInvalid, pre + "bad config"), nullptr;
  if (cfg.world_size > kImmMaxRanks)
    return set_error(kErrInvalid, pre + "world_size " + std::to_string(cfg.world_size) + " exceeds " +
                                      std::to_string(kImmMaxRanks) + ", the most ranks the " +
                                      std::to_string(kImmSrcBits) + " source bits of an immediate can name"),
           nullptr;
  if (t->rank() != cfg.rank || t->world() != cfg.world_size)
    return set_error(kErrInvalid, pre + "config rank/world do not match the transport's"), nullptr;
  if (!mailbox || mailbox_words < uint64_t(kMbWords) || (reinterpret_cast<uintptr_t>(mailbox) & 7))
    return set_error(kErrInvalid, pre + "mailbox must be " + std::to_string(int(kMbWords)) + " aligned int64 words"),
           nullptr;
  uint64_t need[kNumRegions];
  proxy_region_bytes(cfg, need);
  static const char* names[kNumRegions] = {"dispatch send", "round-1", "overflow", "combine send", "combine receive"};
  for (int i = 0; i < kNumRegions; ++i)
    if (lens[i] < need[i] || (lens[i] > 0 && !regions[i]))
      return set_error(kErrInvalid, pre + std::string(names[i]) + " region has " + std::to_string(lens[i]) +
                                        " bytes, needs " + std::to_string(need[i])),
             nullptr;
  Proxy* p = new Proxy();
  p->t_ = t;
  p->cfg_ = cfg;
  p->hdr_ = proxy_hdr_bytes(cfg.world_size, cfg.num_local_experts);
  p->mb_ = mailbox;
  p->posted_to_.assign(size_t(cfg.world_size), 0);
  for (int i = 0; i < kNumRegions; ++i) {
    p->reg_[i] = static_cast<char*>(regions[i]);
    p->len_[i] = lens[i];
    if (const int rc = t->register_memory(regions[i], lens[i], &p->keys_[i]); rc != kOk) {
      delete p;
      return nullptr;
    }
  }
  return p;
}

Proxy::~Proxy() { stop(); }

int Proxy::start() {
  if (started_.exchange(true)) return set_error(kErrInvalid, "rank " + std::to_string(cfg_.rank) + ": proxy already started");
  try {
    thr_ = std::thread([this] { loop(); });
  } catch (const std::exception& e) {
    return set_error(kErrSystem, "rank " + std::to_string(cfg_.rank) + ": proxy thread: " + e.what());
  }
  return kOk;
}

void Proxy::stop() {
  stop_ = true;
  if (thr_.joinable()) thr_.join();
}

std::string Proxy::error_message() {
  std::lock_guard<std::mutex> lk(msg_mu_);
  return msg_;
}

bool Proxy::fail(int64_t code, int peer, int phase, int64_t epoch, const std::string& msg) {
  {
    std::lock_guard<std::mutex> lk(msg_mu_);
    msg_ = "rank " + std::to_string(cfg_.rank) + ": " + phase_name(phase) + " epoch " + std::to_string(epoch) + ": " + msg;
  }
  store(kMbErrPeer, peer);
  store(kMbErrPhase, phase);
  store(kMbErrEpoch, epoch);
  store(kMbErrCode, code);  // last: a reader that sees the code sees the rest
  return false;
}

int Proxy::lost_peer() {
  // The transports fail the ImmCounter with the first lost peer's error message: that peer is
  // the root cause (peers that went away after it, e.g. survivors closing their buffers, are not).
  std::string first;
  if (t_->imm_counter().failed(&first))
    for (int p = 0; p < cfg_.world_size; ++p)
      if (p != cfg_.rank && t_->peer_error(p) == first) return p;
  for (int p = 0; p < cfg_.world_size; ++p)
    if (p != cfg_.rank && !t_->peer_error(p).empty()) return p;
  return -1;
}

bool Proxy::fail_lost(int peer, int phase, int64_t epoch, const std::string& msg) {
  const int first = lost_peer();
  if (first < 0 || first == peer) return fail(kProxyPeerLost, peer, phase, epoch, msg);
  const std::string why = t_->peer_error(first);
  if (peer < 0 || msg == why) return fail(kProxyPeerLost, first, phase, epoch, msg);
  return fail(kProxyPeerLost, first, phase, epoch, why + " (the first peer lost; then " + msg + ")");
}

void Proxy::record(int64_t kind, int64_t epoch, int64_t seen, int64_t mid, int64_t ready, int64_t cpu) {
  std::lock_guard<std::mutex> lk(rec_mu_);
  if (rec_.empty()) rec_.resize(kMaxRecords);
  rec_[size_t(n_rec_ % kMaxRecords)] = PhaseRecord{kind, epoch, seen, mid, ready, cpu};
  ++n_rec_;
}

int Proxy::phase_records(PhaseRecord* out, int max) {
  std::lock_guard<std::mutex> lk(rec_mu_);
  const int64_t n = std::min<int64_t>({int64_t(std::max(max, 0)), n_rec_, int64_t(kMaxRecords)});
  for (int64_t i = 0; i < n; ++i) out[i] = rec_[size_t((n_rec_ - n + i) % kMaxRecords)];
  return int(n);
}

void Proxy::loop() {
#ifdef __linux__
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // idle polls sleep sleep_ns, not sleep_ns + 50 us
#endif
  int64_t idle_since = mono_ns();
  while (!stop_) {
    if (load(kMbErrCode) != kProxyOk) break;  // an error stops the proxy (the buffer is broken)
    bool worked = false;
    const int64_t cd = load(kMbCombDoorbell), dd = load(kMbDispDoorbell);
    // A combine for the latest dispatch goes first; dispatch epochs only grow.
    if (cd != last_comb_ && cd > last_comb_ && cd == counts_epoch_) {
      last_comb_ = cd;
      const int64_t t0 = mono_ns(), c0 = thread_cpu_ns();
      if (!run_combine(cd)) break;
      // The record and the count first, then the ready word (release): a caller that sees
      // ready sees the phase counted and recorded.
      const int64_t t1 = mono_ns();
      record(1, cd, t0, t1, t1, thread_cpu_ns() - c0);
      phases_done_.fetch_add(1, std::memory_order_release);
      store(kMbCombReady, cd);
      worked = true;
    } else if (dd != last_disp_) {
      if (dd < last_disp_ || dd <= 0) {
        fail(kProxyInvalid, -1, kPhaseD1, dd,
             "dispatch doorbell went from epoch " + std::to_string(last_disp_) + " to " + std::to_string(dd));
        break;
      }
      last_disp_ = dd;
      const int64_t t0 = mono_ns(), c0 = thread_cpu_ns();
      if (!run_dispatch(dd)) break;
      record(0, dd, t0, mid_ns_, mono_ns(), thread_cpu_ns() - c0);
      phases_done_.fetch_add(1, std::memory_order_release);
      store(kMbDispReady, dd);  // last, as for combine
      worked = true;
    } else if (cd != last_comb_) {
      fail(kProxyInvalid, -1, kPhaseC, cd,
           "combine doorbell for epoch " + std::to_string(cd) + " but the last dispatch was epoch " +
               std::to_string(counts_epoch_));
      break;
    }
    const int64_t now = mono_ns();
    if (worked) {
      idle_since = now;
    } else if (now - idle_since > cfg_.spin_ns) {
      std::this_thread::sleep_for(std::chrono::nanoseconds(cfg_.sleep_ns));
    }
  }
}

bool Proxy::post(int phase, int64_t epoch, int peer, int lreg, uint64_t loff, int rreg, uint64_t roff, uint64_t len) {
  uint64_t wr = 0;
  const int rc = t_->post_write(peer, keys_[lreg], loff, keys_[rreg], roff, len, true,
                                make_imm(phase, int(cfg_.rank), epoch), &wr);
  if (rc == kOk) {
    ++n_posted_;
    ++posted_to_[size_t(peer)];
    return true;
  }
  if (rc == kErrPeer) return fail_lost(peer, phase, epoch, "post_write: " + thread_error());
  return fail(kProxyTransport, peer, phase, epoch, "post_write: " + thread_error());
}

bool Proxy::wait_imm(int phase, int64_t epoch, const std::vector<int>& from, int64_t deadline) {
  // One counter per source (the immediate carries it), each expecting exactly one write: the
  // transport's imm_per_write() immediates (one per NIC shard over verbs, empty shards included).
  std::vector<uint32_t> imms(from.size());
  for (size_t i = 0; i < from.size(); ++i) imms[i] = make_imm(phase, from[i], epoch);
  const int64_t per = t_->imm_per_write();
  const std::vector<int64_t> ones(from.size(), per);
  std::vector<int> missing;
  for (;;) {
    const int64_t now = mono_ns();
    if (stop_) return fail(kProxyTimeout, -1, phase, epoch, "proxy stopped while waiting");
    std::string err;
    const int rc = t_->imm_counter().wait_all(imms.data(), ones.data(), int(imms.size()),
                                              std::min<int64_t>(std::max<int64_t>(deadline - now, 0), 50'000'000),
                                              &err, &missing);
    if (rc == kOk) return true;
    if (rc == kErrPeer) return fail_lost(-1, phase, epoch, err);
    if (rc != kErrTimeout) return fail(kProxyTransport, -1, phase, epoch, err);
    if (mono_ns() >= deadline && !missing.empty()) {
      // `missing` is the counter's view at the deadline: the peers whose write never landed.
      std::string who;
      for (size_t i = 0; i < missing.size() && i < 8; ++i) who += (i ? ", " : "") + std::to_string(from[size_t(missing[i])]);
      if (missing.size() > 8) who += ", ...";
      const int first = from[size_t(missing[0])];
      std::string shards;  // several per write: how many of the first missing peer's landed
      if (per > 1)
        shards = "; " + std::to_string(t_->imm_counter().value(imms[size_t(missing[0])])) + " of its " +
                 std::to_string(per) + " shards landed";
      return fail(kProxyTimeout, first, phase, epoch,
                  "no immediate from peer " + std::to_string(first) + " within " + seconds(cfg_.timeout_ns) +
                      " s (" + std::to_string(missing.size()) + " of " + std::to_string(from.size()) +
                      " peers missing: " + who + shards + ")");
    }
  }
}

bool Proxy::wait_writes(int phase, int64_t epoch, int64_t deadline) {
  Completion cq[64];
  while (n_posted_ > 0) {
    const int64_t now = mono_ns();
    if (stop_) return fail(kProxyTimeout, -1, phase, epoch, "proxy stopped while waiting");
    if (now >= deadline) {
      const int peer = int(std::find_if(posted_to_.begin(), posted_to_.end(), [](int n) { return n > 0; }) -
                           posted_to_.begin());
      return fail(kProxyTimeout, peer < cfg_.world_size ? peer : -1, phase, epoch,
                  std::to_string(n_posted_) + " own writes not completed within " +
                      seconds(cfg_.timeout_ns) + " s (the first to peer " +
                      std::to_string(peer) + ")");
    }
    const int n = t_->poll(cq, 64, std::min<int64_t>(deadline - now, 50'000'000));
    if (n < 0) return fail(kProxyTransport, -1, phase, epoch, "poll: " + thread_error());
    for (int i = 0; i < n; ++i) {
      --n_posted_;
      const Completion& c = cq[i];
      if (c.peer >= 0 && c.peer < cfg_.world_size) --posted_to_[size_t(c.peer)];
      if (c.status == kCqOk) continue;
      std::string why = t_->peer_error(c.peer);
      if (why.empty()) why = "write to peer " + std::to_string(c.peer) + " failed with status " + std::to_string(c.status);
      if (c.status == kCqPeerLost || c.status == kCqTimeout) return fail_lost(c.peer, phase, epoch, why);
      return fail(kProxyTransport, c.peer, phase, epoch, why);
    }
  }
  return true;
}

bool Proxy::run_dispatch(int64_t epoch) {
  const int64_t deadline = mono_ns() + cfg_.timeout_ns;
  const int R = int(cfg_.world_size), me = int(cfg_.rank);
  const int64_t RB = cfg_.row_bytes, cap = cfg_.private_capacity, slot = hdr_ + cap * RB;
  // Parity copies: round-1 slots of epoch e at (e & 1) * R * slot, overflow at (e & 1) * ovcap.
  const uint64_t r1_base = uint64_t((epoch & 1) * R * slot);
  const uint64_t ov_base = uint64_t((epoch & 1) * cfg_.overflow_capacity * RB);
  n_posted_ = 0;
  std::fill(posted_to_.begin(), posted_to_.end(), 0);
  // Own count vector: HDR of the first peer, at offset 0 of the send buffer.
  std::vector<int32_t> C(size_t(R) * R);
  std::memcpy(&C[size_t(me) * R], reg_[kRegDispSend], 4 * size_t(R));
  int64_t rows = 0;
  for (int p = 0; p < R; ++p) {
    const int32_t c = C[size_t(me) * R + p];
    if (c < 0) return fail(kProxyInvalid, p, kPhaseD1, epoch, "negative count for peer " + std::to_string(p));
    if (p != me && remote(p)) rows += c;
  }
  if (rows > cfg_.max_send_rows)
    return fail(kProxyInvalid, -1, kPhaseD1, epoch,
                std::to_string(rows) + " rows to remote peers exceed the send buffer's " +
                    std::to_string(cfg_.max_send_rows));
  // Round 1: HDR_p (+ the first min(c, cap) rows for remote p) into p's round-1 slot [me].
  std::vector<uint64_t> off(R, 0);
  uint64_t o = 0;
  for (int p = 0; p < R; ++p) {
    if (p == me) continue;
    off[p] = o;
    o += uint64_t(hdr_ + (remote(p) ? C[size_t(me) * R + p] : 0) * RB);
  }
  for (int p = 0; p < R; ++p) {
    if (p == me) continue;
    const int64_t n1 = remote(p) ? std::min<int64_t>(C[size_t(me) * R + p], cap) : 0;
    if (!post(kPhaseD1, epoch, p, kRegDispSend, off[p], kRegRound1, r1_base + uint64_t(me * slot), uint64_t(hdr_ + n1 * RB)))
      return false;
  }
  std::vector<int> from;  // the ranks this phase expects one immediate from
  for (int s = 0; s < R; ++s)
    if (s != me) from.push_back(s);
  if (!wait_imm(kPhaseD1, epoch, from, deadline)) return false;
  mid_ns_ = mono_ns();
  for (int s = 0; s < R; ++s) {
    if (s == me) continue;
    std::memcpy(&C[size_t(s) * R], reg_[kRegRound1] + r1_base + uint64_t(s * slot), 4 * size_t(R));
    for (int p = 0; p < R; ++p)
      if (C[size_t(s) * R + p] < 0)
        return fail(kProxyInvalid, s, kPhaseD1, epoch, "peer " + std::to_string(s) + " sent a negative count");
  }
  // Capacity: every rank checks every p's total overflow (same data, same decision everywhere).
  for (int p = 0; p < R; ++p) {
    int64_t tot = 0;
    for (int s = 0; s < R; ++s)
      if (s != p && s / cfg_.node_size != p / cfg_.node_size) tot += std::max<int64_t>(0, C[size_t(s) * R + p] - cap);
    if (tot > cfg_.overflow_capacity) {
      wait_writes(kPhaseD1, epoch, deadline);  // let round 1 finish (best effort); nothing more is written
      return fail(kProxyCapacity, p, kPhaseD2, epoch,
                  "rank " + std::to_string(p) + " would receive " + std::to_string(tot) +
                      " overflow rows, overflow_capacity is " + std::to_string(cfg_.overflow_capacity));
    }
  }
  // Round 2: the overflow rows to each remote p at sum of o_{s'p} over remote s' < me. Every rank
  // knows every o_{sp} from the count matrix, so only pairs with overflow exchange a write: p
  // expects one D2 immediate from each remote s with o_{sp} > 0 (none at all in a batch that
  // fits the private slots).
  for (int p = 0; p < R; ++p) {
    if (p == me || !remote(p)) continue;
    const int64_t c = C[size_t(me) * R + p], ov = std::max<int64_t>(0, c - cap);
    if (ov == 0) continue;
    int64_t roff = 0;
    for (int s = 0; s < me; ++s)
      if (s != p && s / cfg_.node_size != p / cfg_.node_size) roff += std::max<int64_t>(0, C[size_t(s) * R + p] - cap);
    const uint64_t loff = off[p] + uint64_t(hdr_ + std::min(c, cap) * RB);
    if (!post(kPhaseD2, epoch, p, kRegDispSend, loff, kRegOverflow, ov_base + uint64_t(roff * RB), uint64_t(ov * RB)))
      return false;
  }
  from.clear();
  for (int s = 0; s < R; ++s)
    if (s != me && remote(s) && C[size_t(s) * R + me] > cap) from.push_back(s);
  if (!wait_imm(kPhaseD2, epoch, from, deadline)) return false;
  if (!wait_writes(kPhaseD2, epoch, deadline)) return false;
  counts_.swap(C);
  counts_epoch_ = epoch;
  return true;
}

bool Proxy::run_combine(int64_t epoch) {
  const int64_t deadline = mono_ns() + cfg_.timeout_ns;
  const int R = int(cfg_.world_size), me = int(cfg_.rank);
  const int64_t CRB = cfg_.comb_row_bytes;
  const uint64_t cr_base = uint64_t((epoch & 1) * cfg_.max_send_rows * CRB);  // parity copy of s's region
  const auto& C = counts_;
  n_posted_ = 0;
  std::fill(posted_to_.begin(), posted_to_.end(), 0);
  // One write per remote pair with rows (both ends know c_{s,me}): s expects one C immediate
  // from each remote owner p with c_{s,p} > 0.
  uint64_t loff = 0;  // per remote source s, in rank order: c_{s,me} rows received from s
  for (int s = 0; s < R; ++s) {
    if (s == me || !remote(s)) continue;
    const int64_t n = C[size_t(s) * R + me];
    if (n == 0) continue;
    int64_t roff = 0;  // in s's combine receive region: sum of c_{s,p'} over remote p' < me
    for (int p = 0; p < me; ++p)
      if (p != s && p / cfg_.node_size != s / cfg_.node_size) roff += C[size_t(s) * R + p];
    if (!post(kPhaseC, epoch, s, kRegCombSend, loff, kRegCombRecv, cr_base + uint64_t(roff * CRB), uint64_t(n * CRB)))
      return false;
    loff += uint64_t(n * CRB);
  }
  std::vector<int> from;
  for (int p = 0; p < R; ++p)
    if (p != me && remote(p) && C[size_t(me) * R + p] > 0) from.push_back(p);
  if (!wait_imm(kPhaseC, epoch, from, deadline)) return false;
  return wait_writes(kPhaseC, epoch, deadline);
}

}  // namespace moe_ep
