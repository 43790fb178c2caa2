// attention.cpp — the public entry points: validate every argument, fill one AttentionParams,
// dispatch to a backend.
//
// Validation is complete before anything is written: a rejected call leaves every output exactly
// as it was, and the AttentionParams untouched. Messages name the argument and the rule
// ("k: heads = 3 must divide q's heads = 8 (GQA/MQA)"). The C API hands over whatever integers
// its caller wrote, so enum values, ranks, signs and offset overflow are checked too, before any
// shape is indexed. The CPU can check cu_seqlens values; for CUDA tensors reading them would need
// a device synchronisation, which flare never hides, so only their shape is checked there.
#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>

#include "core/backends.h"
#include "core/message.h"
#include "core/numeric.h"
#include "core/params.h"
#include "flare/attention.h"

namespace flare {
namespace {

// Callers have checked 0 <= ndim <= kMaxDims, so these never read past the arrays.
std::string shape_str(const TensorView& t) {
  std::ostringstream s;
  s << "(";
  for (int i = 0; i < t.ndim; ++i) s << (i ? ", " : "") << t.shape[i];
  s << ")";
  return s.str();
}

std::string stride_str(const TensorView& t) {
  std::ostringstream s;
  s << "(";
  for (int i = 0; i < t.ndim; ++i) s << (i ? ", " : "") << t.stride[i];
  s << ")";
  return s.str();
}

const char* device_name(DeviceType d) { return d == DeviceType::kCUDA ? "cuda" : "cpu"; }

bool known_dtype(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16 ||
         d == DType::kInt32 || d == DType::kUInt8 || d == DType::kFloat8E4M3;
}

// The C API casts caller integers to these enums, so any value can arrive here.
std::string dtype_str(DType d) {
  return known_dtype(d) ? dtype_name(d) : cat("unknown (", static_cast<int>(d), ")");
}

bool has_elements(const TensorView& t) {
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[i] == 0) return false;
  return t.ndim > 0;
}

// Presence and rank come first: every later check indexes shape[0 .. ndim).
Status check_rank(const TensorView& t, const char* name, int ndim, const char* layout) {
  if (!t.defined()) return invalid(name, ": tensor is required");
  if (t.ndim != ndim)
    return invalid(name, ": expected ", ndim, " dimensions ", layout, ", got ", t.ndim);
  return {};
}

// What every tensor argument needs once its rank is known. Backends address element (i0, i1, …)
// at Σ i·stride in int64 and cast data to the element type, so the largest offset must fit in
// int64 and the pointer must be aligned to the element size.
Status check_view(const TensorView& t, const char* name) {
  int64_t reach = 0;  // largest element offset
  for (int i = 0; i < t.ndim; ++i) {
    if (t.shape[i] < 0) return invalid(name, ": shape[", i, "] = ", t.shape[i], " is negative");
    if (t.stride[i] < 0) return invalid(name, ": stride[", i, "] = ", t.stride[i], " is negative");
    if (t.shape[i] > 1) {
      if (t.stride[i] > (INT64_MAX - reach) / (t.shape[i] - 1))
        return invalid(name, ": shape ", shape_str(t), " with strides ", stride_str(t),
                       " reaches element offsets beyond int64");
      reach += t.stride[i] * (t.shape[i] - 1);
    }
  }
  if (!known_dtype(t.dtype))
    return invalid(name, ": dtype ", dtype_str(t.dtype), " is not a known dtype");
  if (t.device != DeviceType::kCPU && t.device != DeviceType::kCUDA)
    return invalid(name, ": device type ", static_cast<int>(t.device), " is neither cpu nor cuda");
  if (t.device == DeviceType::kCUDA && t.device_index < 0)
    return invalid(name, ": CUDA device index ", t.device_index, " is negative");
  if (has_elements(t)) {
    if (t.data == nullptr) return invalid(name, ": data pointer is null");
    if (reinterpret_cast<std::uintptr_t>(t.data) % dtype_size(t.dtype) != 0)
      return invalid(name, ": data pointer is not aligned to its ", dtype_size(t.dtype),
                     "-byte elements");
  }
  return {};
}

// Which element types a call's q, k and v take: attention_forward_fp8's float8_e4m3, or the
// 16/32-bit floats of every other entry point (and of every output).
enum class Inputs { kFloat, kFloat8 };

// q, k, v and everything shaped like them: floating point of the `inputs` kind, unit head_dim
// stride.
Status check_qkv_like(const TensorView& t, const char* name, int ndim, const char* layout,
                      Inputs inputs = Inputs::kFloat) {
  FLARE_RETURN_IF_ERROR(check_rank(t, name, ndim, layout));
  FLARE_RETURN_IF_ERROR(check_view(t, name));
  // An empty tensor has no element to address: its strides mean nothing (NumPy gives them 0).
  if (has_elements(t) && t.shape[ndim - 1] > 1 && t.stride[ndim - 1] != 1)
    return invalid(name, ": last (head_dim) stride must be 1, got ", t.stride[ndim - 1]);
  if (inputs == Inputs::kFloat8) {
    if (t.dtype != DType::kFloat8E4M3)
      return invalid(name, ": dtype ", dtype_str(t.dtype),
                     " must be float8_e4m3 (attention_forward_fp8)");
    return {};
  }
  if (t.dtype == DType::kFloat8E4M3)
    return invalid(name, ": float8_e4m3 is an input type of attention_forward_fp8 only (its q, k "
                         "and v, forward)");
  if (t.dtype != DType::kFloat32 && t.dtype != DType::kFloat16 && t.dtype != DType::kBFloat16)
    return invalid(name, ": dtype ", dtype_str(t.dtype),
                   " is not one of float32, float16, bfloat16");
  return {};
}

Status check_same_device(const TensorView& t, const char* name, const TensorView& q) {
  if (t.device != q.device || (t.device == DeviceType::kCUDA && t.device_index != q.device_index))
    return invalid(name, ": on ", device_name(t.device), ":", t.device_index, " but q is on ",
                   device_name(q.device), ":", q.device_index,
                   "; all tensors must share one device");
  return {};
}

Status check_same_dtype(const TensorView& t, const char* name, const TensorView& q) {
  if (t.dtype != q.dtype)
    return invalid(name, ": dtype ", dtype_str(t.dtype), " differs from q's dtype ",
                   dtype_name(q.dtype));
  return {};
}

Status check_same_shape(const TensorView& t, const char* name, const TensorView& ref,
                        const char* ref_name) {
  bool same = t.ndim == ref.ndim;
  for (int i = 0; same && i < t.ndim; ++i) same = t.shape[i] == ref.shape[i];
  if (!same)
    return invalid(name, ": shape ", shape_str(t), " must equal ", ref_name, "'s shape ",
                   shape_str(ref));
  return {};
}

// Outputs are written in parallel, so no two of their elements may share memory. The test is the
// usual sufficient one: with dimensions sorted by stride, each stride must step past everything
// the smaller dimensions reach. Dense layouts pass however they are permuted or padded; broadcast
// (stride 0) and interleaved views do not. Needs check_view first (non-negative, no overflow).
// The dims of extent > 1, sorted by stride (ascending), into dims; returns their count.
int dims_by_stride(const TensorView& t, int* dims) {
  int n = 0;
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[i] > 1) dims[n++] = i;
  for (int j = 1; j < n; ++j)  // insertion sort: at most kMaxDims entries
    for (int m = j; m > 0 && t.stride[dims[m]] < t.stride[dims[m - 1]]; --m)
      std::swap(dims[m], dims[m - 1]);
  return n;
}

