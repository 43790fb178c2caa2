// rendezvous.cpp — where a process sits in a launch (torchrun or mpirun environment) and a small
// TCP rendezvous that hands rank 0's bytes (an NCCL unique id) to every other rank.
//
// The rendezvous is the only thing flare puts on the wire itself, once, at startup: NCCL needs its
// 128-byte id on every rank before it can connect them. Rank 0 listens on MASTER_ADDR:MASTER_PORT;
// every other rank connects (retrying while rank 0 is not up yet) and sends a hello with its rank,
// the world size it was launched with and the payload size it expects; rank 0 checks the hello
// and answers with the payload or with the reason it refuses. Every wait is bounded by the
// timeout, and a timeout names the ranks that did not arrive.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "dist/dist_internal.h"
#include "flare/dist.h"

namespace flare::dist {
namespace {

using Clock = std::chrono::steady_clock;

// Reads an integer variable; false when unset. A set but malformed value is an error.
Status read_int(const char* name, int* value, bool* found) {
  const char* text = std::getenv(name);
  *found = text != nullptr;
  if (!*found) return {};
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < 0 || v > 1 << 30)
    return invalid("environment: ", name, "=\"", text, "\" is not a non-negative integer");
  *value = static_cast<int>(v);
  return {};
}

constexpr uint32_t kMagic = 0x464c5244;  // "FLRD"

struct Hello {
  uint32_t magic;
  int32_t rank;
  int32_t size;
  int64_t bytes;
};

enum class Verdict : int32_t { kOk = 0, kWrongSize = 1, kDuplicate = 2, kBadRank = 3, kWrongBytes = 4 };

struct Reply {
  uint32_t magic;
  Verdict verdict;
  int32_t size;
  int64_t bytes;
};

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() > 0 ? static_cast<int>(left.count()) : 0;
}

// Closes a socket when it goes out of scope.
struct Socket {
  int fd = -1;
  Socket() = default;
  explicit Socket(int f) : fd(f) {}
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket() {
    if (fd >= 0) ::close(fd);
  }
};

// Waits for `events` on fd until the deadline; false on timeout or error.
bool wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, remaining_ms(deadline));
    if (rc > 0) return (p.revents & (events | POLLHUP | POLLERR)) != 0;
    if (rc == 0) return false;
    if (errno != EINTR) return false;
  }
}

