// test_cpu_memory.cpp — the CPU flash backend's extra memory grows linearly with sequence length.
//
// Every heap allocation of this binary is counted (heap_counter.h). The peak growth of live bytes during a
// forward + backward is the backend's extra memory. Going from s = 4096 to s = 16384 multiplies
// it by about 4 at most for O(s) memory and by 16 for anything that materialises scores, so the
// test asserts a ratio below 6, and that the extra memory at 16k is far below one s×s fp32
// matrix (1 GiB).
#include <cstdint>
#include <string>

#include "heap_counter.h"
#include "test_util.h"

#if FLARE_HEAP_COUNTER

namespace flare::test {
namespace {

// Peak heap growth of a causal forward + backward at (b=1, h=1, d=64, s_q = s_k = s), fp32.
int64_t extra_bytes(int s) {
  ProblemSpec spec;
  spec.seqlen_q = spec.seqlen_k = s;
  spec.heads_q = spec.heads_kv = 1;
  spec.head_dim = 64;
  spec.options.causal = true;  // halves the run time; the tiles and buffers are the same
  spec.seed = test_seed();
  Problem pr = make_problem(spec);  // inputs and outputs are allocated before measuring
  const HeapGrowth growth;
  EXPECT_TRUE(attention_forward(pr.q.view, pr.k.view, pr.v.view, pr.o.view, pr.lse.view,
                                pr.options, pr.varlen).ok());
  EXPECT_TRUE(attention_backward(pr.dout.view, pr.q.view, pr.k.view, pr.v.view, pr.o.view,
                                 pr.lse.view, pr.dq.view, pr.dk.view, pr.dv.view, pr.options,
                                 pr.varlen).ok());
  return growth.bytes();
}

TEST(CpuFlashMemory, ExtraMemoryIsLinearInSeqlen) {
  const int64_t at_4k = extra_bytes(4096);
  const int64_t at_16k = extra_bytes(16384);
  RecordProperty("extra_bytes_4k", std::to_string(at_4k));
  RecordProperty("extra_bytes_16k", std::to_string(at_16k));
  ASSERT_GT(at_4k, 0);
  EXPECT_LT(static_cast<double>(at_16k) / static_cast<double>(at_4k), 6.0)
      << "extra bytes: " << at_4k << " at s=4096, " << at_16k << " at s=16384";
  EXPECT_LT(at_16k, int64_t{16384} * 16384 * 4 / 16) << "extra bytes at s=16384";
}

}  // namespace
}  // namespace flare::test

#else

TEST(CpuFlashMemory, ExtraMemoryIsLinearInSeqlen) {
  GTEST_SKIP() << "needs glibc's malloc_usable_size to count heap bytes";
}

#endif
