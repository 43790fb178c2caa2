// test_util.cpp — see test_util.h.
#include "test_util.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <sstream>

namespace flare::test {

std::string ProblemSpec::describe() const {
  std::ostringstream s;
  s << "b=" << batch << " s_q=" << seqlen_q << " s_k=" << seqlen_k << " h=" << heads_q << "/"
    << heads_kv << " d=" << head_dim << " dtype=" << dtype_name(dtype);
  if (!varlen_q.empty()) {
    s << " varlen_q=[";
    for (size_t i = 0; i < varlen_q.size(); ++i) s << (i ? "," : "") << varlen_q[i];
    s << "] varlen_k=[";
    for (size_t i = 0; i < varlen_k.size(); ++i) s << (i ? "," : "") << varlen_k[i];
    s << "]";
  }
  s << " causal=" << options.causal << " window=(" << options.window_left << ","
    << options.window_right << ") softcap=" << options.softcap << " alibi=" << alibi
    << " dropout=" << options.dropout_p << " pad=" << pad << " magnitude=" << magnitude
    << " seed=" << seed;
  return s.str();
}

uint64_t test_seed() {
  static const uint64_t seed = [] {
    if (const char* env = std::getenv("FLARE_TEST_SEED"))
      return static_cast<uint64_t>(std::strtoull(env, nullptr, 10));
    return static_cast<uint64_t>(
        std::chrono::high_resolution_clock::now().time_since_epoch().count());
  }();
  return seed;
}

Problem make_problem(const ProblemSpec& spec) {
  Problem pr;
  pr.spec = spec;
  std::mt19937_64 rng(spec.seed);
  const bool varlen = !spec.varlen_q.empty();
  const int b = varlen ? static_cast<int>(spec.varlen_q.size()) : spec.batch;
  int64_t total_q = 0, total_k = 0;
  if (varlen) {
    pr.cu_q = HostTensor::make(DType::kInt32, {b + 1});
    pr.cu_k = HostTensor::make(DType::kInt32, {b + 1});
    auto* cq = reinterpret_cast<int32_t*>(pr.cu_q.bytes.data());
    auto* ck = reinterpret_cast<int32_t*>(pr.cu_k.bytes.data());
    cq[0] = ck[0] = 0;
    int max_q = 0, max_k = 0;
    for (int i = 0; i < b; ++i) {
      cq[i + 1] = cq[i] + spec.varlen_q[i];
      ck[i + 1] = ck[i] + spec.varlen_k[i];
      max_q = std::max(max_q, spec.varlen_q[i]);
      max_k = std::max(max_k, spec.varlen_k[i]);
    }
    total_q = cq[b];
    total_k = ck[b];
    pr.varlen.cu_seqlens_q = pr.cu_q.view;
    pr.varlen.cu_seqlens_k = pr.cu_k.view;
    pr.varlen.max_seqlen_q = max_q;
    pr.varlen.max_seqlen_k = max_k;
  }
  auto shape_q = [&](int heads) -> std::vector<int64_t> {
    if (varlen) return {total_q, heads, spec.head_dim};
    return {b, spec.seqlen_q, heads, spec.head_dim};
  };
  auto shape_k = [&]() -> std::vector<int64_t> {
    if (varlen) return {total_k, spec.heads_kv, spec.head_dim};
    return {b, spec.seqlen_k, spec.heads_kv, spec.head_dim};
  };
  auto tensor = [&](std::vector<int64_t> shape) {
    return spec.pad > 0 ? HostTensor::make_padded(spec.dtype, shape, spec.pad)
                        : HostTensor::make(spec.dtype, shape);
  };
  pr.q = tensor(shape_q(spec.heads_q));
  pr.k = tensor(shape_k());
  pr.v = tensor(shape_k());
  pr.o = tensor(shape_q(spec.heads_q));
  pr.dout = tensor(shape_q(spec.heads_q));
  pr.dq = tensor(shape_q(spec.heads_q));
  pr.dk = tensor(shape_k());
  pr.dv = tensor(shape_k());
  if (varlen) {
    pr.lse = HostTensor::make(DType::kFloat32, {spec.heads_q, total_q});
  } else {
    pr.lse = HostTensor::make(DType::kFloat32, {b, spec.heads_q, spec.seqlen_q});
  }
  pr.q.fill_normal(rng, spec.magnitude);
  pr.k.fill_normal(rng, spec.magnitude);
  pr.v.fill_normal(rng);
  pr.dout.fill_normal(rng);
  pr.o.poison();
  pr.lse.poison();
  pr.dq.poison();
  pr.dk.poison();
  pr.dv.poison();
  pr.options = spec.options;
  if (spec.alibi) {
    pr.alibi = spec.alibi_per_batch ? HostTensor::make(DType::kFloat32, {b, spec.heads_q})
                                    : HostTensor::make(DType::kFloat32, {spec.heads_q});
    std::uniform_real_distribution<float> slope(0.01f, 1.0f);
    auto* a = reinterpret_cast<float*>(pr.alibi.bytes.data());
    for (int64_t i = 0; i < pr.alibi.view.numel(); ++i) a[i] = slope(rng);
    pr.options.alibi_slopes = pr.alibi.view;
  }
  return pr;
}

AttentionParams Problem::forward_params() const {
  AttentionParams p;
  const Status s = make_forward_params(q.view, k.view, v.view, o.view, lse.view, options, varlen, &p);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return p;
}

AttentionParams Problem::backward_params() const {
  AttentionParams p;
  const Status s = make_backward_params(dout.view, q.view, k.view, v.view, o.view, lse.view, dq.view,
                                        dk.view, dv.view, options, varlen, &p);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return p;
}

std::vector<double> Problem::read_packed(const HostTensor& t) const {
  const TensorView& tv = t.view;
  std::vector<double> out;
  if (is_varlen()) {
    out.reserve(static_cast<size_t>(tv.shape[0] * tv.shape[1] * tv.shape[2]));
    for (int64_t r = 0; r < tv.shape[0]; ++r)
      for (int64_t h = 0; h < tv.shape[1]; ++h)
        for (int64_t c = 0; c < tv.shape[2]; ++c) out.push_back(t.get({r, h, c}));
  } else {
    out.reserve(static_cast<size_t>(tv.numel()));
    for (int64_t b = 0; b < tv.shape[0]; ++b)
      for (int64_t r = 0; r < tv.shape[1]; ++r)
        for (int64_t h = 0; h < tv.shape[2]; ++h)
          for (int64_t c = 0; c < tv.shape[3]; ++c) out.push_back(t.get({b, r, h, c}));
  }
  return out;
}

std::vector<double> Problem::read_lse() const {
  const TensorView& lv = lse.view;
  std::vector<double> out;
  if (is_varlen()) {
    for (int64_t h = 0; h < lv.shape[0]; ++h)
      for (int64_t r = 0; r < lv.shape[1]; ++r) out.push_back(lse.get({h, r}));
  } else {
    // (b, h, s) → (h, b·s + i)
    for (int64_t h = 0; h < lv.shape[1]; ++h)
      for (int64_t b = 0; b < lv.shape[0]; ++b)
        for (int64_t r = 0; r < lv.shape[2]; ++r) out.push_back(lse.get({b, h, r}));
  }
  return out;
}

double naive_error(const std::vector<double>& naive, const std::vector<double>& ref) {
  double e = 0;
  for (size_t i = 0; i < ref.size() && i < naive.size(); ++i)
    if (std::isfinite(ref[i]) && std::isfinite(naive[i]))
      e = std::max(e, std::fabs(naive[i] - ref[i]));
  return e;
}

::testing::AssertionResult within_tolerance(const std::string& name, const std::vector<double>& fast,
                                            const std::vector<double>& ref,
                                            const std::vector<double>& naive, DType dtype,
                                            int64_t reduction_length) {
  if (naive.size() != ref.size())
    return ::testing::AssertionFailure() << name << ": size mismatch " << naive.size() << " vs "
                                         << ref.size();
  double naive_err = 0;
  for (size_t i = 0; i < ref.size(); ++i)
    if (!std::isinf(ref[i])) naive_err = std::max(naive_err, std::fabs(naive[i] - ref[i]));
  return within_tolerance(name, fast, ref, naive_err, dtype, reduction_length);
}

::testing::AssertionResult within_tolerance(const std::string& name, const std::vector<double>& fast,
                                            const std::vector<double>& ref, double naive_err,
                                            DType dtype, int64_t reduction_length) {
  if (fast.size() != ref.size())
    return ::testing::AssertionFailure() << name << ": size mismatch " << fast.size() << " vs "
                                         << ref.size();
  double err = 0, ref_max = 0;
  size_t worst = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(fast[i]))
      return ::testing::AssertionFailure() << name << "[" << i << "] is NaN (unwritten or invalid)"
                                           << " seed=" << test_seed();
    if (std::isinf(ref[i])) {
      if (fast[i] != ref[i])
        return ::testing::AssertionFailure() << name << "[" << i << "] = " << fast[i]
                                             << ", expected " << ref[i];
      continue;
    }
    const double e = std::fabs(fast[i] - ref[i]);
    if (!(e <= err)) {
      err = e;
      worst = i;
    }
    ref_max = std::max(ref_max, std::fabs(ref[i]));
  }
  const double floor =
      (2.0 * unit_roundoff(dtype) +
       unit_roundoff(DType::kFloat32) * std::sqrt(static_cast<double>(std::max<int64_t>(reduction_length, 1)))) *
      ref_max;
  const double bound = 2.0 * naive_err + floor;
  if (err <= bound) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << name << ": max|fast-ref| = " << err << " at [" << worst << "] (fast " << fast[worst]
         << ", ref " << ref[worst] << ") exceeds 2*naive_err + floor = 2*" << naive_err << " + "
         << floor << " = " << bound << " (seed " << test_seed() << ")";
}

