// TCP transport: several streams (sockets) per peer and direction; every write is sharded across
// the streams, so delivery is really unordered. Wire format and threading: docs/ARCHITECTURE.md,
// "Proxy engine (native)".
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

#include "transport.h"

namespace moe_ep {
namespace {

constexpr uint32_t kMagicWrite = 0x5750454d;  // "MEPW"
constexpr uint32_t kMagicHello = 0x4850454d;  // "MEPH"
constexpr uint32_t kFlagImm = 1;

// One shard of a write, followed by `len` payload bytes. Host byte order.
struct WireHeader {
  uint32_t magic;    // kMagicWrite
  uint32_t flags;    // bit 0: the write carries an immediate
  uint64_t wr_id;    // sender's id of the whole write (unique per sender)
  uint32_t rkey;     // receiver's memory key
  uint32_t imm;      // immediate (valid with kFlagImm)
  uint64_t roff;     // offset of this shard in the receiver's region
  uint64_t len;      // payload bytes of this shard
  uint32_t shard;    // index of this shard, 0..nshards-1
  uint32_t nshards;  // shards of the whole write
};
static_assert(sizeof(WireHeader) == 48, "wire format");

// Receiver -> sender, on the same socket, once a shard has landed (or was rejected).
struct WireAck {
  uint64_t wr_id;
  uint32_t status;  // 0 ok, 1 rejected (unknown key or out of bounds)
  uint32_t shard;
};
static_assert(sizeof(WireAck) == 16, "wire format");

// First message on every connection, connector -> listener.
struct WireHello {
  uint32_t magic;  // kMagicHello
  int32_t src_rank;
  int32_t world;
  int32_t stream;
};
static_assert(sizeof(WireHello) == 16, "wire format");

using Clock = std::chrono::steady_clock;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

std::string errno_str(int e) { return std::string(strerror(e)); }

// 1: all n bytes read; 0: clean EOF before the first byte; -1: error or EOF mid-message (errno).
int read_all(int fd, void* buf, size_t n) {
  char* p = static_cast<char*>(buf);
  size_t got = 0;
  while (got < n) {
    ssize_t r = recv(fd, p + got, n - got, 0);
    if (r > 0) {
      got += size_t(r);
    } else if (r == 0) {
      if (got == 0) return 0;
      errno = ECONNRESET;
      return -1;
    } else if (errno != EINTR) {
      return -1;
    }
  }
  return 1;
}

bool write_all(int fd, iovec* iov, int cnt) {
  while (cnt > 0) {
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = size_t(cnt);
    ssize_t r = sendmsg(fd, &m, MSG_NOSIGNAL);
    if (r < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    size_t left = size_t(r);
    while (cnt > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --cnt;
    }
    if (cnt > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return true;
}

bool write_all(int fd, const void* buf, size_t n) {
  iovec iov{const_cast<void*>(buf), n};
  return write_all(fd, &iov, 1);
}

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

struct Region {
  char* ptr = nullptr;
  uint64_t len = 0;
};

struct Shard {
  WireHeader h;
  const char* src;
};

struct Stream {
  int out_fd = -1;  // we connected: shards out, acks in
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Shard> q;
  std::thread sender, acker;
};

struct Partial {
  uint32_t remaining;
  bool bad;
};

struct Peer {
  std::vector<std::unique_ptr<Stream>> streams;
  std::atomic<bool> lost{false};
  std::atomic<int64_t> writes_posted{0};
  std::atomic<uint32_t> next_stream{0};
  std::mutex mu;                // guards err, in_fds, partial
  std::string err;
  std::vector<int> in_fds;      // the peer connected: shards in, acks out
  std::unordered_map<uint64_t, Partial> partial;  // writes with shards still to land
};

struct Pending {
  int peer;
  uint32_t remaining;
  int32_t status;
  int64_t posted_ns;
};

class TcpTransport final : public Transport {
 public:
  TcpTransport(int rank, int world, int streams) : rank_(rank), world_(world), nstreams_(streams) {
    for (int p = 0; p < world; ++p) {
      peers_.emplace_back(new Peer);
      for (int s = 0; s < streams; ++s) peers_.back()->streams.emplace_back(new Stream);
    }
  }

  int start(const std::string& bind_host) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (listen_fd_ < 0) return set_error(kErrSystem, prefix() + "socket() failed: " + errno_str(errno));
    int one = 1;
    setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = 0;
    if (inet_pton(AF_INET, bind_host.c_str(), &a.sin_addr) != 1)
      return set_error(kErrInvalid, prefix() + "bind host '" + bind_host + "' is not an IPv4 address");
    if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0)
      return set_error(kErrSystem, prefix() + "bind(" + bind_host + ") failed: " + errno_str(errno));
    if (listen(listen_fd_, 4096) != 0)
      return set_error(kErrSystem, prefix() + "listen() failed: " + errno_str(errno));
    socklen_t sl = sizeof(a);
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &sl);
    std::string host = bind_host;
    if (host == "0.0.0.0") {
      char name[256] = {0};
      gethostname(name, sizeof(name) - 1);
      host = name;
    }
    endpoint_ = host + ":" + std::to_string(ntohs(a.sin_port));
    accept_thread_ = std::thread([this] { accept_loop(); });
    return kOk;
  }

  ~TcpTransport() override {
    stop_ = true;
    if (listen_fd_ >= 0) shutdown(listen_fd_, SHUT_RDWR);
    {
      std::lock_guard<std::mutex> lk(thr_mu_);
      for (int fd : accepted_fds_) shutdown(fd, SHUT_RDWR);
    }
    for (auto& pr : peers_) {
      std::lock_guard<std::mutex> lk(pr->mu);
      for (auto& s : pr->streams) {
        if (s->out_fd >= 0) shutdown(s->out_fd, SHUT_RDWR);
        std::lock_guard<std::mutex> lq(s->mu);
        s->cv.notify_all();
      }
    }
    if (accept_thread_.joinable()) accept_thread_.join();
    {
      std::lock_guard<std::mutex> lk(thr_mu_);
      for (int fd : accepted_fds_) shutdown(fd, SHUT_RDWR);  // accepted after the first sweep
    }
    for (auto& t : recv_threads_) t.join();
    for (auto& pr : peers_)
      for (auto& s : pr->streams) {
        if (s->sender.joinable()) s->sender.join();
        if (s->acker.joinable()) s->acker.join();
        if (s->out_fd >= 0) close(s->out_fd);
      }
    for (int fd : accepted_fds_) close(fd);
    if (listen_fd_ >= 0) close(listen_fd_);
  }

  int rank() const override { return rank_; }
  int world() const override { return world_; }
  std::string endpoint() const override { return endpoint_; }
  ImmCounter& imm_counter() override { return imm_; }

  int register_memory(void* ptr, uint64_t len, uint32_t* key) override {
    if (ptr == nullptr && len > 0) return set_error(kErrInvalid, prefix() + "register: null pointer");
    std::lock_guard<std::mutex> lk(reg_mu_);
    regions_.push_back(Region{static_cast<char*>(ptr), len});
    *key = uint32_t(regions_.size());
    return kOk;
  }

  int connect(const std::vector<std::string>& endpoints, int64_t timeout_ns) override {
    if (connected_) return set_error(kErrInvalid, prefix() + "connect: already connected");
    if (int(endpoints.size()) != world_)
      return set_error(kErrInvalid, prefix() + "connect: got " + std::to_string(endpoints.size()) +
                                        " endpoints for world size " + std::to_string(world_));
    const int64_t deadline = now_ns() + timeout_ns;
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      for (int s = 0; s < nstreams_; ++s) {
        int fd = -1;
        int rc = dial(p, endpoints[p], deadline, &fd);
        if (rc != kOk) return rc;
        WireHello h{kMagicHello, rank_, world_, s};
        if (!write_all(fd, &h, sizeof(h))) {
          int e = errno;
          close(fd);
          return set_error(kErrSystem, prefix() + "peer " + std::to_string(p) + ": sending hello failed: " + errno_str(e));
        }
        std::lock_guard<std::mutex> lk(peers_[p]->mu);
        peers_[p]->streams[s]->out_fd = fd;
      }
    }
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      for (auto& sp : peers_[p]->streams) {
        Stream* s = sp.get();
        s->sender = std::thread([this, p, s] { send_loop(p, s); });
        s->acker = std::thread([this, p, s] { ack_loop(p, s); });
      }
    }
    connected_ = true;
    return kOk;
  }

