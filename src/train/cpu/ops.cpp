// ops.cpp — the CPU operators of ops.h.
//
// Plain loops, parallel over rows with OpenMP and vectorised along a row with `omp simd`. Where a
// gradient sums over rows (dweight, dbias, the embedding tables) the loop is parallel over columns
// instead and walks the rows in order, so no two threads write one element and the result is the
// same for any thread count. Row statistics (norms, softmax) are accumulated in double: these
// functions are the reference the CUDA kernels are measured against, so they should carry less
// error than the kernels, and a row's statistics cost little next to the matmuls.
#include "train/cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include "core/message.h"

namespace flare::train::cpu {
namespace {

// Rows per block in the matmuls: each weight row loaded from cache serves this many input rows.
constexpr int64_t kRowBlock = 4;

// Whether a loop of `work` multiply-adds (or element updates) is worth a parallel region. Starting
// and joining the threads costs microseconds on idle cores, and milliseconds when the cores are
// shared and a thread waits for its turn: on a loaded 2-core machine the tiny test models ran
// 6x slower with 2 threads than with 1 (gpt-tiny, B 4, T 32: 470 vs 70 ms a step) until loops
// below 2^18 (about 100 µs of one core's work) ran serially. The threshold changes only who
// computes a row, never the order of any sum.
constexpr int64_t kParallelWork = int64_t{1} << 18;
bool worth_parallel(int64_t work) { return work >= kParallelWork; }

template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// y += alpha · x
template <typename T>
void axpy(T alpha, const T* x, T* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

}  // namespace

// ---- Linear layer -------------------------------------------------------------------------------

template <typename T>
void matmul_forward(const T* x, const T* weight, Nullable<const T> bias, T* y, int64_t N,
                    int64_t in, int64_t out) {
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
#pragma omp parallel for schedule(static) if(worth_parallel(N * in * out))
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t n0 = blk * kRowBlock;
    const int64_t rows = std::min(kRowBlock, N - n0);
    for (int64_t o = 0; o < out; ++o) {
      const T* w = weight + o * in;
      const T b = bias ? bias[o] : T(0);
      for (int64_t r = 0; r < rows; ++r) y[(n0 + r) * out + o] = dot(x + (n0 + r) * in, w, in) + b;
    }
  }
}

template <typename T>
void matmul_backward(const T* dy, const T* x, const T* weight, Nullable<T> dx, T* dweight,
                     Nullable<T> dbias, int64_t N, int64_t in, int64_t out) {
  // dx (N, in) = dy (N, out) · W (out, in): each input row is a sum of weight rows.
  if (dx) {
#pragma omp parallel for schedule(static) if(worth_parallel(N * in * out))
    for (int64_t n = 0; n < N; ++n) {
      T* dxr = dx + n * in;
      std::fill(dxr, dxr + in, T(0));
      for (int64_t o = 0; o < out; ++o) axpy(dy[n * out + o], weight + o * in, dxr, in);
    }
  }
  // dW (out, in) += dyᵀ · x and db (out) += Σ_n dy: one weight row per iteration, rows n in order.
#pragma omp parallel for schedule(static) if(worth_parallel(N * in * out))
  for (int64_t o = 0; o < out; ++o) {
    T* dw = dweight + o * in;
    T db = 0;
    for (int64_t n = 0; n < N; ++n) {
      const T g = dy[n * out + o];
      axpy(g, x + n * in, dw, in);
      db += g;
    }
    if (dbias) dbias[o] += db;
  }
}

// ---- LayerNorm ----------------------------------------------------------------------------------

template <typename T>
void layernorm_forward(const T* x, const T* weight, const T* bias, T* y, T* mean, T* rstd,
                       int64_t N, int64_t C, double eps) {
#pragma omp parallel for schedule(static) if(worth_parallel(N * C))
  for (int64_t n = 0; n < N; ++n) {
    const T* xr = x + n * C;
    double sum = 0.0;
    for (int64_t c = 0; c < C; ++c) sum += xr[c];
    const double m = sum / static_cast<double>(C);
    double sq = 0.0;
    for (int64_t c = 0; c < C; ++c) sq += (xr[c] - m) * (xr[c] - m);
    const double s = 1.0 / std::sqrt(sq / static_cast<double>(C) + eps);
    T* yr = y + n * C;
    for (int64_t c = 0; c < C; ++c) yr[c] = static_cast<T>((xr[c] - m) * s * weight[c] + bias[c]);
    mean[n] = static_cast<T>(m);
    rstd[n] = static_cast<T>(s);
  }
}

template <typename T>
void layernorm_backward(const T* dy, const T* x, const T* weight, const T* mean, const T* rstd,
                        T* dx, T* dweight, T* dbias, int64_t N, int64_t C) {
  // dx = rstd · (g − mean(g) − x̂ · mean(g · x̂)), g = dy · weight, x̂ the normalised input.
#pragma omp parallel for schedule(static) if(worth_parallel(N * C))
  for (int64_t n = 0; n < N; ++n) {
    const T* xr = x + n * C;
    const T* dyr = dy + n * C;
    const double m = mean[n];
    const double s = rstd[n];
    double g_sum = 0.0;
    double gx_sum = 0.0;
    for (int64_t c = 0; c < C; ++c) {
      const double g = static_cast<double>(dyr[c]) * weight[c];
      g_sum += g;
      gx_sum += g * (xr[c] - m) * s;
    }
    const double g_mean = g_sum / static_cast<double>(C);
    const double gx_mean = gx_sum / static_cast<double>(C);
    T* dxr = dx + n * C;
    for (int64_t c = 0; c < C; ++c) {
      const double g = static_cast<double>(dyr[c]) * weight[c];
      const double xhat = (xr[c] - m) * s;
      dxr[c] += static_cast<T>(s * (g - g_mean - xhat * gx_mean));
    }
  }
  // dweight += Σ_n dy · x̂, dbias += Σ_n dy: parallel over columns, rows in order.
#pragma omp parallel for schedule(static) if(worth_parallel(N * C))
  for (int64_t c = 0; c < C; ++c) {
    double dw = 0.0;
    double db = 0.0;
    for (int64_t n = 0; n < N; ++n) {
      const double g = dy[n * C + c];
      dw += g * (x[n * C + c] - static_cast<double>(mean[n])) * rstd[n];
      db += g;
    }
    dweight[c] += static_cast<T>(dw);
    dbias[c] += static_cast<T>(db);
  }
}

// ---- RMSNorm ------------------------------------------------------------------------------------

template <typename T>
void rmsnorm_forward(const T* x, const T* weight, T* y, T* rstd, int64_t N, int64_t C,
                     double eps) {
#pragma omp parallel for schedule(static) if(worth_parallel(N * C))
  for (int64_t n = 0; n < N; ++n) {
    const T* xr = x + n * C;
    double sq = 0.0;
    for (int64_t c = 0; c < C; ++c) sq += static_cast<double>(xr[c]) * xr[c];
    const double s = 1.0 / std::sqrt(sq / static_cast<double>(C) + eps);
    T* yr = y + n * C;
    for (int64_t c = 0; c < C; ++c) yr[c] = static_cast<T>(xr[c] * s * weight[c]);
    rstd[n] = static_cast<T>(s);
  }
}

template <typename T>
void rmsnorm_backward(const T* dy, const T* x, const T* weight, const T* rstd, T* dx, T* dweight,
                      int64_t N, int64_t C) {
  // dx = rstd · (g − x̂ · mean(g · x̂)), g = dy · weight, x̂ = x · rstd.
#pragma omp parallel for schedule(static) if(worth_parallel(N * C))
  for (int64_t n = 0; n < N; ++n) {
    const T* xr = x + n * C;
    const T* dyr = dy + n * C;
    const double s = rstd[n];
    double gx_sum = 0.0;
    for (int64_t c = 0; c < C; ++c) gx_sum += static_cast<double>(dyr[c]) * weight[c] * xr[c] * s;
    const double gx_mean = gx_sum / static_cast<double>(C);
    T* dxr = dx + n * C;
    for (int64_t c = 0; c < C; ++c) {
      const double g = static_cast<double>(dyr[c]) * weight[c];
      dxr[c] += static_cast<T>(s * (g - xr[c] * s * gx_mean));
    }
  }
#pragma omp parallel for schedule(static) if(worth_parallel(N * C))
  for (int64_t c = 0; c < C; ++c) {
    double dw = 0.0;
    for (int64_t n = 0; n < N; ++n)
      dw += static_cast<double>(dy[n * C + c]) * x[n * C + c] * rstd[n];
    dweight[c] += static_cast<T>(dw);
  }
}

// ---- GELU (tanh) --------------------------------------------------------------------------------

namespace {
constexpr double kGeluK = 0.7978845608028654;  // sqrt(2 / π)
constexpr double kGeluC = 0.044715;
}  // namespace

template <typename T>
void gelu_forward(const T* x, T* y, int64_t n) {
#pragma omp parallel for simd schedule(static) if(worth_parallel(n))
  for (int64_t i = 0; i < n; ++i) {
    const T v = x[i];
    const T u = static_cast<T>(kGeluK) * (v + static_cast<T>(kGeluC) * v * v * v);
    y[i] = T(0.5) * v * (T(1) + std::tanh(u));
  }
}

template <typename T>
void gelu_backward(const T* dy, const T* x, T* dx, int64_t n) {
#pragma omp parallel for simd schedule(static) if(worth_parallel(n))
  for (int64_t i = 0; i < n; ++i) {
    const T v = x[i];
    const T u = static_cast<T>(kGeluK) * (v + static_cast<T>(kGeluC) * v * v * v);
    const T t = std::tanh(u);
    const T du = static_cast<T>(kGeluK) * (T(1) + T(3) * static_cast<T>(kGeluC) * v * v);
    dx[i] = dy[i] * (T(0.5) * (T(1) + t) + T(0.5) * v * (T(1) - t * t) * du);
  }
}

// ---- SwiGLU -------------------------------------------------------------------------------------

template <typename T>
void swiglu_forward(const T* gate_up, T* out, int64_t N, int64_t ffn) {
#pragma omp parallel for schedule(static) if(worth_parallel(N * ffn))
  for (int64_t n = 0; n < N; ++n) {
    const T* gate = gate_up + n * 2 * ffn;
    const T* up = gate + ffn;
    T* o = out + n * ffn;
    for (int64_t j = 0; j < ffn; ++j) {
      const T sig = T(1) / (T(1) + std::exp(-gate[j]));
      o[j] = gate[j] * sig * up[j];
    }
  }
}

template <typename T>
void swiglu_backward(const T* dout, const T* gate_up, T* dgate_up, int64_t N, int64_t ffn) {
  // d silu(g) / dg = sigmoid(g) · (1 + g · (1 − sigmoid(g))).
#pragma omp parallel for schedule(static) if(worth_parallel(N * ffn))
  for (int64_t n = 0; n < N; ++n) {
    const T* gate = gate_up + n * 2 * ffn;
    const T* up = gate + ffn;
    const T* d = dout + n * ffn;
    T* dgate = dgate_up + n * 2 * ffn;
    T* dup = dgate + ffn;
    for (int64_t j = 0; j < ffn; ++j) {
      const T g = gate[j];
      const T sig = T(1) / (T(1) + std::exp(-g));
      dgate[j] = d[j] * up[j] * sig * (T(1) + g * (T(1) - sig));
      dup[j] = d[j] * g * sig;
    }
  }
}

// ---- RoPE ---------------------------------------------------------------------------------------

template <typename T>
void rope_table(T* cos_table, T* sin_table, int64_t max_pos, int64_t head_dim, double theta,
                const RopeScaling& scaling, const int64_t* positions) {
  const int64_t half = head_dim / 2;
  std::vector<double> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    double f = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
    if (scaling.enabled) {
      // LLaMA-3: long wavelengths are slowed by `factor`, short ones kept, the band between
      // interpolated linearly in original_max_position / wavelength.
      const double original = static_cast<double>(scaling.original_max_position);
      const double low_freq_wavelen = original / scaling.low_freq_factor;
      const double high_freq_wavelen = original / scaling.high_freq_factor;
      const double wavelen = 2.0 * std::numbers::pi / f;
      if (wavelen > low_freq_wavelen) {
        f = f / scaling.factor;
      } else if (wavelen >= high_freq_wavelen) {
        const double smooth = (original / wavelen - scaling.low_freq_factor) /
                              (scaling.high_freq_factor - scaling.low_freq_factor);
        f = (1.0 - smooth) * f / scaling.factor + smooth * f;
      }
    }
    inv_freq[static_cast<size_t>(i)] = f;
  }
  for (int64_t row = 0; row < max_pos; ++row) {
    const int64_t p = positions ? positions[row] : row;
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(p) * inv_freq[static_cast<size_t>(i)];
      cos_table[row * half + i] = static_cast<T>(std::cos(angle));
      sin_table[row * half + i] = static_cast<T>(std::sin(angle));
    }
  }
}

