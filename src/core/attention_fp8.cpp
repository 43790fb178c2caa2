// attention_fp8.cpp — attention_forward_fp8: float8_e4m3 q, k and v with descale factors
// (flare/attention.h states the semantics).
//
// Validation is attention_forward's (make_forward_params_fp8) plus the descales', all before
// anything is written. On the CPU the inputs are dequantized into float32 scratch, each element
// e4m3(x) · descale rounded once to float32, and attention_forward's float32 path runs on them;
// a 16-bit o receives the fp32 result rounded once. The scratch is 4 bytes per input element (and
// per output element for a 16-bit o), allocated before any output is touched.
#include <cstdint>
#include <new>
#include <utility>
#include <vector>

#include "core/backends.h"
#include "core/message.h"
#include "core/numeric.h"
#include "core/validate.h"
#include "flare/attention.h"

namespace flare {
namespace {

// A descale tensor's axes against its input: `heads` the input's heads (and `group_heads` the
// other count a q descale may have: k's, the query heads of a group sharing one factor), `seqlen`
// the rows per sequence that its blocks cover.
struct DescaleAxes {
  int64_t batch, heads, group_heads, seqlen;
  const char* seqlen_name;
};

Status check_descale(const TensorView& t, const char* name, const DescaleAxes& axes,
                     int block_rows, const TensorView& q) {
  if (!t.defined()) return {};
  FLARE_RETURN_IF_ERROR(check_tensor_rank(t, name, 3, "(batch | 1, heads | 1, blocks | 1)"));
  FLARE_RETURN_IF_ERROR(check_tensor_view(t, name));
  if (t.dtype != DType::kFloat32)
    return invalid(name, ": dtype must be float32, got ", dtype_name(t.dtype));
  FLARE_RETURN_IF_ERROR(check_same_device_as_q(t, name, q));
  if (t.shape[0] != axes.batch && t.shape[0] != 1)
    return invalid(name, ": shape[0] = ", t.shape[0], " must be batch = ", axes.batch, " or 1");
  if (t.shape[1] != axes.heads && t.shape[1] != axes.group_heads && t.shape[1] != 1)
    return invalid(name, ": shape[1] = ", t.shape[1], " must be ",
                   axes.group_heads != axes.heads
                       ? cat("heads_q = ", axes.heads, ", heads_kv = ", axes.group_heads)
                       : cat("heads = ", axes.heads),
                   " or 1");
  const int64_t blocks = t.shape[2];
  if (blocks != 1) {
    if (block_rows < 1)
      return invalid("block_rows: must be >= 1 where ", name, " has ", blocks,
                     " blocks of rows, got ", block_rows);
    const int64_t want = (axes.seqlen + block_rows - 1) / block_rows;
    if (blocks != want)
      return invalid(name, ": shape[2] = ", blocks, " blocks must be ceil(", axes.seqlen_name,
                     " / block_rows) = ceil(", axes.seqlen, " / ", block_rows, ") = ", want,
                     ", or 1");
  }
  return {};
}

// Outputs must share no memory with any input, the descales included.
Status check_outputs_apart_from(const TensorView& out, const char* out_name,
                                const TensorView& in, const char* in_name) {
  if (in.defined() && tensors_share_memory(out, in))
    return invalid(out_name, ": shares memory with ", in_name,
                   "; outputs must not overlap any input");
  return {};
}

// The factor of input element (sequence b, head h, row i of the sequence).
float descale_at(const TensorView& t, int block_rows, int64_t b, int64_t h, int64_t group,
                 int64_t heads, int64_t i) {
  if (!t.defined()) return 1.0f;
  const int64_t tb = t.shape[0] == 1 ? 0 : b;
  const int64_t th = t.shape[1] == 1 ? 0 : t.shape[1] == heads ? h : h / group;
  const int64_t tr = t.shape[2] == 1 ? 0 : i / block_rows;
  return static_cast<const float*>(t.data)[tb * t.stride[0] + th * t.stride[1] + tr * t.stride[2]];
}

// x (b, s, h, d), or packed (total, h, d) with the sequences' first rows in `cu` → out, dense
// float32 of the same logical shape: e4m3(x) · descale, rounded once. `group`: x's heads per
// descale head where the descale has the other head count.
void dequantize(const TensorView& x, const TensorView& descale, int block_rows, int64_t group,
                const int32_t* cu, int64_t batch, float* out) {
  const bool packed = cu != nullptr;
  const int hd = packed ? 2 : 3;
  const int64_t heads = x.shape[hd - 1], d = x.shape[hd];
  const uint8_t* codes = static_cast<const uint8_t*>(x.data);
  auto row = [&](int64_t b, int64_t i, int64_t src_row, int64_t dst_row) {
    for (int64_t h = 0; h < heads; ++h) {
      const float f = descale_at(descale, block_rows, b, h, group, heads, i);
      const uint8_t* src = codes + src_row + h * x.stride[hd - 1];
      float* dst = out + (dst_row * heads + h) * d;
      for (int64_t e = 0; e < d; ++e) dst[e] = e4m3_to_float(src[e]) * f;
    }
  };
  if (packed) {
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t t = cu[b]; t < cu[b + 1]; ++t) row(b, t - cu[b], t * x.stride[0], t);
    return;
  }
  const int64_t s = x.shape[1];
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0; i < s; ++i) row(b, i, b * x.stride[0] + i * x.stride[1], b * s + i);
}

