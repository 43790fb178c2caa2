// Marks functions that compile for both the host and CUDA devices, so CPU and GPU backends share
// one definition of masks, score modifiers, dtype conversions and the dropout generator.
#pragma once

#if defined(__CUDACC__)
#define FLARE_HD __host__ __device__ __forceinline__
#else
#define FLARE_HD inline
#endif
