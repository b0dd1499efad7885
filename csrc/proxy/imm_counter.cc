#include "imm_counter.h"

#include <algorithm>
#include <chrono>

namespace moe_ep {

void CountTable::grow() {
  std::vector<Slot> old;
  old.swap(slots_);
  const size_t cap = old.empty() ? 64 : 2 * old.size();
  slots_.assign(cap, Slot{});
  shift_ = 64 - __builtin_ctzll(cap);
  n_ = 0;
  for (const Slot& s : old)
    if (s.used) add(s.key, s.val);
}

void CountTable::erase_at(size_t i) {
  // Backward shift: move up each later entry of the run that may live at i (its home is not
  // cyclically in (i, j]), so every lookup still finds its key without tombstones.
  const size_t mask = slots_.size() - 1;
  for (size_t j = i;;) {
    j = (j + 1) & mask;
    if (!slots_[j].used) break;
    const size_t k = home(slots_[j].key);
    if (i <= j ? (i < k && k <= j) : (i < k || k <= j)) continue;
    slots_[i] = slots_[j];
    i = j;
  }
  slots_[i] = Slot{};
  --n_;
}

int64_t CountTable::add(uint32_t key, int64_t n) {
  if (n == 0) return get(key);
  if (2 * (n_ + 1) > slots_.size()) grow();  // load factor <= 1/2
  const size_t mask = slots_.size() - 1;
  size_t i = home(key);
  while (slots_[i].used && slots_[i].key != key) i = (i + 1) & mask;
  if (!slots_[i].used) {
    slots_[i] = Slot{key, 1, n};
    ++n_;
    return n;
  }
  const int64_t c = (slots_[i].val += n);
  if (c == 0) erase_at(i);
  return c;
}

int64_t ImmCounter::count(uint32_t imm) const { return counts_.get(imm); }


int ImmCounter::unmet(const Waiter& w) const {
  int u = 0;
  for (const Key& k : w.keys) u += count(k.imm) < k.expected;
  return u;
}

void ImmCounter::add(uint32_t imm, int64_t n) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    const int64_t c = counts_.add(imm, n);
    if (log_on_ && n > 0 && c == n) log_.push_back(imm);  // it rose from zero
    // Wake a waiter only when it can now return: when this add brings the last of its counts
    // up to its expectation (a phase waiting for R - 1 immediates sleeps through the first R - 2).
    // `pending` never exceeds the true number of unmet keys (a count that drops is not re-added,
    // which at worst wakes the waiter early; it recounts), so no waiter that can return sleeps on.
    for (Waiter* w : waiters_) {
      auto it = std::lower_bound(w->keys.begin(), w->keys.end(), imm,
                                 [](const Key& k, uint32_t v) { return k.imm < v; });
      if (it != w->keys.end() && it->imm == imm && c - n < it->expected && c >= it->expected) wake |= --w->pending <= 0;
    }
    gen_.fetch_add(1, std::memory_order_release);
    wake |= change_waiters_ > 0;
  }
  if (wake) cv_.notify_all();
}

int ImmCounter::wait(uint32_t imm, int64_t expected, int64_t timeout_ns, std::string* err) {
  return wait_all(&imm, &expected, 1, timeout_ns, err, nullptr);
}

int ImmCounter::wait_all(const uint32_t* imms, const int64_t* expected, int n, int64_t timeout_ns, std::string* err,
                         std::vector<int>* missing) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::nanoseconds(timeout_ns < 0 ? 0 : timeout_ns);
  Waiter w;
  w.keys.reserve(size_t(std::max(n, 0)));
  for (int i = 0; i < n; ++i) w.keys.push_back(Key{imms[i], expected[i]});
  std::sort(w.keys.begin(), w.keys.end(), [](const Key& a, const Key& b) { return a.imm < b.imm; });
  std::unique_lock<std::mutex> lk(mu_);
  auto take = [&]() {
    w.pending = unmet(w);
    if (w.pending > 0) return false;
    for (const Key& k : w.keys) counts_.add(k.imm, -k.expected);  // (a count spent leaves the table)
    return true;
  };
  int rc = kOk;
  if (!take()) {
    waiters_.push_back(&w);
    rc = kErrTimeout;
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
    waiters_.erase(std::find(waiters_.begin(), waiters_.end(), &w));
  }
  if (missing) {
    missing->clear();
    if (rc != kOk)
      for (int i = 0; i < n; ++i)
        if (count(imms[i]) < expected[i]) missing->push_back(i);
  }
  return rc;
}

void ImmCounter::enable_log() {
  std::lock_guard<std::mutex> lk(mu_);
  if (log_on_) return;
  log_on_ = true;
  counts_.for_each([this](uint32_t imm, int64_t) { log_.push_back(imm); });
}

void ImmCounter::wait_change(uint64_t seen, int64_t timeout_ns) {
  std::unique_lock<std::mutex> lk(mu_);
  ++change_waiters_;
  cv_.wait_for(lk, std::chrono::nanoseconds(timeout_ns < 0 ? 0 : timeout_ns),
               [&] { return gen_.load(std::memory_order_relaxed) != seen; });  // (fail() moves it too)
  --change_waiters_;
}

int ImmCounter::try_take(uint32_t imm, int64_t expected, std::string* err) {
  std::lock_guard<std::mutex> lk(mu_);
  if (counts_.get(imm) >= expected) {
    counts_.add(imm, -expected);  // (a count spent leaves the table)
    return kOk;
  }
  if (failed_) {
    if (err) *err = fail_msg_;
    return kErrPeer;
  }
  return kErrTimeout;
}

int64_t ImmCounter::value(uint32_t imm) {
  std::lock_guard<std::mutex> lk(mu_);
  return count(imm);
}

void ImmCounter::fail(const std::string& msg) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (failed_) return;
    failed_ = true;
    fail_msg_ = msg;
    gen_.fetch_add(1, std::memory_order_release);  // a poller looks again, and sees the failure
  }
  cv_.notify_all();
}

bool ImmCounter::failed(std::string* msg) {
  std::lock_guard<std::mutex> lk(mu_);
  if (failed_ && msg) *msg = fail_msg_;
  return failed_;
}

}  // namespace moe_ep
