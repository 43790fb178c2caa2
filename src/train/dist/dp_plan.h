// dp_plan.h — the data-parallel plan as data: which rank owns which part of the flat parameter
// vector (ZeRO-1: optimizer state sharded), and which gradient bucket is reduced when.
//
// Buckets. The flat gradient (parameter_layout(model), layout.total fp32) is cut into buckets of
// whole parameters, formed in backward order: the backward finishes the output head and final
// norm first, then layer n_layer−1 … layer 0, then the embeddings, which in the flat buffer (embed,
// pos_embed, layers 0…L−1, final_norm, head) is the reverse of buffer order. Walking the tensors
// from the top of the buffer down, a bucket closes as soon as it holds at least bucket_bytes of
// fp32 gradient, so each bucket is one contiguous range [begin, end) of the flat buffer, buckets
// tile [0, layout.total) without gaps, and buckets[0] is the highest range. A bucket's
// ready_stage is the backward stage (backward_stage()) after which every gradient in it is final;
// the stages never decrease along the bucket list, so the buckets can be reduced in list order,
// each as soon as its stage has passed, while the backward goes on.
//
// Shards. Every bucket is split into `world` slices, one per rank, and a rank's shard is the
// concatenation of its slices of every bucket in flat-buffer order (the last bucket first), so
// that with one rank the shard is the flat buffer itself. Slicing per bucket (rather than
// cutting the whole vector into `world` contiguous pieces) is what lets each bucket be
// reduce-scattered on its own with every rank sending and receiving about 1/world of it: with
// contiguous whole-vector shards a bucket would lie inside one or two ranks' shards and every
// other rank would send to those alone. The rule, which every collective relies on:
//   - bucket boundaries are tensor offsets, so multiples of kParamAlignment (64) elements;
//   - a bucket of u = (end − begin) / 64 units gives rank r ⌊u/world⌋ units, one more for the
//     first u mod world ranks, in rank order; so every slice starts 64 elements (256 bytes of
//     fp32, 128 of bf16) into an aligned buffer and is vector-loadable; slices may be empty
//     (tiny buckets, many ranks) and are then skipped by every rank alike;
//   - rank r's slice of bucket k sits at shard_offset[k][r] of its shard buffers (master, m, v,
//     the reduced gradient, the updated bf16 weights), the sum of its earlier slices' lengths.
// The shard holds the alignment gaps of its slices too (zero, as in the flat buffer); the
// optimizer skips them through shard_layout(), which lists the pieces of parameters a shard holds.
//
// Everything here is pure arithmetic on the layout: every rank computes the same plan.
#pragma once

#include <cstdint>
#include <vector>

#include "flare/dist.h"
#include "flare/status.h"
#include "train/core/model_config.h"

namespace flare::train::dp {

// 25 MiB of fp32 gradient per bucket: large enough that each collective runs near link bandwidth
// (NCCL reaches most of its bus bandwidth from a few MiB per rank), small enough that the first
// buckets are on the wire while most of the backward is still to run. The value PyTorch DDP uses.
inline constexpr int64_t kDefaultBucketBytes = int64_t{25} << 20;

// The backward's stages (model_config.h: backward_stage, backward_stage_count) order the buckets.

struct Bucket {
  int64_t begin = 0;        // flat elements [begin, end)
  int64_t end = 0;
  int64_t ready_stage = 0;  // reduce it once this backward stage has finished
  // world + 1 boundaries: rank r's slice is [slice_begin[r], slice_begin[r + 1]).
  std::vector<int64_t> slice_begin;
  // Where rank r's slice starts in rank r's shard buffers.
  std::vector<int64_t> shard_offset;

