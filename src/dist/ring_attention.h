// ring_attention.h — one rank's side of ring attention, forward and backward, on host memory.
//
// The caller (context_parallel.cpp) has validated the tensors and agreed on the plan with every
// other rank; these functions run the ring. See ring_attention.cpp for the step structure.
#pragma once

#include <vector>

#include "flare/attention.h"
#include "flare/dist.h"

namespace flare::dist {

// Host scratch reused across calls (grown on demand, never shrunk).
struct RingScratch {
  std::vector<unsigned char> kv_send;    // this rank's K and V packed, when not contiguous
  std::vector<unsigned char> kv_recv[2]; // K then V of an incoming block, double-buffered
  std::vector<unsigned char> dkv[2];     // fp32 dK then dV travelling with a block, double-buffered
  std::vector<unsigned char> o_acc;      // fp32 (b, s_local, h_q, d)
  std::vector<unsigned char> lse_acc;    // fp32 (b, h_q, s_local)
  std::vector<unsigned char> o_blk;      // dtype (b, rows, h_q, d): one block call's output
  std::vector<unsigned char> lse_blk;    // fp32 (b, h_q, rows)
  std::vector<unsigned char> dq_acc;     // fp32 (b, s_local, h_q, d)
  std::vector<unsigned char> grad_blk;   // dtype dQ, dK, dV of one block call
};

// What the ring needs besides the tensors.
struct RingContext {
  Communicator* comm = nullptr;
  std::vector<SequenceShard> shards;  // shards[r]: rank r's rows
  int batch = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  DType dtype = DType::kFloat32;
  bool causal = false;
  AttentionOptions block_options;  // for every block call; `causal` is set per call
  RingScratch scratch;
};

Status ring_attention_forward(RingContext& ctx, const TensorView& q, const TensorView& k,
                              const TensorView& v, const TensorView& o, const TensorView& lse,
                              Stream stream);
Status ring_attention_backward(RingContext& ctx, const TensorView& dout, const TensorView& q,
                               const TensorView& k, const TensorView& v, const TensorView& o,
                               const TensorView& lse, const TensorView& dq, const TensorView& dk,
                               const TensorView& dv, Stream stream);

}  // namespace flare::dist
