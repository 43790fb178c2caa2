# apps/train — the flare-train program: the training loop's command line (train, sample,
# synth-data). Included from src/train/loop/part.cmake; the binary lands in <build>/apps/train,
# where the CLI tests (tests/train/test_cpu_trainer_cli.cpp) look for it.
add_executable(flare_train_app ${CMAKE_CURRENT_LIST_DIR}/main.cpp ${CMAKE_CURRENT_LIST_DIR}/flags.cpp)
set_target_properties(flare_train_app PROPERTIES OUTPUT_NAME flare-train
                      RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/apps/train)
target_link_libraries(flare_train_app PRIVATE flare_train)
target_compile_options(flare_train_app PRIVATE ${FLARE_WARNINGS})
