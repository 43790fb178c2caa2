// host_array.h — a large host array that nothing writes until its owner fills it.
//
// std::vector<T>(n) zero-fills its elements on one thread before anything else touches them: the
// page faults and the zeroing of LLaMA-3.2 1B's 4.9 GB of fp32 weights took 5.8 s on a 2-core
// development machine, and a run's start-up holds several such buffers (master weights, AdamW
// state on resume, their bf16 copy, a checkpoint's gather), each overwritten in full right after.
// HostArray allocates without writing, so the pages are first touched by the loop that fills the
// array, in parallel where that loop is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace flare::train {

template <typename T>
class HostArray {
 public:
  HostArray() = default;
  explicit HostArray(int64_t n)
      : data_(n > 0 ? std::make_unique_for_overwrite<T[]>(static_cast<size_t>(n)) : nullptr), size_(n > 0 ? n : 0) {}

  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  int64_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

 private:
  std::unique_ptr<T[]> data_;
  int64_t size_ = 0;
};

}  // namespace flare::train
