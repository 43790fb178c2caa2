// all_to_all_attention.cpp — head-parallel context parallelism (Ulysses-style) at one rank, on
// host memory or a CUDA device (ctx.ops).
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
// O and LSE back; backward dout, q, k, v, O, LSE out and in, then dQ, dK, dV back. Each trade is
// one group of 2n transfers (a send to and a receive from every rank, itself included), issued on
// the communication stream after the packing and waited for by the unpacking (nothing overlaps:
// each step needs the previous one's data).
//
// Full-sequence buffers of (b, s, h, d) tensors are sequence-major in memory, (S, b, heads, d)
// seen as a (b, S, heads, d) view, so that each source rank's rows form one contiguous region and
// are received in place. LSE must be dense (b, heads, S) for the single-device call, so its rows
// arrive in a staging buffer and are copied into place.
//
// Packed batches (a batch of one over the pack, as in the ring): rank p holds its chunk of every
// sequence (varlen_shard), so its rows are runs scattered over the whole pack. They arrive in the
// staging buffer and are copied run by run into place, and go back the same way; the call is
// one varlen call over the whole pack, whose cu_seqlens were uploaded at create.
#include "dist/all_to_all_attention.h"

#include <algorithm>
#include <vector>

#include "dist/dist_internal.h"
#include "dist/layout.h"

