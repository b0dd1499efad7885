// The tests' hooks into the native library, compiled only into the tests' build of it
// (tests/native_hooks.py builds csrc/proxy, csrc/launch and this folder with MOE_EP_TEST_HOOKS
// defined; setup.py never does, so the library users install has none of them): fault injection
// on an engine, a verbs engine's queue pairs destroyed as a crashed process would, the memory type
// registration assumes, and native threads adding to an ImmCounter at once. Return codes and the
// thread's error as in csrc/proxy/capi.cc.
#ifndef MOE_EP_TEST_HOOKS
#error "csrc/testing is the tests' build only: compile it with -DMOE_EP_TEST_HOOKS"
#endif
#include <thread>
#include <vector>

#include "../proxy/cuda_mem.h"
#include "../proxy/imm_counter.h"
#include "../proxy/transport.h"

#pragma GCC visibility push(default)
extern "C" {

// delay_us: random per-shard delay up to this many microseconds (0: off); reorder: 0/1;
// cut_peer: -1 off, else cut every connection with that peer when write number cut_after+1 to
// it is posted.
int moe_ep_set_fault(void* e, int64_t delay_us, int reorder, int cut_peer, int64_t cut_after) {
  moe_ep::FaultConfig f;
  f.delay_us = delay_us;
  f.reorder = reorder != 0;
  f.cut_peer = cut_peer;
  f.cut_after = cut_after;
  static_cast<moe_ep::Transport*>(e)->set_fault(f);
  return 0;
}

// Destroys a verbs engine's queue pairs to `peer`.
int moe_ep_verbs_destroy_qp(void* e, int peer) {
  return moe_ep::guarded([&] { return moe_ep::verbs_destroy_qp(static_cast<moe_ep::Transport*>(e), peer); });
}

// The memory type registration assumes: -1 asks the CUDA driver (default), 0 host, 1 device.
int moe_ep_test_memory_type(int kind) {
  moe_ep::set_memory_type_override(kind);
  return 0;
}

// `threads` native threads each add 1 to `imm`, `adds_per_thread` times.
int moe_ep_imm_stress(void* c, uint32_t imm, int threads, int64_t adds_per_thread) {
  return moe_ep::guarded([&] {
    auto* ic = static_cast<moe_ep::ImmCounter*>(c);
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([ic, imm, adds_per_thread] {
        for (int64_t i = 0; i < adds_per_thread; ++i) ic->add(imm, 1);
      });
    for (auto& t : ts) t.join();
    return 0;
  });
}

}  // extern "C"
#pragma GCC visibility pop
