# src/train/loop — the training loop (trainer.h) over a CPU or CUDA backend (backend.h), the
# initialisation and the sampler; the CUDA backend only in CUDA builds (model/ holds its model).
# Also the flare-train program (apps/train), built here because it is the loop's front end and
# needs nothing but flare_train.
set(flare_train_loop_dir ${CMAKE_CURRENT_LIST_DIR})
target_sources(flare_train PRIVATE
  ${flare_train_loop_dir}/init.cpp
  ${flare_train_loop_dir}/cpu_backend.cpp
  ${flare_train_loop_dir}/trainer.cpp
  ${flare_train_loop_dir}/sample.cpp)
if(FLARE_WITH_CUDA)
  target_sources(flare_train PRIVATE ${flare_train_loop_dir}/cuda_backend.cpp)
else()
  target_sources(flare_train PRIVATE ${flare_train_loop_dir}/cuda_backend_stub.cpp)
endif()

if(FLARE_BUILD_APPS)
  include(${PROJECT_SOURCE_DIR}/apps/train/app.cmake)
endif()
