# kernels.cmake — CUDA sources of the flare library (included when CUDA is enabled).
# Until the FlashAttention-2 kernels land, the CUDA entry points are the stub.
target_sources(flare PRIVATE src/cuda/cuda_stub.cpp)
