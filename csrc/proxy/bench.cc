// Measurement entry points (moe_ep/bench/proxy_cost.py): loops that run in native code, so the numbers
// are the engine's own cost and not that of the ctypes calls around them.
#include <sched.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "proxy.h"
#include "transport.h"

namespace {
using moe_ep::Completion;
using moe_ep::Transport;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t pct(std::vector<int64_t>& v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, size_t(q * double(v.size())))];
}

// Polls until `n` completions arrived (or the deadline); counts failed ones into *bad.
int drain(Transport* t, int64_t n, int64_t deadline, int64_t* bad) {
  Completion cq[256];
  while (n > 0) {
    const int64_t left = deadline - now_ns();
    if (left <= 0)
      return moe_ep::set_error(moe_ep::kErrTimeout, "rank " + std::to_string(t->rank()) + ": bench: " +
                                                        std::to_string(n) + " writes not completed before the deadline");
    const int k = t->poll(cq, int(std::min<int64_t>(n, 256)), left);
    if (k < 0) return k;
    for (int i = 0; i < k; ++i) *bad += cq[i].status != moe_ep::kCqOk;
    n -= k;
  }
  return moe_ep::kOk;
}
}  // namespace

#pragma GCC visibility push(default)
extern "C" {

// Posts writes of `len` bytes (local key/offset -> the peer's remote key/offset, immediate `imm`):
//  - pipelined: `n` posts back to back, then drains their completions;
//  - serial: `n_serial` times post one write and wait for its completion.
// out[0] ns of the n pipelined posts, out[1] ns from the first post to the last completion,
// out[2]/out[3] p50/p99 ns of one serial post_write call, out[4]/out[5] p50/p99 ns from a serial
// post to its completion, out[6] failed completions. Every wait ends at timeout_ns from the start.
int moe_ep_bench_post(void* engine, int peer, uint32_t lkey, uint64_t loff, uint32_t rkey, uint64_t roff, uint64_t len,
                      uint32_t imm, int64_t n, int64_t n_serial, int64_t timeout_ns, int64_t* out) {
  auto* t = static_cast<Transport*>(engine);
  const int64_t deadline = now_ns() + timeout_ns;
  int64_t bad = 0;
  uint64_t wr = 0;
  const int64_t t0 = now_ns();
  for (int64_t i = 0; i < n; ++i)
    if (const int rc = t->post_write({peer, lkey, loff, rkey, roff, len, true, imm}, &wr); rc != moe_ep::kOk) return rc;
  const int64_t t1 = now_ns();
  if (const int rc = drain(t, n, deadline, &bad); rc != moe_ep::kOk) return rc;
  const int64_t t2 = now_ns();
  std::vector<int64_t> post, lat;
  for (int64_t i = 0; i < n_serial; ++i) {
    const int64_t a = now_ns();
    if (const int rc = t->post_write({peer, lkey, loff, rkey, roff, len, true, imm}, &wr); rc != moe_ep::kOk) return rc;
    const int64_t b = now_ns();
    if (const int rc = drain(t, 1, deadline, &bad); rc != moe_ep::kOk) return rc;
    post.push_back(b - a);
    lat.push_back(now_ns() - a);
  }
  out[0] = t1 - t0;
  out[1] = t2 - t0;
  out[2] = pct(post, 0.5);
  out[3] = pct(post, 0.99);
  out[4] = pct(lat, 0.5);
  out[5] = pct(lat, 0.99);
  out[6] = bad;
  return moe_ep::kOk;
}

// Stands in for the kernels of `n` epochs on a proxy's mailbox (`world` ranks): for e = first ..
// first+n-1, rings every rows bell and the header bell of dispatch e, waits for disp_ready >= e,
// then (combine != 0) rings every combine bell and waits for comb_ready >= e. Overflow windows
// beyond the first are unpacked at once: ov_done says window 0 is read as soon as the bells rang
// (the proxy credits window 1 only once window 0 landed anyway), and window w + 1 whenever
// ov_ready says window w landed; the combine's later windows are packed at once too (comb_win_bell
// for w whenever comb_win_done says the send buffer is free for it). Waits spin for
// spin_ns, then sleep sleep_ns between looks (0: yield). out[2i], out[2i+1]: ns bell -> ready of
// dispatch and combine of epoch first+i. Returns 0; 1 at the deadline (timeout_ns per phase);
// -1 when the proxy wrote its error record (read it from the mailbox).
int moe_ep_bench_drive(int64_t* mailbox, int64_t world, int64_t first, int64_t n, int combine, int64_t timeout_ns,
                       int64_t spin_ns, int64_t sleep_ns, int64_t* out) {
#ifdef __linux__
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
#endif
  auto ld = [&](int w) { return __atomic_load_n(&mailbox[w], __ATOMIC_ACQUIRE); };
  int64_t win = 0, win_epoch = 0;    // the overflow windows of epoch win_epoch read so far
  int64_t cwin = 0, cwin_epoch = 0;  // the combine's next window to pack, of epoch cwin_epoch
  auto wait = [&](int w, int64_t e, int64_t t0) {
    while (ld(w) < e) {
      if (win_epoch == e && ld(moe_ep::kMbOvReady) >= moe_ep::ov_window(e, win)) {
        __atomic_store_n(&mailbox[moe_ep::kMbOvDone], moe_ep::ov_window(e, ++win), __ATOMIC_RELEASE);
        continue;
      }
      if (cwin_epoch == e && ld(moe_ep::kMbCombWinDone) >= moe_ep::ov_window(e, cwin)) {
        __atomic_store_n(&mailbox[moe_ep::kMbCombWinBell], moe_ep::ov_window(e, cwin++), __ATOMIC_RELEASE);
        continue;
      }
      if (ld(moe_ep::kMbErrCode) != moe_ep::kProxyOk) return -1;
      const int64_t now = now_ns();
      if (now - t0 > timeout_ns) return 1;
      if (now - t0 <= spin_ns) continue;
      if (sleep_ns > 0)
        std::this_thread::sleep_for(std::chrono::nanoseconds(sleep_ns));
      else
        sched_yield();
    }
    return 0;
  };
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = first + i;
    int64_t t0 = now_ns();
    for (int p = 0; p < world; ++p) __atomic_store_n(&mailbox[moe_ep::mb_disp_bell(world, p)], e, __ATOMIC_RELEASE);
    __atomic_store_n(&mailbox[moe_ep::kMbHdrBell], e, __ATOMIC_RELEASE);
    win_epoch = e, win = 1;
    __atomic_store_n(&mailbox[moe_ep::kMbOvDone], moe_ep::ov_window(e, 1), __ATOMIC_RELEASE);
    if (const int rc = wait(moe_ep::kMbDispReady, e, t0); rc != 0) return rc;
    const int64_t t1 = now_ns();
    out[2 * i] = t1 - t0;
    out[2 * i + 1] = 0;
    if (!combine) continue;
    cwin_epoch = e, cwin = 1;
    for (int s = 0; s < world; ++s) __atomic_store_n(&mailbox[moe_ep::mb_comb_bell(world, s)], e, __ATOMIC_RELEASE);
    if (const int rc = wait(moe_ep::kMbCombReady, e, t1); rc != 0) return rc;
    out[2 * i + 1] = now_ns() - t1;
  }
  return 0;
}

}  // extern "C"
#pragma GCC visibility pop
