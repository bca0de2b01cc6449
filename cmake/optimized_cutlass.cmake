# The CUTLASS peers of optimized-bench (bench/gemm/cutlass_peers.h; issue 22): CUTLASS GEMMs timed
# beside cuBLAS and our rungs. Benchmark only: nothing of CUTLASS reaches liboptimized_ops.
#
#   OPTIMIZED_CUTLASS      AUTO (default): on when the headers are found and the sm_90a rungs are
#                          built (OPTIMIZED_HAS_SM90A), off silently otherwise; ON: fail naming what is
#                          missing; OFF: never.
#   OPTIMIZED_CUTLASS_DIR  a CUTLASS checkout or install (a folder holding include/cutlass/cutlass.h or
#                          cutlass/cutlass.h). Empty (default): the headers of PyPI's nvidia-cutlass wheel
#                          in .whl/ (scripts/fetch-wheels puts it there; it travels to the GPU machine as
#                          6 MB), extracted once into <build>/_deps/cutlass/include at configure time.
#
# Sets OPTIMIZED_HAS_CUTLASS, OPTIMIZED_CUTLASS_INCLUDE_DIR and OPTIMIZED_CUTLASS_VERSION_TEXT.
set(OPTIMIZED_CUTLASS "AUTO" CACHE STRING "CUTLASS GEMMs as benchmark peers: AUTO, ON, OFF")
set(OPTIMIZED_CUTLASS_DIR "" CACHE PATH "CUTLASS headers (empty: the nvidia-cutlass wheel in .whl/)")
set_property(CACHE OPTIMIZED_CUTLASS PROPERTY STRINGS AUTO ON OFF)

set(OPTIMIZED_HAS_CUTLASS OFF)
set(OPTIMIZED_CUTLASS_INCLUDE_DIR "")
set(OPTIMIZED_CUTLASS_VERSION_TEXT "")

function(_optimized_cutlass_off why)
  if(OPTIMIZED_CUTLASS STREQUAL "ON")
    message(FATAL_ERROR "OPTIMIZED_CUTLASS=ON: ${why}")
  endif()
  message(STATUS "optimized-bench: CUTLASS peers off (${why})")
endfunction()

# The include folder (holding cutlass/ and cute/) found under `root`, or "".
function(_optimized_cutlass_include root out)
  set(found "")
  foreach(candidate "${root}/include" "${root}" "${root}/cutlass_library/source/include")
    if(EXISTS "${candidate}/cutlass/cutlass.h" AND EXISTS "${candidate}/cute/tensor.hpp")
      set(found "${candidate}")
      break()
    endif()
  endforeach()
  set(${out} "${found}" PARENT_SCOPE)
endfunction()

if(NOT OPTIMIZED_CUTLASS STREQUAL "OFF")
  if(NOT OPTIMIZED_HAS_CUDA OR NOT OPTIMIZED_HAS_SM90A)
    _optimized_cutlass_off("needs the CUDA backend with the sm_90a rungs (CMAKE_CUDA_ARCHITECTURES with 90a)")
  else()
    set(_inc "")
    if(OPTIMIZED_CUTLASS_DIR)
      _optimized_cutlass_include("${OPTIMIZED_CUTLASS_DIR}" _inc)
      if(NOT _inc)
        _optimized_cutlass_off("OPTIMIZED_CUTLASS_DIR=${OPTIMIZED_CUTLASS_DIR} holds no cutlass/cutlass.h and cute/tensor.hpp")
      endif()
    else()
      file(GLOB _wheels "${CMAKE_SOURCE_DIR}/.whl/nvidia_cutlass-*.whl")
      list(SORT _wheels)
      if(_wheels)
        list(GET _wheels -1 _wheel)  # the newest version, where several are there
        get_filename_component(_wheel_name "${_wheel}" NAME)
        set(_dest "${CMAKE_BINARY_DIR}/_deps/cutlass")
        set(_stamp "${_dest}/.from")
        set(_have "")
        if(EXISTS "${_stamp}")
          file(READ "${_stamp}" _have)
        endif()
        if(NOT _have STREQUAL _wheel_name)
          message(STATUS "optimized-bench: extracting the CUTLASS headers of ${_wheel_name}")
          file(REMOVE_RECURSE "${_dest}")
          file(ARCHIVE_EXTRACT INPUT "${_wheel}" DESTINATION "${_dest}"
               PATTERNS "cutlass_library/source/include/*")
          file(WRITE "${_stamp}" "${_wheel_name}")
        endif()
        _optimized_cutlass_include("${_dest}" _inc)
        if(NOT _inc)
          _optimized_cutlass_off("${_wheel_name} holds no cutlass_library/source/include")
        endif()
      else()
        _optimized_cutlass_off("no headers: run scripts/fetch-wheels (the nvidia-cutlass wheel into .whl/) or set OPTIMIZED_CUTLASS_DIR")
      endif()
    endif()
    if(_inc)
      file(STRINGS "${_inc}/cutlass/version.h" _ver REGEX "#define CUTLASS_(MAJOR|MINOR|PATCH) [0-9]+")
      string(REGEX REPLACE ".*CUTLASS_MAJOR ([0-9]+).*" "\\1" _major "${_ver}")
      string(REGEX REPLACE ".*CUTLASS_MINOR ([0-9]+).*" "\\1" _minor "${_ver}")
      string(REGEX REPLACE ".*CUTLASS_PATCH ([0-9]+).*" "\\1" _patch "${_ver}")
      if(_major LESS 3)
        _optimized_cutlass_off("CUTLASS ${_major}.${_minor} at ${_inc}: the Hopper peers need CUTLASS 3.x or later")
      else()
        set(OPTIMIZED_HAS_CUTLASS ON)
        set(OPTIMIZED_CUTLASS_INCLUDE_DIR "${_inc}")
        set(OPTIMIZED_CUTLASS_VERSION_TEXT "${_major}.${_minor}.${_patch}")
        message(STATUS "optimized-bench: CUTLASS peers on (CUTLASS ${OPTIMIZED_CUTLASS_VERSION_TEXT}, ${_inc})")
      endif()
    endif()
  endif()
endif()
