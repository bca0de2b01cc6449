# optimized_add_family(<family>
#     SOURCES <file>...         entry (validation, dispatch), CPU backend: always built
#     [CUDA_SOURCES <file>...]  CUDA rungs, built when the CUDA backend is on, for
#                               CMAKE_CUDA_ARCHITECTURES (default 90a)
#     [SM90A_SOURCES <file>...] the Hopper rungs (wgmma, TMA, setmaxnreg): built for sm_90a alone
#                               when OPTIMIZED_HAS_SM90A (root CMakeLists), else left out; the family's
#                               variant table gates them on OPTIMIZED_WITH_SM90A and compute capability 9.0
#     [TORCH_SOURCES <file>...] the family's torch glue (src/torch/<family>_ops.cpp), built with
#                               OPTIMIZED_WITH_TORCH (with torch's include paths and ABI flag)
#     [ISA_SOURCES <file> "<flags>" ...]  CPU sources compiled for one ISA alone (flags separated
#                               by spaces); the family picks one at run time
#     [DTYPE_SOURCES <header> <function> ...]  CUDA templates instantiated for the dtypes of
#                               OPTIMIZED_DTYPES: per pair, a generated translation unit includes
#                               <header> and holds OPTIMIZED_DTYPE_INSTANCE(<function>, <kDType>) for
#                               each dtype (cmake/dtype_instance.cu.in); a trimmed build skips the others
#     [PER_DTYPE_SOURCES <header> <function> ...]  the same, one translation unit per dtype: for the
#                               heavy templates, so that each dtype's kernels compile in parallel
#
# Each family's folder has one CMakeLists.txt that calls this once; the root CMakeLists lists the
# family folders, never their files. Paths are relative to the calling folder.
set(_optimized_family_dir "${CMAKE_CURRENT_LIST_DIR}")

# OPTIMIZED_DTYPES (root CMakeLists): checked once, handed to the sources as OPTIMIZED_BUILT_<DTYPE>
# and OPTIMIZED_DTYPES_LIST (the option's text); src/core/dtypes_built.h reads them.
set(_optimized_dtype_enum_f32 kF32)
set(_optimized_dtype_enum_f16 kF16)
set(_optimized_dtype_enum_bf16 kBF16)
if(NOT OPTIMIZED_DTYPES)
  message(FATAL_ERROR "OPTIMIZED_DTYPES is empty: expected a list of f32, f16, bf16 (default f32;f16;bf16)")
endif()
foreach(dtype IN LISTS OPTIMIZED_DTYPES)
  if(NOT DEFINED _optimized_dtype_enum_${dtype})
    message(FATAL_ERROR "OPTIMIZED_DTYPES: expected a list of f32, f16, bf16; given '${dtype}' in '${OPTIMIZED_DTYPES}'")
  endif()
  string(TOUPPER "${dtype}" upper)
  target_compile_definitions(optimized_ops PRIVATE OPTIMIZED_BUILT_${upper}=1)
endforeach()
# No comma in a definition: nvcc splits -D values at commas.
string(REPLACE ";" "+" _optimized_dtypes_list "${OPTIMIZED_DTYPES}")
target_compile_definitions(optimized_ops PRIVATE "OPTIMIZED_DTYPES_LIST=\"${_optimized_dtypes_list}\"")

# Generates the translation units of DTYPE_SOURCES (split FALSE) or PER_DTYPE_SOURCES (split TRUE)
# in the calling family's binary folder and adds them to the library.
function(_optimized_dtype_instances pairs split)
  list(LENGTH pairs n)
  if(n EQUAL 0)
    return()
  endif()
  file(RELATIVE_PATH folder "${CMAKE_SOURCE_DIR}/src" "${CMAKE_CURRENT_SOURCE_DIR}")
  math(EXPR last "${n} - 1")
  foreach(i RANGE 0 ${last} 2)
    math(EXPR j "${i} + 1")
    list(GET pairs ${i} header)
    list(GET pairs ${j} function)
    set(OPTIMIZED_INSTANCE_HEADER "${folder}/${header}")
    set(OPTIMIZED_INSTANCE_FUNCTION "${function}")
    set(groups "${OPTIMIZED_DTYPES}")
    if(NOT split)
      string(REPLACE ";" "," groups "${OPTIMIZED_DTYPES}")  # one group: every dtype
    endif()
    foreach(group IN LISTS groups)
      string(REPLACE "," ";" dtypes "${group}")
      set(OPTIMIZED_INSTANCES "")
      foreach(dtype IN LISTS dtypes)
        string(APPEND OPTIMIZED_INSTANCES "OPTIMIZED_DTYPE_INSTANCE(${function}, ${_optimized_dtype_enum_${dtype}})\n")
      endforeach()
      set(OPTIMIZED_INSTANCE_DTYPES "${group}")
      if(split)
        set(out "${CMAKE_CURRENT_BINARY_DIR}/generated/${function}_${group}.cu")
      else()
        set(out "${CMAKE_CURRENT_BINARY_DIR}/generated/${function}.cu")
      endif()
      configure_file("${_optimized_family_dir}/dtype_instance.cu.in" "${out}" @ONLY)
      target_sources(optimized_ops PRIVATE "${out}")
    endforeach()
  endforeach()
endfunction()

# The sm_90a sources of every family: one object library compiled for sm_90a alone (an
# architecture is a target's property, not a source's), with the library's definitions, include
# paths and options, its objects linked into optimized_ops.
function(_optimized_sm90a_library)
  if(TARGET optimized_ops_sm90a)
    return()
  endif()
  add_library(optimized_ops_sm90a OBJECT)
  set_target_properties(optimized_ops_sm90a PROPERTIES CUDA_ARCHITECTURES 90a POSITION_INDEPENDENT_CODE ON)
  target_compile_definitions(optimized_ops_sm90a PRIVATE $<TARGET_PROPERTY:optimized_ops,COMPILE_DEFINITIONS>)
  target_include_directories(optimized_ops_sm90a PRIVATE $<TARGET_PROPERTY:optimized_ops,INCLUDE_DIRECTORIES>)
  target_compile_options(optimized_ops_sm90a PRIVATE $<TARGET_PROPERTY:optimized_ops,COMPILE_OPTIONS>)
  target_link_libraries(optimized_ops_sm90a PRIVATE CUDA::cudart)
  target_sources(optimized_ops PRIVATE $<TARGET_OBJECTS:optimized_ops_sm90a>)
endfunction()

function(optimized_add_family family)
  cmake_parse_arguments(F "" "" "SOURCES;CUDA_SOURCES;SM90A_SOURCES;TORCH_SOURCES;ISA_SOURCES;DTYPE_SOURCES;PER_DTYPE_SOURCES" ${ARGN})
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
  if(OPTIMIZED_HAS_SM90A AND F_SM90A_SOURCES)
    list(TRANSFORM F_SM90A_SOURCES PREPEND "${CMAKE_CURRENT_SOURCE_DIR}/")
    _optimized_sm90a_library()
    target_sources(optimized_ops_sm90a PRIVATE ${F_SM90A_SOURCES})
  endif()
  if(OPTIMIZED_HAS_CUDA)
    _optimized_dtype_instances("${F_DTYPE_SOURCES}" FALSE)
    _optimized_dtype_instances("${F_PER_DTYPE_SOURCES}" TRUE)
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
