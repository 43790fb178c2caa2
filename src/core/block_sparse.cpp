// block_sparse.cpp — block-sparse attention's entry points: the dense validation of
// attention.cpp, then the block mask's own checks, then dispatch; plus the fixed patterns.
//
// As everywhere in core, validation is complete before anything is written: a rejected call
// leaves every output as it was. The mask is an input, so no output may share memory with it.
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

#include "core/backends.h"
#include "core/block_mask.h"
#include "core/block_sparse_backends.h"
#include "core/message.h"
#include "core/params.h"
#include "core/validate.h"
#include "flare/block_sparse.h"

namespace flare {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The mask against the validated dense params r (batch, heads, lengths, device); on success
// writes the mask fields of *r.
Status add_block_mask(const BlockMask& m, const TensorView& q, AttentionParams* r) {
  const TensorView& t = m.mask;
  if (!t.defined()) return invalid("mask: tensor is required for block-sparse attention");
  if (t.ndim != 4)
    return invalid("mask: expected 4 dimensions (batch or 1, heads_q or 1, row blocks, column "
                   "blocks), got ", t.ndim);
  FLARE_RETURN_IF_ERROR(check_tensor_view(t, "mask"));
  if (t.dtype != DType::kUInt8 && t.dtype != DType::kInt32)
    return invalid("mask: dtype must be uint8 or int32, got ", dtype_name(t.dtype));
  if (t.device != q.device || (t.device == DeviceType::kCUDA && t.device_index != q.device_index))
    return invalid("mask: must be on q's device");
  if (m.block_m < 1) return invalid("block_m: must be >= 1, got ", m.block_m);
  if (m.block_n < 1) return invalid("block_n: must be >= 1, got ", m.block_n);
  const int64_t rows = ceil_div(r->seqlen_q, m.block_m), cols = ceil_div(r->seqlen_k, m.block_n);
  const bool shape_ok = (t.shape[0] == 1 || t.shape[0] == r->batch) &&
                        (t.shape[1] == 1 || t.shape[1] == r->heads_q) && t.shape[2] == rows &&
                        t.shape[3] == cols;
  if (!shape_ok)
    return invalid("mask: shape (", t.shape[0], ", ", t.shape[1], ", ", t.shape[2], ", ",
                   t.shape[3], ") must be (batch = ", r->batch, " or 1, heads_q = ", r->heads_q,
                   " or 1, ceil(seqlen_q / block_m) = ceil(", r->seqlen_q, " / ", m.block_m,
                   ") = ", rows, ", ceil(seqlen_k / block_n) = ceil(", r->seqlen_k, " / ",
                   m.block_n, ") = ", cols, ")");
  r->block_mask = t.data;
  r->block_mask_int32 = t.dtype == DType::kInt32;
  r->block_m = m.block_m;
  r->block_n = m.block_n;
  r->block_rows = static_cast<int>(rows);
  r->block_cols = static_cast<int>(cols);
  // A dimension of extent 1 broadcasts: stride 0 whatever the caller wrote.
  r->mask_batch_stride = t.shape[0] == 1 ? 0 : t.stride[0];
  r->mask_head_stride = t.shape[1] == 1 ? 0 : t.stride[1];
  r->mask_row_stride = t.shape[2] == 1 ? 0 : t.stride[2];
  r->mask_col_stride = t.shape[3] == 1 ? 0 : t.stride[3];
  return {};
}

Status check_disjoint_from_mask(const BlockMask& m,
                                std::initializer_list<std::pair<const TensorView*, const char*>> outs) {
  for (const auto& [view, name] : outs)
    if (tensors_share_memory(*view, m.mask))
      return invalid(name, ": shares memory with the input mask; outputs must not overlap any input");
  return {};
}

// The CUDA kernels skip whole tiles, so a mask block must hold whole tiles of every kernel
// (core/block_mask.h); a finer mask is refused rather than rounded.
Status check_cuda_block_sizes(const AttentionParams& p) {
  if (p.block_m % kMaskTileMultiple != 0)
    return Status::unsupported(cat(
        "block_m: the CUDA kernels take mask blocks of a multiple of ", kMaskTileMultiple,
        " query rows (whole tiles), got ", p.block_m, "; use block_m = 128 or a multiple, or "
        "CPU tensors for finer masks"));
  if (p.block_n % kMaskTileMultiple != 0)
    return Status::unsupported(cat(
        "block_n: the CUDA kernels take mask blocks of a multiple of ", kMaskTileMultiple,
        " keys (whole tiles), got ", p.block_n, "; use block_n = 128 or a multiple, or CPU "
        "tensors for finer masks"));
  return {};
}

}  // namespace

Status make_block_sparse_forward_params(const TensorView& q, const TensorView& k,
                                        const TensorView& v, const TensorView& o,
                                        const TensorView& lse, const BlockMask& mask,
                                        const AttentionOptions& options, const VarlenArgs& varlen,
                                        AttentionParams* p) {
  AttentionParams r;
  FLARE_RETURN_IF_ERROR(make_forward_params(q, k, v, o, lse, options, varlen, &r));
  FLARE_RETURN_IF_ERROR(add_block_mask(mask, q, &r));
  FLARE_RETURN_IF_ERROR(check_disjoint_from_mask(mask, {{&o, "o"}, {&lse, "lse"}}));
  *p = r;
  return {};
}

