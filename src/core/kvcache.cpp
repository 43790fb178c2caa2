// kvcache.cpp — attention_with_kvcache (flare/kvcache.h): validate, append, attend in place.
//
// Decoding is attention of q over each sequence's first n_i cache positions, so the CPU path
// reduces it to the varlen attention every backend already implements instead of repeating its
// mathematics: the new keys and values are written into the cache (rotated if asked), q is packed
// (rotated) into (b·s_q, h_q, d) rows with cu_seqlens, and the CPU reference or flash backend runs
// the packed call with each sequence's n_i keys read from the cache in place, through a key row
// locator (cpu/key_rows.h: cache row cache_batch_idx[i], or page block_table[i][j / block_size]).
// The backends load the same key rows into the same tiles whichever layout holds them, so a
// paged cache and a contiguous one give the same bits, and so does the packed copy of the cache
// this path made before (tests/test_cpu_kvcache_in_place.cpp keeps that copy as its reference).
// The bottom-right mask alignment of the varlen call is the right-aligned causal mask of decoding.
// Nothing cache-sized is allocated: a decoding step reads the cache once, at the memory's speed.
//
// Order of work: every argument is checked first — q, o, lse and the options by the same function
// that validates attention_forward, the cache arguments here, the packed call's params built — and
// only then is anything written (the cache append, then o and lse). CUDA tensors stop after the
// shape checks with kUnsupported: their integer tensors live on the device, and there are no
// decoding kernels yet.
#include "flare/kvcache.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "core/backends.h"
#include "core/message.h"
#include "core/numeric.h"
#include "core/params.h"
#include "core/validate.h"
#include "cpu/key_rows.h"