  int post_write(int peer, uint32_t local_key, uint64_t local_off, uint32_t remote_key, uint64_t remote_off,
                 uint64_t len, bool has_imm, uint32_t imm, uint64_t* wr_id) override {
    if (peer < 0 || peer >= world_ || peer == rank_)
      return set_error(kErrInvalid, prefix() + "post_write: bad peer " + std::to_string(peer));
    if (!connected_) return set_error(kErrInvalid, prefix() + "post_write: not connected");
    Region r;
    if (!lookup(local_key, local_off, len, &r))
      return set_error(kErrInvalid, prefix() + "post_write to peer " + std::to_string(peer) + ": local key " +
                                        std::to_string(local_key) + " offset " + std::to_string(local_off) + " length " +
                                        std::to_string(len) + " is not inside a registered region");
    const char* src = r.ptr + local_off;
    Peer& pr = *peers_[peer];
    const uint64_t wr = next_wr_++;
    *wr_id = wr;

    const int64_t n = pr.writes_posted++;
    if (cut_peer_.load() == peer && n >= cut_after_.load())
      lose_peer(peer, "connection cut by fault injection after " + std::to_string(n) + " writes");

    // Shards of at least min_shard_bytes (a small write is one message on one stream; successive
    // writes still go to different streams, so they stay unordered).
    const uint64_t ms = std::max<uint64_t>(min_shard_.load(), 1);
    const uint32_t nshards = uint32_t(std::min<uint64_t>(uint64_t(nstreams_), std::max<uint64_t>((len + ms - 1) / ms, 1)));
    {
      std::lock_guard<std::mutex> lk(cq_mu_);
      if (pr.lost) {
        cq_.push_back(Completion{wr, peer, kCqPeerLost});
        cq_cv_.notify_all();
        return kOk;
      }
      pending_[wr] = Pending{peer, nshards, kCqOk, now_ns()};
    }
    static thread_local std::mt19937_64 rng{std::random_device{}()};
    const bool reorder = reorder_.load();
    const uint32_t start = pr.next_stream.fetch_add(nshards);
    const uint64_t base = len / nshards, extra = len % nshards;
    uint64_t off = 0;
    for (uint32_t i = 0; i < nshards; ++i) {
      const uint64_t slen = base + (i < extra ? 1 : 0);
      Shard sh;
      sh.h = WireHeader{kMagicWrite, has_imm ? kFlagImm : 0u, wr, remote_key, imm, remote_off + off, slen, i, nshards};
      sh.src = src + off;
      off += slen;
      const uint32_t si = reorder ? uint32_t(rng() % uint64_t(nstreams_)) : (start + i) % uint32_t(nstreams_);
      Stream& s = *pr.streams[si];
      {
        std::lock_guard<std::mutex> lk(s.mu);
        if (pr.lost) break;  // pending already failed by lose_peer
        s.q.push_back(sh);
      }
      s.cv.notify_one();
    }
    return kOk;
  }

