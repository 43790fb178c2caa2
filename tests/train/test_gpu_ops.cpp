// test_gpu_ops.cpp — the trainer's CUDA operators (src/train/cuda) against the CPU operators
// (src/train/cpu/ops.h, core/adamw.h) on the same random bf16 inputs.
//
// Tolerance (docs/architecture.md): for each output, max|gpu − ref| ≤ 2·max|naive − ref| + floor,
// where ref is the CPU operator in double on the inputs as rounded to bf16, naive the same operator
// in float (the GPU's precision: fp32 math), rounded to bf16 where the GPU stores bf16, and floor
// the dtype's rounding at the reference's magnitude (test_util.h). The optimizer has only a float
// reference; there ref = naive and the floor alone bounds the difference.
//
// Sizes are awkward on purpose: rows 1 and 97, channels 2560 (80·32) and 1600 (64·25) on the
// 16-byte path, 77 and 40·3 + 1 off it. Every output buffer is poisoned (NaN) before the call, so
// an element left unwritten fails. Determinism: each backward runs twice, the bytes must match.
// Without a GPU the numerical tests skip, saying so; the argument checks run anyway (they are
// decided before any device work).
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/numeric.h"
#include "test_util.h"
#include "train/core/adamw.h"
#include "train/core/split_master.h"
#include "train/cpu/ops.h"
#include "train/cuda/adamw.h"
#include "train/cuda/classifier.h"
#include "train/cuda/embedding.h"
#include "train/cuda/matmul.h"
#include "train/cuda/norm.h"
#include "train/cuda/rope.h"
#include "train/cuda/swiglu.h"
#include "train_gpu_test.h"

