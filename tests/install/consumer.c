/* consumer.c — a tiny user of the installed C ABI (flare/c_api.h): the forward of consumer.cpp
 * (O = (3, 2), LSE = ln 4 in closed form). Built through the CMake package and, separately, with
 * nothing but the flags `pkg-config --cflags --libs flare` prints. */
#include <math.h> /* NAN */
#include <stdio.h>
#include <string.h>

#include <flare/c_api.h>

/* A dense row-major float32 CPU tensor. */
static flare_tensor dense_f32(float* data, int32_t ndim, const int64_t* shape) {
  flare_tensor t;
  int64_t stride = 1;
  int i;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.dtype = FLARE_FLOAT32;
  t.device = FLARE_CPU;
  t.ndim = ndim;
  for (i = ndim - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.stride[i] = stride;
    stride *= shape[i];
  }
  return t;
}

/* Within 1e-5 relatively (want > 0). No libm call, so the link needs only what flare brings. */
static int near(const char* what, float got, double want) {
  const double diff = got - want;
  if (diff <= 1e-5 * want && -diff <= 1e-5 * want) return 0;
  fprintf(stderr, "%s: got %.9g, expected %.9g\n", what, got, want);
  return 1;
}

static const double kLn3 = 1.0986122886681098, kLn4 = 1.3862943611198906;

int main(void) {
  static const int64_t q_shape[4] = {1, 1, 1, 2}, kv_shape[4] = {1, 2, 1, 2},
                       lse_shape[3] = {1, 1, 1};
  float q[2], k[4] = {1.0f, 0.0f, 0.0f, 1.0f}, v[4] = {4.0f, 0.0f, 0.0f, 8.0f};
  float o[2] = {NAN, NAN}, lse[1] = {NAN};
  flare_tensor tq, tk, tv, to, tl;
  flare_attention_options options = flare_default_options();
  int failures = 0;
  q[0] = (float)kLn3;
  q[1] = 0.0f;
  tq = dense_f32(q, 4, q_shape);
  tk = dense_f32(k, 4, kv_shape);
  tv = dense_f32(v, 4, kv_shape);
  to = dense_f32(o, 4, q_shape);
  tl = dense_f32(lse, 3, lse_shape);
  options.softmax_scale = 1.0f;
  if (flare_attention_forward(&tq, &tk, &tv, &to, &tl, &options, NULL, NULL) != FLARE_OK) {
    fprintf(stderr, "flare_attention_forward: %s\n", flare_last_error());
    return 1;
  }
  printf("flare %s (C): O = (%.7g, %.7g), LSE = %.7g\n", flare_version(), o[0], o[1], lse[0]);
  failures += near("O[0]", o[0], 3.0);
  failures += near("O[1]", o[1], 2.0);
  failures += near("LSE", lse[0], kLn4);
  if (strcmp(flare_version(), FLARE_EXPECTED_VERSION) != 0) {
    fprintf(stderr, "version %s, package says %s\n", flare_version(), FLARE_EXPECTED_VERSION);
    ++failures;
  }
#if defined(FLARE_WITH_CUDA)
  if (flare_cuda_built() != 1) {
#else
  if (flare_cuda_built() != 0) {
#endif
    fprintf(stderr, "flare_cuda_built() is %d, against the package's FLARE_WITH_CUDA\n",
            flare_cuda_built());
    ++failures;
  }
  return failures == 0 ? 0 : 1;
}
