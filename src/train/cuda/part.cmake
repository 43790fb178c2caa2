# src/train/cuda — the trainer's CUDA operators: cuBLASLt matmuls, norms, RoPE, SwiGLU,
# embeddings, the fused classifier, AdamW and the gradient norm, and the step's event timer.
# Built only with CUDA; a CPU-only build adds nothing from here.
if(FLARE_WITH_CUDA)
  set(flare_train_cuda_dir ${CMAKE_CURRENT_LIST_DIR})
  target_sources(flare_train PRIVATE
    ${flare_train_cuda_dir}/matmul.cpp
    ${flare_train_cuda_dir}/norm.cu
    ${flare_train_cuda_dir}/bias_gradient.cu
    ${flare_train_cuda_dir}/rope.cu
    ${flare_train_cuda_dir}/swiglu.cu
    ${flare_train_cuda_dir}/embedding.cu
    ${flare_train_cuda_dir}/classifier.cu
    ${flare_train_cuda_dir}/adamw.cu
    ${flare_train_cuda_dir}/event_timer.cpp)
  target_link_libraries(flare_train PUBLIC CUDA::cudart PRIVATE CUDA::cublasLt)
  option(FLARE_TRAIN_PTXAS_VERBOSE "Print ptxas register/spill reports for the trainer's kernels" OFF)
  target_compile_options(flare_train PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-Xptxas=--warn-on-spills -lineinfo -Xcompiler=-Wall,-Wextra,-Wno-unknown-pragmas>
    $<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<BOOL:${FLARE_TRAIN_PTXAS_VERBOSE}>>:-Xptxas=-v>)

  # The operators' micro-benchmark at GPT-3 2.7B's shapes (memory-bound: it prints GB/s).
  add_executable(train_ops_bench ${PROJECT_SOURCE_DIR}/bench/train_ops_bench.cu)
  target_link_libraries(train_ops_bench PRIVATE flare_train CUDA::cudart)
  target_compile_options(train_ops_bench PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wno-unknown-pragmas>)
endif()
