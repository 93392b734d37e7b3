#include <cuda_runtime.h>

#include "ops.h"

namespace specinfer {

// Never raises: no driver, no device or a driver too old all mean zero usable devices.
int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error so later calls start clean
    return 0;
  }
  return count;
}

}  // namespace specinfer
