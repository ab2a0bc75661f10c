# What `cmake --install BUILD [--prefix DIR] [--component C]` puts where.
#
#   runtime  bin/mlaverify-server, bin/mlaverify-client
#   client   the C++ client library for schedulers: lib/libmlaverify_*.a,
#            headers under include/mlaverify/ (client/, common/, the generated
#            mlaverify/v1 and grpc/health/v1 stubs), the CMake package
#            (find_package(mlaverify CONFIG) -> mlaverify::client) and the
#            pkg-config module mlaverify-client.pc
#
# The headers live in their own include/mlaverify/ folder: the generated
# grpc/health/v1 headers would otherwise land in the folder of gRPC's own
# include/grpc/. tests/install_consumer_test.sh installs the client into a
# scratch prefix and builds a scheduler against it both ways.
include(CMakePackageConfigHelpers)

install(TARGETS mlaverify-server mlaverify-client RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        COMPONENT runtime)

set(mlaverify_client_targets mlaverify_client mlaverify_proto mlaverify_health_proto
    mlaverify_common)
if(MLAVERIFY_HAVE_CUDA)
  list(APPEND mlaverify_client_targets mlaverify_stream_memops)
endif()
install(TARGETS ${mlaverify_client_targets} EXPORT mlaverifyTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT client)
# The package's one name for the library and what it needs.
add_library(mlaverify_client_package INTERFACE)
set_target_properties(mlaverify_client_package PROPERTIES EXPORT_NAME client)
target_link_libraries(mlaverify_client_package INTERFACE mlaverify_client)
install(TARGETS mlaverify_client_package EXPORT mlaverifyTargets COMPONENT client)

set(mlaverify_include_dir ${CMAKE_INSTALL_INCLUDEDIR}/mlaverify)
set(mlaverify_proto_out ${PROJECT_BINARY_DIR}/proto)  # where proto/ generates the stubs
install(FILES client/client.h client/cuda_shared_memory.h client/gpu_doorbells.h
              client/replica_set.h client/shared_memory.h client/steps.h client/wire.h
        DESTINATION ${mlaverify_include_dir}/client COMPONENT client)
install(DIRECTORY common/ DESTINATION ${mlaverify_include_dir}/common COMPONENT client
        FILES_MATCHING PATTERN "*.h" PATTERN "cli_switch.h" EXCLUDE)
install(FILES ${PROJECT_BINARY_DIR}/generated/common/build_info.h
        DESTINATION ${mlaverify_include_dir}/common COMPONENT client)
install(FILES ${mlaverify_proto_out}/mlaverify/v1/verify.pb.h
              ${mlaverify_proto_out}/mlaverify/v1/verify.grpc.pb.h
        DESTINATION ${mlaverify_include_dir}/mlaverify/v1 COMPONENT client)
install(FILES ${mlaverify_proto_out}/grpc/health/v1/health.pb.h
              ${mlaverify_proto_out}/grpc/health/v1/health.grpc.pb.h
        DESTINATION ${mlaverify_include_dir}/grpc/health/v1 COMPONENT client)
if(MLAVERIFY_HAVE_CUDA)
  install(FILES kernels/stream_memops.h DESTINATION ${mlaverify_include_dir}/kernels
          COMPONENT client)
endif()

set(mlaverify_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/mlaverify)
install(EXPORT mlaverifyTargets NAMESPACE mlaverify:: DESTINATION ${mlaverify_cmake_dir}
        COMPONENT client)
configure_package_config_file(cmake/mlaverifyConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/mlaverifyConfig.cmake
                              INSTALL_DESTINATION ${mlaverify_cmake_dir})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/mlaverifyConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/mlaverifyConfig.cmake
              ${PROJECT_BINARY_DIR}/mlaverifyConfigVersion.cmake
        DESTINATION ${mlaverify_cmake_dir} COMPONENT client)

# pkg-config: the same library for builds without CMake. The CUDA runtime
# (a CUDA build's shared-memory and doorbell code) is linked statically, as
# in the project's own binaries.
set(mlaverify_pc_cuda_libs "")
if(MLAVERIFY_HAVE_CUDA)
  get_target_property(mlaverify_cudart CUDA::cudart_static IMPORTED_LOCATION)
  set(mlaverify_pc_cuda_libs " -lmlaverify_stream_memops ${mlaverify_cudart} -ldl -lrt")
endif()
file(RELATIVE_PATH mlaverify_pc_to_prefix /prefix/${CMAKE_INSTALL_LIBDIR}/pkgconfig /prefix)
string(REGEX REPLACE "/$" "" mlaverify_pc_to_prefix "${mlaverify_pc_to_prefix}")
configure_file(cmake/mlaverify-client.pc.in ${PROJECT_BINARY_DIR}/mlaverify-client.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/mlaverify-client.pc
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT client)
