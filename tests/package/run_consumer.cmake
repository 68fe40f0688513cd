# ctest's package.find_package: installs this build into a fresh prefix, then configures, builds and
# runs tests/package/consumer against it, then tests/package/allocator_consumer (one component,
# no torch). Inputs: BUILD_DIR, SOURCE_DIR, WORK_DIR, TORCH_DIR (the
# libtorch this build used; empty without it).
file(REMOVE_RECURSE "${WORK_DIR}")
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${err}")
  endif()
endfunction()
run(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${WORK_DIR}/prefix")
run(${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/package/consumer" -B "${WORK_DIR}/build"
    "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix" "-DTorch_DIR=${TORCH_DIR}"
    "-DSPILLWAY_INCLUDE_DIR=${WORK_DIR}/prefix/include" -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build "${WORK_DIR}/build" -j 2)
run("${WORK_DIR}/build/consumer")
# spillway::allocator alone, where no torch can be found: find_package(spillway COMPONENTS allocator)
# must look for none of torch, nlohmann-json or prometheus-cpp.
run(${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/package/allocator_consumer" -B "${WORK_DIR}/allocator-build"
    "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix" -DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON
    -DCMAKE_DISABLE_FIND_PACKAGE_nlohmann_json=ON -DCMAKE_DISABLE_FIND_PACKAGE_prometheus-cpp=ON
    -DCMAKE_BUILD_TYPE=Release)
run(${CMAKE_COMMAND} --build "${WORK_DIR}/allocator-build" -j 2)
run("${WORK_DIR}/allocator-build/allocator_consumer")
# A component that does not exist: refused, naming it and the components there are.
execute_process(COMMAND ${CMAKE_COMMAND} -S "${SOURCE_DIR}/tests/package/allocator_consumer"
                        -B "${WORK_DIR}/nosuch-build" "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix" -DASK=nosuch
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "no component 'nosuch'; the components are:")
  message(FATAL_ERROR "find_package(spillway COMPONENTS nosuch) was not refused by name (${rc}):\n${err}")
endif()
