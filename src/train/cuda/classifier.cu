// classifier.cu — fused softmax / cross-entropy / dlogits (classifier.h).
//
// One block of 512 threads per row. Pass 1: each thread keeps a running (max, Σexp) over its
// 8-value packs; the block merges the pairs in a fixed order (warp butterfly, then warp 0 over the
// warps), so lse has the same bits every run. The target's logit is read before the block's
// barrier, i.e. before any thread overwrites the row. Pass 2 re-reads the row and stores dlogits.
#include "train/cuda/classifier.h"

#include <climits>

#include "core/message.h"
#include "train/cuda/device.cuh"

namespace flare::train::cuda {
namespace {

constexpr int kThreads = 512;

struct ClassifierParams {
  bf16* logits;            // (rows, padded_vocab): logits in, dlogits out
  const int32_t* targets;  // (rows)
  float* losses;           // (rows) or null
  int64_t rows, vocab, padded_vocab;
  float dloss_scale;
  const float* dloss_scale_device;  // multiplies dloss_scale, or null
  bool write_dlogits;
};

// (m, s) represents Σ exp(x − m) = s; merging two keeps the larger max.
struct MaxSum {
  float m, s;
};
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

template <int kVec>
__global__ void __launch_bounds__(kThreads) classifier_kernel(const ClassifierParams p) {
  __shared__ MaxSum warp_parts[kThreads / 32];
  __shared__ float row_lse;
  const int64_t row = blockIdx.x;
  bf16* x = p.logits + row * p.padded_vocab;
  const int32_t target = p.targets[row];
  const bool ignored = target == -1;
  const bool bad = !ignored && (target < 0 || target >= p.vocab);

  float lse = 0.0f;
  if (!ignored) {
    MaxSum acc{-INFINITY, 0.0f};
    for (int64_t c = threadIdx.x * kVec; c < p.vocab; c += kThreads * kVec) {
      float v[kVec];
      load_floats<kVec>(x + c, v);
      float m = -INFINITY;
#pragma unroll
      for (int i = 0; i < kVec; ++i)
        if (c + i < p.vocab) m = fmaxf(m, v[i]);
      MaxSum part{m, 0.0f};
#pragma unroll
      for (int i = 0; i < kVec; ++i)
        if (c + i < p.vocab) part.s += expf(v[i] - m);
      acc = merge(acc, part);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      const MaxSum other{__shfl_xor_sync(0xffffffffu, acc.m, offset),
                         __shfl_xor_sync(0xffffffffu, acc.s, offset)};
      acc = merge(acc, other);
    }
    if (threadIdx.x % 32 == 0) warp_parts[threadIdx.x / 32] = acc;
    float target_logit = 0.0f;
    if (threadIdx.x == 0 && !bad) target_logit = __bfloat162float(x[target]);
    __syncthreads();
    if (threadIdx.x == 0) {
      MaxSum total = warp_parts[0];
      for (int w = 1; w < kThreads / 32; ++w) total = merge(total, warp_parts[w]);
      row_lse = total.m + logf(total.s);
      if (p.losses) p.losses[row] = bad ? __int_as_float(0x7fc00000) : row_lse - target_logit;
    }
    __syncthreads();
    lse = row_lse;
  } else if (threadIdx.x == 0 && p.losses) {
    p.losses[row] = 0.0f;
  }
  if (!p.write_dlogits) return;

  const float scale = p.dloss_scale_device ? p.dloss_scale * *p.dloss_scale_device : p.dloss_scale;
  for (int64_t c = threadIdx.x * kVec; c < p.padded_vocab; c += kThreads * kVec) {
    float v[kVec];
    load_floats<kVec>(x + c, v);
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const int64_t j = c + i;
      float d = 0.0f;
      if (bad) {
        d = __int_as_float(0x7fc00000);
      } else if (!ignored && j < p.vocab) {
        d = (expf(v[i] - lse) - (j == target ? 1.0f : 0.0f)) * scale;
      }
      v[i] = d;
    }
    store_floats<kVec>(x + c, v);
  }
}

}  // namespace

Status classifier_forward_backward(bf16* logits, const int32_t* targets, float* losses,
                                   int64_t rows, int64_t vocab_size, int64_t padded_vocab,
                                   float dloss_scale, bool write_dlogits, cudaStream_t stream,
                                   const float* dloss_scale_device) {
  const char* op = "classifier_forward_backward";
  if (rows < 1 || rows > INT_MAX) return invalid(op, ": rows = ", rows, " must be in [1, 2^31)");
  if (vocab_size < 1 || vocab_size > padded_vocab)
    return invalid(op, ": vocab_size = ", vocab_size, " must be in [1, padded_vocab = ", padded_vocab, "]");
  if (padded_vocab > INT_MAX) return invalid(op, ": padded_vocab = ", padded_vocab, " must be < 2^31");
  if (!(dloss_scale == dloss_scale) || dloss_scale == INFINITY || dloss_scale == -INFINITY)
    return invalid(op, ": dloss_scale = ", dloss_scale, " must be finite");
  if (logits == nullptr || targets == nullptr) return invalid(op, ": logits and targets must not be null");
  const ClassifierParams p{logits, targets, losses, rows, vocab_size, padded_vocab, dloss_scale,
                           dloss_scale_device, write_dlogits};
  if (padded_vocab % 8 == 0 && aligned16(logits))
    classifier_kernel<8><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(p);
  else
    classifier_kernel<1><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(p);
  return launch_status(kCudaContext, op);
}

}  // namespace flare::train::cuda
