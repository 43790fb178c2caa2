# src/train/dist — data parallelism: the plan (gradient buckets, ZeRO shards) as pure arithmetic
# (dp_plan.h), the host-side agreement and shard gather both backends share (dp_host.h), where
# sharded gradients live (stage_buffers.h), and the
# CUDA step's collectives over NCCL (dp_cuda.h, CUDA builds only); context parallelism's rows and
# attention plan (cp_rows.h).
target_sources(flare_train PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/dp_plan.cpp
  ${CMAKE_CURRENT_LIST_DIR}/dp_host.cpp
  ${CMAKE_CURRENT_LIST_DIR}/stage_buffers.cpp
  ${CMAKE_CURRENT_LIST_DIR}/cp_rows.cpp)
if(FLARE_WITH_CUDA)
  target_sources(flare_train PRIVATE ${CMAKE_CURRENT_LIST_DIR}/dp_cuda.cu)
endif()
