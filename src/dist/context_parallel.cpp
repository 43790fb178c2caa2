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
      window_right, deterministic, backend;
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
#undef FLARE_DIST_COMPARE
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
  // A block's mask is bottom-right aligned within the block; these features would need each
  // block's global position, which attention_forward cannot take (docs/context-parallel.md).
  // All-to-all calls attention over the whole sequence, so its windows are the single-device ones.
  if ((a.window_left != -1 || a.window_right != -1) && c.strategy != Strategy::kAllToAll)
    return Status::unsupported(cat("config.attention: a sliding window (", a.window_left, ", ",
                                   a.window_right, ") is not supported by the ",
                                   strategy_name(c.strategy), " strategy yet (all-to-all has it)"));
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
  for (const auto& [t, name] : qlike)
    FLARE_RETURN_IF_ERROR(check_shape(*t, name, {c.batch, s, c.heads_q, c.head_dim},
                                      "(batch, local rows, heads_q, head_dim)", st, comm));
  for (const auto& [t, name] : kvlike)
    FLARE_RETURN_IF_ERROR(check_shape(*t, name, {c.batch, s, c.heads_kv, c.head_dim},
                                      "(batch, local rows, heads_kv, head_dim)", st, comm));
  FLARE_RETURN_IF_ERROR(check_shape(lse, "lse", {c.batch, c.heads_q, s},
                                    "(batch, heads_q, local rows)", st, comm));
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
  o.causal = false;  // set per block call
  return o;
}

}  // namespace

ContextParallelAttention::ContextParallelAttention(std::unique_ptr<State> state)
    : state_(std::move(state)) {}
ContextParallelAttention::~ContextParallelAttention() = default;

const ContextParallelConfig& ContextParallelAttention::config() const { return state_->config; }
const SequenceShard& ContextParallelAttention::shard() const {
  return state_->ring.shards[state_->ring.comm->rank()];
}

Status ContextParallelAttention::create(Communicator* comm, const ContextParallelConfig& config,
                                        std::unique_ptr<ContextParallelAttention>* out) {
  if (out == nullptr) return invalid("ContextParallelAttention::create: out is null");
  if (comm == nullptr) return invalid("comm: is null");
  FLARE_RETURN_IF_ERROR(comm->health());
  FLARE_RETURN_IF_ERROR(check_config(config));
  if (comm->device() == DeviceType::kCUDA && config.dtype == DType::kFloat32)
    return Status::unsupported(
        "config.dtype: float32 over the " + std::string(comm->kind()) +
        " communicator: the CUDA kernels take float16 or bfloat16 (as FlashAttention does)");

  const int n = comm->size();
  if (config.strategy == Strategy::kAllToAll &&
      (config.heads_q % n != 0 || config.heads_kv % n != 0))
    return Status::unsupported(cat(
        "config: all-to-all over ", n, " ranks needs heads_q = ", config.heads_q,
        " and heads_kv = ", config.heads_kv, " to be multiples of ", n,
        " (each rank takes whole heads, and K/V heads are never copied); use ring or zigzag"));

  // Agreement: every rank sees every config and fails alike on the first difference.
  const WireConfig mine = wire(config, n);
  std::vector<WireConfig> all(static_cast<size_t>(n));
  FLARE_RETURN_IF_ERROR(comm->host_all_gather(&mine, all.data(), sizeof(WireConfig)));
  for (int r = 0; r < n; ++r) FLARE_RETURN_IF_ERROR(compare(all[0], all[r], 0, r));

  auto st = std::make_unique<State>();
  st->config = config;
  CpContext& ring = st->ring;
  ring.comm = comm;
  ring.shards.resize(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r)
    FLARE_RETURN_IF_ERROR(sequence_shard(config.strategy, config.seqlen, n, r, &ring.shards[r]));
  ring.batch = config.batch;
  ring.heads_q = config.heads_q;
  ring.heads_kv = config.heads_kv;
  ring.head_dim = config.head_dim;
  ring.dtype = config.dtype;
  ring.causal = config.attention.causal;
  // The ring sets the mask per block call; all-to-all makes one call with the caller's options.
  ring.block_options =
      config.strategy == Strategy::kAllToAll ? config.attention : ring_block_options(config);
  ring.strategy = config.strategy;
  ring.device = comm->device();
  ring.device_index = comm->device() == DeviceType::kCUDA ? comm->device_index() : 0;
  // The workspace, once, from the plan: no call allocates after this.
  if (config.strategy == Strategy::kAllToAll)
    plan_all_to_all_workspace(ring, &ring.ws);
  else
    plan_ring_workspace(ring, &ring.ws);
  if (ring.device == DeviceType::kCUDA)
    FLARE_RETURN_IF_ERROR(make_device_ops(ring.device_index, ring.ws.bytes, &ring.ops));
  else
    ring.ops = make_host_ops(ring.ws.bytes);
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
  FLARE_RETURN_IF_ERROR(make_forward_params(q, k, v, o, lse, st.config.attention, {}, &p));
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
      make_backward_params(dout, q, k, v, o, lse, dq, dk, dv, st.config.attention, {}, &p));
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