namespace {

// Rotates the q and k heads of every qkv row by `direction` · angle (+1 forward, −1 backward).
template <typename T>
void rope_rotate(T* qkv, const T* cos_table, const T* sin_table, int64_t N, int64_t seq_len,
                 int64_t n_head, int64_t n_kv_head, int64_t head_dim, T direction) {
  const int64_t half = head_dim / 2;
  const int64_t row = (n_head + 2 * n_kv_head) * head_dim;
  const int64_t rotated_heads = n_head + n_kv_head;  // q heads, then k heads; v follows
#pragma omp parallel for schedule(static) if(worth_parallel(N * row))
  for (int64_t n = 0; n < N; ++n) {
    const int64_t pos = n % seq_len;
    const T* c = cos_table + pos * half;
    const T* s = sin_table + pos * half;
    for (int64_t h = 0; h < rotated_heads; ++h) {
      T* x = qkv + n * row + h * head_dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const T a = x[i];
        const T b = x[i + half];
        const T sn = direction * s[i];
        x[i] = a * c[i] - b * sn;
        x[i + half] = b * c[i] + a * sn;
      }
    }
  }
}

}  // namespace

template <typename T>
void rope_forward(T* qkv, const T* cos_table, const T* sin_table, int64_t N, int64_t seq_len,
                  int64_t n_head, int64_t n_kv_head, int64_t head_dim) {
  rope_rotate(qkv, cos_table, sin_table, N, seq_len, n_head, n_kv_head, head_dim, T(1));
}

