// TCP transport: several streams (sockets) per peer and direction; writes are spread (and large
// ones sharded) across the streams, so delivery is really unordered. Two epoll threads per
// engine: a sender thread puts this rank's shards and goodbyes on its sockets, an I/O thread
// does everything else (receives, acks both ways, hellos, failures), so sends and receives run at
// once. Wire format and threading: docs/ARCHITECTURE.md, "Proxy engine (native)".
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <linux/sockios.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cuda_mem.h"
#include "transport.h"
#include "transport_common.h"

namespace moe_ep {
namespace {

constexpr uint32_t kMagicWrite = 0x5750454d;  // "MEPW"
constexpr uint32_t kFlagImm = 1;
constexpr int kMaxStreams = 256;

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
  uint32_t status;  // 0 ok, 1 rejected (unknown key or out of bounds), kAckGoodbye
  uint32_t shard;
};
static_assert(sizeof(WireAck) == 16, "wire format");

// An ack with this status (wr_id 0, which no write has) is followed by the receiver's WireGoodbye
// (transport_common.h): how a closing rank says goodbye on the connections its peer opened, where
// the peer reads acks. On its own connections the goodbye is a frame of its own, after the last
// shard begun (its magic tells it from a shard header).
constexpr uint32_t kAckGoodbye = 2;

// The first message on every connection, connector -> listener: WireHello (transport_common.h),
// with the stream index as its lane.

using Clock = std::chrono::steady_clock;

int64_t now_ns() { return steady_now_ns(); }

std::string errno_str(int e) { return std::string(strerror(e)); }

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

// One socket. Outgoing (this rank connected): shards out (the sender thread), acks in (the I/O
// thread). Incoming (the peer connected): hello and shards in, acks out (the I/O thread). The
// receiving fields belong to the I/O thread; an outgoing connection's sending fields to the sender
// thread; posters push shards into `q` under `mu`.
struct Conn {
  int fd = -1;
  int peer = -1;  // incoming: known after the hello
  bool outgoing = false;
  std::atomic<bool> dead{false};  // out of the I/O epoll set; closed (outgoing: shut down, closed at the end)
  std::string addr;   // incoming: the connector's address, "ip:port"
  // receiving
  enum State { kHello, kHeader, kPayload } st = kHeader;
  std::vector<char> rbuf;  // staging; [rpos, rend) not parsed yet
  size_t rpos = 0, rend = 0;
  WireHeader w{};
  char* dst = nullptr;  // where the payload goes (null: drained, the shard was rejected)
  uint64_t left = 0;    // payload bytes still to come
  bool ok = false;
  int64_t hello_deadline = 0;
  // sending
  std::mutex mu;
  std::deque<Shard> q;  // outgoing: shards waiting for this stream
  bool busy = false;    // `cur` partly sent
  Shard cur{};
  uint64_t cur_off = 0;     // bytes of header + payload of `cur` sent
  int64_t hold_until = 0;   // delay injection: the next message leaves at this time
  std::vector<char> obuf;   // incoming: acks not yet sent, from opos; then the goodbye (both kinds)
  size_t opos = 0;
  bool want_out = false;    // EPOLLOUT armed
  bool bye = false;         // the goodbye is in obuf: nothing is queued after it
  // outgoing: a send that failed (the sender thread stops using the socket and hands the failure
  // to the I/O thread, which reads what the peer sent before, its goodbye above all; under mu)
  std::string send_error;
  bool send_broken = false;  // sender thread: the socket failed, nothing more is sent on it
  bool in_send_set = false;  // sender thread: registered in its epoll set
};

struct Partial {
  uint32_t remaining;
  bool bad;
};

struct Peer {
  std::vector<std::unique_ptr<Conn>> out;  // one per stream; fd set by connect()
  std::atomic<bool> lost{false};
  std::atomic<int64_t> writes_posted{0};
  std::atomic<uint32_t> next_stream{0};
  std::mutex mu;            // guards err, the goodbye fields, in_fds and the out fds
  std::string err;
  bool said_bye = false;    // the peer's goodbye came before it was lost: it said `bye`
  Goodbye bye;
  std::string bye_text;
  std::vector<int> in_fds;  // the peer's connections to us
  std::unordered_map<uint64_t, Partial> partial;  // I/O thread: writes with shards still to land
  std::vector<bool> stream_in = std::vector<bool>(kMaxStreams, false);  // I/O thread: streams connected to us
};

constexpr size_t kInBuf = 64 << 10, kAckBuf = 4 << 10, kDirectRecv = 8 << 10;

class TcpTransport final : public Transport {
 public:
  TcpTransport(int rank, int world, int streams, const JobIdentity& id)
      : rank_(rank), world_(world), nstreams_(streams), id_(id) {
    for (int p = 0; p < world; ++p) {
      peers_.emplace_back(new Peer);
      for (int s = 0; s < streams; ++s) {
        peers_.back()->out.emplace_back(new Conn);
        Conn& c = *peers_.back()->out.back();
        c.peer = p;
        c.outgoing = true;
        c.rbuf.resize(kAckBuf);
      }
    }
  }

