// train_ops_bench.cu — times the trainer's CUDA operators at GPT-3 2.7B's shapes (tokens 4096,
// d_model 2560, 32 heads of 80, ffn 10240, vocab 50257 padded to 50304) and prints one line per
// operator: median time of 20 runs after 3 warm-ups (CUDA events), the bytes the operator must
// move at least, and the achieved GB/s. These operators are memory-bound: compare GB/s with the
// card's HBM bandwidth (H100 SXM: 3350 GB/s); a figure above it means the count or the timing is
// wrong. The matmuls print TFLOP/s instead. Inputs are random-free (constant fills): timing only.
//
// Usage: train_ops_bench [--json PATH]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "train/cuda/adamw.h"
#include "train/cuda/classifier.h"
#include "train/cuda/embedding.h"
#include "train/cuda/matmul.h"
#include "train/cuda/norm.h"
#include "train/cuda/rope.h"
#include "train/cuda/swiglu.h"

namespace {

using flare::Status;
using flare::train::cuda::bf16;
namespace tc = flare::train::cuda;

constexpr int64_t kTokens = 4096, kSeq = 1024, kD = 2560, kHeads = 32, kHeadDim = 80;
constexpr int64_t kFfn = 10240, kVocab = 50257, kPadded = 50304;

void* device_alloc(size_t bytes) {
  void* p = nullptr;
  if (cudaMalloc(&p, bytes) != cudaSuccess) {
    std::fprintf(stderr, "cudaMalloc of %zu bytes failed\n", bytes);
    std::exit(1);
  }
  cudaMemset(p, 0, bytes);
  return p;
}
bf16* bf_alloc(int64_t n) { return static_cast<bf16*>(device_alloc(n * sizeof(bf16))); }
float* f_alloc(int64_t n) { return static_cast<float*>(device_alloc(n * sizeof(float))); }

struct Row {
  std::string op;
  double ms, bytes, flops;
};
std::vector<Row> rows;

void time_op(const std::string& name, double bytes, double flops, const std::function<Status()>& op) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int i = 0; i < 3; ++i) {
    const Status s = op();
    if (!s.ok()) {
      std::printf("%-28s rejected: %s\n", name.c_str(), s.to_string().c_str());
      return;
    }
  }
  std::vector<float> ms(20);
  for (float& t : ms) {
    cudaEventRecord(start);
    (void)op();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    cudaEventElapsedTime(&t, start, stop);
  }
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  rows.push_back({name, med, bytes, flops});
  if (flops > 0)
    std::printf("%-28s %9.3f ms %10.1f TFLOP/s\n", name.c_str(), med, flops / med / 1e9);
  else
    std::printf("%-28s %9.3f ms %10.1f MB %8.0f GB/s\n", name.c_str(), med, bytes / 1e6, bytes / med / 1e6);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

}  // namespace

