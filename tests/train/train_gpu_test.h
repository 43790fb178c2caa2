// train_gpu_test.h — what the training library's GPU tests share: the skip without a device
// (gpu_util.h's FLARE_SKIP_WITHOUT_CUDA) and assertions on CUDA calls and Status results.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "flare/status.h"
#include "gpu_util.h"

#define ASSERT_CUDA(expr) ASSERT_EQ((expr), cudaSuccess) << #expr
#define ASSERT_OK(expr)                                              \
  do {                                                               \
    const ::flare::Status st_ = (expr);                              \
    ASSERT_TRUE(st_.ok()) << #expr << ": " << st_.to_string();       \
  } while (0)
