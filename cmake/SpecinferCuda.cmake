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
    set(CMAKE_CUDA_RUNTIME_LIBRARY Static)
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(SPECINFER_WITH_CUDA ON)
  else()
    message(STATUS "specinfer: no CUDA compiler found, building the CPU backend only")
  endif()
endif()
