// Proxy: dispatch rounds D1/D2 and the combine write C, driven by mailbox doorbells
// (docs/ARCHITECTURE.md §10). See proxy.h.
#include "proxy.h"

#include <chrono>
#include <climits>
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
// The trace's clock: the TSC on x86 (invariant on every CPU this runs on; trace() converts), else steady-clock ns.
#if defined(__x86_64__)
constexpr bool trace_tsc_ = true;
int64_t trace_clock() { return int64_t(__builtin_ia32_rdtsc()); }
#else
constexpr bool trace_tsc_ = false;
int64_t trace_clock() { return mono_ns(); }
#endif
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
// Sum of row[a..b) (0 when b <= a): vectorized, as the combine sums a row prefix per source.
__attribute__((optimize("tree-vectorize"))) int64_t sum_range(const int32_t* row, int a, int b) {
  int64_t s = 0;
  for (int p = a; p < b; ++p) s += row[p];
  return s;
}
const char* phase_name(int ph) { return ph == kPhaseD1 ? "dispatch round 1" : ph == kPhaseD2 ? "dispatch round 2" : "combine"; }
}  // namespace

void proxy_region_bytes(const ProxyConfig& c, uint64_t out[kNumRegions]) {
  const int64_t hdr = proxy_hdr_bytes(c.world_size, c.num_local_experts);
  const int64_t n_remote = c.world_size - c.node_size;
  out[kRegDispSend] = uint64_t(c.max_send_rows * c.row_bytes);
  // The four regions peers write into hold two copies each, picked by epoch & 1 (§10).
  out[kRegRound1] = uint64_t(2 * c.world_size * c.private_capacity * c.row_bytes);
  out[kRegOverflow] = uint64_t(2 * c.overflow_capacity * c.row_bytes);
  // (the combine returns overflow rows in the dispatch's windows: window 0 with the round-1 rows)
  out[kRegCombSend] = uint64_t((n_remote * c.private_capacity + c.overflow_capacity) * c.comb_row_bytes);
  out[kRegCombRecv] = uint64_t(2 * c.max_send_rows * c.comb_row_bytes);
  out[kRegHdrSend] = uint64_t(c.world_size * hdr);
  out[kRegHdrRecv] = uint64_t(2 * c.world_size * hdr);
}

Proxy* Proxy::create(Transport* t, const ProxyConfig& cfg, void* const regions[kNumRegions],
                     const uint64_t lens[kNumRegions], int64_t* mailbox, uint64_t mailbox_words) {
  const std::string pre = "rank " + std::to_string(cfg.rank) + ": proxy: ";
  if (!t) return set_error(kErrInvalid, pre + "no transport"), nullptr;
  if (cfg.world_size < 2 || cfg.rank < 0 || cfg.rank >= cfg.world_size || cfg.node_size < 1 ||
      cfg.world_size % cfg.node_size != 0 || cfg.num_local_experts < 0 || cfg.row_bytes < 0 ||
      cfg.comb_row_bytes < 0 || cfg.private_capacity < 0 || cfg.overflow_capacity < 0 || cfg.max_send_rows < 0 ||
      cfg.timeout_ns <= 0 || cfg.spin_ns < 0 || cfg.sleep_ns < 0 || cfg.trace_level < kTraceOff ||
      cfg.trace_level > kTracePeers)
    return set_error(kErrInvalid, pre + "bad config"), nullptr;
  if (cfg.world_size > kImmMaxRanks)
    return set_error(kErrInvalid, pre + "world_size " + std::to_string(cfg.world_size) + " exceeds " +
                                      std::to_string(kImmMaxRanks) + ", the most ranks the " +
                                      std::to_string(kImmSrcBits) + " source bits of an immediate can name"),
           nullptr;
  if (t->rank() != cfg.rank || t->world() != cfg.world_size)
    return set_error(kErrInvalid, pre + "config rank/world do not match the transport's"), nullptr;
  if (!mailbox || mailbox_words < uint64_t(mailbox_words_for(cfg.world_size)) || (reinterpret_cast<uintptr_t>(mailbox) & 7))
    return set_error(kErrInvalid, pre + "mailbox must be " + std::to_string(mailbox_words_for(cfg.world_size)) +
                                      " aligned int64 words"),
           nullptr;
  uint64_t need[kNumRegions];
  proxy_region_bytes(cfg, need);
  static const char* names[kNumRegions] = {"dispatch send", "round-1", "overflow", "combine send", "combine receive",
                                              "header send", "header receive"};
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
  const size_t R = size_t(cfg.world_size);
  p->posted_to_.assign(R, 0);
  p->node_g_ = int(cfg.node_size);
  p->my_lo_ = int(cfg.rank / cfg.node_size * cfg.node_size);
  for (int r = 0; r < int(R); ++r) p->node_lo_.push_back(int(r / cfg.node_size * cfg.node_size));
  const int64_t hdr = p->hdr_;
  for (int par = 0; par < 2; ++par) {
    p->own_[par].assign(R, 0);
    for (int s = 0; s < int(R); ++s)
      p->rows_[par].push_back(s == cfg.rank ? p->own_[par].data()
                                            : reinterpret_cast<const int32_t*>(static_cast<const char*>(regions[kRegHdrRecv]) +
                                                                               (par * int64_t(R) + s) * hdr));
  }
  for (int r = 0; r < int(R); ++r)
    if (r != cfg.rank) p->others_.push_back(r);
  p->todo_.reserve(R);
  p->off_.assign(R, 0);
  p->arrived_.reserve(4 * R);
  p->batch_.reserve(2 * R + 8);
  p->scratch_.assign(kHdrChunk * R, 0);
  p->ov_total_.assign(R, 0);
  t->imm_counter().enable_log();
  p->trace_.resize(kMaxTrace);
  p->ns0_ = mono_ns();
  p->tsc0_ = trace_clock();
  for (int i : {kRegRound1, kRegOverflow, kRegCombRecv})
    if (lens[i] > 0 && p->gdr_region_ < 0 && memory_type(regions[i]) == MemType::Device) p->gdr_region_ = i;
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
  // the root cause (peers that went away after it, e.g. survivors closing their buffers, are not),
  // unless it left with a clean goodbye (it had finished) and another was lost otherwise.
  std::string first;
  int clean = -1;
  if (t_->imm_counter().failed(&first))
    for (int p = 0; p < cfg_.world_size; ++p)
      if (p != cfg_.rank && t_->peer_error(p).rfind(first, 0) == 0) {  // (a late goodbye appends)
        if (!left_cleanly(p)) return p;
        clean = p;
      }
  for (int p = 0; p < cfg_.world_size; ++p)
    if (p != cfg_.rank && !t_->peer_error(p).empty() && !left_cleanly(p)) return p;
  if (clean >= 0) return clean;
  for (int p = 0; p < cfg_.world_size; ++p)
    if (p != cfg_.rank && !t_->peer_error(p).empty()) return p;
  return -1;
}

