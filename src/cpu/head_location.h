// head_location.h — where one (batch, query head) of an attention call lives in its tensors.
//
// The CPU backends (flash.cpp, block_sparse_flash.cpp) work one (batch, query head) at a time and
// address every tensor from the element offset of its row 0 (query side) or key 0 (key side,
// kv head h / head_group under GQA/MQA). The offsets are computed here once so that both backends
// read the same layout the same way. Plain host code: flash.cpp includes it before its
// instruction-set region, so every compiled level shares the one inline definition.
#pragma once

#include <cstdint>

#include "core/params.h"
#include "core/score_mod.h"

namespace flare::cpu {

struct HeadLocation {
  int b = 0, h = 0;                        // batch, query head
  SequenceInfo seq;                        // sequence b's rows and lengths
  uint32_t bh = 0;                         // dropout stream: b·heads_q + h
  int64_t q = 0, o = 0, dout = 0, dq = 0;  // element offsets of row 0 (query-side tensors)
  int64_t k = 0, v = 0, dk = 0, dv = 0;    // element offsets of key 0 (kv head h / group)
  int64_t lse = 0;                         // index of row 0 in lse (and in the backward's D buffer)
  float slope = 0.0f;                      // ALiBi; 0 = off
};

inline HeadLocation locate_head(const AttentionParams& p, int b, int h) {
  HeadLocation at;
  at.b = b;
  at.h = h;
  at.seq = sequence_info(p, b);
  at.bh = static_cast<uint32_t>(b * p.heads_q + h);
  const int kvh = h / p.head_group;
  const int64_t q_row0 = at.seq.q_row0, k_row0 = at.seq.k_row0;
  at.q = b * p.q_batch_stride + q_row0 * p.q_row_stride + h * p.q_head_stride;
  at.o = b * p.o_batch_stride + q_row0 * p.o_row_stride + h * p.o_head_stride;
  at.dout = b * p.do_batch_stride + q_row0 * p.do_row_stride + h * p.do_head_stride;
  at.dq = b * p.dq_batch_stride + q_row0 * p.dq_row_stride + h * p.dq_head_stride;
  at.k = b * p.k_batch_stride + k_row0 * p.k_row_stride + kvh * p.k_head_stride;
  at.v = b * p.v_batch_stride + k_row0 * p.v_row_stride + kvh * p.v_head_stride;
  at.dk = b * p.dk_batch_stride + k_row0 * p.dk_row_stride + kvh * p.dk_head_stride;
  at.dv = b * p.dv_batch_stride + k_row0 * p.dv_row_stride + kvh * p.dv_head_stride;
  at.lse = b * p.lse_batch_stride + h * p.lse_head_stride + q_row0;
  at.slope = alibi_slope(p, b, h);
  return at;
}

}  // namespace flare::cpu