// A dense float32 view of `like`'s logical shape over `data`.
TensorView dense_fp32(float* data, const TensorView& like) {
  TensorView t = like;
  t.data = data;
  t.dtype = DType::kFloat32;
  int64_t step = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.stride[i] = step;
    step *= t.shape[i];
  }
  return t;
}

// o (any float dtype, any strides) ← the dense float32 result, rounded once.
void store_output(const TensorView& o, const float* result) {
  const int nd = o.ndim;
  int64_t index[kMaxDims] = {0, 0, 0, 0};
  const int64_t n = o.numel();
  for (int64_t flat = 0; flat < n; ++flat) {
    int64_t offset = 0;
    for (int i = 0; i < nd; ++i) offset += index[i] * o.stride[i];
    store_from_float(o.data, offset, o.dtype, result[flat]);
    for (int i = nd - 1; i >= 0 && ++index[i] == o.shape[i]; --i) index[i] = 0;
  }
}

}  // namespace

Status attention_forward_fp8(const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& o, const TensorView& lse,
                             const Fp8Descale& descale, const AttentionOptions& options,
                             const VarlenArgs& varlen, Stream stream) {
  AttentionParams p;
  FLARE_RETURN_IF_ERROR(make_forward_params_fp8(q, k, v, o, lse, options, varlen, &p));
  if (descale.block_rows < 0)
    return invalid("block_rows: must be >= 0 (0: no blocks of rows), got ", descale.block_rows);
  const DescaleAxes q_axes{p.batch, p.heads_q, p.heads_kv, p.seqlen_q,
                           varlen.defined() ? "max_seqlen_q" : "seqlen_q"};
  const DescaleAxes kv_axes{p.batch, p.heads_kv, p.heads_kv, p.seqlen_k,
                            varlen.defined() ? "max_seqlen_k" : "seqlen_k"};
  FLARE_RETURN_IF_ERROR(check_descale(descale.q, "q_descale", q_axes, descale.block_rows, q));
  FLARE_RETURN_IF_ERROR(check_descale(descale.k, "k_descale", kv_axes, descale.block_rows, q));
  FLARE_RETURN_IF_ERROR(check_descale(descale.v, "v_descale", kv_axes, descale.block_rows, q));
  for (const auto& [out, out_name] : {std::pair{&o, "o"}, std::pair{&lse, "lse"}}) {
    FLARE_RETURN_IF_ERROR(check_outputs_apart_from(*out, out_name, descale.q, "q_descale"));
    FLARE_RETURN_IF_ERROR(check_outputs_apart_from(*out, out_name, descale.k, "k_descale"));
    FLARE_RETURN_IF_ERROR(check_outputs_apart_from(*out, out_name, descale.v, "v_descale"));
  }
  if (p.device == DeviceType::kCUDA)
    return Status::unsupported(
        "q: float8_e4m3 attention has no CUDA kernel yet; CPU tensors run it");

  std::vector<float> q32, k32, v32, o32;
  try {
    q32.resize(static_cast<size_t>(q.numel()));
    k32.resize(static_cast<size_t>(k.numel()));
    v32.resize(static_cast<size_t>(v.numel()));
    if (o.dtype != DType::kFloat32) o32.resize(static_cast<size_t>(o.numel()));
  } catch (const std::bad_alloc&) {
    return Status::out_of_memory(
        cat("attention_forward_fp8: no memory for the float32 copies of q, k and v (",
            4 * (q.numel() + k.numel() + v.numel()), " bytes)"));
  }
  const int64_t group = p.head_group;
  dequantize(q, descale.q, descale.block_rows, group, p.cu_seqlens_q, p.batch, q32.data());
  dequantize(k, descale.k, descale.block_rows, 1, p.cu_seqlens_k, p.batch, k32.data());
  dequantize(v, descale.v, descale.block_rows, 1, p.cu_seqlens_k, p.batch, v32.data());
  const TensorView o_fp32 = o.dtype == DType::kFloat32 ? o : dense_fp32(o32.data(), o);
  FLARE_RETURN_IF_ERROR(attention_forward(dense_fp32(q32.data(), q), dense_fp32(k32.data(), k),
                                          dense_fp32(v32.data(), v), o_fp32, lse, options,
                                          varlen, stream));
  if (o.dtype != DType::kFloat32) store_output(o, o32.data());
  return {};
}

}  // namespace flare
