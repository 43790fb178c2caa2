// ring_attention.cpp — ring attention at one rank: the forward merges per-block (O, LSE), the
// backward returns dK/dV to their owners.
//
// Forward, at rank r of n, step i = 0 … n−1, holding the K/V block of src = (r − i) mod n:
//   1. start the next block's transfer: send the held block to r+1 and receive r−1's (the block
//      of src − 1) into the other receive buffer — skipped at the last step;
//   2. attend: one attention_forward call per task of ring_step_tasks (layout.h) on this rank's
//      queries and the held block, each call's (O, LSE) merged into fp32 accumulators (merge.h);
//   3. the received block is held at step i+1.
// Then O and LSE are rounded into the outputs, once.
//
// Backward, the same ring, with the forward's final O and LSE. Why blocks give exact gradients:
// with the full row's LSE, P_ij = exp(s_ij − LSE_i) is the final probability, and the flash
// backward's D_i = rowsum(dO_i ∘ O_i) is the full row's, so each block call computes exactly the
// single-device terms of dS for its pairs and their contributions to dQ, dK and dV; the sum over
// blocks is the single-device gradient. dQ accumulates locally in fp32. dK and dV of the held
// block accumulate in an fp32 buffer that travels with the block: after step i it goes to r+1,
// which holds that block at step i+1; after step n−1 the buffer that arrives from r−1 belongs to
// this rank's own block. So n−1 K/V transfers and n dK/dV transfers per rank, every one to the
// next rank, and every rank the same amount of work under the zigzag layout.
//
// Buffers and overlap: step i sends the held block while receiving into the other buffer, and
// step i+1 receives into the buffer sent at step i, so a block is never overwritten while it is
// read. With the in-process communicator each exchange completes before the attention calls of
// its step start; a stream-ordered communicator (NCCL) runs it on its own stream while those calls
// run (docs/context-parallel.md says what the GPU path still needs).
#include "dist/ring_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/numeric.h"
#include "dist/dist_internal.h"
#include "dist/layout.h"
#include "dist/merge.h"