namespace flare::train {
namespace {

using cuda::bf16;
using test::within_tolerance;

// ---- host data ---------------------------------------------------------------------------------

// Random values rounded to bf16, kept as the bits the device gets and as float / double.
struct Bf16Data {
  std::vector<uint16_t> bits;
  std::vector<float> f;
  std::vector<double> d;
};

Bf16Data random_bf16(size_t n, std::mt19937_64& rng, float sigma = 1.0f, float mean = 0.0f) {
  std::normal_distribution<float> dist(mean, sigma);
  Bf16Data out;
  out.bits.resize(n);
  out.f.resize(n);
  out.d.resize(n);
  for (size_t i = 0; i < n; ++i) {
    out.bits[i] = float_to_bf16(dist(rng));
    out.f[i] = bf16_to_float(out.bits[i]);
    out.d[i] = out.f[i];
  }
  return out;
}

std::vector<float> random_floats(size_t n, std::mt19937_64& rng, float sigma = 1.0f) {
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }
std::vector<double> rounded_bf16(const std::vector<float>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_float(float_to_bf16(v[i]));
  return out;
}
std::vector<double> bits_to_double(const std::vector<uint16_t>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_float(v[i]);
  return out;
}

// ---- device buffers ----------------------------------------------------------------------------

template <typename T>
class Dev {
 public:
  explicit Dev(size_t n) : n_(n) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p_), std::max<size_t>(n, 1) * sizeof(T)), cudaSuccess);
    poison();
  }
  explicit Dev(const std::vector<T>& host) : Dev(host.size()) { upload(host); }
  ~Dev() { cudaFree(p_); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;

  void upload(const std::vector<T>& host) {
    EXPECT_EQ(host.size(), n_);
    EXPECT_EQ(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<T> get() const {
    std::vector<T> host(n_);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }
  // All-ones bytes: NaN in bf16 and fp32.
  void poison() { EXPECT_EQ(cudaMemset(p_, 0xff, std::max<size_t>(n_, 1) * sizeof(T)), cudaSuccess); }
  T* get_ptr() const { return p_; }
  operator T*() const { return p_; }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

// bf16 device buffers travel as uint16_t; the operators take bf16*.
bf16* bf(const Dev<uint16_t>& d) { return reinterpret_cast<bf16*>(d.get_ptr()); }

std::vector<double> get_bf16(const Dev<uint16_t>& d) { return bits_to_double(d.get()); }
std::vector<double> get_f32(const Dev<float>& d) { return to_double(d.get()); }

bool same_bytes(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 2) == 0;
}
bool same_bytes(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

struct RowsChannels {
  int64_t rows, channels;
};
const RowsChannels kNormSizes[] = {{1, 2560}, {97, 2560}, {97, 1600}, {33, 77}, {5, 121}};

// ---- norms -------------------------------------------------------------------------------------

void check_norm(bool rms, bool residual, int64_t N, int64_t C) {
  SCOPED_TRACE(testing::Message() << (rms ? "rmsnorm" : "layernorm") << (residual ? " +residual" : "")
                                  << " rows " << N << " channels " << C);
  std::mt19937_64 rng(test::test_seed() + N * 131 + C);
  const size_t n = N * C;
  // An offset mean and scale make the centred variance matter.
  const Bf16Data a = random_bf16(n, rng, 2.0f, 0.5f), b = random_bf16(n, rng);
  const Bf16Data w = random_bf16(C, rng, 0.3f, 1.0f), bias = random_bf16(C, rng, 0.1f);
  const Bf16Data dy = random_bf16(n, rng), dres = random_bf16(n, rng);

  // The normalised input: a, or the bf16 residual a + b (what the fused kernel stores).
  std::vector<float> x = a.f;
  if (residual) {
    cpu::residual_forward(a.f.data(), b.f.data(), x.data(), static_cast<int64_t>(n));
    for (float& v : x) v = bf16_to_float(float_to_bf16(v));
  }
  const std::vector<double> xd = to_double(x);
  const double eps = 1e-5;

  // CPU forward, double and float.
  std::vector<double> y_ref(n), mean_ref(N), rstd_ref(N);
  std::vector<float> y_naive(n), mean_naive(N), rstd_naive(N);
  if (rms) {
    cpu::rmsnorm_forward(xd.data(), w.d.data(), y_ref.data(), rstd_ref.data(), N, C, eps);
    cpu::rmsnorm_forward(x.data(), w.f.data(), y_naive.data(), rstd_naive.data(), N, C, eps);
  } else {
    cpu::layernorm_forward(xd.data(), w.d.data(), bias.d.data(), y_ref.data(), mean_ref.data(),
                           rstd_ref.data(), N, C, eps);
    cpu::layernorm_forward(x.data(), w.f.data(), bias.f.data(), y_naive.data(), mean_naive.data(),
                           rstd_naive.data(), N, C, eps);
  }

  // GPU forward.
  Dev<uint16_t> ga(a.bits), gb(b.bits), gw(w.bits), gbias(bias.bits), gres(n), gy(n);
  Dev<float> gmean(N), grstd(N);
  if (rms && residual)
    ASSERT_OK(cuda::residual_rmsnorm_forward(bf(ga), bf(gb), bf(gw), bf(gres), bf(gy), grstd, N, C,
                                             static_cast<float>(eps), nullptr));
  else if (rms)
    ASSERT_OK(cuda::rmsnorm_forward(bf(ga), bf(gw), bf(gy), grstd, N, C, static_cast<float>(eps), nullptr));
  else if (residual)
    ASSERT_OK(cuda::residual_layernorm_forward(bf(ga), bf(gb), bf(gw), bf(gbias), bf(gres), bf(gy),
                                               gmean, grstd, N, C, static_cast<float>(eps), nullptr));
  else
    ASSERT_OK(cuda::layernorm_forward(bf(ga), bf(gw), bf(gbias), bf(gy), gmean, grstd, N, C,
                                      static_cast<float>(eps), nullptr));
  EXPECT_TRUE(within_tolerance("y", get_bf16(gy), y_ref, rounded_bf16(y_naive), DType::kBFloat16, C));
  EXPECT_TRUE(within_tolerance("rstd", get_f32(grstd), rstd_ref, to_double(rstd_naive), DType::kFloat32, C));
  if (!rms) {
    EXPECT_TRUE(within_tolerance("mean", get_f32(gmean), mean_ref, to_double(mean_naive), DType::kFloat32, C));
  }
  if (residual) {
    // Exact: the sum of two bf16 values rounded once.
    EXPECT_TRUE(within_tolerance("residual_out", get_bf16(gres), xd, xd, DType::kBFloat16, 1));
  }

  // Backward: dx accumulates onto dres (CPU +=; GPU dx = dresidual + ∂L/∂x with dresidual = dx),
  // dweight and dbias accumulate onto random fp32 starting values.
  const std::vector<float> dw0 = random_floats(C, rng), db0 = random_floats(C, rng);
  std::vector<double> dx_ref = dres.d, dw_ref = to_double(dw0), db_ref = to_double(db0);
  std::vector<float> dx_naive = dres.f, dw_naive = dw0, db_naive = db0;
  const std::vector<float> mean_f = rms ? std::vector<float>(N) : mean_naive;
  if (rms) {
    cpu::rmsnorm_backward(dy.d.data(), xd.data(), w.d.data(), rstd_ref.data(), dx_ref.data(),
                          dw_ref.data(), N, C);
    cpu::rmsnorm_backward(dy.f.data(), x.data(), w.f.data(), rstd_naive.data(), dx_naive.data(),
                          dw_naive.data(), N, C);
  } else {
    cpu::layernorm_backward(dy.d.data(), xd.data(), w.d.data(), mean_ref.data(), rstd_ref.data(),
                            dx_ref.data(), dw_ref.data(), db_ref.data(), N, C);
    cpu::layernorm_backward(dy.f.data(), x.data(), w.f.data(), mean_naive.data(), rstd_naive.data(),
                            dx_naive.data(), dw_naive.data(), db_naive.data(), N, C);
  }
  std::vector<uint16_t> x_bits(n);
  for (size_t i = 0; i < n; ++i) x_bits[i] = float_to_bf16(x[i]);
  Dev<uint16_t> gx(x_bits), gdy(dy.bits), gdx(dres.bits);
  Dev<float> gm(mean_f), gr(rstd_naive), gdw(dw0), gdb(db0);
  Dev<char> scratch(cuda::norm_backward_scratch_bytes(N, C));
  auto backward = [&] {
    if (rms)
      return cuda::rmsnorm_backward(bf(gdy), bf(gx), bf(gw), gr, bf(gdx), bf(gdx), gdw.get_ptr(), N, C, true,
                                    scratch, nullptr);
    return cuda::layernorm_backward(bf(gdy), bf(gx), bf(gw), gm, gr, bf(gdx), bf(gdx), gdw.get_ptr(), gdb.get_ptr(), N, C,
                                    true, scratch, nullptr);
  };
  ASSERT_OK(backward());
  const std::vector<uint16_t> dx1 = gdx.get();
  const std::vector<float> dw1 = gdw.get(), db1 = gdb.get();
  EXPECT_TRUE(within_tolerance("dx", bits_to_double(dx1), dx_ref, rounded_bf16(dx_naive), DType::kBFloat16, C));
  EXPECT_TRUE(within_tolerance("dweight", to_double(dw1), dw_ref, to_double(dw_naive), DType::kFloat32, N));
  if (!rms) {
    EXPECT_TRUE(within_tolerance("dbias", to_double(db1), db_ref, to_double(db_naive), DType::kFloat32, N));
  }

  // Bitwise determinism: the same call on the same inputs.
  gdx.upload(dres.bits);
  gdw.upload(dw0);
  gdb.upload(db0);
  ASSERT_OK(backward());
  EXPECT_TRUE(same_bytes(gdx.get(), dx1)) << "dx differs between two runs";
  EXPECT_TRUE(same_bytes(gdw.get(), dw1)) << "dweight differs between two runs";
  if (!rms) {
    EXPECT_TRUE(same_bytes(gdb.get(), db1)) << "dbias differs between two runs";
  }

  // The parameter gradients written in bf16 (accumulate false), each rounded once.
  std::vector<double> dx2_ref = dres.d, w2_ref(C, 0.0), b2_ref(C, 0.0);
  std::vector<float> dx2_naive = dres.f, w2_naive(C, 0.0f), b2_naive(C, 0.0f);
  if (rms) {
    cpu::rmsnorm_backward(dy.d.data(), xd.data(), w.d.data(), rstd_ref.data(), dx2_ref.data(), w2_ref.data(), N, C);
    cpu::rmsnorm_backward(dy.f.data(), x.data(), w.f.data(), rstd_naive.data(), dx2_naive.data(), w2_naive.data(),
                          N, C);
  } else {
    cpu::layernorm_backward(dy.d.data(), xd.data(), w.d.data(), mean_ref.data(), rstd_ref.data(), dx2_ref.data(),
                            w2_ref.data(), b2_ref.data(), N, C);
    cpu::layernorm_backward(dy.f.data(), x.data(), w.f.data(), mean_naive.data(), rstd_naive.data(),
                            dx2_naive.data(), w2_naive.data(), b2_naive.data(), N, C);
  }
  Dev<uint16_t> gdw16(C), gdb16(C);
  gdx.upload(dres.bits);
  auto backward16 = [&](bool accumulate) {
    if (rms)
      return cuda::rmsnorm_backward(bf(gdy), bf(gx), bf(gw), gr, bf(gdx), bf(gdx), bf(gdw16), N, C, accumulate,
                                    scratch, nullptr);
    return cuda::layernorm_backward(bf(gdy), bf(gx), bf(gw), gm, gr, bf(gdx), bf(gdx), bf(gdw16), bf(gdb16), N,
                                    C, accumulate, scratch, nullptr);
  };
  ASSERT_OK(backward16(false));
  EXPECT_TRUE(within_tolerance("dx (bf16 parameter gradients)", get_bf16(gdx), dx2_ref, rounded_bf16(dx2_naive),
                               DType::kBFloat16, C));
  EXPECT_TRUE(within_tolerance("dweight (bf16)", get_bf16(gdw16), w2_ref, rounded_bf16(w2_naive),
                               DType::kBFloat16, N));
  if (!rms) {
    EXPECT_TRUE(within_tolerance("dbias (bf16)", get_bf16(gdb16), b2_ref, rounded_bf16(b2_naive),
                                 DType::kBFloat16, N));
  }
  EXPECT_EQ(backward16(true).code(), StatusCode::kInvalidArgument) << "a bf16 gradient is never accumulated";
}

TEST(GpuOps, LayerNorm) {
  FLARE_SKIP_WITHOUT_CUDA();
  for (const auto& s : kNormSizes) check_norm(false, false, s.rows, s.channels);
}
TEST(GpuOps, RmsNorm) {
  FLARE_SKIP_WITHOUT_CUDA();
  for (const auto& s : kNormSizes) check_norm(true, false, s.rows, s.channels);
}
TEST(GpuOps, ResidualLayerNorm) {
  FLARE_SKIP_WITHOUT_CUDA();
  for (const auto& s : kNormSizes) check_norm(false, true, s.rows, s.channels);
}
TEST(GpuOps, ResidualRmsNorm) {
  FLARE_SKIP_WITHOUT_CUDA();
  for (const auto& s : kNormSizes) check_norm(true, true, s.rows, s.channels);
}

// ---- matmul ------------------------------------------------------------------------------------

// Forward (bias, GELU), backward input (with DGELU), backward weight (accumulating, with bias).
void check_matmul(cuda::MatmulContext& ctx, int64_t N, int64_t in, int64_t out, bool use_bias, bool gelu) {
  SCOPED_TRACE(testing::Message() << "matmul tokens " << N << " in " << in << " out " << out
                                  << (use_bias ? " bias" : "") << (gelu ? " gelu" : ""));
  std::mt19937_64 rng(test::test_seed() + N * 7 + in * 11 + out);
  const Bf16Data x = random_bf16(N * in, rng), w = random_bf16(out * in, rng, 0.05f);
  const Bf16Data b = random_bf16(out, rng, 0.5f), dy = random_bf16(N * out, rng);
  const double* bd = use_bias ? b.d.data() : nullptr;
  const float* bfp = use_bias ? b.f.data() : nullptr;

  std::vector<double> pre_ref(N * out), y_ref(N * out);
  std::vector<float> pre_naive(N * out), y_naive(N * out);
  cpu::matmul_forward(x.d.data(), w.d.data(), bd, pre_ref.data(), N, in, out);
  cpu::matmul_forward(x.f.data(), w.f.data(), bfp, pre_naive.data(), N, in, out);
  y_ref = pre_ref;
  y_naive = pre_naive;
  if (gelu) {
    cpu::gelu_forward(pre_ref.data(), y_ref.data(), N * out);
    cpu::gelu_forward(pre_naive.data(), y_naive.data(), N * out);
  }
  Dev<uint16_t> gx(x.bits), gw(w.bits), gb(b.bits), gy(N * out), gpre(N * out);
  ASSERT_OK(cuda::matmul_forward(ctx, bf(gx), bf(gw), use_bias ? bf(gb) : nullptr, bf(gy),
                                 gelu ? bf(gpre) : nullptr, N, in, out, nullptr));
  EXPECT_TRUE(within_tolerance("y", get_bf16(gy), y_ref, rounded_bf16(y_naive), DType::kBFloat16, in));
  if (gelu) {
    EXPECT_TRUE(within_tolerance("pre_gelu", get_bf16(gpre), pre_ref, rounded_bf16(pre_naive),
                                 DType::kBFloat16, in));
  }

  // dx = dy·W, and through DGELU: the gradient of a layer whose output (N, in) was a GELU's; its
  // pre-activation is a random bf16 (N, in) tensor here.
  const Bf16Data pre_in = random_bf16(N * in, rng);
  std::vector<double> dx_ref(N * in), dw_ref(out * in), db_ref(out);
  std::vector<float> dx_naive(N * in), dw_naive(out * in), db_naive(out);
  const std::vector<float> dw0 = random_floats(out * in, rng), db0 = random_floats(out, rng);
  for (size_t i = 0; i < dw0.size(); ++i) dw_ref[i] = dw_naive[i] = dw0[i];
  for (size_t i = 0; i < db0.size(); ++i) db_ref[i] = db_naive[i] = db0[i];
  cpu::matmul_backward(dy.d.data(), x.d.data(), w.d.data(), dx_ref.data(), dw_ref.data(),
                       use_bias ? db_ref.data() : nullptr, N, in, out);
  cpu::matmul_backward(dy.f.data(), x.f.data(), w.f.data(), dx_naive.data(), dw_naive.data(),
                       use_bias ? db_naive.data() : nullptr, N, in, out);
  if (gelu) {
    cpu::gelu_backward(dx_ref.data(), pre_in.d.data(), dx_ref.data(), N * in);
    cpu::gelu_backward(dx_naive.data(), pre_in.f.data(), dx_naive.data(), N * in);
  }
  Dev<uint16_t> gdy(dy.bits), gdx(N * in), gpre_in(pre_in.bits);
  ASSERT_OK(cuda::matmul_backward_input(ctx, bf(gdy), bf(gw), gelu ? bf(gpre_in) : nullptr, bf(gdx),
                                        N, in, out, nullptr));
  EXPECT_TRUE(within_tolerance("dx", get_bf16(gdx), dx_ref, rounded_bf16(dx_naive), DType::kBFloat16, out));

  Dev<float> gdw(dw0), gdb(db0);
  auto backward_weight = [&] {
    return cuda::matmul_backward_weight(ctx, bf(gdy), bf(gx), gdw.get_ptr(), use_bias ? gdb.get_ptr() : nullptr,
                                        N, in, out, true, nullptr);
  };
  ASSERT_OK(backward_weight());
  const std::vector<float> dw1 = gdw.get(), db1 = gdb.get();
  EXPECT_TRUE(within_tolerance("dweight", to_double(dw1), dw_ref, to_double(dw_naive), DType::kFloat32, N));
  if (use_bias) {
    EXPECT_TRUE(within_tolerance("dbias", to_double(db1), db_ref, to_double(db_naive), DType::kFloat32, N));
  }
  gdw.upload(dw0);
  gdb.upload(db0);
  ASSERT_OK(backward_weight());
  EXPECT_TRUE(same_bytes(gdw.get(), dw1)) << "dweight differs between two runs";
  if (use_bias) {
    EXPECT_TRUE(same_bytes(gdb.get(), db1)) << "dbias differs between two runs";
  }

  // accumulate = false overwrites (the poisoned buffer must come back finite and equal to the
  // gradient alone).
  if (!use_bias) {
    Dev<float> fresh(out * in);
    ASSERT_OK(cuda::matmul_backward_weight(ctx, bf(gdy), bf(gx), fresh.get_ptr(), nullptr, N, in, out, false, nullptr));
    std::vector<double> alone_ref(out * in, 0.0);
    std::vector<float> alone_naive(out * in, 0.0f);
    cpu::matmul_backward(dy.d.data(), x.d.data(), w.d.data(), nullptr, alone_ref.data(), nullptr, N, in, out);
    cpu::matmul_backward(dy.f.data(), x.f.data(), w.f.data(), nullptr, alone_naive.data(), nullptr, N, in, out);
    EXPECT_TRUE(within_tolerance("dweight (overwrite)", get_f32(fresh), alone_ref, to_double(alone_naive),
                                 DType::kFloat32, N));
  }

  // The weight gradient written in bf16: the same product, rounded once.
  std::vector<double> w16_ref(out * in, 0.0), b16_ref(out, 0.0);
  std::vector<float> w16_naive(out * in, 0.0f), b16_naive(out, 0.0f);
  cpu::matmul_backward(dy.d.data(), x.d.data(), w.d.data(), nullptr, w16_ref.data(),
                       use_bias ? b16_ref.data() : nullptr, N, in, out);
  cpu::matmul_backward(dy.f.data(), x.f.data(), w.f.data(), nullptr, w16_naive.data(),
                       use_bias ? b16_naive.data() : nullptr, N, in, out);
  Dev<uint16_t> gdw16(out * in), gdb16(out);
  ASSERT_OK(cuda::matmul_backward_weight(ctx, bf(gdy), bf(gx), bf(gdw16), use_bias ? bf(gdb16) : nullptr, N,
                                         in, out, false, nullptr));
  EXPECT_TRUE(within_tolerance("dweight (bf16)", get_bf16(gdw16), w16_ref, rounded_bf16(w16_naive),
                               DType::kBFloat16, N));
  if (use_bias) {
    EXPECT_TRUE(within_tolerance("dbias (bf16)", get_bf16(gdb16), b16_ref, rounded_bf16(b16_naive),
                                 DType::kBFloat16, N));
  }
  // A bf16 gradient is never accumulated.
  EXPECT_EQ(cuda::matmul_backward_weight(ctx, bf(gdy), bf(gx), bf(gdw16), nullptr, N, in, out, true, nullptr).code(),
            StatusCode::kInvalidArgument);
}

TEST(GpuOps, Matmul) {
  FLARE_SKIP_WITHOUT_CUDA();
  cuda::MatmulContext ctx;
  ASSERT_OK(ctx.init());
  check_matmul(ctx, 97, 80, 2560, true, false);
  check_matmul(ctx, 1, 64, 1600, true, true);
  check_matmul(ctx, 97, 1600, 256, true, true);
  check_matmul(ctx, 33, 77, 45, false, false);   // no size a multiple of 8
  check_matmul(ctx, 130, 2560, 96, true, false);
  check_matmul(ctx, 97, 80, 2560, true, false);  // the cached plan, second time
}

// ---- RoPE --------------------------------------------------------------------------------------

void check_rope(int64_t N, int64_t seq_len, int64_t n_head, int64_t n_kv_head, int64_t D, bool scaled) {
  SCOPED_TRACE(testing::Message() << "rope rows " << N << " seq " << seq_len << " heads " << n_head
                                  << "/" << n_kv_head << " d " << D << (scaled ? " llama3" : ""));
  std::mt19937_64 rng(test::test_seed() + N + D);
  RopeScaling scaling;
  scaling.enabled = scaled;
  const double theta = scaled ? 500000.0 : 10000.0;
  const int64_t half = D / 2;
  std::vector<double> cos_d(seq_len * half), sin_d(seq_len * half);
  std::vector<float> cos_f(seq_len * half), sin_f(seq_len * half);
  cpu::rope_table(cos_d.data(), sin_d.data(), seq_len, D, theta, scaling);
  cpu::rope_table(cos_f.data(), sin_f.data(), seq_len, D, theta, scaling);
  const int64_t width = (n_head + 2 * n_kv_head) * D;
  const Bf16Data qkv = random_bf16(N * width, rng);

  std::vector<double> ref = qkv.d;
  std::vector<float> naive = qkv.f;
  cpu::rope_forward(ref.data(), cos_d.data(), sin_d.data(), N, seq_len, n_head, n_kv_head, D);
  cpu::rope_forward(naive.data(), cos_f.data(), sin_f.data(), N, seq_len, n_head, n_kv_head, D);
  Dev<float> gcos(cos_f), gsin(sin_f);
  Dev<uint16_t> g(qkv.bits);
  ASSERT_OK(cuda::rope_forward(gcos, gsin, bf(g), N, seq_len, n_head, n_kv_head, D, nullptr));
  EXPECT_TRUE(within_tolerance("rope_forward", get_bf16(g), ref, rounded_bf16(naive), DType::kBFloat16, 2));

  std::vector<double> dref = qkv.d;
  std::vector<float> dnaive = qkv.f;
  cpu::rope_backward(dref.data(), cos_d.data(), sin_d.data(), N, seq_len, n_head, n_kv_head, D);
  cpu::rope_backward(dnaive.data(), cos_f.data(), sin_f.data(), N, seq_len, n_head, n_kv_head, D);
  g.upload(qkv.bits);
  ASSERT_OK(cuda::rope_backward(gcos, gsin, bf(g), N, seq_len, n_head, n_kv_head, D, nullptr));
  EXPECT_TRUE(within_tolerance("rope_backward", get_bf16(g), dref, rounded_bf16(dnaive), DType::kBFloat16, 2));
}

TEST(GpuOps, Rope) {
  FLARE_SKIP_WITHOUT_CUDA();
  check_rope(97, 97, 4, 2, 64, false);
  check_rope(2 * 50, 50, 8, 1, 128, true);   // GQA 8:1, LLaMA-3 scaling, two sequences
  check_rope(1, 1, 32, 32, 80, false);       // head_dim 80
  check_rope(33, 11, 3, 1, 20, false);       // half 10: pairs two at a time
  check_rope(5, 5, 2, 2, 6, true);           // half 3: one pair at a time
}

// ---- SwiGLU ------------------------------------------------------------------------------------

TEST(GpuOps, Swiglu) {
  FLARE_SKIP_WITHOUT_CUDA();
  for (const auto& s : {RowsChannels{97, 1600}, RowsChannels{1, 2560}, RowsChannels{33, 77}}) {
    const int64_t N = s.rows, F = s.channels;
    SCOPED_TRACE(testing::Message() << "swiglu rows " << N << " ffn " << F);
    std::mt19937_64 rng(test::test_seed() + N + F);
    const Bf16Data gu = random_bf16(N * 2 * F, rng, 2.0f), dy = random_bf16(N * F, rng);
    std::vector<double> y_ref(N * F), dgu_ref(N * 2 * F);
    std::vector<float> y_naive(N * F), dgu_naive(N * 2 * F);
    cpu::swiglu_forward(gu.d.data(), y_ref.data(), N, F);
    cpu::swiglu_forward(gu.f.data(), y_naive.data(), N, F);
    cpu::swiglu_backward(dy.d.data(), gu.d.data(), dgu_ref.data(), N, F);
    cpu::swiglu_backward(dy.f.data(), gu.f.data(), dgu_naive.data(), N, F);
    Dev<uint16_t> ggu(gu.bits), gy(N * F), gdy(dy.bits), gdgu(N * 2 * F);
    ASSERT_OK(cuda::swiglu_forward(bf(ggu), bf(gy), N, F, nullptr));
    ASSERT_OK(cuda::swiglu_backward(bf(gdy), bf(ggu), bf(gdgu), N, F, nullptr));
    EXPECT_TRUE(within_tolerance("swiglu y", get_bf16(gy), y_ref, rounded_bf16(y_naive), DType::kBFloat16, 1));
    EXPECT_TRUE(within_tolerance("swiglu dgate_up", get_bf16(gdgu), dgu_ref, rounded_bf16(dgu_naive),
                                 DType::kBFloat16, 1));
  }
}

// ---- embedding ---------------------------------------------------------------------------------

void check_embedding(int64_t N, int64_t seq_len, int64_t vocab, int64_t C, bool positions) {
  SCOPED_TRACE(testing::Message() << "embedding rows " << N << " seq " << seq_len << " vocab " << vocab
                                  << " channels " << C << (positions ? " +positions" : ""));
  std::mt19937_64 rng(test::test_seed() + N + vocab + C);
  // A small vocabulary against many rows: tokens repeat, so rows collect several gradients.
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> tokens(N);
  for (auto& t : tokens) t = pick(rng);
  const Bf16Data wte = random_bf16(vocab * C, rng), wpe = random_bf16(seq_len * C, rng);
  const Bf16Data dy = random_bf16(N * C, rng);

  std::vector<double> out_ref(N * C);
  std::vector<float> out_naive(N * C);
  ASSERT_OK(cpu::embedding_forward(tokens.data(), wte.d.data(), positions ? wpe.d.data() : nullptr,
                                   out_ref.data(), N, seq_len, vocab, C));
  ASSERT_OK(cpu::embedding_forward(tokens.data(), wte.f.data(), positions ? wpe.f.data() : nullptr,
                                   out_naive.data(), N, seq_len, vocab, C));
  Dev<int32_t> gtok(tokens);
  Dev<uint16_t> gwte(wte.bits), gwpe(wpe.bits), gout(N * C), gdy(dy.bits);
  ASSERT_OK(cuda::embedding_forward(gtok, bf(gwte), positions ? bf(gwpe) : nullptr, bf(gout), N,
                                    seq_len, vocab, C, nullptr));
  EXPECT_TRUE(within_tolerance("embedding out", get_bf16(gout), out_ref, rounded_bf16(out_naive),
                               DType::kBFloat16, 2));

  const std::vector<float> dwte0 = random_floats(vocab * C, rng), dwpe0 = random_floats(seq_len * C, rng);
  std::vector<double> dwte_ref = to_double(dwte0), dwpe_ref = to_double(dwpe0);
  std::vector<float> dwte_naive = dwte0, dwpe_naive = dwpe0;
  cpu::embedding_backward(dy.d.data(), tokens.data(), dwte_ref.data(), positions ? dwpe_ref.data() : nullptr,
                          N, seq_len, C);
  cpu::embedding_backward(dy.f.data(), tokens.data(), dwte_naive.data(),
                          positions ? dwpe_naive.data() : nullptr, N, seq_len, C);
  Dev<float> gdwte(dwte0), gdwpe(dwpe0);
  Dev<char> scratch(cuda::embedding_backward_scratch_bytes(vocab));
  auto backward = [&] {
    return cuda::embedding_backward(bf(gdy), gtok, gdwte.get_ptr(), positions ? gdwpe.get_ptr() : nullptr, N,
                                    seq_len, vocab, C, scratch, nullptr);
  };
  ASSERT_OK(backward());
  const std::vector<float> dwte1 = gdwte.get(), dwpe1 = gdwpe.get();
  EXPECT_TRUE(within_tolerance("dtoken_table", to_double(dwte1), dwte_ref, to_double(dwte_naive),
                               DType::kFloat32, N));
  if (positions) {
    EXPECT_TRUE(within_tolerance("dposition_table", to_double(dwpe1), dwpe_ref, to_double(dwpe_naive),
                                 DType::kFloat32, N));
  }
  gdwte.upload(dwte0);
  gdwpe.upload(dwpe0);
  ASSERT_OK(backward());
  EXPECT_TRUE(same_bytes(gdwte.get(), dwte1)) << "dtoken_table differs between two runs";
  EXPECT_TRUE(same_bytes(gdwpe.get(), dwpe1)) << "dposition_table differs between two runs";

  // bf16 tables: each element's old value plus its fp32 sum, rounded once. The starting values
  // are bf16 (what a bf16 table holds), so the reference starts from the same numbers.
  std::vector<uint16_t> wte_bits(dwte0.size()), wpe_bits(dwpe0.size());
  std::vector<double> wte16_ref(dwte0.size()), wpe16_ref(dwpe0.size());
  std::vector<float> wte16_naive(dwte0.size()), wpe16_naive(dwpe0.size());
  for (size_t i = 0; i < wte_bits.size(); ++i) {
    wte_bits[i] = float_to_bf16(dwte0[i]);
    wte16_ref[i] = wte16_naive[i] = bf16_to_float(wte_bits[i]);
  }
  for (size_t i = 0; i < wpe_bits.size(); ++i) {
    wpe_bits[i] = float_to_bf16(dwpe0[i]);
    wpe16_ref[i] = wpe16_naive[i] = bf16_to_float(wpe_bits[i]);
  }
  cpu::embedding_backward(dy.d.data(), tokens.data(), wte16_ref.data(), positions ? wpe16_ref.data() : nullptr,
                          N, seq_len, C);
  cpu::embedding_backward(dy.f.data(), tokens.data(), wte16_naive.data(),
                          positions ? wpe16_naive.data() : nullptr, N, seq_len, C);
  Dev<uint16_t> gwte16(wte_bits), gwpe16(wpe_bits);
  ASSERT_OK(cuda::embedding_backward(bf(gdy), gtok, bf(gwte16), positions ? bf(gwpe16) : nullptr, N, seq_len,
                                     vocab, C, scratch, nullptr));
  EXPECT_TRUE(within_tolerance("dtoken_table (bf16)", get_bf16(gwte16), wte16_ref, rounded_bf16(wte16_naive),
                               DType::kBFloat16, N));
  if (positions) {
    EXPECT_TRUE(within_tolerance("dposition_table (bf16)", get_bf16(gwpe16), wpe16_ref,
                                 rounded_bf16(wpe16_naive), DType::kBFloat16, N));
  }
}

TEST(GpuOps, Embedding) {
  FLARE_SKIP_WITHOUT_CUDA();
  check_embedding(97, 97, 50, 2560, true);
  check_embedding(4 * 300, 300, 37, 1600, true);  // > 256 rows: owners scan several steps
  check_embedding(1, 1, 5, 77, false);
  check_embedding(600, 200, 3, 121, false);       // hundreds of repeats per row
}

// ---- classifier --------------------------------------------------------------------------------

void check_classifier(int64_t N, int64_t vocab, int64_t padded) {
  SCOPED_TRACE(testing::Message() << "classifier rows " << N << " vocab " << vocab << " padded " << padded);
  std::mt19937_64 rng(test::test_seed() + N + vocab);
  const Bf16Data logits = random_bf16(N * padded, rng, 3.0f);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> targets(N);
  for (int64_t i = 0; i < N; ++i) targets[i] = (N > 1 && i % 5 == 3) ? -1 : pick(rng);  // some ignored

  std::vector<double> loss_ref(N), d_ref(N * padded);
  std::vector<float> loss_naive(N), d_naive(N * padded);
  cpu::ClassifierResult r_ref, r_naive;
  ASSERT_OK(cpu::classifier_forward_backward(logits.d.data(), targets.data(), loss_ref.data(),
                                             d_ref.data(), &r_ref, N, vocab, padded));
  ASSERT_OK(cpu::classifier_forward_backward(logits.f.data(), targets.data(), loss_naive.data(),
                                             d_naive.data(), &r_naive, N, vocab, padded));
  ASSERT_GT(r_ref.n_valid, 0);
  const float scale = 1.0f / static_cast<float>(r_ref.n_valid);
  Dev<uint16_t> g(logits.bits);
  Dev<int32_t> gt(targets);
  Dev<float> gloss(N);
  auto run = [&] {
    return cuda::classifier_forward_backward(bf(g), gt, gloss, N, vocab, padded, scale, true, nullptr);
  };
  ASSERT_OK(run());
  const std::vector<uint16_t> d1 = g.get();
  const std::vector<float> loss1 = gloss.get();
  EXPECT_TRUE(within_tolerance("losses", to_double(loss1), loss_ref, to_double(loss_naive), DType::kFloat32, vocab));
  EXPECT_TRUE(within_tolerance("dlogits", bits_to_double(d1), d_ref, rounded_bf16(d_naive), DType::kBFloat16, vocab));
  double mean = 0.0;
  for (float l : loss1) mean += l;
  mean /= static_cast<double>(r_ref.n_valid);
  EXPECT_NEAR(mean, r_ref.mean_loss, 1e-5 * std::max(1.0, std::fabs(r_ref.mean_loss)));
  g.upload(logits.bits);
  ASSERT_OK(run());
  EXPECT_TRUE(same_bytes(g.get(), d1)) << "dlogits differ between two runs";
  EXPECT_TRUE(same_bytes(gloss.get(), loss1)) << "losses differ between two runs";
  // Forward only: the logits stay as they were.
  g.upload(logits.bits);
  ASSERT_OK(cuda::classifier_forward_backward(bf(g), gt, gloss, N, vocab, padded, scale, false, nullptr));
  EXPECT_TRUE(same_bytes(g.get(), logits.bits)) << "write_dlogits = false changed the logits";
}

TEST(GpuOps, Classifier) {
  FLARE_SKIP_WITHOUT_CUDA();
  check_classifier(97, 50257, 50304);
  check_classifier(1, 1000, 1024);
  check_classifier(7, 1001, 1003);  // padded row not a multiple of 8: the scalar path
}

// ---- optimizer ---------------------------------------------------------------------------------

ParameterLayout small_layout() {
  // Three tensors with gaps between them (as the layout's 64-element alignment leaves), one
  // longer than a chunk, decay on two.
  ParameterLayout layout;
  auto add = [&](const char* name, int64_t numel, bool decay) {
    ParamSpec p;
    p.name = name;
    p.shape = {numel};
    p.offset = layout.total;
    p.numel = numel;
    p.weight_decay = decay;
    layout.params.push_back(p);
    layout.total += (numel + 63) / 64 * 64;
  };
  add("a.weight", 3 * cuda::DeviceChunkTable::kChunkElements + 77, true);
  add("a.bias", 97, false);
  add("b.weight", 2560 * 13, true);
  return layout;
}

// The norm and AdamW against core's, from fp32 gradients or bf16 ones (the reference then reads
// the same bf16 values).
void check_norm_and_adamw(bool bf16_grads) {
  SCOPED_TRACE(bf16_grads ? "bf16 gradients" : "fp32 gradients");
  const ParameterLayout layout = small_layout();
  const size_t n = layout.total;
  std::mt19937_64 rng(test::test_seed());
  std::vector<float> grads = random_floats(n, rng, 0.01f), master = random_floats(n, rng, 0.02f);
  std::vector<float> m = random_floats(n, rng, 0.001f), v(n);
  for (float& x : v) x = std::fabs(random_floats(1, rng, 1e-5f)[0]);
  std::vector<uint16_t> grad_bits(n);
  for (size_t i = 0; i < n; ++i) {
    grad_bits[i] = float_to_bf16(grads[i]);
    if (bf16_grads) grads[i] = bf16_to_float(grad_bits[i]);
  }

  cuda::DeviceChunkTable table;
  ASSERT_OK(table.init(layout));
  Dev<float> ggrads32(grads), gnorm(2);
  Dev<uint16_t> ggrads16(grad_bits);
  struct {
    Dev<float>* f32;
    Dev<uint16_t>* b16;
    bool use_b16;
    cuda::GradientIn get_ptr() const {
      return use_b16 ? cuda::GradientIn(bf(*b16)) : cuda::GradientIn(f32->get_ptr());
    }
  } ggrads{&ggrads32, &ggrads16, bf16_grads};
  Dev<char> scratch(cuda::gradient_norm_scratch_bytes(table));
  const double max_norm = 0.5;
  ASSERT_OK(cuda::gradient_norm(table, ggrads.get_ptr(), max_norm, gnorm, scratch, nullptr));
  const std::vector<float> norm1 = gnorm.get();
  const double norm_ref = gradient_norm(layout, grads.data());
  const float scale_ref = clip_scale(norm_ref, max_norm);
  EXPECT_TRUE(within_tolerance("grad norm", {norm1[0]}, {norm_ref}, {norm_ref}, DType::kFloat32, 1));
  EXPECT_TRUE(within_tolerance("clip scale", {norm1[1]}, {scale_ref}, {scale_ref}, DType::kFloat32, 1));
  ASSERT_OK(cuda::gradient_norm(table, ggrads.get_ptr(), max_norm, gnorm, scratch, nullptr));
  EXPECT_TRUE(same_bytes(gnorm.get(), norm1)) << "the gradient norm differs between two runs";

  AdamWStep step;
  step.t = 3;
  step.lr = 3e-4;
  step.weight_decay = 0.1;
  step.grad_scale = 0.5f;  // e.g. 1 / loss scale; times the clip scale read from the device
  // The master as the GPU holds it: its bf16 weights and low halves (split_master.h), gaps included.
  std::vector<uint16_t> halves_w(n), halves_low(n);
  for (size_t i = 0; i < n; ++i) {
    const SplitMaster h = split_master(master[i]);
    halves_w[i] = h.weight;
    halves_low[i] = h.low;
  }
  std::vector<float> master_ref = master, m_ref = m, v_ref = v;
  std::vector<uint16_t> w_ref = halves_w;  // the reference writes the tensors' elements, not the gaps
  AdamWStep cpu_step = step;
  cpu_step.grad_scale = step.grad_scale * norm1[1];
  ASSERT_OK(adamw_step(layout, cpu_step, grads.data(), master_ref.data(), m_ref.data(), v_ref.data(),
                       w_ref.data()));
  Dev<float> gm(m), gv(v);
  Dev<uint16_t> gw(halves_w), glow(halves_low);
  ASSERT_OK(cuda::adamw_update(table, step, gnorm.get_ptr() + 1, ggrads.get_ptr(), bf(gw), glow, gm, gv, nullptr));
  const std::vector<uint16_t> w_after = gw.get(), low_after = glow.get();
  std::vector<float> master_after(n);
  for (size_t i = 0; i < n; ++i) master_after[i] = join_master(w_after[i], low_after[i]);
  EXPECT_TRUE(within_tolerance("master", to_double(master_after), to_double(master_ref), to_double(master_ref),
                               DType::kFloat32, 1));
  EXPECT_TRUE(within_tolerance("m", get_f32(gm), to_double(m_ref), to_double(m_ref), DType::kFloat32, 1));
  EXPECT_TRUE(within_tolerance("v", get_f32(gv), to_double(v_ref), to_double(v_ref), DType::kFloat32, 1));
  EXPECT_TRUE(within_tolerance("weights", get_bf16(gw), bits_to_double(w_ref), bits_to_double(w_ref),
                               DType::kBFloat16, 1));
  for (const ParamSpec& p : layout.params) {
    for (int64_t i = p.offset; i < p.offset + p.numel; ++i) {
      // The weight is the new master rounded to nearest even, and the low half is never a tie.
      ASSERT_EQ(w_after[i], float_to_bf16(master_after[i])) << "element " << i;
      ASSERT_NE(low_after[i], 0x8000u) << "element " << i;
    }
    // The gaps between tensors keep their contents.
    const int64_t gap_end = p.offset + (p.numel + 63) / 64 * 64;
    for (int64_t i = p.offset + p.numel; i < gap_end; ++i) {
      ASSERT_EQ(w_after[i], halves_w[i]) << "gap element " << i << " written";
      ASSERT_EQ(low_after[i], halves_low[i]) << "gap element " << i << " written";
    }
  }
}

TEST(GpuOps, GradientNormAndAdamW) {
  FLARE_SKIP_WITHOUT_CUDA();
  check_norm_and_adamw(false);
  check_norm_and_adamw(true);
}

// ---- argument checks (no device needed: rejected before any device work) ----------------------

TEST(GpuOpsArguments, RejectsBadSizesNamingTheArgument) {
  // Non-null dummies: a rejected call never dereferences them.
  auto* p = reinterpret_cast<bf16*>(uintptr_t{256});
  auto* f = reinterpret_cast<float*>(uintptr_t{256});
  auto* i = reinterpret_cast<int32_t*>(uintptr_t{256});
  auto expect_invalid = [](const Status& s, const std::string& word) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find(word), std::string::npos) << s.message() << " should name " << word;
  };
  expect_invalid(cuda::layernorm_forward(p, p, p, p, f, f, 0, 64, 1e-5f, nullptr), "rows");
  expect_invalid(cuda::rmsnorm_forward(p, p, p, f, 4, 0, 1e-5f, nullptr), "channels");
  expect_invalid(cuda::rmsnorm_forward(p, p, p, f, 4, 64, -1.0f, nullptr), "eps");
  expect_invalid(cuda::layernorm_backward(p, p, p, f, f, nullptr, p, f, nullptr, 4, 64, true, f, nullptr),
                 "dbias");
  expect_invalid(cuda::rope_forward(f, f, p, 4, 4, 2, 2, 63, nullptr), "head_dim");
  expect_invalid(cuda::rope_forward(f, f, p, 4, 0, 2, 2, 64, nullptr), "seq_len");
  expect_invalid(cuda::swiglu_forward(p, p, 0, 64, nullptr), "rows");
  expect_invalid(cuda::embedding_forward(i, p, p, p, 4, 4, 0, 64, nullptr), "vocab_size");
  expect_invalid(cuda::classifier_forward_backward(p, i, f, 4, 60000, 50304, 1.0f, true, nullptr),
                 "vocab_size");
  cuda::MatmulContext ctx;  // not initialised: the size rules come first
  expect_invalid(cuda::matmul_forward(ctx, p, p, p, p, p, 4, 64, 100, nullptr), "out");
  expect_invalid(cuda::matmul_backward_input(ctx, p, p, p, p, 4, 100, 64, nullptr), "in");
  expect_invalid(cuda::matmul_forward(ctx, p, p, nullptr, p, nullptr, 0, 64, 64, nullptr), "tokens");
  expect_invalid(cuda::matmul_forward(ctx, p, p, nullptr, p, nullptr, 4, 64, 64, nullptr), "init");
}

}  // namespace
}  // namespace flare::train