Status check_no_overlap(const TensorView& t, const char* name) {
  if (!has_elements(t)) return {};
  int dims[kMaxDims];
  const int n = dims_by_stride(t, dims);
  int64_t reach = 0;
  for (int j = 0; j < n; ++j) {
    const int i = dims[j];
    if (t.stride[i] <= reach)
      return invalid(name, ": strides ", stride_str(t), " for shape ", shape_str(t),
                     " make distinct elements share memory; an output must not overlap itself");
    reach += t.stride[i] * (t.shape[i] - 1);
  }
  return {};
}

// Whether two views (each passed check_view) share an element's bytes. Exact where it matters —
// views of one buffer that interleave without touching, such as dq, dk and dv sliced from a
// packed (…, 3, h, d) gradient, or, under GQA, a (…, h_q + 2·h_kv, d) one whose slices differ in
// heads — and conservative elsewhere: byte ranges that intersect count as shared unless both views
// have the same element size, rank and strides (shapes may differ), the view spanning both
// shapes does not overlap itself, and no index difference reaches the offset between them.
int64_t last_byte(const TensorView& t) {
  int64_t reach = 0;
  for (int i = 0; i < t.ndim; ++i) reach += t.stride[i] * (t.shape[i] - 1);
  return (reach + 1) * static_cast<int64_t>(dtype_size(t.dtype));
}

