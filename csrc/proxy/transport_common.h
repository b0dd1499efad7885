// Pieces every transport shares: the table of registered regions (keys in registration order),
// the completion queue of posted writes (pending writes, op timeouts, poll), a thread's CPU
// clock, the messages of local argument errors, endpoint strings, the goodbye, the record of a lost
// peer, a thread's start, connect's wait for every link, the checks of a post, the fault-injection
// cut and the keepalive clock.
#pragma once

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "transport.h"

namespace moe_ep {

inline int64_t steady_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// CPU ns a running thread has used (-1 when it cannot tell).
inline int64_t thread_cpu_ns(std::thread& t) {
  clockid_t cid;
  timespec ts{};
  if (!t.joinable() || pthread_getcpuclockid(t.native_handle(), &cid) != 0 || clock_gettime(cid, &ts) != 0) return -1;
  return int64_t(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

// CPU ns the threads of `owners` (each a unique_ptr to something with a `thr`: a NIC, an
// endpoint) have used, summed (-1 when it cannot tell for one of them).
template <class Owner>
int64_t threads_cpu_ns(const std::vector<std::unique_ptr<Owner>>& owners) {
  int64_t sum = 0;
  for (auto& o : owners) {
    const int64_t c = thread_cpu_ns(o->thr);
    if (c < 0) return -1;
    sum += c;
  }
  return sum;
}

// `t` once its start(args...) returned kOk; else null, `t` deleted, the thread's error what start
// said (not what the destructor may say after it).
template <class Engine, class... Args>
Transport* started(Engine* t, Args&&... args) {
  if (t->start(std::forward<Args>(args)...) == kOk) return t;
  const std::string msg = thread_error();
  delete t;
  thread_error() = msg;
  return nullptr;
}

// ---- Endpoint strings: "KIND;key=value;..." (verbs1, fabric1), values in hex or '/'-, ','-joined ----

inline std::string hex(const uint8_t* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) s += d[p[i] >> 4], s += d[p[i] & 15];
  return s;
}

// The bytes of hex digits `s` (either case); false when it is not an even number of them.
inline bool unhex(const std::string& s, std::vector<uint8_t>* out) {
  if (s.size() % 2) return false;
  auto nib = [](char c) { return std::isdigit(c) ? c - '0' : std::isxdigit(c) ? std::tolower(c) - 'a' + 10 : -1; };
  out->clear();
  for (size_t i = 0; i < s.size(); i += 2) {
    const int hi = nib(s[i]), lo = nib(s[i + 1]);
    if (hi < 0 || lo < 0) return false;
    out->push_back(uint8_t(hi * 16 + lo));
  }
  return true;
}

inline std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream is(s);
  while (std::getline(is, cur, sep)) out.push_back(cur);
  return out;
}

// The key=value fields of endpoint `ep` into *kv: kOk, or kErrInvalid with the thread's error set
// to `bad` (+ why) when it is not a `kind` endpoint or a field has no '='.
inline int endpoint_fields(const std::string& ep, const std::string& kind, const std::string& bad,
                           std::unordered_map<std::string, std::string>* kv) {
  const auto fields = split(ep, ';');
  if (fields.empty() || fields[0] != kind) return set_error(kErrInvalid, bad + " (not a " + kind + " endpoint)");
  for (size_t i = 1; i < fields.size(); ++i) {
    const auto eq = fields[i].find('=');
    if (eq == std::string::npos) return set_error(kErrInvalid, bad);
    (*kv)[fields[i].substr(0, eq)] = fields[i].substr(eq + 1);
  }
  return kOk;
}

// Byte sharding of one write over k NICs (verbs): shard i is [out[i], out[i + 1]), contiguous and
// in order, out[0] = 0, out[k] = len. Every shard is `chunk` bytes except the last non-empty one
// (the rest, 1..chunk bytes) and the empty ones after it, where chunk = max(ceil(len / k),
// min_shard) rounded up to a multiple of `align` (0 and 1: no rounding). So shards start at
// multiples of `align`, none but the last non-empty one is shorter than min_shard, and a write
// smaller than min_shard is one shard followed by k - 1 empty ones. len 0: k empty shards.
inline void shard_bounds(uint64_t len, int k, uint64_t min_shard, uint64_t align, uint64_t* out) {
  if (k < 1) k = 1;
  align = std::max<uint64_t>(align, 1);
  uint64_t chunk = std::max<uint64_t>(len / uint64_t(k) + (len % uint64_t(k) != 0), std::max<uint64_t>(min_shard, 1));
  chunk = chunk + (align - chunk % align) % align;
  out[0] = 0;
  for (int i = 1; i <= k; ++i) out[i] = std::min<uint64_t>(len, out[i - 1] + std::min<uint64_t>(chunk, len));
}

// False when (rank, world) is valid; else true, with the thread's error set.
inline bool bad_rank(int rank, int world) {
  if (world >= 1 && rank >= 0 && rank < world) return false;
  set_error(kErrInvalid, "rank " + std::to_string(rank) + ": bad rank for world size " + std::to_string(world));
  return true;
}

// ---- Who gets in: the hello every connection starts with (docs/ARCHITECTURE.md §9) ----

constexpr uint32_t kMagicHello = 0x3248454d;    // "MEH2": the hello with the job identity
constexpr uint32_t kMagicHelloV1 = 0x4850454d;  // "MEPH": the hello before it (refused, by name)

// tcp: the first message of every connection, connector -> listener; verbs: the payload of the
// hello SEND; libfabric: the hello message (fi_send). Host byte order (little-endian hosts).
struct WireHello {
  uint32_t magic;     // kMagicHello
  int32_t src_rank;   // the connector
  int32_t dst_rank;   // the rank it means to reach
  int32_t world;      // its world size
  int32_t lane;       // tcp: the stream; verbs: the NIC index; libfabric: the endpoint index
  uint32_t reserved;  // 0
  uint64_t session;   // JobIdentity::session
  uint8_t secret[16];  // JobIdentity::secret
};
static_assert(sizeof(WireHello) == 48, "wire format");

inline WireHello make_hello(const JobIdentity& id, int src, int dst, int world, int lane) {
  WireHello h{kMagicHello, src, dst, world, lane, 0, id.session, {}};
  std::memcpy(h.secret, id.secret, sizeof(h.secret));
  return h;
}

// "" for the magic of a hello, else what the first 4 bytes say instead.
inline std::string hello_magic_problem(uint32_t magic) {
  if (magic == kMagicHello) return "";
  if (magic == kMagicHelloV1) return "a hello without the job identity (a moe_ep older than this one)";
  char m[16];
  std::snprintf(m, sizeof(m), "0x%08x", magic);
  return std::string("not a moe_ep hello (magic ") + m + ")";
}

// Whether `secret` is the job's, compared in constant time.
inline bool same_secret(const uint8_t* secret, const JobIdentity& id) {
  uint8_t diff = 0;
  for (size_t i = 0; i < sizeof(id.secret); ++i) diff |= uint8_t(secret[i] ^ id.secret[i]);
  return diff == 0;
}

// "" when the first `nbytes` bytes `h` are a hello from a peer of this job (another rank of the
// same world, meaning this rank, with this session's epoch and secret); else what is wrong, in
// words that never contain a secret. The secrets are compared in constant time.
inline std::string hello_mismatch(const WireHello& h, uint64_t nbytes, int rank, int world, const JobIdentity& id) {
  if (nbytes < sizeof(WireHello))
    return "a hello of " + std::to_string(nbytes) + " bytes (expected " + std::to_string(sizeof(WireHello)) +
           (nbytes == 0 ? "; a moe_ep older than this one?)" : ")");
  if (std::string why = hello_magic_problem(h.magic); !why.empty()) return why;
  if (h.world != world)
    return "world size " + std::to_string(h.world) + " (this job has " + std::to_string(world) + ")";
  if (h.src_rank < 0 || h.src_rank >= world || h.src_rank == rank)
    return "source rank " + std::to_string(h.src_rank) + " (not a peer of rank " + std::to_string(rank) +
           " in a world of " + std::to_string(world) + ")";
  if (h.dst_rank != rank) return "meant for rank " + std::to_string(h.dst_rank) + " (this is rank " + std::to_string(rank) + ")";
  if (h.session != id.session)
    return "session epoch " + std::to_string(h.session) + " (this session: " + std::to_string(id.session) +
           "; a rank of another session or job)";
  if (!same_secret(h.secret, id)) return "the job secret does not match (a process outside this job)";
  return "";
}

// ---- The goodbye: a closing engine's last frame to each peer (docs/ARCHITECTURE.md §10) ----

constexpr uint32_t kMagicGoodbye = 0x4247454d;  // "MEGB"
constexpr int kGoodbyePhases = 4;               // the proxy's phases: the 2 phase bits of an immediate (proxy.h kPhase*)

// tcp: sent on every connection with the peer (on a data stream as a frame of its own, on an ack
// stream after an ack marker); verbs: the payload of a SEND; libfabric: a message. It carries the
// identity of the hello, checked the same way (FI_EP_RDM has no connection to vouch for the sender). Host byte order.
struct WireGoodbye {
  uint32_t magic;       // kMagicGoodbye
  int32_t src_rank;     // the closing rank
  int32_t dst_rank;     // the rank it is sent to
  int32_t world;        // its world size
  int32_t error;        // Goodbye::error (1: it closes after an error of its own)
  int32_t cause_peer;   // Goodbye::peer
  int32_t cause_phase;  // Goodbye::phase
  int32_t cause_code;   // Goodbye::code (kByeCapacity, else 0)
  int64_t cause_epoch;  // Goodbye::epoch
  uint64_t session;     // JobIdentity::session
  uint8_t secret[16];   // JobIdentity::secret
};
static_assert(sizeof(WireGoodbye) == 64, "wire format");

inline WireGoodbye make_goodbye(const JobIdentity& id, int src, int dst, int world, const Goodbye& g) {
  WireGoodbye w{kMagicGoodbye, src, dst, world, g.error ? 1 : 0, g.peer, g.phase, g.code, g.epoch, id.session, {}};
  std::memcpy(w.secret, id.secret, sizeof(w.secret));
  return w;
}

// "" when the first `nbytes` bytes `g` are a goodbye from peer `src` of this job to this rank; else
// what is wrong, in words that never contain a secret.
inline std::string goodbye_mismatch(const WireGoodbye& g, uint64_t nbytes, int src, int rank, int world,
                                    const JobIdentity& id) {
  if (nbytes < sizeof(WireGoodbye))
    return "a goodbye of " + std::to_string(nbytes) + " bytes (expected " + std::to_string(sizeof(WireGoodbye)) + ")";
  if (g.magic != kMagicGoodbye) return "not a goodbye";
  if (g.world != world) return "a goodbye for world size " + std::to_string(g.world) + " (this job has " + std::to_string(world) + ")";
  if (g.src_rank != src) return "a goodbye saying rank " + std::to_string(g.src_rank) + ", from peer " + std::to_string(src);
  if (g.dst_rank != rank) return "a goodbye meant for rank " + std::to_string(g.dst_rank);
  if (g.session != id.session) return "a goodbye of session epoch " + std::to_string(g.session);
  if (!same_secret(g.secret, id)) return "a goodbye whose job secret does not match";
  return "";
}

inline const char* goodbye_phase_name(int phase) { return phase == 2 ? "combine" : "dispatch"; }

// A clean goodbye of a peer not lost yet (PeerT: a transport's peer, with mu, lost and the
// goodbye fields); the first one counts. The loss that follows names it (lose_peer).
template <class PeerT>
void remember_goodbye(PeerT& pr, const Goodbye& bye, const std::string& text) {
  std::lock_guard<std::mutex> lk(pr.mu);
  if (pr.lost || pr.said_bye) return;
  pr.bye = bye;
  pr.bye_text = text;
  pr.said_bye = true;
}

// A goodbye that lands after its peer was lost without one: the loss was noticed first (a
// keepalive or a write to the closed link failed before the goodbye queued ahead of the close was
// read; providers order the two as they like). It still counts, and the loss's text names it, so
// the cause is named all the same. True where it was taken so; under pr.mu.
template <class PeerT>
bool late_goodbye(PeerT& pr, const Goodbye& bye, const std::string& text) {
  if (!pr.lost || pr.said_bye) return false;
  pr.bye = bye;
  pr.bye_text = text;
  pr.said_bye = true;
  pr.err += "; its goodbye said: " + text;
  return true;
}

// Whether the peer is gone: lost, or it said goodbye (nothing is sent to it any more, a goodbye
// included: it may never take one).
template <class PeerT>
bool peer_gone(PeerT& pr) {
  std::lock_guard<std::mutex> lk(pr.mu);
  return pr.lost || pr.said_bye;
}

// What a checked goodbye (goodbye_mismatch passed) may be trusted with: whether its closer had an
// error and, only when that error names another peer of this job in a known phase, that peer (else
// none: the receiver then names the closer, as for any loss); whether it was a capacity error
// (kByeCapacity; any other code is taken as 0). *text says what the closer said.
inline Goodbye trusted_goodbye(const WireGoodbye& g, int world, std::string* text) {
  Goodbye out;
  const std::string who = "rank " + std::to_string(g.src_rank);
  out.error = g.error != 0;
  if (!out.error) {
    *text = who + " closed without an error of its own (a clean close)";
    return out;
  }
  const bool peer_ok = g.cause_peer >= 0 && g.cause_peer < world && g.cause_peer != g.src_rank;
  const bool phase_ok = g.cause_phase >= 0 && g.cause_phase < kGoodbyePhases;
  out.code = g.cause_code == kByeCapacity ? kByeCapacity : 0;
  if (out.code == kByeCapacity) {  // the rank over its cap: the closer's node peer where trusted, else the closer
    if (peer_ok && phase_ok) out.peer = g.cause_peer, out.phase = g.cause_phase, out.epoch = g.cause_epoch;
    const int over = out.peer >= 0 ? out.peer : g.src_rank;
    *text = who + " closed after a CapacityError: rank " + std::to_string(over) + " received more rows than its " +
            "max_recv_rows" + (phase_ok ? std::string(" (") + goodbye_phase_name(g.cause_phase) + " epoch " +
                                              std::to_string(g.cause_epoch) + ")" : std::string());
    return out;
  }
  if (peer_ok && phase_ok) {
    out.peer = g.cause_peer;
    out.phase = g.cause_phase;
    out.epoch = g.cause_epoch;
    *text = who + " closed after its own error naming peer " + std::to_string(g.cause_peer) + " (" +
            goodbye_phase_name(g.cause_phase) + " epoch " + std::to_string(g.cause_epoch) + ")";
  } else if (g.cause_peer < 0) {
    *text = who + " closed after its own error, naming no peer";
  } else {
    *text = who + " closed after its own error, naming peer " + std::to_string(g.cause_peer) + " in phase " +
            std::to_string(g.cause_phase) + " (not trusted: " +
            (peer_ok ? "an unknown phase" : "not another rank of a world of " + std::to_string(world)) + ")";
  }
  return out;
}

// A checked goodbye (goodbye_mismatch passed) from the peer `pr`: a clean one is remembered for
// the loss that follows (true); after an error, lose(text, bye) loses the peer at once, by what
// it said (false). One from a peer lost already is taken as late_goodbye says.
template <class PeerT, class Lose>
bool take_goodbye(const WireGoodbye& g, int world, PeerT& pr, Lose&& lose) {
  std::string text;
  const Goodbye bye = trusted_goodbye(g, world, &text);
  {
    std::lock_guard<std::mutex> lk(pr.mu);
    if (late_goodbye(pr, bye, text)) return !bye.error;
  }
  if (!bye.error) return remember_goodbye(pr, bye, text), true;
  lose(text, bye);
  return false;
}

// say_goodbye of an engine whose peers' links keep bye_status (-2 not sent, -1 pending, else
// done: verbs, libfabric): send(p, i, deadline) on link i of every peer p not gone, then a wait
// (at most kGoodbyeTimeoutNs; `cv` under `mu` is notified as they complete) until each one left
// or its peer went.
template <class PeerT, class Send>
void goodbye_every_link(std::vector<std::unique_ptr<PeerT>>& peers, int rank, std::mutex& mu,
                        std::condition_variable& cv, Send&& send) {
  const int64_t deadline = steady_now_ns() + kGoodbyeTimeoutNs;
  for (int p = 0; p < int(peers.size()); ++p)
    if (p != rank && !peer_gone(*peers[size_t(p)]))
      for (int i = 0; i < int(peers[size_t(p)]->link.size()); ++i) send(p, i, deadline);
  std::unique_lock<std::mutex> lk(mu);
  auto out = [&] {
    for (auto& pr : peers)
      for (auto& l : pr->link)
        if (l->bye_status == -1 && !peer_gone(*pr)) return false;
    return true;
  };
  while (!out() && steady_now_ns() < deadline) cv.wait_for(lk, std::chrono::milliseconds(10));
}

// peer_goodbye of every engine: true when `peer` said goodbye before it was lost (*out: what).
template <class PeerT>
bool said_goodbye(const std::vector<std::unique_ptr<PeerT>>& peers, int peer, Goodbye* out) {
  if (peer < 0 || size_t(peer) >= peers.size()) return false;
  PeerT& pr = *peers[size_t(peer)];
  std::lock_guard<std::mutex> lk(pr.mu);
  if (pr.said_bye) *out = pr.bye;
  return pr.said_bye;
}

// ---- A lost peer (PeerT: a transport's peer, with mu, lost, err and the goodbye fields) ----

// What the loss of `peer` reads: "rank R: connection with peer P lost (WHERE): WHY" ("" where:
// no parentheses).
inline std::string loss_text(int rank, int peer, const std::string& where, const std::string& why) {
  return "rank " + std::to_string(rank) + ": connection with peer " + std::to_string(peer) + " lost" +
         (where.empty() ? "" : " (" + where + ")") + ": " + why;
}

// Marks `pr` lost with *msg (loss_text), under pr.mu, which the caller holds; false when it was
// lost already (the first reason wins). `bye`: lost by its goodbye; else a clean goodbye it said
// before is appended to *msg.
template <class PeerT>
bool mark_lost(PeerT& pr, std::string* msg, const Goodbye* bye) {
  if (pr.lost) return false;
  if (bye) pr.bye = *bye, pr.said_bye = true;
  else if (pr.said_bye) *msg += "; its goodbye said: " + pr.bye_text;
  pr.err = *msg;
  pr.lost = true;
  return true;
}

// peer_error of every engine: "" while `peer` is healthy, else why it was lost.
template <class PeerT>
std::string loss_of(const std::vector<std::unique_ptr<PeerT>>& peers, int peer) {
  if (peer < 0 || size_t(peer) >= peers.size()) return "";
  std::lock_guard<std::mutex> lk(peers[size_t(peer)]->mu);
  return peers[size_t(peer)]->err;
}

constexpr size_t kRefusalRecords = 64;

// The refused connections and hellos of one engine: each is one line on stderr ("moe_ep: rank R:
// refused ..."; at most kLinesPerSecond a second, the rest counted and named in the next line
// printed) and kept (the last kRefusalRecords) for refused().
class RefusalLog {
 public:
  void record(const std::string& line) {
    std::lock_guard<std::mutex> lk(mu_);
    ++total_;
    lines_.push_back(line);
    if (lines_.size() > kRefusalRecords) lines_.pop_front();
    const int64_t now = steady_now_ns();
    if (now - window_start_ >= 1'000'000'000) {
      window_start_ = now;
      printed_ = 0;
    }
    if (printed_ >= kLinesPerSecond) {
      ++suppressed_;
      return;
    }
    ++printed_;
    std::string more;
    if (suppressed_ > 0) more = " (and " + std::to_string(suppressed_) + " more refused before, not printed)";
    suppressed_ = 0;
    std::fprintf(stderr, "moe_ep: %s%s\n", line.c_str(), more.c_str());
    std::fflush(stderr);
  }
  std::vector<std::string> lines(int64_t* total) const {
    std::lock_guard<std::mutex> lk(mu_);
    if (total) *total = total_;
    return std::vector<std::string>(lines_.begin(), lines_.end());
  }

