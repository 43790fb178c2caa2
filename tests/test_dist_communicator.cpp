// test_dist_communicator.cpp — the in-process communicator (every operation, with 1 to 8 ranks,
// and its failures: bad arguments, ranks that disagree, a rank that never joins), the launch
// environment and the TCP rendezvous on the loopback address.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "flare/dist.h"
#include "test_dist_util.h"

namespace flare::test {
namespace {

using dist::Communicator;
using dist::ReduceOp;
using dist::Transfer;
using Clock = std::chrono::steady_clock;

constexpr int kTimeoutMs = 20000;  // generous: a hung test still ends; never reached when correct

class Sizes : public ::testing::TestWithParam<int> {};

// A ring step: each rank sends its vector to the next and receives the previous rank's.
TEST_P(Sizes, ExchangeRing) {
  auto comms = in_process_group(GetParam(), kTimeoutMs);
  auto st = run_ranks(comms, [](Communicator& c) -> Status {
    const int n = c.size(), r = c.rank();
    for (int step = 0; step < 3; ++step) {
      std::vector<int> mine(5 + step, r * 100 + step), got(5 + step, -1);
      const Transfer t[2] = {Transfer::send((r + 1) % n, mine.data(), mine.size() * 4),
                             Transfer::recv((r + n - 1) % n, got.data(), got.size() * 4)};
      FLARE_RETURN_IF_ERROR(c.exchange(t, 2));
      for (int x : got)
        if (x != ((r + n - 1) % n) * 100 + step) return Status::internal("wrong ring payload");
    }
    return {};
  });
  for (const Status& s : st) EXPECT_TRUE(s.ok()) << s.to_string();
}

TEST_P(Sizes, Collectives) {
  auto comms = in_process_group(GetParam(), kTimeoutMs);
  auto st = run_ranks(comms, [](Communicator& c) -> Status {
    const int n = c.size(), r = c.rank();
    // all_reduce in every dtype and op; values exact in each dtype.
    for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kInt32}) {
      const int64_t count = 7;
      std::vector<unsigned char> send(count * dtype_size(dt)), recv(send.size());
      for (int64_t i = 0; i < count; ++i) {
        const int value = static_cast<int>(r + i);
        if (dt == DType::kInt32)
          reinterpret_cast<int32_t*>(send.data())[i] = value;
        else
          store_from_float(send.data(), i, dt, static_cast<float>(value));
      }
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
        FLARE_RETURN_IF_ERROR(c.all_reduce(send.data(), recv.data(), count, dt, op));
        for (int64_t i = 0; i < count; ++i) {
          const double got = dt == DType::kInt32 ? reinterpret_cast<int32_t*>(recv.data())[i]
                                                 : load_as_float(recv.data(), i, dt);
          const double want = op == ReduceOp::kSum   ? n * i + n * (n - 1) / 2.0
                              : op == ReduceOp::kMax ? i + n - 1
                                                     : i;
          if (got != want)
            return Status::internal(std::string("all_reduce ") + dtype_name(dt) + " wrong");
        }
      }
    }
    // In place.
    float x = static_cast<float>(r + 1);
    FLARE_RETURN_IF_ERROR(c.all_reduce(&x, &x, 1, DType::kFloat32, ReduceOp::kSum));
    if (x != n * (n + 1) / 2.0f) return Status::internal("in-place all_reduce wrong");
    // all_gather and host_all_gather: slot p holds rank p's bytes.
    std::vector<int> gathered(2 * n, -1), mine = {r, -r};
    FLARE_RETURN_IF_ERROR(c.all_gather(mine.data(), gathered.data(), 8));
    for (int p = 0; p < n; ++p)
      if (gathered[2 * p] != p || gathered[2 * p + 1] != -p) return Status::internal("all_gather");
    std::fill(gathered.begin(), gathered.end(), -1);
    FLARE_RETURN_IF_ERROR(c.host_all_gather(mine.data(), gathered.data(), 8));
    for (int p = 0; p < n; ++p)
      if (gathered[2 * p] != p) return Status::internal("host_all_gather");
    // all_to_all: slot p of rank r's send, r·100 + p, lands in slot r of rank p's receive.
    std::vector<int> send(n), recv(n, -1);
    for (int p = 0; p < n; ++p) send[p] = r * 100 + p;
    FLARE_RETURN_IF_ERROR(c.all_to_all(send.data(), recv.data(), 4));
    for (int p = 0; p < n; ++p)
      if (recv[p] != p * 100 + r) return Status::internal("all_to_all");
    // Point-to-point wrappers: rank 0 sends each rank its number.
    if (r == 0) {
      for (int p = 1; p < n; ++p) FLARE_RETURN_IF_ERROR(c.send(p, &p, 4));
    } else {
      int got = -1;
      FLARE_RETURN_IF_ERROR(c.recv(0, &got, 4));
      if (got != r) return Status::internal("send/recv");
    }
    FLARE_RETURN_IF_ERROR(c.barrier());
    return c.health();
  });
  for (size_t r = 0; r < st.size(); ++r) EXPECT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].to_string();
}

