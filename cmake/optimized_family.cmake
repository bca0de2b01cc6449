# optimized_add_family(<family>
#     SOURCES <file>...         entry (validation, dispatch), CPU backend: always built
#     [CUDA_SOURCES <file>...]  CUDA rungs, built when the CUDA backend is on
#     [TORCH_SOURCES <file>...] the family's torch glue (src/torch/<family>_ops.cpp), built with
#                               OPTIMIZED_WITH_TORCH (with torch's include paths and ABI flag)
#     [ISA_SOURCES <file> "<flags>" ...]  CPU sources compiled for one ISA alone (flags separated
#                               by spaces); the family picks one at run time
#
# Each family's folder has one CMakeLists.txt that calls this once; the root CMakeLists lists the
# family folders, never their files. Paths are relative to the calling folder.
function(optimized_add_family family)
  cmake_parse_arguments(F "" "" "SOURCES;CUDA_SOURCES;TORCH_SOURCES;ISA_SOURCES" ${ARGN})
  if(F_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "optimized_add_family(${family}): unknown arguments ${F_UNPARSED_ARGUMENTS}")
  endif()
  list(TRANSFORM F_SOURCES PREPEND "${CMAKE_CURRENT_SOURCE_DIR}/")
  target_sources(optimized_ops PRIVATE ${F_SOURCES})
  list(LENGTH F_ISA_SOURCES n)
  if(n GREATER 0)
    math(EXPR last "${n} - 1")
    foreach(i RANGE 0 ${last} 2)
      math(EXPR j "${i} + 1")
      list(GET F_ISA_SOURCES ${i} file)
      list(GET F_ISA_SOURCES ${j} flags)
      separate_arguments(flags UNIX_COMMAND "${flags}")
      set(file "${CMAKE_CURRENT_SOURCE_DIR}/${file}")
      target_sources(optimized_ops PRIVATE ${file})
      set_source_files_properties(${file} TARGET_DIRECTORY optimized_ops PROPERTIES COMPILE_OPTIONS "${flags}")
    endforeach()
  endif()
  if(OPTIMIZED_HAS_CUDA AND F_CUDA_SOURCES)
    list(TRANSFORM F_CUDA_SOURCES PREPEND "${CMAKE_CURRENT_SOURCE_DIR}/")
    target_sources(optimized_ops PRIVATE ${F_CUDA_SOURCES})
  endif()
  if(OPTIMIZED_WITH_TORCH AND F_TORCH_SOURCES)
    list(TRANSFORM F_TORCH_SOURCES PREPEND "${CMAKE_CURRENT_SOURCE_DIR}/")
    target_sources(optimized_ops PRIVATE ${F_TORCH_SOURCES})
    set_source_files_properties(${F_TORCH_SOURCES} TARGET_DIRECTORY optimized_ops PROPERTIES
      COMPILE_OPTIONS "${OPTIMIZED_TORCH_COMPILE_OPTIONS}"
      COMPILE_DEFINITIONS "${OPTIMIZED_TORCH_COMPILE_DEFINITIONS}")
  endif()
  set_property(GLOBAL APPEND PROPERTY OPTIMIZED_FAMILIES ${family})
endfunction()
