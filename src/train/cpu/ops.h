// ops.h — the operators of the GPT and LLaMA models on the CPU, forward and backward.
//
// These are the ground truth of the training library: the CPU model (model.h) is built from them,
// and the CUDA kernels are tested against them. Every function works on plain row-major buffers
// given by pointer and sizes; N is the number of rows (tokens, N = B·T), C the row width.
//
// Conventions, the same for every function:
//   - Arguments come in the order inputs, outputs, sizes (as in flare's attention API).
//   - Forward outputs are written (=).
//   - Parameter gradients (dweight, dbias, embedding tables) are accumulated (+=): the model zeroes
//     its flat gradient buffer once per step, micro-batches add into it, and a tied embedding
//     receives both the embedding's and the output head's share.
//   - Activation gradients are written (=), with one exception said at each function: the norms'
//     dx is accumulated (+=), because a norm's input is always the residual stream, whose gradient
//     already holds the skip connection's share.
//   - Elementwise functions allow their output to alias their input (in place).
//   - Each function is a template over the scalar, instantiated for float (what the models run)
//     and double (what the finite-difference tests run); the arithmetic is the same for both.
//   - Loops are parallel over rows (OpenMP) and vectorised along the row; the parallel split never
//     changes which values are summed in which order, so results do not depend on the thread
//     count.
// Only the classifier and the embedding read integer data that can be out of range; they return
// a Status and write nothing when a token or target is invalid. The rest cannot fail.
#pragma once

#include <cstdint>
#include <type_traits>

#include "flare/status.h"
#include "train/core/model_config.h"

