// matmul.cpp — the cuBLASLt plans behind matmul.h.
//
// cuBLASLt is column-major; a row-major (r, c) matrix is the column-major (c, r) one, so each
// pass is written on the transposed problem:
//   forward          yᶜ (out × tokens)  = Wᶜᵀ · xᶜ      A = W (in × out, op T), B = x (in × tokens)
//   backward input   dxᶜ (in × tokens)  = Wᶜ · dyᶜ      A = W (in × out),       B = dy (out × tokens)
//   backward weight  dWᶜ (in × out)     = xᶜ · dyᶜᵀ     A = x (in × tokens),    B = dy (out × tokens, op T)
// The bias of the forward is then a vector along m (out), as cuBLASLt's BIAS epilogue wants.
#include "train/cuda/matmul.h"

#include <cublasLt.h>

#include <map>
#include <tuple>

#include "core/message.h"

namespace flare::train::cuda {

namespace {

enum class Pass : int { kForward, kBackwardInput, kBackwardWeight };

// Everything that decides a plan. Alignments are the largest power of two (≤ 16) dividing each
// pointer: cuBLASLt picks kernels for the alignment it is promised.
struct PlanKey {
  Pass pass;
  int epilogue;  // cublasLtEpilogue_t
  int d_type;    // cudaDataType_t of the output
  int64_t m, n, k;
  bool accumulate;
  int align_a, align_b, align_c, align_bias, align_aux;
  auto tie() const {
    return std::tie(pass, epilogue, d_type, m, n, k, accumulate, align_a, align_b, align_c, align_bias,
                    align_aux);
  }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // c also describes D
  cublasLtMatmulAlgo_t algo{};
};

int alignment(const void* p) {
  const auto u = reinterpret_cast<uintptr_t>(p);
  for (int a = 16; a > 1; a /= 2)
    if (u % a == 0) return a;
  return 1;
}

const char* cublas_name(cublasStatus_t s) { return cublasLtGetStatusName(s); }

void destroy(Plan& plan) {
  if (plan.desc) cublasLtMatmulDescDestroy(plan.desc);
  if (plan.a) cublasLtMatrixLayoutDestroy(plan.a);
  if (plan.b) cublasLtMatrixLayoutDestroy(plan.b);
  if (plan.c) cublasLtMatrixLayoutDestroy(plan.c);
  plan = Plan{};
}

}  // namespace

struct MatmulContext::State {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::map<PlanKey, Plan> plans;

