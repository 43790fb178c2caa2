// decode_fp16.cu — the CUDA KV-cache decoding kernels for kFloat16 tensors (decode_launch.cuh).
#include "cuda/decode/decode_launch.cuh"

namespace flare::cuda::decode {
template Status launch<DType::kFloat16>(const DecodeParams& p, cudaStream_t stream);
}  // namespace flare::cuda::decode
