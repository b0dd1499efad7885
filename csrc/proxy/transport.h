// Transport interface for the proxy engine: one-sided writes with an optional 32-bit immediate,
// reliable but unordered delivery, completion known by polling (sender) and by counting
// immediates (receiver). Implemented by TcpTransport (tcp_transport.cc), VerbsTransport
// (verbs_transport.cc, libibverbs RC, one or several NICs) and FabricTransport
// (fabric_transport.cc, libfabric FI_EP_RDM: EFA through its efa provider).
//
// Contract:
//  - register_memory(ptr, len) returns a key; a peer addresses that memory as (key, offset).
//    Keys are small integers assigned in registration order (1, 2, ...), so ranks that register
//    the same regions in the same order get the same keys.
//  - endpoint() is an opaque string (tcp: "host:port") that peers pass to connect().
//  - connect(endpoints, timeout_ns): endpoints[r] for every rank r (own entry ignored).
//  - post_write(...) copies len bytes from local (key, off) into the peer's (key, off). The local
//    bytes must stay unchanged until the write's completion. The write's completion (poll) has
//    status kCqOk once every byte has landed in the peer's memory; an error status otherwise.
//    Writes are not ordered with respect to each other, not even to the same peer.
//  - post_writes(ops, n, ...) posts a batch, as n post_write calls in order would (the proxy posts
//    through it: one call per pass and phase).
//  - has_imm: the receiver adds imm_per_write() to imm_counter() at `imm` in all, the whole of it
//    only once all bytes of the write have landed (tcp: 1, once the write has landed; verbs with
//    k NICs: k, one per byte shard as it lands, empty shards included). A receiver waiting for n
//    writes waits for n * imm_per_write(); ranks agree on it at connect. Zero-byte writes carry
//    immediates too.
//  - A lost peer (cut, closed, dead) fails its pending and later writes with kCqPeerLost and
//    fails the receiver's ImmCounter, so waiters return kErrPeer with a message naming the peer.
//  - Every blocking call takes a deadline.
#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "imm_counter.h"