 private:
  static constexpr int kLinesPerSecond = 20;
  mutable std::mutex mu_;
  std::deque<std::string> lines_;
  int64_t total_ = 0, window_start_ = 0, suppressed_ = 0;
  int printed_ = 0;
};

// Registered regions; key k (1, 2, ...) is the k-th registration.
template <class Region>
class RegionTable {
 public:
  uint32_t add(const Region& r) {
    std::lock_guard<std::mutex> lk(mu_);
    v_.push_back(r);
    max_len_ = std::max<uint64_t>(max_len_, r.len);
    return uint32_t(v_.size());
  }
  // The length of the largest region (0 when there is none).
  uint64_t max_len() const {
    std::lock_guard<std::mutex> lk(mu_);
    return max_len_;
  }
  // The region of `key` when [off, off + len) lies inside it.
  bool lookup(uint32_t key, uint64_t off, uint64_t len, Region* out) const {
    std::lock_guard<std::mutex> lk(mu_);
    if (key == 0 || key > v_.size()) return false;
    const Region& r = v_[key - 1];
    if (off > r.len || len > r.len - off) return false;
    *out = r;
    return true;
  }
  std::vector<Region> snapshot() const {
    std::lock_guard<std::mutex> lk(mu_);
    return v_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<Region> v_;
  uint64_t max_len_ = 0;
};

// The checks every connect() starts with (kOk, or the error code with the thread's error set).
inline int check_connect(int rank, int world, bool connected, size_t n_endpoints) {
  const std::string pre = "rank " + std::to_string(rank) + ": connect: ";
  if (connected) return set_error(kErrInvalid, pre + "already connected");
  if (int(n_endpoints) != world)
    return set_error(kErrInvalid, pre + "got " + std::to_string(n_endpoints) + " endpoints for world size " +
                                      std::to_string(world));
  return kOk;
}

// What connect() returns when its deadline passed before `peer` came up on lane `where`, link `l`:
// how far each side's hello got, in the transport's words (the own hello's status: -1 `pending`, 0
// `done`, else the error `failed` names; its attempts; `peer_hello`), and `more`.
template <class Link>
int connect_timed_out(const std::string& prefix, int peer, int64_t timeout_ns, const std::string& where, const Link& l,
                      const char* pending, const char* done, const char* (*failed)(int), const std::string& peer_hello,
                      const std::string& more = "") {
  const int hs = l.hello_status.load();
  const std::string own_hello = hs < 0 ? pending : hs == 0 ? done : failed(hs);
  return set_error(kErrTimeout, prefix + "connect: peer " + std::to_string(peer) + " never connected within " +
                                    std::to_string(double(timeout_ns) / 1e9) + " s (" + where + "; own hello: " +
                                    own_hello + " (attempt " + std::to_string(l.hello_attempt.load()) +
                                    "); the peer's hello: " + peer_hello + ")" + more);
}

// Starts `fn` on thread *t: kOk, else kErrSystem, "<what>: <the system's refusal>".
template <class Fn>
int start_thread(std::thread* t, Fn fn, const std::string& what) {
  try {
    *t = std::thread(std::move(fn));
  } catch (const std::exception& e) {
    return set_error(kErrSystem, what + ": " + e.what());
  }
  return kOk;
}

// Connect's wait, under `lk` (the lock `cv` is notified under): `scan(&p, &i)` brings up what it
// can and names the first link still waited for (peer p on lane i; p stays -1 when none is) or
// returns an error; it runs again on each notification (20 ms at most apart) until no link is
// waited for (kOk), an error, or the deadline: then `timed_out(p, i)`'s error.
template <class Scan, class TimedOut>
int wait_links_up(std::unique_lock<std::mutex>& lk, std::condition_variable& cv, int64_t deadline, Scan scan,
                  TimedOut timed_out) {
  for (;;) {
    int p = -1, i = 0;
    if (int rc = scan(&p, &i); rc != kOk) return rc;
    if (p < 0) return kOk;
    const int64_t now = steady_now_ns();
    if (now >= deadline) return timed_out(p, i);
    cv.wait_for(lk, std::chrono::nanoseconds(std::min<int64_t>(deadline - now, 20'000'000)));
  }
}

// The checks every post_write() starts with: a peer other than this rank, connected, the local
// range inside a registered region (returned in *out).
template <class Region>
int check_post(int rank, int world, bool connected, const RegionTable<Region>& regions, const WriteOp& w,
               Region* out) {
  const std::string pre = "rank " + std::to_string(rank) + ": post_write";
  if (w.peer < 0 || w.peer >= world || w.peer == rank)
    return set_error(kErrInvalid, pre + ": bad peer " + std::to_string(w.peer));
  if (!connected) return set_error(kErrInvalid, pre + ": not connected");
  if (!regions.lookup(w.local_key, w.local_off, w.len, out))
    return set_error(kErrInvalid, pre + " to peer " + std::to_string(w.peer) + ": local key " +
                                      std::to_string(w.local_key) + " offset " + std::to_string(w.local_off) +
                                      " length " + std::to_string(w.len) + " is not inside a registered region");
  return kOk;
}

// The region `key` (1, 2, ...) among a peer's advertised ones (R: with its len) when
// [off, off + len) lies inside it; else null (the write fails as a remote access error).
template <class R>
const R* remote_region(const std::vector<R>& mrs, uint32_t key, uint64_t off, uint64_t len) {
  if (key == 0 || key > mrs.size() || off > mrs[key - 1].len || len > mrs[key - 1].len - off) return nullptr;
  return &mrs[key - 1];
}

constexpr int kMaxLanes = 16;  // the most NICs (verbs) or endpoints (libfabric) a write is cut over

// One write of `len` bytes cut over k lanes (NICs, endpoints; at most kMaxLanes) by shard_bounds:
// shard s is `bytes(s)` bytes from `at(s)`. posted(s): whether shard s is posted at all (every
// shard of a write with an immediate, which the receiver counts once per shard, empty ones
// included; else those with bytes, and shard 0 of a zero-byte write); posts(): how many are.
class WriteShards {
 public:
  WriteShards(uint64_t len, int k, uint64_t min_shard, uint64_t align, bool has_imm)
      : len_(len), k_(k), has_imm_(has_imm) {
    shard_bounds(len, k, min_shard, align, b_);
  }
  uint64_t at(int s) const { return b_[s]; }
  uint64_t bytes(int s) const { return b_[s + 1] - b_[s]; }
  bool posted(int s) const { return has_imm_ || bytes(s) > 0 || (s == 0 && len_ == 0); }
  int posts() const {
    int n = 0;
    for (int s = 0; s < k_; ++s) n += posted(s);
    return n;
  }