int64_t reduction_length(const AttentionParams& p) {
  // Scores are length-d dot products; O and dQ sum over keys; dK and dV over the queries of a
  // head group.
  return std::max<int64_t>({p.head_dim, p.seqlen_k, int64_t{p.seqlen_q} * p.head_group});
}

double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (double e : x) m = std::max(m, std::fabs(e));
  return m;
}

namespace {

// Where the exact gradient is no larger than the fp32 noise of computing it (`noise`, below), its
// digits carry no signal and only the size of the error is checked: the kernel's fp32 value c is
// within `noise` of the exact g, and storing c rounds it by at most u·|c| ≤ u·(|g| + noise), u
// the dtype's unit roundoff. So |fast − g| ≤ noise + u·(|g| + noise) for every element.
::testing::AssertionResult within_zero_gradient_bound(const std::string& name,
                                                      const std::vector<double>& fast,
                                                      const std::vector<double>& ref, double noise,
                                                      DType dtype) {
  const double u = unit_roundoff(dtype);
  for (size_t i = 0; i < fast.size(); ++i) {
    const double bound = noise + u * (std::fabs(ref[i]) + noise);
    if (!(std::fabs(fast[i] - ref[i]) <= bound))
      return ::testing::AssertionFailure()
             << name << "[" << i << "] = " << fast[i] << ", exact " << ref[i]
             << ": the exact gradient is within fp32 noise of 0 (" << noise
             << "), and the error exceeds that noise plus the dtype's rounding: " << bound
             << " (seed " << test_seed() << ")";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace

namespace {

// Largest magnitudes of the inputs that scale a gradient's fp32 noise (expect_gradients_match).
struct GradientScales {
  double dout, v, k, q;
};

void check_gradients(const cpu::RefBackward& fast, const cpu::RefBackward& ref,
                     const NaiveBackward& naive, const AttentionParams& bp, DType dtype,
                     const GradientScales& in, const NaiveErrors* budget = nullptr) {
  const GradientErrors naive_err =
      budget ? GradientErrors{budget->dq, budget->dk, budget->dv} : gradient_errors(naive, ref);
  const double dq_err = naive_err.dq, dk_err = naive_err.dk, dv_err = naive_err.dv;
  const int64_t n = reduction_length(bp);
  const double d = bp.head_dim;
  const double ds_bound = 2.0 * d * d * std::ldexp(1.0, -24) * in.dout * in.v * bp.dropout_scale;
  const double terms = static_cast<double>(std::max<int64_t>(int64_t{bp.seqlen_q} * bp.head_group, bp.seqlen_k));
  const double dq_noise = terms * bp.scale * ds_bound * in.k;
  const double dk_noise = terms * bp.scale * ds_bound * in.q;
  if (max_abs(ref.dq) <= dq_noise)
    EXPECT_TRUE(within_zero_gradient_bound("dQ", fast.dq, ref.dq, dq_noise, dtype));
  else
    EXPECT_TRUE(within_tolerance("dQ", fast.dq, ref.dq, dq_err, dtype, n));
  if (max_abs(ref.dk) <= dk_noise)
    EXPECT_TRUE(within_zero_gradient_bound("dK", fast.dk, ref.dk, dk_noise, dtype));
  else
    EXPECT_TRUE(within_tolerance("dK", fast.dk, ref.dk, dk_err, dtype, n));
  EXPECT_TRUE(within_tolerance("dV", fast.dv, ref.dv, dv_err, dtype, n));
}

}  // namespace

NaiveBackward naive_backward(const AttentionParams& bp) {
  return {cpu::reference_backward(bp, cpu::RefPrecision::kLowPrecision),
          cpu::reference_backward(bp, cpu::RefPrecision::kLowPrecisionReversed)};
}

GradientErrors gradient_errors(const NaiveBackward& naive, const cpu::RefBackward& ref) {
  auto larger = [](const std::vector<double>& a, const std::vector<double>& b,
                   const std::vector<double>& r) {
    return std::max(naive_error(a, r), naive_error(b, r));
  };
  return {larger(naive.in_order.dq, naive.reversed.dq, ref.dq),
          larger(naive.in_order.dk, naive.reversed.dk, ref.dk),
          larger(naive.in_order.dv, naive.reversed.dv, ref.dv)};
}

void expect_gradients_match(const Problem& pr, const AttentionParams& bp,
                            const cpu::RefBackward& ref, const NaiveBackward& naive) {
  check_gradients({pr.read_dq(), pr.read_dk(), pr.read_dv()}, ref, naive, bp, pr.spec.dtype,
                  {max_abs(pr.read_packed(pr.dout)), max_abs(pr.read_packed(pr.v)),
                   max_abs(pr.read_packed(pr.k)), max_abs(pr.read_packed(pr.q))});
}

void expect_forward_matches(const Problem& pr) {
  const AttentionParams fp = pr.forward_params();
  expect_forward_matches(pr, cpu::reference_forward(fp, cpu::RefPrecision::kFloat64),
                         cpu::reference_forward(fp, cpu::RefPrecision::kLowPrecision));
}

void expect_forward_matches(const Problem& pr, const cpu::RefForward& ref,
                            const cpu::RefForward& naive) {
  const int64_t n = reduction_length(pr.forward_params());
  EXPECT_TRUE(within_tolerance("O", pr.read_o(), ref.o, naive.o, pr.spec.dtype, n));
  EXPECT_TRUE(within_tolerance("LSE", pr.read_lse(), ref.lse, naive.lse, DType::kFloat32, n));
}

void check_against_reference(const ProblemSpec& spec, bool backward) {
  SCOPED_TRACE(spec.describe());
  Problem pr = make_problem(spec);
  Status s = attention_forward(pr.q.view, pr.k.view, pr.v.view, pr.o.view, pr.lse.view, pr.options,
                               pr.varlen);
  ASSERT_TRUE(s.ok()) << s.to_string();
  expect_forward_matches(pr);
  if (!backward) return;
  s = attention_backward(pr.dout.view, pr.q.view, pr.k.view, pr.v.view, pr.o.view, pr.lse.view,
                         pr.dq.view, pr.dk.view, pr.dv.view, pr.options, pr.varlen);
  ASSERT_TRUE(s.ok()) << s.to_string();
  const AttentionParams bp = pr.backward_params();
  expect_gradients_match(pr, bp, cpu::reference_backward(bp, cpu::RefPrecision::kFloat64),
                         naive_backward(bp));
}

// ---- inputs holding NaN or ±Inf -----------------------------------------------------------------

double max_abs_finite(const std::vector<double>& x) {
  double m = 0;
  for (double e : x)
    if (std::isfinite(e)) m = std::max(m, std::fabs(e));
  return m;
}

::testing::AssertionResult same_nonfinite_pattern(const std::string& name,
                                                  const std::vector<double>& fast,
                                                  const std::vector<double>& ref) {
  if (fast.size() != ref.size())
    return ::testing::AssertionFailure() << name << ": size mismatch " << fast.size() << " vs "
                                         << ref.size();
  for (size_t i = 0; i < ref.size(); ++i) {
    const bool same = std::isnan(ref[i]) ? std::isnan(fast[i])
                      : std::isinf(ref[i]) ? fast[i] == ref[i]
                                           : std::isfinite(fast[i]);
    if (!same)
      return ::testing::AssertionFailure()
             << name << "[" << i << "] = " << fast[i] << " where the reference has " << ref[i]
             << " (seed " << test_seed() << ")";
  }
  return ::testing::AssertionSuccess();
}

namespace {

// fast, ref and naive where ref is finite; 0 in all three elsewhere (same_nonfinite_pattern has
// checked those entries). Where the naive kernel alone is not finite it carries no error budget:
// naive = ref there.
struct FinitePart {
  std::vector<double> fast, ref, naive;
};

FinitePart finite_part(const std::vector<double>& fast, const std::vector<double>& ref,
                       const std::vector<double>& naive) {
  FinitePart f{fast, ref, naive};
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(ref[i])) {
      f.fast[i] = f.ref[i] = f.naive[i] = 0.0;
    } else if (!std::isfinite(naive[i])) {
      f.naive[i] = ref[i];
    }
  }
  return f;
}

}  // namespace

NaiveErrors naive_errors(Problem& twin) {
  // The naive backward reads the forward's stored O and LSE, as a fast backward does.
  const Status s = attention_forward(twin.q.view, twin.k.view, twin.v.view, twin.o.view,
                                     twin.lse.view, twin.options, twin.varlen);
  EXPECT_TRUE(s.ok()) << s.to_string();
  const AttentionParams fp = twin.forward_params();
  const cpu::RefForward ref = cpu::reference_forward(fp, cpu::RefPrecision::kFloat64);
  const cpu::RefForward naive = cpu::reference_forward(fp, cpu::RefPrecision::kLowPrecision);
  const AttentionParams bp = twin.backward_params();
  const cpu::RefBackward rb = cpu::reference_backward(bp, cpu::RefPrecision::kFloat64);
  const GradientErrors g = gradient_errors(naive_backward(bp), rb);
  return {naive_error(naive.o, ref.o), naive_error(naive.lse, ref.lse), g.dq, g.dk, g.dv};
}

void expect_forward_matches_nonfinite(const Problem& pr, const NaiveErrors* budget) {
  const AttentionParams fp = pr.forward_params();
  const cpu::RefForward ref = cpu::reference_forward(fp, cpu::RefPrecision::kFloat64);
  const cpu::RefForward naive = cpu::reference_forward(fp, cpu::RefPrecision::kLowPrecision);
  const int64_t n = reduction_length(fp);
  const std::vector<double> o = pr.read_o(), lse = pr.read_lse();
  EXPECT_TRUE(same_nonfinite_pattern("O", o, ref.o));
  EXPECT_TRUE(same_nonfinite_pattern("LSE", lse, ref.lse));
  const FinitePart fo = finite_part(o, ref.o, naive.o);
  const FinitePart fl = finite_part(lse, ref.lse, naive.lse);
  EXPECT_TRUE(within_tolerance("O", fo.fast, fo.ref,
                               budget ? budget->o : naive_error(fo.naive, fo.ref), pr.spec.dtype, n));
  EXPECT_TRUE(within_tolerance("LSE", fl.fast, fl.ref,
                               budget ? budget->lse : naive_error(fl.naive, fl.ref), DType::kFloat32,
                               n));
}

void expect_gradients_match_nonfinite(const Problem& pr, const AttentionParams& bp,
                                      const cpu::RefBackward& ref, const NaiveBackward& naive,
                                      const NaiveErrors* budget) {
  const cpu::RefBackward fast{pr.read_dq(), pr.read_dk(), pr.read_dv()};
  EXPECT_TRUE(same_nonfinite_pattern("dQ", fast.dq, ref.dq));
  EXPECT_TRUE(same_nonfinite_pattern("dK", fast.dk, ref.dk));
  EXPECT_TRUE(same_nonfinite_pattern("dV", fast.dv, ref.dv));
  const FinitePart dq = finite_part(fast.dq, ref.dq, naive.in_order.dq);
  const FinitePart dk = finite_part(fast.dk, ref.dk, naive.in_order.dk);
  const FinitePart dv = finite_part(fast.dv, ref.dv, naive.in_order.dv);
  const cpu::RefBackward reversed{finite_part(fast.dq, ref.dq, naive.reversed.dq).naive,
                                  finite_part(fast.dk, ref.dk, naive.reversed.dk).naive,
                                  finite_part(fast.dv, ref.dv, naive.reversed.dv).naive};
  check_gradients({dq.fast, dk.fast, dv.fast}, {dq.ref, dk.ref, dv.ref},
                  {{dq.naive, dk.naive, dv.naive}, reversed}, bp, pr.spec.dtype,
                  {max_abs_finite(pr.read_packed(pr.dout)), max_abs_finite(pr.read_packed(pr.v)),
                   max_abs_finite(pr.read_packed(pr.k)), max_abs_finite(pr.read_packed(pr.q))},
                  budget);
}

}  // namespace flare::test
