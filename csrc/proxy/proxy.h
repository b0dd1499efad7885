// Proxy: the host side of the inter-node protocol (docs/ARCHITECTURE.md §10).
//
// One per rank, on top of a connected Transport. Python owns the memory (regions and mailbox)
// and passes pointers; the proxy registers the five regions with the transport in the fixed
// order of §10, so every rank's keys agree. A thread started once polls the mailbox doorbells
// (short spin, then sleep), runs the dispatch rounds (D1, D2) and the combine write (C), and
// raises the ready words; on any failure it writes the error record and stops (it serves no
// later doorbell). Every wait has the phase deadline; nothing blocks without one.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda_mem.h"
#include "transport.h"

namespace moe_ep {

// ---- Mailbox: int64 words, single writer each, epoch valued, never reset. ----
// The kernel side writes the bells; the proxy writes the ready words and the error record.
// Mirrored in moe_ep/native/protocol.py (MAILBOX) and checked against moe_ep_proxy_mailbox_layout.
// Twelve fixed words, then four arrays of one word per rank (mb_* below): 12 + 4R words in all.
enum : int {
  kMbHdrBell = 0,       // kernel: every peer's header (HDR_p) of dispatch epoch e is in the send buffer -> e
  kMbDispReady = 1,     // proxy: every write of dispatch e from and to this rank landed, own writes completed -> e
  kMbHdrReady = 2,      // proxy: every source's header of dispatch e landed (the count matrix is complete) -> e
  kMbCombReady = 3,     // proxy: every combine row of epoch e landed, own writes completed -> e
  kMbErrCode = 4,       // error record: written last (release); 0 while healthy
  kMbErrPeer = 5,       //   the peer concerned (-1: none / unknown)
  kMbErrPhase = 6,      //   kPhaseD1 / kPhaseD2 / kPhaseC (a header is part of round 1)
  kMbErrEpoch = 7,      //   the epoch of the failed phase
  // Overflow windows beyond the first (§10 "Round 2 in windows"), valued ov_window(e, w):
  kMbOvReady = 8,       // proxy: window w (w >= 1) of dispatch e landed -> ov_window(e, w)
  kMbOvDone = 9,        // kernel: windows 0..w-1 of dispatch e unpacked (region free again) -> ov_window(e, w)
  // The combine's return of those windows, through the combine send region:
  kMbCombWinDone = 10,  // proxy: combine writes of windows 0..w-1 of epoch e completed (region free) -> ov_window(e, w)
  kMbCombWinBell = 11,  // kernel: combine window w (w >= 1) of epoch e packed -> ov_window(e, w)
  kMbWords = 12,        // the fixed words
};
// The value of the window words for window w of epoch e: grows with e, then w (w < 2^32).
inline int64_t ov_window(int64_t e, int64_t w) { return (e << 32) | w; }
// The per-rank arrays (index p or s in [0, R)).
inline int mb_disp_bell(int64_t R, int p) { return int(kMbWords + p); }         // kernel: rows_p packed -> e
inline int mb_ready1(int64_t R, int s) { return int(kMbWords + R + s); }        // proxy: s's round-1 rows landed -> e
inline int mb_ready2(int64_t R, int s) { return int(kMbWords + 2 * R + s); }    // proxy: s's overflow rows landed -> e
inline int mb_comb_bell(int64_t R, int s) { return int(kMbWords + 3 * R + s); } // kernel: s's combine rows packed -> e
inline int64_t mailbox_words_for(int64_t R) { return kMbWords + 4 * R; }

// Error codes (mailbox word kMbErrCode).
enum : int64_t {
  kProxyOk = 0,
  kProxyTimeout = 1,    // a phase deadline passed
  kProxyPeerLost = 2,   // a peer's connection was lost (or its write was not acknowledged)
  kProxyCapacity = 3,   // some rank's total overflow exceeds overflow_capacity (all ranks agree), or a peer
                        // closed after a CapacityError (its goodbye's kByeCapacity): peer = the rank over its cap
  kProxyInvalid = 4,    // bad counts or protocol misuse (e.g. combine for an epoch not dispatched)
  kProxyTransport = 5,  // any other transport failure (remote access error, post failed)
};

// Phases: the immediate's bits 31..29. kPhaseD0 (headers) is reported as round 1 (kPhaseD1);
// kPhaseCredit (a receiver's zero-byte "window w of your overflow may come" write) as round 2.
enum : int { kPhaseD1 = 0, kPhaseD2 = 1, kPhaseC = 2, kPhaseD0 = 3, kPhaseCredit = 4 };

// Immediate (§10): phase in bits 31..29, the source (sending) rank in bits 28..16, the epoch mod
// 2^16 in bits 15..0. The ImmCounter keys on the whole value, so each (phase, source, epoch) is
// counted apart: a receiver knows which peers delivered, and a late write of epoch n never counts
// for epoch n + 1 (a receiver only ever has writes of two consecutive epochs of one phase
// pending, so the epoch's 16 bits never alias). The source field limits a job to
// kImmMaxRanks ranks (checked by Proxy::create).
constexpr int kImmSrcShift = 16;
constexpr int kImmSrcBits = 13;
constexpr int kImmPhaseShift = kImmSrcShift + kImmSrcBits;  // 29
constexpr int64_t kImmMaxRanks = int64_t(1) << kImmSrcBits;
constexpr uint32_t kImmEpochMask = (1u << kImmSrcShift) - 1;
inline int imm_phase(uint32_t imm) { return int(imm >> kImmPhaseShift); }
inline int imm_src(uint32_t imm) { return int((imm >> kImmSrcShift) & uint32_t(kImmMaxRanks - 1)); }

inline uint32_t make_imm(int phase, int src, int64_t epoch) {
  return (uint32_t(phase) << kImmPhaseShift) | ((uint32_t(src) & uint32_t(kImmMaxRanks - 1)) << kImmSrcShift) |
         (uint32_t(uint64_t(epoch)) & kImmEpochMask);
}

// Region order (registration order, hence the key order on every rank). The regions peers write
// into (round-1, overflow, combine receive, header receive) hold two copies each; epoch e uses
// copy e & 1, at (e & 1) * (the copy's size), so several dispatches in a row are safe (§10).
// The five row regions hold rows only, so they may be GPU memory where the transport registers
// it; the proxy reads counts only from the two header regions, which are host memory.
enum : int {
  kRegDispSend = 0,  // rows for each remote peer, in rank order: [rows_p]
  kRegRound1 = 1,    // [2][R][cap rows]: each source's first cap rows
  kRegOverflow = 2,  // [2][overflow rows]: one window of a receiver's overflow stream
  kRegCombSend = 3,
  kRegCombRecv = 4,
  kRegHdrSend = 5,   // [R][HDR]: the header for each peer (this rank's own slot: its count vector too)
  kRegHdrRecv = 6,   // [2][R][HDR]: each source's header
  kNumRegions = 7
};

// Part of the C ABI (moe_ep_proxy_create): all fields int64.
struct ProxyConfig {
  int64_t rank;
  int64_t world_size;
  int64_t node_size;            // node(r) = r / node_size; world_size % node_size == 0
  int64_t num_local_experts;    // EL: the header holds int32[R] + int32[EL], padded to 16 bytes
  int64_t row_bytes;            // RB: one dispatch row (payload + trailer)
  int64_t comb_row_bytes;       // one combine row
  int64_t private_capacity;     // cap: rows per source in the round-1 region
  int64_t overflow_capacity;    // B: rows in the shared overflow region (one window of the overflow stream)
  int64_t max_send_rows;        // rows in the dispatch send buffer (sum over remote peers)
  int64_t timeout_ns;           // per-phase deadline, from the doorbell
  int64_t spin_ns;              // doorbell polling: spin this long after the last work ...
  int64_t sleep_ns;             // ... then sleep this long between polls
  int64_t trace_level;          // kTraceOff / kTracePhases / kTracePeers: what the trace records
};
static_assert(sizeof(ProxyConfig) == 13 * 8, "ProxyConfig is part of the C ABI");

// Trace levels (ProxyConfig::trace_level). Per-peer events cost the proxy about 15 ns each, five
// per remote peer and dispatch (a third of its CPU at EP64), so buffers record phases only
// unless asked for peers (tests, diagnosis).
enum : int64_t { kTraceOff = 0, kTracePhases = 1, kTracePeers = 2 };

// Whether some row[p] is negative or above cap (as unsigned, a negative count is above any cap):
// one pass over n counts, vectorized (the proxy does it for every row of the count matrix).
__attribute__((optimize("tree-vectorize"))) inline bool row_exceeds(const int32_t* row, int n, uint32_t cap) {
  uint32_t any = 0;
  for (int p = 0; p < n; ++p) any |= uint32_t(uint32_t(row[p]) > cap);
  return any != 0;
}

inline int64_t proxy_hdr_bytes(int64_t world, int64_t el) { return (4 * (world + el) + 15) / 16 * 16; }
// Minimum byte size of each region for a config (kReg* order).
void proxy_region_bytes(const ProxyConfig& c, uint64_t out[kNumRegions]);

// One served phase, for measurements (moe_ep_proxy_phase_times): steady-clock ns.
struct PhaseRecord {
  int64_t kind;      // 0 dispatch (D1 + D2), 1 combine
  int64_t epoch;
  int64_t seen_ns;   // the proxy saw the doorbell
  int64_t mid_ns;    // dispatch: every D1 immediate counted; combine: = ready_ns
  int64_t ready_ns;  // just before the ready word was written
  int64_t cpu_ns;    // CPU time of the proxy thread in the phase (the transport's own threads not included)
  int64_t posts;     // writes the phase posted
  int64_t bells;     // doorbells it saw (dispatch: the header bell and each remote peer's rows bell)
};
static_assert(sizeof(PhaseRecord) == 8 * 8, "PhaseRecord is part of the C ABI");

// One event of the proxy's trace (moe_ep_proxy_trace): what it saw and did, in order.
enum : int32_t {
  kTrHdrBell = 0,   // the header bell of dispatch `epoch` seen
  kTrRowsBell = 1,  // peer's rows bell seen
  kTrPostD0 = 2,    // header write to peer posted
  kTrPostD1 = 3,    // round-1 rows to peer posted
  kTrPostD2 = 4,    // overflow rows to peer posted
  kTrGotD0 = 5,     // peer's header landed
  kTrGotD1 = 6,     // peer's round-1 rows landed
  kTrGotD2 = 7,     // peer's overflow rows landed
  kTrHdrReady = 8,  // every header in: the count matrix
  kTrDispReady = 9,
  kTrCombBell = 10, // source peer's combine rows bell seen
  kTrPostC = 11,
  kTrGotC = 12,
  kTrCombReady = 13,
  kTrPostCredit = 14, // credit for overflow window `epoch`'s next window sent to peer
  kTrGotCredit = 15,  // peer's credit landed
  kTrOvReady = 16,    // an overflow window beyond the first landed (ov_ready raised)
};
struct TraceEvent {
  int64_t ns;     // steady clock
  int64_t epoch;
  int32_t kind;   // kTr*
  int32_t peer;   // -1 where none
};
static_assert(sizeof(TraceEvent) == 24, "TraceEvent is part of the C ABI");

class Proxy {
 public:
  // Registers the regions (in kReg* order) with `t`, which the caller keeps alive and connects
  // before start(). Returns null and sets the thread's error on a bad config or short region.
  static Proxy* create(Transport* t, const ProxyConfig& cfg, void* const regions[kNumRegions],
                       const uint64_t lens[kNumRegions], int64_t* mailbox, uint64_t mailbox_words);
  ~Proxy();  // stops and joins the thread