int main(int argc, char** argv) {
  const char* json = nullptr;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--json") == 0) json = argv[i + 1];
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device\n");
    return 0;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("card: %s; tokens %lld, d %lld, ffn %lld, vocab %lld (padded %lld)\n", prop.name,
              static_cast<long long>(kTokens), static_cast<long long>(kD), static_cast<long long>(kFfn),
              static_cast<long long>(kVocab), static_cast<long long>(kPadded));

  const int64_t N = kTokens, C = kD, NC = N * C;
  bf16 *x = bf_alloc(NC), *x2 = bf_alloc(NC), *y = bf_alloc(NC), *res = bf_alloc(NC), *dy = bf_alloc(NC);
  bf16 *dx = bf_alloc(NC), *w = bf_alloc(C), *b = bf_alloc(C);
  float *mean = f_alloc(N), *rstd = f_alloc(N), *dw = f_alloc(C), *db = f_alloc(C);
  void* norm_scratch = device_alloc(tc::norm_backward_scratch_bytes(N, C));
  const cudaStream_t s = nullptr;
  const double bNC = 2.0 * NC;  // bytes of one (tokens, d) bf16 tensor

  time_op("layernorm_forward", 2 * bNC, 0, [&] { return tc::layernorm_forward(x, w, b, y, mean, rstd, N, C, 1e-5f, s); });
  time_op("residual_layernorm_forward", 4 * bNC, 0, [&] {
    return tc::residual_layernorm_forward(x, x2, w, b, res, y, mean, rstd, N, C, 1e-5f, s);
  });
  time_op("layernorm_backward", 6 * bNC, 0, [&] {
    return tc::layernorm_backward(dy, x, w, mean, rstd, dx, dx, dw, db, N, C, true, norm_scratch, s);
  });
  time_op("rmsnorm_forward", 2 * bNC, 0, [&] { return tc::rmsnorm_forward(x, w, y, rstd, N, C, 1e-5f, s); });
  time_op("rmsnorm_backward", 6 * bNC, 0, [&] {
    return tc::rmsnorm_backward(dy, x, w, rstd, dx, dx, dw, N, C, true, norm_scratch, s);
  });

  // RoPE on a LLaMA-style qkv of the same width (32 q, 32 k, 32 v heads of 80).
  const int64_t qkv_width = 3 * kHeads * kHeadDim;
  bf16* qkv = bf_alloc(N * qkv_width);
  float *cos_t = f_alloc(kSeq * kHeadDim / 2), *sin_t = f_alloc(kSeq * kHeadDim / 2);
  const double rope_bytes = 2.0 * 2 * N * 2 * kHeads * kHeadDim;  // q and k read and written
  time_op("rope_forward", rope_bytes, 0, [&] { return tc::rope_forward(cos_t, sin_t, qkv, N, kSeq, kHeads, kHeads, kHeadDim, s); });
  time_op("rope_backward", rope_bytes, 0, [&] { return tc::rope_backward(cos_t, sin_t, qkv, N, kSeq, kHeads, kHeads, kHeadDim, s); });

  bf16 *gate_up = bf_alloc(N * 2 * kFfn), *h = bf_alloc(N * kFfn), *dgate_up = bf_alloc(N * 2 * kFfn);
  const double bNF = 2.0 * N * kFfn;
  time_op("swiglu_forward", 3 * bNF, 0, [&] { return tc::swiglu_forward(gate_up, h, N, kFfn, s); });
  time_op("swiglu_backward", 5 * bNF, 0, [&] { return tc::swiglu_backward(h, gate_up, dgate_up, N, kFfn, s); });

  std::vector<int32_t> host_tokens(N);
  for (int64_t i = 0; i < N; ++i) host_tokens[i] = static_cast<int32_t>((i * 7919) % kVocab);
  auto* tokens = static_cast<int32_t*>(device_alloc(N * sizeof(int32_t)));
  cudaMemcpy(tokens, host_tokens.data(), N * sizeof(int32_t), cudaMemcpyHostToDevice);
  bf16 *wte = bf_alloc(kPadded * C), *wpe = bf_alloc(kSeq * C);
  float *dwte = f_alloc(kPadded * C), *dwpe = f_alloc(kSeq * C);
  void* emb_scratch = device_alloc(tc::embedding_backward_scratch_bytes(kVocab));
  time_op("embedding_forward", 3 * bNC, 0, [&] { return tc::embedding_forward(tokens, wte, wpe, y, N, kSeq, kVocab, C, s); });
  // dout once, the fp32 table rows read and written, the position rows read and written.
  time_op("embedding_backward", bNC + 8.0 * NC + 8.0 * kSeq * C, 0, [&] {
    return tc::embedding_backward(dy, tokens, dwte, dwpe, N, kSeq, kVocab, C, emb_scratch, s);
  });

  bf16* logits = bf_alloc(N * kPadded);
  float* losses = f_alloc(N);
  time_op("classifier (in place)", 2.0 * 2 * N * kPadded, 0, [&] {
    return tc::classifier_forward_backward(logits, tokens, losses, N, kVocab, kPadded, 1.0f / N, true, s);
  });

  tc::MatmulContext ctx;
  if (!ctx.init().ok()) return 1;
  bf16 *fc_out = bf_alloc(N * kFfn), *pre = bf_alloc(N * kFfn);
  float *dw_fc = f_alloc(kFfn * C), *db_fc = f_alloc(kFfn);
  bf16* w_fc = bf_alloc(kFfn * C);
  bf16* b_fc = bf_alloc(kFfn);
  const double fc_flops = 2.0 * N * C * kFfn;
  time_op("matmul fc fwd gelu+bias", 0, fc_flops, [&] { return tc::matmul_forward(ctx, x, w_fc, b_fc, fc_out, pre, N, C, kFfn, s); });
  time_op("matmul fc bwd input dgelu", 0, fc_flops, [&] { return tc::matmul_backward_input(ctx, fc_out, w_fc, nullptr, dx, N, C, kFfn, s); });
  time_op("matmul fc bwd weight+bias", 0, fc_flops, [&] {
    return tc::matmul_backward_weight(ctx, fc_out, x, dw_fc, db_fc, N, C, kFfn, true, s);
  });
  time_op("bias_gradient (fc)", 2.0 * N * kFfn, 0, [&] {
    return tc::bias_gradient(fc_out, db_fc, N, kFfn, true, norm_scratch, s);
  });

  // Weight gradients written in fp32 (the trainer's) against bf16 (cuBLASLt's bf16-output kernels)
  // at GPT-3 2.7B's and LLaMA-3.2 1B's (b4 s4096) products: tokens, in, out.
  struct DwShape {
    const char* name;
    int64_t tokens, in, out;
  };
  const DwShape dw_shapes[] = {
      {"gpt3 qkv", N, kD, 3 * kD},           {"gpt3 proj", N, kD, kD},
      {"gpt3 fc", N, kD, kFfn},              {"gpt3 fc2", N, kFfn, kD},
      {"llama1b qkv", 16384, 2048, 3072},    {"llama1b o", 16384, 2048, 2048},
      {"llama1b gate_up", 16384, 2048, 16384}, {"llama1b down", 16384, 8192, 2048},
  };
  for (const DwShape& d : dw_shapes) {
    bf16 *dy = bf_alloc(d.tokens * d.out), *xin = bf_alloc(d.tokens * d.in), *dw16 = bf_alloc(d.in * d.out);
    float* dw32 = f_alloc(d.in * d.out);
    const double flops = 2.0 * d.tokens * d.in * d.out;
    time_op(std::string("dW fp32 ") + d.name, 0, flops, [&] {
      return tc::matmul_backward_weight(ctx, dy, xin, dw32, nullptr, d.tokens, d.in, d.out, false, s);
    });
    time_op(std::string("dW bf16 ") + d.name, 0, flops, [&] {
      return tc::matmul_backward_weight(ctx, dy, xin, dw16, nullptr, d.tokens, d.in, d.out, false, s);
    });
    cudaFree(dy);
    cudaFree(xin);
    cudaFree(dw16);
    cudaFree(dw32);
  }

  // The optimizer over one tenth of GPT-3 2.7B (265M parameters) in 4 tensors.
  flare::train::ParameterLayout layout;
  const int64_t per_tensor = 66'250'000;
  for (int i = 0; i < 4; ++i) {
    flare::train::ParamSpec p;
    p.name = "tensor";
    p.name += std::to_string(i);
    p.shape = {per_tensor};
    p.offset = layout.total;
    p.numel = per_tensor;
    p.weight_decay = i % 2 == 0;
    layout.params.push_back(p);
    layout.total += per_tensor;
  }
  const int64_t P = layout.total;
  tc::DeviceChunkTable table;
  if (!table.init(layout).ok()) return 1;
  float *grads = f_alloc(P), *m = f_alloc(P), *v = f_alloc(P), *norm = f_alloc(2);
  bf16* weights = bf_alloc(P);  // with low: the fp32 master's two halves (split_master.h)
  auto* low = static_cast<uint16_t*>(device_alloc(static_cast<size_t>(P) * sizeof(uint16_t)));
  void* norm_partials = device_alloc(tc::gradient_norm_scratch_bytes(table));
  time_op("gradient_norm (265M)", 4.0 * P, 0, [&] { return tc::gradient_norm(table, grads, 1.0, norm, norm_partials, s); });
  flare::train::AdamWStep step;
  step.lr = 1e-4;
  step.weight_decay = 0.1;
  time_op("adamw_update (265M)", 28.0 * P, 0, [&] {
    return tc::adamw_update(table, step, norm + 1, grads, weights, low, m, v, s);
  });

  if (json) {
    FILE* f = std::fopen(json, "w");
    if (f) {
      std::fprintf(f, "{\"card\": \"%s\", \"benchmark\": \"train_ops\", \"rows\": [\n", prop.name);
      for (size_t i = 0; i < rows.size(); ++i)
        std::fprintf(f, "  {\"op\": \"%s\", \"ms\": %.5f, \"bytes\": %.0f, \"flops\": %.0f}%s\n",
                     rows[i].op.c_str(), rows[i].ms, rows[i].bytes, rows[i].flops,
                     i + 1 < rows.size() ? "," : "");
      std::fprintf(f, "]}\n");
      std::fclose(f);
    }
  }
  return 0;
}