namespace flare::dist {
namespace {

int64_t elem(DType d) { return static_cast<int64_t>(dtype_size(d)); }

// Which dimension of a local tensor holds its rows, which its heads.
struct Axes {
  int seq, head;
};
constexpr Axes kRowsFirst{1, 2};  // q, k, v, o, dout, dq, dk, dv: (b, s, h, d)
constexpr Axes kLseAxes{2, 1};    // lse: (b, h, s)

// The full-sequence tensors of this rank's heads, one slot each in the workspace: the forward uses
// q..lse, the backward all of them.
enum Full : int { kDout = 0, kQ, kK, kV, kO, kLse, kDq, kDk, kDv, kFullCount };

struct Plan {
  int n, r;
  int64_t b, d, s_total, s_local;
  int64_t hq, hk;  // heads per rank
  const CpContext* ctx;
  int64_t len(int p) const { return ctx->shards[p].length; }
  // Where rank p's rows sit among the slabs of every rank, in rank order.
  int64_t slot(int p) const {
    int64_t at = 0;
    for (int i = 0; i < p; ++i) at += len(i);
    return at;
  }
  // Rank p's rows in the full sequence: runs from its local row src_row to global row dst_row.
  std::vector<RowRun> runs(int p) const {
    std::vector<RowRun> out;
    if (!ctx->packed) add_runs(ctx->shards[p], false, &out);
    if (ctx->packed)
      for (const SequenceShard& seq : ctx->varlen[p].sequences) add_runs(seq, false, &out);
    return out;
  }
};

Plan plan_of(const CpContext& ctx) {
  const int n = ctx.comm->size();
  return {n,
          ctx.comm->rank(),
          ctx.packed ? 1 : ctx.batch,
          ctx.head_dim,
          ctx.s_total(),
          ctx.s_local(),
          ctx.heads_q / n,
          ctx.heads_kv / n,
          &ctx};
}

// `len` rows of `hh` heads as laid out in a slab or a full buffer: sequence-major (b, len, hh, d)
// for row-first tensors, dense (b, hh, len) for LSE.
TensorView laid_out(const CpContext& ctx, const Plan& m, void* data, DType dt, Axes ax, int64_t len,
                    int64_t hh) {
  if (ax.seq == kLseAxes.seq) return ctx.dense(data, dt, {m.b, hh, len});
  return TensorView::strided(data, dt, {m.b, len, hh, m.d}, {hh * m.d, m.b * hh * m.d, m.d, 1},
                             ctx.device, ctx.device_index);
}

// Bytes of `len` rows of `hh` heads.
int64_t slab_bytes(const Plan& m, DType dt, Axes ax, int64_t len, int64_t hh) {
  return m.b * len * hh * (ax.seq == kLseAxes.seq ? 1 : m.d) * elem(dt);
}

// Rows-first full buffers of fixed-length plans receive in place (each rank's rows are one run);
// LSE and packed plans go through the staging buffer.
bool in_place(const Plan& m, Axes ax) { return ax.seq == kRowsFirst.seq && !m.ctx->packed; }

// This rank's rows of every head of `local` → every row of its own hh heads in `full` (scatter),
// or the reverse (gather). One trade of n sends and n receives.
Status trade(CpContext& ctx, const Plan& m, const TensorView& local, Axes ax, int64_t hh,
             void* full, bool scatter) {
  CpOps& ops = *ctx.ops;
  const DType dt = local.dtype;
  const int64_t mine = slab_bytes(m, dt, ax, m.s_local, hh);  // bytes of this rank's rows
  auto* send = ctx.at(ctx.ws.a2a_send);
  auto* stage = ctx.at(ctx.ws.a2a_stage);
  auto* whole = static_cast<unsigned char*>(full);
  const TensorView full_view = laid_out(ctx, m, full, dt, ax, m.s_total, hh);
  // Where rank p's rows of the full buffer travel from or to: in place, or a staging slot.
  auto region = [&](int p) {
    return in_place(m, ax) ? whole + slab_bytes(m, dt, ax, m.slot(p), hh)
                           : (scatter ? stage : send) + slab_bytes(m, dt, ax, m.slot(p), hh);
  };
  // Rank p's rows between its slot (laid out as its local rows) and the full buffer.
  auto copy_runs = [&](int p, bool into_full) -> Status {
    const TensorView slot = laid_out(ctx, m, region(p), dt, ax, m.len(p), hh);
    for (const RowRun& run : m.runs(p))
      FLARE_RETURN_IF_ERROR(
          into_full ? ops.copy_rows(slot, run.src_row, full_view, run.dst_row, run.rows, ax.seq)
                    : ops.copy_rows(full_view, run.dst_row, slot, run.src_row, run.rows, ax.seq));
    return {};
  };
  std::vector<Transfer> t;
  for (int p = 0; p < m.n; ++p) {
    const TensorView heads = rows(local, ax.head, p * hh, hh);
    if (scatter) {
      FLARE_RETURN_IF_ERROR(ops.copy_rows(heads, 0,
                                          laid_out(ctx, m, send + p * mine, dt, ax, m.s_local, hh),
                                          0, m.s_local, ax.seq));
      t.push_back(Transfer::send(p, send + p * mine, mine));
      t.push_back(Transfer::recv(p, region(p), slab_bytes(m, dt, ax, m.len(p), hh)));
    } else {
      if (!in_place(m, ax)) FLARE_RETURN_IF_ERROR(copy_runs(p, false));
      t.push_back(Transfer::send(p, region(p), slab_bytes(m, dt, ax, m.len(p), hh)));
      t.push_back(Transfer::recv(p, stage + p * mine, mine));
    }
  }
  FLARE_RETURN_IF_ERROR(exchange_after_compute(ctx, t));
  FLARE_RETURN_IF_ERROR(ops.compute_waits_comm());
  for (int p = 0; p < m.n; ++p) {
    if (scatter) {
      if (!in_place(m, ax)) FLARE_RETURN_IF_ERROR(copy_runs(p, true));
    } else {
      FLARE_RETURN_IF_ERROR(ops.copy_rows(laid_out(ctx, m, stage + p * mine, dt, ax, m.s_local, hh),
                                          0, rows(local, ax.head, p * hh, hh), 0, m.s_local,
                                          ax.seq));
    }
  }
  return {};
}

// The full buffers of this rank's heads.
struct FullViews {
  const CpContext& ctx;
  const Plan& m;
  void* at(Full f) const { return ctx.at(ctx.ws.a2a_full[f]); }
  TensorView q_like(Full f) const {
    return laid_out(ctx, m, at(f), ctx.dtype, kRowsFirst, m.s_total, m.hq);
  }
  TensorView kv_like(Full f) const {
    return laid_out(ctx, m, at(f), ctx.dtype, kRowsFirst, m.s_total, m.hk);
  }
  TensorView lse() const {
    return laid_out(ctx, m, at(kLse), DType::kFloat32, kLseAxes, m.s_total, m.hq);
  }
  // A full buffer as the call takes it: the packed layout for packed plans.
  TensorView arg(const TensorView& t) const { return ctx.packed ? unbatched(t) : t; }
  // The call's sequences: the whole pack's (none for fixed-length plans).
  VarlenArgs varlen() const {
    VarlenArgs a;
    if (!ctx.packed) return a;
    const int64_t entries = static_cast<int64_t>(ctx.varlen[0].cu_seqlens.size());
    a.cu_seqlens_q = a.cu_seqlens_k = ctx.dense(ctx.at(ctx.ws.a2a_pack), DType::kInt32, {entries});
    a.max_seqlen_q = a.max_seqlen_k = ctx.pack_max_seqlen;
    return a;
  }
};

}  // namespace

void plan_all_to_all(CpContext& ctx, const std::vector<int32_t>& cu_seqlens,
                     std::vector<int32_t>* tables) {
  tables->clear();
  if (ctx.packed) {
    const std::vector<int32_t>& own = ctx.varlen[ctx.comm->rank()].cu_seqlens;
    tables->insert(tables->end(), own.begin(), own.end());  // the local pack, for validation
    tables->insert(tables->end(), cu_seqlens.begin(), cu_seqlens.end());
    ctx.pack_max_seqlen = 0;
    for (size_t i = 0; i + 1 < cu_seqlens.size(); ++i)
      ctx.pack_max_seqlen = std::max(ctx.pack_max_seqlen, cu_seqlens[i + 1] - cu_seqlens[i]);
  }
  CpWorkspace* ws = &ctx.ws;
  const Plan m = plan_of(ctx);
  const int64_t el = elem(ctx.dtype);
  // A slab set (n slabs of this rank's rows, or every row of this rank's heads) of the largest
  // tensor traded: q-like rows, or LSE.
  const int64_t q_rows = std::max(m.b * m.hq * m.d * el, m.b * m.hq * int64_t{4});
  WorkspaceCursor c;
  ws->tables = c.take(static_cast<int64_t>(tables->size()) * 4);
  ws->a2a_pack =
      ws->tables +
      (ctx.packed ? 4 * static_cast<int64_t>(ctx.varlen[ctx.comm->rank()].cu_seqlens.size()) : 0);
  ws->a2a_send = c.take(std::max(m.n * m.s_local, m.s_total) * q_rows);
  ws->a2a_stage = c.take(std::max(m.n * m.s_local, m.s_total) * q_rows);
  for (int f = 0; f < kFullCount; ++f) {
    const int64_t heads = (f == kK || f == kV || f == kDk || f == kDv) ? m.hk : m.hq;
    ws->a2a_full[f] = c.take(m.s_total * m.b * heads * (f == kLse ? 4 : m.d * el));
  }
  ws->bytes = c.end;
}

namespace {

Status forward(CpContext& ctx, const TensorView& q, const TensorView& k, const TensorView& v,
               const TensorView& o, const TensorView& lse, Stream stream) {
  OpsScope scope(*ctx.ops, stream);
  FLARE_RETURN_IF_ERROR(scope.status());
  const Plan m = plan_of(ctx);
  const FullViews f{ctx, m};
  FLARE_RETURN_IF_ERROR(trade(ctx, m, q, kRowsFirst, m.hq, f.at(kQ), true));
  FLARE_RETURN_IF_ERROR(trade(ctx, m, k, kRowsFirst, m.hk, f.at(kK), true));
  FLARE_RETURN_IF_ERROR(trade(ctx, m, v, kRowsFirst, m.hk, f.at(kV), true));
  FLARE_RETURN_IF_ERROR(attention_forward(
      f.arg(f.q_like(kQ)), f.arg(f.kv_like(kK)), f.arg(f.kv_like(kV)), f.arg(f.q_like(kO)),
      f.arg(f.lse()), ctx.block_options, f.varlen(), ctx.ops->compute_stream()));
  FLARE_RETURN_IF_ERROR(trade(ctx, m, o, kRowsFirst, m.hq, f.at(kO), false));
  return trade(ctx, m, lse, kLseAxes, m.hq, f.at(kLse), false);
}

Status backward(CpContext& ctx, const TensorView& dout, const TensorView& q, const TensorView& k,
                const TensorView& v, const TensorView& o, const TensorView& lse,
                const TensorView& dq, const TensorView& dk, const TensorView& dv, Stream stream) {
  OpsScope scope(*ctx.ops, stream);
  FLARE_RETURN_IF_ERROR(scope.status());
  const Plan m = plan_of(ctx);
  const FullViews f{ctx, m};
  FLARE_RETURN_IF_ERROR(trade(ctx, m, dout, kRowsFirst, m.hq, f.at(kDout), true));
  FLARE_RETURN_IF_ERROR(trade(ctx, m, q, kRowsFirst, m.hq, f.at(kQ), true));
  FLARE_RETURN_IF_ERROR(trade(ctx, m, k, kRowsFirst, m.hk, f.at(kK), true));
  FLARE_RETURN_IF_ERROR(trade(ctx, m, v, kRowsFirst, m.hk, f.at(kV), true));
  FLARE_RETURN_IF_ERROR(trade(ctx, m, o, kRowsFirst, m.hq, f.at(kO), true));
  FLARE_RETURN_IF_ERROR(trade(ctx, m, lse, kLseAxes, m.hq, f.at(kLse), true));
  FLARE_RETURN_IF_ERROR(attention_backward(
      f.arg(f.q_like(kDout)), f.arg(f.q_like(kQ)), f.arg(f.kv_like(kK)), f.arg(f.kv_like(kV)),
      f.arg(f.q_like(kO)), f.arg(f.lse()), f.arg(f.q_like(kDq)), f.arg(f.kv_like(kDk)),
      f.arg(f.kv_like(kDv)), ctx.block_options, f.varlen(), ctx.ops->compute_stream()));
  FLARE_RETURN_IF_ERROR(trade(ctx, m, dq, kRowsFirst, m.hq, f.at(kDq), false));
  FLARE_RETURN_IF_ERROR(trade(ctx, m, dk, kRowsFirst, m.hk, f.at(kDk), false));
  return trade(ctx, m, dv, kRowsFirst, m.hk, f.at(kDv), false);
}

}  // namespace

// Packed plans run as a batch of one over the pack (the ring's convention).
Status all_to_all_attention_forward(CpContext& ctx, const TensorView& q, const TensorView& k,
                                    const TensorView& v, const TensorView& o, const TensorView& lse,
                                    Stream stream) {
  return on_batch_views(
      ctx, [&](const auto&... t) { return forward(ctx, t..., stream); }, q, k, v, o, lse);
}

Status all_to_all_attention_backward(CpContext& ctx, const TensorView& dout, const TensorView& q,
                                     const TensorView& k, const TensorView& v, const TensorView& o,
                                     const TensorView& lse, const TensorView& dq,
                                     const TensorView& dk, const TensorView& dv, Stream stream) {
  return on_batch_views(
      ctx, [&](const auto&... t) { return backward(ctx, t..., stream); }, dout, q, k, v, o, lse, dq,
      dk, dv);
}

}  // namespace flare::dist