// Index differences between an element of view a and one of view b along each dim: from
// −(shape_b − 1) to shape_a − 1.
struct DigitRange {
  int64_t lo[kMaxDims];
  int64_t hi[kMaxDims];
};

// Whether delta = Σ c_i · stride_i for digits c_i within their ranges, over dims[0..n) sorted by
// stride (ascending). Each stride exceeds the reach of the smaller ones (no self-overlap of the
// spanning view), so at most three digits fit at each level and the search stays tiny.
bool lattice_hits(int64_t delta, const int64_t* stride, const DigitRange& r, const int* dims,
                  int n) {
  if (n == 0) return delta == 0;
  const int i = dims[n - 1];
  int64_t below_lo = 0, below_hi = 0;  // what the smaller dims can still add
  for (int j = 0; j < n - 1; ++j) {
    below_lo += stride[dims[j]] * r.lo[dims[j]];
    below_hi += stride[dims[j]] * r.hi[dims[j]];
  }
  const int64_t s = stride[i];
  auto floor_div = [](int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); };
  // Digits c with below_lo <= delta − c·s <= below_hi.
  const int64_t first = std::max(r.lo[i], -floor_div(-(delta - below_hi), s));
  const int64_t last = std::min(r.hi[i], floor_div(delta - below_lo, s));
  for (int64_t c = first; c <= last; ++c)
    if (lattice_hits(delta - c * s, stride, r, dims, n - 1)) return true;
  return false;
}

bool share_memory(const TensorView& a, const TensorView& b) {
  if (!has_elements(a) || !has_elements(b) || a.device != b.device ||
      (a.device == DeviceType::kCUDA && a.device_index != b.device_index))
    return false;
  const auto lo_a = reinterpret_cast<intptr_t>(a.data), lo_b = reinterpret_cast<intptr_t>(b.data);
  if (lo_a + last_byte(a) <= lo_b || lo_b + last_byte(b) <= lo_a) return false;
  bool same_lattice = a.dtype == b.dtype && a.ndim == b.ndim;
  for (int i = 0; same_lattice && i < a.ndim; ++i) same_lattice = a.stride[i] == b.stride[i];
  const auto size = static_cast<intptr_t>(dtype_size(a.dtype));
  if (!same_lattice || (lo_b - lo_a) % size != 0) return true;
  TensorView span = a;  // covers every index of either view
  DigitRange r{};
  for (int i = 0; i < a.ndim; ++i) {
    span.shape[i] = std::max(a.shape[i], b.shape[i]);
    r.lo[i] = -(b.shape[i] - 1);
    r.hi[i] = a.shape[i] - 1;
  }
  if (!check_no_overlap(span, "").ok()) return true;
  int dims[kMaxDims];
  const int n = dims_by_stride(span, dims);
  return lattice_hits((lo_b - lo_a) / size, span.stride, r, dims, n);
}

struct NamedView {
  const TensorView* view;
  const char* name;
};

// Outputs are written while inputs are still being read and while other outputs are written, so
// an output may share no byte with any other argument.
Status check_outputs_disjoint(std::initializer_list<NamedView> outputs,
                              std::initializer_list<NamedView> inputs) {
  for (auto out = outputs.begin(); out != outputs.end(); ++out) {
    for (auto other = outputs.begin(); other != out; ++other)
      if (share_memory(*out->view, *other->view))
        return invalid(out->name, ": shares memory with ", other->name,
                       "; outputs must not overlap each other or any input");
    for (const NamedView& in : inputs)
      if (share_memory(*out->view, *in.view))
        return invalid(out->name, ": shares memory with the input ", in.name,
                       "; outputs must not overlap each other or any input");
  }
  return {};
}

