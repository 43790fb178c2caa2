// cuda_stub.cpp — the CUDA entry points of a build without CUDA: every call on CUDA tensors is
// answered kUnsupported with a message saying how to get the kernels.
#include "core/backends.h"

namespace flare {
namespace cuda {

Status forward(const AttentionParams&, Stream) {
  return Status::unsupported("q: CUDA tensors need a flare build with CUDA (configure with "
                             "-DFLARE_CUDA=ON on a machine with nvcc)");
}

Status backward(const AttentionParams& p, Stream s) { return forward(p, s); }

Status kvcache_forward(const DecodeParams&, int, Stream) {
  return Status::unsupported("q: CUDA tensors need a flare build with CUDA (configure with "
                             "-DFLARE_CUDA=ON on a machine with nvcc)");
}

}  // namespace cuda

bool cuda_built() { return false; }

}  // namespace flare
