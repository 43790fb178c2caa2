# install_test.cmake — the installed package, tested as a user meets it. Run as
#   cmake -DMODE=<mode> -DBUILD_DIR=<flare build> -DWORK=<scratch dir> -DVERSION=<x.y.z>
#         -DLIBDIR=<lib dir> -DGENERATOR=<gen> -DMAKE_PROGRAM=<path> -DC_COMPILER=<path>
#         -DCXX_COMPILER=<path> [-DPKG_CONFIG=<path>] [-DCLI=ON] -P install_test.cmake
#   install    `cmake --install BUILD_DIR --prefix WORK/prefix` into an emptied prefix; checks the
#              files a consumer relies on, and that the installed CLI runs
#   cmake      configures, builds and runs the consumer project in this folder (C++ and C, through
#              find_package(flare CONFIG) and flare::flare) against WORK/prefix alone
#   pkgconfig  compiles and links consumer.c with C_COMPILER and nothing but
#              `pkg-config --cflags --libs flare` from WORK/prefix, and runs it
# tests/CMakeLists.txt runs `install` as a fixture the other two require.
cmake_minimum_required(VERSION 3.25)

set(prefix ${WORK}/prefix)

# Runs a command; stops the test with its output unless it succeeds. Sets `output` in the caller.
function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${ARGN}\n${out}")
  endif()
  set(output "${out}" PARENT_SCOPE)
endfunction()

if(MODE STREQUAL "install")
  file(REMOVE_RECURSE ${WORK})
  run_step("cmake --install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
  set(expected
    include/flare/attention.h include/flare/c_api.h include/flare/status.h include/flare/tensor.h
    ${LIBDIR}/cmake/flare/flareConfig.cmake ${LIBDIR}/cmake/flare/flareConfigVersion.cmake
    ${LIBDIR}/cmake/flare/flareTargets.cmake ${LIBDIR}/pkgconfig/flare.pc)
  foreach(file IN LISTS expected)
    if(NOT EXISTS ${prefix}/${file})
      message(FATAL_ERROR "not installed: ${file}")
    endif()
  endforeach()
  file(GLOB libraries ${prefix}/${LIBDIR}/libflare.a ${prefix}/${LIBDIR}/libflare.so)
  if(NOT libraries)
    message(FATAL_ERROR "not installed: ${LIBDIR}/libflare.a or libflare.so")
  endif()
  if(CLI)
    run_step("the installed CLI" ${prefix}/bin/flare --version)
    if(NOT output MATCHES "^flare ${VERSION}")
      message(FATAL_ERROR "installed `flare --version` printed: ${output}")
    endif()
  endif()
  message(STATUS "installed into ${prefix}")

elseif(MODE STREQUAL "cmake")
  set(build ${WORK}/consumer-cmake)
  file(REMOVE_RECURSE ${build})
  run_step("configuring the consumer" ${CMAKE_COMMAND} -S ${CMAKE_CURRENT_LIST_DIR} -B ${build}
    -G ${GENERATOR} -DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}
    -DCMAKE_C_COMPILER=${C_COMPILER} -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${prefix}
    -DFLARE_EXPECTED_VERSION=${VERSION} -DFLARE_EXPECTED_PREFIX=${prefix})
  run_step("building the consumer" ${CMAKE_COMMAND} --build ${build})
  foreach(program consumer_cxx consumer_c)
    run_step(${program} ${build}/${program})
    message(STATUS "${output}")
  endforeach()

elseif(MODE STREQUAL "pkgconfig")
  if(NOT PKG_CONFIG)
    message(STATUS "pkg-config not found; skipped")
    return()
  endif()
  set(ENV{PKG_CONFIG_PATH} ${prefix}/${LIBDIR}/pkgconfig)
  run_step("pkg-config" ${PKG_CONFIG} --modversion flare)
  string(STRIP "${output}" pc_version)
  if(NOT pc_version STREQUAL VERSION)
    message(FATAL_ERROR "flare.pc says version ${pc_version}, the build is ${VERSION}")
  endif()
  run_step("pkg-config" ${PKG_CONFIG} --cflags --libs flare)
  separate_arguments(flags UNIX_COMMAND "${output}")
  message(STATUS "pkg-config --cflags --libs flare: ${output}")
  set(program ${WORK}/consumer-pkgconfig)
  run_step("compiling consumer.c with pkg-config's flags" ${C_COMPILER} -std=c99
    ${CMAKE_CURRENT_LIST_DIR}/consumer.c "-DFLARE_EXPECTED_VERSION=\"${VERSION}\"" -o ${program}
    ${flags})
  # pkg-config gives no run path: a libflare.so outside the loader's directories is found as a
  # user would make it found.
  set(ENV{LD_LIBRARY_PATH} ${prefix}/${LIBDIR})
  run_step("consumer (pkg-config)" ${program})
  message(STATUS "${output}")

else()
  message(FATAL_ERROR "MODE must be install, cmake or pkgconfig, got '${MODE}'")
endif()
