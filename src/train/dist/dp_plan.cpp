// dp_plan.cpp — the bucket and shard arithmetic of dp_plan.h.
#include "train/dist/dp_plan.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "core/message.h"

namespace flare::train::dp {
namespace {

size_t sz(int64_t n) { return static_cast<size_t>(n); }

// Rank r's first element of a bucket [begin, end) cut into `world` slices of whole 64-element
// units (the rule in dp_plan.h).
int64_t slice_start(int64_t begin, int64_t end, int world, int r) {
  const int64_t units = (end - begin + kParamAlignment - 1) / kParamAlignment;
  const int64_t base = units / world, extra = units % world;
  const int64_t first_unit = r * base + std::min<int64_t>(r, extra);
  return std::min(end, begin + first_unit * kParamAlignment);
}

}  // namespace

Status make_dp_plan(const ParameterLayout& layout, int64_t n_layer, int world,
                    int64_t bucket_bytes, DpPlan* plan, bool stage_buckets) {
  if (plan == nullptr) return invalid("make_dp_plan: plan is null");
  if (world < 1) return invalid("world: ", world, " ranks, must be >= 1");
  if (bucket_bytes < 1) return invalid("bucket_bytes: ", bucket_bytes, " must be >= 1");
  if (n_layer < 0) return invalid("n_layer: ", n_layer, " must be >= 0");
  if (layout.params.empty() || layout.total < 1) return invalid("layout: has no parameters");
  if (layout.params.front().offset != 0) {
    return invalid("layout: the first tensor starts at ", layout.params.front().offset, ", not 0");
  }
  for (size_t i = 0; i < layout.params.size(); ++i) {
    const ParamSpec& p = layout.params[i];
    const int64_t next = i + 1 < layout.params.size() ? layout.params[i + 1].offset : layout.total;
    if (p.offset % kParamAlignment != 0 || p.numel < 0 || p.offset + p.numel > next) {
      return invalid("layout: tensor '", p.name, "' at ", p.offset, " (", p.numel,
                     " elements) is not aligned to ", kParamAlignment, " or overlaps the next");
    }
  }

  DpPlan out;
  out.world = world;
  out.total = layout.total;
  out.bucket_bytes = bucket_bytes;
  out.stage_buckets = stage_buckets;
  FLARE_RETURN_IF_ERROR(backward_stage_ranges(layout, n_layer, &out.stage_begin, &out.stage_end));
  // Tensors from the top of the buffer down; a bucket closes once it holds bucket_bytes.
  int64_t end = layout.total;
  int64_t stage = 0;
  for (size_t i = layout.params.size(); i-- > 0;) {
    const ParamSpec& p = layout.params[i];
    stage = std::max(stage, backward_stage(p, n_layer));
    const bool full = (end - p.offset) * int64_t{sizeof(float)} >= bucket_bytes;
    const bool stage_ends = stage_buckets && i > 0 && backward_stage(layout.params[i - 1], n_layer) != stage;
    if (!full && !stage_ends && i > 0) continue;
    Bucket b;
    b.begin = p.offset;
    b.end = end;
    b.ready_stage = stage;  // the running maximum: never decreases along the list
    out.buckets.push_back(std::move(b));
    end = p.offset;
  }

  out.shard_elements.assign(sz(world), 0);
  // Slices enter the shard in flat order (the last bucket first), so that for one rank the shard
  // is the flat buffer itself.
  for (auto it = out.buckets.rbegin(); it != out.buckets.rend(); ++it) {
    Bucket& b = *it;
    b.slice_begin.resize(sz(world) + 1);
    b.shard_offset.resize(sz(world));
    for (int r = 0; r <= world; ++r) b.slice_begin[sz(r)] = slice_start(b.begin, b.end, world, r);
    for (int r = 0; r < world; ++r) {
      b.shard_offset[sz(r)] = out.shard_elements[sz(r)];
      out.shard_elements[sz(r)] += b.slice_size(r);
      out.max_slice = std::max(out.max_slice, b.slice_size(r));
    }
  }
  *plan = std::move(out);
  return Status::ok_status();
}

ParameterLayout shard_layout(const ParameterLayout& layout, const DpPlan& plan, int rank) {
  ParameterLayout out;
  out.total = plan.shard_size(rank);
  for (const Bucket& b : plan.buckets) {
    const int64_t lo = b.slice_begin[sz(rank)], hi = b.slice_begin[sz(rank) + 1];
    if (lo == hi) continue;
    // The parameters in flat order; a bucket holds few, so a scan is cheap.
    for (const ParamSpec& p : layout.params) {
      const int64_t first = std::max(lo, p.offset), last = std::min(hi, p.offset + p.numel);
      if (first >= last) continue;
      ParamSpec piece;
      piece.name = p.name;
      piece.shape = {last - first};
      piece.offset = b.shard_offset[sz(rank)] + (first - lo);
      piece.numel = last - first;
      piece.weight_decay = p.weight_decay;
      piece.init_std = p.init_std;
      piece.init_ones = p.init_ones;
      out.params.push_back(std::move(piece));
    }
  }
  // Buckets run down the flat buffer, their slices up the shard: pieces in shard order.
  std::sort(out.params.begin(), out.params.end(),
            [](const ParamSpec& a, const ParamSpec& b) { return a.offset < b.offset; });
  return out;
}

void full_to_shard(const DpPlan& plan, int rank, const void* full, void* shard, int64_t elem_bytes) {
  const auto* src = static_cast<const unsigned char*>(full);
  auto* dst = static_cast<unsigned char*>(shard);
  for (const Bucket& b : plan.buckets) {
    const int64_t n = b.slice_size(rank);
    if (n == 0) continue;
    std::memcpy(dst + b.shard_offset[sz(rank)] * elem_bytes, src + b.slice_begin[sz(rank)] * elem_bytes,
                sz(n * elem_bytes));
  }
}

void shard_to_full(const DpPlan& plan, int rank, const void* shard, void* full, int64_t elem_bytes) {
  const auto* src = static_cast<const unsigned char*>(shard);
  auto* dst = static_cast<unsigned char*>(full);
  for (const Bucket& b : plan.buckets) {
    const int64_t n = b.slice_size(rank);
    if (n == 0) continue;
    std::memcpy(dst + b.slice_begin[sz(rank)] * elem_bytes, src + b.shard_offset[sz(rank)] * elem_bytes,
                sz(n * elem_bytes));
  }
}

std::vector<dist::Transfer> reduce_scatter_transfers(const DpPlan& plan, const Bucket& bucket,
                                                     int rank, const void* grads, void* staging,
                                                     int64_t elem_bytes, int64_t grads_first) {
  std::vector<dist::Transfer> out;
  const auto* g = static_cast<const unsigned char*>(grads);
  auto* stage = static_cast<unsigned char*>(staging);
  const int64_t mine = bucket.slice_size(rank);
  for (int p = 0; p < plan.world; ++p) {
    if (p == rank) continue;
    const int64_t theirs = bucket.slice_size(p);
    if (theirs > 0) {
      out.push_back(dist::Transfer::send(p, g + (bucket.slice_begin[sz(p)] - grads_first) * elem_bytes,
                                         theirs * elem_bytes));
    }
    if (mine > 0) {
      out.push_back(dist::Transfer::recv(p, stage + staging_slot(p, rank) * plan.max_slice * elem_bytes,
                                         mine * elem_bytes));
    }
  }
  return out;
}

std::vector<dist::Transfer> all_gather_transfers(const DpPlan& plan, const Bucket& bucket, int rank,
                                                 const void* shard, void* full, int64_t elem_bytes) {
  std::vector<dist::Transfer> out;
  const auto* src = static_cast<const unsigned char*>(shard) + bucket.shard_offset[sz(rank)] * elem_bytes;
  auto* dst = static_cast<unsigned char*>(full);
  const int64_t mine = bucket.slice_size(rank);
  for (int p = 0; p < plan.world; ++p) {
    if (p == rank) continue;
    if (mine > 0) out.push_back(dist::Transfer::send(p, src, mine * elem_bytes));
    const int64_t theirs = bucket.slice_size(p);
    if (theirs > 0) {
      out.push_back(dist::Transfer::recv(p, dst + bucket.slice_begin[sz(p)] * elem_bytes, theirs * elem_bytes));
    }
  }
  return out;
}

}  // namespace flare::train::dp
