// sample.cpp — greedy and top-k generation on the CPU model (see sample.h).
#include "train/loop/sample.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/message.h"
#include "core/philox.h"
#include "train/cpu/model.h"

namespace flare::train {
namespace {

// A uniform in [0, 1) for generated token `index`.
double uniform(uint64_t seed, int64_t index) {
  const Philox4 ctr = {static_cast<uint32_t>(index), static_cast<uint32_t>(index >> 32), 0x5a4du, 0u};
  const Philox4 r = philox4x32_10(ctr, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return static_cast<double>((uint64_t{r.x} << 21) ^ r.y) / 9007199254740992.0;
}

// The next token from one row of logits (vocab_size entries).
int32_t choose(const float* logits, int64_t vocab, const SampleOptions& o, int64_t index) {
  if (o.top_k <= 1) return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  const int64_t k = std::min(o.top_k, vocab);
  std::vector<int32_t> ids(static_cast<size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  // Ties keep the lower id first so the choice does not depend on the sort's implementation.
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  });
  std::vector<double> p(static_cast<size_t>(k));
  const double top = logits[ids[0]];
  double total = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    p[static_cast<size_t>(i)] = std::exp((logits[ids[static_cast<size_t>(i)]] - top) / o.temperature);
    total += p[static_cast<size_t>(i)];
  }
  double u = uniform(o.seed, index) * total;
  for (int64_t i = 0; i < k; ++i) {
    u -= p[static_cast<size_t>(i)];
    if (u < 0) return ids[static_cast<size_t>(i)];
  }
  return ids[static_cast<size_t>(k - 1)];
}

}  // namespace

Status sample_tokens(const ModelConfig& model, const float* master, std::span<const int32_t> prompt,
                     const SampleOptions& options, std::vector<int32_t>* out) {
  FLARE_RETURN_IF_ERROR(validate_model_config(model));
  if (prompt.empty()) return invalid("prompt: must hold at least one token");
  if (options.tokens < 1) return invalid("tokens: ", options.tokens, " must be >= 1");
  if (options.top_k < 0) return invalid("top_k: ", options.top_k, " must be >= 0 (0: greedy)");
  if (!std::isfinite(options.temperature) || options.temperature <= 0) {
    return invalid("temperature: ", options.temperature, " must be finite and > 0");
  }
  const int64_t window = static_cast<int64_t>(prompt.size()) + options.tokens;
  if (window > model.max_seq) {
    return invalid("tokens: prompt ", prompt.size(), " + ", options.tokens, " tokens exceed max_seq = ",
                   model.max_seq);
  }
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= model.vocab_size) {
      return invalid("prompt: token ", i, " = ", prompt[i], " is outside [0, vocab_size = ",
                     model.vocab_size, ")");
    }
  }
  std::unique_ptr<cpu::CpuModel> m;
  FLARE_RETURN_IF_ERROR(cpu::CpuModel::create(model, 1, window, &m));
  std::vector<int32_t> tokens(static_cast<size_t>(window), 0);
  std::copy(prompt.begin(), prompt.end(), tokens.begin());
  out->clear();
  for (int64_t i = 0; i < options.tokens; ++i) {
    const int64_t last = static_cast<int64_t>(prompt.size()) + i - 1;  // predicts position last + 1
    FLARE_RETURN_IF_ERROR(m->forward(master, tokens.data(), nullptr, nullptr));
    const float* row = m->logits().data() + last * model.padded_vocab;
    const int32_t next = choose(row, model.vocab_size, options, i);
    tokens[static_cast<size_t>(last + 1)] = next;
    out->push_back(next);
  }
  return Status::ok_status();
}

}  // namespace flare::train