int Proxy::cause_of(int lost) {
  // A peer that closed after its own error said in its goodbye which peer that error names (the
  // transport keeps only a peer of this job other than the closer, in a known phase): that peer
  // is the cause, not the closer. Not this rank, though: a peer that gave up on it is the one lost.
  Goodbye g;
  if (lost < 0 || !t_->peer_goodbye(lost, &g) || !g.error || g.peer < 0 || g.peer >= cfg_.world_size ||
      g.peer == lost || g.peer == cfg_.rank)
    return lost;
  return g.peer;
}

bool Proxy::fail_lost(int peer, int phase, int64_t epoch, const std::string& msg) {
  const int first = lost_peer();
  if (first < 0) return fail(kProxyPeerLost, peer, phase, epoch, msg);
  // A link whose loss was noticed before its goodbye was read (the goodbye goes out before the
  // close, but a failed keepalive or write may be seen first): the goodbye is given a moment to
  // land, since it may name the cause. Only a failure waits, and at most kLateGoodbyeNs.
  Goodbye said;
  for (const int64_t until = mono_ns() + kLateGoodbyeNs; !t_->peer_goodbye(first, &said) && mono_ns() < until;)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const int cause = cause_of(first);
  // A peer that closed after a CapacityError: this rank fails with a capacity error too, naming
  // the rank over its cap (the goodbye's peer where trusted, else the closer), not a lost peer.
  Goodbye g;
  const int code = t_->peer_goodbye(first, &g) && g.error && g.code == kByeCapacity ? kProxyCapacity : kProxyPeerLost;
  const std::string why = t_->peer_error(first);  // names the goodbye's cause where there is one
  if (peer >= 0 && first != peer && msg != why)
    return fail(code, cause, phase, epoch, why + " (the first peer lost; then " + msg + ")");
  if (cause != first && msg.find(why) == std::string::npos)
    return fail(code, cause, phase, epoch, why + " (then " + msg + ")");
  return fail(code, cause, phase, epoch, msg);
}

void Proxy::record(const PhaseRecord& r) {
  std::lock_guard<std::mutex> lk(rec_mu_);
  if (rec_.empty()) rec_.resize(kMaxRecords);
  rec_[size_t(n_rec_ % kMaxRecords)] = r;
  ++n_rec_;
}

int Proxy::phase_records(PhaseRecord* out, int max) {
  std::lock_guard<std::mutex> lk(rec_mu_);
  const int64_t n = std::min<int64_t>({int64_t(std::max(max, 0)), n_rec_, int64_t(kMaxRecords)});
  for (int64_t i = 0; i < n; ++i) out[i] = rec_[size_t((n_rec_ - n + i) % kMaxRecords)];
  return int(n);
}

void Proxy::trace_event(int32_t kind, int peer, int64_t epoch) {
  // Single writer (the proxy thread), no lock: the slot's words first, then the count (release).
  // A time stamp is the TSC where there is one (a few ns; trace() turns it into steady-clock ns).
  const int64_t i = n_trace_.load(std::memory_order_relaxed);
  TraceEvent& ev = trace_[size_t(i % kMaxTrace)];
  __atomic_store_n(&ev.ns, trace_clock(), __ATOMIC_RELAXED);
  __atomic_store_n(&ev.epoch, epoch, __ATOMIC_RELAXED);
  __atomic_store_n(&ev.kind, kind, __ATOMIC_RELAXED);
  __atomic_store_n(&ev.peer, int32_t(peer), __ATOMIC_RELAXED);
  n_trace_.store(i + 1, std::memory_order_release);
}

int Proxy::trace(TraceEvent* out, int max) {
  std::lock_guard<std::mutex> lk(trace_mu_);  // (readers only)
  const int64_t end = n_trace_.load(std::memory_order_acquire);
  int64_t n = std::min<int64_t>({int64_t(std::max(max, 0)), end, int64_t(kMaxTrace)});
  for (int64_t i = 0; i < n; ++i) {
    const TraceEvent& ev = trace_[size_t((end - n + i) % kMaxTrace)];
    out[i] = TraceEvent{__atomic_load_n(&ev.ns, __ATOMIC_RELAXED), __atomic_load_n(&ev.epoch, __ATOMIC_RELAXED),
                        __atomic_load_n(&ev.kind, __ATOMIC_RELAXED), __atomic_load_n(&ev.peer, __ATOMIC_RELAXED)};
  }
  // Slots the writer reused while they were copied (it wrapped past them) are dropped.
  std::atomic_thread_fence(std::memory_order_acquire);
  const int64_t torn = std::max<int64_t>(0, n_trace_.load(std::memory_order_relaxed) - kMaxTrace - (end - n));
  if (torn > 0) {
    n = std::max<int64_t>(0, n - torn);
    std::memmove(out, out + torn, size_t(n) * sizeof(TraceEvent));
  }
  // TSC -> steady-clock ns: the line through (tsc, ns) at creation and now.
  const int64_t tsc1 = trace_clock(), ns1 = mono_ns();
  const double scale = trace_tsc_ && tsc1 > tsc0_ ? double(ns1 - ns0_) / double(tsc1 - tsc0_) : 1.0;
  if (trace_tsc_)
    for (int64_t i = 0; i < n; ++i) out[i].ns = ns0_ + int64_t(double(out[i].ns - tsc0_) * scale);
  return int(n);
}

int64_t Proxy::comb_bell_seen() {
  // The kernels ring every remote source's combine bell, so any of them tells a combine began.
  for (int s = 0; s < cfg_.world_size; ++s) {
    if (!remote(s)) continue;
    const int64_t b = load(mb_comb_bell(cfg_.world_size, s));
    if (b > last_comb_) return b;
  }
  return -1;
}

bool Proxy::raise_ready_gdr(int w, int64_t epoch, int phase) {
  std::string why;
  if (!gdr_.flush(&why)) return fail(kProxyTransport, -1, phase, epoch, "GPU memory regions: " + why);
  store(w, epoch);
  return true;
}