 private:
  uint64_t b_[kMaxLanes + 1];
  uint64_t len_;
  int k_;
  bool has_imm_;
};

// The fault-injection cut (FaultConfig::cut_peer, cut_after), changed at run time by set_fault.
class CutFault {
 public:
  void set(const FaultConfig& f) {
    after_ = f.cut_after;
    peer_ = f.cut_peer;
  }
  // Why a write to `peer` posted after n others to it cuts the peer; "" when it does not.
  std::string cuts(int peer, int64_t n) const {
    if (peer_.load() != peer || n < after_.load()) return "";
    return "connection cut by fault injection after " + std::to_string(n) + " writes";
  }

 private:
  std::atomic<int> peer_{-1};
  std::atomic<int64_t> after_{0};
};

// verbs and libfabric: a peer gets a keepalive once per kKeepaliveNs (verbs: one nothing was
// posted to for that long), from each completion thread, which looks every kKeepaliveNs / 8.
constexpr int64_t kKeepaliveNs = 1'000'000'000;

// When a completion thread next looks at its peers' keepalives (every kKeepaliveNs / 8).
class KeepaliveClock {
 public:
  explicit KeepaliveClock(int64_t now) : next_(now + kKeepaliveNs / 8) {}
  // True once the time has come at `now` (the next look is then set from it).
  bool due(int64_t now) {
    if (now < next_) return false;
    next_ = now + kKeepaliveNs / 8;
    return true;
  }