// An output or gradient tensor that must look like `ref` (shape, device; dtype: q's, or any
// float type after float8_e4m3 inputs) and own its memory element by element.
Status check_output_like(const TensorView& t, const char* name, const TensorView& ref,
                         const char* ref_name, const char* layout, const TensorView& q) {
  FLARE_RETURN_IF_ERROR(check_qkv_like(t, name, ref.ndim, layout));
  FLARE_RETURN_IF_ERROR(check_same_shape(t, name, ref, ref_name));
  if (q.dtype != DType::kFloat8E4M3) FLARE_RETURN_IF_ERROR(check_same_dtype(t, name, q));
  FLARE_RETURN_IF_ERROR(check_same_device(t, name, q));
  return check_no_overlap(t, name);
}

// cu_seqlens_q / cu_seqlens_k against the batch (from cu_seqlens_q's length) and the packed token
// count `total` of q or k.
Status check_cu_seqlens(const TensorView& cu, const char* name, const char* other,
                        const TensorView& q, int64_t batch, int64_t total, int max_seqlen,
                        const char* max_name) {
  if (!cu.defined()) return invalid(name, ": required when ", other, " is given");
  if (cu.ndim != 1) return invalid(name, ": expected 1 dimension (batch + 1), got ", cu.ndim);
  FLARE_RETURN_IF_ERROR(check_view(cu, name));
  if (cu.dtype != DType::kInt32)
    return invalid(name, ": dtype must be int32, got ", dtype_str(cu.dtype));
  if (cu.shape[0] != batch + 1)
    return invalid(name, ": length ", cu.shape[0], " must be batch + 1 = ", batch + 1,
                   " (same as cu_seqlens_q)");
  if (cu.shape[0] > 1 && cu.stride[0] != 1) return invalid(name, ": must be contiguous (stride 1)");
  FLARE_RETURN_IF_ERROR(check_same_device(cu, name, q));
  if (max_seqlen < 0) return invalid(max_name, ": must be >= 0, got ", max_seqlen);
  if (cu.device != DeviceType::kCPU) return {};
  const auto* c = static_cast<const int32_t*>(cu.data);
  if (c[0] != 0) return invalid(name, "[0] must be 0, got ", c[0]);
  for (int64_t b = 0; b < batch; ++b) {
    if (c[b + 1] < c[b])
      return invalid(name, ": must be non-decreasing, but [", b + 1, "] = ", c[b + 1], " < [", b,
                     "] = ", c[b]);
    if (c[b + 1] - c[b] > max_seqlen)
      return invalid(max_name, ": ", max_seqlen, " is smaller than sequence ", b, "'s length ",
                     c[b + 1] - c[b], " in ", name, "; it must be >= every sequence length");
  }
  if (c[batch] != total)
    return invalid(name, "[batch] = ", c[batch], " must equal the packed token count ", total);
  return {};
}

// The strides the backends index with. An empty tensor's own strides are arbitrary (validation
// ignores them), so it gets the dense strides of its shape: nothing is read through them, but
// pointer arithmetic and copy descriptors stay well formed.
void set_strides(const TensorView& view, bool varlen, int64_t* batch, int64_t* row,
                 int64_t* head) {
  TensorView t = view;
  if (!has_elements(t)) {
    int64_t dense = 1;
    for (int i = t.ndim - 1; i >= 0; --i) {
      t.stride[i] = dense;
      dense *= std::max<int64_t>(t.shape[i], 1);
    }
  }
  if (varlen) {
    *batch = 0;
    *row = t.stride[0];
    *head = t.stride[1];
  } else {
    *batch = t.stride[0];
    *row = t.stride[1];
    *head = t.stride[2];
  }
}

const char* q_layout(bool varlen) {
  return varlen ? "(total_q, heads_q, head_dim) for a varlen batch"
                : "(batch, seqlen_q, heads_q, head_dim)";
}
const char* k_layout(bool varlen) {
  return varlen ? "(total_k, heads_kv, head_dim) for a varlen batch"
                : "(batch, seqlen_k, heads_kv, head_dim)";
}

// Sizes kernels keep in int: sequence lengths and batch; tokens are counted in int64.
constexpr int64_t kMaxSeqlen = int64_t{1} << 30;
constexpr int64_t kMaxBatch = INT32_MAX;
constexpr int64_t kMaxHeads = 65535;  // CUDA grid dimension y/z limit
constexpr int64_t kMaxHeadDim = 256;

}  // namespace