  int start();
  void stop();
  const uint32_t* keys() const { return keys_; }
  std::string error_message();
  // Phases served. Counted (and recorded) before the phase's ready word is stored, so a reader
  // that has seen ready (acquire) reads a count that includes that phase.
  int64_t phases_done() const { return phases_done_.load(std::memory_order_acquire); }
  // Copies up to `max` of the most recent phase records (oldest first); returns how many.
  int phase_records(PhaseRecord* out, int max);
  // Copies up to `max` of the most recent trace events (oldest first); returns how many.
  int trace(TraceEvent* out, int max);

 private:
  Proxy() = default;
  void loop();
  bool run_dispatch(int64_t epoch);  // false: error recorded
  bool run_combine(int64_t epoch);
  // A combine bell of a remote source (to the latest dispatch, or stale), or -1 (none new).
  int64_t comb_bell_seen();
  // One immediate (phase, src, epoch) taken from the counter if it is there (never blocks);
  // *lost (when still unset), when it is not there: `src` and why, if `src` itself was lost; -1
  // and why, if the job is failing (some peer lost without a clean goodbye).
  struct Lost {
    int peer = -1;
    std::string why;
  };
  bool take(int phase, int src, int64_t epoch, Lost* lost);
  bool left_cleanly(int p);  // peer p said a clean goodbye (it closed after finishing, no error)
  bool failing();            // some peer was lost without a clean goodbye
  // The immediates of `phase` from every rank of `srcs`, all taken at once when all are there
  // within timeout_ns (one wake-up for them all); false (nothing taken) otherwise.
  bool await_all(int phase, int64_t epoch, const std::vector<int>& srcs, int64_t timeout_ns);
  // Completions of own writes, waiting up to wait_ns for the first; false: error recorded.
  bool reap(int phase, int64_t epoch, int64_t wait_ns = 0);
  // After a pass that did nothing (`bells`: some bell is still to ring; `imms`: some immediate
  // still to come): spin until spin_ns since `last_work`, then sleep until something can have
  // changed (see proxy.cc). Returns how long the next pass's reap may wait.
  int64_t idle(int64_t last_work, uint64_t seen_gen, bool bells, bool imms);
  static constexpr int64_t kLateGoodbyeNs = 100'000'000;  // how long a failure waits for a lost link's goodbye
  static constexpr int64_t kBlockNs = 1'000'000;  // the longest sleep in a phase (stop() and the deadline are checked after)
  void trace_event(int32_t kind, int peer, int64_t epoch);
  // trace_event at kTracePhases (phase events) / kTracePeers (one per peer).
  void trace_phase(int32_t kind, int64_t epoch) {
    if (cfg_.trace_level >= kTracePhases) trace_event(kind, -1, epoch);
  }
  void trace_peer(int32_t kind, int peer, int64_t epoch) {
    if (cfg_.trace_level >= kTracePeers) trace_event(kind, peer, epoch);
  }
  // The peers in todo_ whose bell (mailbox array `word`) rang for `epoch`: each counted, traced
  // (`kind`) and handed to `serve`, and dropped from todo_; the rest kept, in order. Returns how
  // many rang, or -1 when `serve` failed (error recorded).
  template <class F>
  int serve_bells(int (*word)(int64_t, int), int64_t epoch, int32_t kind, F serve) {
    size_t keep = 0;
    int rung = 0;
    for (size_t i = 0; i < todo_.size(); ++i) {
      const int p = todo_[i];
      if (load(word(cfg_.world_size, p)) < epoch) {
        todo_[keep++] = p;
        continue;
      }
      ++phase_bells_;
      ++rung;
      trace_peer(kind, p, epoch);
      if (!serve(p)) return -1;
    }
    todo_.resize(keep);
    return rung;
  }
  // The immediates of `epoch` that landed and that `want(phase, source)` waits for, taken from
  // the counter's arrival log into arrived_ (the rest stay counted, for later or never: a stray
  // write is not consumed); kErrPeer once the counter failed.
  template <class F>
  int take_arrived(int64_t epoch, F want);
  bool fail(int64_t code, int peer, int phase, int64_t epoch, const std::string& msg);
  // The timeout of a phase: names the first of `from` (ranks) for which `missing(rank)`, and how
  // many are missing ("no immediate from peer P within T s (what; n of m peers missing: ...)");
  // with several immediates a write, how many of the first one's (`imm_phase`; -1: none) landed.
  template <class F>
  bool fail_missing(int phase, int imm_phase, int64_t epoch, const std::vector<int>& from, F missing,
                    const std::string& what);
  // The timeout of own writes: names the first peer with a write outstanding.
  bool fail_writes(int phase, int64_t epoch);
  // Queues one write with the immediate (phase, this rank, epoch); flush() posts the queue in one
  // post_writes call. Every group of posts is flushed before anything reads n_posted_.
  // (Fields stored in the queue's slot: a WriteOp built on the stack and copied in is read back
  // with wide loads from narrow stores, a store-forwarding stall per write.)
  void post(int phase, int64_t epoch, int peer, int lreg, uint64_t loff, int rreg, uint64_t roff, uint64_t len) {
    WriteOp& w = batch_.emplace_back();
    w.peer = peer;
    w.local_key = keys_[lreg];
    w.local_off = loff;
    w.remote_key = keys_[rreg];
    w.remote_off = roff;
    w.len = len;
    w.has_imm = true;
    w.imm = make_imm(phase, int(cfg_.rank), epoch);
  }
  // Posts the queued writes; false (error recorded, naming the first write not posted) on failure.
  bool flush(int64_t epoch) { return batch_.empty() || flush_batch(epoch); }
  bool flush_batch(int64_t epoch);
  std::vector<WriteOp> batch_;  // writes queued by post(), not posted yet
  // Whether rank p is on another node than this rank (no division: the proxy asks per peer and event).
  bool remote(int p) const { return unsigned(p - my_lo_) >= unsigned(node_g_); }
  int my_lo_ = 0, node_g_ = 1;  // this rank's node: ranks [my_lo_, my_lo_ + node_g_)
  std::vector<int> node_lo_;    // per rank r: the first rank of r's node (r / node_size * node_size)
  int lost_peer();  // the first peer lost (the root cause), else -1
  // The peer to name for lost peer `lost`: the cause its goodbye gave, if it closed after an error
  // of its own naming another peer; else `lost`.
  int cause_of(int lost);
  // A lost-peer failure naming the first peer lost (else `peer`), or the cause its goodbye gave.
  bool fail_lost(int peer, int phase, int64_t epoch, const std::string& msg);
  int64_t load(int w) const { return __atomic_load_n(&mb_[w], __ATOMIC_ACQUIRE); }
  void store(int w, int64_t v) { __atomic_store_n(&mb_[w], v, __ATOMIC_RELEASE); }
  // Raises ready word w to `epoch` for rows that landed in a region the kernels read: after the
  // GPUDirect RDMA flush where those regions are GPU memory. False (error recorded) if it failed.
  bool raise_ready(int w, int64_t epoch, int phase) {
    if (gdr_region_ < 0) {  // host memory: nothing to flush
      store(w, epoch);
      return true;
    }
    return raise_ready_gdr(w, epoch, phase);
  }
  bool raise_ready_gdr(int w, int64_t epoch, int phase);

