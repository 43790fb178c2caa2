# Training data: token shards (llm.c's format), the shuffled resumable loader, the BPE tokenizer.
target_sources(flare_train PRIVATE
  ${CMAKE_CURRENT_LIST_DIR}/shard.cpp
  ${CMAKE_CURRENT_LIST_DIR}/loader.cpp
  ${CMAKE_CURRENT_LIST_DIR}/tokenizer.cpp)
