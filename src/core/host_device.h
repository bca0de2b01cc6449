// Marks functions that compile for both the host and the device when the translation unit is CUDA
// (params structs whose predicates the kernels call too); plain C++ elsewhere.
#pragma once

#ifdef __CUDACC__
#define OPTIMIZED_HOST_DEVICE __host__ __device__
#else
#define OPTIMIZED_HOST_DEVICE
#endif
