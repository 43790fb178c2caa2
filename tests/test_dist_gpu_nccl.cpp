// test_dist_gpu_nccl.cpp — the NCCL communicator on real GPUs (label gpu): one thread per device
// in this process, every operation checked against host arithmetic, and the failures a launch
// meets: a rank that never joins the creation, a rank that skips an operation. Each test skips,
// saying so, without NCCL in the build or with fewer than two CUDA devices.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "flare/dist.h"
#include "test_dist_gpu_util.h"
#include "test_dist_util.h"

namespace flare::test {
namespace {

using dist::Communicator;
using Clock = std::chrono::steady_clock;

TEST(NcclCommunicator, EveryOperation) {
  FLARE_SKIP_WITHOUT_TWO_GPUS();
  const int n = usable_devices();
  const std::vector<Status> st = run_nccl(n, 60000, [](Communicator& c) -> Status {
    const int r = c.rank(), size = c.size();
    if (c.device() != DeviceType::kCUDA || c.device_index() != r)
      return Status::internal("device");
    cudaStream_t stream;
    cudaStreamCreate(&stream);
    // Ring step.
    DeviceBuffer<int> mine(64), got(64);
    mine.upload(std::vector<int>(64, r));
    const dist::Transfer t[2] = {dist::Transfer::send((r + 1) % size, mine.ptr, 256),
                                 dist::Transfer::recv((r + size - 1) % size, got.ptr, 256)};
    FLARE_RETURN_IF_ERROR(c.exchange(t, 2, stream));
    // all_reduce, all_gather, all_to_all.
    DeviceBuffer<float> x(16);
    x.upload(std::vector<float>(16, static_cast<float>(r + 1)));
    FLARE_RETURN_IF_ERROR(c.all_reduce(x.ptr, x.ptr, 16, DType::kFloat32, dist::ReduceOp::kSum, stream));
    DeviceBuffer<int> gathered(size);
    FLARE_RETURN_IF_ERROR(c.all_gather(mine.ptr, gathered.ptr, 4, stream));
    std::vector<int> a2a_in(size);
    for (int p = 0; p < size; ++p) a2a_in[p] = r * 100 + p;
    DeviceBuffer<int> a2a_send(size), a2a_recv(size);
    a2a_send.upload(a2a_in);
    FLARE_RETURN_IF_ERROR(c.all_to_all(a2a_send.ptr, a2a_recv.ptr, 4, stream));
    FLARE_RETURN_IF_ERROR(c.barrier());
    cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
    for (int v : got.download(64))
      if (v != (r + size - 1) % size) return Status::internal("exchange payload");
    for (float v : x.download(16))
      if (v != size * (size + 1) / 2.0f) return Status::internal("all_reduce");
    const std::vector<int> g = gathered.download(size);
    for (int p = 0; p < size; ++p)
      if (g[p] != p) return Status::internal("all_gather");
    const std::vector<int> a = a2a_recv.download(size);
    for (int p = 0; p < size; ++p)
      if (a[p] != p * 100 + r) return Status::internal("all_to_all");
    // Host agreement.
    std::vector<int> host(size, -1);
    const int me = 7 * r;
    FLARE_RETURN_IF_ERROR(c.host_all_gather(&me, host.data(), 4));
    for (int p = 0; p < size; ++p)
      if (host[p] != 7 * p) return Status::internal("host_all_gather");
    return c.health();
  });
  for (int r = 0; r < n; ++r) EXPECT_TRUE(st[r].ok()) << "rank " << r << ": " << st[r].to_string();
}

// One rank never creates its communicator: the others fail within the timeout.
TEST(NcclCommunicator, RankThatNeverJoins) {
  FLARE_SKIP_WITHOUT_TWO_GPUS();
  const int timeout_ms = 3000;
  const auto t0 = Clock::now();
  const std::vector<Status> st = run_nccl(2, timeout_ms, [](Communicator&) { return Status{}; },
                                          /*absent_rank=*/1);
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  EXPECT_EQ(st[0].code(), StatusCode::kDeviceError) << st[0].to_string();
  EXPECT_TRUE(has(st[0], "did not join within 3000 ms")) << st[0].message();
  EXPECT_LT(ms, timeout_ms + 10000.0);
}

// Rank 1 skips an exchange: rank 0's barrier reports the timeout; the communicator stays failed.
TEST(NcclCommunicator, PeerThatSkipsAnOperation) {
  FLARE_SKIP_WITHOUT_TWO_GPUS();
  const int timeout_ms = 2000;
  const std::vector<Status> st = run_nccl(2, timeout_ms, [&](Communicator& c) -> Status {
    if (c.rank() == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(3 * timeout_ms));
      return {};
    }
    DeviceBuffer<int> buf(4);
    const auto t0 = Clock::now();
    FLARE_RETURN_IF_ERROR(c.recv(1, buf.ptr, 16, nullptr));
    const Status s = c.barrier();
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (s.ok()) return Status::internal("barrier succeeded without the peer");
    if (ms > timeout_ms + 5000.0) return Status::internal("timeout not bounded");
    if (c.health().ok()) return Status::internal("health() forgot the failure");
    return Status(StatusCode::kDeviceError, s.message());
  });
  EXPECT_EQ(st[0].code(), StatusCode::kDeviceError) << st[0].to_string();
  EXPECT_TRUE(has(st[0], "exchange (recv from 1)") && has(st[0], "2000 ms")) << st[0].message();
  EXPECT_TRUE(st[1].ok());
}

}  // namespace
}  // namespace flare::test
