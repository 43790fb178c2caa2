// dp_test_util.h — what the data-parallel trainer tests share (test_cpu_dp_trainer.cpp on
// in-process ranks, test_gpu_dp.cpp on NCCL ranks): one rank's run of a Trainer, and the check of a
// data-parallel run against a one-rank reference within the reordering noise of one-rank
// regroupings of the same global batch.
//
// Tolerance (docs/architecture.md's rule, max|fast − ref| ≤ 2·max|naive − ref| + floor): the
// reference is one rank with batch B·N; the data-parallel run (N ranks of batch B) computes the
// same mean gradient of the same windows with its sums grouped and ordered otherwise (per rank,
// then across ranks). The naive runs are such regroupings on one rank, in the same precision: batch
// B with N times the micro-batches, and one sequence per micro-batch (the loader deals the same
// windows to a step whatever the split, loader.h). Their distance to the reference is the
// reordering noise of the arithmetic at this problem; the floor is fp32 rounding at the reference's
// magnitude (2·2⁻²³·max|ref|), the precision of the loss, the norm and the optimizer state.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "train/loop/trainer.h"

namespace flare::train::test {

// What a run leaves: rank 0's loss and gradient norm of every step and its final state.
struct RunResult {
  std::vector<double> losses;
  std::vector<double> norms;
  std::vector<float> master, m, v;
  std::vector<StepReport> reports;
};

// Creates rank `rank`'s Trainer of `o` (o.backend.comm set by the caller), runs it to `until`
// steps and appends that rank's losses to *losses; rank 0 also fills *out (its norms, reports and
// the final state, which get_state gathers from every rank, so every rank must call this).
inline Status train_rank(const TrainerOptions& o, int rank, int64_t until, std::vector<double>* losses,
                         RunResult* out) {
  std::unique_ptr<Trainer> t;
  FLARE_RETURN_IF_ERROR(Trainer::create(o, &t));
  FLARE_RETURN_IF_ERROR(t->run(until, [&](const StepReport& r) {
    losses->push_back(r.loss);
    if (rank == 0) {
      out->norms.push_back(r.grad_norm);
      out->reports.push_back(r);
    }
  }));
  const size_t n = rank == 0 ? static_cast<size_t>(parameter_layout(o.model).total) : 0;
  std::vector<float> master(n), m(n), v(n);
  FLARE_RETURN_IF_ERROR(t->backend().get_state(master.data(), m.data(), v.data()));
  if (rank == 0) {
    out->master = std::move(master);
    out->m = std::move(m);
    out->v = std::move(v);
  }
  return Status::ok_status();
}

inline double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0.0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) d = std::max(d, std::fabs(double(a[i]) - b[i]));
  return d;
}

inline double max_abs(const std::vector<float>& a) {
  double m = 0.0;
  for (float x : a) m = std::max(m, std::fabs(double(x)));
  return m;
}

inline constexpr double kFp32Eps = 1.0 / (1 << 23);

// The largest distance(naive) over the naive runs.
inline double worst_naive(const std::vector<RunResult>& naives,
                          const std::function<double(const RunResult&)>& distance) {
  double d = 0.0;
  for (const RunResult& naive : naives) d = std::max(d, distance(naive));
  return d;
}

// fast within 2·max|naive − ref| + floor of ref, the max over the naive runs: every step's loss
// and gradient norm.
inline void expect_curves_within_reordering_noise(const RunResult& fast, const RunResult& ref,
                                                  const std::vector<RunResult>& naives) {
  ASSERT_EQ(fast.losses.size(), ref.losses.size());
  for (const RunResult& naive : naives) ASSERT_EQ(naive.losses.size(), ref.losses.size());
  auto worst = [&](const std::function<double(const RunResult&)>& distance) { return worst_naive(naives, distance); };
  for (size_t s = 0; s < ref.losses.size(); ++s) {
    const double noise = worst([&](const RunResult& n) { return std::fabs(n.losses[s] - ref.losses[s]); });
    const double bound = 2 * noise + 2 * kFp32Eps * std::fabs(ref.losses[s]);
    EXPECT_LE(std::fabs(fast.losses[s] - ref.losses[s]), bound)
        << "step " << s + 1 << ": fast " << fast.losses[s] << ", ref " << ref.losses[s]
        << ", reordering noise " << noise;
  }
  for (size_t s = 0; s < ref.norms.size(); ++s) {
    const double noise = worst([&](const RunResult& n) { return std::fabs(n.norms[s] - ref.norms[s]); });
    EXPECT_LE(std::fabs(fast.norms[s] - ref.norms[s]), 2 * noise + 2 * kFp32Eps * ref.norms[s])
        << "gradient norm, step " << s + 1;
  }
}

// The same, and the final weights, m and v.
inline void expect_within_reordering_noise(const RunResult& fast, const RunResult& ref,
                                           const std::vector<RunResult>& naives) {
  expect_curves_within_reordering_noise(fast, ref, naives);
  auto worst = [&](const std::function<double(const RunResult&)>& distance) { return worst_naive(naives, distance); };
  const std::pair<const char*, std::vector<float> RunResult::*> tensors[] = {
      {"master", &RunResult::master}, {"m", &RunResult::m}, {"v", &RunResult::v}};
  for (const auto& [name, field] : tensors) {
    const double noise = worst([&](const RunResult& n) { return max_abs_diff(n.*field, ref.*field); });
    const double bound = 2 * noise + 2 * kFp32Eps * max_abs(ref.*field);
    const double diff = max_abs_diff(fast.*field, ref.*field);
    EXPECT_LE(diff, bound) << name << ": max|fast - ref| " << diff << ", max|naive - ref| " << noise;
  }
}

}  // namespace flare::train::test