namespace flare {
namespace {

bool has_elements(const TensorView& t) {
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[i] == 0) return false;
  return t.ndim > 0;
}

// Presence, rank, the view itself and q's device (core/validate.h, the checks attention_forward
// applies): what any tensor argument needs before it is indexed.
Status check_tensor(const TensorView& t, const char* name, int ndim, const char* layout,
                    const TensorView& q) {
  FLARE_RETURN_IF_ERROR(check_tensor_rank(t, name, ndim, layout));
  FLARE_RETURN_IF_ERROR(check_tensor_view(t, name));
  return check_same_device_as_q(t, name, q);
}

// Cache-shaped tensors: q's dtype, unit head_dim stride.
Status check_kv(const TensorView& t, const char* name, const char* layout, const TensorView& q) {
  FLARE_RETURN_IF_ERROR(check_tensor(t, name, 4, layout, q));
  if (t.dtype != q.dtype)
    return invalid(name, ": dtype ", dtype_name(t.dtype), " differs from q's dtype ",
                   dtype_name(q.dtype));
  if (has_elements(t) && t.shape[3] > 1 && t.stride[3] != 1)
    return invalid(name, ": last (head_dim) stride must be 1, got ", t.stride[3]);
  return {};
}

Status check_int32(const TensorView& t, const char* name, int ndim, const char* layout,
                   const TensorView& q) {
  FLARE_RETURN_IF_ERROR(check_tensor(t, name, ndim, layout, q));
  if (t.dtype != DType::kInt32) return invalid(name, ": dtype must be int32, got ", dtype_name(t.dtype));
  return {};
}

struct Named {
  const TensorView* view;
  const char* name;
};

// A tensor flare writes (an output, or a cache it appends to) may share no byte with another
// argument (core/validate.h's test: exact for views of one lattice, else conservative).
Status check_written_disjoint(const Named& out, std::initializer_list<Named> others) {
  for (const Named& in : others)
    if (in.view != out.view && tensors_share_memory(*out.view, *in.view))
      return invalid(out.name, ": shares memory with ", in.name,
                     "; a tensor flare writes must not overlap any other argument");
  return {};
}

int32_t int_at(const TensorView& t, int64_t i) {
  return static_cast<const int32_t*>(t.data)[i * t.stride[0]];
}
int32_t int_at(const TensorView& t, int64_t i, int64_t j) {
  return static_cast<const int32_t*>(t.data)[i * t.stride[0] + j * t.stride[1]];
}

// Everything the execution needs, filled by validate().
struct Plan {
  int64_t batch = 0, seqlen_q = 0, heads_q = 0, heads_kv = 0, head_dim = 0, seqlen_new = 0;
  bool paged = false;
  int64_t block_size = 0;  // paged only
  int64_t capacity = 0;    // positions a sequence can hold
  bool rotary = false;
  int64_t rotary_half = 0;  // d_rot / 2
  bool rotate_q_per_row = false;
  std::vector<int64_t> len_before;  // per sequence (CPU only)
  std::vector<int64_t> cache_row;   // contiguous cache: the cache batch row of each sequence
};

// Shapes and dtypes of the cache arguments; needs q's shape checked.
Status validate_shapes(const TensorView& q, const KVCacheArgs& c, const AttentionOptions& opt,
                       Plan* plan) {
  const int64_t b = q.shape[0], hq = q.shape[2], d = q.shape[3];
  plan->batch = b;
  plan->seqlen_q = q.shape[1];
  plan->heads_q = hq;
  plan->head_dim = d;
  plan->paged = c.block_table.defined();
  const char* cache_layout = plan->paged ? "(num_blocks, block_size, heads_kv, head_dim)"
                                         : "(batch_cache, seqlen_cache, heads_kv, head_dim)";
  FLARE_RETURN_IF_ERROR(check_kv(c.k_cache, "k_cache", cache_layout, q));
  FLARE_RETURN_IF_ERROR(check_kv(c.v_cache, "v_cache", cache_layout, q));
  const TensorView& kc = c.k_cache;
  for (int i = 0; i < 4; ++i)
    if (c.v_cache.shape[i] != kc.shape[i])
      return invalid("v_cache: shape[", i, "] = ", c.v_cache.shape[i], " must equal k_cache's ",
                     kc.shape[i]);
  const int64_t hkv = kc.shape[2];
  plan->heads_kv = hkv;
  if (kc.shape[3] != d)
    return invalid("k_cache: head_dim = ", kc.shape[3], " must equal q's head_dim = ", d);
  if (hkv == 0 || hq % hkv != 0)
    return invalid("k_cache: heads = ", hkv, " must divide q's heads = ", hq, " (GQA/MQA)");

  if (plan->paged) {
    FLARE_RETURN_IF_ERROR(check_int32(c.block_table, "block_table", 2,
                                      "(batch, max_blocks_per_sequence)", q));
    if (c.block_table.shape[0] != b)
      return invalid("block_table: batch = ", c.block_table.shape[0], " must equal q's batch = ", b);
    if (c.cache_batch_idx.defined())
      return invalid("cache_batch_idx: not supported with a paged cache (block_table already maps "
                     "each sequence to its blocks)");
    plan->block_size = kc.shape[1];
    if (plan->block_size < 1)
      return invalid("k_cache: block_size (shape[1]) = ", plan->block_size, " must be >= 1");
    plan->capacity = c.block_table.shape[1] * plan->block_size;
  } else {
    plan->capacity = kc.shape[1];
    if (c.cache_batch_idx.defined()) {
      FLARE_RETURN_IF_ERROR(check_int32(c.cache_batch_idx, "cache_batch_idx", 1, "(batch)", q));
      if (c.cache_batch_idx.shape[0] != b)
        return invalid("cache_batch_idx: length ", c.cache_batch_idx.shape[0],
                       " must equal q's batch = ", b);
    } else if (kc.shape[0] < b) {
      return invalid("k_cache: batch_cache = ", kc.shape[0], " must be >= q's batch = ", b,
                     " (or pass cache_batch_idx)");
    }
  }

  if (c.cache_seqlens.defined()) {
    FLARE_RETURN_IF_ERROR(check_int32(c.cache_seqlens, "cache_seqlens", 1, "(batch)", q));
    if (c.cache_seqlens.shape[0] != b)
      return invalid("cache_seqlens: length ", c.cache_seqlens.shape[0],
                     " must equal q's batch = ", b);
  } else if (c.cache_seqlen < 0) {
    return invalid("cache_seqlen: must be >= 0, got ", c.cache_seqlen);
  }

  if (c.k_new.defined() != c.v_new.defined())
    return invalid(c.k_new.defined() ? "v_new" : "k_new", ": k_new and v_new come together");
  if (c.k_new.defined()) {
    const char* layout = "(batch, seqlen_new, heads_kv, head_dim)";
    FLARE_RETURN_IF_ERROR(check_kv(c.k_new, "k_new", layout, q));
    FLARE_RETURN_IF_ERROR(check_kv(c.v_new, "v_new", layout, q));
    const int64_t want[4] = {b, c.k_new.shape[1], hkv, d};
    for (const Named& t : {Named{&c.k_new, "k_new"}, Named{&c.v_new, "v_new"}})
      for (int i = 0; i < 4; ++i)
        if (t.view->shape[i] != want[i])
          return invalid(t.name, ": shape[", i, "] = ", t.view->shape[i], " must be ", want[i],
                         " (batch and heads_kv of q and the cache, seqlen_new of k_new)");
    plan->seqlen_new = c.k_new.shape[1];
  }

  if (c.rotary_cos.defined() != c.rotary_sin.defined())
    return invalid(c.rotary_cos.defined() ? "rotary_sin" : "rotary_cos",
                   ": rotary_cos and rotary_sin come together");
  if (c.rotary_cos.defined()) {
    if (!c.k_new.defined())
      return invalid("rotary_cos: needs k_new and v_new (the rotary embedding rotates the new keys "
                     "and q at their positions)");
    for (const Named& t : {Named{&c.rotary_cos, "rotary_cos"}, Named{&c.rotary_sin, "rotary_sin"}}) {
      FLARE_RETURN_IF_ERROR(check_tensor(*t.view, t.name, 2, "(seqlen_rotary, rotary_dim / 2)", q));
      if (t.view->dtype != DType::kFloat32 && t.view->dtype != q.dtype)
        return invalid(t.name, ": dtype ", dtype_name(t.view->dtype), " must be float32 or q's ",
                       dtype_name(q.dtype));
      if (t.view->shape[0] != c.rotary_cos.shape[0] || t.view->shape[1] != c.rotary_cos.shape[1])
        return invalid("rotary_sin: shape must equal rotary_cos's");
    }
    plan->rotary = true;
    plan->rotary_half = c.rotary_cos.shape[1];
    if (plan->rotary_half < 1 || 2 * plan->rotary_half > d)
      return invalid("rotary_cos: rotary_dim = 2 * shape[1] = ", 2 * plan->rotary_half,
                     " must be in [2, head_dim = ", d, "]");
    plan->rotate_q_per_row = opt.causal || opt.window_left >= 0 || opt.window_right >= 0;
  }
  if (c.num_splits < 0) return invalid("num_splits: must be >= 0 (0 = automatic), got ", c.num_splits);
  if (opt.dropout_p != 0.0f)
    return invalid("dropout_p: must be 0; decoding with a KV cache has no dropout");
  return {};
}

// The integer arguments' values (CPU): lengths within capacity, indices within range, rotary long
// enough, no sequence appending to a cache row or block another sequence uses.
Status validate_values(const KVCacheArgs& c, Plan* plan) {
  const int64_t b = plan->batch;
  plan->len_before.resize(static_cast<size_t>(b));
  for (int64_t i = 0; i < b; ++i) {
    const int64_t len = c.cache_seqlens.defined() ? int_at(c.cache_seqlens, i) : c.cache_seqlen;
    const char* name = c.cache_seqlens.defined() ? "cache_seqlens" : "cache_seqlen";
    if (len < 0) return invalid(name, "[", i, "] = ", len, " is negative");
    if (len + plan->seqlen_new > plan->capacity)
      return invalid(name, "[", i, "] = ", len, " plus seqlen_new = ", plan->seqlen_new,
                     " exceeds the cache capacity ", plan->capacity,
                     plan->paged ? " (max_blocks * block_size)" : " (seqlen_cache)");
    plan->len_before[static_cast<size_t>(i)] = len;
  }
  const bool appends = plan->seqlen_new > 0;
  if (plan->paged) {
    const int64_t num_blocks = c.k_cache.shape[0], bs = plan->block_size;
    std::vector<int64_t> writer(static_cast<size_t>(num_blocks), -1);
    for (int64_t i = 0; i < b; ++i) {
      const int64_t n = plan->len_before[static_cast<size_t>(i)] + plan->seqlen_new;
      for (int64_t lb = 0; lb < (n + bs - 1) / bs; ++lb) {
        const int32_t blk = int_at(c.block_table, i, lb);
        if (blk < 0 || blk >= num_blocks)
          return invalid("block_table[", i, ", ", lb, "] = ", blk, " is outside [0, num_blocks = ",
                         num_blocks, ") but sequence ", i, " uses it (", n, " tokens)");
      }
      if (!appends) continue;
      for (int64_t lb = plan->len_before[static_cast<size_t>(i)] / bs; lb < (n + bs - 1) / bs; ++lb)
        writer[static_cast<size_t>(int_at(c.block_table, i, lb))] = i;
    }
    for (int64_t i = 0; appends && i < b; ++i) {
      const int64_t n = plan->len_before[static_cast<size_t>(i)] + plan->seqlen_new;
      for (int64_t lb = 0; lb < (n + bs - 1) / bs; ++lb) {
        const int32_t blk = int_at(c.block_table, i, lb);
        const int64_t w = writer[static_cast<size_t>(blk)];
        if (w >= 0 && w != i)
          return invalid("block_table: block ", blk, " is appended to by sequence ", w,
                         " and used by sequence ", i, "; an appended block must be private");
      }
    }
  } else {
    const int64_t b_cache = c.k_cache.shape[0];
    plan->cache_row.resize(static_cast<size_t>(b));
    for (int64_t i = 0; i < b; ++i) {
      const int64_t row = c.cache_batch_idx.defined() ? int_at(c.cache_batch_idx, i) : i;
      if (row < 0 || row >= b_cache)
        return invalid("cache_batch_idx[", i, "] = ", row, " is outside [0, batch_cache = ",
                       b_cache, ")");
      plan->cache_row[static_cast<size_t>(i)] = row;
    }
    for (int64_t i = 0; appends && i < b; ++i)
      for (int64_t j = 0; j < i; ++j)
        if (plan->cache_row[static_cast<size_t>(i)] == plan->cache_row[static_cast<size_t>(j)])
          return invalid("cache_batch_idx: sequences ", j, " and ", i, " share cache row ",
                         plan->cache_row[static_cast<size_t>(i)],
                         " and k_new appends to it; an appended row must be private");
  }
  if (plan->rotary) {
    const int64_t s_rot = c.rotary_cos.shape[0];
    const int64_t q_span = plan->rotate_q_per_row ? plan->seqlen_q : std::min<int64_t>(plan->seqlen_q, 1);
    for (int64_t i = 0; i < b; ++i) {
      const int64_t need = plan->len_before[static_cast<size_t>(i)] + std::max(plan->seqlen_new, q_span);
      if (need > s_rot)
        return invalid("rotary_cos: seqlen_rotary = ", s_rot, " is too short: sequence ", i,
                       " rotates positions up to ", need - 1);
    }
  }
  return {};
}

// CUDA tensors: cache_seqlens, block_table and cache_batch_idx stay on the device (reading them
// would synchronise), so the kernels check their values (cuda/decode/decode_params.h). One length
// for every sequence is a host value: it is checked here like the CPU path's.
Status validate_scalar_length(const KVCacheArgs& c, Plan* plan) {
  if (c.cache_seqlens.defined()) return {};
  if (c.cache_seqlen + plan->seqlen_new > plan->capacity)
    return invalid("cache_seqlen = ", c.cache_seqlen, " plus seqlen_new = ", plan->seqlen_new,
                   " exceeds the cache capacity ", plan->capacity,
                   plan->paged ? " (max_blocks * block_size)" : " (seqlen_cache)");
  if (plan->rotary) {
    const int64_t q_span = plan->rotate_q_per_row ? plan->seqlen_q : std::min<int64_t>(plan->seqlen_q, 1);
    const int64_t need = c.cache_seqlen + std::max(plan->seqlen_new, q_span);
    if (need > c.rotary_cos.shape[0])
      return invalid("rotary_cos: seqlen_rotary = ", c.rotary_cos.shape[0],
                     " is too short: the sequences rotate positions up to ", need - 1);
  }
  return {};
}

bool aligned16(const TensorView& t) {
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return false;
  for (int i = 0; i < t.ndim - 1; ++i)
    if (t.stride[i] % 8 != 0) return false;
  return true;
}

// The CUDA kernels' view of a validated call.
cuda::DecodeParams decode_params(const TensorView& q, const KVCacheArgs& c, const TensorView& o,
                                 const TensorView& lse, const AttentionParams& scores,
                                 const Plan& plan) {
  cuda::DecodeParams p;
  p.dtype = q.dtype;
  p.batch = static_cast<int>(plan.batch);
  p.seqlen_q = static_cast<int>(plan.seqlen_q);
  p.heads_q = static_cast<int>(plan.heads_q);
  p.heads_kv = static_cast<int>(plan.heads_kv);
  p.head_dim = static_cast<int>(plan.head_dim);
  p.group = p.heads_q / p.heads_kv;
  p.q = q.data;
  p.q_batch_stride = q.stride[0], p.q_row_stride = q.stride[1], p.q_head_stride = q.stride[2];
  p.o = o.data;
  p.o_batch_stride = o.stride[0], p.o_row_stride = o.stride[1], p.o_head_stride = o.stride[2];
  p.lse = lse.defined() ? static_cast<float*>(lse.data) : nullptr;
  p.k_cache = c.k_cache.data;
  p.v_cache = c.v_cache.data;
  for (int i = 0; i < 3; ++i) {
    p.k_stride[i] = c.k_cache.stride[i];
    p.v_stride[i] = c.v_cache.stride[i];
  }
  if (plan.paged) {
    p.block_table = static_cast<const int32_t*>(c.block_table.data);
    p.block_table_stride[0] = c.block_table.stride[0];
    p.block_table_stride[1] = c.block_table.stride[1];
    p.block_size = static_cast<int>(plan.block_size);
    p.num_blocks = static_cast<int>(c.k_cache.shape[0]);
  } else if (c.cache_batch_idx.defined()) {
    p.cache_batch_idx = static_cast<const int32_t*>(c.cache_batch_idx.data);
    p.cache_batch_idx_stride = c.cache_batch_idx.stride[0];
  }
  p.batch_cache = static_cast<int>(c.k_cache.shape[0]);
  if (c.cache_seqlens.defined()) {
    p.cache_seqlens = static_cast<const int32_t*>(c.cache_seqlens.data);
    p.cache_seqlens_stride = c.cache_seqlens.stride[0];
  }
  p.cache_seqlen = c.cache_seqlen;
  p.capacity = plan.capacity;
  if (plan.seqlen_new > 0) {
    p.k_new = c.k_new.data;
    p.v_new = c.v_new.data;
    for (int i = 0; i < 3; ++i) {
      p.k_new_stride[i] = c.k_new.stride[i];
      p.v_new_stride[i] = c.v_new.stride[i];
    }
    p.seqlen_new = static_cast<int>(plan.seqlen_new);
  }
  if (plan.rotary) {
    p.rotary_cos = c.rotary_cos.data;
    p.rotary_sin = c.rotary_sin.data;
    for (int i = 0; i < 2; ++i) {
      p.cos_stride[i] = c.rotary_cos.stride[i];
      p.sin_stride[i] = c.rotary_sin.stride[i];
    }
    p.rotary_fp32 = c.rotary_cos.dtype == DType::kFloat32;
    p.rotary_interleaved = c.rotary_interleaved;
    p.rotate_q_per_row = plan.rotate_q_per_row;
    p.rotary_half = static_cast<int>(plan.rotary_half);
    p.seqlen_rotary = c.rotary_cos.shape[0];
  }
  p.scale = scores.scale;
  p.softcap = scores.softcap;
  p.softcap_inverse = scores.softcap > 0.0f ? 1.0f / scores.softcap : 0.0f;
  p.alibi_slopes = scores.alibi_slopes;
  p.alibi_batch_stride = scores.alibi_batch_stride;
  p.window_left = scores.window_left;
  p.window_right = scores.window_right;
  p.aligned16 = plan.head_dim % 8 == 0 && aligned16(c.k_cache) && aligned16(c.v_cache);
  p.num_splits = c.num_splits;
  return p;
}

// Element offset of (token t, kv head h, 0) of sequence i in a cache view.
int64_t cache_offset(const TensorView& cache, const KVCacheArgs& c, const Plan& plan, int64_t i,
                     int64_t t, int64_t h) {
  if (plan.paged) {
    const int64_t blk = int_at(c.block_table, i, t / plan.block_size);
    return blk * cache.stride[0] + (t % plan.block_size) * cache.stride[1] + h * cache.stride[2];
  }
  return plan.cache_row[static_cast<size_t>(i)] * cache.stride[0] + t * cache.stride[1] +
         h * cache.stride[2];
}

// Copies one head vector of d elements, rotating its first 2·half elements at `pos` when rotary
// tables are given (fp32 arithmetic, one rounding to the dtype).
void copy_head(const void* src, int64_t src_off, void* dst, int64_t dst_off, DType dt, int64_t d,
               const KVCacheArgs* rot, int64_t half, int64_t pos) {
  if (rot == nullptr) {
    const size_t es = dtype_size(dt);
    std::memcpy(static_cast<char*>(dst) + dst_off * static_cast<int64_t>(es),
                static_cast<const char*>(src) + src_off * static_cast<int64_t>(es),
                static_cast<size_t>(d) * es);
    return;
  }
  const TensorView &cs = rot->rotary_cos, &sn = rot->rotary_sin;
  for (int64_t m = 0; m < half; ++m) {
    const float co = load_as_float(cs.data, pos * cs.stride[0] + m * cs.stride[1], cs.dtype);
    const float si = load_as_float(sn.data, pos * sn.stride[0] + m * sn.stride[1], sn.dtype);
    const int64_t e0 = rot->rotary_interleaved ? 2 * m : m;
    const int64_t e1 = rot->rotary_interleaved ? 2 * m + 1 : m + half;
    const float x0 = load_as_float(src, src_off + e0, dt), x1 = load_as_float(src, src_off + e1, dt);
    store_from_float(dst, dst_off + e0, dt, x0 * co - x1 * si);
    store_from_float(dst, dst_off + e1, dt, x0 * si + x1 * co);
  }
  for (int64_t e = 2 * half; e < d; ++e)
    store_from_float(dst, dst_off + e, dt, load_as_float(src, src_off + e, dt));
}

// The K (or V) argument of the packed call: the cache's kv heads of its first row, repeated for
// every packed key (row stride 0). It carries the pointer, dtype, head stride and total_k to the
// params; where each key's row lies is the KeyRows' business (cache_keys), so the view spans no
// memory outside the cache.
TensorView packed_stand_in(const TensorView& cache, int64_t total_k) {
  return TensorView::strided(cache.data, cache.dtype, {total_k, cache.shape[2], cache.shape[3]},
                             {0, cache.stride[2], 1}, cache.device, cache.device_index);
}

// Where the backends find key t of sequence i (cpu/key_rows.h): a contiguous cache is one page
// per sequence, its cache row (`rows` holds them as int32); a paged cache's pages are the blocks
// of its block table.
cpu::KeyRows cache_keys(const KVCacheArgs& c, const Plan& plan, std::vector<int32_t>* rows) {
  cpu::KeyRows keys;
  keys.k_page_stride = c.k_cache.stride[0];
  keys.v_page_stride = c.v_cache.stride[0];
  keys.k_row_stride = c.k_cache.stride[1];
  keys.v_row_stride = c.v_cache.stride[1];
  if (plan.paged) {
    keys.pages = static_cast<const int32_t*>(c.block_table.data);
    keys.pages_seq_stride = c.block_table.stride[0];
    keys.pages_stride = c.block_table.stride[1];
    keys.page_size = plan.block_size;
  } else {
    rows->assign(plan.cache_row.begin(), plan.cache_row.end());  // validated: < batch_cache
    keys.pages = rows->data();
    keys.pages_seq_stride = 1;
    keys.page_size = std::max<int64_t>(plan.capacity, 1);  // every used position is on page 0
  }
  return keys;
}

}  // namespace