  int start(const std::string& bind_host) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
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
    ep_ = epoll_create1(EPOLL_CLOEXEC);
    sep_ = epoll_create1(EPOLL_CLOEXEC);
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    swake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    timer_fd_ = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (ep_ < 0 || sep_ < 0 || wake_fd_ < 0 || swake_fd_ < 0 || timer_fd_ < 0)
      return set_error(kErrSystem, prefix() + "epoll/eventfd/timerfd failed: " + errno_str(errno));
    listen_tag_.fd = listen_fd_;
    wake_tag_.fd = wake_fd_;
    swake_tag_.fd = swake_fd_;
    timer_tag_.fd = timer_fd_;
    for (Conn* c : {&listen_tag_, &wake_tag_}) ep_add(c);
    for (Conn* c : {&swake_tag_, &timer_tag_}) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.ptr = c;
      epoll_ctl(sep_, EPOLL_CTL_ADD, c->fd, &ev);
    }
    if (int rc = start_thread(&io_thread_, [this] { io_loop(); }, prefix() + "I/O thread"); rc != kOk) return rc;
    return start_thread(&send_thread_, [this] { send_loop(); }, prefix() + "sender thread");
  }

  ~TcpTransport() override {
    say_goodbye(Goodbye{});  // a clean close, unless the owner said otherwise
    stop_ = true;
    wake_io();
    wake_sender();
    if (send_thread_.joinable()) send_thread_.join();
    if (io_thread_.joinable()) io_thread_.join();
    for (auto& c : in_)
      if (c->fd >= 0) shutdown(c->fd, SHUT_RDWR), close(c->fd);
    for (auto& pr : peers_)
      for (auto& c : pr->out)
        if (c->fd >= 0) shutdown(c->fd, SHUT_RDWR), close(c->fd);
    for (int fd : {listen_fd_, ep_, sep_, wake_fd_, swake_fd_, timer_fd_})
      if (fd >= 0) close(fd);
  }

  int rank() const override { return rank_; }
  int world() const override { return world_; }
  std::string endpoint() const override { return endpoint_; }
  ImmCounter& imm_counter() override { return imm_; }

  int register_memory(void* ptr, uint64_t len, uint32_t* key) override {
    if (ptr == nullptr && len > 0) return set_error(kErrInvalid, prefix() + "register: null pointer");
    std::string why;
    if (len > 0 && !try_register(ptr, len, &why)) return set_error(kErrInvalid, prefix() + "register: " + why);
    *key = regions_.add(Region{static_cast<char*>(ptr), len});
    return kOk;
  }

  // The CPU sends and receives every byte (send/recv on sockets), so GPU memory is refused.
  bool try_register(void* ptr, uint64_t len, std::string* how) override {
    if (len > 0 && memory_type(ptr) == MemType::Device) {
      *how = "the tcp transport moves bytes with the CPU, which cannot reach GPU memory";
      return false;
    }
    *how = "host";
    return true;
  }

  int connect(const std::vector<std::string>& endpoints, int64_t timeout_ns) override {
    if (int rc = check_connect(rank_, world_, connected_, endpoints.size()); rc != kOk) return rc;
    const int64_t deadline = now_ns() + timeout_ns;
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      for (int s = 0; s < nstreams_; ++s) {
        int fd = -1;
        int rc = dial(p, endpoints[p], deadline, &fd);
        if (rc != kOk) return rc;
        const WireHello h = make_hello(id_, rank_, p, world_, s);
        if (!write_all(fd, &h, sizeof(h))) {
          int e = errno;
          close(fd);
          return set_error(kErrSystem, prefix() + "peer " + std::to_string(p) + ": sending hello failed: " + errno_str(e));
        }
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
        Conn* c = peers_[p]->out[s].get();
        {
          std::lock_guard<std::mutex> lk(peers_[p]->mu);
          c->fd = fd;
          if (peers_[p]->lost) shutdown(fd, SHUT_RDWR);
        }
        ep_add(c);
      }
    }
    connected_ = true;
    return kOk;
  }

  int post_write(const WriteOp& w, uint64_t* wr_id) override {
    Region r;
    if (int rc = check_post(rank_, world_, connected_, regions_, w, &r); rc != kOk) return rc;
    const char* src = r.ptr + w.local_off;
    Peer& pr = *peers_[w.peer];
    const uint64_t wr = next_wr_++;
    *wr_id = wr;

    if (std::string why = cut_.cuts(w.peer, pr.writes_posted++); !why.empty()) lose_peer(w.peer, why);

    // Shards of at least min_shard_bytes (a small write is one message on one stream; successive
    // writes still go to different streams, so they stay unordered).
    const uint64_t ms = std::max<uint64_t>(min_shard_.load(), 1);
    const uint32_t nshards =
        uint32_t(std::min<uint64_t>(uint64_t(nstreams_), std::max<uint64_t>((w.len + ms - 1) / ms, 1)));
    if (cq_.add(wr, w.peer, nshards, pr.lost) == 0) return kOk;  // lost: completed as such
    static thread_local std::mt19937_64 rng{std::random_device{}()};
    const bool reorder = reorder_.load();
    const uint32_t start = pr.next_stream.fetch_add(nshards);
    const uint64_t base = w.len / nshards, extra = w.len % nshards;
    uint64_t off = 0;
    for (uint32_t i = 0; i < nshards; ++i) {
      const uint64_t slen = base + (i < extra ? 1 : 0);
      Shard sh;
      sh.h = WireHeader{kMagicWrite, w.has_imm ? kFlagImm : 0u, wr, w.remote_key, w.imm, w.remote_off + off, slen, i,
                        nshards};
      sh.src = src + off;
      off += slen;
      const uint32_t si = reorder ? uint32_t(rng() % uint64_t(nstreams_)) : (start + i) % uint32_t(nstreams_);
      Conn& s = *pr.out[si];
      std::lock_guard<std::mutex> lk(s.mu);
      if (pr.lost) break;  // pending already failed by lose_peer
      s.q.push_back(sh);
    }
    wake_sender();
    return kOk;
  }

  int poll(Completion* out, int max, int64_t timeout_ns) override {
    return cq_.poll(out, max, timeout_ns, [this] { check_op_timeouts(); });
  }

  void set_fault(const FaultConfig& f) override {
    delay_us_ = std::max<int64_t>(f.delay_us, 0);
    reorder_ = f.reorder;
    cut_.set(f);
  }

  void set_op_timeout(int64_t ns) override { op_timeout_ns_ = ns; }
  void set_min_shard_bytes(uint64_t n) override { min_shard_ = std::max<uint64_t>(n, 1); }
  void set_hello_timeout(int64_t ns) override { hello_timeout_ns_ = std::max<int64_t>(ns, 1); }
  void set_max_pending(int n) override { max_pending_ = std::max(n, 1); }
  std::vector<std::string> refused(int64_t* total) const override { return refusals_.lines(total); }

  int64_t cpu_ns() override { return thread_cpu_ns(io_thread_) + thread_cpu_ns(send_thread_); }

  std::string peer_error(int peer) override { return loss_of(peers_, peer); }

  // The goodbye goes on every connection of every peer not lost: the sender thread queues it on
  // this rank's connections, the I/O thread on the peers'; each reports when the kernel has sent
  // all of its part (queue_*_goodbyes, *_goodbyes_gone); this waits for both.
  void say_goodbye(const Goodbye& g) override {
    std::unique_lock<std::mutex> lk(bye_mu_);
    if (bye_asked_) return;
    bye_ = g;
    bye_asked_ = true;
    if (!connected_ || !io_thread_.joinable() || !send_thread_.joinable()) return;
    wake_io();
    wake_sender();
    bye_cv_.wait_for(lk, std::chrono::nanoseconds(kGoodbyeTimeoutNs), [this] { return bye_gone_; });
  }

  bool peer_goodbye(int peer, Goodbye* out) override { return said_goodbye(peers_, peer, out); }

 private:
  std::string prefix() const { return "rank " + std::to_string(rank_) + ": "; }

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

  // Wakes the I/O thread (a goodbye to queue, a send failure to take, stop).
  void wake_io() {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }

  // Wakes the sender thread: shards were queued (once until it has drained the signal).
  void wake_sender() {
    if (!wake_pending_.exchange(true)) {
      const uint64_t one = 1;
      (void)!write(swake_fd_, &one, sizeof(one));
    }
  }

  void ep_add(Conn* c) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.ptr = c;
    epoll_ctl(ep_, EPOLL_CTL_ADD, c->fd, &ev);
  }

  // EPOLLOUT on or off for c: an incoming connection's in the I/O thread's set (acks to send), an
  // outgoing one's in the sender thread's (shards and its goodbye to send; added on first use).
  void arm_out(Conn* c, bool on) {
    if (c->want_out == on || c->dead) return;
    c->want_out = on;
    epoll_event ev{};
    ev.data.ptr = c;
    if (c->outgoing) {
      ev.events = on ? EPOLLOUT : 0u;
      epoll_ctl(sep_, c->in_send_set ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, c->fd, &ev);
      c->in_send_set = true;
    } else {
      ev.events = EPOLLIN | (on ? EPOLLOUT : 0u);
      epoll_ctl(ep_, EPOLL_CTL_MOD, c->fd, &ev);
    }
  }

  // Takes outgoing c out of the sender thread's set (its socket failed or its peer is gone: a hung
  // up socket would be reported there again and again).
  void unwatch_send(Conn* c) {
    if (!c->in_send_set) return;
    epoll_ctl(sep_, EPOLL_CTL_DEL, c->fd, nullptr);
    c->in_send_set = false;
    c->want_out = false;
  }

  // Takes the socket out of the epoll set and closes it. A peer's socket (outgoing, or incoming
  // after its hello) is closed under the peer's lock, so lose_peer() never shuts down a
  // descriptor number that was reused since. A dropped incoming Conn is freed by reap().
  void drop(Conn* c) {
    if (c->dead) return;
    c->dead = true;
    epoll_ctl(ep_, EPOLL_CTL_DEL, c->fd, nullptr);
    if (!c->outgoing && c->st == Conn::kHello) {
      --pending_;
      close_fd(c);
    } else {
      Peer& pr = *peers_[c->peer];
      std::lock_guard<std::mutex> lk(pr.mu);
      pr.in_fds.erase(std::remove(pr.in_fds.begin(), pr.in_fds.end(), c->fd), pr.in_fds.end());
      // An outgoing socket is only shut down: the sender thread may still be using it (a send then
      // fails); it is closed with the engine.
      if (c->outgoing)
        shutdown(c->fd, SHUT_RDWR);
      else
        close_fd(c);
    }
    if (!c->outgoing) reap_ = true;
  }

  static void close_fd(Conn* c) {
    shutdown(c->fd, SHUT_RDWR);
    close(c->fd);
    c->fd = -1;
  }

  // An incoming connection that did not become a peer's: one line naming its address and why
  // (never the secret), then dropped. Its claimed peer is not touched.
  void refuse(Conn* c, const std::string& why) {
    refusals_.record(prefix() + "refused a connection from " + c->addr + ": " + why);
    drop(c);
  }

  // Frees the incoming Conns dropped in this round of the I/O loop (after its events: none of
  // them is referred to any more).
  void reap() {
    if (!reap_) return;
    reap_ = false;
    in_.erase(std::remove_if(in_.begin(), in_.end(), [](const std::unique_ptr<Conn>& c) { return c->dead.load(); }), in_.end());
  }

  // A send failed (I/O thread): the peer ended the connection (reset it), but what it sent before
  // is still to be read (its goodbye above all, which says why it left), so that is read first.
  void fail_send(Conn* c, const std::string& why) {
    on_readable(c, false);
    if (!c->dead) fail(c, why);
  }

  // A socket failed: its peer is lost (first reason wins) and the socket is closed. A connection
  // still waiting for its hello belongs to no peer: it is refused, and no peer is touched.
  void fail(Conn* c, const std::string& why) {
    if (!c->outgoing && c->st == Conn::kHello) return refuse(c, why);
    if (!stop_) lose_peer(c->peer, why);
    drop(c);
  }

  // Marks the peer lost (first reason wins): shuts its sockets down both ways, fails its pending
  // writes and the ImmCounter's waiters. `bye`: lost by its goodbye (`why` says what it said).
  void lose_peer(int p, const std::string& why, int32_t status = kCqPeerLost, const Goodbye* bye = nullptr) {
    Peer& pr = *peers_[p];
    std::string msg = loss_text(rank_, p, "", why);
    {
      std::lock_guard<std::mutex> lk(pr.mu);
      if (!mark_lost(pr, &msg, bye)) return;
      for (int fd : pr.in_fds) shutdown(fd, SHUT_RDWR);
      for (auto& c : pr.out)
        if (c->fd >= 0) shutdown(c->fd, SHUT_RDWR);
    }
    for (auto& c : pr.out) {
      std::lock_guard<std::mutex> lk(c->mu);
      c->q.clear();
    }
    cq_.fail_peer(p, status);
    imm_.fail(msg);
  }

  void check_op_timeouts() {
    cq_.expire(op_timeout_ns_.load(), [this](int p, const std::string& why) { lose_peer(p, why, kCqTimeout); });
  }

  // ---- the I/O thread: every socket of the engine, one epoll loop ----

  // One wait of a thread's epoll set `ep`: the events (at most 64) in ev, their count (0 after an
  // error, which backs off 1 ms rather than spin). The 10 ms timeout is only a safety net.
  static int wait_events(int ep, epoll_event* ev) {
    const int n = epoll_wait(ep, ev, 64, 10);
    if (n < 0 && errno != EINTR) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return std::max(n, 0);
  }

  // An eventfd's signal, drained.
  static void drain(int fd) {
    uint64_t v;
    (void)!read(fd, &v, sizeof(v));
  }

  void io_loop() {
    epoll_event ev[64];
    while (!stop_) {
      const int n = wait_events(ep_, ev);
      if (stop_) break;
      for (int i = 0; i < n; ++i) {
        Conn* c = static_cast<Conn*>(ev[i].data.ptr);
        if (c == &wake_tag_) {
          drain(wake_fd_);
        } else if (c == &listen_tag_) {
          accept_all();
        } else if (!c->dead) {
          if (ev[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) on_readable(c);
          if (!c->dead && !c->outgoing && (ev[i].events & EPOLLOUT)) flush_out(c);
        }
      }
      if (send_failures_.exchange(false)) take_send_failures();
      if (bye_asked_ && !in_bye_queued_) queue_in_goodbyes();
      if (in_bye_queued_) in_goodbyes_gone();
      expire_hellos();
      reap();
    }
  }

  // The failures the sender thread handed over (send_failed), each taken as any failed send is.
  void take_send_failures() {
    for (auto& pr : peers_)
      for (auto& c : pr->out) {
        std::string why;
        {
          std::lock_guard<std::mutex> lk(c->mu);
          why.swap(c->send_error);
        }
        if (!why.empty() && !c->dead) fail_send(c.get(), why);
      }
  }

  // ---- the sender thread: this rank's shards and goodbyes out, on every outgoing socket, so that
  // sending and receiving (the I/O thread) run at once ----

  void send_loop() {
    epoll_event ev[64];
    while (!stop_) {
      const int n = wait_events(sep_, ev);
      if (stop_) break;
      for (int i = 0; i < n; ++i) {
        Conn* c = static_cast<Conn*>(ev[i].data.ptr);
        if (c == &swake_tag_) {
          drain(swake_fd_);
          // After draining, before pump(): a post that saw the flag set queued its shards before
          // this store, so pump() sends them; a later post finds it clear and signals again.
          wake_pending_ = false;
        } else if (c == &timer_tag_) {
          drain(timer_fd_);
        } else if (c->dead || c->send_broken || peers_[c->peer]->lost || (ev[i].events & (EPOLLHUP | EPOLLERR))) {
          unwatch_send(c);  // (the I/O thread reads the end and fails the peer)
        } else {
          send_some(c);
        }
      }
      pump();
      if (bye_asked_ && !out_bye_queued_) queue_out_goodbyes();
      if (out_bye_queued_) out_goodbyes_gone();
    }
  }

  // A send on outgoing c failed (sender thread): nothing more is sent on it, and the I/O thread
  // takes the failure (fail_send reads what the peer sent before first).
  void send_failed(Conn* c, const std::string& why) {
    c->send_broken = true;
    unwatch_send(c);
    {
      std::lock_guard<std::mutex> lk(c->mu);
      if (c->send_error.empty()) c->send_error = why;
    }
    send_failures_ = true;
    wake_io();
  }

  // The goodbye on every connection of every peer not gone (the peer may notice any of them close
  // first): on this rank's own connections after the shard being sent (the queued ones are
  // dropped: the engine is closing; the sender thread), on the peer's after the acks queued, behind
  // an ack marker (the I/O thread).
  Goodbye goodbye_said() {
    std::lock_guard<std::mutex> lk(bye_mu_);
    return bye_;
  }

  static void put(Conn* c, const void* p, size_t n) {
    c->obuf.insert(c->obuf.end(), static_cast<const char*>(p), static_cast<const char*>(p) + n);
  }

  void queue_out_goodbyes() {
    const Goodbye g = goodbye_said();
    out_bye_queued_ = true;
    for (int p = 0; p < world_; ++p) {
      if (p == rank_ || peer_gone(*peers_[p])) continue;
      const WireGoodbye w = make_goodbye(id_, rank_, p, world_, g);
      for (auto& c : peers_[p]->out) {
        if (c->fd < 0 || c->dead || c->send_broken) continue;
        {
          std::lock_guard<std::mutex> lk(c->mu);
          c->q.clear();
        }
        put(c.get(), &w, sizeof(w));
        c->bye = true;
        send_some(c.get());
      }
    }
  }

  void queue_in_goodbyes() {
    const Goodbye g = goodbye_said();
    in_bye_queued_ = true;
    const WireAck marker{0, kAckGoodbye, 0};
    for (auto& c : in_) {
      if (c->dead || c->st == Conn::kHello || peer_gone(*peers_[c->peer])) continue;
      const WireGoodbye w = make_goodbye(id_, rank_, c->peer, world_, g);
      put(c.get(), &marker, sizeof(marker));
      put(c.get(), &w, sizeof(w));
      c->bye = true;
      flush_out(c.get());
    }
  }

  // Tells say_goodbye once every goodbye is out: handed to the kernel and acknowledged by the peer's
  // (SIOCOUTQ 0), since closing a socket with unread bytes resets it and drops what it still holds.
  // Each thread its part: this rank's connections (sender thread), the peers' (I/O thread).
  static bool bye_sent(const Conn& c) {
    int unsent = 0;
    return c.dead || !c.bye || (c.obuf.empty() && ioctl(c.fd, SIOCOUTQ, &unsent) == 0 && unsent == 0);
  }

  void out_goodbyes_gone() {
    for (int p = 0; p < world_; ++p)
      if (p != rank_ && !peers_[p]->lost)
        for (auto& c : peers_[p]->out)
          if (c->fd >= 0 && !c->send_broken && !bye_sent(*c)) return;
    part_gone(&out_bye_gone_);
  }

  void in_goodbyes_gone() {
    for (auto& c : in_)
      if (c->st != Conn::kHello && !peers_[c->peer]->lost && !bye_sent(*c)) return;
    part_gone(&in_bye_gone_);
  }

  void part_gone(bool* part) {
    std::lock_guard<std::mutex> lk(bye_mu_);
    *part = true;
    if (out_bye_gone_ && in_bye_gone_ && !bye_gone_) {
      bye_gone_ = true;
      bye_cv_.notify_all();
    }
  }

  // Accepts the waiting connections (at most 64 a round, so a flood cannot keep the loop from
  // the peers' sockets: the listener stays readable) and reads each at once: a peer sends its
  // hello right after connecting, so it usually becomes the peer's before it counts as pending.
  // Beyond max_pending_ connections without a hello, the oldest of them is dropped.
  void accept_all() {
    for (int round = 0; round < 64; ++round) {
      sockaddr_in a{};
      socklen_t al = sizeof(a);
      const int fd = accept4(listen_fd_, reinterpret_cast<sockaddr*>(&a), &al, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        // Out of descriptors or memory: the socket stays readable, so back off instead of spinning.
        if (errno != EAGAIN && errno != EWOULDBLOCK) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        return;
      }
      set_nodelay(fd);
      in_.emplace_back(new Conn);
      Conn* c = in_.back().get();
      c->fd = fd;
      c->st = Conn::kHello;
      char ip[INET_ADDRSTRLEN] = "?";
      inet_ntop(AF_INET, &a.sin_addr, ip, sizeof(ip));
      c->addr = std::string(ip) + ":" + std::to_string(ntohs(a.sin_port));
      c->hello_deadline = now_ns() + hello_timeout_ns_.load();  // a silent connector cannot stay forever
      c->rbuf.resize(kInBuf);
      ++pending_;
      ep_add(c);
      on_readable(c);
      if (pending_ > max_pending_.load()) evict_oldest_pending();
    }
  }

  void evict_oldest_pending() {
    for (auto& c : in_)
      if (!c->dead && c->st == Conn::kHello)
        return refuse(c.get(), "no hello yet, and more than " + std::to_string(max_pending_.load()) +
                                   " connections wait for theirs (the oldest is dropped)");
  }

  void expire_hellos() {
    const int64_t now = now_ns();
    if (now - last_hello_check_ < 100'000'000) return;
    last_hello_check_ = now;
    char t[32];
    std::snprintf(t, sizeof(t), "%g", double(hello_timeout_ns_.load()) / 1e9);
    const std::string why = std::string("no hello within ") + t + " s";
    for (auto& c : in_)
      if (!c->dead && c->st == Conn::kHello && now > c->hello_deadline) refuse(c.get(), why);
  }

  // `flush`: send the acks this read queued (an incoming connection).
  void on_readable(Conn* c, bool flush = true) {
    for (int round = 0; round < 64 && !c->dead; ++round) {
      if (c->st == Conn::kPayload && c->dst && c->rpos == c->rend && c->left >= kDirectRecv) {
        const ssize_t r = recv(c->fd, c->dst, size_t(c->left), MSG_DONTWAIT);  // large payload: no staging copy
        if (r > 0) {
          c->dst += r;
          c->left -= uint64_t(r);
          if (c->left == 0) land(c);
          continue;
        }
        if (!read_failed(c, r)) break;
        return;
      }
      if (c->rpos == c->rend) c->rpos = c->rend = 0;
      if (c->rend == c->rbuf.size()) {  // keep the unparsed tail, make room after it
        std::memmove(c->rbuf.data(), c->rbuf.data() + c->rpos, c->rend - c->rpos);
        c->rend -= c->rpos;
        c->rpos = 0;
      }
      const size_t room = c->rbuf.size() - c->rend;
      const ssize_t r = recv(c->fd, c->rbuf.data() + c->rend, room, MSG_DONTWAIT);
      if (r <= 0) {
        if (!read_failed(c, r)) break;
        return;
      }
      c->rend += size_t(r);
      if (!parse(c)) return;
      if (size_t(r) < room) break;  // drained (level-triggered: epoll reports more)
    }
    if (flush && !c->dead && !c->outgoing) flush_out(c);
  }

  // r <= 0 from recv. Returns false for "would block" (nothing lost), true when the socket failed.
  bool read_failed(Conn* c, ssize_t r) {
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
    const int e = errno;
    std::string why;
    if (!c->outgoing && c->st == Conn::kHello)
      why = r == 0 ? "closed after " + std::to_string(c->rend - c->rpos) + " of its " + std::to_string(sizeof(WireHello)) +
                         " hello bytes"
                   : "receive failed: " + errno_str(e);
    else if (r == 0 && !c->outgoing && (c->st == Conn::kPayload || c->rpos != c->rend))
      why = "connection lost in the middle of a write: " + errno_str(ECONNRESET);
    else if (r == 0)
      why = "the peer closed the connection";
    else
      why = std::string(c->outgoing ? "receiving acks failed: " : "receive failed: ") + errno_str(e);
    fail(c, why);
    return true;
  }

  // Consumes the staged bytes. False when the connection was dropped.
  bool parse(Conn* c) {
    if (c->outgoing) return parse_acks(c);
    for (;;) {
      const size_t avail = c->rend - c->rpos;
      const char* p = c->rbuf.data() + c->rpos;
      if (c->st == Conn::kHello) {
        if (!accept_hello(c, p, avail)) return false;
        if (c->st == Conn::kHello) return true;  // not all of it yet
      } else if (c->st == Conn::kHeader) {
        uint32_t magic = 0;
        if (avail >= sizeof(magic)) std::memcpy(&magic, p, sizeof(magic));
        if (magic == kMagicGoodbye) {
          if (avail < sizeof(WireGoodbye)) return true;
          WireGoodbye g;
          std::memcpy(&g, p, sizeof(g));
          c->rpos += sizeof(g);
          if (!on_goodbye(c, g)) return false;
          continue;
        }
        if (avail < sizeof(WireHeader)) return true;
        std::memcpy(&c->w, p, sizeof(WireHeader));
        c->rpos += sizeof(WireHeader);
        const WireHeader& w = c->w;
        if (std::string why = header_problem(w); !why.empty()) return fail(c, "protocol error: " + why), false;
        Region reg;
        c->ok = regions_.lookup(w.rkey, w.roff, w.len, &reg);
        c->dst = c->ok ? reg.ptr + w.roff : nullptr;  // rejected: drained, acknowledged with an error
        c->left = w.len;
        c->st = Conn::kPayload;
        if (c->left == 0) land(c);
      } else {
        if (avail == 0) return true;
        const size_t n = size_t(std::min<uint64_t>(avail, c->left));
        if (c->dst) {
          std::memcpy(c->dst, p, n);
          c->dst += n;
        }
        c->rpos += n;
        c->left -= n;
        if (c->left == 0) land(c);
      }
    }
  }

  // The hello at the start of an incoming connection (`avail` bytes staged at p). False when the
  // connection was refused; true otherwise, with c->st left at kHello while bytes are missing.
  // A wrong magic is refused from its first 4 bytes, without waiting for the rest.
  bool accept_hello(Conn* c, const char* p, size_t avail) {
    if (avail >= sizeof(uint32_t)) {
      uint32_t magic;
      std::memcpy(&magic, p, sizeof(magic));
      if (std::string why = hello_magic_problem(magic); !why.empty()) return refuse(c, why), false;
    }
    if (avail < sizeof(WireHello)) return true;
    WireHello h;
    std::memcpy(&h, p, sizeof(h));
    c->rpos += sizeof(h);
    std::string why = hello_mismatch(h, sizeof(h), rank_, world_, id_);
    if (why.empty() && (h.lane < 0 || h.lane >= kMaxStreams))
      why = "stream " + std::to_string(h.lane) + " (streams are 0.." + std::to_string(kMaxStreams - 1) + ")";
    if (why.empty() && peers_[h.src_rank]->stream_in[size_t(h.lane)])
      why = "a second connection for rank " + std::to_string(h.src_rank) + " stream " + std::to_string(h.lane) +
            " (that stream is connected already)";
    if (!why.empty()) return refuse(c, why), false;
    Peer& pr = *peers_[h.src_rank];
    {
      std::lock_guard<std::mutex> lk(pr.mu);
      if (!pr.lost && !stop_) {
        pr.in_fds.push_back(c->fd);
        pr.stream_in[size_t(h.lane)] = true;
        c->peer = h.src_rank;
        c->st = Conn::kHeader;
        --pending_;
        return true;
      }
    }
    drop(c);  // the peer is lost already: nothing more comes from it
    return false;
  }

  // "" for a write header a peer may send, else what is wrong with it. A shard longer than the
  // largest region can land nowhere: the connection ends at once instead of draining it.
  std::string header_problem(const WireHeader& w) const {
    if (w.magic != kMagicWrite) return "bad write header magic";
    if (w.nshards == 0 || w.nshards > uint32_t(kMaxStreams) || w.shard >= w.nshards)
      return "shard " + std::to_string(w.shard) + " of " + std::to_string(w.nshards) + " (at most " +
             std::to_string(kMaxStreams) + " shards)";
    if (const uint64_t most = regions_.max_len(); w.len > most)
      return "a shard of " + std::to_string(w.len) + " bytes, larger than any registered region (" +
             std::to_string(most) + " bytes)";
    return "";
  }

  // Every byte of the current shard is in place: count it, add the immediate when it was the
  // write's last shard, queue the ack.
  void land(Conn* c) {
    const WireHeader& w = c->w;
    Peer& pr = *peers_[c->peer];
    bool count = false;
    if (w.nshards == 1) {
      count = c->ok;
    } else {
      auto [it, fresh] = pr.partial.try_emplace(w.wr_id, Partial{w.nshards, false});
      (void)fresh;
      it->second.bad |= !c->ok;
      if (--it->second.remaining == 0) {
        count = !it->second.bad;
        pr.partial.erase(it);
      }
    }
    // The immediate is counted before the ack goes out: a sender that saw its completion knows
    // the receiver's counter already includes the write.
    if (count && (w.flags & kFlagImm)) imm_.add(w.imm, 1);
    const WireAck a{w.wr_id, c->ok ? 0u : 1u, w.shard};
    const char* b = reinterpret_cast<const char*>(&a);
    if (!c->bye) c->obuf.insert(c->obuf.end(), b, b + sizeof(a));  // nothing after a goodbye
    c->st = Conn::kHeader;
  }

  // The acks staged on one of this rank's connections, up to a goodbye (false: the connection and
  // its peer are gone).
  bool parse_acks(Conn* c) {
    bool notify = false, alive = true;
    while (c->rend - c->rpos >= sizeof(WireAck)) {
      WireAck a;
      std::memcpy(&a, c->rbuf.data() + c->rpos, sizeof(a));
      if (a.status == kAckGoodbye) {
        if (c->rend - c->rpos < sizeof(WireAck) + sizeof(WireGoodbye)) break;
        WireGoodbye g;
        std::memcpy(&g, c->rbuf.data() + c->rpos + sizeof(WireAck), sizeof(g));
        c->rpos += sizeof(WireAck) + sizeof(g);
        if (!(alive = on_goodbye(c, g))) break;
        continue;
      }
      bool completed = false;
      cq_.finish(a.wr_id, a.status != 0 ? kCqRemoteAccess : kCqOk, &completed);  // not pending: already failed
      notify |= completed;
      c->rpos += sizeof(WireAck);
    }
    if (notify) cq_.notify();
    return alive;
  }

  // A goodbye on a connection that passed its hello (only a cause trusted_goodbye accepts is
  // kept). After an error the peer is lost at once, by what it said; a clean one is remembered, and
  // the end of the connection that follows loses the peer as any end does (so a healthy job never
  // fails by a goodbye). One that fails the hello's checks is a protocol error: the peer is lost
  // all the same, named as the cause. False: the connection is gone.
  bool on_goodbye(Conn* c, const WireGoodbye& g) {
    if (std::string why = goodbye_mismatch(g, sizeof(g), c->peer, rank_, world_, id_); !why.empty())
      return fail(c, "protocol error: " + why), false;
    if (take_goodbye(g, world_, *peers_[c->peer], [&](const std::string& text, const Goodbye& bye) {
          if (!stop_) lose_peer(c->peer, text, kCqPeerLost, &bye);
        }))
      return true;
    drop(c);
    return false;
  }

  // Sends obuf (an incoming connection's acks, then its goodbye; an outgoing one's goodbye) as far
  // as the socket takes it.
  void flush_out(Conn* c) {
    while (c->opos < c->obuf.size()) {
      const ssize_t r = send(c->fd, c->obuf.data() + c->opos, c->obuf.size() - c->opos, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (r < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return arm_out(c, true);
        if (c->outgoing) return send_failed(c, "sending the goodbye failed: " + errno_str(errno));
        return fail_send(c, "sending ack failed: " + errno_str(errno));
      }
      c->opos += size_t(r);
    }
    c->obuf.clear();
    c->opos = 0;
    arm_out(c, false);
  }

  // Sends what the posters queued on every outgoing stream, as far as the sockets take it.
  void pump() {
    if (!connected_) return;
    next_hold_ = 0;
    for (int p = 0; p < world_; ++p)
      if (p != rank_)
        for (auto& c : peers_[p]->out)
          if (c->fd >= 0 && !c->dead && !c->send_broken) send_some(c.get());
    if (next_hold_) {  // delay injection: wake up when the earliest held message may leave
      itimerspec ts{};
      ts.it_value.tv_sec = time_t(next_hold_ / 1'000'000'000);
      ts.it_value.tv_nsec = long(next_hold_ % 1'000'000'000);
      timerfd_settime(timer_fd_, TFD_TIMER_ABSTIME, &ts, nullptr);
    }
  }

  void send_some(Conn* c) {
    Peer& pr = *peers_[c->peer];
    for (;;) {
      if (pr.lost || stop_) return;
      if (!c->busy && c->bye) return flush_out(c);  // the goodbye, after the last shard begun
      if (!c->busy) {
        std::lock_guard<std::mutex> lk(c->mu);
        if (c->q.empty()) break;
        if (const int64_t d = delay_us_.load(); d > 0) {
          const int64_t now = now_ns();
          if (c->hold_until == 0) c->hold_until = now + int64_t(rng_() % uint64_t(d + 1)) * 1000;
          if (now < c->hold_until) {
            if (!next_hold_ || c->hold_until < next_hold_) next_hold_ = c->hold_until;
            return;
          }
        }
        size_t i = 0;
        if (reorder_ && c->q.size() > 1) i = rng_() % c->q.size();
        c->cur = c->q[i];
        c->q.erase(c->q.begin() + long(i));
        c->hold_until = 0;
        c->busy = true;
        c->cur_off = 0;
      }
      const uint64_t hl = sizeof(WireHeader), total = hl + c->cur.h.len;
      iovec iov[2];
      int cnt = 0;
      if (c->cur_off < hl)
        iov[cnt++] = {reinterpret_cast<char*>(&c->cur.h) + c->cur_off, size_t(hl - c->cur_off)};
      const uint64_t poff = c->cur_off > hl ? c->cur_off - hl : 0;
      if (c->cur.h.len > poff) iov[cnt++] = {const_cast<char*>(c->cur.src) + poff, size_t(c->cur.h.len - poff)};
      msghdr m{};
      m.msg_iov = iov;
      m.msg_iovlen = size_t(cnt);
      const ssize_t r = sendmsg(c->fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (r < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return arm_out(c, true);
        return send_failed(c, "send failed: " + errno_str(errno));
      }
      c->cur_off += uint64_t(r);
      if (c->cur_off == total) c->busy = false;
    }
    arm_out(c, false);
  }

  const int rank_, world_, nstreams_;
  const JobIdentity id_;
  int listen_fd_ = -1, ep_ = -1, wake_fd_ = -1;  // the I/O thread's epoll set and eventfd
  int sep_ = -1, swake_fd_ = -1, timer_fd_ = -1;  // the sender thread's, and its delay-injection timer
  Conn listen_tag_, wake_tag_, swake_tag_, timer_tag_;  // epoll tags of the listening socket, eventfds, timerfd
  std::string endpoint_;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::vector<std::unique_ptr<Conn>> in_;  // I/O thread: accepted connections, oldest first
  int pending_ = 0;                        // I/O thread: of them, waiting for their hello
  bool reap_ = false;                      // I/O thread: some of them were dropped
  RefusalLog refusals_;
  RegionTable<Region> regions_;
  ImmCounter imm_;
  CompletionQueue cq_;
  std::atomic<uint64_t> next_wr_{1};
  std::atomic<int64_t> delay_us_{0};
  std::atomic<bool> reorder_{false};
  CutFault cut_;
  std::atomic<int64_t> op_timeout_ns_{30'000'000'000LL};
  std::atomic<uint64_t> min_shard_{kDefaultMinShardBytes};
  std::atomic<int64_t> hello_timeout_ns_{10'000'000'000LL};
  std::atomic<int> max_pending_{256};
  std::atomic<bool> stop_{false};
  std::atomic<bool> connected_{false};
  std::atomic<bool> wake_pending_{false};  // the sender thread's eventfd is signalled
  std::atomic<bool> send_failures_{false};  // a send_failed for the I/O thread to take
  std::mutex bye_mu_;                  // guards bye_, bye_gone_ and its two parts
  std::condition_variable bye_cv_;
  Goodbye bye_;                        // what the goodbye says (say_goodbye)
  std::atomic<bool> bye_asked_{false};
  bool bye_gone_ = false;              // every goodbye is out (both parts below)
  bool out_bye_gone_ = false, in_bye_gone_ = false;  // this rank's connections' part, the peers'
  bool out_bye_queued_ = false;        // sender thread: queue_out_goodbyes ran
  bool in_bye_queued_ = false;         // I/O thread: queue_in_goodbyes ran
  std::minstd_rand rng_{std::random_device{}()};  // sender thread
  int64_t next_hold_ = 0;                          // sender thread
  int64_t last_hello_check_ = 0;                   // I/O thread
  std::thread io_thread_, send_thread_;
};

}  // namespace

Transport* create_tcp_transport(int rank, int world, int streams, const std::string& bind_host, const JobIdentity& id) {
  if (bad_rank(rank, world)) return nullptr;
  if (streams < 1 || streams > 256)
    return set_error(kErrInvalid, "rank " + std::to_string(rank) + ": streams must be 1..256, got " + std::to_string(streams)), nullptr;
  return started(new TcpTransport(rank, world, streams, id), bind_host);
}

}  // namespace moe_ep
