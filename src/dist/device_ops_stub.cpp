// device_ops_stub.cpp — make_device_ops in builds without CUDA: context-parallel attention runs on
// host memory only (a device communicator cannot exist there either: see nccl_stub.cpp).
#include "dist/cp_ops.h"
#include "dist/layout.h"

namespace flare::dist {

Status make_device_ops(int, int64_t, std::unique_ptr<CpOps>*) {
  return Status::unsupported("context parallel: device memory needs a flare build with CUDA");
}

Status device_copy_runs(const TensorView&, const TensorView&, int, const std::vector<RowRun>&,
                        Stream) {
  return Status::unsupported(
      "shard / unshard of CUDA tensors: this build of flare has no CUDA (use CPU tensors)");
}

}  // namespace flare::dist