  ~State() {
    for (auto& entry : plans) destroy(entry.second);
    if (workspace) cudaFree(workspace);
    if (handle) cublasLtDestroy(handle);
  }
};

MatmulContext::MatmulContext() = default;
MatmulContext::~MatmulContext() = default;

Status MatmulContext::init() {
  if (state_) return Status::ok_status();
  auto s = std::make_unique<State>();
  const cublasStatus_t st = cublasLtCreate(&s->handle);
  if (st != CUBLAS_STATUS_SUCCESS) return Status::device_error(cat("cublasLtCreate: ", cublas_name(st)));
  FLARE_RETURN_IF_ERROR(
      cuda_status(kCudaContext, "matmul workspace", cudaMalloc(&s->workspace, kWorkspaceBytes)));
  state_ = std::move(s);
  return Status::ok_status();
}

namespace {

// One matmul call, in cuBLASLt's column-major terms.
struct Call {
  Pass pass;
  cublasLtEpilogue_t epilogue;
  cublasOperation_t op_a, op_b;
  int64_t m, n, k;
  const void* a;
  int64_t lda, a_rows, a_cols;  // the stored matrix, before op
  const void* b;
  int64_t ldb, b_rows, b_cols;
  void* d;  // C = D
  int64_t ldd;
  cudaDataType_t d_type;
  const void* bias;  // forward bias (read, bf16), BGRADB's bias gradient (written, fp32), or null
  const void* aux;   // pre-GELU buffer (written by GELU_AUX, read by DGELU), or null
  int64_t ld_aux;
  bool accumulate;
};

#define FLARE_CUBLAS(expr)                                                              \
  do {                                                                                  \
    const cublasStatus_t st_ = (expr);                                                  \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                   \
      return Status::device_error(cat(what, ": ", #expr, ": ", cublas_name(st_)));      \
  } while (0)

Status set_pointers(const Plan& plan, const Call& c, const char* what) {
  if (c.bias)
    FLARE_CUBLAS(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                &c.bias, sizeof c.bias));
  if (c.aux)
    FLARE_CUBLAS(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                &c.aux, sizeof c.aux));
  return Status::ok_status();
}

// Sets one attribute of a heuristic preference unless an earlier step failed (*st holds the
// first failure, and the preference is destroyed whatever happened).
template <typename T>
void set_preference(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
                    const T& value, cublasStatus_t* st) {
  if (*st == CUBLAS_STATUS_SUCCESS)
    *st = cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof value);
}

// A call cuBLASLt's heuristic found no algorithm for (the BGRADB epilogue falls back on it).
Status no_algorithm(const Call& c, const char* what) {
  return Status::unsupported(cat(what, ": cuBLASLt has no algorithm for m = ", c.m, ", n = ", c.n,
                                   ", k = ", c.k, ", epilogue ", static_cast<int>(c.epilogue)));
}

// Builds the descriptors of a call and asks the heuristic for its algorithm (first call of a
// shape only).
Status make_plan(MatmulContext::State& s, const Call& c, Plan* plan, const char* what) {
  FLARE_CUBLAS(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  FLARE_CUBLAS(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &c.op_a,
                                              sizeof c.op_a));
  FLARE_CUBLAS(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &c.op_b,
                                              sizeof c.op_b));
  FLARE_CUBLAS(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                              &c.epilogue, sizeof c.epilogue));
  if (c.bias) {
    // The forward's bias is bf16; BGRADB's bias gradient has the output's type.
    const cudaDataType_t bias_type = c.epilogue == CUBLASLT_EPILOGUE_BGRADB ? c.d_type : CUDA_R_16BF;
    FLARE_CUBLAS(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                &bias_type, sizeof bias_type));
  }
  if (c.aux) {
    const cudaDataType_t aux_type = CUDA_R_16BF;
    FLARE_CUBLAS(cublasLtMatmulDescSetAttribute(
        plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &aux_type, sizeof aux_type));
    FLARE_CUBLAS(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                                &c.ld_aux, sizeof c.ld_aux));
  }
  FLARE_RETURN_IF_ERROR(set_pointers(*plan, c, what));
  FLARE_CUBLAS(cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_16BF, c.a_rows, c.a_cols, c.lda));
  FLARE_CUBLAS(cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_16BF, c.b_rows, c.b_cols, c.ldb));
  FLARE_CUBLAS(cublasLtMatrixLayoutCreate(&plan->c, c.d_type, c.m, c.n, c.ldd));

  cublasLtMatmulPreference_t pref = nullptr;
  FLARE_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t workspace = MatmulContext::kWorkspaceBytes;
  // Split-K in place on the output is left out: every other scheme reduces in a fixed order.
  const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_MASK & ~uint32_t{CUBLASLT_REDUCTION_SCHEME_INPLACE};
  const uint32_t align_a = alignment(c.a), align_b = alignment(c.b), align_d = alignment(c.d);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
  set_preference(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace, &st);
  set_preference(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, schemes, &st);
  set_preference(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a, &st);
  set_preference(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b, &st);
  set_preference(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d, &st);
  set_preference(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d, &st);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulAlgoGetHeuristic(s.handle, plan->desc, plan->a, plan->b, plan->c, plan->c,
                                        pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS)
    return Status::device_error(cat(what, ": cuBLASLt heuristic: ", cublas_name(st)));
  if (found == 0)
    return no_algorithm(c, what);
  plan->algo = result.algo;
  return Status::ok_status();
}