  int64_t slice_size(int rank) const { return slice_begin[rank + 1] - slice_begin[rank]; }
};

struct DpPlan {
  int world = 1;
  int64_t total = 0;         // layout.total: the flat buffer's elements
  int64_t bucket_bytes = 0;  // the target the buckets were formed with
  bool stage_buckets = false;  // no bucket spans two backward stages (sharded gradients need it)
  // Per backward stage: the flat range [stage_begin, stage_end) its tensors (and the alignment
  // gaps after them) tile; the stages tile [0, total) (empty stages have begin == end).
  std::vector<int64_t> stage_begin, stage_end;
  std::vector<Bucket> buckets;          // in backward (issue) order: buckets[0] is the highest
  std::vector<int64_t> shard_elements;  // per rank: the length of its shard
  int64_t max_slice = 0;                // the longest slice of any bucket and rank

  int64_t shard_size(int rank) const { return shard_elements[rank]; }
  int64_t stage_size(int64_t stage) const { return stage_end[stage] - stage_begin[stage]; }
};

// The plan for `world` ranks. Fails (naming the argument) on world < 1, bucket_bytes < 1, or a
// layout that is empty, not aligned as model_config.h promises, or whose stages are not each one
// contiguous range. stage_buckets: a bucket also closes where the next tensor down belongs to
// another stage, so each bucket lies in one stage (ZeRO-2 keeps only a few stages' gradients).
Status make_dp_plan(const ParameterLayout& layout, int64_t n_layer, int world,
                    int64_t bucket_bytes, DpPlan* plan, bool stage_buckets = false);

// The pieces of parameters in rank `rank`'s shard, as a layout over the shard buffer: one
// ParamSpec per (parameter, bucket slice) intersection, at its shard offset, with the parameter's
// name, weight_decay and a one-dimensional shape; total = the shard's length. The optimizer and
// the gradient norm walk it exactly as they walk the full layout.
ParameterLayout shard_layout(const ParameterLayout& layout, const DpPlan& plan, int rank);

// Copies between a full flat buffer and rank `rank`'s shard of it (host memory, elements of
// `elem_bytes` each): full_to_shard takes a rank's part of a full state (set_state, resume at any
// world size), shard_to_full puts it back (checkpoints).
void full_to_shard(const DpPlan& plan, int rank, const void* full, void* shard, int64_t elem_bytes);
void shard_to_full(const DpPlan& plan, int rank, const void* shard, void* full, int64_t elem_bytes);

// The transfers of one bucket's reduce-scatter on rank `rank`: its slice p of `grads` (the flat
// gradient, elements of elem_bytes) goes to every other rank p, and every other rank's copy of
// this rank's slice arrives in `staging`, rank q < rank in slot q and q > rank in slot q − 1, each
// slot max_slice elements apart. Empty slices have no transfer. Then
// reduce = Σ over ranks in rank order of (staging slot or this rank's own slice).
// `grads` holds the flat buffer from element `grads_first` on (0: the whole buffer; a stage's
// buffer with sharded gradients: that stage's first element).
std::vector<dist::Transfer> reduce_scatter_transfers(const DpPlan& plan, const Bucket& bucket,
                                                     int rank, const void* grads, void* staging,
                                                     int64_t elem_bytes, int64_t grads_first = 0);
// Slot of rank q's contribution in the staging buffer of reduce_scatter_transfers (q != rank);
// also called by the CUDA kernel that sums the slots (dp_cuda.cu).
#if defined(__CUDACC__)
#define FLARE_DP_HOST_DEVICE __host__ __device__
#else
#define FLARE_DP_HOST_DEVICE
#endif
inline FLARE_DP_HOST_DEVICE int64_t staging_slot(int q, int rank) { return q < rank ? q : q - 1; }

// The transfers of one bucket's all-gather on rank `rank`: this rank's updated slice, at
// `shard` + shard_offset (elements of elem_bytes), goes to every other rank, and every other
// rank's slice arrives at its place in the flat buffer `full`. The caller copies its own slice.
std::vector<dist::Transfer> all_gather_transfers(const DpPlan& plan, const Bucket& bucket, int rank,
                                                 const void* shard, void* full, int64_t elem_bytes);

}  // namespace flare::train::dp
