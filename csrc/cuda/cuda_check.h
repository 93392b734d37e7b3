// Error checking and device selection for the CUDA entry points.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace specinfer::cuda {

inline void check(cudaError_t err, const char* op, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(op) + ": " + what + " failed: " + cudaGetErrorString(err));
  }
}

// Makes `device` current for the scope of a call and restores the caller's device after.
class DeviceGuard {
 public:
  DeviceGuard(int device, const char* op) {
    check(cudaGetDevice(&previous_), op, "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), op, "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace specinfer::cuda
