#include "imm_counter.h"

#include <chrono>

namespace moe_ep {

void ImmCounter::add(uint32_t imm, int64_t n) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    const int64_t c = (counts_[imm] += n);
    // Wake the waiters only when one of them can now return: a phase waiting for R - 1
    // immediates sleeps through the first R - 2.
    for (const Waiter& w : waiters_) wake |= w.imm == imm && c >= w.expected;
  }
  if (wake) cv_.notify_all();
}

int ImmCounter::wait(uint32_t imm, int64_t expected, int64_t timeout_ns, std::string* err) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::nanoseconds(timeout_ns < 0 ? 0 : timeout_ns);
  std::unique_lock<std::mutex> lk(mu_);
  auto take = [&]() {
    auto it = counts_.find(imm);
    const int64_t c = it == counts_.end() ? 0 : it->second;
    if (c < expected) return false;
    if (c != expected)
      counts_[imm] = c - expected;
    else if (it != counts_.end())
      counts_.erase(it);  // spent: the table holds only immediates with a count
    return true;
  };
  if (take()) return kOk;
  waiters_.push_back(Waiter{imm, expected});
  int rc = kErrTimeout;
  for (;;) {
    if (failed_) {
      if (err) *err = fail_msg_;
      rc = kErrPeer;
      break;
    }
    const bool timed_out = cv_.wait_until(lk, deadline) == std::cv_status::timeout;
    if (take()) {
      rc = kOk;
      break;
    }
    if (timed_out && !failed_) break;
  }
  for (size_t i = 0; i < waiters_.size(); ++i)
    if (waiters_[i].imm == imm && waiters_[i].expected == expected) {
      waiters_[i] = waiters_.back();
      waiters_.pop_back();
      break;
    }
  return rc;
}

int64_t ImmCounter::value(uint32_t imm) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = counts_.find(imm);
  return it == counts_.end() ? 0 : it->second;
}

void ImmCounter::fail(const std::string& msg) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (failed_) return;
    failed_ = true;
    fail_msg_ = msg;
  }
  cv_.notify_all();
}

bool ImmCounter::failed(std::string* msg) {
  std::lock_guard<std::mutex> lk(mu_);
  if (failed_ && msg) *msg = fail_msg_;
  return failed_;
}

}  // namespace moe_ep
