# The CPU operators and the CPU model: the fp32 ground truth of the training library.
target_sources(flare_train PRIVATE ${CMAKE_CURRENT_LIST_DIR}/ops.cpp
               ${CMAKE_CURRENT_LIST_DIR}/model.cpp)
