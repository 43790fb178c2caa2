// test_cpu_memory.cpp — the CPU flash backend's extra memory grows linearly with sequence length.
//
// Every heap allocation of this binary goes through the counting operator new below (glibc's
// malloc_usable_size gives the size back at delete). The peak growth of live bytes during a
// forward + backward is the backend's extra memory. Going from s = 4096 to s = 16384 multiplies
// it by about 4 at most for O(s) memory and by 16 for anything that materialises scores, so the
// test asserts a ratio below 6, and that the extra memory at 16k is far below one s×s fp32
// matrix (1 GiB).
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>

#include "test_util.h"

#if defined(__GLIBC__)
#include <malloc.h>

namespace {

std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};

void* counted_alloc(std::size_t n, std::size_t align) {
  void* p = align > alignof(std::max_align_t)
                ? std::aligned_alloc(align, (n + align - 1) / align * align)
                : std::malloc(n == 0 ? 1 : n);
  if (p == nullptr) throw std::bad_alloc();
  const int64_t live = g_live.fetch_add(static_cast<int64_t>(malloc_usable_size(p))) +
                       static_cast<int64_t>(malloc_usable_size(p));
  int64_t peak = g_peak.load();
  while (live > peak && !g_peak.compare_exchange_weak(peak, live)) {
  }
  return p;
}

void counted_free(void* p) {
  if (p == nullptr) return;
  g_live.fetch_sub(static_cast<int64_t>(malloc_usable_size(p)));
  std::free(p);
}

}  // namespace

void* operator new(std::size_t n) { return counted_alloc(n, 0); }
void* operator new[](std::size_t n) { return counted_alloc(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) {
  return counted_alloc(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return counted_alloc(n, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept { counted_free(p); }
void operator delete[](void* p) noexcept { counted_free(p); }
void operator delete(void* p, std::size_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::size_t) noexcept { counted_free(p); }
void operator delete(void* p, std::align_val_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { counted_free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { counted_free(p); }

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
  const int64_t base = g_live.load();
  g_peak.store(base);
  EXPECT_TRUE(attention_forward(pr.q.view, pr.k.view, pr.v.view, pr.o.view, pr.lse.view,
                                pr.options, pr.varlen).ok());
  EXPECT_TRUE(attention_backward(pr.dout.view, pr.q.view, pr.k.view, pr.v.view, pr.o.view,
                                 pr.lse.view, pr.dq.view, pr.dk.view, pr.dv.view, pr.options,
                                 pr.varlen).ok());
  return g_peak.load() - base;
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