namespace flare::dist {
namespace {

// Sizes of the problem at this rank.
struct Dims {
  int64_t b, hq, hkv, d, s_local, s_max;
  DType dtype;
  int64_t kv_elems(int64_t len) const { return b * len * hkv * d; }
  int64_t q_elems(int64_t len) const { return b * len * hq * d; }
  int64_t kv_bytes(int64_t len) const {
    return kv_elems(len) * static_cast<int64_t>(dtype_size(dtype));
  }
};

Dims dims_of(const CpContext& ctx) {
  Dims m{ctx.batch, ctx.heads_q, ctx.heads_kv, ctx.head_dim, 0, 0, ctx.dtype};
  m.s_local = ctx.shards[ctx.comm->rank()].length;
  for (const SequenceShard& s : ctx.shards) m.s_max = std::max(m.s_max, s.length);
  return m;
}

// A K/V block: dense (b, len, h_kv, d) views, in user memory or a receive buffer.
struct KvBlock {
  TensorView k, v;
  int64_t len = 0;
};

KvBlock dense_block(unsigned char* base, const Dims& m, int64_t len) {
  KvBlock blk;
  blk.k = TensorView::contiguous(base, m.dtype, {m.b, len, m.hkv, m.d});
  blk.v = TensorView::contiguous(base + m.kv_bytes(m.s_max), m.dtype, {m.b, len, m.hkv, m.d});
  blk.len = len;
  return blk;
}

// This rank's own block as dense views: the user's tensors when they are dense already (nothing
// copied), else a packed copy to send from.
KvBlock local_block(CpContext& ctx, const Dims& m, const TensorView& k, const TensorView& v) {
  if (k.is_contiguous() && v.is_contiguous()) return {k, v, m.s_local};
  KvBlock blk = dense_block(grow(ctx.scratch.kv_send, 2 * m.kv_bytes(m.s_max)), m, m.s_local);
  copy_rows(k, 0, blk.k, 0, m.s_local, 1);
  copy_rows(v, 0, blk.v, 0, m.s_local, 1);
  return blk;
}

// Step 1 of the ring: the held block to the next rank, the previous rank's into `incoming`.
Status pass_block(Communicator& comm, const KvBlock& held, const KvBlock& incoming,
                  const Dims& m, Stream stream) {
  const int n = comm.size(), r = comm.rank();
  const Transfer t[4] = {
      Transfer::send((r + 1) % n, held.k.data, m.kv_bytes(held.len)),
      Transfer::send((r + 1) % n, held.v.data, m.kv_bytes(held.len)),
      Transfer::recv((r + n - 1) % n, incoming.k.data, m.kv_bytes(incoming.len)),
      Transfer::recv((r + n - 1) % n, incoming.v.data, m.kv_bytes(incoming.len)),
  };
  return comm.exchange(t, 4, stream);
}

// The block this rank receives at step `step` (held at step + 1), in receive buffer step % 2.
KvBlock incoming_block(CpContext& ctx, const Dims& m, int step) {
  const int n = ctx.comm->size(), owner = ((ctx.comm->rank() - step - 1) % n + n) % n;
  return dense_block(grow(ctx.scratch.kv_recv[step % 2], 2 * m.kv_bytes(m.s_max)), m,
                     ctx.shards[owner].length);
}

AttentionOptions block_options(const CpContext& ctx, const BlockTask& t) {
  AttentionOptions o = ctx.block_options;
  o.causal = t.causal;
  return o;
}

// Folds one block call's (O, LSE) over local query rows [t.q_begin, t.q_begin + t.q_len) into the
// fp32 accumulators.
void merge_block(const Dims& m, const BlockTask& t, const void* o_blk, const float* lse_blk,
                 float* o_acc, float* lse_acc) {
  for (int64_t b = 0; b < m.b; ++b)
    for (int64_t h = 0; h < m.hq; ++h)
      for (int64_t i = 0; i < t.q_len; ++i) {
        float& lse = lse_acc[(b * m.hq + h) * m.s_local + t.q_begin + i];
        const MergeWeights w = merge_weights(lse, lse_blk[(b * m.hq + h) * t.q_len + i]);
        lse = w.lse;
        float* acc = o_acc + ((b * m.s_local + t.q_begin + i) * m.hq + h) * m.d;
        const int64_t blk = ((b * t.q_len + i) * m.hq + h) * m.d;
        for (int64_t c = 0; c < m.d; ++c)
          acc[c] = w.a * acc[c] + w.b * load_as_float(o_blk, blk + c, m.dtype);
      }
}

// acc rows [row0, row0 + rows) of a dense fp32 (b, len, h, d) += a dense dtype (b, rows, h, d).
void accumulate_rows(float* acc, int64_t len, int64_t row0, const void* blk, int64_t rows,
                     int64_t b_count, int64_t hd, DType dtype) {
  for (int64_t b = 0; b < b_count; ++b)
    for (int64_t i = 0; i < rows; ++i) {
      float* dst = acc + (b * len + row0 + i) * hd;
      const int64_t src = (b * rows + i) * hd;
      for (int64_t c = 0; c < hd; ++c) dst[c] += load_as_float(blk, src + c, dtype);
    }
}

// A dense fp32 (b, s, h, d) into a (b, s, h, d) view of any strides, rounding to its dtype.
void store_rows(const float* acc, const TensorView& out) {
  const int64_t s = out.shape[1], h = out.shape[2], d = out.shape[3];
  for (int64_t b = 0; b < out.shape[0]; ++b)
    for (int64_t i = 0; i < s; ++i)
      for (int64_t j = 0; j < h; ++j)
        for (int64_t c = 0; c < d; ++c)
          store_from_float(out.data,
                           b * out.stride[0] + i * out.stride[1] + j * out.stride[2] + c,
                           out.dtype, acc[((b * s + i) * h + j) * d + c]);
}

}  // namespace

Status ring_attention_forward(CpContext& ctx, const TensorView& q, const TensorView& k,
                              const TensorView& v, const TensorView& o, const TensorView& lse,
                              Stream stream) {
  Communicator& comm = *ctx.comm;
  const int n = comm.size(), r = comm.rank();
  const Dims m = dims_of(ctx);
  CpScratch& sc = ctx.scratch;
  float* o_acc = grow<float>(sc.o_acc, m.q_elems(m.s_local) * 4);
  float* lse_acc = grow<float>(sc.lse_acc, m.b * m.hq * m.s_local * 4);
  std::fill(o_acc, o_acc + m.q_elems(m.s_local), 0.0f);
  std::fill(lse_acc, lse_acc + m.b * m.hq * m.s_local, -INFINITY);  // no key seen yet
  void* o_blk = grow(sc.o_blk, m.q_elems(m.s_local) * static_cast<int64_t>(dtype_size(m.dtype)));
  float* lse_blk = grow<float>(sc.lse_blk, m.b * m.hq * m.s_local * 4);

  KvBlock held = local_block(ctx, m, k, v);
  for (int step = 0; step < n; ++step) {
    const int src = ((r - step) % n + n) % n;
    KvBlock incoming;
    if (step + 1 < n) {
      incoming = incoming_block(ctx, m, step);
      FLARE_RETURN_IF_ERROR(pass_block(comm, held, incoming, m, stream));
    }
    for (const BlockTask& t : ring_step_tasks(ctx.shards[r], ctx.shards[src], ctx.causal, src == r)) {
      const TensorView o_t = TensorView::contiguous(o_blk, m.dtype, {m.b, t.q_len, m.hq, m.d});
      const TensorView lse_t = TensorView::contiguous(lse_blk, DType::kFloat32, {m.b, m.hq, t.q_len});
      FLARE_RETURN_IF_ERROR(attention_forward(
          rows(q, 1, t.q_begin, t.q_len), rows(held.k, 1, t.k_begin, t.k_len),
          rows(held.v, 1, t.k_begin, t.k_len), o_t, lse_t, block_options(ctx, t), {}, stream));
      merge_block(m, t, o_blk, lse_blk, o_acc, lse_acc);
    }
    held = incoming;
  }
  store_rows(o_acc, o);
  if (m.b * m.hq * m.s_local > 0)
    std::memcpy(lse.data, lse_acc, static_cast<size_t>(m.b * m.hq * m.s_local) * 4);
  return {};
}

Status ring_attention_backward(CpContext& ctx, const TensorView& dout, const TensorView& q,
                               const TensorView& k, const TensorView& v, const TensorView& o,
                               const TensorView& lse, const TensorView& dq, const TensorView& dk,
                               const TensorView& dv, Stream stream) {
  Communicator& comm = *ctx.comm;
  const int n = comm.size(), r = comm.rank();
  const Dims m = dims_of(ctx);
  CpScratch& sc = ctx.scratch;
  const int64_t el = static_cast<int64_t>(dtype_size(m.dtype));
  float* dq_acc = grow<float>(sc.dq_acc, m.q_elems(m.s_local) * 4);
  std::fill(dq_acc, dq_acc + m.q_elems(m.s_local), 0.0f);
  // A travelling fp32 dK/dV buffer: dK at 0, dV at kv_elems(s_max).
  const int64_t dkv_stride = m.kv_elems(m.s_max);
  float* dkv[2] = {grow<float>(sc.dkv[0], 2 * dkv_stride * 4),
                   grow<float>(sc.dkv[1], 2 * dkv_stride * 4)};
  std::fill(dkv[0], dkv[0] + 2 * dkv_stride, 0.0f);
  unsigned char* grad = grow(sc.grad_blk, (m.q_elems(m.s_local) + 2 * m.kv_elems(m.s_max)) * el);
  float* lse_rows = grow<float>(sc.lse_blk, m.b * m.hq * m.s_local * 4);

  KvBlock held = local_block(ctx, m, k, v);
  for (int step = 0; step < n; ++step) {
    const int src = ((r - step) % n + n) % n;
    KvBlock incoming;
    if (step + 1 < n) {
      incoming = incoming_block(ctx, m, step);
      FLARE_RETURN_IF_ERROR(pass_block(comm, held, incoming, m, stream));
    }
    float* acc_dk = dkv[step % 2];
    float* acc_dv = acc_dk + dkv_stride;
    for (const BlockTask& t : ring_step_tasks(ctx.shards[r], ctx.shards[src], ctx.causal, src == r)) {
      // The backward takes a dense LSE: rows of the full (b, h, s_local) one are copied out.
      TensorView lse_t = lse;
      if (t.q_len != m.s_local) {
        lse_t = TensorView::contiguous(lse_rows, DType::kFloat32, {m.b, m.hq, t.q_len});
        copy_rows(lse, t.q_begin, lse_t, 0, t.q_len, 2);
      }
      unsigned char* dq_t = grad;
      unsigned char* dk_t = dq_t + m.q_elems(t.q_len) * el;
      unsigned char* dv_t = dk_t + m.kv_elems(t.k_len) * el;
      FLARE_RETURN_IF_ERROR(attention_backward(
          rows(dout, 1, t.q_begin, t.q_len), rows(q, 1, t.q_begin, t.q_len),
          rows(held.k, 1, t.k_begin, t.k_len), rows(held.v, 1, t.k_begin, t.k_len),
          rows(o, 1, t.q_begin, t.q_len), lse_t,
          TensorView::contiguous(dq_t, m.dtype, {m.b, t.q_len, m.hq, m.d}),
          TensorView::contiguous(dk_t, m.dtype, {m.b, t.k_len, m.hkv, m.d}),
          TensorView::contiguous(dv_t, m.dtype, {m.b, t.k_len, m.hkv, m.d}),
          block_options(ctx, t), {}, stream));
      accumulate_rows(dq_acc, m.s_local, t.q_begin, dq_t, t.q_len, m.b, m.hq * m.d, m.dtype);
      accumulate_rows(acc_dk, held.len, t.k_begin, dk_t, t.k_len, m.b, m.hkv * m.d, m.dtype);
      accumulate_rows(acc_dv, held.len, t.k_begin, dv_t, t.k_len, m.b, m.hkv * m.d, m.dtype);
    }
    // The return trip: this block's dK/dV go on with it; the previous rank's arrive.
    const int64_t in_len = ctx.shards[((src - 1) % n + n) % n].length;
    float* in_dk = dkv[(step + 1) % 2];
    const Transfer t[4] = {
        Transfer::send((r + 1) % n, acc_dk, m.kv_elems(held.len) * 4),
        Transfer::send((r + 1) % n, acc_dv, m.kv_elems(held.len) * 4),
        Transfer::recv((r + n - 1) % n, in_dk, m.kv_elems(in_len) * 4),
        Transfer::recv((r + n - 1) % n, in_dk + dkv_stride, m.kv_elems(in_len) * 4),
    };
    FLARE_RETURN_IF_ERROR(comm.exchange(t, 4, stream));
    held = incoming;
  }
  store_rows(dq_acc, dq);
  store_rows(dkv[n % 2], dk);  // after n steps this rank's own block's dK/dV are back
  store_rows(dkv[n % 2] + dkv_stride, dv);
  return {};
}

}  // namespace flare::dist
