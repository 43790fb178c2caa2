// ring_attention.cpp — ring attention at one rank: the forward merges per-block (O, LSE), the
// backward returns dK/dV to their owners. Written once for host memory and CUDA devices: the
// element-wise passes, the workspace and the ordering of the two streams are CpOps' (cp_ops.h).
//
// Forward, at rank r of n, step i = 0 … T−1, holding the K/V block of src = (r − i) mod n, where
// T ≤ n counts the steps that carry a call at some rank (layout.h: visible_ring_steps; under a
// causal window the ring stops once every rank has seen the blocks its window reaches):
//   1. the computation waits for the block it holds (received by step i−1's exchange);
//   2. the next block's transfer starts on the communication stream: send the held block to r+1,
//      receive r−1's (the block of src − 1) into the other receive buffer — once step i−1's
//      computation, which read that buffer, is done; skipped at the last step;
//   3. attend, on the caller's stream, while 2 runs: one attention_forward call per task of the
//      step's plan (layout.h: ring_step_tasks, or varlen_step_tasks for a packed batch; each call
//      with the window its global rows see, none for blocks the mask hides) on this rank's
//      queries and the held block, each call's (O, LSE) merged into fp32 accumulators (merge.h).
// Then O and LSE are rounded into the outputs, once. A packed batch runs as a batch of one over
// its pack; its calls are varlen calls whose cu_seqlens the plan uploaded at create.
//
// Backward, the same ring, with the forward's final O and LSE. Why blocks give exact gradients:
// with the full row's LSE, P_ij = exp(s_ij − LSE_i) is the final probability, and the flash
// backward's D_i = rowsum(dO_i ∘ O_i) is the full row's, so each block call computes exactly the
// single-device terms of dS for its pairs and their contributions to dQ, dK and dV; the sum over
// blocks is the single-device gradient, in a fixed order (deterministic). dQ accumulates locally
// in fp32. dK and dV of the held block accumulate in an fp32 buffer that travels with the block:
// step i's exchange also sends step i−1's buffer to r+1 (which holds that block at step i) and
// receives, from r−1, the buffer of the block held at step i. So the block calls of step i run
// while the buffer they add into is in flight, and only the additions wait for it. After step T−1
// one more exchange brings every block's buffer home: the one held goes to its owner, r − (T−1)
// (the next rank when T = n), and this rank's own arrives from r + (T−1). Per rank: T−1 K/V
// transfers and T dK/dV transfers (fp32, twice the bytes of bf16 K/V).
//
// Buffers: step i receives into K/V buffer i mod 2 and dK/dV buffer i mod 2; both were last read
// by the computation of step i−1 or earlier, which the exchange waits for. Transfers of zero
// bytes (empty shards) are skipped by both sides alike.
#include "dist/ring_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "dist/dist_internal.h"
#include "dist/layout.h"

namespace flare::dist {
namespace {

// Sizes of the problem at this rank.
struct Dims {
  int64_t b, hq, hkv, d, s_local, s_max;
  DType dtype;
  int64_t el() const { return static_cast<int64_t>(dtype_size(dtype)); }
  int64_t kv_elems(int64_t len) const { return b * len * hkv * d; }
  int64_t q_elems(int64_t len) const { return b * len * hq * d; }
  int64_t lse_elems(int64_t len) const { return b * hq * len; }
  int64_t kv_bytes(int64_t len) const { return kv_elems(len) * el(); }
};

// A packed plan runs as a batch of one: its (total, h, d) tensors and (h, total) LSE are viewed
// as (1, total, h, d) and (1, h, total), so that the merge, the accumulations and the copies index
// both kinds of plan alike; its block calls get the packed views back (unbatched).
Dims dims_of(const CpContext& ctx) {
  return {ctx.packed ? 1 : ctx.batch,
          ctx.heads_q,
          ctx.heads_kv,
          ctx.head_dim,
          ctx.s_local(),
          ctx.s_max(),
          ctx.dtype};
}

int mod(int a, int n) { return (a % n + n) % n; }

// The calls of step `step` at this rank (the block of rank src = r − step).
const std::vector<RingCall>& step_calls(const CpContext& ctx, int step) { return ctx.steps[step]; }

// The most K/V rows the calls of one step read, summed over the step's calls: the backward keeps
// every call's dK/dV until the step's accumulator has arrived.
int64_t max_step_k_rows(const CpContext& ctx) {
  int64_t most = 0;
  for (const std::vector<RingCall>& step : ctx.steps) {
    int64_t sum = 0;
    for (const RingCall& c : step) sum += c.task.k_len;
    most = std::max(most, sum);
  }
  return most;
}

// Appends the offsets of a pack's sequences (from 0) to the tables; returns where they start, in
// int32 entries.
int64_t add_offsets(const std::vector<Segment>& segments, bool keys, std::vector<int32_t>* tables,
                    int* longest) {
  const auto at = static_cast<int64_t>(tables->size());
  int64_t end = 0;
  tables->push_back(0);
  for (const Segment& sg : segments) {
    const int64_t len = keys ? sg.k_len : sg.q_len;
    end += len;
    *longest = std::max(*longest, static_cast<int>(len));
    tables->push_back(static_cast<int32_t>(end));
  }
  return at;
}

// A K/V block: dense (b, len, h_kv, d) views, in user memory or a receive buffer.
struct KvBlock {
  TensorView k, v;
  int64_t len = 0;
};

KvBlock dense_block(const CpContext& ctx, const Dims& m, unsigned char* base, int64_t len) {
  KvBlock blk;
  blk.k = ctx.dense(base, m.dtype, {m.b, len, m.hkv, m.d});
  blk.v = ctx.dense(base + m.kv_bytes(m.s_max), m.dtype, {m.b, len, m.hkv, m.d});
  blk.len = len;
  return blk;
}

// One forward or backward at this rank: the ring's walk, shared by both passes.
class Ring {
 public:
  Ring(CpContext& ctx, Stream stream)
      : ctx_(ctx), ops_(*ctx.ops), m_(dims_of(ctx)), scope_(ops_, stream) {}