bool send_all(int fd, const void* data, size_t bytes, Clock::time_point deadline) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (bytes > 0) {
    if (!wait_for(fd, POLLOUT, deadline)) return false;
    const ssize_t n = ::send(fd, p, bytes, MSG_NOSIGNAL);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

bool recv_all(int fd, void* data, size_t bytes, Clock::time_point deadline) {
  auto* p = static_cast<unsigned char*>(data);
  while (bytes > 0) {
    if (!wait_for(fd, POLLIN, deadline)) return false;
    const ssize_t n = ::recv(fd, p, bytes, 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

Status resolve(const LaunchInfo& info, addrinfo** out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string port = std::to_string(info.master_port);
  const int rc = ::getaddrinfo(info.master_addr.c_str(), port.c_str(), &hints, out);
  if (rc != 0)
    return invalid("MASTER_ADDR: cannot resolve \"", info.master_addr, "\": ", gai_strerror(rc));
  return {};
}

std::string where(const LaunchInfo& info) {
  return cat(info.master_addr, ":", info.master_port);
}

// Rank 0: serve the payload to size − 1 distinct ranks.
Status serve(const LaunchInfo& info, const void* data, int64_t bytes, int timeout_ms) {
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  addrinfo* ai = nullptr;
  FLARE_RETURN_IF_ERROR(resolve(info, &ai));
  Socket listener(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
  const int one = 1;
  const bool ok = listener.fd >= 0 &&
                  ::setsockopt(listener.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0 &&
                  ::bind(listener.fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
                  ::listen(listener.fd, 128) == 0;
  const int err = errno;
  ::freeaddrinfo(ai);
  if (!ok)
    return comm_failure("rendezvous: rank 0 cannot listen on ", where(info), ": ",
                        std::strerror(err), " (MASTER_ADDR must be this host, MASTER_PORT free)");
  std::vector<bool> served(static_cast<size_t>(info.size), false);
  served[0] = true;
  int count = 1;
  while (count < info.size) {
    if (!wait_for(listener.fd, POLLIN, deadline)) {
      std::string missing;
      for (int r = 1; r < info.size; ++r)
        if (!served[r]) missing += cat(missing.empty() ? "" : ", ", r);
      return comm_failure("rendezvous: rank 0 at ", where(info), " heard from ", count - 1, " of ",
                          info.size - 1, " ranks within ", timeout_ms, " ms; missing: ", missing);
    }
    Socket peer(::accept4(listener.fd, nullptr, nullptr, SOCK_CLOEXEC));
    if (peer.fd < 0) continue;
    Hello hello{};
    // A peer that connects and says nothing is dropped, not waited for past the deadline.
    if (!recv_all(peer.fd, &hello, sizeof hello, deadline) || hello.magic != kMagic) continue;
    Reply reply{kMagic, Verdict::kOk, info.size, bytes};
    if (hello.size != info.size)
      reply.verdict = Verdict::kWrongSize;
    else if (hello.rank <= 0 || hello.rank >= info.size)
      reply.verdict = Verdict::kBadRank;
    else if (served[hello.rank])
      reply.verdict = Verdict::kDuplicate;
    else if (hello.bytes != bytes)
      reply.verdict = Verdict::kWrongBytes;
    if (!send_all(peer.fd, &reply, sizeof reply, deadline)) continue;
    if (reply.verdict != Verdict::kOk) continue;
    if (!send_all(peer.fd, data, static_cast<size_t>(bytes), deadline)) continue;
    served[hello.rank] = true;
    ++count;
  }
  return {};
}

// Ranks > 0: connect to rank 0 (retrying until it listens) and fetch the payload.
Status fetch(const LaunchInfo& info, void* data, int64_t bytes, int timeout_ms) {
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  std::string last_error = "no attempt";
  while (Clock::now() < deadline) {
    addrinfo* ai = nullptr;
    FLARE_RETURN_IF_ERROR(resolve(info, &ai));
    Socket s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                      ai->ai_protocol));
    int rc = s.fd >= 0 ? ::connect(s.fd, ai->ai_addr, ai->ai_addrlen) : -1;
    ::freeaddrinfo(ai);
    if (rc != 0 && errno == EINPROGRESS && wait_for(s.fd, POLLOUT, deadline)) {
      int so_error = 0;
      socklen_t len = sizeof so_error;
      ::getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &so_error, &len);
      rc = so_error == 0 ? 0 : -1;
      errno = so_error;
    }
    if (rc != 0) {
      last_error = std::strerror(errno);
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(50, remaining_ms(deadline))));
      continue;
    }
    const Hello hello{kMagic, info.rank, info.size, bytes};
    Reply reply{};
    if (!send_all(s.fd, &hello, sizeof hello, deadline) ||
        !recv_all(s.fd, &reply, sizeof reply, deadline) || reply.magic != kMagic) {
      last_error = "connection closed during the handshake";
      continue;
    }
    switch (reply.verdict) {
      case Verdict::kOk: break;
      case Verdict::kWrongSize:
        return invalid("rendezvous: rank ", info.rank, " was launched with world size ", info.size,
                       ", rank 0 with ", reply.size);
      case Verdict::kBadRank:
        return invalid("rendezvous: rank ", info.rank, " is not a rank of world size ", info.size);
      case Verdict::kDuplicate:
        return invalid("rendezvous: rank ", info.rank,
                       " has already joined; two processes were launched with the same RANK");
      case Verdict::kWrongBytes:
        return invalid("rendezvous: rank ", info.rank, " expects ", bytes,
                       " bytes, rank 0 shares ", reply.bytes);
    }
    if (!recv_all(s.fd, data, static_cast<size_t>(bytes), deadline)) {
      last_error = "connection closed before the payload";
      continue;
    }
    return {};
  }
  return comm_failure("rendezvous: rank ", info.rank, " could not reach rank 0 at ", where(info),
                      " within ", timeout_ms, " ms (last error: ", last_error, ")");
}

}  // namespace

Status launch_info_from_env(LaunchInfo* info) {
  if (info == nullptr) return invalid("launch_info_from_env: info is null");
  LaunchInfo l;
  bool has_rank = false, has_size = false, has_local = false;
  FLARE_RETURN_IF_ERROR(read_int("RANK", &l.rank, &has_rank));
  FLARE_RETURN_IF_ERROR(read_int("WORLD_SIZE", &l.size, &has_size));
  FLARE_RETURN_IF_ERROR(read_int("LOCAL_RANK", &l.local_rank, &has_local));
  l.source = "torchrun";
  if (!has_rank && !has_size) {
    FLARE_RETURN_IF_ERROR(read_int("OMPI_COMM_WORLD_RANK", &l.rank, &has_rank));
    FLARE_RETURN_IF_ERROR(read_int("OMPI_COMM_WORLD_SIZE", &l.size, &has_size));
    FLARE_RETURN_IF_ERROR(read_int("OMPI_COMM_WORLD_LOCAL_RANK", &l.local_rank, &has_local));
    l.source = "mpirun";
  }
  if (!has_rank || !has_size)
    return invalid("environment: no launch found: set RANK and WORLD_SIZE (torchrun style) or "
                   "run under mpirun (OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE)");
  if (l.size < 1) return invalid("environment: world size ", l.size, " must be >= 1");
  if (l.rank >= l.size)
    return invalid("environment: rank ", l.rank, " must be below the world size ", l.size);
  if (!has_local) l.local_rank = l.rank;  // one node
  if (const char* addr = std::getenv("MASTER_ADDR"); addr != nullptr && *addr != '\0')
    l.master_addr = addr;
  bool has_port = false;
  FLARE_RETURN_IF_ERROR(read_int("MASTER_PORT", &l.master_port, &has_port));
  if (l.master_port < 1 || l.master_port > 65535)
    return invalid("environment: MASTER_PORT ", l.master_port, " is not a TCP port");
  *info = l;
  return {};
}

Status rendezvous_broadcast(const LaunchInfo& info, void* data, int64_t bytes, int timeout_ms) {
  if (info.size < 1 || info.rank < 0 || info.rank >= info.size)
    return invalid("rendezvous: rank ", info.rank, " of world size ", info.size, " is not valid");
  if (info.master_port < 1 || info.master_port > 65535)
    return invalid("rendezvous: master_port ", info.master_port, " is not a TCP port");
  if (bytes < 0 || (bytes > 0 && data == nullptr))
    return invalid("rendezvous: data must hold bytes = ", bytes, " >= 0 bytes");
  if (timeout_ms <= 0) return invalid("rendezvous: timeout_ms must be > 0, got ", timeout_ms);
  if (info.size == 1) return {};
  return info.rank == 0 ? serve(info, data, bytes, timeout_ms)
                        : fetch(info, data, bytes, timeout_ms);
}

}  // namespace flare::dist
