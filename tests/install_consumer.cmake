# ctest "example_cpp_consumer": installs the library into a scratch prefix, builds examples/cpp (a
# project that only says find_package(optimized_ops)) against it and runs it: the README's C++
# section, as a user follows it.
#   cmake -DBUILD_DIR=... -DSOURCE_DIR=... -DGENERATOR=... -P install_consumer.cmake
set(work "${BUILD_DIR}/_example_cpp_consumer")
file(REMOVE_RECURSE "${work}")
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${err}")
  endif()
endfunction()
step(${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${work}/prefix")
step(${CMAKE_COMMAND} -S "${SOURCE_DIR}/examples/cpp" -B "${work}/build" -G "${GENERATOR}"
     -DCMAKE_PREFIX_PATH=${work}/prefix -DCMAKE_BUILD_TYPE=Release)
step(${CMAKE_COMMAND} --build "${work}/build")
step("${work}/build/app")
