// gpu_bwd_util.h — device mirrors of test Problems for the CUDA backward tests, built on the
// forward tests' GpuProblem (gpu_util.h).
//
// The backward needs the forward's O and LSE. They come from the float64 CPU reference
// (store_forward rounds them into the problem's host tensors) before the problem is copied to the
// device, so the backward tests do not depend on the CUDA forward kernel. dq/dk/dv are poisoned
// with NaN on the device before each call and copied back into the Problem afterwards, where
// read_dq()/read_dk()/read_dv() and the CPU reference take over.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "gpu_util.h"
#include "test_util.h"

namespace flare::test {

// Fills the problem's O and LSE from the float64 reference forward; returns it for chaining.
inline const Problem& with_reference_forward(Problem* pr) {
  const AttentionParams fp = pr->forward_params();
  cpu::store_forward(fp, cpu::reference_forward(fp, cpu::RefPrecision::kFloat64));
  return *pr;
}

// Every tensor of a backward call on the device.
struct GpuBackwardProblem {
  GpuProblem fwd;  // q, k, v, o, lse, cu_seqlens, alibi, options, varlen
  GpuTensor dout, dq, dk, dv;

  explicit GpuBackwardProblem(Problem* pr) : fwd(with_reference_forward(pr)) {
    dout.upload(pr->dout);
    dq.upload(pr->dq);
    dk.upload(pr->dk);
    dv.upload(pr->dv);
  }

  // Poisons the gradients, runs attention_backward on `stream` (with `overrides`, telling
  // `record` which kernels ran: gpu_util.h) and waits for the device.
  Status backward(Stream stream = nullptr, const cuda::DispatchOverrides& overrides = {},
                  cuda::DispatchRecord* record = nullptr) {
    dq.poison();
    dk.poison();
    dv.poison();
    Status s;
    if (record == nullptr && overrides == cuda::DispatchOverrides{}) {
      s = attention_backward(dout.view(), fwd.q.view(), fwd.k.view(), fwd.v.view(), fwd.o.view(),
                             fwd.lse.view(), dq.view(), dk.view(), dv.view(), fwd.options,
                             fwd.varlen, stream);
    } else {
      AttentionParams p;
      s = make_backward_params(dout.view(), fwd.q.view(), fwd.k.view(), fwd.v.view(),
                               fwd.o.view(), fwd.lse.view(), dq.view(), dk.view(), dv.view(),
                               fwd.options, fwd.varlen, &p);
      if (s.ok()) s = cuda::backward(p, stream, overrides, record);
    }
    const cudaError_t err = cudaDeviceSynchronize();
    EXPECT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
    return s;
  }

  // Copies dq, dk and dv back into the problem's host tensors.
  void download_backward(Problem* pr) const {
    dq.download(&pr->dq);
    dk.download(&pr->dk);
    dv.download(&pr->dv);
  }
};

}  // namespace flare::test
