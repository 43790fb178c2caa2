// decode.cpp — cuda::kvcache_forward (core/backends.h): the split count, the split-KV workspace
// and the launch, on the tensors' device and the caller's stream.
#include <algorithm>
#include <string>

#include "core/backends.h"
#include "cuda/decode/decode_launch.h"
#include "cuda/device_probe.h"

namespace flare::cuda {
namespace {

// Splits of the key range. A call's CTAs are (sequence · kv head) × row tiles; decoding has few
// of them (b 1, 8 kv heads, one query row: 8 CTAs for 132 SMs), so the keys are split until every
// SM holds as many CTAs as fit, each split keeping 8+ key blocks (two per warp) of the largest
// length the cache can hold. The caller's num_splits, when given, wins (at most kMaxSplits).
int split_count(const DecodeParams& p, int sms) {
  using namespace decode;
  const int bucket = head_dim_bucket(p.head_dim);
  const int64_t row_tiles = (static_cast<int64_t>(p.seqlen_q) * p.group + kRowsPerTile - 1) / kRowsPerTile;
  const int64_t ctas = std::max<int64_t>(1, static_cast<int64_t>(p.batch) * p.heads_kv * row_tiles);
  if (p.num_splits > 0) return std::min(p.num_splits, kMaxSplits);
  const int64_t blocks = (p.capacity + keys_per_block(bucket) - 1) / keys_per_block(bucket);
  const int64_t want = (static_cast<int64_t>(ctas_per_sm(bucket)) * sms + ctas - 1) / ctas;
  return static_cast<int>(std::clamp<int64_t>(std::min(want, blocks / 8), 1, kMaxSplits));
}

}  // namespace

Status kvcache_forward(const DecodeParams& params, int device_index, Stream stream) {
  if (params.dtype != DType::kFloat16 && params.dtype != DType::kBFloat16)
    return Status::unsupported(
        std::string("q: KV-cache decoding on CUDA takes float16 or bfloat16 tensors, got ") +
        dtype_name(params.dtype) + "; convert them, or use CPU tensors");
  if (decode::head_dim_bucket(params.head_dim) == 0)
    return Status::unsupported("q: head_dim " + std::to_string(params.head_dim) +
                               " exceeds 256, the largest the CUDA decoding kernels take");
  const auto s = static_cast<cudaStream_t>(stream);
  return on_device(device_index, [&]() -> Status {
    DeviceFacts device;
    FLARE_RETURN_IF_ERROR(current_device_facts(&device));
    DecodeParams p = params;
    p.num_splits = split_count(p, device.sms);
    const int64_t row_tiles = (static_cast<int64_t>(p.seqlen_q) * p.group + decode::kRowsPerTile - 1) /
                              decode::kRowsPerTile;
    if (p.batch > 65535)
      return Status::unsupported("q: batch = " + std::to_string(p.batch) +
                                 " exceeds the decoding grid's 65535 sequences; split the call");
    if (row_tiles > 65535 || static_cast<int64_t>(p.batch) * p.heads_kv > INT32_MAX)
      return Status::unsupported("q: seqlen_q * heads_q / heads_kv = " +
                                 std::to_string(static_cast<int64_t>(p.seqlen_q) * p.group) +
                                 " query rows per kv head exceed the decoding grid (65535 tiles of " +
                                 std::to_string(decode::kRowsPerTile) + "); use attention_forward");
    const int64_t rows = static_cast<int64_t>(p.batch) * p.heads_q * p.seqlen_q;
    void* scratch = nullptr;
    if (p.num_splits > 1 && rows > 0) {
      const size_t bytes = static_cast<size_t>(p.num_splits * rows) * (p.head_dim + 1) * sizeof(float);
      FLARE_RETURN_IF_ERROR(cuda_status(decode::kErrorContext,
                                        "cudaMallocAsync of the split workspace",
                                        cudaMallocAsync(&scratch, bytes, s)));
      p.partial_o = static_cast<float*>(scratch);
      p.partial_lse = p.partial_o + p.num_splits * rows * p.head_dim;
    }
    Status status = p.dtype == DType::kFloat16 ? decode::launch<DType::kFloat16>(p, s)
                                               : decode::launch<DType::kBFloat16>(p, s);
    if (scratch != nullptr) {
      const Status freed =
          cuda_status(decode::kErrorContext, "cudaFreeAsync", cudaFreeAsync(scratch, s));
      if (status.ok()) status = freed;
    }
    return status;
  });
}

}  // namespace flare::cuda
