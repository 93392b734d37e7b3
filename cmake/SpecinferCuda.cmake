# Turns on CUDA when SPECINFER_ENABLE_CUDA is set and a CUDA compiler exists; sets
# SPECINFER_WITH_CUDA. The CUDA runtime is linked statically so that importing the extension needs
# no CUDA libraries, and a machine without a GPU or driver just reports zero devices.
set(SPECINFER_WITH_CUDA OFF)
if(SPECINFER_ENABLE_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # sm_70 is gone in CUDA 13; Ampere and Hopper are the targets.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
      set(CMAKE_CUDA_ARCHITECTURES "80;90")
    endif()
    # The tensor-core tree attention needs cp.async and bf16 mma.sync: sm_80 or newer. Fail here,
    # naming the setting, rather than deep in a kernel's compile.
    set(_archs "${CMAKE_CUDA_ARCHITECTURES}")
    if(NOT _archs AND DEFINED ENV{CUDAARCHS})
      set(_archs "$ENV{CUDAARCHS}")
    endif()
    foreach(_arch IN LISTS _archs)
      if((_arch MATCHES "^([0-9]+)" AND CMAKE_MATCH_1 LESS 80) OR _arch MATCHES "^all")
        message(FATAL_ERROR "specinfer's CUDA kernels need sm_80 or newer; the CUDA "
                            "architectures asked for include ${_arch} (CMAKE_CUDA_ARCHITECTURES "
                            "or CUDAARCHS; e.g. 80;90)")
      endif()
    endforeach()
    set(CMAKE_CUDA_RUNTIME_LIBRARY Static)
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(SPECINFER_WITH_CUDA ON)
  else()
    message(STATUS "specinfer: no CUDA compiler found, building the CPU backend only")
  endif()
endif()
