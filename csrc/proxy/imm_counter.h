// ImmCounter: one signed 64-bit counter per 32-bit immediate value.
//
// Producers (transport receive threads, tests) call add(imm, n) from any thread. A waiter calls
// wait(imm, expected, timeout_ns): it blocks until the counter is >= expected and then subtracts
// `expected`, so counts may run ahead of their waiter and nothing is lost. wait_all does the same
// for several immediates at once (all of them reached, then all subtracted; on failure none), and
// says which were not reached. A counter that has been failed (a peer's connection was lost)
// makes every waiter whose counts are not yet reached return kErrPeer with the failure message; a
// count that is already reached still succeeds.
//
// Arrival log (off until enable_log): an immediate whose count rises from zero is appended once,
// and take_arrived takes, under one lock, every logged immediate a consumer asks for whose count
// is reached. A consumer waiting on many sources (the proxy, one immediate per peer and phase)
// then looks only at what arrived, not at every source it still waits for.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace moe_ep {

// Return codes shared by the native API (capi.cc).
enum : int {
  kOk = 0,
  kErrTimeout = 1,    // a deadline passed
  kErrPeer = 2,       // a peer's connection was lost (cut, closed, dead)
  kErrInvalid = -1,   // bad argument (unknown key, out of bounds, bad peer, ...)
  kErrSystem = -2,    // a system call failed (socket, bind, connect, thread)
};

// Immediate -> count, nonzero counts only: open addressing with linear probing in a
// power-of-two table, multiplicative hashing, deletion by backward shift (no tombstones). The
// proxy counts and takes one immediate per peer and phase: a node allocation per count and a
// modulo per look (std::unordered_map) were most of what that cost.
class CountTable {
 public:
  // The count of `key` (0 when absent).
  int64_t get(uint32_t key) const {
    const size_t i = find(key);
    return i == kNone ? 0 : slots_[i].val;
  }
  // Adds n to `key`'s count (inserting it); removes it when the count reaches 0. Returns the new count.
  int64_t add(uint32_t key, int64_t n);
  template <class F>
  void for_each(F f) const {
    for (const Slot& s : slots_)
      if (s.used) f(s.key, s.val);
  }
  // One look-up, then the count read or changed in place (a take is one probe, not two).
  static constexpr size_t kNone = ~size_t(0);
  // The slot of `key`, or kNone when its count is 0 (absent).
  size_t find(uint32_t key) const {
    if (n_ == 0) return kNone;
    const size_t mask = slots_.size() - 1;
    for (size_t i = home(key);; i = (i + 1) & mask) {
      if (!slots_[i].used) return kNone;
      if (slots_[i].key == key) return i;
    }
  }
  int64_t val_at(size_t i) const { return slots_[i].val; }
  // Subtracts n from the count in slot i (from find), removing it at 0; returns the new count.
  // Other keys' slots may move (backward shift): find them again.
  int64_t sub_at(size_t i, int64_t n) {
    const int64_t c = (slots_[i].val -= n);
    if (c == 0) erase_at(i);
    return c;
  }
  // Starts loading the line `key`'s probe begins at (another thread may have written it last).
  void prefetch(uint32_t key) const {
    if (!slots_.empty()) __builtin_prefetch(&slots_[home(key)]);
  }

 private:
  struct Slot {
    uint32_t key = 0;
    uint32_t used = 0;
    int64_t val = 0;
  };
  size_t home(uint32_t key) const { return size_t((uint64_t(key) * 0x9E3779B97F4A7C15ull) >> shift_); }
  void erase_at(size_t i);
  void grow();
  std::vector<Slot> slots_;
  size_t n_ = 0;
  int shift_ = 64;
};

class ImmCounter {
 public:
  void add(uint32_t imm, int64_t n = 1);
  // 0 on success; kErrTimeout when the deadline passed (the counter is left unchanged);
  // kErrPeer when fail() was called and the count is not reached. `err` (optional) receives the
  // failure message.
  int wait(uint32_t imm, int64_t expected, int64_t timeout_ns, std::string* err = nullptr);
  // wait() for n distinct immediates: returns 0 once every imms[i] is >= expected[i], having
  // subtracted each expectation; kErrTimeout / kErrPeer as wait(), with no counter changed.
  // `missing` (optional) then receives the indices i not reached at that moment, ascending.
  // The waiter is woken once, when the last of its counts is reached.
  int wait_all(const uint32_t* imms, const int64_t* expected, int n, int64_t timeout_ns, std::string* err = nullptr,
               std::vector<int>* missing = nullptr);
  int64_t value(uint32_t imm);
  // wait() that never blocks: kOk having subtracted `expected` when the count is there, else
  // kErrTimeout, or kErrPeer (with `err`) when the counter failed.
  int try_take(uint32_t imm, int64_t expected, std::string* err = nullptr);
  // Starts the arrival log (the immediates already counted are logged too).
  void enable_log();
  // The logged immediates that `want(imm)` accepts and whose count is >= per, each taken (per
  // subtracted) and appended to *out, in arrival order, under one lock; the rest stay logged.
  // Returns kOk, or kErrPeer once the counter failed (what was there is still taken).
  template <class F>
  int take_arrived(F want, int64_t per, std::vector<uint32_t>* out);
  // How many add() calls so far: a poller that saw generation g and finds it unchanged knows no
  // immediate arrived meanwhile.
  uint64_t generation() const { return gen_.load(std::memory_order_acquire); }
  // Sleeps until an add() or fail() moves the generation past `seen`, or timeout_ns.
  void wait_change(uint64_t seen, int64_t timeout_ns);
  // Records the first failure (later ones are ignored) and wakes every waiter.
  void fail(const std::string& msg);
  bool failed(std::string* msg = nullptr);

 private:
  struct Key {
    uint32_t imm;
    int64_t expected;
  };
  struct Waiter {
    std::vector<Key> keys;  // sorted by imm (add finds its key by binary search)
    int64_t pending = 0;    // keys not reached: recounted on every wake, decremented by add
  };
  int64_t count(uint32_t imm) const;
  int unmet(const Waiter& w) const;

  std::mutex mu_;
  std::condition_variable cv_;
  CountTable counts_;
  std::vector<Waiter*> waiters_;                  // blocked waits (add wakes them when one can return)
  std::atomic<uint64_t> gen_{0};
  int change_waiters_ = 0;  // threads in wait_change (add wakes them)
  bool log_on_ = false;
  std::vector<uint32_t> log_;  // immediates whose count rose from zero, oldest first (may hold spent ones)
  bool failed_ = false;
  std::string fail_msg_;
};

template <class F>
int ImmCounter::take_arrived(F want, int64_t per, std::vector<uint32_t>* out) {
  std::lock_guard<std::mutex> lk(mu_);
  size_t keep = 0;
  const size_t n = log_.size();
  // The producers wrote these slots last: their lines are loaded a few entries ahead of their use.
  constexpr size_t kAhead = 8;
  for (size_t i = 0; i < n && i < kAhead; ++i) counts_.prefetch(log_[i]);
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) counts_.prefetch(log_[i + kAhead]);
    const uint32_t imm = log_[i];
    const size_t at = counts_.find(imm);
    if (at == CountTable::kNone) continue;  // spent meanwhile (wait / try_take): no longer logged
    if (counts_.val_at(at) < per || !want(imm)) {
      log_[keep++] = imm;
      continue;
    }
    out->push_back(imm);
    if (counts_.sub_at(at, per) != 0) log_[keep++] = imm;
  }
  log_.resize(keep);
  return failed_ ? kErrPeer : kOk;
}

}  // namespace moe_ep
