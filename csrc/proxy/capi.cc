// C API for ctypes (the bindings in moe_ep/native/; the tests' hooks: csrc/testing/hooks.cc). Every function returns a code from imm_counter.h
// (0 ok, 1 timeout, 2 peer lost, <0 invalid/system) unless noted; on failure the message, naming
// rank, peer and what failed, is available from moe_ep_last_error() on the same thread.
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "cuda_mem.h"
#include "fabric_load.h"
#include "imm_counter.h"
#include "proxy.h"
#include "rdma_probe.h"
#include "transport.h"
#include "transport_common.h"

using moe_ep::Completion;
using moe_ep::guarded;
using moe_ep::ImmCounter;
using moe_ep::Transport;

namespace {
// The job identity of a create call: `secret` 16 bytes (null: none, all zero) and the session epoch.
moe_ep::JobIdentity identity(const uint8_t* secret, uint64_t session) {
  moe_ep::JobIdentity id;
  if (secret) std::memcpy(id.secret, secret, sizeof(id.secret));
  id.session = session;
  return id;
}
int copy_str(const std::string& s, char* buf, size_t len) {
  if (buf && len) {
    const size_t n = std::min(s.size(), len - 1);
    std::memcpy(buf, s.data(), n);
    buf[n] = 0;
  }
  return int(s.size());
}
}  // namespace