 private:
  int64_t next_;
};

// Posted writes until their completion, and the completions poll() hands out. A write may have
// several parts (shards); it completes when all have, with the first error status of any.
class CompletionQueue {
 public:
  // Adds a pending write unless `lost` (then it completes at once with kCqPeerLost): checked
  // under the queue's lock, so a concurrent fail_peer() either sees this write or this call
  // sees `lost`. max_per_peer > 0: first waits (until deadline_ns) while the peer has that many
  // pending. Returns 1 added, 0 completed as lost, -1 still full at the deadline.
  int add(uint64_t wr, int peer, uint32_t parts, const std::atomic<bool>& lost, int max_per_peer = 0,
          int64_t deadline_ns = 0) {
    std::unique_lock<std::mutex> lk(mu_);
    if (max_per_peer > 0)
      while (per_peer(peer) >= max_per_peer && !lost && steady_now_ns() < deadline_ns)
        cv_.wait_for(lk, std::chrono::milliseconds(10));
    if (lost) {
      done_.push_back(Completion{wr, peer, kCqPeerLost});
      cv_.notify_all();
      return 0;
    }
    if (max_per_peer > 0 && per_peer(peer) >= max_per_peer) return -1;
    pending_[wr] = Pending{peer, parts, kCqOk, steady_now_ns()};
    ++per_peer(peer);
    return 1;
  }
  // Forgets a pending write that was never sent.
  void remove(uint64_t wr) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = pending_.find(wr);
    if (it == pending_.end()) return;
    --per_peer(it->second.peer);
    pending_.erase(it);
  }
  // The peer of a pending write (-1: not pending).
  int peer_of(uint64_t wr) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = pending_.find(wr);
    return it == pending_.end() ? -1 : it->second.peer;
  }
  // One part of `wr` finished with `status`. Returns the peer, or -1 when the write is not pending
  // (already failed). *completed: this was its last part. Call notify() after a batch.
  int finish(uint64_t wr, int32_t status, bool* completed) {
    std::lock_guard<std::mutex> lk(mu_);
    *completed = false;
    auto it = pending_.find(wr);
    if (it == pending_.end()) return -1;
    Pending& p = it->second;
    const int peer = p.peer;
    if (status != kCqOk && p.status == kCqOk) p.status = status;
    if (--p.parts == 0) {
      done_.push_back(Completion{wr, peer, p.status});
      --per_peer(peer);
      pending_.erase(it);
      *completed = true;
    }
    return peer;
  }
  void push(uint64_t wr, int peer, int32_t status) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      done_.push_back(Completion{wr, peer, status});
    }
    cv_.notify_all();
  }
  void notify() { cv_.notify_all(); }
  // Completes every pending write of `peer` with `status`.
  void fail_peer(int peer, int32_t status) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto it = pending_.begin(); it != pending_.end();) {
        if (it->second.peer == peer) {
          done_.push_back(Completion{it->first, peer, status});
          it = pending_.erase(it);
        } else {
          ++it;
        }
      }
      per_peer(peer) = 0;
    }
    cv_.notify_all();
  }
  // Writes pending for longer than limit_ns (checked at most once a millisecond): calls
  // lose(peer, why) for each, which fails the peer (and so the write) with kCqTimeout.
  template <class Lose>
  void expire(int64_t limit_ns, Lose&& lose) {
    std::vector<std::pair<int, uint64_t>> late;
    const int64_t now = steady_now_ns();
    if (now - last_check_ns_.load() < 1'000'000) return;
    last_check_ns_ = now;
    {
      std::lock_guard<std::mutex> lk(mu_);
      for (auto& [wr, p] : pending_)
        if (now - p.posted_ns > limit_ns) late.emplace_back(p.peer, wr);
    }
    for (auto& [peer, wr] : late)
      lose(peer, "write " + std::to_string(wr) + " not acknowledged within " + std::to_string(double(limit_ns) / 1e9) + " s");
  }
  // Up to `max` completions, waiting up to timeout_ns for the first; tick() runs every 10 ms.
  template <class Tick>
  int poll(Completion* out, int max, int64_t timeout_ns, Tick&& tick) {
    if (max <= 0) return 0;
    const int64_t deadline = steady_now_ns() + std::max<int64_t>(timeout_ns, 0);
    for (;;) {
      tick();
      std::unique_lock<std::mutex> lk(mu_);
      if (!done_.empty()) {
        int n = 0;
        while (n < max && !done_.empty()) {
          out[n++] = done_.front();
          done_.pop_front();
        }
        return n;
      }
      const int64_t now = steady_now_ns();
      if (now >= deadline) return 0;
      cv_.wait_for(lk, std::chrono::nanoseconds(std::min<int64_t>(deadline - now, 10'000'000)));
    }
  }

 private:
  struct Pending {
    int peer;
    uint32_t parts;
    int32_t status;
    int64_t posted_ns;
  };
  int& per_peer(int peer) {
    if (size_t(peer) >= count_.size()) count_.resize(size_t(peer) + 1, 0);
    return count_[size_t(peer)];
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Completion> done_;
  std::unordered_map<uint64_t, Pending> pending_;
  std::vector<int> count_;  // pending writes per peer
  std::atomic<int64_t> last_check_ns_{0};
};


