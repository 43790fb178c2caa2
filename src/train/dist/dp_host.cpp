// dp_host.cpp — agreement on per-rank numbers and the shard gather of dp_host.h.
#include "train/dist/dp_host.h"

#include "core/message.h"

namespace flare::train::dp {
namespace {

size_t sz(int64_t n) { return static_cast<size_t>(n); }

template <typename T>
Status gather_host(dist::Communicator& comm, const std::vector<T>& values, std::vector<T>* all) {
  all->assign(values.size() * sz(comm.size()), T{});
  const int64_t bytes = static_cast<int64_t>(values.size() * sizeof(T));
  return comm.host_all_gather(values.data(), all->data(), bytes);
}

}  // namespace

Status gather_values(dist::Communicator& comm, const std::vector<int64_t>& values,
                     std::vector<int64_t>* all) {
  return gather_host(comm, values, all);
}

Status gather_values(dist::Communicator& comm, const std::vector<double>& values,
                     std::vector<double>* all) {
  return gather_host(comm, values, all);
}

double sum_in_order(const std::vector<double>& values) {
  double sum = 0.0;
  for (double v : values) sum += v;
  return sum;
}

Status gather_shards_to_rank0(dist::Communicator& comm, const DpPlan& plan, const void* shard,
                              void* staging, int64_t elem_bytes, void* full,
                              const CopyToHost& to_host, Stream stream) {
  const int rank = comm.rank();
  if (comm.size() != plan.world) {
    return invalid("gather_shards_to_rank0: the communicator has ", comm.size(),
                   " ranks, the plan ", plan.world);
  }
  if (rank == 0 && full == nullptr) return invalid("gather_shards_to_rank0: full is null on rank 0");
  const auto* src = static_cast<const unsigned char*>(shard);
  auto* stage = static_cast<unsigned char*>(staging);
  auto* dst = static_cast<unsigned char*>(full);
  for (const Bucket& b : plan.buckets) {
    std::vector<dist::Transfer> transfers;
    if (rank == 0) {
      for (int p = 1; p < plan.world; ++p) {
        if (b.slice_size(p) == 0) continue;
        transfers.push_back(dist::Transfer::recv(p, stage + staging_slot(p, 0) * plan.max_slice * elem_bytes,
                                                 b.slice_size(p) * elem_bytes));
      }
    } else if (b.slice_size(rank) > 0) {
      transfers.push_back(dist::Transfer::send(0, src + b.shard_offset[sz(rank)] * elem_bytes,
                                               b.slice_size(rank) * elem_bytes));
    }
    if (!transfers.empty()) {
      FLARE_RETURN_IF_ERROR(comm.exchange(transfers.data(), static_cast<int>(transfers.size()), stream));
    }
    if (rank != 0) continue;
    for (int p = 0; p < plan.world; ++p) {
      const int64_t n = b.slice_size(p);
      if (n == 0) continue;
      const unsigned char* from = p == 0 ? src + b.shard_offset[0] * elem_bytes
                                         : stage + staging_slot(p, 0) * plan.max_slice * elem_bytes;
      FLARE_RETURN_IF_ERROR(to_host(dst + b.slice_begin[sz(p)] * elem_bytes, from, n * elem_bytes));
    }
  }
  // The senders' last transfers are complete once rank 0 has them; a barrier makes every rank
  // leave together (and surfaces a failed peer on all of them).
  return comm.barrier();
}

}  // namespace flare::train::dp
