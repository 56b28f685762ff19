# Install rules (NSA_INSTALL): the library, its public headers, the CMake package
# (find_package(nsa CONFIG) -> nsa::nsa), a pkg-config file and the licence. The nsa command
# installs itself (tools/CMakeLists.txt).
#
#   <prefix>/include/nsa/*.h
#   <prefix>/<libdir>/libnsa.a                  (libnsa.so with BUILD_SHARED_LIBS=ON)
#   <prefix>/<libdir>/cmake/nsa/nsaConfig.cmake, nsaConfigVersion.cmake, nsaTargets*.cmake
#   <prefix>/<libdir>/pkgconfig/nsa.pc
#   <prefix>/share/doc/nsa/LICENSE
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(NSA_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/nsa)

install(TARGETS nsa EXPORT nsaTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/nsa DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.h")
# nsa::nsa carries its usage requirements: OpenMP::OpenMP_CXX, and with the CUDA backend
# CUDA::cudart and CUDA::cublasLt (nsaConfig.cmake finds them again in the consumer).
install(EXPORT nsaTargets NAMESPACE nsa:: DESTINATION ${NSA_INSTALL_CMAKEDIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/nsaConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/nsaConfig.cmake
                              INSTALL_DESTINATION ${NSA_INSTALL_CMAKEDIR})
# 0.x: a minor version may change the API, so only patch releases of one minor are compatible.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/nsaConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/nsaConfig.cmake ${PROJECT_BINARY_DIR}/nsaConfigVersion.cmake
        DESTINATION ${NSA_INSTALL_CMAKEDIR})

# pkg-config: libnsa is a static library by default, so Libs lists what linking it needs (OpenMP,
# and the CUDA runtime and cuBLASLt when the CUDA backend is in). The prefix is found from the .pc file's own
# place, so the file stays right for `cmake --install --prefix <elsewhere>`.
file(RELATIVE_PATH NSA_PC_PREFIX_FROM_PCDIR ${CMAKE_INSTALL_FULL_LIBDIR}/pkgconfig ${CMAKE_INSTALL_PREFIX})
string(REGEX REPLACE "/$" "" NSA_PC_PREFIX_FROM_PCDIR "${NSA_PC_PREFIX_FROM_PCDIR}")
file(RELATIVE_PATH NSA_PC_LIBDIR ${CMAKE_INSTALL_PREFIX} ${CMAKE_INSTALL_FULL_LIBDIR})
file(RELATIVE_PATH NSA_PC_INCLUDEDIR ${CMAKE_INSTALL_PREFIX} ${CMAKE_INSTALL_FULL_INCLUDEDIR})
set(NSA_PC_LIBS "${OpenMP_CXX_FLAGS}")
if(NSA_WITH_CUDA)
  string(APPEND NSA_PC_LIBS " -L${CUDAToolkit_LIBRARY_DIR} -lcublasLt -lcudart")
endif()
configure_file(${PROJECT_SOURCE_DIR}/cmake/nsa.pc.in ${PROJECT_BINARY_DIR}/nsa.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/nsa.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

install(FILES ${PROJECT_SOURCE_DIR}/LICENSE DESTINATION ${CMAKE_INSTALL_DOCDIR})
