# Builds and runs tests/package/consumer against nsa, as ctest's package_install and
# package_subdirectory tests (tests/package/CMakeLists.txt):
#   cmake -DMODE=install|subdirectory -DNSA_SOURCE_DIR=... -DNSA_BINARY_DIR=... -DWORK_DIR=...
#         -DNSA_VERSION=... -DGENERATOR=... -DCXX_COMPILER=... [-DEXPECT_CLI=ON]
#         [-DRUNTIME_LIBRARY_DIRS=<dir>] -P run_consumer.cmake
# install: `cmake --install` of the build into WORK_DIR/prefix, then the consumer through
#   find_package(nsa CONFIG), through pkg-config (when pkg-config is on the PATH), and the
#   installed `nsa --version`.
# subdirectory: the consumer with add_subdirectory(nsa) and nsa's defaults (NSA_CUDA=OFF to keep
#   it quick): it must get the library and none of nsa's tests, tools or benchmarks, and keep
#   its own (empty) build type.
cmake_minimum_required(VERSION 3.25)
foreach(var MODE NSA_SOURCE_DIR WORK_DIR NSA_VERSION GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_consumer.cmake: -D${var}=... is required")
  endif()
endforeach()
cmake_host_system_information(RESULT jobs QUERY NUMBER_OF_LOGICAL_CORES)
set(consumer_src ${NSA_SOURCE_DIR}/tests/package/consumer)

# Runs a command; fails the test with its output when it fails. OUT receives stdout.
function(run OUT)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " cmd "${ARGN}")
    message(FATAL_ERROR "failed (${rc}): ${cmd}\n${out}\n${err}")
  endif()
  set(${OUT} "${out}" PARENT_SCOPE)
endfunction()

# Configures, builds and runs the consumer in WORK_DIR/<name> with extra -D arguments.
function(build_and_run_consumer name)
  set(dir ${WORK_DIR}/${name})
  run(out ${CMAKE_COMMAND} -S ${consumer_src} -B ${dir} -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX_COMPILER} ${ARGN})
  message(STATUS "${name}: configured")
  run(out ${CMAKE_COMMAND} --build ${dir} --parallel ${jobs})
  run(out ${dir}/nsa_consumer)
  if(NOT out MATCHES "nsa consumer: ok")
    message(FATAL_ERROR "${name}: the consumer ran but did not print \"nsa consumer: ok\":\n${out}")
  endif()
  message(STATUS "${name}: ${out}")
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

if(MODE STREQUAL "install")
  set(prefix ${WORK_DIR}/prefix)
  run(out ${CMAKE_COMMAND} --install ${NSA_BINARY_DIR} --prefix ${prefix})
  file(GLOB config ${prefix}/*/cmake/nsa/nsaConfig.cmake ${prefix}/*/*/cmake/nsa/nsaConfig.cmake)
  if(NOT config)
    message(FATAL_ERROR "no <libdir>/cmake/nsa/nsaConfig.cmake under ${prefix}")
  endif()
  get_filename_component(cmakedir ${config} DIRECTORY)
  get_filename_component(libdir ${cmakedir}/../.. ABSOLUTE)
  foreach(file ${prefix}/include/nsa/nsa.h ${prefix}/include/nsa/api.h ${cmakedir}/nsaConfigVersion.cmake
               ${cmakedir}/nsaTargets.cmake ${libdir}/pkgconfig/nsa.pc ${prefix}/share/doc/nsa/LICENSE)
    if(NOT EXISTS ${file})
      message(FATAL_ERROR "not installed: ${file}")
    endif()
  endforeach()

  if(EXPECT_CLI)
    run(out ${prefix}/bin/nsa --version)
    if(NOT out MATCHES "^nsa ${NSA_VERSION}\n")
      message(FATAL_ERROR "the installed `nsa --version` printed \"${out}\", expected \"nsa ${NSA_VERSION}\" first")
    endif()
    message(STATUS "installed nsa --version: ${out}")
  endif()

  build_and_run_consumer(find_package -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${prefix})

  find_program(PKG_CONFIG NAMES pkg-config pkgconf)
  if(PKG_CONFIG)
    set(ENV{PKG_CONFIG_PATH} ${libdir}/pkgconfig)
    run(version ${PKG_CONFIG} --modversion nsa)
    string(STRIP "${version}" version)
    if(NOT version STREQUAL NSA_VERSION)
      message(FATAL_ERROR "pkg-config --modversion nsa gave \"${version}\", expected ${NSA_VERSION}")
    endif()
    run(flags ${PKG_CONFIG} --cflags --libs nsa)
    string(STRIP "${flags}" flags)
    separate_arguments(flags UNIX_COMMAND "${flags}")
    run(out ${CXX_COMPILER} -std=c++17 ${consumer_src}/main.cpp -o ${WORK_DIR}/pkg_config_consumer ${flags})
    run(out ${CMAKE_COMMAND} -E env "LD_LIBRARY_PATH=${RUNTIME_LIBRARY_DIRS}:$ENV{LD_LIBRARY_PATH}"
        ${WORK_DIR}/pkg_config_consumer)
    if(NOT out MATCHES "nsa consumer: ok")
      message(FATAL_ERROR "pkg-config consumer: no \"nsa consumer: ok\" in:\n${out}")
    endif()
    message(STATUS "pkg-config (${flags}): ${out}")
  else()
    message(STATUS "pkg-config is not on the PATH: the nsa.pc check is left out")
  endif()
elseif(MODE STREQUAL "subdirectory")
  # No build type, as many engines configure: nsa must not force its own (Release) on the parent,
  # and unoptimised files (bar the CPU kernels, -O3 always) halve the time of this build.
  build_and_run_consumer(add_subdirectory -DCMAKE_BUILD_TYPE= -DNSA_CONSUMER_MODE=subdirectory
                         -DNSA_SOURCE_DIR=${NSA_SOURCE_DIR} -DNSA_CUDA=OFF)
else()
  message(FATAL_ERROR "MODE must be install or subdirectory, got ${MODE}")
endif()
