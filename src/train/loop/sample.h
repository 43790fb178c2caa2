// sample.h — a few tokens generated from trained weights, to show what a model learned.
//
// Generation runs the fp32 CPU model (cpu/model.h) on the master weights, one forward pass per
// new token over a window of prompt + tokens positions (causal attention: the logits at position
// p do not depend on the unfilled positions after it, which hold token 0). Each token is the
// argmax of the logits (top_k ≤ 1) or is drawn from the softmax of the top_k logits divided by
// temperature, with uniforms from Philox keyed by (seed, token index), so a seed gives the same
// text every run. Meant for a few dozen tokens: every token costs a full forward.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "flare/status.h"
#include "train/core/model_config.h"

namespace flare::train {

struct SampleOptions {
  int64_t tokens = 32;       // new tokens to generate
  int64_t top_k = 0;         // 0 or 1: greedy; else sample among the k most likely
  double temperature = 1.0;  // > 0; divides the logits before the softmax
  uint64_t seed = 0;
};

// master: parameter_layout(model).total floats. prompt: ≥ 1 token ids in [0, vocab_size);
// prompt + tokens must fit model.max_seq. out: the generated tokens (not the prompt).
Status sample_tokens(const ModelConfig& model, const float* master, std::span<const int32_t> prompt,
                     const SampleOptions& options, std::vector<int32_t>* out);

}  // namespace flare::train