#pragma GCC visibility push(default)
extern "C" {

int moe_ep_abi_version() { return 20; }  // 20: a launch graph launched into a capturing stream launches its plans one by one (cuStreamIsCapturing needed); 19: launch graphs (moe_ep_launch_graph_create / _destroy / moe_ep_launch_graph, moe_ep_launch_graph_function); 18: moe_ep_sim_floor's writer_cpu and two more parts (what another core wrote); 17: moe_ep_null_post_calls (the proxy posts through Transport::post_writes); 16: the test hooks (moe_ep_set_fault, moe_ep_verbs_destroy_qp, moe_ep_test_memory_type, moe_ep_imm_stress) only in the tests' build (csrc/testing/hooks.cc); 15: the goodbye's error kind (moe_ep_engine_goodbye's code, WireGoodbye.cause_code); 14: immediates with 3 phase bits (the credit phase), 13 source bits; mailbox words ov_ready / ov_done / comb_win_done / comb_win_bell (12 fixed words); 13: ProxyConfig.trace_level, PhaseRecord.posts / bells, moe_ep_sim_floor; 12: the null transport and peer simulator (null_transport.cc); 11: moe_ep_engine_try_register (GPU memory regions); 10: the efadv engine retired (EFA through libfabric); per-endpoint domains

// How this library was built, for bug reports (python -m moe_ep.doctor): the compiler, the C++
// standard and the builder's flags, which setup.py and the in-tree build of
// moe_ep/native/library.py pass as the string literal MOE_EP_BUILD_FLAGS. A static string.
#ifndef MOE_EP_BUILD_FLAGS
#define MOE_EP_BUILD_FLAGS "unknown (built without MOE_EP_BUILD_FLAGS)"
#endif
#define MOE_EP_STR2(x) #x
#define MOE_EP_STR(x) MOE_EP_STR2(x)
const char* moe_ep_build_info() {
#if defined(__GNUC__) && !defined(__clang__)
#define MOE_EP_COMPILER "gcc " __VERSION__
#else
#define MOE_EP_COMPILER __VERSION__
#endif
  return "compiler " MOE_EP_COMPILER "; C++ " MOE_EP_STR(__cplusplus) "; flags " MOE_EP_BUILD_FLAGS;
}

// Copies the last error of this thread into buf (NUL-terminated); returns its full length.
int moe_ep_last_error(char* buf, size_t len) { return copy_str(moe_ep::thread_error(), buf, len); }

// ---- ImmCounter (standalone, or an engine's via moe_ep_engine_imm) ----
void* moe_ep_imm_create() { return new (std::nothrow) ImmCounter(); }
void moe_ep_imm_destroy(void* c) { delete static_cast<ImmCounter*>(c); }

int moe_ep_imm_add(void* c, uint32_t imm, int64_t n) {
  return guarded([&] {
    static_cast<ImmCounter*>(c)->add(imm, n);
    return 0;
  });
}

int moe_ep_imm_wait(void* c, uint32_t imm, int64_t expected, int64_t timeout_ns) {
  return guarded([&] {
    std::string err;
    const int rc = static_cast<ImmCounter*>(c)->wait(imm, expected, timeout_ns, &err);
    if (rc == moe_ep::kErrTimeout)
      return moe_ep::set_error(rc, "wait for immediate " + std::to_string(imm) + " (expected " + std::to_string(expected) +
                                       ") timed out after " + std::to_string(double(timeout_ns) / 1e9) + " s");
    if (rc != 0) return moe_ep::set_error(rc, err);
    return 0;
  });
}

int64_t moe_ep_imm_value(void* c, uint32_t imm) { return static_cast<ImmCounter*>(c)->value(imm); }

// ---- Engine (a transport plus its ImmCounter) ----
// Every create call takes the job identity every hello carries and checks (transport.h
// JobIdentity): `secret` 16 bytes (null: none, all zero), `session` the session epoch.
// transport: "tcp", "verbs", "libfabric" or "efa" (libfabric with provider efa) (devices, provider
// and domain from the environment, see moe_ep_engine_create_verbs / _fabric; streams and bind_host
// unused). bind_host: IPv4 address to listen
// on (null: 127.0.0.1). Returns null on failure (see moe_ep_last_error).
void* moe_ep_engine_create(const char* transport, int rank, int world, int streams, const char* bind_host,
                           const uint8_t* secret, uint64_t session) {
  try {
    const std::string kind = transport ? transport : "tcp";
    const moe_ep::JobIdentity id = identity(secret, session);
    if (kind == "verbs") return moe_ep::create_verbs_transport(rank, world, "", 0, -1, 0, id);
    if (kind == "efa") return moe_ep::create_fabric_transport(rank, world, "efa", "", 0, 0, id);
    if (kind == "libfabric") return moe_ep::create_fabric_transport(rank, world, "", "", 1, 0, id);
    if (kind != "tcp") {
      moe_ep::set_error(moe_ep::kErrInvalid, "rank " + std::to_string(rank) + ": unknown transport '" + kind + "'");
      return nullptr;
    }
    return moe_ep::create_tcp_transport(rank, world, streams, bind_host ? bind_host : "127.0.0.1", id);
  } catch (const std::exception& e) {
    moe_ep::set_error(moe_ep::kErrSystem, std::string("native exception: ") + e.what());
    return nullptr;
  }
}

// verbs engine (libibverbs loaded at run time). device: the NICs, "NAME[:PORT],..." (a name
// listed twice is opened twice); null or "" = MOE_EP_IB_DEVICE, else the first `nics` devices
// with an active port; nics 0 = MOE_EP_IB_NICS, else as many as listed, else 1; port 0 =
// MOE_EP_IB_PORT, else 1; gid_index -1 = MOE_EP_IB_GID_INDEX, else the first RoCE v2
// IPv4-mapped GID. Null on failure, the message naming what is missing (library, device,
// active port, GID).
void* moe_ep_engine_create_verbs(int rank, int world, const char* device, int port, int gid_index, int nics,
                                 const uint8_t* secret, uint64_t session) {
  try {
    return moe_ep::create_verbs_transport(rank, world, device ? device : "", port, gid_index, nics,
                                          identity(secret, session));
  } catch (const std::exception& e) {
    moe_ep::set_error(moe_ep::kErrSystem, std::string("native exception: ") + e.what());
    return nullptr;
  }
}

// 1 when a verbs engine can be created here, else 0; buf gets the device, or why not.
int moe_ep_verbs_probe(char* buf, size_t len) {
  return guarded([&] {
    std::string what;
    const bool ok = moe_ep::verbs_probe(&what);
    copy_str(what, buf, len);
    return ok ? 1 : 0;
  });
}

// 1 when a verbs engine can be created on `device` and `port` (null or "" and 0: the default
// choice); buf gets the device, or why not.
int moe_ep_verbs_probe_device(const char* device, int port, char* buf, size_t len) {
  return guarded([&] {
    std::string what;
    const bool ok = moe_ep::verbs_probe_device(device ? device : "", port, &what);
    copy_str(what, buf, len);
    return ok ? 1 : 0;
  });
}

// libfabric engine (libfabric loaded at run time): `endpoints` FI_EP_RDM endpoints of `provider`
// (null or "" = MOE_EP_FI_PROVIDER, else FI_PROVIDER, else efa where it fits, else libfabric's
// first) on `domain` (null or "" = MOE_EP_FI_DOMAIN, else the provider's first; "a,b": endpoint
// i on the i % n-th; endpoints 0: one per listed domain); force_mr_mode:
// FI_MR_* bits used as if the provider needed them. Null on failure, the message naming what is
// missing (library, provider, capability).
void* moe_ep_engine_create_fabric(int rank, int world, const char* provider, const char* domain, int endpoints,
                                  int force_mr_mode, const uint8_t* secret, uint64_t session) {
  try {
    return moe_ep::create_fabric_transport(rank, world, provider ? provider : "", domain ? domain : "", endpoints,
                                           force_mr_mode, identity(secret, session));
  } catch (const std::exception& e) {
    moe_ep::set_error(moe_ep::kErrSystem, std::string("native exception: ") + e.what());
    return nullptr;
  }
}

// 1 when a libfabric engine can be created here (null or "": the default choices), else 0; buf
// gets the provider and domain, or why not.
int moe_ep_fabric_probe(const char* provider, const char* domain, char* buf, size_t len) {
  return guarded([&] {
    std::string what;
    const bool ok = moe_ep::fabric_probe(provider ? provider : "", domain ? domain : "", &what);
    copy_str(what, buf, len);
    return ok ? 1 : 0;
  });
}

// Every fi_info entry of `provider` (null or "": all) as JSON (fabric_load.h providers_json);
// returns its full length.
int moe_ep_fabric_providers(const char* provider, char* buf, size_t len) {
  return copy_str(moe_ep::fi::providers_json(provider ? provider : ""), buf, len);
}

// A libfabric engine's provider, domain and mr_mode as JSON ("" for another engine); returns the length.
int moe_ep_fabric_describe(void* e, char* buf, size_t len) {
  return copy_str(moe_ep::fabric_describe(static_cast<Transport*>(e)), buf, len);
}

// Every RDMA device libibverbs lists, as JSON (see rdma_probe.h); returns its full length.
int moe_ep_rdma_devices(char* buf, size_t len) {
  return copy_str(moe_ep::rdma_devices_json(), buf, len);
}

// How a verbs engine registered region `key` ("host", "dma-buf", "gpu address" per NIC,
// '/'-joined); returns the length.
int moe_ep_verbs_region_how(void* e, uint32_t key, char* buf, size_t len) {
  return copy_str(moe_ep::verbs_region_how(static_cast<Transport*>(e), key), buf, len);
}

// Whether engine `e` would register [ptr, ptr + len) (tried and released, no key used): 1 with
// how it would ("host", "dma-buf", "FI_HMEM_CUDA", ...) in buf, else 0 with why not.
int moe_ep_engine_try_register(void* e, void* ptr, uint64_t len, char* buf, size_t buflen) {
  std::string how;
  const bool ok = static_cast<Transport*>(e)->try_register(ptr, len, &how);
  copy_str(how, buf, buflen);
  return ok ? 1 : 0;
}

// ---- GPU memory (cuda_mem.h) ----
// 1 when ptr is device memory (as registration decides it), else 0.
int moe_ep_memory_type(const void* ptr) { return moe_ep::memory_type(ptr) == moe_ep::MemType::Device ? 1 : 0; }

// The dma-buf fd registration would use for [ptr, ptr + len) (the caller closes it) and ptr's
// offset in it; 0, or -1 with the message (library, symbol, driver error).
int moe_ep_cuda_dmabuf_fd(const void* ptr, uint64_t len, int* fd, uint64_t* offset) {
  return guarded([&] {
    std::string why;
    if (!moe_ep::cuda_dmabuf_fd(ptr, len, fd, offset, &why)) return moe_ep::set_error(moe_ep::kErrInvalid, why);
    return 0;
  });
}

void moe_ep_engine_destroy(void* e) { delete static_cast<Transport*>(e); }

// Before moe_ep_engine_destroy: the goodbye the engine sends every connected peer (transport.h
// Goodbye): `error` 1 when it closes after an error of its own naming `peer` (-1: none) in `phase`
// (the proxy's kPhase*) of `epoch`, `code` its kind (kByeCapacity: a CapacityError, else 0); 0 for
// a clean close (what destroy says without this call). Waits until the goodbye has left, at most
// kGoodbyeTimeoutNs. The first goodbye counts.
int moe_ep_engine_goodbye(void* e, int error, int peer, int phase, int64_t epoch, int code) {
  return guarded([&] {
    static_cast<Transport*>(e)->say_goodbye(moe_ep::Goodbye{error ? 1 : 0, peer, phase, epoch, code});
    return 0;
  });
}

void* moe_ep_engine_imm(void* e) { return &static_cast<Transport*>(e)->imm_counter(); }

// What one write with an immediate adds to the receiver's count (tcp 1, verbs its NIC count).
int moe_ep_engine_imm_per_write(void* e) { return static_cast<Transport*>(e)->imm_per_write(); }

// The byte shards of a write of `len` bytes over k NICs (transport_common.h shard_bounds): writes
// k + 1 bounds into out (shard i is [out[i], out[i + 1])). -1 when k is out of 1..1024.
int moe_ep_shard_bounds(uint64_t len, int k, uint64_t min_shard, uint64_t align, uint64_t* out) {
  if (k < 1 || k > 1024) return moe_ep::set_error(moe_ep::kErrInvalid, "shard_bounds: k must be 1..1024");
  moe_ep::shard_bounds(len, k, min_shard, align, out);
  return 0;
}

int moe_ep_register(void* e, void* ptr, uint64_t len, uint32_t* key) {
  return guarded([&] { return static_cast<Transport*>(e)->register_memory(ptr, len, key); });
}

// Returns the endpoint's full length; copies it into buf.
int moe_ep_endpoint(void* e, char* buf, size_t len) { return copy_str(static_cast<Transport*>(e)->endpoint(), buf, len); }

int moe_ep_connect(void* e, const char** endpoints, int n, int64_t timeout_ns) {
  return guarded([&] {
    std::vector<std::string> eps;
    for (int i = 0; i < n; ++i) eps.emplace_back(endpoints[i] ? endpoints[i] : "");
    return static_cast<Transport*>(e)->connect(eps, timeout_ns);
  });
}

int moe_ep_post_write(void* e, int peer, uint32_t local_key, uint64_t local_off, uint32_t remote_key, uint64_t remote_off,
                      uint64_t len, int has_imm, uint32_t imm, uint64_t* wr_id) {
  return guarded([&] {
    return static_cast<Transport*>(e)->post_write(
        {peer, local_key, local_off, remote_key, remote_off, len, has_imm != 0, imm}, wr_id);
  });
}

// Returns the number of completions (>= 0) written to out, or a negative code.
int moe_ep_poll(void* e, Completion* out, int max, int64_t timeout_ns) {
  return guarded([&] { return static_cast<Transport*>(e)->poll(out, max, timeout_ns); });
}

int moe_ep_set_op_timeout(void* e, int64_t timeout_ns) {
  static_cast<Transport*>(e)->set_op_timeout(timeout_ns);
  return 0;
}

int moe_ep_set_min_shard_bytes(void* e, uint64_t n) {
  static_cast<Transport*>(e)->set_min_shard_bytes(n);
  return 0;
}

// tcp: accepted connections without a valid hello within timeout_ns are dropped (default 10 s).
int moe_ep_set_hello_timeout(void* e, int64_t timeout_ns) {
  static_cast<Transport*>(e)->set_hello_timeout(timeout_ns);
  return 0;
}

// tcp: at most n accepted connections wait for their hello (default 256); one more drops the oldest.
int moe_ep_set_max_pending(void* e, int n) {
  static_cast<Transport*>(e)->set_max_pending(n);
  return 0;
}

// The refused connections and hellos (the last 64, oldest first, one a line) into buf; *total gets
// how many were refused in all. Returns the text's full length.
int moe_ep_engine_refused(void* e, char* buf, size_t len, int64_t* total) {
  int64_t n = 0;
  std::string text;
  for (const auto& line : static_cast<Transport*>(e)->refused(&n)) text += line + "\n";
  if (total) *total = n;
  return copy_str(text, buf, len);
}

// Copies why the peer was lost (empty when healthy); returns the message length.
int moe_ep_peer_error(void* e, int peer, char* buf, size_t len) {
  return copy_str(static_cast<Transport*>(e)->peer_error(peer), buf, len);
}

// CPU ns used so far by the engine's own threads (-1: unknown).
int64_t moe_ep_engine_cpu_ns(void* e) { return static_cast<Transport*>(e)->cpu_ns(); }

int moe_ep_rank(void* e) { return static_cast<Transport*>(e)->rank(); }
int moe_ep_world(void* e) { return static_cast<Transport*>(e)->world(); }

// ---- Proxy (docs/ARCHITECTURE.md §10) on a transport from moe_ep_engine_create ----
// Writes the mailbox word indices into out (order: hdr_bell, disp_ready, hdr_ready, comb_ready,
// err_code, err_peer, err_phase, err_epoch, n_fixed, then the first word of the per-rank arrays
// disp_bell, ready1, ready2, comb_bell for `world` ranks, then the words in all); returns how
// many it wrote.
int moe_ep_proxy_mailbox_layout(int64_t world, int64_t* out, int n) {
  const int64_t v[] = {moe_ep::kMbHdrBell,   moe_ep::kMbDispReady,  moe_ep::kMbHdrReady,
                       moe_ep::kMbCombReady, moe_ep::kMbErrCode,    moe_ep::kMbErrPeer,
                       moe_ep::kMbErrPhase,  moe_ep::kMbErrEpoch,   moe_ep::kMbOvReady,
                       moe_ep::kMbOvDone,    moe_ep::kMbCombWinDone, moe_ep::kMbCombWinBell,
                       moe_ep::kMbWords,
                       moe_ep::mb_disp_bell(world, 0), moe_ep::mb_ready1(world, 0),
                       moe_ep::mb_ready2(world, 0),    moe_ep::mb_comb_bell(world, 0),
                       moe_ep::mailbox_words_for(world)};
  int k = 0;
  for (; k < n && k < int(sizeof(v) / sizeof(v[0])); ++k) out[k] = v[k];
  return k;
}

int64_t moe_ep_proxy_hdr_bytes(int64_t world, int64_t num_local_experts) {
  return moe_ep::proxy_hdr_bytes(world, num_local_experts);
}

// Minimum region sizes for a config, in registration order (5 values).
int moe_ep_proxy_region_bytes(const moe_ep::ProxyConfig* cfg, uint64_t* out) {
  moe_ep::proxy_region_bytes(*cfg, out);
  return 0;
}

// Registers the 5 regions with the engine (in order) and returns the proxy (null on failure).
void* moe_ep_proxy_create(void* engine, const moe_ep::ProxyConfig* cfg, void* const* regions, const uint64_t* lens,
                          int64_t* mailbox, uint64_t mailbox_words) {
  try {
    return moe_ep::Proxy::create(static_cast<Transport*>(engine), *cfg, regions, lens, mailbox, mailbox_words);
  } catch (const std::exception& e) {
    moe_ep::set_error(moe_ep::kErrSystem, std::string("native exception: ") + e.what());
    return nullptr;
  }
}

int moe_ep_proxy_keys(void* p, uint32_t* out) {
  for (int i = 0; i < moe_ep::kNumRegions; ++i) out[i] = static_cast<moe_ep::Proxy*>(p)->keys()[i];
  return 0;
}

int moe_ep_proxy_start(void* p) {
  return guarded([&] { return static_cast<moe_ep::Proxy*>(p)->start(); });
}

// Stops and joins the proxy thread (prompt: its waits run in short slices), then frees it.
void moe_ep_proxy_destroy(void* p) { delete static_cast<moe_ep::Proxy*>(p); }

// The message of the error record (empty while healthy); returns its full length.
int moe_ep_proxy_error_message(void* p, char* buf, size_t len) {
  return copy_str(static_cast<moe_ep::Proxy*>(p)->error_message(), buf, len);
}

int64_t moe_ep_proxy_phases_done(void* p) { return static_cast<moe_ep::Proxy*>(p)->phases_done(); }

// Copies up to `max` of the most recent phase records (oldest first); returns how many.
int moe_ep_proxy_phase_records(void* p, moe_ep::PhaseRecord* out, int max) {
  return static_cast<moe_ep::Proxy*>(p)->phase_records(out, max);
}

// Copies up to `max` of the most recent trace events (oldest first); returns how many.
int moe_ep_proxy_trace(void* p, moe_ep::TraceEvent* out, int max) {
  return static_cast<moe_ep::Proxy*>(p)->trace(out, max);
}

}  // extern "C"
#pragma GCC visibility pop
