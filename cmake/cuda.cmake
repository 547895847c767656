# CUDA part of the build, included from CMakeLists.txt.
#
# TOPG_CUDA=AUTO compiles csrc/cuda when the installed torch is a CUDA build and nvcc
# is found; ON requires both (a clear error otherwise); OFF never compiles CUDA.
# Architectures: TORCH_CUDA_ARCH_LIST (e.g. "8.0;9.0" or "9.0a") if set, else sm_80 and
# sm_90. No GPU and no cuBLAS/cuSPARSE headers are needed to build.

# Explicit list: a new .cu file is added here.
set(TOPG_CUDA_SOURCES
    csrc/cuda/activation.cu
    csrc/cuda/attention.cu
    csrc/cuda/cache.cu
    csrc/cuda/fused_moe.cu
    csrc/cuda/fused_moe_q.cu
    csrc/cuda/linear.cu
    csrc/cuda/linear_q.cu
    csrc/cuda/moe_topk.cu
    csrc/cuda/norm.cu
    csrc/cuda/paged_attention.cu
    csrc/cuda/rotary.cu
)

set(TOPG_CUDA_ENABLED_JSON false)
set(TOPG_CUDA_ARCHS "")

if(NOT TOPG_CUDA MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "TOPG_CUDA must be AUTO, ON or OFF (got '${TOPG_CUDA}')")
endif()

if(NOT TOPG_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)
  set(_why "")
  if(NOT TORCH_CUDA_VERSION)
    set(_why "torch ${TORCH_VERSION} is not a CUDA build")
  elseif(NOT CMAKE_CUDA_COMPILER)
    set(_why "nvcc was not found (set CUDACXX or put nvcc on PATH)")
  elseif(NOT TOPG_CUDA_SOURCES)
    set(_why "csrc/cuda has no kernels yet")
  endif()
  if(_why)
    if(TOPG_CUDA STREQUAL "ON")
      message(FATAL_ERROR "TOPG_CUDA=ON but ${_why}")
    endif()
    message(STATUS "CUDA kernels: off (${_why})")
  else()
    if(DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND NOT "$ENV{TORCH_CUDA_ARCH_LIST}" STREQUAL "")
      string(REPLACE " " ";" _archs "$ENV{TORCH_CUDA_ARCH_LIST}")
      set(TOPG_CUDA_ARCHS "")
      foreach(_a IN LISTS _archs)
        string(REPLACE "." "" _a "${_a}")
        string(REPLACE "+PTX" "" _a "${_a}")
        list(APPEND TOPG_CUDA_ARCHS "${_a}")
      endforeach()
    else()
      set(TOPG_CUDA_ARCHS "80;90")
    endif()
    set(CMAKE_CUDA_ARCHITECTURES "${TOPG_CUDA_ARCHS}")
    set(CMAKE_CUDA_STANDARD 20)
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    target_sources(topg_C PRIVATE ${TOPG_CUDA_SOURCES})
    set_target_properties(topg_C PROPERTIES CUDA_ARCHITECTURES "${TOPG_CUDA_ARCHS}")
    target_compile_definitions(topg_C PRIVATE TOPG_WITH_CUDA=1)
    target_compile_options(topg_C PRIVATE
      $<$<COMPILE_LANGUAGE:CUDA>:-O3 --expt-relaxed-constexpr -Xcompiler=-fPIC>)
    target_link_libraries(topg_C PRIVATE torch_cuda c10_cuda CUDA::cudart)
    set(TOPG_CUDA_ENABLED_JSON true)
    message(STATUS "CUDA kernels: on, architectures ${TOPG_CUDA_ARCHS}")
  endif()
endif()
