// cp_ops.h — where the strategies' own work runs: the memory it uses, the element-wise passes
// around the block calls, and the ordering of communication against computation.
//
// The strategies (ring_attention.cpp, all_to_all_attention.cpp) are written once. What differs
// between host memory and a CUDA device is behind CpOps:
//   - the workspace, one allocation made at ContextParallelAttention::create and sized from the
//     plan (CpWorkspace says where each buffer sits in it);
//   - the element-wise passes: fill, the (O, LSE) merge (merge.h's merge_weights per row), the fp32
//     accumulation of block gradients, the final rounding into the outputs, strided row copies;
//   - two streams and their ordering. Computation (block calls and the passes above) runs on the
//     caller's stream; exchanges are issued on comm_stream(). comm_waits_compute() and
//     compute_waits_comm() order one after the work issued so far on the other (CUDA events; no
//     host waits). On the host everything completes when issued, and both are no-ops.
// Timing (set_timing): with it on, the device records timed events around every exchange and every
// span of computation between waits, read back by take_timing().
#pragma once

#include <cstdint>
#include <memory>

#include "flare/dist.h"

namespace flare::dist {

struct CpContext;

// Element offsets of one call to merge_block: local query rows [q_begin, q_begin + q_len) of the
// fp32 accumulators (b, s_local, h, d) and (b, h, s_local), merged with a dense block result
// (b, q_len, h, d) in `dtype` and its fp32 LSE (b, h, q_len).
struct MergeArgs {
  float* o_acc;
  float* lse_acc;
  const void* o_blk;
  const float* lse_blk;
  int64_t batch, heads, head_dim, s_local, q_begin, q_len;
  DType dtype;
};

class CpOps {
 public:
  virtual ~CpOps() = default;

  // Start of a forward or backward: makes the communicator's device current (restored by end())
  // and takes `compute` as the stream of the computation.
  virtual Status begin(Stream compute) = 0;
  virtual void end() = 0;

  virtual unsigned char* workspace() = 0;
  // Copies `bytes` of host memory into the workspace at `offset` and waits for the copy (on the
  // plan's own stream: nothing else on the device waits). At create only: the plan's constant
  // tables (a packed plan's per-call cu_seqlens).
  virtual Status upload(int64_t offset, const void* host, int64_t bytes) = 0;

  // ---- computation, on the caller's stream ----
  virtual Status fill(float* data, int64_t count, float value) = 0;
  virtual Status merge_block(const MergeArgs& a) = 0;
  // acc rows [row0, row0 + rows) of a dense fp32 (b, len, hd) += a dense dtype (b, rows, hd).
  virtual Status accumulate_rows(float* acc, int64_t len, int64_t row0, const void* blk,
                                 int64_t rows, int64_t batch, int64_t hd, DType dtype) = 0;
  // A dense fp32 (b, s, h, d) into a (b, s, h, d) view of any strides, rounded to its dtype.
  virtual Status store_rows(const float* acc, const TensorView& out) = 0;
  // `rows` rows along seq_dim from src (from src_row) to dst (from dst_row); one dtype, any strides.
  virtual Status copy_rows(const TensorView& src, int64_t src_row, const TensorView& dst,
                           int64_t dst_row, int64_t rows, int seq_dim) = 0;

  // ---- ordering ----
  virtual Stream compute_stream() = 0;
  virtual Stream comm_stream() = 0;
  virtual Status comm_waits_compute() = 0;
  virtual Status compute_waits_comm() = 0;
  // Brackets one exchange on comm_stream() (timing only).
  virtual Status comm_started(int64_t bytes_sent) = 0;
  virtual Status comm_finished() = 0;

  // ---- timing ----
  virtual Status set_timing(bool on) = 0;
  virtual Status take_timing(CpTiming* out) = 0;
};

// begin() … end() around one forward or backward.
class OpsScope {
 public:
  OpsScope(CpOps& ops, Stream compute) : ops_(ops), status_(ops.begin(compute)) {}
  ~OpsScope() { ops_.end(); }
  OpsScope(const OpsScope&) = delete;
  OpsScope& operator=(const OpsScope&) = delete;
  const Status& status() const { return status_; }

 private:
  CpOps& ops_;
  Status status_;
};

// Host memory: every pass completes before it returns.
std::unique_ptr<CpOps> make_host_ops(int64_t workspace_bytes);
// The communicator's CUDA device (device_ops.cu; kUnsupported in builds without CUDA):
// allocates the workspace and the communication stream.
Status make_device_ops(int device_index, int64_t workspace_bytes, std::unique_ptr<CpOps>* out);

}  // namespace flare::dist