  int poll(Completion* out, int max, int64_t timeout_ns) override {
    if (max <= 0) return 0;
    const int64_t deadline = now_ns() + std::max<int64_t>(timeout_ns, 0);
    for (;;) {
      check_op_timeouts();
      std::unique_lock<std::mutex> lk(cq_mu_);
      if (!cq_.empty()) {
        int n = 0;
        while (n < max && !cq_.empty()) {
          out[n++] = cq_.front();
          cq_.pop_front();
        }
        return n;
      }
      const int64_t now = now_ns();
      if (now >= deadline) return 0;
      const int64_t slice = std::min<int64_t>(deadline - now, 10'000'000);  // re-check op timeouts
      cq_cv_.wait_for(lk, std::chrono::nanoseconds(slice));
    }
  }

  void set_fault(const FaultConfig& f) override {
    delay_us_ = std::max<int64_t>(f.delay_us, 0);
    reorder_ = f.reorder;
    cut_after_ = f.cut_after;
    cut_peer_ = f.cut_peer;
  }

  void set_op_timeout(int64_t ns) override { op_timeout_ns_ = ns; }
  void set_min_shard_bytes(uint64_t n) override { min_shard_ = std::max<uint64_t>(n, 1); }

  std::string peer_error(int peer) override {
    if (peer < 0 || peer >= world_) return "";
    std::lock_guard<std::mutex> lk(peers_[peer]->mu);
    return peers_[peer]->err;
  }