  Status begun() const { return scope_.status(); }
  const Dims& dims() const { return m_; }
  int size() const { return ctx_.comm->size(); }
  int steps() const { return static_cast<int>(ctx_.steps.size()); }  // T: see the top of the file
  int rank() const { return ctx_.comm->rank(); }

  // This rank's own block as dense views: the user's tensors when they are dense already
  // (nothing copied), else a packed copy to send from.
  Status hold_own_block(const TensorView& k, const TensorView& v) {
    if (k.is_contiguous() && v.is_contiguous()) {
      held_ = {k, v, m_.s_local};
      return {};
    }
    held_ = dense_block(ctx_, m_, ctx_.at(ctx_.ws.kv_send), m_.s_local);
    FLARE_RETURN_IF_ERROR(ops_.copy_rows(k, 0, held_.k, 0, m_.s_local, 1));
    return ops_.copy_rows(v, 0, held_.v, 0, m_.s_local, 1);
  }
  const KvBlock& held() const { return held_; }

  // Steps 1 and 2 of a ring step: the computation waits for the held block, then the exchange of
  // the next block (and `extra` transfers: the backward's travelling dK/dV) starts.
  Status start_step(int step, const std::vector<Transfer>& extra = {}) {
    if (step > 0) {
      held_ = incoming_;
      FLARE_RETURN_IF_ERROR(ops_.compute_waits_comm());
    }
    std::vector<Transfer> t = extra;
    if (step + 1 < steps()) {
      const int n = size(), r = rank(), owner = mod(r - step - 1, n);
      incoming_ =
          dense_block(ctx_, m_, ctx_.at(ctx_.ws.kv_recv[step % 2]), ctx_.shards[owner].length);
      t.push_back(Transfer::send((r + 1) % n, held_.k.data, m_.kv_bytes(held_.len)));
      t.push_back(Transfer::send((r + 1) % n, held_.v.data, m_.kv_bytes(held_.len)));
      t.push_back(Transfer::recv((r + n - 1) % n, incoming_.k.data, m_.kv_bytes(incoming_.len)));
      t.push_back(Transfer::recv((r + n - 1) % n, incoming_.v.data, m_.kv_bytes(incoming_.len)));
    }
    return exchange(t);
  }

  Status exchange(const std::vector<Transfer>& t) { return exchange_after_compute(ctx_, t); }

  // The options of one block call: the caller's, with the call's own window.
  AttentionOptions options(const RingCall& c) const {
    AttentionOptions o = ctx_.block_options;
    o.causal = c.task.window_right == 0;
    o.window_left = static_cast<int>(c.task.window_left);
    o.window_right = o.causal ? -1 : static_cast<int>(c.task.window_right);
    return o;
  }

  // A (1, rows, h, d) or (1, h, rows) view as the call takes it: unchanged for fixed-length plans,
  // the packed layout for packed ones.
  TensorView arg(const TensorView& t) const { return ctx_.packed ? unbatched(t) : t; }

