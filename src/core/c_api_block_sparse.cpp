// c_api_block_sparse.cpp — the extern "C" mirror of block_sparse.h: the C block mask to a
// BlockMask, the C++ entry points, and the same error guard as the rest of the C API
// (c_api_internal.h). The pattern helpers write into the caller's buffer instead of a vector.
#include <cstdint>
#include <cstring>
#include <vector>

#include "core/c_api_internal.h"
#include "core/message.h"
#include "flare/block_sparse.h"
#include "flare/c_api.h"

namespace {

using flare::Status;
using flare::c_api::to_view;

// A null mask argument is refused by name; the mask's own rules are block_sparse.cpp's.
Status mask_given(const flare_block_mask* mask) {
  if (mask == nullptr) return flare::invalid("mask: block mask arguments are required");
  return {};
}

flare::BlockMask to_block_mask(const flare_block_mask& m) {
  return flare::BlockMask{to_view(&m.mask), m.block_m, m.block_n};
}

// Runs a pattern helper and copies its mask into the caller's `capacity` bytes at `mask`. The
// helper's own rules (sizes, band, global, at most 2^31 blocks) come first, so a caller that
// cannot size its buffer (negative or huge sizes) still hears what is wrong with them.
template <typename MakePattern>
Status write_pattern(uint8_t* mask, int64_t capacity, MakePattern make) {
  if (capacity < 0) return flare::invalid("capacity: must be >= 0 bytes, got ", capacity);
  std::vector<uint8_t> m;
  FLARE_RETURN_IF_ERROR(make(&m));
  const int64_t blocks = static_cast<int64_t>(m.size());
  if (blocks > capacity)
    return flare::invalid("capacity: ", capacity, " bytes cannot hold the ", blocks,
                          " blocks of the mask");
  if (blocks > 0 && mask == nullptr)
    return flare::invalid("mask: output pointer is null with ", blocks, " blocks to write");
  if (blocks > 0) std::memcpy(mask, m.data(), m.size());
  return {};
}

}  // namespace

extern "C" {

int flare_block_sparse_attention_forward(const flare_tensor* q, const flare_tensor* k,
                                         const flare_tensor* v, const flare_tensor* o,
                                         const flare_tensor* lse, const flare_block_mask* mask,
                                         const flare_attention_options* options,
                                         const flare_varlen* varlen, void* stream) {
  return flare::c_api::guarded([&] {
    FLARE_RETURN_IF_ERROR(mask_given(mask));
    FLARE_RETURN_IF_ERROR(flare::c_api::rank_error(
        {{"q", q}, {"k", k}, {"v", v}, {"o", o}, {"lse", lse}, {"mask", &mask->mask}}, options,
        varlen));
    return flare::block_sparse_attention_forward(
        to_view(q), to_view(k), to_view(v), to_view(o), to_view(lse), to_block_mask(*mask),
        flare::c_api::to_options(options), flare::c_api::to_varlen(varlen), stream);
  });
}

int flare_block_sparse_attention_backward(const flare_tensor* dout, const flare_tensor* q,
                                          const flare_tensor* k, const flare_tensor* v,
                                          const flare_tensor* o, const flare_tensor* lse,
                                          const flare_tensor* dq, const flare_tensor* dk,
                                          const flare_tensor* dv, const flare_block_mask* mask,
                                          const flare_attention_options* options,
                                          const flare_varlen* varlen, void* stream) {
  return flare::c_api::guarded([&] {
    FLARE_RETURN_IF_ERROR(mask_given(mask));
    FLARE_RETURN_IF_ERROR(flare::c_api::rank_error(
        {{"dout", dout}, {"q", q}, {"k", k}, {"v", v}, {"o", o}, {"lse", lse}, {"dq", dq},
         {"dk", dk}, {"dv", dv}, {"mask", &mask->mask}},
        options, varlen));
    return flare::block_sparse_attention_backward(
        to_view(dout), to_view(q), to_view(k), to_view(v), to_view(o), to_view(lse), to_view(dq),
        to_view(dk), to_view(dv), to_block_mask(*mask), flare::c_api::to_options(options),
        flare::c_api::to_varlen(varlen), stream);
  });
}

int flare_local_global_block_mask(int64_t row_blocks, int64_t col_blocks, int64_t band,
                                  int64_t global, uint8_t* mask, int64_t capacity) {
  return flare::c_api::guarded([&] {
    return write_pattern(mask, capacity, [&](std::vector<uint8_t>* m) {
      return flare::local_global_block_mask(row_blocks, col_blocks, band, global, m);
    });
  });
}

int flare_butterfly_block_mask(int64_t row_blocks, int64_t col_blocks, uint8_t* mask,
                               int64_t capacity) {
  return flare::c_api::guarded([&] {
    return write_pattern(mask, capacity, [&](std::vector<uint8_t>* m) {
      return flare::butterfly_block_mask(row_blocks, col_blocks, m);
    });
  });
}

}  // extern "C"
