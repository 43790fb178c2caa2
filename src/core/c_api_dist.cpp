// c_api_dist.cpp — the extern "C" mirror of flare/dist.h: communicators and context-parallel plans
// behind opaque handles, the sequence layout, and the launch environment. Conversions and the
// status-to-code guard are c_api.cpp's (c_api_internal.h); this file adds the handles and the
// checks that only a C caller can get wrong (null handles and out-pointers, a timeout that means
// "default", a host name too long for its fixed field).
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/c_api_internal.h"
#include "core/message.h"
#include "flare/c_api.h"
#include "flare/dist.h"

// The handles: a rank's communicator, and a plan with the communicator it runs on.
struct flare_comm {
  std::unique_ptr<flare::dist::Communicator> impl;
};

struct flare_cp {
  std::unique_ptr<flare::dist::ContextParallelAttention> impl;
};

namespace {

using flare::Status;
using flare::c_api::guarded;
using flare::c_api::rank_error;
using flare::c_api::to_view;
namespace dist = flare::dist;

// flare_comm_* timeouts: 0 asks for CommOptions' default; the library rejects other values <= 0.
Status comm_options(int32_t timeout_ms, dist::CommOptions* out) {
  if (timeout_ms < 0)
    return Status::invalid_argument(flare::cat("timeout_ms: ", timeout_ms,
                                               " must be >= 0 (0 = the default, ",
                                               dist::CommOptions{}.timeout_ms, " ms)"));
  if (timeout_ms > 0) out->timeout_ms = timeout_ms;
  return {};
}

Status not_null(const void* p, const char* name, const char* what) {
  if (p != nullptr) return {};
  return Status::invalid_argument(flare::cat(name, ": ", what, " is null"));
}

// Wraps a communicator the library made into a new handle, stored in *out only once complete.
Status wrap(std::unique_ptr<dist::Communicator> comm, flare_comm** out) {
  auto handle = std::make_unique<flare_comm>();
  handle->impl = std::move(comm);
  *out = handle.release();
  return {};
}

Status copy_field(const std::string& value, char* field, size_t capacity, const char* name) {
  if (value.size() >= capacity)
    return Status::invalid_argument(
        flare::cat(name, ": '", value, "' is longer than ", capacity - 1, " characters"));
  std::memcpy(field, value.c_str(), value.size() + 1);
  return {};
}

Status to_c(const dist::LaunchInfo& in, flare_launch_info* out) {
  flare_launch_info c{};
  c.rank = in.rank;
  c.size = in.size;
  c.local_rank = in.local_rank;
  c.master_port = in.master_port;
  FLARE_RETURN_IF_ERROR(
      copy_field(in.master_addr, c.master_addr, sizeof c.master_addr, "MASTER_ADDR"));
  FLARE_RETURN_IF_ERROR(copy_field(in.source, c.source, sizeof c.source, "launch source"));
  *out = c;
  return {};
}

void to_c(const dist::SequenceShard& in, flare_sequence_shard* out) {
  flare_sequence_shard c{};
  c.count = in.count;
  for (int i = 0; i < 2; ++i)
    c.chunk[i] = {in.chunk[i].global_begin, in.chunk[i].local_begin, in.chunk[i].length};
  c.length = in.length;
  *out = c;
}

dist::Strategy to_strategy(int32_t s) { return static_cast<dist::Strategy>(s); }

}  // namespace