  // The packed sequences of a call (none for fixed-length plans).
  VarlenArgs varlen(const RingCall& c) const {
    VarlenArgs a;
    if (!ctx_.packed) return a;
    const int64_t entries = static_cast<int64_t>(c.task.segments.size()) + 1;
    a.cu_seqlens_q = ctx_.dense(ctx_.at(c.cu_q), DType::kInt32, {entries});
    a.cu_seqlens_k = ctx_.dense(ctx_.at(c.cu_k), DType::kInt32, {entries});
    a.max_seqlen_q = c.max_q;
    a.max_seqlen_k = c.max_k;
    return a;
  }

 private:
  CpContext& ctx_;
  CpOps& ops_;
  Dims m_;
  OpsScope scope_;  // begin() … end() of the ops, around the whole pass
  KvBlock held_, incoming_;
};

}  // namespace

void plan_ring(CpContext& ctx, std::vector<int32_t>* tables) {
  const int n = ctx.comm->size(), r = ctx.comm->rank();
  tables->clear();
  if (ctx.packed) {
    const std::vector<int32_t>& own = ctx.varlen[r].cu_seqlens;
    tables->insert(tables->end(), own.begin(), own.end());  // the local pack, for validation
  }
  // Calls of each step, and in packed plans their tables (as int32 indices until the workspace
  // has a place for them).
  const int steps = ctx.packed ? visible_ring_steps(ctx.varlen, ctx.band)
                               : visible_ring_steps(ctx.shards, ctx.band);
  ctx.steps.assign(static_cast<size_t>(steps), {});
  for (int step = 0; step < steps; ++step) {
    const int src = mod(r - step, n);
    const std::vector<BlockTask> tasks =
        ctx.packed ? varlen_step_tasks(ctx.varlen[r], ctx.varlen[src], ctx.band, src == r)
                   : ring_step_tasks(ctx.shards[r], ctx.shards[src], ctx.band, src == r);
    for (const BlockTask& t : tasks) {
      RingCall call;
      call.task = t;
      if (ctx.packed) {
        call.cu_q = add_offsets(t.segments, false, tables, &call.max_q);
        call.cu_k = add_offsets(t.segments, true, tables, &call.max_k);
      }
      ctx.steps[step].push_back(call);
    }
  }
  plan_ring_workspace(ctx, &ctx.ws, static_cast<int64_t>(tables->size()) * 4);
  for (std::vector<RingCall>& step : ctx.steps)
    for (RingCall& call : step) {
      call.cu_q = ctx.ws.tables + 4 * call.cu_q;
      call.cu_k = ctx.ws.tables + 4 * call.cu_k;
    }
}

void plan_ring_workspace(const CpContext& ctx, CpWorkspace* ws, int64_t table_bytes) {
  const Dims m = dims_of(ctx);
  WorkspaceCursor c;
  ws->tables = c.take(table_bytes);
  ws->kv_send = c.take(2 * m.kv_bytes(m.s_max));
  ws->kv_recv[0] = c.take(2 * m.kv_bytes(m.s_max));
  ws->kv_recv[1] = c.take(2 * m.kv_bytes(m.s_max));
  const int64_t shared = c.end;
  // The forward's buffers, then the backward's over the same bytes.
  ws->o_acc = c.take(m.q_elems(m.s_local) * 4);
  ws->lse_acc = c.take(m.lse_elems(m.s_local) * 4);
  ws->o_blk = c.take(m.q_elems(m.s_local) * m.el());
  ws->lse_blk = c.take(m.lse_elems(m.s_local) * 4);
  const int64_t forward_end = c.end;
  c.end = shared;
  ws->dq_acc = c.take(m.q_elems(m.s_local) * 4);
  ws->dkv[0] = c.take(2 * m.kv_elems(m.s_max) * 4);
  ws->dkv[1] = c.take(2 * m.kv_elems(m.s_max) * 4);
  ws->grad_blk = c.take((m.q_elems(m.s_local) + 2 * m.kv_elems(max_step_k_rows(ctx))) * m.el());
  ws->lse_rows = c.take(m.lse_elems(m.s_local) * 4);
  ws->bytes = std::max(forward_end, c.end);
}

namespace {

Status ring_forward(CpContext& ctx, const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& o, const TensorView& lse, Stream stream) {
  Ring ring(ctx, stream);
  FLARE_RETURN_IF_ERROR(ring.begun());
  CpOps& ops = *ctx.ops;
  const Dims& m = ring.dims();
  auto* o_acc = ctx.at<float>(ctx.ws.o_acc);
  auto* lse_acc = ctx.at<float>(ctx.ws.lse_acc);
  void* o_blk = ctx.at(ctx.ws.o_blk);
  auto* lse_blk = ctx.at<float>(ctx.ws.lse_blk);
  FLARE_RETURN_IF_ERROR(ops.fill(o_acc, m.q_elems(m.s_local), 0.0f));
  FLARE_RETURN_IF_ERROR(ops.fill(lse_acc, m.lse_elems(m.s_local), -INFINITY));  // no key seen yet
  FLARE_RETURN_IF_ERROR(ring.hold_own_block(k, v));

  for (int step = 0; step < ring.steps(); ++step) {
    FLARE_RETURN_IF_ERROR(ring.start_step(step));
    const KvBlock& held = ring.held();
    for (const RingCall& call : step_calls(ctx, step)) {
      const BlockTask& t = call.task;
      FLARE_RETURN_IF_ERROR(attention_forward(
          ring.arg(rows(q, 1, t.q_begin, t.q_len)), ring.arg(rows(held.k, 1, t.k_begin, t.k_len)),
          ring.arg(rows(held.v, 1, t.k_begin, t.k_len)),
          ring.arg(ctx.dense(o_blk, m.dtype, {m.b, t.q_len, m.hq, m.d})),
          ring.arg(ctx.dense(lse_blk, DType::kFloat32, {m.b, m.hq, t.q_len})), ring.options(call),
          ring.varlen(call), ops.compute_stream()));
      FLARE_RETURN_IF_ERROR(ops.merge_block({o_acc, lse_acc, o_blk, lse_blk, m.b, m.hq, m.d,
                                             m.s_local, t.q_begin, t.q_len, m.dtype}));
    }
  }
  FLARE_RETURN_IF_ERROR(ops.store_rows(o_acc, o));
  return ops.copy_rows(ctx.dense(lse_acc, DType::kFloat32, {m.b, m.hq, m.s_local}), 0, lse, 0,
                       m.s_local, 2);
}

Status ring_backward(CpContext& ctx, const TensorView& dout, const TensorView& q,
                     const TensorView& k, const TensorView& v, const TensorView& o,
                     const TensorView& lse, const TensorView& dq, const TensorView& dk,
                     const TensorView& dv, Stream stream) {
  Ring ring(ctx, stream);
  FLARE_RETURN_IF_ERROR(ring.begun());
  CpOps& ops = *ctx.ops;
  const Dims& m = ring.dims();
  const int n = ring.size(), r = ring.rank(), steps = ring.steps();
  auto* dq_acc = ctx.at<float>(ctx.ws.dq_acc);
  // A travelling fp32 dK/dV buffer: dK at 0, dV at kv_elems(s_max).
  const int64_t dv_at = m.kv_elems(m.s_max);
  float* dkv[2] = {ctx.at<float>(ctx.ws.dkv[0]), ctx.at<float>(ctx.ws.dkv[1])};
  unsigned char* grad = ctx.at(ctx.ws.grad_blk);
  auto* lse_rows = ctx.at<float>(ctx.ws.lse_rows);
  FLARE_RETURN_IF_ERROR(ops.fill(dq_acc, m.q_elems(m.s_local), 0.0f));
  FLARE_RETURN_IF_ERROR(ops.fill(dkv[0], 2 * dv_at, 0.0f));  // the own block's, at step 0
  FLARE_RETURN_IF_ERROR(ring.hold_own_block(k, v));

  // Step i's accumulator goes to r+1 and the one of the block held next arrives from r−1.
  int64_t prev_len = 0;  // rows of the block held at the previous step
  auto pass_dkv = [&](int step) -> std::vector<Transfer> {
    if (step == 0) return {};
    const int64_t in_len = ctx.shards[mod(r - step, n)].length;
    float* out = dkv[(step - 1) % 2];
    float* in = dkv[step % 2];
    return {Transfer::send((r + 1) % n, out, m.kv_elems(prev_len) * 4),
            Transfer::send((r + 1) % n, out + dv_at, m.kv_elems(prev_len) * 4),
            Transfer::recv((r + n - 1) % n, in, m.kv_elems(in_len) * 4),
            Transfer::recv((r + n - 1) % n, in + dv_at, m.kv_elems(in_len) * 4)};
  };

  for (int step = 0; step < steps; ++step) {
    FLARE_RETURN_IF_ERROR(ring.start_step(step, pass_dkv(step)));
    const KvBlock& held = ring.held();
    const std::vector<RingCall>& calls = step_calls(ctx, step);
    // Every call's dK/dV stays in grad until the step's accumulator has arrived.
    unsigned char* dq_t = grad;
    std::vector<unsigned char*> dk_t(calls.size());
    unsigned char* next = grad + m.q_elems(m.s_local) * m.el();
    for (size_t i = 0; i < calls.size(); ++i) {
      const BlockTask& t = calls[i].task;
      dk_t[i] = next;
      next += 2 * m.kv_bytes(t.k_len);
      // The backward takes a dense LSE: rows of the full (b, h, s_local) one are copied out.
      TensorView lse_t = lse;
      if (t.q_len != m.s_local) {
        lse_t = ctx.dense(lse_rows, DType::kFloat32, {m.b, m.hq, t.q_len});
        FLARE_RETURN_IF_ERROR(ops.copy_rows(lse, t.q_begin, lse_t, 0, t.q_len, 2));
      }
      FLARE_RETURN_IF_ERROR(attention_backward(
          ring.arg(rows(dout, 1, t.q_begin, t.q_len)), ring.arg(rows(q, 1, t.q_begin, t.q_len)),
          ring.arg(rows(held.k, 1, t.k_begin, t.k_len)),
          ring.arg(rows(held.v, 1, t.k_begin, t.k_len)), ring.arg(rows(o, 1, t.q_begin, t.q_len)),
          ring.arg(lse_t), ring.arg(ctx.dense(dq_t, m.dtype, {m.b, t.q_len, m.hq, m.d})),
          ring.arg(ctx.dense(dk_t[i], m.dtype, {m.b, t.k_len, m.hkv, m.d})),
          ring.arg(ctx.dense(dk_t[i] + m.kv_bytes(t.k_len), m.dtype, {m.b, t.k_len, m.hkv, m.d})),
          ring.options(calls[i]), ring.varlen(calls[i]), ops.compute_stream()));
      FLARE_RETURN_IF_ERROR(ops.accumulate_rows(dq_acc, m.s_local, t.q_begin, dq_t, t.q_len, m.b,
                                                m.hq * m.d, m.dtype));
    }
    // The additions into the travelling buffer wait for it (step 0's is local and zeroed).
    if (step > 0 && !calls.empty()) FLARE_RETURN_IF_ERROR(ops.compute_waits_comm());
    float* acc = dkv[step % 2];
    for (size_t i = 0; i < calls.size(); ++i) {
      const BlockTask& t = calls[i].task;
      FLARE_RETURN_IF_ERROR(ops.accumulate_rows(acc, held.len, t.k_begin, dk_t[i], t.k_len, m.b,
                                                m.hkv * m.d, m.dtype));
      FLARE_RETURN_IF_ERROR(ops.accumulate_rows(acc + dv_at, held.len, t.k_begin,
                                                dk_t[i] + m.kv_bytes(t.k_len), t.k_len, m.b,
                                                m.hkv * m.d, m.dtype));
    }
    prev_len = held.len;
  }
  // The last step's buffer goes to its block's owner; the one arriving is this rank's own block's.
  if (steps > 1) {
    const int to = mod(r - (steps - 1), n), from = mod(r + steps - 1, n);
    float* out = dkv[(steps - 1) % 2];
    float* in = dkv[steps % 2];
    const std::vector<Transfer> home = {
        Transfer::send(to, out, m.kv_elems(prev_len) * 4),
        Transfer::send(to, out + dv_at, m.kv_elems(prev_len) * 4),
        Transfer::recv(from, in, m.kv_elems(m.s_local) * 4),
        Transfer::recv(from, in + dv_at, m.kv_elems(m.s_local) * 4)};
    FLARE_RETURN_IF_ERROR(ring.exchange(home));
    FLARE_RETURN_IF_ERROR(ops.compute_waits_comm());
  }
  const float* own = dkv[steps > 1 ? steps % 2 : 0];
  FLARE_RETURN_IF_ERROR(ops.store_rows(dq_acc, dq));
  FLARE_RETURN_IF_ERROR(ops.store_rows(own, dk));
  return ops.store_rows(own + dv_at, dv);
}

}  // namespace

Status ring_attention_forward(CpContext& ctx, const TensorView& q, const TensorView& k,
                              const TensorView& v, const TensorView& o, const TensorView& lse,
                              Stream stream) {
  return on_batch_views(
      ctx, [&](const auto&... t) { return ring_forward(ctx, t..., stream); }, q, k, v, o, lse);
}

Status ring_attention_backward(CpContext& ctx, const TensorView& dout, const TensorView& q,
                               const TensorView& k, const TensorView& v, const TensorView& o,
                               const TensorView& lse, const TensorView& dq, const TensorView& dk,
                               const TensorView& dv, Stream stream) {
  return on_batch_views(
      ctx, [&](const auto&... t) { return ring_backward(ctx, t..., stream); }, dout, q, k, v, o,
      lse, dq, dk, dv);
}

}  // namespace flare::dist
