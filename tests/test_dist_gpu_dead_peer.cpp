// test_dist_gpu_dead_peer.cpp — context-parallel attention over NCCL when a peer stops taking part
// (labels gpu, dist): an error within the communicator's timeout, never a hang. Two ranks, one
// thread per GPU; skips, saying so, without NCCL in the build or with fewer than two CUDA devices.
//
// A binary of its own: after NCCL's abort, work queued behind the aborted transfer runs against a
// freed communicator, which may leave the device unusable for the rest of the process, so nothing
// else shares this process (and each case queues a single transfer: a forward on two ranks).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "flare/dist.h"
#include "test_dist_gpu_util.h"
#include "test_dist_util.h"

namespace flare::test {
namespace {

using dist::Communicator;
using dist::ContextParallelAttention;
using Clock = std::chrono::steady_clock;

// Rank 1 makes its plan, takes part in `peer_calls` forwards and then in no more; rank 0 calls
// once more. Rank 0's call, or its communicator right after its stream drains, reports a device
// error naming the timeout, and its stream drains by itself (NCCL's abort releases the transfers
// waiting for rank 1): an error, never a hang. With peer_calls 0 the first transfer to rank 1 is
// never accepted; with 1 the transfers are accepted and wait on the GPU until the watchdog aborts.
void expect_dead_peer_detected(int peer_calls) {
  SCOPED_TRACE("rank 1 takes part in " + std::to_string(peer_calls) + " forward(s)");
  const int timeout_ms = 3000;
  CpCase c;
  c.world = 2;
  c.dtype = DType::kBFloat16;
  c.seqlen = 256;
  const Problem pr = problem_of(c);
  std::vector<Local> locals = make_locals(c, pr);
  const std::vector<Status> st = run_nccl(2, timeout_ms, [&](Communicator& comm) -> Status {
    std::unique_ptr<ContextParallelAttention> cp;
    FLARE_RETURN_IF_ERROR(ContextParallelAttention::create(&comm, config_of(c), &cp));
    const DeviceLocal d(locals[comm.rank()], comm.device_index());
    cudaStream_t stream = nullptr;
    FLARE_RETURN_IF_ERROR(cuda_ok(cudaStreamCreate(&stream), "cudaStreamCreate"));
    auto forward = [&] {
      return cp->forward(d.at(d.q), d.at(d.k), d.at(d.v), d.at(d.o), d.at(d.lse), stream);
    };
    for (int i = 0; i < peer_calls; ++i) {
      FLARE_RETURN_IF_ERROR(forward());
      FLARE_RETURN_IF_ERROR(cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize"));
    }
    if (comm.rank() == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(3 * timeout_ms));
      return {};
    }
    const auto t0 = Clock::now();
    Status s = forward();
    // The stream must drain by itself: poll it, never block on it.
    const auto give_up = t0 + std::chrono::milliseconds(timeout_ms + 20000);
    cudaError_t q = cudaErrorNotReady;
    while ((q = cudaStreamQuery(stream)) == cudaErrorNotReady && Clock::now() < give_up)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (q == cudaErrorNotReady) return Status::internal("the stream hung past the timeout");
    if (s.ok()) s = comm.health();
    if (s.ok()) return Status::internal("the calls succeeded without the peer");
    if (ms > timeout_ms + 20000.0) return Status::internal("the failure took too long");
    return Status(StatusCode::kDeviceError, s.message());  // what the test expects to see
  });
  EXPECT_EQ(st[0].code(), StatusCode::kDeviceError) << st[0].to_string();
  EXPECT_TRUE(has(st[0], "3000 ms")) << st[0].message();
  EXPECT_TRUE(st[1].ok()) << st[1].to_string();
}

TEST(ContextParallelGpuDeadPeer, BeforeItsFirstCall) {
  FLARE_SKIP_WITHOUT_TWO_GPUS();
  expect_dead_peer_detected(0);
}

TEST(ContextParallelGpuDeadPeer, AfterOneCall) {
  FLARE_SKIP_WITHOUT_TWO_GPUS();
  expect_dead_peer_detected(1);
}

}  // namespace
}  // namespace flare::test
