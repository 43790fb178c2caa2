// all_to_all_attention.cpp — head-parallel context parallelism (Ulysses-style) at one rank.
//
// Ranks hold contiguous rows of every head (the ring layout). One all-to-all turns that into
// every row of heads_q / n query heads and heads_kv / n K/V heads: rank p receives from each rank
// its rows of p's heads (query head i reads K/V head i / (heads_q / heads_kv), so p's query heads
// read exactly p's K/V heads and nothing is copied twice). One single-device call then runs over
// the whole sequence, and a second all-to-all returns each rank its rows of every head. There is
// no merge: every output element comes from one call, as on one device, and masks that depend on
// positions (causal, sliding window) are the single-device ones over the full sequence.
//
// Traffic per rank and call, in elements of the local tensors: forward q + k + v out and in, then
// O and LSE back; backward dout, q, k, v, O, LSE out and in, then dQ, dK, dV back. Each exchange
// is one group of 2n transfers (a send to and a receive from every rank, itself included).
//
// Full-sequence buffers are sequence-major in memory, (S, b, heads, d) seen as a (b, S, heads, d)
// view, so that each source rank's rows form one contiguous region and are received in place.
#include "dist/all_to_all_attention.h"

#include <vector>

#include "dist/dist_internal.h"
#include "dist/layout.h"

