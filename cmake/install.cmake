# `cmake --install` and find_package(spillway): the libraries, their public headers, and a package
# config that finds what they link, per component. A consumer writes
#     find_package(spillway REQUIRED COMPONENTS engine)   # or base, allocator, aio, offload, metrics, trainer
#     target_link_libraries(app PRIVATE spillway::engine)
# (no COMPONENTS: every component this build has).
# tests/package builds such a consumer against an installed tree.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(spillway_exported spillway_base spillway_allocator spillway_aio spillway_offload spillway_engine spillway_metrics
    spillway_torch_alloc_core)
set(spillway_header_dirs base allocator aio offload engine metrics torch_alloc)
if(SPILLWAY_WITH_TORCH)
  list(APPEND spillway_exported spillway_torch_alloc spillway_trainer)
  list(APPEND spillway_header_dirs trainer)
endif()
foreach(t IN LISTS spillway_exported)
  string(REPLACE "spillway_" "" short "${t}")
  set_target_properties(${t} PROPERTIES EXPORT_NAME ${short})
  target_include_directories(${t} INTERFACE $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
endforeach()
# Linked privately into the static libraries, so named in the export as link-only: its warning
# flags never reach a consumer's compile lines.
set_target_properties(spillway_warnings PROPERTIES EXPORT_NAME warnings)

# One export set per component, so find_package(spillway COMPONENTS allocator) loads (and finds the
# dependencies of) the allocator and what it links, never torch's or prometheus-cpp's targets.
# spillway_warnings is in base's set: every library links it (link-only).
foreach(t IN LISTS spillway_exported)
  string(REPLACE "spillway_" "" short "${t}")
  set(extra "")
  if(short STREQUAL "base")
    set(extra spillway_warnings)
  endif()
  install(TARGETS ${t} ${extra} EXPORT spillway-${short}-targets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
  install(EXPORT spillway-${short}-targets NAMESPACE spillway:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/spillway)
endforeach()
string(REPLACE "spillway_" "" SPILLWAY_COMPONENTS "${spillway_exported}")
foreach(d IN LISTS spillway_header_dirs)
  # cuda_status.h is for Spillway's own CUDA translation units (it includes the CUDA runtime's
  # header); it is not part of the interface.
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${d}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
          FILES_MATCHING PATTERN "*.h" PATTERN "cuda_status.h" EXCLUDE)
endforeach()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/spillway-config.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/spillway-config.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/spillway)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/spillway-config-version.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/spillway-config.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/spillway-config-version.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/spillway)