 private:
  std::string prefix() const { return "rank " + std::to_string(rank_) + ": "; }

  bool lookup(uint32_t key, uint64_t off, uint64_t len, Region* out) {
    std::lock_guard<std::mutex> lk(reg_mu_);
    if (key == 0 || key > regions_.size()) return false;
    const Region& r = regions_[key - 1];
    if (off > r.len || len > r.len - off) return false;
    *out = r;
    return true;
  }

  int dial(int p, const std::string& ep, int64_t deadline, int* out_fd) {
    const auto colon = ep.rfind(':');
    if (colon == std::string::npos)
      return set_error(kErrInvalid, prefix() + "peer " + std::to_string(p) + ": bad endpoint '" + ep + "'");
    const std::string host = ep.substr(0, colon), port = ep.substr(colon + 1);
    addrinfo hints{}, *res = nullptr;
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    if (int g = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); g != 0)
      return set_error(kErrSystem, prefix() + "peer " + std::to_string(p) + ": cannot resolve '" + ep + "': " + gai_strerror(g));
    sockaddr_in addr;
    std::memcpy(&addr, res->ai_addr, sizeof(addr));
    freeaddrinfo(res);
    std::string last = "no attempt";
    while (!stop_) {
      int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0) return set_error(kErrSystem, prefix() + "socket() failed: " + errno_str(errno));
      int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
      int err = rc == 0 ? 0 : errno;
      if (err == EINPROGRESS) {
        const int64_t left_ms = std::max<int64_t>((deadline - now_ns()) / 1'000'000, 0);
        pollfd pfd{fd, POLLOUT, 0};
        int pr = ::poll(&pfd, 1, int(std::min<int64_t>(left_ms, 1000)));
        if (pr > 0) {
          socklen_t sl = sizeof(err);
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &sl);
        } else {
          err = ETIMEDOUT;
        }
      }
      if (err == 0) {
        int fl = fcntl(fd, F_GETFL);
        fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
        set_nodelay(fd);
        *out_fd = fd;
        return kOk;
      }
      close(fd);
      last = errno_str(err);
      if (now_ns() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return set_error(kErrTimeout, prefix() + "peer " + std::to_string(p) + ": connect to " + ep +
                                      " did not succeed before the deadline (" + last + ")");
  }

  void accept_loop() {
    while (!stop_) {
      int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        if (stop_) return;
        if (errno == EINTR || errno == ECONNABORTED) continue;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      set_nodelay(fd);
      std::lock_guard<std::mutex> lk(thr_mu_);
      if (stop_) {
        close(fd);
        return;
      }
      accepted_fds_.push_back(fd);
      recv_threads_.emplace_back([this, fd] { recv_loop(fd); });
    }
  }

  // Marks the peer lost (first reason wins): shuts its sockets down both ways, fails its pending
  // writes and the ImmCounter's waiters.
  void lose_peer(int p, const std::string& why, int32_t status = kCqPeerLost) {
    Peer& pr = *peers_[p];
    const std::string msg = prefix() + "connection with peer " + std::to_string(p) + " lost: " + why;
    {
      std::lock_guard<std::mutex> lk(pr.mu);
      if (pr.lost) return;
      pr.err = msg;
      pr.lost = true;
      for (int fd : pr.in_fds) shutdown(fd, SHUT_RDWR);
      for (auto& s : pr.streams)
        if (s->out_fd >= 0) shutdown(s->out_fd, SHUT_RDWR);
    }
    for (auto& s : pr.streams) {
      std::lock_guard<std::mutex> lk(s->mu);
      s->q.clear();
      s->cv.notify_all();
    }
    {
      std::lock_guard<std::mutex> lk(cq_mu_);
      for (auto it = pending_.begin(); it != pending_.end();) {
        if (it->second.peer == p) {
          cq_.push_back(Completion{it->first, p, status});
          it = pending_.erase(it);
        } else {
          ++it;
        }
      }
    }
    cq_cv_.notify_all();
    imm_.fail(msg);
  }

  void check_op_timeouts() {
    const int64_t now = now_ns();
    if (now - last_timeout_check_ns_.load() < 1'000'000) return;
    last_timeout_check_ns_ = now;
    const int64_t limit = op_timeout_ns_.load();
    std::vector<std::pair<int, uint64_t>> late;
    {
      std::lock_guard<std::mutex> lk(cq_mu_);
      for (auto it = pending_.begin(); it != pending_.end();) {
        if (now - it->second.posted_ns > limit) {
          late.emplace_back(it->second.peer, it->first);
          cq_.push_back(Completion{it->first, it->second.peer, kCqTimeout});
          it = pending_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& [p, wr] : late)
      lose_peer(p, "write " + std::to_string(wr) + " not acknowledged within " + std::to_string(double(limit) / 1e9) + " s",
                kCqTimeout);
  }

  void send_loop(int p, Stream* s) {
    Peer& pr = *peers_[p];
    std::minstd_rand rng(std::random_device{}());
    for (;;) {
      Shard sh;
      {
        std::unique_lock<std::mutex> lk(s->mu);
        s->cv.wait(lk, [&] { return stop_ || pr.lost || !s->q.empty(); });
        if (stop_ || pr.lost) return;
        size_t i = 0;
        if (reorder_ && s->q.size() > 1) i = rng() % s->q.size();
        sh = s->q[i];
        s->q.erase(s->q.begin() + long(i));
      }
      const int64_t d = delay_us_.load();
      if (d > 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % uint64_t(d + 1)));
      if (stop_ || pr.lost) return;
      iovec iov[2] = {{&sh.h, sizeof(sh.h)}, {const_cast<char*>(sh.src), size_t(sh.h.len)}};
      if (!write_all(s->out_fd, iov, sh.h.len ? 2 : 1)) {
        const int e = errno;
        if (!stop_) lose_peer(p, "send failed: " + errno_str(e));
        return;
      }
    }
  }

  void ack_loop(int p, Stream* s) {
    for (;;) {
      WireAck a;
      const int r = read_all(s->out_fd, &a, sizeof(a));
      if (r != 1) {
        const int e = errno;
        if (!stop_) lose_peer(p, r == 0 ? "the peer closed the connection" : "receiving acks failed: " + errno_str(e));
        return;
      }
      std::lock_guard<std::mutex> lk(cq_mu_);
      auto it = pending_.find(a.wr_id);
      if (it == pending_.end()) continue;  // already failed
      if (a.status != 0) it->second.status = kCqRemoteAccess;
      if (--it->second.remaining == 0) {
        cq_.push_back(Completion{a.wr_id, p, it->second.status});
        pending_.erase(it);
        cq_cv_.notify_all();
      }
    }
  }

  void recv_loop(int fd) {
    // Handshake, with a deadline so a silent connector cannot hold this thread.
    timeval tv{10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    WireHello h{};
    if (read_all(fd, &h, sizeof(h)) != 1 || h.magic != kMagicHello || h.world != world_ || h.src_rank < 0 ||
        h.src_rank >= world_ || h.src_rank == rank_) {
      shutdown(fd, SHUT_RDWR);
      return;
    }
    tv = timeval{0, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    const int p = h.src_rank;
    Peer& pr = *peers_[p];
    {
      std::lock_guard<std::mutex> lk(pr.mu);
      if (pr.lost || stop_) {
        shutdown(fd, SHUT_RDWR);
        return;
      }
      pr.in_fds.push_back(fd);
    }
    std::vector<char> scratch;
    for (;;) {
      WireHeader w;
      int r = read_all(fd, &w, sizeof(w));
      if (r != 1) {
        const int e = errno;
        if (!stop_) lose_peer(p, r == 0 ? "the peer closed the connection" : "receive failed: " + errno_str(e));
        return;
      }
      if (w.magic != kMagicWrite || w.nshards == 0 || w.shard >= w.nshards) {
        if (!stop_) lose_peer(p, "protocol error (bad write header)");
        return;
      }
      Region reg;
      const bool ok = lookup(w.rkey, w.roff, w.len, &reg);
      if (ok) {
        r = w.len ? read_all(fd, reg.ptr + w.roff, size_t(w.len)) : 1;
      } else {  // reject: drain the payload, ack with an error
        uint64_t left = w.len;
        scratch.resize(1 << 16);
        r = 1;
        while (left > 0 && r == 1) {
          const size_t n = size_t(std::min<uint64_t>(left, scratch.size()));
          r = read_all(fd, scratch.data(), n);
          left -= n;
        }
      }
      if (r != 1) {
        const int e = errno;
        if (!stop_) lose_peer(p, "connection lost in the middle of a write: " + errno_str(e));
        return;
      }
      bool count = false;
      if (w.nshards == 1) {
        count = ok;
      } else {
        std::lock_guard<std::mutex> lk(pr.mu);
        auto [it, fresh] = pr.partial.try_emplace(w.wr_id, Partial{w.nshards, false});
        (void)fresh;
        it->second.bad |= !ok;
        if (--it->second.remaining == 0) {
          count = !it->second.bad;
          pr.partial.erase(it);
        }
      }
      // The immediate is counted before the ack goes out: a sender that saw its completion knows
      // the receiver's counter already includes the write.
      if (count && (w.flags & kFlagImm)) imm_.add(w.imm, 1);
      WireAck a{w.wr_id, ok ? 0u : 1u, w.shard};
      if (!write_all(fd, &a, sizeof(a))) {
        const int e = errno;
        if (!stop_) lose_peer(p, "sending ack failed: " + errno_str(e));
        return;
      }
    }
  }

  const int rank_, world_, nstreams_;
  int listen_fd_ = -1;
  std::string endpoint_;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::mutex reg_mu_;
  std::vector<Region> regions_;
  ImmCounter imm_;
  std::mutex cq_mu_;
  std::condition_variable cq_cv_;
  std::deque<Completion> cq_;
  std::unordered_map<uint64_t, Pending> pending_;
  std::atomic<uint64_t> next_wr_{1};
  std::atomic<int64_t> delay_us_{0};
  std::atomic<bool> reorder_{false};
  std::atomic<int> cut_peer_{-1};
  std::atomic<int64_t> cut_after_{0};
  std::atomic<int64_t> op_timeout_ns_{30'000'000'000LL};
  std::atomic<uint64_t> min_shard_{kDefaultMinShardBytes};
  std::atomic<int64_t> last_timeout_check_ns_{0};
  std::atomic<bool> stop_{false};
  std::atomic<bool> connected_{false};
  std::thread accept_thread_;
  std::mutex thr_mu_;
  std::vector<std::thread> recv_threads_;
  std::vector<int> accepted_fds_;
};

}  // namespace

Transport* create_tcp_transport(int rank, int world, int streams, const std::string& bind_host) {
  if (world < 1 || rank < 0 || rank >= world)
    return set_error(kErrInvalid, "rank " + std::to_string(rank) + ": bad rank for world size " + std::to_string(world)), nullptr;
  if (streams < 1 || streams > 256)
    return set_error(kErrInvalid, "rank " + std::to_string(rank) + ": streams must be 1..256, got " + std::to_string(streams)), nullptr;
  auto* t = new TcpTransport(rank, world, streams);
  if (t->start(bind_host) != kOk) {
    delete t;
    return nullptr;
  }
  return t;
}

}  // namespace moe_ep