namespace flare::dist {
namespace {

int64_t elem(DType d) { return static_cast<int64_t>(dtype_size(d)); }

// A (b, S, heads, d) view of a sequence-major buffer.
TensorView seq_major(void* data, DType dtype, int64_t b, int64_t s, int64_t heads, int64_t d) {
  return TensorView::strided(data, dtype, {b, s, heads, d}, {heads * d, b * heads * d, d, 1});
}

struct Plan {
  int n, r;
  int64_t b, d, s_total, s_local;
  const std::vector<SequenceShard>* shards;
  int64_t begin(int p) const { return (*shards)[p].chunk[0].global_begin; }
  int64_t len(int p) const { return (*shards)[p].length; }
};

Plan plan_of(const CpContext& ctx) {
  const int r = ctx.comm->rank();
  int64_t total = 0;
  for (const SequenceShard& s : ctx.shards) total += s.length;
  return {ctx.comm->size(), r, ctx.batch, ctx.head_dim, total, ctx.shards[r].length, &ctx.shards};
}

// This rank's rows of every head of `local` (b, s_local, heads, d) → every row of its own
// heads_per_rank heads, sequence-major in `full`.
Status scatter_heads(CpContext& ctx, const Plan& m, const TensorView& local, int64_t hh,
                     void* full, Stream stream) {
  const DType dt = local.dtype;
  const int64_t slab = m.s_local * m.b * hh * m.d * elem(dt);  // bytes to each rank
  auto* send = grow(ctx.scratch.a2a_send, m.n * slab);
  auto* out = static_cast<unsigned char*>(full);
  std::vector<Transfer> t;
  for (int p = 0; p < m.n; ++p) {
    copy_rows(rows(local, 2, p * hh, hh), 0, seq_major(send + p * slab, dt, m.b, m.s_local, hh, m.d),
              0, m.s_local, 1);
    t.push_back(Transfer::send(p, send + p * slab, slab));
    t.push_back(Transfer::recv(p, out + m.begin(p) * m.b * hh * m.d * elem(dt),
                               m.len(p) * m.b * hh * m.d * elem(dt)));
  }
  return ctx.comm->exchange(t.data(), static_cast<int>(t.size()), stream);
}

// The inverse: every row of this rank's heads (sequence-major `full`) → each rank's rows, and
// this rank's rows of every head into `local`.
Status gather_heads(CpContext& ctx, const Plan& m, const void* full, int64_t hh,
                    const TensorView& local, Stream stream) {
  const DType dt = local.dtype;
  const int64_t slab = m.s_local * m.b * hh * m.d * elem(dt);  // bytes from each rank
  auto* stage = grow(ctx.scratch.a2a_stage, m.n * slab);
  const auto* in = static_cast<const unsigned char*>(full);
  std::vector<Transfer> t;
  for (int p = 0; p < m.n; ++p) {
    t.push_back(Transfer::send(p, in + m.begin(p) * m.b * hh * m.d * elem(dt),
                               m.len(p) * m.b * hh * m.d * elem(dt)));
    t.push_back(Transfer::recv(p, stage + p * slab, slab));
  }
  FLARE_RETURN_IF_ERROR(ctx.comm->exchange(t.data(), static_cast<int>(t.size()), stream));
  for (int p = 0; p < m.n; ++p)
    copy_rows(seq_major(stage + p * slab, dt, m.b, m.s_local, hh, m.d), 0,
              rows(local, 2, p * hh, hh), 0, m.s_local, 1);
  return {};
}

// LSE (b, heads_q, s_local) → (b, hh, S) of this rank's heads, dense in `full`.
Status scatter_lse(CpContext& ctx, const Plan& m, const TensorView& lse, int64_t hh, float* full,
                   Stream stream) {
  const int64_t slab = m.b * hh * m.s_local;  // floats to each rank
  float* send = grow<float>(ctx.scratch.a2a_send, m.n * slab * 4);
  int64_t staged = 0;
  for (int p = 0; p < m.n; ++p) staged += m.b * hh * m.len(p);
  float* stage = grow<float>(ctx.scratch.a2a_stage, staged * 4);
  std::vector<Transfer> t;
  int64_t offset = 0;
  for (int p = 0; p < m.n; ++p) {
    copy_rows(rows(lse, 1, p * hh, hh), 0,
              TensorView::contiguous(send + p * slab, DType::kFloat32, {m.b, hh, m.s_local}), 0,
              m.s_local, 2);
    t.push_back(Transfer::send(p, send + p * slab, slab * 4));
    t.push_back(Transfer::recv(p, stage + offset, m.b * hh * m.len(p) * 4));
    offset += m.b * hh * m.len(p);
  }
  FLARE_RETURN_IF_ERROR(ctx.comm->exchange(t.data(), static_cast<int>(t.size()), stream));
  const TensorView whole = TensorView::contiguous(full, DType::kFloat32, {m.b, hh, m.s_total});
  offset = 0;
  for (int p = 0; p < m.n; ++p) {
    copy_rows(TensorView::contiguous(stage + offset, DType::kFloat32, {m.b, hh, m.len(p)}), 0, whole,
              m.begin(p), m.len(p), 2);
    offset += m.b * hh * m.len(p);
  }
  return {};
}

// The inverse of scatter_lse.
Status gather_lse(CpContext& ctx, const Plan& m, float* full, int64_t hh, const TensorView& lse,
                  Stream stream) {
  int64_t packed = 0;
  for (int p = 0; p < m.n; ++p) packed += m.b * hh * m.len(p);
  float* send = grow<float>(ctx.scratch.a2a_send, packed * 4);
  const int64_t slab = m.b * hh * m.s_local;  // floats from each rank
  float* stage = grow<float>(ctx.scratch.a2a_stage, m.n * slab * 4);
  const TensorView whole = TensorView::contiguous(full, DType::kFloat32, {m.b, hh, m.s_total});
  std::vector<Transfer> t;
  int64_t offset = 0;
  for (int p = 0; p < m.n; ++p) {
    copy_rows(whole, m.begin(p),
              TensorView::contiguous(send + offset, DType::kFloat32, {m.b, hh, m.len(p)}), 0,
              m.len(p), 2);
    t.push_back(Transfer::send(p, send + offset, m.b * hh * m.len(p) * 4));
    t.push_back(Transfer::recv(p, stage + p * slab, slab * 4));
    offset += m.b * hh * m.len(p);
  }
  FLARE_RETURN_IF_ERROR(ctx.comm->exchange(t.data(), static_cast<int>(t.size()), stream));
  for (int p = 0; p < m.n; ++p)
    copy_rows(TensorView::contiguous(stage + p * slab, DType::kFloat32, {m.b, hh, m.s_local}), 0,
              rows(lse, 1, p * hh, hh), 0, m.s_local, 2);
  return {};
}

// Buffer `i` of the full-sequence tensors, sized for `heads` heads of `dtype`.
void* full_buffer(CpContext& ctx, const Plan& m, int i, int64_t heads, DType dtype) {
  return grow(ctx.scratch.a2a_full[i], m.s_total * m.b * heads * m.d * elem(dtype));
}

}  // namespace

Status all_to_all_attention_forward(CpContext& ctx, const TensorView& q, const TensorView& k,
                                    const TensorView& v, const TensorView& o,
                                    const TensorView& lse, Stream stream) {
  const Plan m = plan_of(ctx);
  const int64_t hq = ctx.heads_q / m.n, hk = ctx.heads_kv / m.n;
  const DType dt = ctx.dtype;
  void* qf = full_buffer(ctx, m, 0, hq, dt);
  void* kf = full_buffer(ctx, m, 1, hk, dt);
  void* vf = full_buffer(ctx, m, 2, hk, dt);
  void* of = full_buffer(ctx, m, 3, hq, dt);
  auto* lsef = static_cast<float*>(full_buffer(ctx, m, 4, hq, DType::kFloat32));
  FLARE_RETURN_IF_ERROR(scatter_heads(ctx, m, q, hq, qf, stream));
  FLARE_RETURN_IF_ERROR(scatter_heads(ctx, m, k, hk, kf, stream));
  FLARE_RETURN_IF_ERROR(scatter_heads(ctx, m, v, hk, vf, stream));
  FLARE_RETURN_IF_ERROR(attention_forward(
      seq_major(qf, dt, m.b, m.s_total, hq, m.d), seq_major(kf, dt, m.b, m.s_total, hk, m.d),
      seq_major(vf, dt, m.b, m.s_total, hk, m.d), seq_major(of, dt, m.b, m.s_total, hq, m.d),
      TensorView::contiguous(lsef, DType::kFloat32, {m.b, hq, m.s_total}), ctx.block_options, {},
      stream));
  FLARE_RETURN_IF_ERROR(gather_heads(ctx, m, of, hq, o, stream));
  return gather_lse(ctx, m, lsef, hq, lse, stream);
}

Status all_to_all_attention_backward(CpContext& ctx, const TensorView& dout, const TensorView& q,
                                     const TensorView& k, const TensorView& v,
                                     const TensorView& o, const TensorView& lse,
                                     const TensorView& dq, const TensorView& dk,
                                     const TensorView& dv, Stream stream) {
  const Plan m = plan_of(ctx);
  const int64_t hq = ctx.heads_q / m.n, hk = ctx.heads_kv / m.n;
  const DType dt = ctx.dtype;
  void* dof = full_buffer(ctx, m, 0, hq, dt);
  void* qf = full_buffer(ctx, m, 1, hq, dt);
  void* kf = full_buffer(ctx, m, 2, hk, dt);
  void* vf = full_buffer(ctx, m, 3, hk, dt);
  void* of = full_buffer(ctx, m, 4, hq, dt);
  auto* lsef = static_cast<float*>(full_buffer(ctx, m, 5, hq, DType::kFloat32));
  void* dqf = full_buffer(ctx, m, 6, hq, dt);
  void* dkf = full_buffer(ctx, m, 7, hk, dt);
  void* dvf = full_buffer(ctx, m, 8, hk, dt);
  FLARE_RETURN_IF_ERROR(scatter_heads(ctx, m, dout, hq, dof, stream));
  FLARE_RETURN_IF_ERROR(scatter_heads(ctx, m, q, hq, qf, stream));
  FLARE_RETURN_IF_ERROR(scatter_heads(ctx, m, k, hk, kf, stream));
  FLARE_RETURN_IF_ERROR(scatter_heads(ctx, m, v, hk, vf, stream));
  FLARE_RETURN_IF_ERROR(scatter_heads(ctx, m, o, hq, of, stream));
  FLARE_RETURN_IF_ERROR(scatter_lse(ctx, m, lse, hq, lsef, stream));
  auto qv = [&](void* p) { return seq_major(p, dt, m.b, m.s_total, hq, m.d); };
  auto kv = [&](void* p) { return seq_major(p, dt, m.b, m.s_total, hk, m.d); };
  FLARE_RETURN_IF_ERROR(attention_backward(
      qv(dof), qv(qf), kv(kf), kv(vf), qv(of),
      TensorView::contiguous(lsef, DType::kFloat32, {m.b, hq, m.s_total}), qv(dqf), kv(dkf),
      kv(dvf), ctx.block_options, {}, stream));
  FLARE_RETURN_IF_ERROR(gather_heads(ctx, m, dqf, hq, dq, stream));
  FLARE_RETURN_IF_ERROR(gather_heads(ctx, m, dkf, hk, dk, stream));
  return gather_heads(ctx, m, dvf, hk, dv, stream);
}

}  // namespace flare::dist