Status make_block_sparse_backward_params(const TensorView& dout, const TensorView& q,
                                         const TensorView& k, const TensorView& v,
                                         const TensorView& o, const TensorView& lse,
                                         const TensorView& dq, const TensorView& dk,
                                         const TensorView& dv, const BlockMask& mask,
                                         const AttentionOptions& options,
                                         const VarlenArgs& varlen, AttentionParams* p) {
  AttentionParams r;
  FLARE_RETURN_IF_ERROR(
      make_backward_params(dout, q, k, v, o, lse, dq, dk, dv, options, varlen, &r));
  FLARE_RETURN_IF_ERROR(add_block_mask(mask, q, &r));
  FLARE_RETURN_IF_ERROR(check_disjoint_from_mask(mask, {{&dq, "dq"}, {&dk, "dk"}, {&dv, "dv"}}));
  *p = r;
  return {};
}

Status block_sparse_attention_forward(const TensorView& q, const TensorView& k,
                                      const TensorView& v, const TensorView& o,
                                      const TensorView& lse, const BlockMask& mask,
                                      const AttentionOptions& options, const VarlenArgs& varlen,
                                      Stream stream) {
  AttentionParams p;
  FLARE_RETURN_IF_ERROR(make_block_sparse_forward_params(q, k, v, o, lse, mask, options, varlen, &p));
  if (p.device == DeviceType::kCUDA) {
    FLARE_RETURN_IF_ERROR(check_cuda_block_sizes(p));
    return cuda::forward(p, stream);
  }
  if (options.backend == Backend::kReference) {
    cpu::store_forward(p, cpu::reference_forward(p, cpu::RefPrecision::kFloat64));
    return {};
  }
  return cpu::block_sparse_flash_forward(p);
}

Status block_sparse_attention_backward(const TensorView& dout, const TensorView& q,
                                       const TensorView& k, const TensorView& v,
                                       const TensorView& o, const TensorView& lse,
                                       const TensorView& dq, const TensorView& dk,
                                       const TensorView& dv, const BlockMask& mask,
                                       const AttentionOptions& options, const VarlenArgs& varlen,
                                       Stream stream) {
  AttentionParams p;
  FLARE_RETURN_IF_ERROR(make_block_sparse_backward_params(dout, q, k, v, o, lse, dq, dk, dv, mask,
                                                          options, varlen, &p));
  if (p.device == DeviceType::kCUDA) {
    FLARE_RETURN_IF_ERROR(check_cuda_block_sizes(p));
    return cuda::backward(p, stream);
  }
  if (options.backend == Backend::kReference) {
    cpu::store_backward(p, cpu::reference_backward(p, cpu::RefPrecision::kFloat64));
    return {};
  }
  return cpu::block_sparse_flash_backward(p);
}

// ---- fixed patterns -----------------------------------------------------------------------------

namespace {

// Shared argument checks of the pattern helpers; a mask of up to 2^31 blocks is plenty.
Status check_pattern_size(int64_t row_blocks, int64_t col_blocks, const std::vector<uint8_t>* mask) {
  if (mask == nullptr) return invalid("mask: output pointer is null");
  if (row_blocks < 0) return invalid("row_blocks: must be >= 0, got ", row_blocks);
  if (col_blocks < 0) return invalid("col_blocks: must be >= 0, got ", col_blocks);
  if (col_blocks > 0 && row_blocks > (int64_t{1} << 31) / col_blocks)
    return invalid("row_blocks × col_blocks = ", row_blocks, " × ", col_blocks,
                   " exceeds 2^31 blocks");
  return {};
}

}  // namespace

Status local_global_block_mask(int64_t row_blocks, int64_t col_blocks, int64_t band,
                               int64_t global, std::vector<uint8_t>* mask) {
  FLARE_RETURN_IF_ERROR(check_pattern_size(row_blocks, col_blocks, mask));
  if (band < 0) return invalid("band: must be >= 0 blocks, got ", band);
  if (global < 0) return invalid("global: must be >= 0 blocks, got ", global);
  const int64_t below = band / 2, above = band - below;  // c − r in [−below, above)
  std::vector<uint8_t> m(static_cast<size_t>(row_blocks * col_blocks), 0);
  for (int64_t r = 0; r < row_blocks; ++r)
    for (int64_t c = 0; c < col_blocks; ++c) {
      const bool local = c - r >= -below && c - r < above;
      m[r * col_blocks + c] = local || r < global || c < global;
    }
  *mask = std::move(m);
  return {};
}

Status butterfly_block_mask(int64_t row_blocks, int64_t col_blocks, std::vector<uint8_t>* mask) {
  FLARE_RETURN_IF_ERROR(check_pattern_size(row_blocks, col_blocks, mask));
  std::vector<uint8_t> m(static_cast<size_t>(row_blocks * col_blocks), 0);
  for (int64_t r = 0; r < row_blocks; ++r)
    for (int64_t c = 0; c < col_blocks; ++c) {
      const uint64_t x = static_cast<uint64_t>(r ^ c);
      m[r * col_blocks + c] = (x & (x - 1)) == 0;  // 0 or a power of two
    }
  *mask = std::move(m);
  return {};
}

}  // namespace flare
