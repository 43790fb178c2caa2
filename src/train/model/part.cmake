# src/train/model — the GPT/LLaMA model on one CUDA device (gpu_model.h), built from the CUDA
# operators of src/train/cuda and flare's attention. CUDA builds only; the CPU model is cpu/.
if(FLARE_WITH_CUDA)
  target_sources(flare_train PRIVATE
    ${CMAKE_CURRENT_LIST_DIR}/gpu_model.cpp
    ${CMAKE_CURRENT_LIST_DIR}/loss_sum.cu)
endif()