template <typename T>
void rope_backward(T* dqkv, const T* cos_table, const T* sin_table, int64_t N, int64_t seq_len,
                   int64_t n_head, int64_t n_kv_head, int64_t head_dim) {
  // The rotation is orthogonal, so its transpose (the backward) is the rotation by −angle.
  rope_rotate(dqkv, cos_table, sin_table, N, seq_len, n_head, n_kv_head, head_dim, T(-1));
}

// ---- Residual -----------------------------------------------------------------------------------

template <typename T>
void residual_forward(const T* a, const T* b, T* y, int64_t n) {
#pragma omp parallel for simd schedule(static) if(worth_parallel(n))
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] + b[i];
}

template <typename T>
void residual_backward(const T* dy, Nullable<T> da, Nullable<T> db, int64_t n) {
#pragma omp parallel for simd schedule(static) if(worth_parallel(n))
  for (int64_t i = 0; i < n; ++i) {
    if (da) da[i] += dy[i];
    if (db) db[i] += dy[i];
  }
}

// ---- Embedding ----------------------------------------------------------------------------------

namespace {

// The position of row n of (batch, seq_len) rows: its index in the sequence, or what `positions`
// says it is (ops.h).
int64_t row_position(int64_t n, int64_t seq_len, const int64_t* positions) {
  return positions ? positions[n % seq_len] : n % seq_len;
}

}  // namespace