namespace moe_ep {

// Completion status (Completion::status).
enum : int32_t {
  kCqOk = 0,
  kCqTimeout = 1,       // not acknowledged within the op timeout
  kCqPeerLost = 2,      // connection to the peer lost (cut, closed, dead)
  kCqRemoteAccess = 3,  // the peer rejected the write (unknown key or out of bounds)
};

struct Completion {
  uint64_t wr_id;
  int32_t peer;
  int32_t status;
};
static_assert(sizeof(Completion) == 16, "Completion is part of the C ABI");

// Fault injection, off by default; may be changed at run time.
struct FaultConfig {
  int64_t delay_us = 0;   // each shard is held back by a random 0..delay_us microseconds
  bool reorder = false;   // random stream per shard, random pick from each stream's queue
  int cut_peer = -1;      // -1: off; otherwise cut every connection with this peer ...
  int64_t cut_after = 0;  // ... when the (cut_after+1)-th write to it (since start) is posted
};

constexpr uint64_t kDefaultMinShardBytes = 16384;

// Who may connect (docs/ARCHITECTURE.md §9, "Who gets in"): the job secret (128 bits that rank 0
// draws when the proxy session is set up and every rank gets through the process group) and the
// session epoch. Every hello carries both, with the connector's rank and world size; an engine
// refuses a hello that does not match its own. All zero: an engine connected by hand (tests,
// tools) without a secret. The secret is never written to a log or an error message.
struct JobIdentity {
  uint8_t secret[16] = {};
  uint64_t session = 0;
};

// What a closing engine tells each healthy peer before its connections go (its goodbye,
// docs/ARCHITECTURE.md §10 "Naming a silent peer"): whether it closes after an error of its own
// and, if so, the peer that error names and its kind, so a peer that sees the close reports that
// peer (the original cause) and, for a capacity error, a capacity error rather than a lost peer.
struct Goodbye {
  int32_t error = 0;   // 1: the closer had an error; 0: a clean close
  int32_t peer = -1;   // the peer the closer's error names (-1: none; a capacity error: the closer's own)
  int32_t phase = -1;  // the phase of that error: the proxy's kPhaseD1 / kPhaseD2 / kPhaseC (proxy.h)
  int64_t epoch = 0;   // the epoch of that error
  int32_t code = 0;    // its kind: kByeCapacity, else 0 (any other)
};

// Goodbye::code of a CapacityError (moe_ep.errors.ErrorCode.CAPACITY: a rank received more rows
// than its cap). The only kind a goodbye names; other values are taken as 0.
constexpr int32_t kByeCapacity = 3;

// One write: `len` bytes from offset `local_off` of this rank's region `local_key` to offset
// `remote_off` of `peer`'s region `remote_key`, carrying the 32-bit immediate `imm` when `has_imm`.
struct WriteOp {
  int peer;
  uint32_t local_key;
  uint64_t local_off;
  uint32_t remote_key;
  uint64_t remote_off;
  uint64_t len;
  bool has_imm;
  uint32_t imm;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  virtual int register_memory(void* ptr, uint64_t len, uint32_t* key) = 0;
  // Whether register_memory(ptr, len) would take this memory: tried and released at once, no key
  // used. True with *how ("host", "dma-buf", "FI_HMEM_CUDA", ...), else false with *how saying why.
  virtual bool try_register(void* ptr, uint64_t len, std::string* how) = 0;
  virtual std::string endpoint() const = 0;
  virtual int connect(const std::vector<std::string>& endpoints, int64_t timeout_ns) = 0;
  // Posts one write (WriteOp); *wr_id names its completion.
  virtual int post_write(const WriteOp& w, uint64_t* wr_id) = 0;
  // Posts n writes in order, as n post_write calls would (wr_ids[i], when wr_ids is not null,
  // names ops[i]'s completion): one call for a batch, so a transport can hand them over at once
  // (one doorbell per queue: chained ibv_post_send, FI_MORE; the null transport one call). kOk
  // with every write posted; else the error of ops[*posted], the first write not posted (the
  // *posted before it were posted and complete as usual). The default posts them one by one.
  virtual int post_writes(const WriteOp* ops, int n, uint64_t* wr_ids, int* posted) {
    for (int i = 0; i < n; ++i) {
      uint64_t wr = 0;
      if (const int rc = post_write(ops[i], wr_ids ? &wr_ids[i] : &wr); rc != kOk) {
        *posted = i;
        return rc;
      }
    }
    *posted = n;
    return kOk;
  }
  // Returns the number of completions written to out (0..max), waiting up to timeout_ns for the
  // first one (0: do not wait); negative on error.
  virtual int poll(Completion* out, int max, int64_t timeout_ns) = 0;
  virtual ImmCounter& imm_counter() = 0;
  // What one write with an immediate adds to the receiver's count (see the contract above).
  virtual int imm_per_write() const { return 1; }
  virtual void set_fault(const FaultConfig& f) = 0;
  // Writes not acknowledged within this time complete with kCqTimeout (default 30 s).
  virtual void set_op_timeout(int64_t ns) = 0;
  // Transports that split a write into shards make none smaller than this (default
  // kDefaultMinShardBytes; tcp 1: a shard per stream for any write of at least `streams` bytes;
  // verbs: shards over the NICs, see shard_bounds in transport_common.h).
  virtual void set_min_shard_bytes(uint64_t) {}
  // CPU time the transport's own threads have used so far (ns; -1 when it cannot tell).
  virtual int64_t cpu_ns() { return -1; }
  // tcp: an accepted connection without a valid hello by then is dropped (default 10 s).
  virtual void set_hello_timeout(int64_t) {}
  // tcp: at most this many accepted connections wait for their hello; one more drops the oldest
  // (default 256).
  virtual void set_max_pending(int) {}
  // The connections and hellos refused so far (the last kRefusalRecords lines, oldest first) and
  // how many in all.
  virtual std::vector<std::string> refused(int64_t* total) const = 0;
  // Empty when the peer is healthy; otherwise why it was lost.
  virtual std::string peer_error(int peer) = 0;
  // Sends `g` to every connected peer not gone (lost, or said its own goodbye) and waits (at most
  // kGoodbyeTimeoutNs) until it has left; the first call counts, later ones do nothing. The
  // destructor says a clean goodbye unless one was said.
  virtual void say_goodbye(const Goodbye& g) = 0;
  // True when `peer` said goodbye before it was lost (*out: what it said, its cause already
  // checked: a peer of this job other than the closer, in a known phase; else no peer).
  virtual bool peer_goodbye(int peer, Goodbye* out) = 0;
};

// How long say_goodbye waits for its frames to leave (a peer that is dead but not yet noticed
// never acknowledges them).
constexpr int64_t kGoodbyeTimeoutNs = 1'000'000'000;

// TCP transport: `streams` sockets per direction per peer; listens on bind_host (an IPv4
// address; "0.0.0.0" listens on all interfaces and advertises this host's name). Returns null
// and sets the thread's error on failure.
Transport* create_tcp_transport(int rank, int world, int streams, const std::string& bind_host,
                                const JobIdentity& id = {});

// verbs transport (verbs_transport.cc): libibverbs opened at run time, one RC queue pair per
// peer and NIC. device: the NICs, "NAME[:PORT],..." (a name listed twice is opened twice); "" =
// MOE_EP_IB_DEVICE, else the first `nics` devices with an active port. nics: how many (0 =
// MOE_EP_IB_NICS, else as many as listed, else 1). port 0 = MOE_EP_IB_PORT, else 1; gid_index
// -1 = MOE_EP_IB_GID_INDEX, else the first RoCE v2 IPv4-mapped GID (InfiniBand: index 0).
// Returns null and sets the thread's error (naming what is missing: the library, a device, an
// active port, a GID) on failure.
Transport* create_verbs_transport(int rank, int world, const std::string& device, int port, int gid_index,
                                  int nics = 0, const JobIdentity& id = {});
// True when a verbs engine could be created here; *what names the device, or why not.
bool verbs_probe(std::string* what);
#ifdef MOE_EP_TEST_HOOKS
// Test hook (csrc/testing/hooks.cc): destroys the queue pairs of a verbs engine to `peer` (the
// peer's writes then fail).
int verbs_destroy_qp(Transport* t, int peer);
#endif
// How a verbs engine registered region `key` on each NIC: "host", "dma-buf" or "gpu address"
// ('/'-joined per NIC; "" for a 0-byte region or another engine).
std::string verbs_region_how(Transport* t, uint32_t key);

// libfabric transport (fabric_transport.cc): libfabric opened at run time, `endpoints` FI_EP_RDM
// endpoints (1..16; every rank must open as many) over which writes are sharded as verbs shards
// them over NICs. provider: "tcp;ofi_rxm", "udp;ofi_rxd", "efa", "shm", ...; "" =
// MOE_EP_FI_PROVIDER, else FI_PROVIDER, else efa where it fits, else libfabric's first. domain:
// the fi_info domain (interface) name, e.g. "lo", or several ("rdmap16s27-rdm,rdmap17s27-rdm":
// endpoint i opens domain i % n); "" = MOE_EP_FI_DOMAIN, else the provider's first. endpoints 0:
// one per listed domain; else a multiple of their number. force_mr_mode: FI_MR_* bits used as if
// the provider had asked for them (tests: the paths EFA needs on tcp). Returns null and sets the thread's error (naming what is missing: the
// library, a provider with FI_EP_RDM + FI_RMA + remote CQ data) on failure.
Transport* create_fabric_transport(int rank, int world, const std::string& provider, const std::string& domain,
                                   int endpoints = 1, int force_mr_mode = 0, const JobIdentity& id = {});
// True when a libfabric engine could be created here; *what names the provider and domain, or why not.
bool fabric_probe(const std::string& provider, const std::string& domain, std::string* what);
// A libfabric engine's provider, domain and mr_mode as JSON ("" for another engine).
std::string fabric_describe(Transport* t);

// The message of the last failed call on this thread (set by every failing call).
inline std::string& thread_error() {
  static thread_local std::string msg;
  return msg;
}
inline int set_error(int code, const std::string& msg) {
  thread_error() = msg;
  return code;
}
// What a C API function returns for `f()`: its code, or kErrSystem with the message of an
// exception it threw (none crosses the C boundary).
template <class F>
int guarded(F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    return set_error(kErrSystem, std::string("native exception: ") + e.what());
  }
}

}  // namespace moe_ep
