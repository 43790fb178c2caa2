// classifier.h — softmax + cross-entropy over the vocabulary, fused with its gradient, written in
// place over the logits.
//
// Why in place: at GPT-3 2.7B's shapes the logits are tokens 4096 × padded_vocab 50304; an fp32
// copy of them would be 824 MB, the bf16 logits are 412 MB. The kernel reads each row twice
// (the second read mostly from L2) and overwrites it with dlogits, so no (tokens × vocab) fp32
// tensor ever exists and the output head's backward matmul reads dlogits where the logits were.
//
// Per row, in fp32: lse = log Σ_{j < vocab_size} exp(logit_j) (online max, then one rescale per
// 8 values), loss = lse − logit[target], and
//   dlogit_j = (exp(logit_j − lse) − [j = target]) · dloss_scale  for j < vocab_size,
//   dlogit_j = 0                                                  on padding columns.
// dloss_scale is d(mean loss)/d(row loss): 1 / (valid targets of the whole optimizer step, over
// every micro-batch), a value the host knows from the targets it loaded; under data parallelism
// the count is every rank's, which the ranks agree on on the device, so the factor can also come
// from device memory (dloss_scale_device, multiplied into dloss_scale: pass 1 and the factor to
// get the factor's bits exactly). A target of −1 is
// ignored: loss 0 and a zero row (torch's ignore_index). A target outside [0, vocab_size) and not
// −1 gives a NaN loss and a NaN row (the host cannot be told without a wait; the CPU reference
// rejects it with a Status).
#pragma once

#include <cstdint>

#include "train/cuda/common.h"

namespace flare::train::cuda {

// logits (rows, padded_vocab) bf16: read, and with write_dlogits overwritten by dlogits (bf16);
// targets (rows) int32; losses (rows) fp32 written, or null; dloss_scale_device (1 fp32) or null.
Status classifier_forward_backward(bf16* logits, const int32_t* targets, float* losses,
                                   int64_t rows, int64_t vocab_size, int64_t padded_vocab,
                                   float dloss_scale, bool write_dlogits, cudaStream_t stream,
                                   const float* dloss_scale_device = nullptr);

}  // namespace flare::train::cuda
