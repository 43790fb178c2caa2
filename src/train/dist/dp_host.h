// dp_host.h — the host-side pieces of a data-parallel step that both backends share: agreeing on
// per-rank numbers (valid-target counts, loss sums, gradient sums of squares) and gathering a
// sharded state to rank 0 for a checkpoint. Collectives: every rank of `comm` calls them in the
// same order.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "flare/dist.h"
#include "flare/status.h"
#include "train/dist/dp_plan.h"

namespace flare::train::dp {

// Every rank's `values` (the same count on each), rank after rank. Host-blocking, bounded by the
// communicator's timeout.
Status gather_values(dist::Communicator& comm, const std::vector<int64_t>& values,
                     std::vector<int64_t>* all);
Status gather_values(dist::Communicator& comm, const std::vector<double>& values,
                     std::vector<double>* all);

// Σ values in index (rank) order, in double: the same bits on every rank.
double sum_in_order(const std::vector<double>& values);

// Copies `bytes` from the shard memory (host or device) to host memory, waiting until done.
using CopyToHost = std::function<Status(void* host_dst, const void* src, int64_t bytes)>;

// Rank 0 receives every rank's shard of one state tensor (shard: this rank's shard buffer,
// elem_bytes per element, in the communicator's memory) into `full` (host, plan.total elements),
// bucket by bucket through `staging` ((world − 1) · plan.max_slice elements in the
// communicator's memory); the other ranks send and do not touch `full` (may be null).
Status gather_shards_to_rank0(dist::Communicator& comm, const DpPlan& plan, const void* shard,
                              void* staging, int64_t elem_bytes, void* full,
                              const CopyToHost& to_host, Stream stream = nullptr);

}  // namespace flare::train::dp
