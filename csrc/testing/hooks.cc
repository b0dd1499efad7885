// The tests' hooks into the native library, compiled only into the tests' build of it
// (tests/native_hooks.py builds csrc/proxy, csrc/launch and this folder with MOE_EP_TEST_HOOKS
// defined; setup.py never does, so the library users install has none of them): fault injection
// on an engine, a verbs engine's queue pairs destroyed as a crashed process would, the memory type
// registration assumes, native threads adding to an ImmCounter at once, and a goodbye taken after
// its peer was lost. Return codes and the thread's error as in csrc/proxy/capi.cc.
#ifndef MOE_EP_TEST_HOOKS
#error "csrc/testing is the tests' build only: compile it with -DMOE_EP_TEST_HOOKS"
#endif
#include <thread>
#include <vector>

#include "../proxy/cuda_mem.h"
#include "../proxy/imm_counter.h"
#include "../proxy/transport.h"
#include "../proxy/transport_common.h"

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

// A peer of 3 lost by its link first ("a keepalive failed"), then its goodbye landing (error:
// 0 clean, 1 after an error naming peer 2 in combine epoch 6), as every transport takes it
// (take_goodbye): out gets the peer's loss text (cut at cap bytes, NUL-terminated); returns
// 1 + the goodbye's peer where it counts (peer_goodbye would give it), 0 where it does not.
int moe_ep_test_late_goodbye(int error, char* out, int64_t cap) {
  struct {
    std::mutex mu;
    bool lost = false, said_bye = false;
    std::string err, bye_text;
    moe_ep::Goodbye bye;
  } pr;
  std::string msg = moe_ep::loss_text(0, 1, "test", "a keepalive failed");
  {
    std::lock_guard<std::mutex> lk(pr.mu);
    moe_ep::mark_lost(pr, &msg, nullptr);
  }
  moe_ep::Goodbye g;
  if (error) g.error = 1, g.peer = 2, g.phase = 2 /* combine */, g.epoch = 6;
  moe_ep::take_goodbye(moe_ep::make_goodbye(moe_ep::JobIdentity{}, 1, 0, 3, g), 3, pr,
                       [&](const std::string& text, const moe_ep::Goodbye& bye) {  // as lose_peer does
                         std::string m = moe_ep::loss_text(0, 1, "test", text);
                         std::lock_guard<std::mutex> lk(pr.mu);
                         moe_ep::mark_lost(pr, &m, &bye);
                       });
  std::snprintf(out, size_t(cap), "%s", pr.err.c_str());
  return pr.said_bye ? 1 + pr.bye.peer : 0;
}

}  // extern "C"
#pragma GCC visibility pop