// What the libfabric and verbs transports share besides their lanes (endpoints, NICs) and peers:
// rank and world, the immediates counted, the writes pending, connect's lock and wakeup, the
// write ids, the settings a proxy changes (fault cut, op timeout, minimum shard), the refused
// hellos and the flags; with the overrides that only read or set these.
class LaneTransport : public Transport {
 public:
  LaneTransport(int rank, int world) : rank_(rank), world_(world) {}

  int rank() const override { return rank_; }
  int world() const override { return world_; }
  ImmCounter& imm_counter() override { return imm_; }
  // Only the cut is implemented (delay and reorder belong to the tcp transport's streams).
  void set_fault(const FaultConfig& f) override { cut_.set(f); }
  void set_op_timeout(int64_t ns) override { op_timeout_ns_ = ns; }
  void set_min_shard_bytes(uint64_t n) override { min_shard_ = std::max<uint64_t>(n, 1); }
  std::vector<std::string> refused(int64_t* total) const override { return refusals_.lines(total); }

 protected:
  const int rank_, world_;
  RefusalLog refusals_;
  ImmCounter imm_;
  CompletionQueue cq_;
  std::mutex conn_mu_;
  std::condition_variable conn_cv_;
  std::atomic<uint64_t> next_wr_{1};
  std::atomic<uint64_t> min_shard_{kDefaultMinShardBytes};
  CutFault cut_;
  std::atomic<int64_t> op_timeout_ns_{30'000'000'000LL};
  std::atomic<bool> stop_{false};
  std::atomic<bool> connected_{false};
  std::atomic<bool> bye_said_{false};
};

}  // namespace moe_ep