Status attention_with_kvcache(const TensorView& q, const KVCacheArgs& c, const TensorView& o,
                              const TensorView& lse, const AttentionOptions& options,
                              Stream stream) {
  // q, o, lse and the options: attention_forward's own checks, with q standing in for k and v.
  FLARE_RETURN_IF_ERROR(check_tensor_rank(q, "q", 4, "(batch, seqlen_q, heads_q, head_dim)"));
  if (options.dropout_p != 0.0f)
    return invalid("dropout_p: must be 0; decoding with a KV cache has no dropout");
  // The packed lse is allocated before the rest of q is checked (it stands in for an lse the
  // caller left out), so its size is bounded first: no overflow, no absurd allocation.
  constexpr int64_t kMaxLseElements = int64_t{1} << 40;
  int64_t lse_elements = 1;
  for (int i = 0; i < 3; ++i) {
    if (q.shape[i] < 0) return invalid("q: shape[", i, "] = ", q.shape[i], " is negative");
    if (q.shape[i] > 0 && lse_elements > kMaxLseElements / q.shape[i])
      return invalid("q: batch * heads_q * seqlen_q exceeds ", kMaxLseElements, " rows");
    lse_elements *= q.shape[i];
  }
  const int64_t b = q.shape[0], sq = q.shape[1], hq = q.shape[2];
  std::vector<float> lse_packed(static_cast<size_t>(b * hq * sq));  // (h_q, b·s_q)
  const TensorView lse_check =
      lse.defined() ? lse : TensorView::contiguous(lse_packed.data(), DType::kFloat32, {b, hq, sq}, q.device, q.device_index);
  AttentionParams scores;  // the score modifiers, as attention_forward reads them
  FLARE_RETURN_IF_ERROR(make_forward_params(q, q, q, o, lse_check, options, {}, &scores));

  Plan plan;
  FLARE_RETURN_IF_ERROR(validate_shapes(q, c, options, &plan));
  const bool appends = plan.seqlen_new > 0;
  const TensorView none;
  const TensorView& kc_written = appends ? c.k_cache : none;
  const TensorView& vc_written = appends ? c.v_cache : none;
  const std::initializer_list<Named> args = {
      {&q, "q"},           {&c.k_cache, "k_cache"},         {&c.v_cache, "v_cache"},
      {&c.k_new, "k_new"}, {&c.v_new, "v_new"},             {&c.block_table, "block_table"},
      {&c.cache_seqlens, "cache_seqlens"},                  {&c.cache_batch_idx, "cache_batch_idx"},
      {&c.rotary_cos, "rotary_cos"}, {&c.rotary_sin, "rotary_sin"},
      {&options.alibi_slopes, "alibi_slopes"}, {&o, "o"},   {&lse, "lse"}};
  FLARE_RETURN_IF_ERROR(check_written_disjoint({&o, "o"}, args));
  FLARE_RETURN_IF_ERROR(check_written_disjoint({&lse, "lse"}, args));
  FLARE_RETURN_IF_ERROR(check_written_disjoint({&kc_written, "k_cache"}, args));
  FLARE_RETURN_IF_ERROR(check_written_disjoint({&vc_written, "v_cache"}, args));
  if (q.device == DeviceType::kCUDA) {
    FLARE_RETURN_IF_ERROR(validate_scalar_length(c, &plan));
    return cuda::kvcache_forward(decode_params(q, c, o, lse, scores, plan), q.device_index, stream);
  }
  FLARE_RETURN_IF_ERROR(validate_values(c, &plan));

  // The packed varlen problem the backends solve: q rows b·s_q + j, sequence i's n_i keys counted
  // by cu_k (their rows are found in the cache, not at cu_k's offsets).
  const int64_t hkv = plan.heads_kv, d = plan.head_dim, total_q = b * sq;
  const DType dt = q.dtype;
  const size_t es = dtype_size(dt);
  std::vector<int32_t> cu_q(static_cast<size_t>(b + 1)), cu_k(static_cast<size_t>(b + 1));
  int64_t max_k = 0;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t n = plan.len_before[static_cast<size_t>(i)] + plan.seqlen_new;
    cu_q[static_cast<size_t>(i + 1)] = static_cast<int32_t>((i + 1) * sq);
    cu_k[static_cast<size_t>(i + 1)] = static_cast<int32_t>(cu_k[static_cast<size_t>(i)] + n);
    max_k = std::max(max_k, n);
    if (cu_k[static_cast<size_t>(i)] + n > INT32_MAX)
      return invalid("cache_seqlens: the sequences' lengths add up beyond int32 (", i,
                     " sequences so far)");
  }
  const int64_t total_k = cu_k[static_cast<size_t>(b)];
  // Packed q and o, every byte written below before it is read: left uninitialised.
  const size_t q_bytes = static_cast<size_t>(total_q * hq * d) * es;
  const auto qp = std::make_unique_for_overwrite<unsigned char[]>(q_bytes);
  const auto op = std::make_unique_for_overwrite<unsigned char[]>(q_bytes);
  VarlenArgs varlen;
  varlen.cu_seqlens_q = TensorView::contiguous(cu_q.data(), DType::kInt32, {b + 1});
  varlen.cu_seqlens_k = TensorView::contiguous(cu_k.data(), DType::kInt32, {b + 1});
  varlen.max_seqlen_q = static_cast<int>(sq);
  varlen.max_seqlen_k = static_cast<int>(max_k);
  AttentionParams p;
  FLARE_RETURN_IF_ERROR(make_forward_params(
      TensorView::contiguous(qp.get(), dt, {total_q, hq, d}), packed_stand_in(c.k_cache, total_k),
      packed_stand_in(c.v_cache, total_k),
      TensorView::contiguous(op.get(), dt, {total_q, hq, d}),
      TensorView::contiguous(lse_packed.data(), DType::kFloat32, {hq, total_q}), options, varlen,
      &p));
  std::vector<int32_t> cache_rows;
  const cpu::KeyRows keys = cache_keys(c, plan, &cache_rows);

  const char* simd_level = nullptr;  // the flash backend's only failure, checked while it is cheap
  if (options.backend != Backend::kReference)
    FLARE_RETURN_IF_ERROR(cpu::flash_simd_level(&simd_level));

  // Nothing has been written so far. Append the new keys (rotated) and values to the cache.
  const KVCacheArgs* rot = plan.rotary ? &c : nullptr;
  for (int64_t i = 0; i < b; ++i)
    for (int64_t j = 0; j < plan.seqlen_new; ++j) {
      const int64_t pos = plan.len_before[static_cast<size_t>(i)] + j;
      for (int64_t h = 0; h < hkv; ++h) {
        const int64_t kn = i * c.k_new.stride[0] + j * c.k_new.stride[1] + h * c.k_new.stride[2];
        const int64_t vn = i * c.v_new.stride[0] + j * c.v_new.stride[1] + h * c.v_new.stride[2];
        copy_head(c.k_new.data, kn, c.k_cache.data, cache_offset(c.k_cache, c, plan, i, pos, h),
                  dt, d, rot, plan.rotary_half, pos);
        copy_head(c.v_new.data, vn, c.v_cache.data, cache_offset(c.v_cache, c, plan, i, pos, h),
                  dt, d, nullptr, 0, 0);
      }
    }
  // Pack q, rotated at its positions; the keys stay where they are.
  for (int64_t i = 0; i < b; ++i)
    for (int64_t j = 0; j < sq; ++j) {
      const int64_t pos = plan.len_before[static_cast<size_t>(i)] + (plan.rotate_q_per_row ? j : 0);
      for (int64_t h = 0; h < hq; ++h)
        copy_head(q.data, i * q.stride[0] + j * q.stride[1] + h * q.stride[2], qp.get(),
                  ((i * sq + j) * hq + h) * d, dt, d, rot, plan.rotary_half, pos);
    }

  if (options.backend == Backend::kReference) {
    cpu::store_forward(p, cpu::reference_forward(p, keys, cpu::RefPrecision::kFloat64));
  } else {
    FLARE_RETURN_IF_ERROR(cpu::flash_forward(p, keys));
  }

  // Scatter the packed results into the caller's o (any strides) and lse (b, h_q, s_q).
  for (int64_t i = 0; i < b; ++i)
    for (int64_t j = 0; j < sq; ++j)
      for (int64_t h = 0; h < hq; ++h) {
        copy_head(op.get(), ((i * sq + j) * hq + h) * d, o.data,
                  i * o.stride[0] + j * o.stride[1] + h * o.stride[2], dt, d, nullptr, 0, 0);
        if (lse.defined())
          static_cast<float*>(lse.data)[(i * hq + h) * sq + j] =
              lse_packed[static_cast<size_t>(h * total_q + i * sq + j)];
      }
  return {};
}

}  // namespace flare
