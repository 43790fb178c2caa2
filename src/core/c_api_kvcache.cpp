// c_api_kvcache.cpp — the extern "C" mirror of kvcache.h: the C struct of cache arguments to
// KVCacheArgs, the C++ entry point, and the same error guard as the rest of the C API
// (c_api_internal.h).
#include <string>

#include "core/c_api_internal.h"
#include "flare/c_api.h"
#include "flare/kvcache.h"

namespace {

flare::KVCacheArgs to_kvcache_args(const flare_kvcache_args& a) {
  using flare::c_api::to_view;
  flare::KVCacheArgs r;
  r.k_cache = to_view(&a.k_cache);
  r.v_cache = to_view(&a.v_cache);
  r.block_table = to_view(&a.block_table);
  r.cache_seqlens = to_view(&a.cache_seqlens);
  r.cache_seqlen = a.cache_seqlen;
  r.cache_batch_idx = to_view(&a.cache_batch_idx);
  r.k_new = to_view(&a.k_new);
  r.v_new = to_view(&a.v_new);
  r.rotary_cos = to_view(&a.rotary_cos);
  r.rotary_sin = to_view(&a.rotary_sin);
  r.rotary_interleaved = a.rotary_interleaved != 0;
  r.num_splits = a.num_splits;
  return r;
}

}  // namespace

extern "C" int flare_attention_with_kvcache(const flare_tensor* q, const flare_kvcache_args* cache,
                                            const flare_tensor* o, const flare_tensor* lse,
                                            const flare_attention_options* options, void* stream) {
  using flare::c_api::to_view;
  return flare::c_api::guarded([&] {
    if (cache == nullptr) return flare::Status::invalid_argument("cache: arguments are required");
    FLARE_RETURN_IF_ERROR(flare::c_api::rank_error(
        {{"q", q}, {"o", o}, {"lse", lse}, {"k_cache", &cache->k_cache},
         {"v_cache", &cache->v_cache}, {"block_table", &cache->block_table},
         {"cache_seqlens", &cache->cache_seqlens}, {"cache_batch_idx", &cache->cache_batch_idx},
         {"k_new", &cache->k_new}, {"v_new", &cache->v_new}, {"rotary_cos", &cache->rotary_cos},
         {"rotary_sin", &cache->rotary_sin}},
        options, nullptr));
    return flare::attention_with_kvcache(to_view(q), to_kvcache_args(*cache), to_view(o),
                                         to_view(lse), flare::c_api::to_options(options), stream);
  });
}