template <typename T>
Status embedding_forward(const int32_t* tokens, const T* token_table,
                         Nullable<const T> position_table, T* out, int64_t N, int64_t seq_len,
                         int64_t vocab_size, int64_t C, const int64_t* positions) {
  for (int64_t n = 0; n < N; ++n) {
    if (tokens[n] < 0 || tokens[n] >= vocab_size) {
      return invalid("tokens[", n, "] = ", tokens[n], " must be in [0, vocab_size = ", vocab_size,
                     ")");
    }
  }
#pragma omp parallel for schedule(static) if(worth_parallel(N * C))
  for (int64_t n = 0; n < N; ++n) {
    const T* tok = token_table + static_cast<int64_t>(tokens[n]) * C;
    T* o = out + n * C;
    if (position_table) {
      const T* pos = position_table + row_position(n, seq_len, positions) * C;
      for (int64_t c = 0; c < C; ++c) o[c] = tok[c] + pos[c];
    } else {
      std::copy(tok, tok + C, o);
    }
  }
  return Status::ok_status();
}

template <typename T>
void embedding_backward(const T* dout, const int32_t* tokens, T* dtoken_table,
                        Nullable<T> dposition_table, int64_t N, int64_t seq_len, int64_t C,
                        const int64_t* positions) {
  // Two tokens may share a table row, so the split is over columns, rows in order.
#pragma omp parallel for schedule(static) if(worth_parallel(N * C))
  for (int64_t c = 0; c < C; ++c) {
    for (int64_t n = 0; n < N; ++n) {
      const T g = dout[n * C + c];
      dtoken_table[static_cast<int64_t>(tokens[n]) * C + c] += g;
      if (dposition_table) dposition_table[row_position(n, seq_len, positions) * C + c] += g;
    }
  }
}