// core/validate.h: the same checks for the other validating entry points.
Status check_tensor_rank(const TensorView& t, const char* name, int ndim, const char* layout) {
  return check_rank(t, name, ndim, layout);
}
Status check_tensor_view(const TensorView& t, const char* name) { return check_view(t, name); }
bool tensors_share_memory(const TensorView& a, const TensorView& b) { return share_memory(a, b); }
Status check_same_device_as_q(const TensorView& t, const char* name, const TensorView& q) {
  return check_same_device(t, name, q);
}

namespace {

// Validates the arguments shared by forward and backward and fills everything in `p` except the
// backward-only pointers. `p` is written only when every check passes.
Status fill_forward_params(const TensorView& q, const TensorView& k, const TensorView& v,
                           const TensorView& o, const TensorView& lse, const AttentionOptions& opt,
                           const VarlenArgs& varlen, Inputs inputs, AttentionParams* p) {
  const bool is_varlen = varlen.defined();
  const int nd = is_varlen ? 3 : 4;
  FLARE_RETURN_IF_ERROR(check_qkv_like(q, "q", nd, q_layout(is_varlen), inputs));
  FLARE_RETURN_IF_ERROR(check_qkv_like(k, "k", nd, k_layout(is_varlen), inputs));
  FLARE_RETURN_IF_ERROR(check_qkv_like(v, "v", nd, k_layout(is_varlen), inputs));
  FLARE_RETURN_IF_ERROR(check_same_dtype(k, "k", q));
  FLARE_RETURN_IF_ERROR(check_same_dtype(v, "v", q));
  FLARE_RETURN_IF_ERROR(check_same_device(k, "k", q));
  FLARE_RETURN_IF_ERROR(check_same_device(v, "v", q));
  FLARE_RETURN_IF_ERROR(check_same_shape(v, "v", k, "k"));

  const int hd = nd - 1, hh = nd - 2;  // dims of head_dim and heads
  const int64_t d = q.shape[hd];
  if (d < 1 || d > kMaxHeadDim)
    return invalid("q: head_dim = ", d, " must be in [1, ", kMaxHeadDim, "]");
  if (k.shape[hd] != d)
    return invalid("k: head_dim = ", k.shape[hd], " must equal q's head_dim = ", d);
  const int64_t hq = q.shape[hh], hkv = k.shape[hh];
  if (hq < 1) return invalid("q: heads = ", hq, " must be >= 1");
  if (hkv < 1) return invalid("k: heads = ", hkv, " must be >= 1");
  if (hq % hkv != 0)
    return invalid("k: heads = ", hkv, " must divide q's heads = ", hq, " (GQA/MQA)");
  if (hq > kMaxHeads) return invalid("q: heads = ", hq, " exceeds the maximum ", kMaxHeads);

  FLARE_RETURN_IF_ERROR(check_output_like(o, "o", q, "q", q_layout(is_varlen), q));

  int64_t batch, sq, sk;
  if (is_varlen) {
    const TensorView& cq = varlen.cu_seqlens_q;
    if (!cq.defined()) return invalid("cu_seqlens_q: required when cu_seqlens_k is given");
    if (cq.ndim != 1)
      return invalid("cu_seqlens_q: expected 1 dimension (batch + 1), got ", cq.ndim);
    if (cq.shape[0] < 1)
      return invalid("cu_seqlens_q: length ", cq.shape[0], " must be batch + 1 >= 1");
    batch = cq.shape[0] - 1;
    if (batch > kMaxBatch)
      return invalid("cu_seqlens_q: batch = ", batch, " exceeds the maximum ", kMaxBatch);
    // cu_seqlens hold int32 row offsets, so the packed token counts must fit in int32.
    if (q.shape[0] > INT32_MAX)
      return invalid("q: total_q = ", q.shape[0], " exceeds int32 offsets of cu_seqlens_q");
    if (k.shape[0] > INT32_MAX)
      return invalid("k: total_k = ", k.shape[0], " exceeds int32 offsets of cu_seqlens_k");
    if (varlen.max_seqlen_q > kMaxSeqlen)
      return invalid("max_seqlen_q: ", varlen.max_seqlen_q, " exceeds the maximum ", kMaxSeqlen);
    if (varlen.max_seqlen_k > kMaxSeqlen)
      return invalid("max_seqlen_k: ", varlen.max_seqlen_k, " exceeds the maximum ", kMaxSeqlen);
    FLARE_RETURN_IF_ERROR(check_cu_seqlens(cq, "cu_seqlens_q", "cu_seqlens_k", q, batch, q.shape[0],
                                           varlen.max_seqlen_q, "max_seqlen_q"));
    FLARE_RETURN_IF_ERROR(check_cu_seqlens(varlen.cu_seqlens_k, "cu_seqlens_k", "cu_seqlens_q", q,
                                           batch, k.shape[0], varlen.max_seqlen_k, "max_seqlen_k"));
    sq = varlen.max_seqlen_q;
    sk = varlen.max_seqlen_k;
  } else {
    batch = q.shape[0];
    sq = q.shape[1];
    sk = k.shape[1];
    if (k.shape[0] != batch)
      return invalid("k: batch = ", k.shape[0], " must equal q's batch = ", batch);
    if (batch > kMaxBatch) return invalid("q: batch = ", batch, " exceeds the maximum ", kMaxBatch);
    if (sq > kMaxSeqlen) return invalid("q: seqlen = ", sq, " exceeds the maximum ", kMaxSeqlen);
    if (sk > kMaxSeqlen) return invalid("k: seqlen = ", sk, " exceeds the maximum ", kMaxSeqlen);
  }

  // lse: fp32, contiguous (b, h_q, s_q) or packed (h_q, total_q).
  FLARE_RETURN_IF_ERROR(
      check_rank(lse, "lse", is_varlen ? 2 : 3,
                 is_varlen ? "(heads_q, total_q)" : "(batch, heads_q, seqlen_q)"));
  FLARE_RETURN_IF_ERROR(check_view(lse, "lse"));
  if (lse.dtype != DType::kFloat32)
    return invalid("lse: dtype must be float32, got ", dtype_str(lse.dtype));
  const bool lse_shape_ok =
      is_varlen ? (lse.shape[0] == hq && lse.shape[1] == q.shape[0])
                : (lse.shape[0] == batch && lse.shape[1] == hq && lse.shape[2] == sq);
  if (!lse_shape_ok)
    return invalid("lse: shape ", shape_str(lse), " must be ",
                   is_varlen
                       ? cat("(heads_q, total_q) = (", hq, ", ", q.shape[0], ")")
                       : cat("(batch, heads_q, seqlen_q) = (", batch, ", ", hq, ", ", sq, ")"));
  if (has_elements(lse) && !lse.is_contiguous())
    return invalid("lse: must be contiguous, got strides ", stride_str(lse));
  FLARE_RETURN_IF_ERROR(check_same_device(lse, "lse", q));

  // Options.
  if (!std::isfinite(opt.softmax_scale) || opt.softmax_scale < 0.0f)
    return invalid("softmax_scale: must be finite and > 0 (0 selects 1/sqrt(head_dim)), got ",
                   opt.softmax_scale);
  if (opt.window_left < -1)
    return invalid("window_left: must be >= -1 (-1 = unbounded), got ", opt.window_left);
  if (opt.window_right < -1)
    return invalid("window_right: must be >= -1 (-1 = unbounded), got ", opt.window_right);
  if (!std::isfinite(opt.softcap) || opt.softcap < 0.0f)
    return invalid("softcap: must be finite and >= 0 (0 = off), got ", opt.softcap);
  if (!(opt.dropout_p >= 0.0f && opt.dropout_p < 1.0f))  // also rejects NaN
    return invalid("dropout_p: must be in [0, 1), got ", opt.dropout_p);
  const TensorView& al = opt.alibi_slopes;
  int64_t alibi_batch_stride = 0;
  if (al.defined()) {
    if (al.ndim != 1 && al.ndim != 2)
      return invalid(
          "alibi_slopes: expected 1 or 2 dimensions, (heads_q) or (batch, heads_q), got ", al.ndim);
    FLARE_RETURN_IF_ERROR(check_view(al, "alibi_slopes"));
    if (al.dtype != DType::kFloat32)
      return invalid("alibi_slopes: dtype must be float32, got ", dtype_str(al.dtype));
    const bool shape_ok = (al.ndim == 1 && al.shape[0] == hq) ||
                          (al.ndim == 2 && al.shape[0] == batch && al.shape[1] == hq);
    if (!shape_ok)
      return invalid("alibi_slopes: shape ", shape_str(al), " must be (heads_q) = (", hq,
                     ") or (batch, heads_q) = (", batch, ", ", hq, ")");
    if (has_elements(al) && al.shape[al.ndim - 1] > 1 && al.stride[al.ndim - 1] != 1)
      return invalid("alibi_slopes: last stride must be 1, got ", al.stride[al.ndim - 1]);
    FLARE_RETURN_IF_ERROR(check_same_device(al, "alibi_slopes", q));
    alibi_batch_stride = al.ndim == 2 ? al.stride[0] : 0;
  }
  if (opt.backend != Backend::kAuto && opt.backend != Backend::kReference &&
      opt.backend != Backend::kFlash)
    return invalid("backend: unknown value ", static_cast<int>(opt.backend),
                   "; must be auto (0), reference (1) or flash (2)");
  if (q.device == DeviceType::kCUDA && opt.backend == Backend::kReference)
    return invalid("backend: the reference backend runs on CPU tensors only");

  FLARE_RETURN_IF_ERROR(check_outputs_disjoint(
      {{&o, "o"}, {&lse, "lse"}},
      {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&al, "alibi_slopes"},
       {&varlen.cu_seqlens_q, "cu_seqlens_q"}, {&varlen.cu_seqlens_k, "cu_seqlens_k"}}));

