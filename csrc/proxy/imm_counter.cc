#include "imm_counter.h"

#include <chrono>

namespace moe_ep {

void ImmCounter::add(uint32_t imm, int64_t n) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    counts_[imm] += n;
  }
  cv_.notify_all();
}

int ImmCounter::wait(uint32_t imm, int64_t expected, int64_t timeout_ns, std::string* err) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::nanoseconds(timeout_ns < 0 ? 0 : timeout_ns);
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    int64_t& c = counts_[imm];
    if (c >= expected) {
      c -= expected;
      return kOk;
    }
    if (failed_) {
      if (err) *err = fail_msg_;
      return kErrPeer;
    }
    if (cv_.wait_until(lk, deadline) == std::cv_status::timeout) {
      int64_t& c2 = counts_[imm];
      if (c2 >= expected) {
        c2 -= expected;
        return kOk;
      }
      if (failed_) {
        if (err) *err = fail_msg_;
        return kErrPeer;
      }
      return kErrTimeout;
    }
  }
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