// ---- Classifier ---------------------------------------------------------------------------------

template <typename T>
Status classifier_forward_backward(const T* logits, const int32_t* targets, Nullable<T> losses,
                                   Nullable<T> dlogits, ClassifierResult* result, int64_t N,
                                   int64_t vocab_size, int64_t padded_vocab) {
  if (vocab_size < 1 || vocab_size > padded_vocab) {
    return invalid("vocab_size = ", vocab_size, " must be in [1, padded_vocab = ", padded_vocab,
                   "]");
  }
  int64_t n_valid = 0;
  for (int64_t n = 0; n < N; ++n) {
    if (targets[n] == -1) continue;
    if (targets[n] < 0 || targets[n] >= vocab_size) {
      return invalid("targets[", n, "] = ", targets[n], " must be in [0, vocab_size = ",
                     vocab_size, ") or -1 (ignored)");
    }
    ++n_valid;
  }
  const double grad_scale = n_valid > 0 ? 1.0 / static_cast<double>(n_valid) : 0.0;
  std::vector<double> row_loss(static_cast<size_t>(N), 0.0);
#pragma omp parallel for schedule(static) if(worth_parallel(N * padded_vocab))
  for (int64_t n = 0; n < N; ++n) {
    const T* z = logits + n * padded_vocab;
    const int32_t target = targets[n];
    if (target == -1) {
      if (dlogits) std::fill(dlogits + n * padded_vocab, dlogits + (n + 1) * padded_vocab, T(0));
      continue;
    }
    // log Σ exp over the real classes only: padding columns are not classes.
    double max_z = z[0];
    for (int64_t j = 1; j < vocab_size; ++j) max_z = std::max(max_z, static_cast<double>(z[j]));
    double sum = 0.0;
    for (int64_t j = 0; j < vocab_size; ++j) sum += std::exp(z[j] - max_z);
    const double lse = max_z + std::log(sum);
    row_loss[static_cast<size_t>(n)] = lse - z[target];
    if (dlogits) {
      // Reads z[j] before writing dz[j], so dlogits may alias logits.
      T* dz = dlogits + n * padded_vocab;
      for (int64_t j = 0; j < vocab_size; ++j) {
        const double p = std::exp(z[j] - lse);
        dz[j] = static_cast<T>((p - (j == target ? 1.0 : 0.0)) * grad_scale);
      }
      std::fill(dz + vocab_size, dz + padded_vocab, T(0));
    }
  }
  double total = 0.0;
  for (int64_t n = 0; n < N; ++n) {
    total += row_loss[static_cast<size_t>(n)];
    if (losses) losses[n] = static_cast<T>(row_loss[static_cast<size_t>(n)]);
  }
  result->mean_loss = total * grad_scale;
  result->n_valid = n_valid;
  return Status::ok_status();
}

