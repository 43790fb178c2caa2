// nccl_stub.cpp — the NCCL entry points of flare/dist.h in builds without CUDA or NCCL.
#include "flare/dist.h"

namespace flare::dist {
namespace {
Status not_built() {
  return Status::unsupported("NCCL communicator: this build of flare has no NCCL (it needs CUDA "
                             "and NCCL at configure time)");
}
}  // namespace

bool nccl_built() { return false; }
Status nccl_unique_id(NcclId*) { return not_built(); }
Status make_nccl_communicator(const NcclId&, int, int, int, const CommOptions&,
                              std::unique_ptr<Communicator>*) {
  return not_built();
}
Status adopt_nccl_communicator(void*, bool, const CommOptions&, std::unique_ptr<Communicator>*) {
  return not_built();
}
Status make_nccl_communicator_from_env(const CommOptions&, std::unique_ptr<Communicator>*,
                                       LaunchInfo*) {
  return not_built();
}

}  // namespace flare::dist