INSTANTIATE_TEST_SUITE_P(Ranks, Sizes, ::testing::Values(1, 2, 3, 4, 8));

TEST(InProcess, CreationErrors) {
  std::vector<std::unique_ptr<Communicator>> comms;
  Status s = dist::make_in_process_group(0, {}, &comms);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(has(s, "size")) << s.message();
  s = dist::make_in_process_group(2, {0}, &comms);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(has(s, "timeout_ms")) << s.message();
}

TEST(InProcess, BadArgumentsAreRejectedWithoutBreakingTheCommunicator) {
  auto comms = in_process_group(2, kTimeoutMs);
  Communicator& c = *comms[0];
  int x = 0;
  Status s = c.send(2, &x, 4);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(has(s, "peer 2")) << s.message();
  s = c.send(1, nullptr, 4);
  EXPECT_TRUE(has(s, "null")) << s.message();
  s = c.all_reduce(&x, &x, -1, DType::kInt32, ReduceOp::kSum);
  EXPECT_TRUE(has(s, "count")) << s.message();
  s = c.all_reduce(&x, &x, 1, DType::kInt32, static_cast<ReduceOp>(9));
  EXPECT_TRUE(has(s, "op")) << s.message();
  EXPECT_TRUE(c.health().ok());
}

// A peer that never takes part: the operation fails within the timeout, naming the operation and
// the peer, and the communicator stays failed.
TEST(InProcess, MissingPeerTimesOut) {
  const int timeout_ms = 200;
  auto comms = in_process_group(3, timeout_ms);
  Communicator& c = *comms[0];
  int x = 0;
  const auto t0 = Clock::now();
  Status s = c.recv(2, &x, 4);
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  EXPECT_EQ(s.code(), StatusCode::kDeviceError);
  EXPECT_TRUE(has(s, "exchange") && has(s, "rank 2") && has(s, "200 ms")) << s.message();
  EXPECT_GE(ms, timeout_ms * 0.9);
  EXPECT_LT(ms, timeout_ms + 2000.0);
  const Status later = c.barrier();
  EXPECT_EQ(later.message(), s.message());
  EXPECT_EQ(c.health().message(), s.message());
}

// A collective names every rank that has not arrived.
TEST(InProcess, BarrierNamesEveryMissingRank) {
  auto comms = in_process_group(4, 200);
  comms[2]->barrier();  // rank 2 arrives (and then fails waiting for ranks 1 and 3) …
  const Status s = comms[0]->barrier();  // … so rank 0 is missing ranks 1 and 3 only
  EXPECT_EQ(s.code(), StatusCode::kDeviceError);
  EXPECT_TRUE(has(s, "barrier") && has(s, "ranks 1, 3")) << s.message();
}

TEST(InProcess, RanksThatDisagreeAreReported) {
  {  // different operations
    auto comms = in_process_group(2, kTimeoutMs);
    auto st = run_ranks(comms, [](Communicator& c) -> Status {
      if (c.rank() == 0) return c.barrier();
      int x = 1, y[2];
      return c.all_gather(&x, y, 4);
    });
    EXPECT_TRUE(has(st[0], "received rank 1's all_gather")) << st[0].message();
    EXPECT_TRUE(has(st[1], "received rank 0's barrier")) << st[1].message();
  }
  {  // different sizes
    auto comms = in_process_group(2, kTimeoutMs);
    auto st = run_ranks(comms, [](Communicator& c) -> Status {
      std::vector<char> send(c.rank() == 0 ? 8 : 12), recv(16);
      return c.all_gather(send.data(), recv.data(), static_cast<int64_t>(send.size()));
    });
    EXPECT_TRUE(has(st[0], "expects 8 bytes from rank 1, which sent 12")) << st[0].message();
  }
}

// ---- launch environment ----------------------------------------------------------------------

