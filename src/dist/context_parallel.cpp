// context_parallel.cpp — ContextParallelAttention: the plan every rank agrees on at creation (and
// the workspace it sizes, on the host or the communicator's CUDA device), the checks of each
// call's local tensors, and the dispatch to the strategies (ring_attention.cpp,
// all_to_all_attention.cpp).
//
// Checks happen in two places. At creation every rank's config is gathered (host_all_gather) and
// compared field by field with every other rank's, so all ranks fail alike and no call can later
// hang on a rank that planned another shape. At each call a rank checks its own tensors against
// the plan before communicating; a rank that rejects its call returns at once, and the others,
// waiting for it in the ring, fail at the communicator's timeout naming it.
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "core/backends.h"
#include "dist/all_to_all_attention.h"
#include "dist/dist_internal.h"
#include "dist/ring_attention.h"
#include "flare/dist.h"

namespace flare::dist {

struct ContextParallelAttention::State {
  ContextParallelConfig config;
  CpContext ring;  // the plan and scratch of every strategy
};

namespace {

// The config as fixed-size data, to gather from every rank and compare.
struct WireConfig {
  int32_t size, strategy, batch, heads_q, heads_kv, head_dim, dtype, causal, window_left,
      window_right, deterministic, backend, cu_seqlens;  // cu_seqlens: its entry count
  int64_t seqlen;
  float softmax_scale, softcap;
};

WireConfig wire(const ContextParallelConfig& c, int size) {
  WireConfig w;
  std::memset(&w, 0, sizeof w);  // padding too: configs are compared field by field, but sent whole
  w.size = size;
  w.strategy = static_cast<int32_t>(c.strategy);
  w.batch = c.batch;
  w.heads_q = c.heads_q;
  w.heads_kv = c.heads_kv;
  w.head_dim = c.head_dim;
  w.dtype = static_cast<int32_t>(c.dtype);
  w.causal = c.attention.causal;
  w.window_left = c.attention.window_left;
  w.window_right = c.attention.window_right;
  w.deterministic = c.attention.deterministic;
  w.backend = static_cast<int32_t>(c.attention.backend);
  w.cu_seqlens = static_cast<int32_t>(c.cu_seqlens.size());
  w.seqlen = c.seqlen;
  w.softmax_scale = c.attention.softmax_scale;
  w.softcap = c.attention.softcap;
  return w;
}

// The first field in which rank `other`'s config differs from this rank's, as an error.
Status compare(const WireConfig& mine, const WireConfig& theirs, int me, int other) {
#define FLARE_DIST_COMPARE(field)                                                              \
  if (!(mine.field == theirs.field))                                                           \
    return invalid("config: ranks disagree on " #field ": rank ", other, " has ", theirs.field, \
                   ", rank ", me, " has ", mine.field,                                         \
                   "; every rank must create the plan with the same config");
  FLARE_DIST_COMPARE(size)
  FLARE_DIST_COMPARE(strategy)
  FLARE_DIST_COMPARE(batch)
  FLARE_DIST_COMPARE(seqlen)
  FLARE_DIST_COMPARE(heads_q)
  FLARE_DIST_COMPARE(heads_kv)
  FLARE_DIST_COMPARE(head_dim)
  FLARE_DIST_COMPARE(dtype)
  FLARE_DIST_COMPARE(causal)
  FLARE_DIST_COMPARE(window_left)
  FLARE_DIST_COMPARE(window_right)
  FLARE_DIST_COMPARE(softmax_scale)
  FLARE_DIST_COMPARE(softcap)
  FLARE_DIST_COMPARE(deterministic)
  FLARE_DIST_COMPARE(backend)
  FLARE_DIST_COMPARE(cu_seqlens)
#undef FLARE_DIST_COMPARE
  return {};
}

// A packed plan's cu_seqlens: every rank's, gathered once every rank is known to hold as many,
// against this rank's (all ranks fail alike on the first difference, named).
Status agree_on_cu_seqlens(Communicator& comm, const std::vector<int32_t>& mine) {
  const int n = comm.size();
  const auto count = static_cast<int64_t>(mine.size());
  std::vector<int32_t> all(static_cast<size_t>(n * count));
  FLARE_RETURN_IF_ERROR(comm.host_all_gather(mine.data(), all.data(), count * 4));
  for (int r = 1; r < n; ++r)
    for (int64_t i = 0; i < count; ++i)
      if (all[r * count + i] != all[i])
        return invalid("config: ranks disagree on cu_seqlens[", i, "]: rank ", r, " has ",
                       all[r * count + i], ", rank 0 has ", all[i],
                       "; every rank must create the plan with the same config");
  return {};
}

// A packed batch's cu_seqlens, and batch / seqlen against them (0: taken from them).
Status check_packed(ContextParallelConfig* c) {
  const std::vector<int32_t>& cu = c->cu_seqlens;
  if (cu.size() < 2)
    return invalid("config.cu_seqlens: ", cu.size(), " entries; a packed batch of b sequences has "
                   "b + 1 >= 2 (leave it empty for fixed length)");
  if (cu[0] != 0) return invalid("config.cu_seqlens[0] must be 0, got ", cu[0]);
  for (size_t i = 0; i + 1 < cu.size(); ++i)
    if (cu[i + 1] < cu[i])
      return invalid("config.cu_seqlens: must be non-decreasing, but [", i + 1, "] = ", cu[i + 1],
                     " < [", i, "] = ", cu[i]);
  const auto sequences = static_cast<int64_t>(cu.size()) - 1;
  if (cu.back() < 1) return invalid("config.cu_seqlens: every sequence is empty (0 tokens)");
  if (c->batch != 0 && c->batch != sequences)
    return invalid("config.batch: ", c->batch, " must be 0 or the number of sequences in "
                   "cu_seqlens, ", sequences);
  if (c->seqlen != 0 && c->seqlen != cu.back())
    return invalid("config.seqlen: ", c->seqlen, " must be 0 or the packed token count "
                   "cu_seqlens ends at, ", cu.back());
  c->batch = static_cast<int>(sequences);
  c->seqlen = cu.back();
  return {};
}

Status check_config(const ContextParallelConfig& c) {
  if (c.strategy != Strategy::kRing && c.strategy != Strategy::kZigzag &&
      c.strategy != Strategy::kAllToAll)
    return invalid("config.strategy: unknown value ", static_cast<int>(c.strategy),
                   "; must be ring (0), zigzag (1) or all-to-all (2)");
  if (c.batch < 1) return invalid("config.batch: ", c.batch, " must be >= 1");
  if (c.seqlen < 1) return invalid("config.seqlen: ", c.seqlen, " must be >= 1");
  if (c.heads_q < 1) return invalid("config.heads_q: ", c.heads_q, " must be >= 1");
  if (c.heads_kv < 1 || c.heads_q % c.heads_kv != 0)
    return invalid("config.heads_kv: ", c.heads_kv, " must be >= 1 and divide heads_q = ",
                   c.heads_q, " (GQA/MQA)");
  if (c.head_dim < 1) return invalid("config.head_dim: ", c.head_dim, " must be >= 1");
  if (c.dtype != DType::kFloat32 && c.dtype != DType::kFloat16 && c.dtype != DType::kBFloat16)
    return invalid("config.dtype: ", static_cast<int>(c.dtype),
                   " is not one of float32, float16, bfloat16");
  const AttentionOptions& a = c.attention;
  if (a.window_left < -1)
    return invalid("config.attention.window_left: must be >= -1 (-1 = unbounded), got ",
                   a.window_left);
  if (a.window_right < -1)
    return invalid("config.attention.window_right: must be >= -1 (-1 = unbounded), got ",
                   a.window_right);
  // ALiBi's bias and dropout's mask depend on each score's global position inside the kernels,
  // which a block call cannot be given (docs/context-parallel.md).
  if (a.alibi_slopes.defined())
    return Status::unsupported("config.attention: ALiBi is not supported by context parallelism yet");
  if (a.dropout_p != 0.0f)
    return Status::unsupported(cat("config.attention: dropout (p = ", a.dropout_p,
                                   ") is not supported by context parallelism yet"));
  return {};
}

std::string shape_str(const TensorView& t) {
  std::string s = "(";
  for (int i = 0; i < t.ndim && i < kMaxDims; ++i) s += cat(i ? ", " : "", t.shape[i]);
  return s + ")";
}

using State = ContextParallelAttention::State;

// A local tensor's shape against the plan.
Status check_shape(const TensorView& t, const char* name, std::initializer_list<int64_t> expected,
                   const char* layout, const State& st, const Communicator& comm) {
  bool same = t.ndim == static_cast<int>(expected.size());
  int i = 0;
  for (int64_t e : expected) same = same && i < kMaxDims && t.shape[i++] == e;
  if (same) return {};
  std::string want = "(";
  i = 0;
  for (int64_t e : expected) want += cat(i++ ? ", " : "", e);
  return invalid(name, ": shape ", shape_str(t), " must be ", layout, " = ", want, ") at rank ",
                 comm.rank(), " of ", comm.size(), " (", strategy_name(st.config.strategy),
                 " layout of ", st.config.seqlen, " rows)");
}

// Every local tensor of a call: shapes against the plan, dtype against the config, device
// against the communicator. The rest (strides, alignment, overlap) is attention's validation.
Status check_locals(const State& st, const Communicator& comm,
                    std::initializer_list<std::pair<const TensorView*, const char*>> qlike,
                    std::initializer_list<std::pair<const TensorView*, const char*>> kvlike,
                    const TensorView& lse) {
  const ContextParallelConfig& c = st.config;
  const int64_t s = st.ring.shards[comm.rank()].length;
  if (st.ring.packed) {
    for (const auto& [t, name] : qlike)
      FLARE_RETURN_IF_ERROR(check_shape(*t, name, {s, c.heads_q, c.head_dim},
                                        "(local rows, heads_q, head_dim)", st, comm));
    for (const auto& [t, name] : kvlike)
      FLARE_RETURN_IF_ERROR(check_shape(*t, name, {s, c.heads_kv, c.head_dim},
                                        "(local rows, heads_kv, head_dim)", st, comm));
    FLARE_RETURN_IF_ERROR(
        check_shape(lse, "lse", {c.heads_q, s}, "(heads_q, local rows)", st, comm));
  } else {
    for (const auto& [t, name] : qlike)
      FLARE_RETURN_IF_ERROR(check_shape(*t, name, {c.batch, s, c.heads_q, c.head_dim},
                                        "(batch, local rows, heads_q, head_dim)", st, comm));
    for (const auto& [t, name] : kvlike)
      FLARE_RETURN_IF_ERROR(check_shape(*t, name, {c.batch, s, c.heads_kv, c.head_dim},
                                        "(batch, local rows, heads_kv, head_dim)", st, comm));
    FLARE_RETURN_IF_ERROR(check_shape(lse, "lse", {c.batch, c.heads_q, s},
                                      "(batch, heads_q, local rows)", st, comm));
  }
  for (const auto& list : {qlike, kvlike})
    for (const auto& [t, name] : list) {
      if (t->dtype != c.dtype)
        return invalid(name, ": dtype ", dtype_name(t->dtype), " differs from the plan's ",
                       dtype_name(c.dtype));
      if (t->device != comm.device())
        return invalid(name, ": on ", t->device == DeviceType::kCUDA ? "cuda" : "cpu",
                       ", but the ", comm.kind(), " communicator moves ",
                       comm.device() == DeviceType::kCUDA ? "cuda" : "cpu", " memory");
      if (t->device == DeviceType::kCUDA && t->device_index != comm.device_index())
        return invalid(name, ": on cuda:", t->device_index, ", but this rank's ", comm.kind(),
                       " communicator is on cuda:", comm.device_index());
    }
  return {};
}

AttentionOptions ring_block_options(const ContextParallelConfig& c) {
  AttentionOptions o = c.attention;
  o.causal = false;  // the mask is set per block call
  o.window_left = o.window_right = -1;
  return o;
}

// The local pack's cu_seqlens as the single-device validation takes them (packed plans).
VarlenArgs local_varlen(const CpContext& ctx) {
  VarlenArgs a;
  if (!ctx.packed) return a;
  const VarlenShard& mine = ctx.varlen[ctx.comm->rank()];
  a.cu_seqlens_q = a.cu_seqlens_k = ctx.dense(ctx.at(ctx.ws.tables), DType::kInt32,
                                              {static_cast<int64_t>(mine.cu_seqlens.size())});
  a.max_seqlen_q = a.max_seqlen_k = mine.max_seqlen;
  return a;
}

}  // namespace

ContextParallelAttention::ContextParallelAttention(std::unique_ptr<State> state)
    : state_(std::move(state)) {}
ContextParallelAttention::~ContextParallelAttention() = default;

const ContextParallelConfig& ContextParallelAttention::config() const { return state_->config; }
const SequenceShard& ContextParallelAttention::shard() const {
  return state_->ring.shards[state_->ring.comm->rank()];
}
const VarlenShard& ContextParallelAttention::varlen_shard() const {
  static const VarlenShard kNone;
  return state_->ring.packed ? state_->ring.varlen[state_->ring.comm->rank()] : kNone;
}

Status ContextParallelAttention::create(Communicator* comm, const ContextParallelConfig& config,
                                        std::unique_ptr<ContextParallelAttention>* out) {
  if (out == nullptr) return invalid("ContextParallelAttention::create: out is null");
  if (comm == nullptr) return invalid("comm: is null");
  FLARE_RETURN_IF_ERROR(comm->health());
  ContextParallelConfig cfg = config;
  if (!cfg.cu_seqlens.empty()) FLARE_RETURN_IF_ERROR(check_packed(&cfg));
  FLARE_RETURN_IF_ERROR(check_config(cfg));
  if (comm->device() == DeviceType::kCUDA && cfg.dtype == DType::kFloat32)
    return Status::unsupported(
        "config.dtype: float32 over the " + std::string(comm->kind()) +
        " communicator: the CUDA kernels take float16 or bfloat16 (as FlashAttention does)");

  const int n = comm->size();
  if (cfg.strategy == Strategy::kAllToAll &&
      (cfg.heads_q % n != 0 || cfg.heads_kv % n != 0))
    return Status::unsupported(cat(
        "config: all-to-all over ", n, " ranks needs heads_q = ", cfg.heads_q,
        " and heads_kv = ", cfg.heads_kv, " to be multiples of ", n,
        " (each rank takes whole heads, and K/V heads are never copied); use ring or zigzag"));

  // Agreement: every rank sees every config and fails alike on the first difference.
  const WireConfig mine = wire(cfg, n);
  std::vector<WireConfig> all(static_cast<size_t>(n));
  FLARE_RETURN_IF_ERROR(comm->host_all_gather(&mine, all.data(), sizeof(WireConfig)));
  for (int r = 0; r < n; ++r) FLARE_RETURN_IF_ERROR(compare(all[0], all[r], 0, r));
  if (!cfg.cu_seqlens.empty()) FLARE_RETURN_IF_ERROR(agree_on_cu_seqlens(*comm, cfg.cu_seqlens));

  auto st = std::make_unique<State>();
  st->config = cfg;
  CpContext& ring = st->ring;
  ring.comm = comm;
  ring.shards.resize(static_cast<size_t>(n));
  ring.packed = !cfg.cu_seqlens.empty();
  if (ring.packed) ring.varlen.resize(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    if (ring.packed) {
      FLARE_RETURN_IF_ERROR(dist::varlen_shard(cfg.strategy, cfg.cu_seqlens, n, r, &ring.varlen[r]));
      ring.shards[r].length = ring.varlen[r].length;
    } else {
      FLARE_RETURN_IF_ERROR(sequence_shard(cfg.strategy, cfg.seqlen, n, r, &ring.shards[r]));
    }
  }
  ring.batch = cfg.batch;
  ring.heads_q = cfg.heads_q;
  ring.heads_kv = cfg.heads_kv;
  ring.head_dim = cfg.head_dim;
  ring.dtype = cfg.dtype;
  ring.band = mask_band(cfg.attention);
  // The ring sets the mask per block call; all-to-all makes one call with the caller's options.
  ring.block_options =
      cfg.strategy == Strategy::kAllToAll ? cfg.attention : ring_block_options(cfg);
  ring.strategy = cfg.strategy;
  ring.device = comm->device();
  ring.device_index = comm->device() == DeviceType::kCUDA ? comm->device_index() : 0;
  // The workspace, once, from the plan: no call allocates after this.
  std::vector<int32_t> tables;
  if (cfg.strategy == Strategy::kAllToAll)
    plan_all_to_all(ring, cfg.cu_seqlens, &tables);
  else
    plan_ring(ring, &tables);
  if (ring.device == DeviceType::kCUDA)
    FLARE_RETURN_IF_ERROR(make_device_ops(ring.device_index, ring.ws.bytes, &ring.ops));
  else
    ring.ops = make_host_ops(ring.ws.bytes);
  FLARE_RETURN_IF_ERROR(ring.ops->upload(ring.ws.tables, tables.data(),
                                         static_cast<int64_t>(tables.size()) * 4));
  out->reset(new ContextParallelAttention(std::move(st)));
  return {};
}

Status ContextParallelAttention::forward(const TensorView& q, const TensorView& k,
                                         const TensorView& v, const TensorView& o,
                                         const TensorView& lse, Stream stream) {
  State& st = *state_;
  Communicator& comm = *st.ring.comm;
  FLARE_RETURN_IF_ERROR(comm.health());
  FLARE_RETURN_IF_ERROR(check_locals(st, comm, {{&q, "q"}, {&o, "o"}}, {{&k, "k"}, {&v, "v"}}, lse));
  AttentionParams p;
  FLARE_RETURN_IF_ERROR(
      make_forward_params(q, k, v, o, lse, st.config.attention, local_varlen(st.ring), &p));
  FLARE_RETURN_IF_ERROR(st.config.strategy == Strategy::kAllToAll
                            ? all_to_all_attention_forward(st.ring, q, k, v, o, lse, stream)
                            : ring_attention_forward(st.ring, q, k, v, o, lse, stream));
  // A peer found dead while the call was issued (NCCL's watchdog) is reported now; one found
  // later, by the next call, by barrier() or by health().
  return comm.health();
}

Status ContextParallelAttention::backward(const TensorView& dout, const TensorView& q,
                                          const TensorView& k, const TensorView& v,
                                          const TensorView& o, const TensorView& lse,
                                          const TensorView& dq, const TensorView& dk,
                                          const TensorView& dv, Stream stream) {
  State& st = *state_;
  Communicator& comm = *st.ring.comm;
  FLARE_RETURN_IF_ERROR(comm.health());
  FLARE_RETURN_IF_ERROR(check_locals(st, comm,
                                     {{&dout, "dout"}, {&q, "q"}, {&o, "o"}, {&dq, "dq"}},
                                     {{&k, "k"}, {&v, "v"}, {&dk, "dk"}, {&dv, "dv"}}, lse));
  AttentionParams p;
  FLARE_RETURN_IF_ERROR(
      make_backward_params(dout, q, k, v, o, lse, dq, dk, dv, st.config.attention,
                           local_varlen(st.ring), &p));
  FLARE_RETURN_IF_ERROR(
      st.config.strategy == Strategy::kAllToAll
          ? all_to_all_attention_backward(st.ring, dout, q, k, v, o, lse, dq, dk, dv, stream)
          : ring_attention_backward(st.ring, dout, q, k, v, o, lse, dq, dk, dv, stream));
  return comm.health();
}

Status ContextParallelAttention::set_timing(bool on) { return state_->ring.ops->set_timing(on); }

Status ContextParallelAttention::take_timing(CpTiming* out) {
  if (out == nullptr) return invalid("take_timing: out is null");
  return state_->ring.ops->take_timing(out);
}

}  // namespace flare::dist