Status run(MatmulContext& ctx, const Call& c, cudaStream_t stream, const char* what) {
  MatmulContext::State* s = ctx.state();
  if (s == nullptr) return invalid(what, ": the MatmulContext is not initialised (call init())");
  const PlanKey key{c.pass, static_cast<int>(c.epilogue), static_cast<int>(c.d_type), c.m, c.n, c.k, c.accumulate,
                    alignment(c.a), alignment(c.b), alignment(c.d),
                    c.bias ? alignment(c.bias) : 0, c.aux ? alignment(c.aux) : 0};
  auto it = s->plans.find(key);
  if (it == s->plans.end()) {
    Plan plan;
    const Status made = make_plan(*s, c, &plan, what);
    if (!made.ok()) {
      destroy(plan);
      // No algorithm is remembered (an empty plan), so the heuristic is not asked again.
      if (made.code() == StatusCode::kUnsupported) s->plans.emplace(key, plan);
      return made;
    }
    it = s->plans.emplace(key, plan).first;
  } else if (it->second.desc == nullptr) {
    return no_algorithm(c, what);
  } else {
    FLARE_RETURN_IF_ERROR(set_pointers(it->second, c, what));
  }
  const Plan& plan = it->second;
  const float alpha = 1.0f;
  const float beta = c.accumulate ? 1.0f : 0.0f;
  FLARE_CUBLAS(cublasLtMatmul(s->handle, plan.desc, &alpha, c.a,
                              plan.a, c.b, plan.b, &beta, c.d, plan.c, c.d, plan.c, &plan.algo,
                              s->workspace, MatmulContext::kWorkspaceBytes, stream));
  return Status::ok_status();
}

Status check_sizes(const char* what, int64_t tokens, int64_t in, int64_t out) {
  if (tokens < 1) return invalid(what, ": tokens = ", tokens, " must be >= 1");
  if (in < 1) return invalid(what, ": in = ", in, " must be >= 1");
  if (out < 1) return invalid(what, ": out = ", out, " must be >= 1");
  return Status::ok_status();
}

Status check_pointer(const char* what, const char* name, const void* p) {
  if (p == nullptr) return invalid(what, ": ", name, " is null");
  return Status::ok_status();
}

}  // namespace

Status matmul_forward(MatmulContext& ctx, const bf16* x, const bf16* weight, const bf16* bias,
                      bf16* y, bf16* pre_gelu, int64_t tokens, int64_t in, int64_t out,
                      cudaStream_t stream) {
  const char* what = "matmul_forward";
  FLARE_RETURN_IF_ERROR(check_sizes(what, tokens, in, out));
  FLARE_RETURN_IF_ERROR(check_pointer(what, "x", x));
  FLARE_RETURN_IF_ERROR(check_pointer(what, "weight", weight));
  FLARE_RETURN_IF_ERROR(check_pointer(what, "y", y));
  if (pre_gelu && out % 8 != 0)
    return invalid(what, ": out = ", out, " must be a multiple of 8 with pre_gelu (cuBLASLt's aux rule)");
  Call c{};
  c.pass = Pass::kForward;
  c.epilogue = pre_gelu ? (bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX)
                        : (bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT);
  c.op_a = CUBLAS_OP_T;
  c.op_b = CUBLAS_OP_N;
  c.m = out, c.n = tokens, c.k = in;
  c.a = weight, c.lda = in, c.a_rows = in, c.a_cols = out;
  c.b = x, c.ldb = in, c.b_rows = in, c.b_cols = tokens;
  c.d = y, c.ldd = out, c.d_type = CUDA_R_16BF;
  c.bias = bias;
  c.aux = pre_gelu, c.ld_aux = out;
  return run(ctx, c, stream, what);
}

