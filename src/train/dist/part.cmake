# src/train/dist — data parallelism: the plan (gradient buckets, ZeRO shards) as pure arithmetic
# (dp_plan.h).
target_sources(flare_train PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/dp_plan.cpp
  ${CMAKE_CURRENT_LIST_DIR}/dp_host.cpp)
