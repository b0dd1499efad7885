// ImmCounter: one signed 64-bit counter per 32-bit immediate value.
//
// Producers (transport receive threads, tests) call add(imm, n) from any thread. A waiter calls
// wait(imm, expected, timeout_ns): it blocks until the counter is >= expected and then subtracts
// `expected`, so counts may run ahead of their waiter and nothing is lost. wait_all does the same
// for several immediates at once (all of them reached, then all subtracted; on failure none), and
// says which were not reached. A counter that has been failed (a peer's connection was lost)
// makes every waiter whose counts are not yet reached return kErrPeer with the failure message; a
// count that is already reached still succeeds.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
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
  std::unordered_map<uint32_t, int64_t> counts_;  // nonzero counts only
  std::vector<Waiter*> waiters_;                  // blocked waits (add wakes them when one can return)
  std::atomic<uint64_t> gen_{0};
  int change_waiters_ = 0;  // threads in wait_change (add wakes them)
  bool failed_ = false;
  std::string fail_msg_;
};

}  // namespace moe_ep
