// cuda_backend_stub.cpp — make_cuda_backend in a build without CUDA.
#include "train/loop/backend.h"

namespace flare::train {

Status make_cuda_backend(const ModelConfig&, const TrainConfig&, const BackendOptions&,
                         std::unique_ptr<Backend>*) {
  return Status::unsupported(
      "device: cuda is not available, flare was built without CUDA (-DFLARE_CUDA=OFF); use "
      "--device cpu");
}

}  // namespace flare::train
