// tensor_map.h — host helpers of the sm90 kernels: TMA tensor maps of flare's (b, s, h, d) tensors.
// (Whether the device runs a kernel's sm_90a code is asked in cuda/device_probe.h.)
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <string>

#include "core/params.h"
#include "flare/status.h"

namespace flare::cuda::sm90 {

// cuTensorMapEncodeTiled from the driver, looked up once through the runtime (no libcuda link).
inline PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = []() -> PFN_cuTensorMapEncodeTiled_v12000 {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      return nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

namespace tensor_map_detail {

// Everything a map below is encoded from (the flags are each function's constants): equal keys
// give equal maps. The dQ accumulator's map is the only fp32 one, so the two functions' keys
// never meet.
struct MapKey {
  const void* ptr = nullptr;
  DType dtype = DType::kFloat32;
  int64_t extents[4] = {};  // the map's dimensions, innermost first (0 past its rank)
  int64_t strides[3] = {};  // in elements
  int box_rows = 0;
  bool operator==(const MapKey&) const = default;
};

// The last kEntries maps this thread encoded. A training loop calls with the same shapes, and the
// caching allocator hands it the same addresses step after step, so most of a call's three to
// seven encodes (each a driver call on the host) become a comparison and a 128-byte copy.
// One per thread: no lock on the call's path.
struct MapCache {
  static constexpr int kEntries = 16;
  MapKey keys[kEntries];
  CUtensorMap maps[kEntries];
  int filled = 0, next = 0;

  const CUtensorMap* find(const MapKey& key) const {
    for (int i = 0; i < filled; ++i)
      if (keys[i] == key) return &maps[i];
    return nullptr;
  }
  void add(const MapKey& key, const CUtensorMap& map) {
    keys[next] = key;
    maps[next] = map;
    next = (next + 1) % kEntries;
    if (filled < kEntries) ++filled;
  }
};

inline MapCache& map_cache() {
  thread_local MapCache cache;
  return cache;
}

// *map for `key`, from the cache or from `encode` (which returns the driver's result), cached
// when it succeeds.
template <typename Encode>
CUresult cached_encode(CUtensorMap* map, const MapKey& key, Encode encode) {
  MapCache& cache = map_cache();
  if (const CUtensorMap* hit = cache.find(key)) {
    *map = *hit;
    return CUDA_SUCCESS;
  }
  const CUresult r = encode();
  if (r == CUDA_SUCCESS) cache.add(key, *map);
  return r;
}

}  // namespace tensor_map_detail

// A 4-D map (head_dim, rows, heads, batch) of a (b, s, h, d) tensor with a (64, box_rows, 1, 1)
// box in the 128-byte swizzle. A zero stride (extent 1) is replaced: the coordinate is always 0.
inline Status encode_map(CUtensorMap* map, DType dtype, const void* ptr, int head_dim, int rows,
                         int heads, int batch, int64_t row_stride, int64_t head_stride,
                         int64_t batch_stride, int box_rows, const char* name) {
  const auto fn = encode_tiled();
  if (fn == nullptr) return Status::device_error("sm90: cuTensorMapEncodeTiled not found in the driver");
  const auto bytes = [](int64_t s) { return static_cast<cuuint64_t>(s == 0 ? 8 : s) * 2; };
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {bytes(row_stride), bytes(head_stride), bytes(batch_stride)};
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  const tensor_map_detail::MapKey key{ptr,
                                      dtype,
                                      {head_dim, rows, heads, batch},
                                      {row_stride, head_stride, batch_stride},
                                      box_rows};
  const CUresult r = tensor_map_detail::cached_encode(map, key, [&] {
    return fn(map,
              dtype == DType::kFloat16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                       : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
              4, const_cast<void*>(ptr), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  });
  if (r != CUDA_SUCCESS)
    return Status::device_error(std::string("sm90: tensor map of ") + name +
                                ": cuTensorMapEncodeTiled error " + std::to_string(r));
  return {};
}

// A 2-D map (cols, rows) of a dense fp32 matrix (the backward's dQ accumulator) with a (32, 32)
// box in the 128-byte swizzle, for TMA reductions into it.
inline Status encode_accum_map(CUtensorMap* map, float* ptr, int cols, int64_t rows) {
  const auto fn = encode_tiled();
  if (fn == nullptr) return Status::device_error("sm90: cuTensorMapEncodeTiled not found in the driver");
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * sizeof(float)};
  const cuuint32_t box[2] = {32, 32};
  const cuuint32_t unit[2] = {1, 1};
  const tensor_map_detail::MapKey key{ptr, DType::kFloat32, {cols, rows}, {cols}, 32};
  const CUresult r = tensor_map_detail::cached_encode(map, key, [&] {
    return fn(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, ptr, dims, strides, box, unit,
              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  });
  if (r != CUDA_SUCCESS)
    return Status::device_error("sm90: tensor map of the dQ accumulator: cuTensorMapEncodeTiled error " +
                                std::to_string(r));
  return {};
}

}  // namespace flare::cuda::sm90
