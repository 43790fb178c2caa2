// cp_context.h — one rank's plan for context-parallel attention, shared by the strategies (ring
// and zigzag in ring_attention.cpp, all-to-all in all_to_all_attention.cpp): the communicator,
// every rank's rows, the problem's sizes, the options of the single-device calls, and the
// workspace (one allocation, sized at create from the plan, on the communicator's device).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "dist/cp_ops.h"
#include "dist/layout.h"
#include "flare/attention.h"
#include "flare/dist.h"

namespace flare::dist {

// Byte offsets of the buffers in the workspace. The forward's and the backward's buffers share
// memory (a call uses one set), so calls on one object must be ordered on the device (one stream,
// or the caller's synchronisation), as their outputs would be anyway.
struct CpWorkspace {
  // Ring and zigzag, both passes.
  int64_t kv_send = 0;          // this rank's K then V packed, when the user's are not dense
  int64_t kv_recv[2] = {0, 0};  // K then V of an incoming block, double-buffered
  // Ring forward.
  int64_t o_acc = 0;    // fp32 (b, s_local, h_q, d)
  int64_t lse_acc = 0;  // fp32 (b, h_q, s_local)
  int64_t o_blk = 0;    // dtype (b, rows, h_q, d): one block call's output
  int64_t lse_blk = 0;  // fp32 (b, h_q, rows)
  // Ring backward.
  int64_t dq_acc = 0;       // fp32 (b, s_local, h_q, d)
  int64_t dkv[2] = {0, 0};  // fp32 dK then dV travelling with a block, double-buffered
  int64_t grad_blk = 0;     // dtype dQ of one call, then dK, dV of every call of a step
  int64_t lse_rows = 0;     // fp32 (b, h_q, rows): a call's rows of the forward's LSE
  // Packed plans: int32 cu_seqlens of this rank's pack, then of every call (RingCall) or, for
  // all-to-all, of the whole pack (at a2a_pack), uploaded at create.
  int64_t tables = 0;
  int64_t a2a_pack = 0;
  // All-to-all.
  int64_t a2a_send = 0;      // slabs to send, one per rank
  int64_t a2a_stage = 0;     // slabs received, one per rank
  int64_t a2a_full[9] = {};  // full-sequence tensors of this rank's heads
  int64_t bytes = 0;         // the whole workspace
};

// One single-device call of a ring step, with where its packed sequences' tables sit.
struct RingCall {
  BlockTask task;
  int64_t cu_q = 0, cu_k = 0;  // byte offsets in the workspace of int32 cu_seqlens (packed plans)
  int max_q = 0, max_k = 0;    // the longest segment on each side (packed plans)
};

// What a strategy needs besides the tensors: the plan, the workspace and where it runs.
struct CpContext {
  Communicator* comm = nullptr;
  // shards[r]: rank r's rows. Of a packed plan: count 0 and length = rank r's pack, whose rows are
  // varlen[r]'s.
  std::vector<SequenceShard> shards;
  bool packed = false;
  std::vector<VarlenShard> varlen;           // packed plans: every rank's rows of every sequence
  int pack_max_seqlen = 0;                   // all-to-all's packed plans: the whole pack's longest
  std::vector<std::vector<RingCall>> steps;  // ring and zigzag: steps[i], the calls of ring step i
  int batch = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  DType dtype = DType::kFloat32;
  AttentionOptions block_options;  // for every block call; the mask is set per call (ring)
  MaskBand band;                   // the mask over global positions (ring)
  DeviceType device = DeviceType::kCPU;
  int device_index = 0;
  CpWorkspace ws;
  std::unique_ptr<CpOps> ops;
  Strategy strategy = Strategy::kRing;

  int64_t s_local() const { return shards[comm->rank()].length; }
  int64_t s_max() const {
    int64_t m = 0;
    for (const SequenceShard& s : shards) m = m > s.length ? m : s.length;
    return m;
  }
  int64_t s_total() const {
    int64_t t = 0;
    for (const SequenceShard& s : shards) t += s.length;
    return t;
  }
  // A workspace buffer.
  template <typename T = unsigned char>
  T* at(int64_t offset) const {
    return reinterpret_cast<T*>(ops->workspace() + offset);
  }
  // A dense view of `shape` at `data`, on this rank's device.
  TensorView dense(void* data, DType dt, std::initializer_list<int64_t> shape) const {
    return TensorView::contiguous(data, dt, shape, device, device_index);
  }
};

// A packed (total, …) tensor as a batch of one, (1, total, …), and back: the strategies index
// packed and fixed-length plans alike, and give the calls the packed views.
inline TensorView batched(const TensorView& t) {
  TensorView r = t;
  r.ndim = t.ndim + 1;
  for (int i = t.ndim; i >= 1; --i) {
    r.shape[i] = t.shape[i - 1];
    r.stride[i] = t.stride[i - 1];
  }
  r.shape[0] = 1;
  r.stride[0] = t.shape[0] * t.stride[0];  // a dense tensor stays dense
  return r;
}

inline TensorView unbatched(const TensorView& t) {
  TensorView r = t;
  r.ndim = t.ndim - 1;
  for (int i = 0; i < r.ndim; ++i) {
    r.shape[i] = t.shape[i + 1];
    r.stride[i] = t.stride[i + 1];
  }
  r.shape[r.ndim] = 0;
  r.stride[r.ndim] = 0;
  return r;
}

// `pass` over the tensors as given, or as batches of one for a packed plan: how each strategy's
// entry points hand both kinds of plan to one implementation.
template <typename Pass, typename... Views>
Status on_batch_views(const CpContext& ctx, Pass pass, const Views&... views) {
  return ctx.packed ? pass(batched(views)...) : pass(views...);
}

// Hands out the workspace's buffers in order, each aligned to 256 bytes (vector loads, and the
// alignment the CUDA kernels check for their fastest paths).
struct WorkspaceCursor {
  int64_t end = 0;
  int64_t take(int64_t bytes) {
    const int64_t at = end;
    end += (bytes + 255) / 256 * 256;
    return at;
  }
};

// One exchange on the communication stream, after the computation issued so far (timed when
// timing is on). Zero-byte transfers are dropped: both sides know every size, so they drop alike.
inline Status exchange_after_compute(CpContext& ctx, const std::vector<Transfer>& all) {
  std::vector<Transfer> t;
  int64_t sent = 0;
  for (const Transfer& x : all)
    if (x.bytes > 0) {
      t.push_back(x);
      if (x.kind == Transfer::Kind::kSend) sent += x.bytes;
    }
  if (t.empty()) return {};
  FLARE_RETURN_IF_ERROR(ctx.ops->comm_waits_compute());
  FLARE_RETURN_IF_ERROR(ctx.ops->comm_started(sent));
  FLARE_RETURN_IF_ERROR(
      ctx.comm->exchange(t.data(), static_cast<int>(t.size()), ctx.ops->comm_stream()));
  return ctx.ops->comm_finished();
}

// Indices [begin, begin + len) of dimension `dim` (rows of the sequence, or a range of heads).
inline TensorView rows(const TensorView& t, int dim, int64_t begin, int64_t len) {
  TensorView r = t;
  r.data = static_cast<unsigned char*>(t.data) +
           begin * t.stride[dim] * static_cast<int64_t>(dtype_size(t.dtype));
  r.shape[dim] = len;
  return r;
}

}  // namespace flare::dist