  AttentionParams r;
  r.q = q.data;
  r.k = k.data;
  r.v = v.data;
  r.o = o.data;
  r.lse = static_cast<float*>(lse.data);
  set_strides(q, is_varlen, &r.q_batch_stride, &r.q_row_stride, &r.q_head_stride);
  set_strides(k, is_varlen, &r.k_batch_stride, &r.k_row_stride, &r.k_head_stride);
  set_strides(v, is_varlen, &r.v_batch_stride, &r.v_row_stride, &r.v_head_stride);
  set_strides(o, is_varlen, &r.o_batch_stride, &r.o_row_stride, &r.o_head_stride);
  if (is_varlen) {
    r.lse_batch_stride = 0;
    r.lse_head_stride = q.shape[0];
  } else {
    r.lse_batch_stride = hq * sq;
    r.lse_head_stride = sq;
  }
  r.dtype = q.dtype;
  r.device = q.device;
  r.device_index = q.device_index;
  r.batch = static_cast<int>(batch);
  r.heads_q = static_cast<int>(hq);
  r.heads_kv = static_cast<int>(hkv);
  r.head_group = static_cast<int>(hq / hkv);
  r.head_dim = static_cast<int>(d);
  r.seqlen_q = static_cast<int>(sq);
  r.seqlen_k = static_cast<int>(sk);
  r.total_q = is_varlen ? q.shape[0] : batch * sq;
  r.total_k = is_varlen ? k.shape[0] : batch * sk;
  r.cu_seqlens_q = is_varlen ? static_cast<const int32_t*>(varlen.cu_seqlens_q.data) : nullptr;
  r.cu_seqlens_k = is_varlen ? static_cast<const int32_t*>(varlen.cu_seqlens_k.data) : nullptr;
  r.scale = opt.softmax_scale > 0.0f ? opt.softmax_scale
                                     : static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
  r.scale_log2 = static_cast<float>(r.scale * kLog2eDouble);
  r.causal = opt.causal;
  r.window_left = opt.window_left;
  r.window_right = opt.causal ? 0 : opt.window_right;  // causal is the window (left, 0)
  r.softcap = opt.softcap;
  r.alibi_slopes = al.defined() ? static_cast<const float*>(al.data) : nullptr;
  r.alibi_batch_stride = alibi_batch_stride;
  r.dropout_p = opt.dropout_p;
  r.dropout_scale = 1.0f / (1.0f - opt.dropout_p);
  r.seed = opt.dropout_seed;
  r.offset = opt.dropout_offset;
  r.deterministic = opt.deterministic;
  *p = r;
  return {};
}

}  // namespace