  Transport* t_ = nullptr;
  ProxyConfig cfg_{};
  int64_t hdr_ = 0;
  char* reg_[kNumRegions] = {};
  uint64_t len_[kNumRegions] = {};
  uint32_t keys_[kNumRegions] = {};
  int64_t* mb_ = nullptr;
  int gdr_region_ = -1;  // a region peers write into that is GPU memory (-1: none): flush before ready words
  GdrFlush gdr_;

  // Checks source s's count vector (false: a negative count) and adds its overflow to remote
  // ranks into ov_total_.
  bool add_overflow(const int32_t* row, int s);
  std::vector<int64_t> ov_total_;  // per rank p: overflow rows from remote sources (this dispatch's headers so far)
  int64_t ov_sum_ = 0;             // their sum: 0 while no source has overflow for a remote rank
  // The count matrix of dispatch e, row s = source s's count vector, read where it landed (no
  // copy): rows_[e & 1][s] points at s's header in copy e & 1 of the header receive region, which
  // no peer writes again before this rank's dispatch e + 1 has begun (a peer's header of e + 2
  // follows its dispatch e + 1, which needs this rank's header of e + 1), so the combine of e
  // reads it there too. This rank's own row: own_[e & 1], copied from its header slot when the
  // dispatch begins (its kernels write the next one there).
  std::vector<const int32_t*> rows_[2];
  std::vector<int32_t> own_[2];
  static constexpr size_t kHdrChunk = 64;  // headers copied at a time to be checked (run_dispatch)
  std::vector<int32_t> scratch_;  // [kHdrChunk][R]: their counts
  // Per-phase scratch, sized once at create (a phase allocates nothing).
  std::vector<int> others_;           // every rank but this one, ascending
  std::vector<int> todo_;             // peers whose bell has not rung yet
  std::vector<uint64_t> off_;         // per peer: byte offset of its rows (send / combine receive)
  std::vector<char> rows_sent_, got_hdr_, got1_, got2_;  // per rank
  std::vector<char> hdr_taken_;       // per rank: its header was taken by a look of the arrival log (run_dispatch's want)
  // Overflow windows (§10 "Round 2 in windows"). As a source, per receiver p: the next window of
  // this rank's overflow to p to post, its last window, and credits taken from p not yet served.
  std::vector<int64_t> ov_start_, ov_next_, ov_last_, credits_;
  std::vector<char> win_wait_;        // as a receiver: per source, its rows of the current window are awaited
  std::vector<uint32_t> arrived_;     // immediates taken by the last take_arrived
  int64_t phase_posts_ = 0, phase_bells_ = 0;
  int64_t counts_epoch_ = -1;
  int64_t last_disp_ = 0, last_comb_ = 0;
  int n_posted_ = 0;               // writes of the phase not completed yet ...
  std::vector<int> posted_to_;     // ... per peer

  static constexpr int kMaxTrace = 1 << 16;  // ring of the most recent trace events
  std::mutex trace_mu_;             // readers of the trace (the writer takes no lock)
  std::vector<TraceEvent> trace_;   // kMaxTrace slots, written by the proxy thread only
  std::atomic<int64_t> n_trace_{0};
  int64_t ns0_ = 0, tsc0_ = 0;      // steady clock and trace clock at creation (trace() converts)

  static constexpr int kMaxRecords = 8192;  // ring of the most recent phases
  std::mutex rec_mu_;
  std::vector<PhaseRecord> rec_;
  int64_t n_rec_ = 0;
  int64_t mid_ns_ = 0;  // set by run_dispatch after round 1
  void record(const PhaseRecord& r);

  std::thread thr_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> started_{false};
  std::atomic<int64_t> phases_done_{0};
  std::mutex msg_mu_;
  std::string msg_;
};

}  // namespace moe_ep