Status matmul_backward_input(MatmulContext& ctx, const bf16* dy, const bf16* weight,
                             const bf16* pre_gelu, bf16* dx, int64_t tokens, int64_t in,
                             int64_t out, cudaStream_t stream) {
  const char* what = "matmul_backward_input";
  FLARE_RETURN_IF_ERROR(check_sizes(what, tokens, in, out));
  FLARE_RETURN_IF_ERROR(check_pointer(what, "dy", dy));
  FLARE_RETURN_IF_ERROR(check_pointer(what, "weight", weight));
  FLARE_RETURN_IF_ERROR(check_pointer(what, "dx", dx));
  if (pre_gelu && in % 8 != 0)
    return invalid(what, ": in = ", in, " must be a multiple of 8 with pre_gelu (cuBLASLt's aux rule)");
  Call c{};
  c.pass = Pass::kBackwardInput;
  c.epilogue = pre_gelu ? CUBLASLT_EPILOGUE_DGELU : CUBLASLT_EPILOGUE_DEFAULT;
  c.op_a = CUBLAS_OP_N;
  c.op_b = CUBLAS_OP_N;
  c.m = in, c.n = tokens, c.k = out;
  c.a = weight, c.lda = in, c.a_rows = in, c.a_cols = out;
  c.b = dy, c.ldb = out, c.b_rows = out, c.b_cols = tokens;
  c.d = dx, c.ldd = in, c.d_type = CUDA_R_16BF;
  c.aux = pre_gelu, c.ld_aux = in;
  return run(ctx, c, stream, what);
}

Status matmul_backward_weight(MatmulContext& ctx, const bf16* dy, const bf16* x, GradientOut dweight,
                              GradientOut dbias, int64_t tokens, int64_t in, int64_t out,
                              bool accumulate, cudaStream_t stream) {
  const char* what = "matmul_backward_weight";
  FLARE_RETURN_IF_ERROR(check_sizes(what, tokens, in, out));
  FLARE_RETURN_IF_ERROR(check_pointer(what, "dy", dy));
  FLARE_RETURN_IF_ERROR(check_pointer(what, "x", x));
  FLARE_RETURN_IF_ERROR(check_pointer(what, "dweight", dweight.data()));
  if (dbias && dbias.is_bf16() != dweight.is_bf16())
    return invalid(what, ": dweight and dbias must have one type (both fp32 or both bf16)");
  if (dweight.is_bf16() && accumulate)
    return invalid(what, ": a bf16 gradient is written, never accumulated (accumulate must be false)");
  if (ctx.state() == nullptr) return invalid(what, ": the MatmulContext is not initialised (call init())");
  Call c{};
  c.pass = Pass::kBackwardWeight;
  c.epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  c.op_a = CUBLAS_OP_N;
  c.op_b = CUBLAS_OP_T;
  c.m = in, c.n = out, c.k = tokens;
  c.a = x, c.lda = in, c.a_rows = in, c.a_cols = tokens;
  c.b = dy, c.ldb = out, c.b_rows = out, c.b_cols = tokens;
  c.d = dweight.data(), c.ldd = in, c.d_type = dweight.is_bf16() ? CUDA_R_16BF : CUDA_R_32F;
  c.accumulate = accumulate;
  if (dbias && !accumulate) {
    // A written bias gradient comes from the product's epilogue (the sum of B = dyᵀ over k), which
    // saves the column sum's read of dy; where cuBLASLt has no such plan, the column sum below.
    Call fused = c;
    fused.epilogue = CUBLASLT_EPILOGUE_BGRADB;
    fused.bias = dbias.data();
    const Status done = run(ctx, fused, stream, what);
    if (done.code() != StatusCode::kUnsupported) return done;
  }
  if (dbias) {
    // The bias reduction borrows the workspace before the matmul, in stream order.
    const int64_t need = bias_gradient_scratch_bytes(tokens, out);
    if (need > MatmulContext::kWorkspaceBytes)
      return Status::unsupported(cat(what, ": the bias gradient of tokens = ", tokens, ", out = ", out,
                                     " needs ", need, " bytes of scratch, over the workspace's ",
                                     MatmulContext::kWorkspaceBytes));
    FLARE_RETURN_IF_ERROR(bias_gradient(dy, dbias, tokens, out, accumulate,
                                        ctx.state()->workspace, stream));
  }
  return run(ctx, c, stream, what);
}

}  // namespace flare::train::cuda