namespace flare::train::cpu {

// A pointer argument that may be nullptr. It takes no part in deducing T, so a literal nullptr
// can be passed without naming the scalar type.
template <typename T>
using Nullable = std::type_identity_t<T>*;

// ---- Linear layer: y = x · Wᵀ + b ---------------------------------------------------------------

// x (N, in), weight (out, in), bias (out) or nullptr; y (N, out) written.
template <typename T>
void matmul_forward(const T* x, const T* weight, Nullable<const T> bias, T* y, int64_t N,
                    int64_t in, int64_t out);

// dy (N, out), x (N, in), weight (out, in).
// dx (N, in) written (= dy · W); may be nullptr when the input needs no gradient.
// dweight (out, in) accumulated (+= dyᵀ · x); dbias (out) accumulated (+= Σ_n dy), or nullptr.
template <typename T>
void matmul_backward(const T* dy, const T* x, const T* weight, Nullable<T> dx, T* dweight,
                     Nullable<T> dbias, int64_t N, int64_t in, int64_t out);

// ---- LayerNorm (GPT): y = (x − mean) · rstd · weight + bias, rstd = 1 / sqrt(var + eps) --------

// x (N, C), weight (C), bias (C); y (N, C), mean (N), rstd (N) written (mean and rstd are saved for
// the backward). var is the biased variance (divide by C), as torch.nn.LayerNorm.
template <typename T>
void layernorm_forward(const T* x, const T* weight, const T* bias, T* y, T* mean, T* rstd,
                       int64_t N, int64_t C, double eps);

// dy (N, C), x (N, C), weight (C), mean and rstd (N) from the forward.
// dx (N, C) accumulated (+=); dweight (C), dbias (C) accumulated (+=).
template <typename T>
void layernorm_backward(const T* dy, const T* x, const T* weight, const T* mean, const T* rstd,
                        T* dx, T* dweight, T* dbias, int64_t N, int64_t C);

// ---- RMSNorm (LLaMA): y = x · rstd · weight, rstd = 1 / sqrt(mean(x²) + eps) --------------------

// x (N, C), weight (C); y (N, C), rstd (N) written.
template <typename T>
void rmsnorm_forward(const T* x, const T* weight, T* y, T* rstd, int64_t N, int64_t C, double eps);

// dy (N, C), x (N, C), weight (C), rstd (N) from the forward.
// dx (N, C) accumulated (+=); dweight (C) accumulated (+=).
template <typename T>
void rmsnorm_backward(const T* dy, const T* x, const T* weight, const T* rstd, T* dx, T* dweight,
                      int64_t N, int64_t C);

// ---- GELU, tanh approximation (GPT MLP) ---------------------------------------------------------
// y = 0.5 · x · (1 + tanh(sqrt(2/π) · (x + 0.044715 · x³))), as torch's gelu(approximate="tanh").

// x (n), y (n) written; y may alias x.
template <typename T>
void gelu_forward(const T* x, T* y, int64_t n);

// dy (n), x (n) the forward's input; dx (n) written; dx may alias dy.
template <typename T>
void gelu_backward(const T* dy, const T* x, T* dx, int64_t n);

// ---- SwiGLU (LLaMA MLP): out = silu(gate) · up, silu(g) = g · sigmoid(g) ------------------------
// gate_up is the output of the gate_up linear layer: each row holds ffn gate values, then ffn up
// values (the weight's gate rows come first).

// gate_up (N, 2·ffn); out (N, ffn) written.
template <typename T>
void swiglu_forward(const T* gate_up, T* out, int64_t N, int64_t ffn);

// dout (N, ffn), gate_up (N, 2·ffn) the forward's input; dgate_up (N, 2·ffn) written.
template <typename T>
void swiglu_backward(const T* dout, const T* gate_up, T* dgate_up, int64_t N, int64_t ffn);

// ---- Rotary position embedding (LLaMA) ----------------------------------------------------------
// Rotate-half convention (Hugging Face LLaMA): for head_dim D and i < D/2 the pair
// (x[i], x[i + D/2]) is rotated by the angle position · inv_freq[i], inv_freq[i] = θ^(−2i/D),
// with LLaMA-3's frequency scaling applied to inv_freq when scaling.enabled:
//   x'[i]       = x[i] · cos − x[i + D/2] · sin
//   x'[i + D/2] = x[i + D/2] · cos + x[i] · sin

// The cos/sin table: cos_table and sin_table (max_pos, head_dim / 2) written; entry (p, i) is
// cos/sin(p · inv_freq[i]), computed in double and rounded once to T. head_dim must be even. With
// positions (max_pos entries), row r holds position positions[r] instead (a context-parallel
// rank's rows of a longer sequence).
template <typename T>
void rope_table(T* cos_table, T* sin_table, int64_t max_pos, int64_t head_dim, double theta,
                const RopeScaling& scaling, const int64_t* positions = nullptr);

// Rotates, in place, the q and k heads of the qkv rows; v is untouched.
// qkv (N, (n_head + 2·n_kv_head) · head_dim): each row holds n_head q heads, n_kv_head k heads,
// n_kv_head v heads. Row n is token n % seq_len of its sequence (N = B · seq_len), so it is
// rotated by position n % seq_len; the tables need at least seq_len rows.
template <typename T>
void rope_forward(T* qkv, const T* cos_table, const T* sin_table, int64_t N, int64_t seq_len,
                  int64_t n_head, int64_t n_kv_head, int64_t head_dim);

// The backward rotates the gradient back (by −angle), in place on the dq and dk parts of dqkv
// (N, (n_head + 2·n_kv_head) · head_dim); dv is untouched. Same arguments as the forward.
template <typename T>
void rope_backward(T* dqkv, const T* cos_table, const T* sin_table, int64_t N, int64_t seq_len,
                   int64_t n_head, int64_t n_kv_head, int64_t head_dim);

// ---- Residual add -------------------------------------------------------------------------------

// a (n), b (n); y (n) written (= a + b); y may alias a or b.
template <typename T>
void residual_forward(const T* a, const T* b, T* y, int64_t n);

// dy (n); da (n) and db (n) accumulated (+= dy); either may be nullptr.
template <typename T>
void residual_backward(const T* dy, Nullable<T> da, Nullable<T> db, int64_t n);

// ---- Token (+ position) embedding ---------------------------------------------------------------

// tokens (N) int32 in [0, vocab_size); token_table (padded_vocab, C); position_table (≥ seq_len,
// C) or nullptr (LLaMA); out (N, C) written: out[n] = token_table[tokens[n]] (+ position_table[p])
// where p, the position of row n, is n % seq_len, or positions[n % seq_len] when positions (seq_len
// entries, each a row of position_table) is given: a context-parallel rank's rows of a longer
// sequence. Returns invalid_argument, writing nothing, when a token is outside [0, vocab_size).
template <typename T>
Status embedding_forward(const int32_t* tokens, const T* token_table,
                         Nullable<const T> position_table, T* out, int64_t N, int64_t seq_len,
                         int64_t vocab_size, int64_t C, const int64_t* positions = nullptr);

// dout (N, C), tokens (N) (already validated by the forward);
// dtoken_table (padded_vocab, C) accumulated (+=) at the rows of the tokens;
// dposition_table accumulated (+=) at the rows' positions (as the forward's), or nullptr (LLaMA).
template <typename T>
void embedding_backward(const T* dout, const int32_t* tokens, T* dtoken_table,
                        Nullable<T> dposition_table, int64_t N, int64_t seq_len, int64_t C,
                        const int64_t* positions = nullptr);

// ---- Classifier: softmax + cross-entropy over the vocabulary, fused -----------------------------
// The logits rows are padded_vocab wide, but only the first vocab_size columns are classes: the
// padding columns never receive probability (they are left out of the softmax) and get zero
// gradient. A target of −1 is ignored (torch's ignore_index = −1): it adds no loss and its row
// gets zero gradient. The loss is the mean over the valid targets of −log p[target].

struct ClassifierResult {
  double mean_loss = 0.0;  // mean of the valid rows' losses; 0 when there are none
  int64_t n_valid = 0;     // rows whose target is not −1
};

// logits (N, padded_vocab), targets (N) int32 in [0, vocab_size) or −1.
// losses (N) written (0 on ignored rows), or nullptr.
// dlogits (N, padded_vocab) written, or nullptr (evaluation): the gradient of the mean loss,
//   (softmax − onehot(target)) / n_valid on valid rows, 0 on ignored rows and padding columns.
//   dlogits may alias logits (the gradient then overwrites them in place).
// Returns invalid_argument, writing nothing, when a target is outside [0, vocab_size) and not −1,
// or when vocab_size is not in [1, padded_vocab].
template <typename T>
Status classifier_forward_backward(const T* logits, const int32_t* targets, Nullable<T> losses,
                                   Nullable<T> dlogits, ClassifierResult* result, int64_t N,
                                   int64_t vocab_size, int64_t padded_vocab);

}  // namespace flare::train::cpu