extern "C" {

int flare_nccl_built(void) { return dist::nccl_built() ? 1 : 0; }

int flare_nccl_unique_id(flare_nccl_id* id) {
  return guarded([&]() -> Status {
    FLARE_RETURN_IF_ERROR(not_null(id, "id", "output pointer"));
    static_assert(sizeof(id->bytes) == sizeof(dist::NcclId::bytes), "NCCL ids are 128 bytes");
    dist::NcclId made;
    FLARE_RETURN_IF_ERROR(dist::nccl_unique_id(&made));
    std::memcpy(id->bytes, made.bytes, sizeof id->bytes);
    return {};
  });
}

int flare_comm_create_in_process_group(int32_t size, int32_t timeout_ms, flare_comm** comms) {
  return guarded([&]() -> Status {
    FLARE_RETURN_IF_ERROR(not_null(comms, "comms", "output array"));
    dist::CommOptions options;
    FLARE_RETURN_IF_ERROR(comm_options(timeout_ms, &options));
    std::vector<std::unique_ptr<dist::Communicator>> made;
    FLARE_RETURN_IF_ERROR(dist::make_in_process_group(size, options, &made));
    // Every handle is made before any is handed out, so a failed allocation leaks nothing and
    // writes nothing.
    std::vector<std::unique_ptr<flare_comm>> handles;
    for (std::unique_ptr<dist::Communicator>& c : made) {
      handles.push_back(std::make_unique<flare_comm>());
      handles.back()->impl = std::move(c);
    }
    for (size_t r = 0; r < handles.size(); ++r) comms[r] = handles[r].release();
    return {};
  });
}

int flare_comm_create_nccl(const flare_nccl_id* id, int32_t rank, int32_t size, int32_t device,
                           int32_t timeout_ms, flare_comm** comm) {
  return guarded([&]() -> Status {
    FLARE_RETURN_IF_ERROR(not_null(id, "id", "NCCL id"));
    FLARE_RETURN_IF_ERROR(not_null(comm, "comm", "output pointer"));
    dist::CommOptions options;
    FLARE_RETURN_IF_ERROR(comm_options(timeout_ms, &options));
    dist::NcclId nid;
    std::memcpy(nid.bytes, id->bytes, sizeof nid.bytes);
    std::unique_ptr<dist::Communicator> made;
    FLARE_RETURN_IF_ERROR(dist::make_nccl_communicator(nid, rank, size, device, options, &made));
    return wrap(std::move(made), comm);
  });
}

int flare_comm_create_nccl_from_env(int32_t timeout_ms, flare_comm** comm,
                                    flare_launch_info* info) {
  return guarded([&]() -> Status {
    FLARE_RETURN_IF_ERROR(not_null(comm, "comm", "output pointer"));
    dist::CommOptions options;
    FLARE_RETURN_IF_ERROR(comm_options(timeout_ms, &options));
    std::unique_ptr<dist::Communicator> made;
    dist::LaunchInfo launch;
    FLARE_RETURN_IF_ERROR(dist::make_nccl_communicator_from_env(options, &made, &launch));
    if (info != nullptr) FLARE_RETURN_IF_ERROR(to_c(launch, info));
    return wrap(std::move(made), comm);
  });
}

int flare_comm_adopt_nccl(void* nccl_comm, int32_t take_ownership, int32_t timeout_ms,
                          flare_comm** comm) {
  return guarded([&]() -> Status {
    FLARE_RETURN_IF_ERROR(not_null(nccl_comm, "nccl_comm", "ncclComm_t"));
    FLARE_RETURN_IF_ERROR(not_null(comm, "comm", "output pointer"));
    dist::CommOptions options;
    FLARE_RETURN_IF_ERROR(comm_options(timeout_ms, &options));
    std::unique_ptr<dist::Communicator> made;
    FLARE_RETURN_IF_ERROR(
        dist::adopt_nccl_communicator(nccl_comm, take_ownership != 0, options, &made));
    return wrap(std::move(made), comm);
  });
}

void flare_comm_destroy(flare_comm* comm) { delete comm; }

int flare_comm_get_info(const flare_comm* comm, flare_comm_info* info) {
  return guarded([&]() -> Status {
    FLARE_RETURN_IF_ERROR(not_null(comm, "comm", "handle"));
    FLARE_RETURN_IF_ERROR(not_null(info, "info", "output pointer"));
    const dist::Communicator& c = *comm->impl;
    *info = {c.rank(),         c.size(),       static_cast<int32_t>(c.device()),
             c.device_index(), c.timeout_ms(), c.kind()};
    return {};
  });
}

int flare_comm_barrier(flare_comm* comm) {
  return guarded([&]() -> Status {
    FLARE_RETURN_IF_ERROR(not_null(comm, "comm", "handle"));
    return comm->impl->barrier();
  });
}

int flare_comm_health(flare_comm* comm) {
  return guarded([&]() -> Status {
    FLARE_RETURN_IF_ERROR(not_null(comm, "comm", "handle"));
    return comm->impl->health();
  });
}

int flare_launch_info_from_env(flare_launch_info* info) {
  return guarded([&]() -> Status {
    FLARE_RETURN_IF_ERROR(not_null(info, "info", "output pointer"));
    dist::LaunchInfo launch;
    FLARE_RETURN_IF_ERROR(dist::launch_info_from_env(&launch));
    return to_c(launch, info);
  });
}

int flare_get_sequence_shard(int32_t strategy, int64_t seqlen, int32_t size, int32_t rank,
                             flare_sequence_shard* shard) {
  return guarded([&]() -> Status {
    FLARE_RETURN_IF_ERROR(not_null(shard, "shard", "output pointer"));
    dist::SequenceShard s;
    FLARE_RETURN_IF_ERROR(dist::sequence_shard(to_strategy(strategy), seqlen, size, rank, &s));
    to_c(s, shard);
    return {};
  });
}

int flare_shard_sequence(const flare_tensor* full, int32_t seq_dim, int32_t strategy, int32_t size,
                         int32_t rank, const flare_tensor* local) {
  return guarded([&]() -> Status {
    FLARE_RETURN_IF_ERROR(rank_error({{"full", full}, {"local", local}}, nullptr, nullptr));
    return dist::shard_sequence(to_view(full), seq_dim, to_strategy(strategy), size, rank,
                                to_view(local));
  });
}

int flare_unshard_sequence(const flare_tensor* local, int32_t seq_dim, int32_t strategy,
                           int32_t size, int32_t rank, const flare_tensor* full) {
  return guarded([&]() -> Status {
    FLARE_RETURN_IF_ERROR(rank_error({{"local", local}, {"full", full}}, nullptr, nullptr));
    return dist::unshard_sequence(to_view(local), seq_dim, to_strategy(strategy), size, rank,
                                  to_view(full));
  });
}

namespace {

// A host int32 array of `count` entries from the C side, named `name` in errors.
Status host_offsets(const int32_t* data, int32_t count, const char* name, const char* count_name,
                    std::vector<int32_t>* out) {
  out->clear();
  if (count < 0) return flare::invalid(count_name, ": must be >= 0, got ", count);
  if (data == nullptr && count > 0)
    return flare::invalid(name, ": NULL with ", count_name, " = ", count, "; pass both or neither");
  if (data != nullptr) out->assign(data, data + count);
  return {};
}

}  // namespace

int flare_shard_varlen(const flare_tensor* full, int32_t seq_dim, int32_t strategy,
                       const int32_t* cu_seqlens, int32_t num_cu_seqlens, int32_t size,
                       int32_t rank, const flare_tensor* local) {
  return guarded([&]() -> Status {
    FLARE_RETURN_IF_ERROR(rank_error({{"full", full}, {"local", local}}, nullptr, nullptr));
    std::vector<int32_t> cu;
    FLARE_RETURN_IF_ERROR(
        host_offsets(cu_seqlens, num_cu_seqlens, "cu_seqlens", "num_cu_seqlens", &cu));
    return dist::shard_varlen(to_view(full), seq_dim, to_strategy(strategy), cu, size, rank,
                              to_view(local));
  });
}

int flare_unshard_varlen(const flare_tensor* local, int32_t seq_dim, int32_t strategy,
                         const int32_t* cu_seqlens, int32_t num_cu_seqlens, int32_t size,
                         int32_t rank, const flare_tensor* full) {
  return guarded([&]() -> Status {
    FLARE_RETURN_IF_ERROR(rank_error({{"local", local}, {"full", full}}, nullptr, nullptr));
    std::vector<int32_t> cu;
    FLARE_RETURN_IF_ERROR(
        host_offsets(cu_seqlens, num_cu_seqlens, "cu_seqlens", "num_cu_seqlens", &cu));
    return dist::unshard_varlen(to_view(local), seq_dim, to_strategy(strategy), cu, size, rank,
                                to_view(full));
  });
}

flare_cp_config flare_default_cp_config(void) {
  const dist::ContextParallelConfig cpp;
  flare_cp_config c{};
  c.strategy = static_cast<int32_t>(cpp.strategy);
  c.dtype = static_cast<int32_t>(cpp.dtype);
  c.attention = flare_default_options();
  return c;
}

int flare_cp_create(flare_comm* comm, const flare_cp_config* config, flare_cp** cp) {
  return guarded([&]() -> Status {
    FLARE_RETURN_IF_ERROR(not_null(comm, "comm", "handle"));
    FLARE_RETURN_IF_ERROR(not_null(config, "config", "pointer"));
    FLARE_RETURN_IF_ERROR(not_null(cp, "cp", "output pointer"));
    FLARE_RETURN_IF_ERROR(rank_error({}, &config->attention, nullptr));
    dist::ContextParallelConfig c;
    c.strategy = to_strategy(config->strategy);
    c.batch = config->batch;
    c.seqlen = config->seqlen;
    c.heads_q = config->heads_q;
    c.heads_kv = config->heads_kv;
    c.head_dim = config->head_dim;
    c.dtype = static_cast<flare::DType>(config->dtype);
    c.attention = flare::c_api::to_options(&config->attention);
    FLARE_RETURN_IF_ERROR(host_offsets(config->cu_seqlens, config->num_cu_seqlens,
                                       "config.cu_seqlens", "config.num_cu_seqlens",
                                       &c.cu_seqlens));
    auto handle = std::make_unique<flare_cp>();
    FLARE_RETURN_IF_ERROR(
        dist::ContextParallelAttention::create(comm->impl.get(), c, &handle->impl));
    *cp = handle.release();
    return {};
  });
}

void flare_cp_destroy(flare_cp* cp) { delete cp; }

int flare_cp_get_shard(const flare_cp* cp, flare_sequence_shard* shard) {
  return guarded([&]() -> Status {
    FLARE_RETURN_IF_ERROR(not_null(cp, "cp", "handle"));
    FLARE_RETURN_IF_ERROR(not_null(shard, "shard", "output pointer"));
    to_c(cp->impl->shard(), shard);
    return {};
  });
}

int flare_cp_forward(flare_cp* cp, const flare_tensor* q, const flare_tensor* k,
                     const flare_tensor* v, const flare_tensor* o, const flare_tensor* lse,
                     void* stream) {
  return guarded([&]() -> Status {
    FLARE_RETURN_IF_ERROR(not_null(cp, "cp", "handle"));
    FLARE_RETURN_IF_ERROR(
        rank_error({{"q", q}, {"k", k}, {"v", v}, {"o", o}, {"lse", lse}}, nullptr, nullptr));
    return cp->impl->forward(to_view(q), to_view(k), to_view(v), to_view(o), to_view(lse), stream);
  });
}

int flare_cp_backward(flare_cp* cp, const flare_tensor* dout, const flare_tensor* q,
                      const flare_tensor* k, const flare_tensor* v, const flare_tensor* o,
                      const flare_tensor* lse, const flare_tensor* dq, const flare_tensor* dk,
                      const flare_tensor* dv, void* stream) {
  return guarded([&]() -> Status {
    FLARE_RETURN_IF_ERROR(not_null(cp, "cp", "handle"));
    FLARE_RETURN_IF_ERROR(rank_error({{"dout", dout},
                                      {"q", q},
                                      {"k", k},
                                      {"v", v},
                                      {"o", o},
                                      {"lse", lse},
                                      {"dq", dq},
                                      {"dk", dk},
                                      {"dv", dv}},
                                     nullptr, nullptr));
    return cp->impl->backward(to_view(dout), to_view(q), to_view(k), to_view(v), to_view(o),
                              to_view(lse), to_view(dq), to_view(dk), to_view(dv), stream);
  });
}

int flare_cp_set_timing(flare_cp* cp, int32_t on) {
  return guarded([&]() -> Status {
    FLARE_RETURN_IF_ERROR(not_null(cp, "cp", "handle"));
    return cp->impl->set_timing(on != 0);
  });
}

int flare_cp_take_timing(flare_cp* cp, flare_cp_timing* timing) {
  return guarded([&]() -> Status {
    FLARE_RETURN_IF_ERROR(not_null(cp, "cp", "handle"));
    FLARE_RETURN_IF_ERROR(not_null(timing, "timing", "output pointer"));
    dist::CpTiming t;
    FLARE_RETURN_IF_ERROR(cp->impl->take_timing(&t));
    *timing = {t.calls, t.exchanges, t.bytes_sent, t.comm_ms, t.compute_ms};
    return {};
  });
}

}  // extern "C"