// ---- Instantiations: float for the models, double for the finite-difference tests --------------

#define FLARE_TRAIN_CPU_OPS(T)                                                                     \
  template void matmul_forward<T>(const T*, const T*, const T*, T*, int64_t, int64_t, int64_t);  \
  template void matmul_backward<T>(const T*, const T*, const T*, T*, T*, T*, int64_t, int64_t,   \
                                   int64_t);                                                      \
  template void layernorm_forward<T>(const T*, const T*, const T*, T*, T*, T*, int64_t, int64_t, \
                                     double);                                                     \
  template void layernorm_backward<T>(const T*, const T*, const T*, const T*, const T*, T*, T*,  \
                                      T*, int64_t, int64_t);                                      \
  template void rmsnorm_forward<T>(const T*, const T*, T*, T*, int64_t, int64_t, double);        \
  template void rmsnorm_backward<T>(const T*, const T*, const T*, const T*, T*, T*, int64_t,     \
                                    int64_t);                                                     \
  template void gelu_forward<T>(const T*, T*, int64_t);                                           \
  template void gelu_backward<T>(const T*, const T*, T*, int64_t);                                \
  template void swiglu_forward<T>(const T*, T*, int64_t, int64_t);                                \
  template void swiglu_backward<T>(const T*, const T*, T*, int64_t, int64_t);                     \
  template void rope_table<T>(T*, T*, int64_t, int64_t, double, const RopeScaling&, const int64_t*);              \
  template void rope_forward<T>(T*, const T*, const T*, int64_t, int64_t, int64_t, int64_t,      \
                                int64_t);                                                         \
  template void rope_backward<T>(T*, const T*, const T*, int64_t, int64_t, int64_t, int64_t,     \
                                 int64_t);                                                        \
  template void residual_forward<T>(const T*, const T*, T*, int64_t);                             \
  template void residual_backward<T>(const T*, T*, T*, int64_t);                                  \
  template Status embedding_forward<T>(const int32_t*, const T*, const T*, T*, int64_t, int64_t, \
                                       int64_t, int64_t, const int64_t*);                         \
  template void embedding_backward<T>(const T*, const int32_t*, T*, T*, int64_t, int64_t,        \
                                      int64_t, const int64_t*);                                   \
  template Status classifier_forward_backward<T>(const T*, const int32_t*, T*, T*,               \
                                                 ClassifierResult*, int64_t, int64_t, int64_t);

FLARE_TRAIN_CPU_OPS(float)
FLARE_TRAIN_CPU_OPS(double)
#undef FLARE_TRAIN_CPU_OPS

}  // namespace flare::train::cpu