Status make_forward_params(const TensorView& q, const TensorView& k, const TensorView& v,
                           const TensorView& o, const TensorView& lse, const AttentionOptions& opt,
                           const VarlenArgs& varlen, AttentionParams* p) {
  return fill_forward_params(q, k, v, o, lse, opt, varlen, Inputs::kFloat, p);
}

Status make_forward_params_fp8(const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& o, const TensorView& lse,
                               const AttentionOptions& opt, const VarlenArgs& varlen,
                               AttentionParams* p) {
  return fill_forward_params(q, k, v, o, lse, opt, varlen, Inputs::kFloat8, p);
}

Status make_backward_params(const TensorView& dout, const TensorView& q, const TensorView& k,
                            const TensorView& v, const TensorView& o, const TensorView& lse,
                            const TensorView& dq, const TensorView& dk, const TensorView& dv,
                            const AttentionOptions& options, const VarlenArgs& varlen,
                            AttentionParams* p) {
  AttentionParams r;
  FLARE_RETURN_IF_ERROR(make_forward_params(q, k, v, o, lse, options, varlen, &r));
  const bool is_varlen = varlen.defined();
  // dout is read, not written, so it may alias itself like any input.
  FLARE_RETURN_IF_ERROR(check_qkv_like(dout, "dout", q.ndim, q_layout(is_varlen)));
  FLARE_RETURN_IF_ERROR(check_same_shape(dout, "dout", q, "q"));
  FLARE_RETURN_IF_ERROR(check_same_dtype(dout, "dout", q));
  FLARE_RETURN_IF_ERROR(check_same_device(dout, "dout", q));
  FLARE_RETURN_IF_ERROR(check_output_like(dq, "dq", q, "q", q_layout(is_varlen), q));
  FLARE_RETURN_IF_ERROR(check_output_like(dk, "dk", k, "k", k_layout(is_varlen), q));
  FLARE_RETURN_IF_ERROR(check_output_like(dv, "dv", v, "v", k_layout(is_varlen), q));
  FLARE_RETURN_IF_ERROR(check_outputs_disjoint(
      {{&dq, "dq"}, {&dk, "dk"}, {&dv, "dv"}},
      {{&dout, "dout"}, {&q, "q"}, {&k, "k"}, {&v, "v"}, {&o, "o"}, {&lse, "lse"},
       {&options.alibi_slopes, "alibi_slopes"}, {&varlen.cu_seqlens_q, "cu_seqlens_q"},
       {&varlen.cu_seqlens_k, "cu_seqlens_k"}}));
  r.dout = dout.data;
  r.dq = dq.data;
  r.dk = dk.data;
  r.dv = dv.data;
  set_strides(dout, is_varlen, &r.do_batch_stride, &r.do_row_stride, &r.do_head_stride);
  set_strides(dq, is_varlen, &r.dq_batch_stride, &r.dq_row_stride, &r.dq_head_stride);
  set_strides(dk, is_varlen, &r.dk_batch_stride, &r.dk_row_stride, &r.dk_head_stride);
  set_strides(dv, is_varlen, &r.dv_batch_stride, &r.dv_row_stride, &r.dv_head_stride);
  *p = r;
  return {};
}

