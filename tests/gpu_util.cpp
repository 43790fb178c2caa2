// gpu_util.cpp — see gpu_util.h.
#include "gpu_util.h"

#include <cuda_runtime_api.h>

#include "core/backends.h"

namespace flare::test {

bool cuda_device_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

GpuTensor::~GpuTensor() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

void GpuTensor::upload(const HostTensor& h) {
  view_ = h.view;
  if (!h.view.defined()) return;
  bytes_ = h.bytes.size();
  ASSERT_EQ(cudaMalloc(&ptr_, bytes_), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(ptr_, h.bytes.data(), bytes_, cudaMemcpyHostToDevice), cudaSuccess);
  // The view's data keeps its offset inside the allocation.
  const auto offset = static_cast<const unsigned char*>(h.view.data) - h.bytes.data();
  view_.data = static_cast<unsigned char*>(ptr_) + offset;
  view_.device = DeviceType::kCUDA;
  view_.device_index = 0;
}

void GpuTensor::download(HostTensor* h) const {
  ASSERT_EQ(h->bytes.size(), bytes_);
  ASSERT_EQ(cudaMemcpy(h->bytes.data(), ptr_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
}

void GpuTensor::poison() const { ASSERT_EQ(cudaMemset(ptr_, 0xff, bytes_), cudaSuccess); }

GpuProblem::GpuProblem(const Problem& pr) : options(pr.options), varlen(pr.varlen) {
  q.upload(pr.q);
  k.upload(pr.k);
  v.upload(pr.v);
  o.upload(pr.o);
  lse.upload(pr.lse);
  cu_q.upload(pr.cu_q);
  cu_k.upload(pr.cu_k);
  alibi.upload(pr.alibi);
  if (pr.spec.alibi) options.alibi_slopes = alibi.view();
  if (pr.is_varlen()) {
    varlen.cu_seqlens_q = cu_q.view();
    varlen.cu_seqlens_k = cu_k.view();
  }
}

Status GpuProblem::enqueue_forward(Stream stream, const cuda::DispatchOverrides& overrides,
                                   cuda::DispatchRecord* record) const {
  if (record == nullptr && overrides == cuda::DispatchOverrides{})
    return attention_forward(q.view(), k.view(), v.view(), o.view(), lse.view(), options, varlen,
                             stream);
  AttentionParams p;
  FLARE_RETURN_IF_ERROR(make_forward_params(q.view(), k.view(), v.view(), o.view(), lse.view(),
                                            options, varlen, &p));
  return cuda::forward(p, stream, overrides, record);
}

Status GpuProblem::forward(Stream stream, const cuda::DispatchOverrides& overrides,
                           cuda::DispatchRecord* record) {
  o.poison();
  lse.poison();
  const Status s = enqueue_forward(stream, overrides, record);
  const cudaError_t err = cudaDeviceSynchronize();
  EXPECT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
  return s;
}

void GpuProblem::download_forward(Problem* pr) const {
  o.download(&pr->o);
  lse.download(&pr->lse);
}

}  // namespace flare::test