TEST(LaunchInfo, TorchrunMpirunAndErrors) {
  ScopedEnv env;
  clear_launch(env);
  dist::LaunchInfo info;
  Status s = dist::launch_info_from_env(&info);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(has(s, "RANK")) << s.message();

  env.set("RANK", "3");
  env.set("WORLD_SIZE", "4");
  env.set("LOCAL_RANK", "1");
  env.set("MASTER_ADDR", "10.1.2.3");
  env.set("MASTER_PORT", "1234");
  ASSERT_TRUE(dist::launch_info_from_env(&info).ok());
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.size, 4);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.master_addr, "10.1.2.3");
  EXPECT_EQ(info.master_port, 1234);
  EXPECT_EQ(info.source, "torchrun");

  env.set("RANK", "4");
  s = dist::launch_info_from_env(&info);
  EXPECT_TRUE(has(s, "rank 4 must be below the world size 4")) << s.message();
  env.set("RANK", "x1");
  s = dist::launch_info_from_env(&info);
  EXPECT_TRUE(has(s, "RANK=\"x1\"")) << s.message();

  clear_launch(env);
  env.set("OMPI_COMM_WORLD_RANK", "2");
  env.set("OMPI_COMM_WORLD_SIZE", "8");
  env.set("OMPI_COMM_WORLD_LOCAL_RANK", "2");
  ASSERT_TRUE(dist::launch_info_from_env(&info).ok());
  EXPECT_EQ(info.rank, 2);
  EXPECT_EQ(info.size, 8);
  EXPECT_EQ(info.local_rank, 2);
  EXPECT_EQ(info.master_addr, "127.0.0.1");
  EXPECT_EQ(info.master_port, 29500);
  EXPECT_EQ(info.source, "mpirun");
}

// ---- rendezvous over the loopback address ----------------------------------------------------

// A port that was free a moment ago (the kernel's pick for port 0).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

dist::LaunchInfo loopback(int rank, int size, int port) {
  dist::LaunchInfo info;
  info.rank = rank;
  info.size = size;
  info.master_port = port;
  return info;
}

TEST(Rendezvous, BroadcastsRankZerosBytes) {
  const int n = 4, port = free_port();
  std::vector<std::array<unsigned char, 128>> ids(n);
  for (int r = 0; r < n; ++r) ids[r].fill(static_cast<unsigned char>(r == 0 ? 0 : 0xee));
  for (int i = 0; i < 128; ++i) ids[0][i] = static_cast<unsigned char>(i * 7);
  std::vector<Status> st(n);
  std::vector<std::thread> threads;
  // Ranks start before rank 0 listens: they retry.
  for (int r = n - 1; r >= 0; --r)
    threads.emplace_back([&, r] {
      st[r] = dist::rendezvous_broadcast(loopback(r, n, port), ids[r].data(), 128, 10000);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    EXPECT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].to_string();
    EXPECT_EQ(ids[r], ids[0]) << "rank " << r;
  }
}

TEST(Rendezvous, MissingRankIsNamedWithinTheTimeout) {
  const int port = free_port();
  std::array<unsigned char, 16> id{};
  std::vector<Status> st(3);
  const auto t0 = Clock::now();
  std::thread root([&] { st[0] = dist::rendezvous_broadcast(loopback(0, 3, port), id.data(), 16, 500); });
  std::thread one([&] { st[1] = dist::rendezvous_broadcast(loopback(1, 3, port), id.data(), 16, 500); });
  root.join();
  one.join();
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  EXPECT_TRUE(st[1].ok()) << st[1].to_string();
  EXPECT_EQ(st[0].code(), StatusCode::kDeviceError);
  EXPECT_TRUE(has(st[0], "heard from 1 of 2") && has(st[0], "missing: 2")) << st[0].message();
  EXPECT_LT(ms, 3000.0);
}

TEST(Rendezvous, NoRootAndDisagreementsAreErrors) {
  const int port = free_port();
  std::array<unsigned char, 16> id{};
  Status s = dist::rendezvous_broadcast(loopback(1, 2, port), id.data(), 16, 300);
  EXPECT_EQ(s.code(), StatusCode::kDeviceError);
  EXPECT_TRUE(has(s, "could not reach rank 0")) << s.message();

  std::vector<Status> st(2);
  std::thread root([&] { st[0] = dist::rendezvous_broadcast(loopback(0, 2, port), id.data(), 16, 600); });
  std::thread other([&] { st[1] = dist::rendezvous_broadcast(loopback(1, 3, port), id.data(), 16, 600); });
  root.join();
  other.join();
  EXPECT_TRUE(has(st[1], "world size 3, rank 0 with 2")) << st[1].message();
  EXPECT_FALSE(st[0].ok());
}

TEST(Nccl, UnavailableBuildsSaySo) {
  if (dist::nccl_built()) GTEST_SKIP() << "this build has NCCL; tests/test_dist_gpu_nccl.cpp covers it";
  dist::NcclId id;
  const Status s = dist::nccl_unique_id(&id);
  EXPECT_EQ(s.code(), StatusCode::kUnsupported);
  EXPECT_TRUE(has(s, "NCCL")) << s.message();
}

}  // namespace
}  // namespace flare::test
