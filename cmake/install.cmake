# install.cmake — what `cmake --install` puts under the prefix (included by CMakeLists.txt when
# FLARE_INSTALL is on; directories from GNUInstallDirs):
#   bin/flare                 the CLI
#   include/flare/*.h         the public headers: C++ API and C ABI
#   lib/libflare.a            (libflare.so with BUILD_SHARED_LIBS=ON)
#   lib/cmake/flare/          the CMake package: find_package(flare CONFIG) gives flare::flare
#   lib/pkgconfig/flare.pc    compiler and linker flags for everything else
# tests/install/ installs a build into a scratch prefix and builds consumers of all three.
include(CMakePackageConfigHelpers)

# The package files locate the prefix from their own place in it (flare.pc: ${pcfiledir}).
foreach(dir CMAKE_INSTALL_BINDIR CMAKE_INSTALL_LIBDIR CMAKE_INSTALL_INCLUDEDIR)
  if(IS_ABSOLUTE "${${dir}}")
    message(FATAL_ERROR "FLARE_INSTALL: ${dir} must be relative to the install prefix, got "
                        "${${dir}}")
  endif()
endforeach()

get_target_property(flare_type flare TYPE)
if(flare_type STREQUAL "STATIC_LIBRARY")
  set(FLARE_PACKAGE_STATIC ON)
else()
  set(FLARE_PACKAGE_STATIC OFF)
endif()
set(flare_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/flare)

install(TARGETS flare EXPORT flareTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY include/flare DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
  FILES_MATCHING PATTERN "*.h")
# Installed, the CLI finds libflare.so beside it, and both find the CUDA runtime where they were
# linked against it.
set_target_properties(flare PROPERTIES INSTALL_RPATH_USE_LINK_PATH ON)
if(TARGET flare_cli)
  install(TARGETS flare_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  set_target_properties(flare_cli PROPERTIES
    INSTALL_RPATH "$ORIGIN/../${CMAKE_INSTALL_LIBDIR}" INSTALL_RPATH_USE_LINK_PATH ON)
endif()

# ---- the CMake package ------------------------------------------------------------------------
install(EXPORT flareTargets NAMESPACE flare:: DESTINATION ${flare_cmake_dir})
configure_package_config_file(cmake/flareConfig.cmake.in
  ${PROJECT_BINARY_DIR}/package/flareConfig.cmake
  INSTALL_DESTINATION ${flare_cmake_dir})
# 0.x releases may break the API between minor versions.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/package/flareConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/package/flareConfig.cmake
              ${PROJECT_BINARY_DIR}/package/flareConfigVersion.cmake
        DESTINATION ${flare_cmake_dir})

# ---- pkg-config -------------------------------------------------------------------------------
# What a plain compiler driver needs besides -lflare. The static library brings its own
# dependencies: OpenMP (the flag, which links the runtime), threads, NCCL where the NCCL
# communicator is built, and the C++ runtime libraries the C++ driver adds and the C driver does
# not (libstdc++ and libm with GCC), so that `cc` can link a C program. The shared library has
# them recorded already. The CUDA runtime is a public dependency either way.
set(FLARE_PC_CFLAGS "")
set(FLARE_PC_LIBS "")
if(FLARE_PACKAGE_STATIC)
  string(APPEND FLARE_PC_LIBS " ${OpenMP_CXX_FLAGS}")
  if(CMAKE_THREAD_LIBS_INIT)
    string(APPEND FLARE_PC_LIBS " ${CMAKE_THREAD_LIBS_INIT}")
  endif()
  if(FLARE_WITH_NCCL)
    get_filename_component(nccl_dir ${FLARE_NCCL_LIBRARY} DIRECTORY)
    string(APPEND FLARE_PC_LIBS " -L${nccl_dir} -lnccl")
  endif()
  foreach(lib IN LISTS CMAKE_CXX_IMPLICIT_LINK_LIBRARIES)
    if(NOT lib IN_LIST CMAKE_C_IMPLICIT_LINK_LIBRARIES)
      if(IS_ABSOLUTE "${lib}" OR lib MATCHES "^-")
        string(APPEND FLARE_PC_LIBS " ${lib}")
      else()
        string(APPEND FLARE_PC_LIBS " -l${lib}")
      endif()
    endif()
  endforeach()
endif()
if(FLARE_WITH_CUDA)
  string(APPEND FLARE_PC_CFLAGS " -DFLARE_WITH_CUDA=1")
  string(APPEND FLARE_PC_LIBS " -L${CUDAToolkit_LIBRARY_DIR} -lcudart")
endif()
# The prefix is found from the .pc file's own location, so the prefix given to
# `cmake --install --prefix` need not be the one configured.
set(flare_pc_dir ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
file(RELATIVE_PATH FLARE_PC_PREFIX_FROM_PCDIR /${flare_pc_dir} /)
string(REGEX REPLACE "/$" "" FLARE_PC_PREFIX_FROM_PCDIR "${FLARE_PC_PREFIX_FROM_PCDIR}")
configure_file(cmake/flare.pc.in ${PROJECT_BINARY_DIR}/package/flare.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/package/flare.pc DESTINATION ${flare_pc_dir})
