// cp_context.h — one rank's plan for context-parallel attention, shared by the strategies (ring
// and zigzag in ring_attention.cpp, all-to-all in all_to_all_attention.cpp): the communicator,
// every rank's rows, the problem's sizes, the options of the single-device calls and host
// scratch memory kept across calls.
#pragma once

#include <cstdint>
#include <vector>

#include "flare/attention.h"
#include "flare/dist.h"

namespace flare::dist {

// Host scratch reused across calls (grown on demand, never shrunk).
struct CpScratch {
  std::vector<unsigned char> kv_send;    // this rank's K and V packed, when not contiguous
  std::vector<unsigned char> kv_recv[2]; // K then V of an incoming block, double-buffered
  std::vector<unsigned char> dkv[2];     // fp32 dK then dV travelling with a block, double-buffered
  std::vector<unsigned char> o_acc;      // fp32 (b, s_local, h_q, d)
  std::vector<unsigned char> lse_acc;    // fp32 (b, h_q, s_local)
  std::vector<unsigned char> o_blk;      // dtype (b, rows, h_q, d): one block call's output
  std::vector<unsigned char> lse_blk;    // fp32 (b, h_q, rows)
  std::vector<unsigned char> dq_acc;     // fp32 (b, s_local, h_q, d)
  std::vector<unsigned char> grad_blk;   // dtype dQ, dK, dV of one block call
  // All-to-all: head slabs to send, the full-sequence tensors of this rank's heads, and staging.
  std::vector<unsigned char> a2a_send;
  std::vector<unsigned char> a2a_full[9];
  std::vector<unsigned char> a2a_stage;
};

// What a strategy needs besides the tensors: the plan and scratch memory.
struct CpContext {
  Communicator* comm = nullptr;
  std::vector<SequenceShard> shards;  // shards[r]: rank r's rows
  int batch = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  DType dtype = DType::kFloat32;
  bool causal = false;
  AttentionOptions block_options;  // for every block call; `causal` is set per call
  CpScratch scratch;
};

// Indices [begin, begin + len) of dimension `dim` (rows of the sequence, or a range of heads).
inline TensorView rows(const TensorView& t, int dim, int64_t begin, int64_t len) {
  TensorView r = t;
  r.data = static_cast<unsigned char*>(t.data) +
           begin * t.stride[dim] * static_cast<int64_t>(dtype_size(t.dtype));
  r.shape[dim] = len;
  return r;
}

// A scratch buffer of at least `bytes`, grown on demand and kept.
template <typename T = unsigned char>
T* grow(std::vector<unsigned char>& buffer, int64_t bytes) {
  if (buffer.size() < static_cast<size_t>(bytes)) buffer.resize(static_cast<size_t>(bytes));
  return reinterpret_cast<T*>(buffer.data());
}

}  // namespace flare::dist
