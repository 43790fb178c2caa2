// consumer.cpp — a tiny user of the installed C++ API: one forward whose answer is known in
// closed form.
//
// One query q = (ln 3, 0), two keys k0 = (1, 0) and k1 = (0, 1), scale 1: the scores are ln 3
// and 0, the softmax weights 3/4 and 1/4, so with v0 = (4, 0) and v1 = (0, 8) the output is
// O = (3, 2) and LSE = ln(3 + 1) = ln 4.
#include <cmath>
#include <cstdio>
#include <cstring>

#include <flare/attention.h>

int main() {
  float q[2] = {std::log(3.0f), 0.0f};
  float k[4] = {1.0f, 0.0f, 0.0f, 1.0f};
  float v[4] = {4.0f, 0.0f, 0.0f, 8.0f};
  float o[2] = {NAN, NAN};
  float lse[1] = {NAN};
  using flare::DType;
  using flare::TensorView;
  flare::AttentionOptions options;
  options.softmax_scale = 1.0f;
  const flare::Status st = flare::attention_forward(
      TensorView::contiguous(q, DType::kFloat32, {1, 1, 1, 2}),
      TensorView::contiguous(k, DType::kFloat32, {1, 2, 1, 2}),
      TensorView::contiguous(v, DType::kFloat32, {1, 2, 1, 2}),
      TensorView::contiguous(o, DType::kFloat32, {1, 1, 1, 2}),
      TensorView::contiguous(lse, DType::kFloat32, {1, 1, 1}), options);
  if (!st.ok()) {
    std::fprintf(stderr, "attention_forward: %s\n", st.to_string().c_str());
    return 1;
  }
  std::printf("flare %s (C++): O = (%.7g, %.7g), LSE = %.7g\n", flare::version(), o[0], o[1],
              lse[0]);
  int failures = 0;
  const auto expect_near = [&](const char* what, float got, double want) {
    if (!(std::fabs(got - want) <= 1e-5 * std::fabs(want))) {
      std::fprintf(stderr, "%s: got %.9g, expected %.9g\n", what, got, want);
      ++failures;
    }
  };
  expect_near("O[0]", o[0], 3.0);
  expect_near("O[1]", o[1], 2.0);
  expect_near("LSE", lse[0], std::log(4.0));
  if (std::strcmp(flare::version(), FLARE_EXPECTED_VERSION) != 0) {
    std::fprintf(stderr, "version %s, package says %s\n", flare::version(), FLARE_EXPECTED_VERSION);
    ++failures;
  }
#if defined(FLARE_WITH_CUDA)
  const bool package_says_cuda = true;
#else
  const bool package_says_cuda = false;
#endif
  if (flare::cuda_built() != package_says_cuda) {
    std::fprintf(stderr, "cuda_built() is %d, the package's FLARE_WITH_CUDA says %d\n",
                 flare::cuda_built(), package_says_cuda);
    ++failures;
  }
  return failures == 0 ? 0 : 1;
}