Status attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                         const TensorView& o, const TensorView& lse,
                         const AttentionOptions& options, const VarlenArgs& varlen, Stream stream) {
  AttentionParams p;
  FLARE_RETURN_IF_ERROR(make_forward_params(q, k, v, o, lse, options, varlen, &p));
  if (p.device == DeviceType::kCUDA) return cuda::forward(p, stream);
  if (options.backend == Backend::kReference) {
    cpu::store_forward(p, cpu::reference_forward(p, cpu::RefPrecision::kFloat64));
    return {};
  }
  return cpu::flash_forward(p);
}

Status attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                          const TensorView& v, const TensorView& o, const TensorView& lse,
                          const TensorView& dq, const TensorView& dk, const TensorView& dv,
                          const AttentionOptions& options, const VarlenArgs& varlen,
                          Stream stream) {
  AttentionParams p;
  FLARE_RETURN_IF_ERROR(
      make_backward_params(dout, q, k, v, o, lse, dq, dk, dv, options, varlen, &p));
  if (p.device == DeviceType::kCUDA) return cuda::backward(p, stream);
  if (options.backend == Backend::kReference) {
    cpu::store_backward(p, cpu::reference_backward(p, cpu::RefPrecision::kFloat64));
    return {};
  }
  return cpu::flash_backward(p);
}

const char* version() { return "0.1.0"; }

}  // namespace flare
