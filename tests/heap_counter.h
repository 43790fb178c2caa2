// heap_counter.h — counts this test binary's live heap bytes, for tests of a call's peak memory.
//
// Replaces the global operator new / delete (glibc's malloc_usable_size gives a block's size back
// at delete), so include it from exactly one source file of a binary. FLARE_HEAP_COUNTER is 1
// where counting works (glibc) and 0 elsewhere, where a test should skip.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

#if defined(__GLIBC__)
#include <malloc.h>
#define FLARE_HEAP_COUNTER 1

namespace flare::test::heap_counter {

inline std::atomic<int64_t> live{0};
inline std::atomic<int64_t> peak{0};

inline void* alloc(std::size_t n, std::size_t align) {
  void* p = align > alignof(std::max_align_t)
                ? std::aligned_alloc(align, (n + align - 1) / align * align)
                : std::malloc(n == 0 ? 1 : n);
  if (p == nullptr) throw std::bad_alloc();
  const int64_t size = static_cast<int64_t>(malloc_usable_size(p));
  const int64_t now = live.fetch_add(size) + size;
  int64_t high = peak.load();
  while (now > high && !peak.compare_exchange_weak(high, now)) {
  }
  return p;
}

inline void release(void* p) {
  if (p == nullptr) return;
  live.fetch_sub(static_cast<int64_t>(malloc_usable_size(p)));
  std::free(p);
}

}  // namespace flare::test::heap_counter

namespace flare::test {

// The peak growth of live heap bytes from its construction to bytes().
class HeapGrowth {
 public:
  HeapGrowth() : base_(heap_counter::live.load()) { heap_counter::peak.store(base_); }
  int64_t bytes() const { return heap_counter::peak.load() - base_; }

 private:
  int64_t base_;
};

}  // namespace flare::test

void* operator new(std::size_t n) { return flare::test::heap_counter::alloc(n, 0); }
void* operator new[](std::size_t n) { return flare::test::heap_counter::alloc(n, 0); }
void* operator new(std::size_t n, std::align_val_t a) {
  return flare::test::heap_counter::alloc(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return flare::test::heap_counter::alloc(n, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept { flare::test::heap_counter::release(p); }
void operator delete[](void* p) noexcept { flare::test::heap_counter::release(p); }
void operator delete(void* p, std::size_t) noexcept { flare::test::heap_counter::release(p); }
void operator delete[](void* p, std::size_t) noexcept { flare::test::heap_counter::release(p); }
void operator delete(void* p, std::align_val_t) noexcept { flare::test::heap_counter::release(p); }
void operator delete[](void* p, std::align_val_t) noexcept {
  flare::test::heap_counter::release(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  flare::test::heap_counter::release(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
  flare::test::heap_counter::release(p);
}

#else
#define FLARE_HEAP_COUNTER 0
#endif