void Proxy::loop() {
#ifdef __linux__
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // idle polls sleep sleep_ns, not sleep_ns + 50 us
#endif
  if (gdr_region_ >= 0) {  // the flush runs on this thread, in the context of the regions' GPU
    std::string why;
    if (!gdr_.bind(reg_[gdr_region_], &why)) {
      fail(kProxyTransport, -1, kPhaseD1, 0, "GPU memory regions: " + why);
      return;
    }
  }
  int64_t idle_since = mono_ns();
  while (!stop_) {
    if (load(kMbErrCode) != kProxyOk) break;  // an error stops the proxy (the buffer is broken)
    bool worked = false;
    const int64_t cd = comb_bell_seen(), dd = load(kMbHdrBell);
    // A combine for the latest dispatch goes first; dispatch epochs only grow.
    if (cd > 0 && cd == counts_epoch_) {
      last_comb_ = cd;
      const int64_t t0 = mono_ns(), c0 = thread_cpu_ns();
      if (!run_combine(cd)) break;
      // The record and the count first, then the ready word (release): a caller that sees
      // ready sees the phase counted and recorded.
      const int64_t t1 = mono_ns();
      record(PhaseRecord{1, cd, t0, t1, t1, thread_cpu_ns() - c0, phase_posts_, phase_bells_});
      phases_done_.fetch_add(1, std::memory_order_release);
      trace_phase(kTrCombReady, cd);
      if (!raise_ready(kMbCombReady, cd, kPhaseC)) break;
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
      record(PhaseRecord{0, dd, t0, mid_ns_, mono_ns(), thread_cpu_ns() - c0, phase_posts_, phase_bells_});
      phases_done_.fetch_add(1, std::memory_order_release);
      trace_phase(kTrDispReady, dd);
      store(kMbDispReady, dd);  // last, as for combine
      worked = true;
    } else if (cd > 0) {
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

bool Proxy::flush_batch(int64_t epoch) {
  const int n = int(batch_.size());
  int posted = 0;
  const int rc = t_->post_writes(batch_.data(), n, nullptr, &posted);
  posted = rc == kOk ? n : std::min(std::max(posted, 0), n);
  for (int i = 0; i < posted; ++i) ++posted_to_[size_t(batch_[size_t(i)].peer)];
  n_posted_ += posted;
  phase_posts_ += posted;
  if (rc == kOk) {
    batch_.clear();
    return true;
  }
  const int peer = posted < n ? batch_[size_t(posted)].peer : -1;
  const int phase = posted < n ? imm_phase(batch_[size_t(posted)].imm) : kPhaseD1;
  batch_.clear();
  if (rc == kErrPeer) return fail_lost(peer, phase, epoch, "post_write: " + thread_error());
  return fail(kProxyTransport, peer, phase, epoch, "post_write: " + thread_error());
}

bool Proxy::take(int phase, int src, int64_t epoch, Lost* lost) {
  std::string err;
  const int rc = t_->imm_counter().try_take(make_imm(phase, src, epoch), t_->imm_per_write(), &err);
  // The counter fails when any peer is lost. That ends the wait for `src`'s immediate when `src`
  // itself is gone, or when the job is failing (a peer lost without a clean goodbye: killed, cut,
  // or closed after its own error, whose cause fail_lost names); a peer that closed cleanly after
  // its last write to this rank leaves the others' waits alone.
  if (rc == kErrPeer && lost->peer < 0 && lost->why.empty()) {
    const std::string why = t_->peer_error(src);
    if (!why.empty())
      *lost = Lost{src, why};
    else if (failing())
      *lost = Lost{-1, err};
  }
  return rc == kOk;
}

template <class F>
int Proxy::take_arrived(int64_t epoch, F want) {
  const uint32_t e16 = uint32_t(uint64_t(epoch)) & kImmEpochMask;
  const int R = int(cfg_.world_size), me = int(cfg_.rank);
  arrived_.clear();
  return t_->imm_counter().take_arrived(
      [&](uint32_t imm) {
        const int s = imm_src(imm);
        return (imm & kImmEpochMask) == e16 && s < R && s != me && want(imm_phase(imm), s);
      },
      t_->imm_per_write(), &arrived_);
}

bool Proxy::left_cleanly(int p) {
  Goodbye g;
  return t_->peer_goodbye(p, &g) && !g.error;
}

bool Proxy::failing() {
  for (int p = 0; p < cfg_.world_size; ++p)
    if (p != cfg_.rank && !t_->peer_error(p).empty() && !left_cleanly(p)) return true;
  return false;
}

bool Proxy::await_all(int phase, int64_t epoch, const std::vector<int>& srcs, int64_t timeout_ns) {
  std::vector<uint32_t> imms;
  for (int s : srcs) imms.push_back(make_imm(phase, s, epoch));
  const std::vector<int64_t> per(imms.size(), t_->imm_per_write());
  // (a failure or a timeout takes nothing: the next pass's takes name a lost source)
  return t_->imm_counter().wait_all(imms.data(), per.data(), int(imms.size()), std::max<int64_t>(timeout_ns, 0)) == kOk;
}

bool Proxy::reap(int phase, int64_t epoch, int64_t wait_ns) {
  if (!flush(epoch)) return false;  // (every group of posts is flushed already)
  Completion cq[64];
  while (n_posted_ > 0) {
    const int n = t_->poll(cq, 64, wait_ns);
    wait_ns = 0;
    if (n < 0) return fail(kProxyTransport, -1, phase, epoch, "poll: " + thread_error());
    if (n == 0) return true;
    for (int i = 0; i < n; ++i) {
      --n_posted_;
      const Completion& c = cq[i];
      if (c.peer >= 0 && c.peer < cfg_.world_size) --posted_to_[size_t(c.peer)];
      if (c.status == kCqOk) continue;
      std::string why = t_->peer_error(c.peer);
      // A write to a peer the transport has lost fails with whatever its NIC says (verbs: a dead
      // peer's queue pair may answer "remote access error"): that is the loss, not its status.
      const bool gone = !why.empty();
      if (why.empty()) why = "write to peer " + std::to_string(c.peer) + " failed with status " + std::to_string(c.status);
      if (c.status == kCqPeerLost || c.status == kCqTimeout || gone) return fail_lost(c.peer, phase, epoch, why);
      return fail(kProxyTransport, c.peer, phase, epoch, why);
    }
  }
  return true;
}

int64_t Proxy::idle(int64_t last_work, uint64_t seen_gen, bool bells, bool imms) {
  // Spinning spin_ns after its last work: what comes next in a phase usually comes soon, and a
  // wake-up costs more than a few looks. Then: bells are host memory the GPU writes, which nothing
  // wakes the proxy for, so while one is to ring it looks every sleep_ns (an immediate arriving
  // after the last look, generation seen_gen, ends the sleep at once); with no bell to wait for,
  // the immediates' counter wakes it, or, with only its own writes to complete, the transport's
  // poll does (the next pass's reap waits that long).
  if (mono_ns() - last_work <= cfg_.spin_ns) return 0;
  if (bells || (imms && n_posted_ > 0)) {
    t_->imm_counter().wait_change(seen_gen, cfg_.sleep_ns);
  } else if (imms) {
    t_->imm_counter().wait_change(seen_gen, kBlockNs);
  } else {
    return kBlockNs;
  }
  return 0;
}

template <class F>
bool Proxy::fail_missing(int phase, int imm_phase, int64_t epoch, const std::vector<int>& from, F missing,
                         const std::string& what) {
  std::vector<int> gone;
  for (int r : from)
    if (missing(r)) gone.push_back(r);
  if (gone.empty()) return fail(kProxyTimeout, -1, phase, epoch, what + ": timed out");
  std::string who;
  for (size_t i = 0; i < gone.size() && i < 8; ++i) who += (i ? ", " : "") + std::to_string(gone[i]);
  if (gone.size() > 8) who += ", ...";
  std::string shards;  // several immediates per write: how many of the first missing peer's landed
  const int64_t per = t_->imm_per_write();
  if (per > 1 && imm_phase >= 0)
    shards = "; " + std::to_string(t_->imm_counter().value(make_imm(imm_phase, gone[0], epoch))) + " of its " +
             std::to_string(per) + " shards landed";
  return fail(kProxyTimeout, gone[0], phase, epoch,
              "no immediate from peer " + std::to_string(gone[0]) + " within " + seconds(cfg_.timeout_ns) + " s (" +
                  what + "; " + std::to_string(gone.size()) + " of " + std::to_string(from.size()) +
                  " peers missing: " + who + shards + ")");
}

bool Proxy::fail_writes(int phase, int64_t epoch) {
  const int peer =
      int(std::find_if(posted_to_.begin(), posted_to_.end(), [](int n) { return n > 0; }) - posted_to_.begin());
  return fail(kProxyTimeout, peer < cfg_.world_size ? peer : -1, phase, epoch,
              std::to_string(n_posted_) + " own writes not completed within " + seconds(cfg_.timeout_ns) +
                  " s (the first to peer " + std::to_string(peer) + ")");
}

bool Proxy::add_overflow(const int32_t* row, int s) {
  const int R = int(cfg_.world_size);
  const int64_t cap = cfg_.private_capacity, lo = node_lo_[size_t(s)], hi = lo + node_g_;
  if (!row_exceeds(row, R, uint32_t(std::min<int64_t>(cap, INT32_MAX)))) return true;  // no overflow (the common case)
  if (*std::min_element(row, row + R) < 0) return false;
  for (int64_t p = 0; p < R; ++p)
    if (p < lo || p >= hi) {
      const int64_t o = std::max<int64_t>(0, row[p] - cap);
      ov_total_[size_t(p)] += o;
      ov_sum_ += o;
    }
  return true;
}

// One dispatch epoch (docs/ARCHITECTURE.md §10), as its pieces become possible, in one pass loop:
//  - at once: this rank's header (count vector + selections) to every peer (D0);
//  - as each remote peer's rows bell rings: its round-1 rows (D1, when it has rows);
//  - as each source's header lands: its row of the count matrix; once all have: hdr_ready, the
//    capacity check (every rank decides alike), and the overflow rows (D2) to each remote peer
//    whose rows are packed;
//  - as each source's rows land: its ready1 / ready2 word, so the receive half unpacks it;
//  - done when every expected immediate is counted and every own write completed.
// Each (phase, source) is counted exactly: D0 from every other rank; D1 from each remote source
// with rows for this rank, D2 from each with overflow (both ends know them from the headers).
// A pass looks only at what changed: the bells not yet rung, and the immediates that arrived
// (the counter's arrival log), so its cost follows the events, not the number of peers.
bool Proxy::run_dispatch(int64_t epoch) {
  int64_t deadline = mono_ns() + cfg_.timeout_ns;  // moved on by each overflow window's progress
  const int R = int(cfg_.world_size), me = int(cfg_.rank), G = int(cfg_.node_size);
  const int64_t RB = cfg_.row_bytes, cap = cfg_.private_capacity, slot = cap * RB;
  // Parity copies: round-1 slots of epoch e at (e & 1) * R * slot, headers at (e & 1) * R * HDR,
  // overflow at (e & 1) * ovcap.
  const uint64_t r1_base = uint64_t((epoch & 1) * R * slot), h_base = uint64_t((epoch & 1) * R * hdr_);
  const uint64_t ov_base = uint64_t((epoch & 1) * cfg_.overflow_capacity * RB);
  trace_phase(kTrHdrBell, epoch);
  n_posted_ = 0;
  batch_.clear();
  phase_posts_ = 0;
  phase_bells_ = 1;  // the header bell
  std::fill(posted_to_.begin(), posted_to_.end(), 0);
  // Own count vector: the start of this rank's own header slot.
  const int32_t* const* const rows_of = rows_[epoch & 1].data();  // the count matrix, row by row (in place)
  int32_t* const own = own_[epoch & 1].data();
  std::memcpy(own, reg_[kRegHdrSend] + uint64_t(me * hdr_), 4 * size_t(R));
  // Per rank: 0 pending, 1 done (or nothing to do). Rows that land before their source's header
  // (writes are unordered) stay counted until the header says they are expected.
  for (auto* v : {&rows_sent_, &got_hdr_, &got1_, &got2_, &win_wait_, &hdr_taken_}) v->assign(size_t(R), 0);
  got_hdr_[me] = 1;
  // One pass over this rank's counts: checked, and for each remote peer p (in rank order) where
  // rows_p starts in the send buffer; p waits for its rows bell (todo_).
  todo_.clear();
  int n_remote = 0;
  int64_t rows = 0;
  uint64_t o = 0;
  const int32_t* const mine = own;
  for (int p = 0; p < R; ++p) {
    const int32_t c = mine[p];
    if (c < 0) return fail(kProxyInvalid, p, kPhaseD1, epoch, "negative count for peer " + std::to_string(p));
    if (!remote(p)) {  // this rank and its node: no rows through the proxy
      rows_sent_[p] = got1_[p] = got2_[p] = 1;
      continue;
    }
    rows += c;
    off_[p] = o;
    o += uint64_t(c * RB);
    todo_.push_back(p);
    ++n_remote;
  }
  if (rows > cfg_.max_send_rows)
    return fail(kProxyInvalid, -1, kPhaseD1, epoch,
                std::to_string(rows) + " rows to remote peers exceed the send buffer's " +
                    std::to_string(cfg_.max_send_rows));
  const uint64_t my_slot = r1_base + uint64_t(me * slot), my_hdr = h_base + uint64_t(me * hdr_);
  // Headers first: they are ready before any row is packed, and the receivers place rows with them.
  for (int p : others_) {
    post(kPhaseD0, epoch, p, kRegHdrSend, uint64_t(p * hdr_), kRegHdrRecv, my_hdr, uint64_t(hdr_));
    trace_peer(kTrPostD0, p, epoch);
  }
  if (!flush(epoch)) return false;
  auto c_to = [&](int s, int p) -> int64_t { return rows_of[s][p]; };
  auto ov = [&](int s, int p) -> int64_t { return std::max<int64_t>(0, c_to(s, p) - cap); };
  // Where remote source s's overflow starts in this rank's stream (every header in).
  auto ov_start_of = [&](int s) {
    int64_t st = 0;
    for (int q = 0; q < s; ++q)
      if (remote(q)) st += ov(q, me);
    return st;
  };
  // Windows of B rows (§10 "Round 2 in windows"). As a source, per receiver p: this rank's
  // overflow to p starts at ov_start_[p] in p's stream; window ov_next_[p] is the next to post,
  // ov_last_[p] the last (none left when next > last), credits_[p] the credits not yet served
  // (window 0 needs none: a credit of its own). Set once every header is in, and only when some
  // source has overflow (ov_any): without, nothing reads them.
  const int64_t B = cfg_.overflow_capacity;
  // As a receiver: windows of this rank's stream, the next to credit, the one whose rows are
  // awaited (-1: none) and how many of its writes are still to come.
  int64_t n_win = 0, next_win = 1, cur_win = -1, win_left = 0;
  // What is left, counted down: headers, round-1 rows, overflow rows to receive; overflow to post.
  int hdr_left = R - 1, got1_left = n_remote, got2_left = n_remote, ov_left = 0;
  bool all_hdr = false, ov_any = false;  // ov_any: some source has overflow for a remote rank (set at all_hdr)
  // Every p's total overflow from remote sources, summed row by row as headers land (the
  // capacity check below needs the whole matrix; one pass per row, no division).
  std::memset(ov_total_.data(), 0, sizeof(int64_t) * size_t(R));
  ov_sum_ = 0;
  add_overflow(own, me);
  auto land1 = [&](int s) {  // s's round-1 rows are in (or it has none)
    got1_[s] = 1;
    --got1_left;
    if (!raise_ready(mb_ready1(R, s), epoch, kPhaseD1)) return false;
    return !got2_[s] || raise_ready(mb_ready2(R, s), epoch, kPhaseD2);
  };
  auto land2 = [&](int s, bool rows) {  // s's overflow rows are in (rows), or it has none
    got2_[s] = 1;
    --got2_left;
    return !(rows || got1_[s]) || raise_ready(mb_ready2(R, s), epoch, kPhaseD2);
  };
  // Source s's header landed: its row of the count matrix, and what else comes from it (nothing,
  // its round-1 rows, its overflow rows). False: bad counts (error recorded).
  // `counts`: a copy of its count vector, to check (scratch_): copying a row in bulk brings its
  // lines, which another core or the NIC wrote, in faster than the check's own loads do.
  auto on_header = [&](int s, const int32_t* counts) {
    got_hdr_[s] = 1;
    --hdr_left;
    trace_peer(kTrGotD0, s, epoch);
    if (!add_overflow(counts, s))
      return fail(kProxyInvalid, s, kPhaseD1, epoch, "peer " + std::to_string(s) + " sent a negative count");
    if (remote(s)) {
      if (ov(s, me) == 0 && !land2(s, false)) return false;
      if (std::min(c_to(s, me), cap) == 0 && !land1(s)) return false;
    }
    return true;
  };
  auto on_header_copy = [&](int s) {
    std::memcpy(scratch_.data(), rows_of[s], 4 * size_t(R));
    return on_header(s, scratch_.data());
  };
  // What a pass takes from the arrival log: headers not yet in; a remote source's rows once its
  // header expects them.
  // A remote source's round-1 rows logged after its header in the same look are taken with it
  // (hdr_taken_: its header was taken in this look), not left for the next look; should the header
  // say no rows come, that immediate is a stray and goes back to the counter.
  auto want = [&](int ph, int s) {
    if (ph == kPhaseD0) return !got_hdr_[s] && (hdr_taken_[s] = 1);
    if (ph == kPhaseD1 && !got_hdr_[s] && hdr_taken_[s]) return remote(s);
    if (!got_hdr_[s] || !remote(s)) return false;
    if (ph == kPhaseCredit) return all_hdr && ov_any && ov_next_[s] + credits_[s] <= ov_last_[s];
    return ph == kPhaseD1 ? !got1_[s] : ph == kPhaseD2 && (!got2_[s] || win_wait_[s]);
  };
  // Source s's rows of the current window (beyond the first) landed: the window's ready word
  // once the last of them is in.
  auto land_window = [&](int s) {
    win_wait_[s] = 0;
    trace_peer(kTrGotD2, s, epoch);
    deadline = std::max(deadline, mono_ns() + cfg_.timeout_ns);
    if (--win_left > 0) return true;
    trace_phase(kTrOvReady, epoch);
    return raise_ready(kMbOvReady, ov_window(epoch, cur_win), kPhaseD2);
  };
  auto got_credit = [&](int p) {
    ++credits_[p];
    trace_peer(kTrGotCredit, p, epoch);
    deadline = std::max(deadline, mono_ns() + cfg_.timeout_ns);
  };
  // The old way, for a failing counter: a take per source still waited for, which names a lost
  // source (its own loss, or the job's) in `lost`; what is there is still taken.
  auto scan_all = [&](Lost* lost) {
    for (int s : others_) {
      if (!got_hdr_[s] && take(kPhaseD0, s, epoch, lost) && !on_header_copy(s)) return false;
      if (got_hdr_[s] && !got1_[s] && take(kPhaseD1, s, epoch, lost)) {
        trace_peer(kTrGotD1, s, epoch);
        if (!land1(s)) return false;
      }
      if (got_hdr_[s] && !got2_[s] && take(kPhaseD2, s, epoch, lost)) {
        trace_peer(kTrGotD2, s, epoch);
        if (!land2(s, true)) return false;
      }
      if (win_wait_[s] && take(kPhaseD2, s, epoch, lost) && !land_window(s)) return false;
      if (want(kPhaseCredit, s) && take(kPhaseCredit, s, epoch, lost)) got_credit(s);
    }
    return true;
  };
  int64_t last_work = mono_ns(), reap_wait = 0;
  uint64_t seen_gen = ~uint64_t(0);
  for (;;) {
    if (stop_) return fail(kProxyTimeout, -1, kPhaseD1, epoch, "proxy stopped while waiting");
    bool work = false;
    Lost lost;
    // Own rows: each remote peer's as soon as the kernels packed them.
    const int rung = serve_bells(mb_disp_bell, epoch, kTrRowsBell, [&](int p) {
      const int64_t n1 = std::min(c_to(me, p), cap);
      if (n1 > 0) {
        post(kPhaseD1, epoch, p, kRegDispSend, off_[p], kRegRound1, my_slot, uint64_t(n1 * RB));
        trace_peer(kTrPostD1, p, epoch);
      }
      rows_sent_[p] = 1;
      return true;
    });
    if (rung < 0 || !flush(epoch)) return false;
    work |= rung > 0;
    // Arrivals (only when the counter moved since the last look).
    const uint64_t gen = t_->imm_counter().generation();
    if (gen != seen_gen) {
      seen_gen = gen;
      const bool failing_counter = take_arrived(epoch, want) == kErrPeer;
      bool headers = false;
      // In chunks of kHdrChunk arrivals: the chunk's headers copied back to back (their lines
      // come in together), then each arrival handled.
      const size_t n_arrived = arrived_.size();
      for (size_t c0 = 0; c0 < n_arrived; c0 += kHdrChunk) {
        const size_t c1 = std::min(n_arrived, c0 + kHdrChunk);
        for (size_t k = c0; k < c1; ++k)
          if (imm_phase(arrived_[k]) == kPhaseD0)
            std::memcpy(&scratch_[(k - c0) * size_t(R)], rows_of[imm_src(arrived_[k])], 4 * size_t(R));
        for (size_t i = c0; i < c1; ++i) {
          const uint32_t imm = arrived_[i];
          const int ph = imm_phase(imm), s = imm_src(imm);
          work = true;
          if (ph == kPhaseD0) {
            headers = true;
            if (!on_header(s, &scratch_[(i - c0) * size_t(R)])) return false;
          } else if (ph == kPhaseD1) {
            if (got1_[s]) {  // taken with its header, which says no rows come: a stray, counted again
              t_->imm_counter().add(imm, t_->imm_per_write());
              continue;
            }
            trace_peer(kTrGotD1, s, epoch);
            if (!land1(s)) return false;
          } else if (ph == kPhaseCredit) {
            got_credit(s);
          } else if (!got2_[s]) {  // window 0 (later windows come only after every window-0 write is in)
            trace_peer(kTrGotD2, s, epoch);
            if (!land2(s, true)) return false;
          } else if (!land_window(s)) {
            return false;
          }
        }
      }
      if (headers) seen_gen = ~uint64_t(0);  // rows that came before these headers are wanted now: look again
      if (failing_counter && !scan_all(&lost)) return false;
    }
    if (!all_hdr && hdr_left == 0 && ov_sum_ == 0) {
      // No overflow anywhere (the common case): no round 2, no windows, no credits.
      all_hdr = work = true;
      mid_ns_ = mono_ns();
      trace_phase(kTrHdrReady, epoch);
      store(kMbHdrReady, epoch);
    } else if (!all_hdr && hdr_left == 0) {
      all_hdr = work = ov_any = true;
      mid_ns_ = mono_ns();
      for (auto* v : {&ov_start_, &ov_next_, &ov_last_, &credits_}) v->assign(size_t(R), 0);
      // Capacity: overflow goes through the region in as many windows as it needs, so only a
      // region of no rows refuses it (every rank checks every p: same data, same decision).
      for (int p = 0; p < R && B == 0; ++p) {
        const int64_t tot = ov_total_[size_t(p)];
        if (tot > 0)
          return fail(kProxyCapacity, p, kPhaseD2, epoch,
                      "rank " + std::to_string(p) + " would receive " + std::to_string(tot) +
                          " overflow rows, overflow_capacity is 0");
      }
      // Where this rank's overflow to each remote p falls in p's stream (sum of o_{s'p} over
      // remote s' < me), its windows, and this rank's own stream's windows.
      for (int p : others_) {
        if (!remote(p)) continue;
        const int64_t n2 = ov(me, p);
        const int plo = node_lo_[size_t(p)], phi = plo + G;  // p's node: its sources send no overflow to p
        int64_t st = 0;
        for (int s = 0; s < me; ++s)
          if (s < plo || s >= phi) st += ov(s, p);
        ov_start_[p] = st;
        ov_next_[p] = n2 ? st / B : 1;
        ov_last_[p] = n2 ? (st + n2 - 1) / B : 0;
        credits_[p] = n2 && ov_next_[p] == 0;
        ov_left += n2 > 0;
      }
      n_win = B ? (ov_total_[size_t(me)] + B - 1) / B : 0;
      for (int s : others_)  // sources whose overflow starts past window 0: none in window 0
        if (remote(s) && !got2_[s] && ov_start_of(s) >= B && !land2(s, false)) return false;
      seen_gen = ~uint64_t(0);  // credits that came before the last header are wanted now: look again
      trace_phase(kTrHdrReady, epoch);
      store(kMbHdrReady, epoch);
    }
    // Round 2: this rank's part of each window of each remote p's overflow stream, once every
    // header is in (the offsets need them), p's rows are packed, and p gave the window's credit
    // (window 0: none needed). Window w's rows [lo, hi) of the stream go to lo - w*B in p's region.
    if (all_hdr && ov_left > 0) {
      for (int p : others_) {
        if (!rows_sent_[p] || !credits_[p] || ov_next_[p] > ov_last_[p]) continue;
        const int64_t w = ov_next_[p]++, st = ov_start_[p], n2 = ov(me, p);
        --credits_[p];
        ov_left -= ov_next_[p] > ov_last_[p];
        const int64_t lo = std::max(st, w * B), hi = std::min(st + n2, (w + 1) * B);
        const uint64_t loff = off_[p] + uint64_t((cap + lo - st) * RB);
        post(kPhaseD2, epoch, p, kRegDispSend, loff, kRegOverflow, ov_base + uint64_t((lo - w * B) * RB),
             uint64_t((hi - lo) * RB));
        trace_peer(kTrPostD2, p, epoch);
        work = true;
      }
      if (!flush(epoch)) return false;
    }
    // This rank's own stream beyond window 0: once its kernels unpacked window w - 1 (ov_done),
    // a zero-byte credit to each source with rows in window w; its ready word once they landed.
    if (all_hdr && next_win < n_win && win_left == 0 && got2_left == 0 &&
        load(kMbOvDone) >= ov_window(epoch, next_win)) {
      cur_win = next_win++;
      for (int s : others_) {
        if (!remote(s) || ov(s, me) == 0) continue;
        const int64_t st = ov_start_of(s);
        if (st >= (cur_win + 1) * B || st + ov(s, me) <= cur_win * B) continue;
        post(kPhaseCredit, epoch, s, kRegHdrSend, 0, kRegHdrRecv, 0, 0);
        trace_peer(kTrPostCredit, s, epoch);
        win_wait_[s] = 1;
        ++win_left;
      }
      if (!flush(epoch)) return false;
      deadline = std::max(deadline, mono_ns() + cfg_.timeout_ns);
      seen_gen = ~uint64_t(0);  // rows of this window that came with the credits' completions: look
      work = true;
    }
    if (!reap(kPhaseD1, epoch, reap_wait)) return false;
    reap_wait = 0;
    if (all_hdr && todo_.empty() && ov_left == 0 && got1_left == 0 && got2_left == 0 && next_win >= n_win &&
        win_left == 0 && n_posted_ == 0)
      break;
    if (!lost.why.empty()) return fail_lost(lost.peer, all_hdr && got1_left == 0 ? kPhaseD2 : kPhaseD1, epoch, lost.why);
    if (work) {
      last_work = mono_ns();
      continue;
    }
    if (mono_ns() >= deadline) {
      if (!all_hdr) return fail_missing(kPhaseD1, kPhaseD0, epoch, others_, [&](int s) { return !got_hdr_[s]; }, "header");
      if (got1_left) return fail_missing(kPhaseD1, kPhaseD1, epoch, others_, [&](int s) { return !got1_[s]; }, "round-1 rows");
      if (got2_left) return fail_missing(kPhaseD2, kPhaseD2, epoch, others_, [&](int s) { return !got2_[s]; }, "overflow rows");
      if (win_left)
        return fail_missing(kPhaseD2, kPhaseD2, epoch, others_, [&](int s) { return win_wait_[s] != 0; },
                            "overflow rows of window " + std::to_string(cur_win) + " of " + std::to_string(n_win));
      if (next_win < n_win)
        return fail(kProxyTimeout, -1, kPhaseD2, epoch,
                    "this rank's kernels never unpacked overflow window " + std::to_string(next_win - 1) + " of " +
                        std::to_string(n_win) + " within " + seconds(cfg_.timeout_ns) + " s");
      if (ov_left && std::any_of(others_.begin(), others_.end(), [&](int p) { return !credits_[p] && ov_next_[p] <= ov_last_[p] && rows_sent_[p]; }))
        return fail_missing(kPhaseD2, kPhaseCredit, epoch, others_,
                            [&](int p) { return !credits_[p] && ov_next_[p] <= ov_last_[p] && rows_sent_[p]; },
                            "credit for an overflow window");
      if (!todo_.empty())
        return fail_missing(kPhaseD1, -1, epoch, others_, [&](int p) { return !rows_sent_[p]; },
                            "this rank's kernels never rang the rows bell");
      return fail_writes(kPhaseD1, epoch);
    }
    if (!all_hdr && todo_.empty() && mono_ns() - last_work > cfg_.spin_ns) {
      // Only headers to wait for: nothing can be placed before the last one, so one wake-up for
      // them all (as many as there are sources would cost the proxy's CPU for nothing).
      std::vector<int> rest;
      for (int s : others_)
        if (!got_hdr_[s]) rest.push_back(s);
      if (await_all(kPhaseD0, epoch, rest, std::min(kBlockNs, deadline - mono_ns()))) {
        for (int s : rest)
          if (!on_header_copy(s)) return false;
        seen_gen = ~uint64_t(0);  // rows that came before these headers are wanted now: look again
        last_work = mono_ns();
        continue;
      }  // (else a time slice passed, or the counter failed: the next pass's takes tell which)
    }
    const bool ov_done_bell = all_hdr && next_win < n_win && win_left == 0;  // a word the kernels raise
    reap_wait = idle(last_work, seen_gen, !todo_.empty() || ov_done_bell,
                     !all_hdr || got1_left > 0 || got2_left > 0 || win_left > 0 || ov_left > 0);
  }
  counts_epoch_ = epoch;  // (its count matrix: rows_[epoch & 1])
  return true;
}

// The combine of the latest dispatch, in the windows of the dispatch's overflow (§10 "Round 2 in
// windows"): to each remote source s, as soon as its rows are packed (its combine bell), one write
// of its window-0 rows (its round-1 rows and its part of overflow window 0) into s's combine
// receive region at sum of c_{s,p'} over remote p' < me; then for each later window w, once the
// kernels packed it into the (reused) send region (comb_win_bell) after the proxy's writes of
// window w - 1 completed (comb_win_done), one write of each source's part of it. From each remote
// owner p: one immediate for its window-0 rows (if any) and one per later window with rows of
// this rank.
bool Proxy::run_combine(int64_t epoch) {
  int64_t deadline = mono_ns() + cfg_.timeout_ns;  // moved on by each window's progress
  const int R = int(cfg_.world_size), me = int(cfg_.rank), G = int(cfg_.node_size);
  const int64_t CRB = cfg_.comb_row_bytes, cap = cfg_.private_capacity, B = cfg_.overflow_capacity;
  const uint64_t cr_base = uint64_t((epoch & 1) * cfg_.max_send_rows * CRB);  // parity copy of s's region
  const int32_t* const* const rows_of = rows_[epoch & 1].data();  // the dispatch's count matrix (epoch == counts_epoch_)
  n_posted_ = 0;
  batch_.clear();
  phase_posts_ = phase_bells_ = 0;
  std::fill(posted_to_.begin(), posted_to_.end(), 0);
  auto ov = [&](int s, int p) -> int64_t { return std::max<int64_t>(0, int64_t(rows_of[s][p]) - cap); };
  // Where remote source s's overflow starts in owner p's stream; s's rows of window w there.
  auto start_in = [&](int s, int p) {
    int64_t st = 0;
    for (int q = 0; q < s; ++q)
      if (node_lo_[size_t(q)] != node_lo_[size_t(p)]) st += ov(q, p);
    return st;
  };
  auto part = [&](int64_t st, int64_t o, int64_t w, int64_t* lo, int64_t* hi) {
    *lo = std::max(st, w * B), *hi = std::min(st + o, (w + 1) * B);
    return *hi > *lo;
  };
  // off_: per remote source s, in rank order: its window-0 rows in the send region. ov_start_:
  // its overflow's place in this rank's stream. rows_sent_: s's window-0 write posted (or none).
  // credits_ (reused): per owner p, the immediates still to come from it.
  std::vector<char>& sent = rows_sent_;
  sent.assign(size_t(R), 1);
  credits_.assign(size_t(R), 0);
  ov_start_.assign(size_t(R), 0);
  todo_.clear();
  int64_t got_left = 0, o = 0, O = 0;
  for (int s = 0; s < R; ++s) {
    if (s == me || !remote(s)) continue;
    const int64_t c = rows_of[s][me], n1 = std::min(c, cap), os = ov(s, me);
    ov_start_[s] = O;
    const int64_t c0 = n1 + (B > 0 ? std::min(os, std::max<int64_t>(0, B - O)) : os);
    O += os;
    off_[s] = uint64_t(o) * uint64_t(CRB);
    o += c0;
    if (c0 > 0) sent[s] = 0, todo_.push_back(s);
    // from owner s (as a source of its stream): window 0 (round 1 and its part there) and each later window
    const int64_t st = start_in(me, s), om = ov(me, s), cm = rows_of[me][s];
    int64_t n = std::min<int64_t>(cm, cap) + (B > 0 ? std::min(om, std::max<int64_t>(0, B - st)) : om) > 0;
    for (int64_t w = 1, lo, hi; B > 0 && w * B < st + om; ++w) n += part(st, om, w, &lo, &hi);
    credits_[s] = n;
    got_left += n;
  }
  const int64_t n_win = B > 0 ? (O + B - 1) / B : 0;
  int64_t next_win = 1, posted_win = 0;  // the next later window to post; the last one posted
  auto owners = [&]() {
    std::vector<int> v;
    for (int p : others_)
      if (remote(p) && credits_[p] > 0) v.push_back(p);
    return v;
  };
  auto got = [&](int p) {
    --credits_[p];
    --got_left;
    trace_peer(kTrGotC, p, epoch);
  };
  auto scan_all = [&](Lost* lost) {  // a failing counter: as run_dispatch's
    for (int p : others_)
      if (credits_[p] > 0 && take(kPhaseC, p, epoch, lost)) got(p);
  };
  int64_t last_work = mono_ns(), reap_wait = 0;
  uint64_t seen_gen = ~uint64_t(0);
  for (;;) {
    if (stop_) return fail(kProxyTimeout, -1, kPhaseC, epoch, "proxy stopped while waiting");
    bool work = false;
    Lost lost;
    const int rung = serve_bells(mb_comb_bell, epoch, kTrCombBell, [&](int s) {
      // In s's combine receive region: sum of c_{s,p'} over p' < me outside s's node.
      const int32_t* row = rows_of[s];
      const int slo = node_lo_[size_t(s)];
      const int64_t roff = sum_range(row, 0, me) - sum_range(row, slo, std::min(slo + G, me));
      const int64_t c0 = std::min<int64_t>(row[me], cap) +
                         (B > 0 ? std::min(ov(s, me), std::max<int64_t>(0, B - ov_start_[s])) : ov(s, me));
      post(kPhaseC, epoch, s, kRegCombSend, off_[s], kRegCombRecv, cr_base + uint64_t(roff * CRB), uint64_t(c0 * CRB));
      trace_peer(kTrPostC, s, epoch);
      sent[s] = 1;
      return true;
    });
    if (rung < 0 || !flush(epoch)) return false;
    work |= rung > 0;
    // Later windows: once the writes of the one before completed, the kernels may pack the next
    // (comb_win_done); once they did (comb_win_bell), each source's part of it.
    if (next_win < n_win && todo_.empty() && n_posted_ == 0 && load(kMbCombWinDone) < ov_window(epoch, next_win)) {
      store(kMbCombWinDone, ov_window(epoch, next_win));
      work = true;
    }
    if (next_win < n_win && posted_win < next_win && load(kMbCombWinBell) >= ov_window(epoch, next_win)) {
      const int64_t w = next_win;
      for (int s : others_) {
        int64_t lo, hi;
        if (!remote(s) || !part(ov_start_[s], ov(s, me), w, &lo, &hi)) continue;
        const int32_t* row = rows_of[s];
        const int slo = node_lo_[size_t(s)];
        const int64_t roff = sum_range(row, 0, me) - sum_range(row, slo, std::min(slo + G, me)) + cap +
                             (lo - ov_start_[s]);
        post(kPhaseC, epoch, s, kRegCombSend, uint64_t((lo - w * B) * CRB), kRegCombRecv,
             cr_base + uint64_t(roff * CRB), uint64_t((hi - lo) * CRB));
        trace_peer(kTrPostC, s, epoch);
      }
      if (!flush(epoch)) return false;
      posted_win = next_win++;
      deadline = std::max(deadline, mono_ns() + cfg_.timeout_ns);
      work = true;
    }
    const uint64_t gen = t_->imm_counter().generation();
    if (gen != seen_gen) {
      seen_gen = gen;
      const bool failing_counter =
          take_arrived(epoch, [&](int ph, int p) { return ph == kPhaseC && credits_[p] > 0; }) == kErrPeer;
      for (const uint32_t imm : arrived_) got(imm_src(imm));
      if (!arrived_.empty()) {
        seen_gen = ~uint64_t(0);  // an owner's next window may have been counted too: look again
        deadline = std::max(deadline, mono_ns() + cfg_.timeout_ns);
        work = true;
      }
      if (failing_counter) scan_all(&lost);
    }
    if (!reap(kPhaseC, epoch, reap_wait)) return false;
    reap_wait = 0;
    if (todo_.empty() && got_left == 0 && next_win >= n_win && n_posted_ == 0) return true;
    if (!lost.why.empty()) return fail_lost(lost.peer, kPhaseC, epoch, lost.why);
    if (work) {
      last_work = mono_ns();
      continue;
    }
    if (mono_ns() >= deadline) {
      if (got_left) return fail_missing(kPhaseC, kPhaseC, epoch, owners(), [&](int p) { return credits_[p] > 0; }, "combine rows");
      if (!todo_.empty()) {
        std::vector<int> sources;
        for (int s : others_)
          if (remote(s) && rows_of[s][me] > 0) sources.push_back(s);
        return fail_missing(kPhaseC, -1, epoch, sources, [&](int s) { return !sent[s]; },
                            "this rank's kernels never rang the combine bell");
      }
      if (next_win < n_win && n_posted_ == 0)
        return fail(kProxyTimeout, -1, kPhaseC, epoch,
                    "this rank's kernels never packed combine window " + std::to_string(next_win) + " of " +
                        std::to_string(n_win) + " within " + seconds(cfg_.timeout_ns) + " s");
      return fail_writes(kPhaseC, epoch);
    }
    if (todo_.empty() && next_win >= n_win && got_left > 0 && mono_ns() - last_work > cfg_.spin_ns) {
      // Only the owners' rows to wait for, and one ready word for them all: one wake-up (one
      // immediate from each owner still sending; the next pass takes the rest).
      std::vector<int> rest = owners();
      if (await_all(kPhaseC, epoch, rest, std::min(kBlockNs, deadline - mono_ns()))) {
        for (int p : rest) got(p);
        seen_gen = ~uint64_t(0);
        last_work = mono_ns();
        continue;
      }  // (else a time slice passed, or the counter failed: the next pass's takes tell which)
    }
    reap_wait = idle(last_work, seen_gen, !todo_.empty() || next_win < n_win, got_left > 0);
  }
}

}  // namespace moe_ep
