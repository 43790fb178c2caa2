// decode.cpp — cuda::kvcache_forward (core/backends.h): the split count (decode_grid.h), the
// split-KV workspace and the launch, on the tensors' device and the caller's stream.
#include <string>

#include "core/backends.h"
#include "cuda/decode/decode_launch.h"
#include "cuda/device_probe.h"

namespace flare::cuda {

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
    p.num_splits = decode::split_count(p, device.sms);
    const int64_t tiles = decode::row_tiles(p);
    if (p.batch > 65535)
      return Status::unsupported("q: batch = " + std::to_string(p.batch) +
                                 " exceeds the decoding grid's 65535 sequences; split the call");
    if (tiles > 65535 || static_cast<int64_t>(p.batch) * p.heads_kv > INT32_MAX)
      return Status::unsupported(
          "q: seqlen_q * heads_q / heads_kv = " +
          std::to_string(static_cast<int64_t>(p.seqlen_q) * p.group) +
          " query rows per kv head exceed the decoding grid (65535 tiles of " +
          std::to_string(decode::kRowsPerTile) + "); use attention_forward");
    const int64_t rows = static_cast<int64_t>(p.batch) * p.heads_q * p.seqlen_q;
    void* scratch = nullptr;
    if (p.num_splits > 1 && rows > 0) {
      const size_t bytes =
          static_cast<size_t>(p.num_splits * rows) * (p.head_dim + 1) * sizeof(float);
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
