// host_ops.cpp — CpOps on host memory (the in-process communicator): plain loops that complete
// before they return, so there is nothing to order between streams and the waits are no-ops.
#include <algorithm>
#include <cstring>
#include <vector>

#include "core/numeric.h"
#include "dist/cp_ops.h"
#include "dist/layout.h"
#include "dist/merge.h"

namespace flare::dist {
namespace {

class HostOps final : public CpOps {
 public:
  explicit HostOps(int64_t workspace_bytes)
      : workspace_(static_cast<size_t>(std::max<int64_t>(workspace_bytes, 1))) {}

  Status begin(Stream) override {
    ++timing_.calls;
    return {};
  }
  void end() override {}
  unsigned char* workspace() override { return workspace_.data(); }
  Status upload(int64_t offset, const void* host, int64_t bytes) override {
    if (bytes > 0) std::memcpy(workspace_.data() + offset, host, static_cast<size_t>(bytes));
    return {};
  }

  Status fill(float* data, int64_t count, float value) override {
    std::fill(data, data + count, value);
    return {};
  }

  Status merge_block(const MergeArgs& a) override {
    for (int64_t b = 0; b < a.batch; ++b)
      for (int64_t h = 0; h < a.heads; ++h)
        for (int64_t i = 0; i < a.q_len; ++i) {
          float& lse = a.lse_acc[(b * a.heads + h) * a.s_local + a.q_begin + i];
          const MergeWeights w = merge_weights(lse, a.lse_blk[(b * a.heads + h) * a.q_len + i]);
          lse = w.lse;
          float* acc = a.o_acc + ((b * a.s_local + a.q_begin + i) * a.heads + h) * a.head_dim;
          const int64_t blk = ((b * a.q_len + i) * a.heads + h) * a.head_dim;
          for (int64_t c = 0; c < a.head_dim; ++c)
            acc[c] = w.a * acc[c] + w.b * load_as_float(a.o_blk, blk + c, a.dtype);
        }
    return {};
  }

  Status accumulate_rows(float* acc, int64_t len, int64_t row0, const void* blk, int64_t rows,
                         int64_t batch, int64_t hd, DType dtype) override {
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < rows; ++i) {
        float* dst = acc + (b * len + row0 + i) * hd;
        const int64_t src = (b * rows + i) * hd;
        for (int64_t c = 0; c < hd; ++c) dst[c] += load_as_float(blk, src + c, dtype);
      }
    return {};
  }

  Status store_rows(const float* acc, const TensorView& out) override {
    const int64_t s = out.shape[1], h = out.shape[2], d = out.shape[3];
    for (int64_t b = 0; b < out.shape[0]; ++b)
      for (int64_t i = 0; i < s; ++i)
        for (int64_t j = 0; j < h; ++j)
          for (int64_t c = 0; c < d; ++c)
            store_from_float(out.data,
                             b * out.stride[0] + i * out.stride[1] + j * out.stride[2] + c,
                             out.dtype, acc[((b * s + i) * h + j) * d + c]);
    return {};
  }

  Status copy_rows(const TensorView& src, int64_t src_row, const TensorView& dst, int64_t dst_row,
                   int64_t rows, int seq_dim) override {
    dist::copy_rows(src, src_row, dst, dst_row, rows, seq_dim);
    return {};
  }

  Stream compute_stream() override { return nullptr; }
  Stream comm_stream() override { return nullptr; }
  Status comm_waits_compute() override { return {}; }
  Status compute_waits_comm() override { return {}; }
  Status comm_started(int64_t bytes_sent) override {
    timing_.bytes_sent += bytes_sent;
    ++timing_.exchanges;
    return {};
  }
  Status comm_finished() override { return {}; }

  Status set_timing(bool) override { return {}; }
  Status take_timing(CpTiming* out) override {
    *out = timing_;
    timing_ = {};
    return {};
  }

 private:
  std::vector<unsigned char> workspace_;
  CpTiming timing_;
};

}  // namespace

std::unique_ptr<CpOps> make_host_ops(int64_t workspace_bytes) {
  return std::make_unique<HostOps>(workspace_bytes);
}

}  // namespace flare::dist
