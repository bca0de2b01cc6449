/* The C API of optimized-ops: plain C (C99) entry points over the C++ library, for engines and
 * languages that cannot take C++ types or exceptions.
 *
 * Rules:
 *   - Every function returns an optimized_status (or a value that cannot fail). No C++ exception
 *     crosses this boundary: each entry catches everything and turns it into a status.
 *   - On failure, optimized_last_error() returns a message that names the argument, what was
 *     expected and what was given ("b: expected 17 rows to match a's columns (K); ..."). The
 *     message is thread-local and describes the most recent call made on this thread; a call
 *     that succeeds sets it to "".
 *   - Tensors are described by optimized_tensor, a non-owning view that mirrors the C++
 *     optimized::TensorView: a data pointer, a dtype, a device, and up to 6 dimensions with
 *     strides in elements. The library never allocates, frees or keeps these pointers.
 *   - CUDA work is enqueued on the given stream (a cudaStream_t passed as void*; NULL is the
 *     legacy default stream) and is asynchronous: synchronize the stream before reading results.
 *
 * Example (C = A @ B, fp32 on the CPU, contiguous row-major):
 *
 *     int64_t sa[2] = {M, K}, sb[2] = {K, N}, sc[2] = {M, N};
 *     optimized_tensor a, b, c;
 *     optimized_tensor_contiguous(&a, pa, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, sa);
 *     optimized_tensor_contiguous(&b, pb, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, sb);
 *     optimized_tensor_contiguous(&c, pc, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, sc);
 *     if (optimized_matmul(&a, &b, &c, 1.0f, 0.0f, "auto", NULL) != OPTIMIZED_STATUS_OK)
 *       fprintf(stderr, "matmul: %s\n", optimized_last_error());
 */
#ifndef OPTIMIZED_C_API_H
#define OPTIMIZED_C_API_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define OPTIMIZED_C_EXPORT __declspec(dllexport)
#else
#define OPTIMIZED_C_EXPORT __attribute__((visibility("default")))
#endif

/* Bumped when a struct layout or a signature changes. */
#define OPTIMIZED_C_API_VERSION 1
#define OPTIMIZED_MAX_RANK 6

/* Status codes: the same values as the C++ optimized::Status. */
typedef enum optimized_status {
  OPTIMIZED_STATUS_OK = 0,
  OPTIMIZED_STATUS_INVALID_ARGUMENT = 1, /* a shape, dtype, device, stride or alignment the op cannot take */
  OPTIMIZED_STATUS_UNSUPPORTED = 2,      /* valid input, but not for this variant or this build */
  OPTIMIZED_STATUS_CUDA_ERROR = 3,       /* a CUDA runtime or library call failed */
  OPTIMIZED_STATUS_OUT_OF_MEMORY = 4,
  OPTIMIZED_STATUS_INTERNAL = 5
} optimized_status;

/* Element types: the same values as the C++ optimized::DType. */
typedef enum optimized_dtype {
  OPTIMIZED_DTYPE_F32 = 0,
  OPTIMIZED_DTYPE_F16 = 1,
  OPTIMIZED_DTYPE_BF16 = 2,
  OPTIMIZED_DTYPE_F8E4M3 = 3,
  OPTIMIZED_DTYPE_I32 = 4,
  OPTIMIZED_DTYPE_I64 = 5,
  OPTIMIZED_DTYPE_F64 = 6  /* GEMM: CPU rungs cpu_naive and cpu_blocked only */
} optimized_dtype;

typedef enum optimized_device_type {
  OPTIMIZED_DEVICE_CPU = 0,
  OPTIMIZED_DEVICE_CUDA = 1
} optimized_device_type;

/* Non-owning view of a strided tensor (mirrors optimized::TensorView). Fixed-width fields so the
 * layout is the same for every C compiler. */
typedef struct optimized_tensor {
  void* data;                          /* first element; host or device memory */
  int32_t dtype;                       /* an optimized_dtype */
  int32_t device_type;                 /* an optimized_device_type */
  int32_t device_index;                /* CUDA ordinal; 0 for the CPU */
  int32_t rank;                        /* 0 .. OPTIMIZED_MAX_RANK */
  int64_t shape[OPTIMIZED_MAX_RANK];   /* sizes, outermost first */
  int64_t strides[OPTIMIZED_MAX_RANK]; /* in elements, not bytes */
} optimized_tensor;

/* Fills *t as a contiguous row-major view of `rank` dimensions `shape`. INVALID_ARGUMENT (and *t
 * left as it was) for a negative size, or a shape whose strides, element count or size in bytes do
 * not fit int64. Every entry that takes an optimized_tensor checks the same of its shape and
 * strides (offsets of the elements reached and their byte span) before reading it. */
OPTIMIZED_C_EXPORT optimized_status optimized_tensor_contiguous(optimized_tensor* t, void* data,
                                                                optimized_dtype dtype,
                                                                optimized_device_type device_type,
                                                                int32_t device_index, int32_t rank,
                                                                const int64_t* shape);

/* GEMM: C = alpha * A @ B + beta * C on row-major matrices with leading dimensions.
 *   a: (M, K) or (batch, M, K)   b: (K, N) or (batch, K, N)   c: (M, N) or (batch, M, N)
 * The last dimension of every operand must have unit stride; rows may be further apart than the
 * width. A batch of 1 (or a 2-D operand) on a or b is broadcast over c's batch. a, b and c share
 * one dtype (fp32, fp16 or bf16) and one device; products accumulate in fp32. When beta == 0,
 * C is not read. variant: "auto" (or NULL), or a name from optimized_gemm_variant_name().
 * cuda_stream: a cudaStream_t for CUDA tensors (NULL: the legacy default stream); ignored on the
 * CPU. */
OPTIMIZED_C_EXPORT optimized_status optimized_matmul(const optimized_tensor* a, const optimized_tensor* b,
                                                     optimized_tensor* c, float alpha, float beta,
                                                     const char* variant, void* cuda_stream);

/* Name of GEMM variant `index` (0-based, naive ... best, "auto" excluded), or NULL past the end. */
OPTIMIZED_C_EXPORT const char* optimized_gemm_variant_name(int32_t index);

/* OPTIMIZED_STATUS_OK when GEMM `variant` ("auto" or a name) runs tensors of `dtype` on
 * `device_type`; otherwise INVALID_ARGUMENT (unknown name, or a variant of the other device) or
 * UNSUPPORTED (the dtype), with the reason in optimized_last_error(). Whether a device is present
 * is not checked (optimized_cuda_device_count() tells). */
OPTIMIZED_C_EXPORT optimized_status optimized_gemm_variant_check(const char* variant, int32_t dtype,
                                                                 int32_t device_type);

/* The message of the most recent call on this thread; "" when it succeeded. Valid until the next
 * call into the library on this thread. Never NULL. */
OPTIMIZED_C_EXPORT const char* optimized_last_error(void);

/* A short name for a status code ("ok", "invalid argument", ...). Never NULL. */
OPTIMIZED_C_EXPORT const char* optimized_status_string(optimized_status status);

/* 1 when the library was built with its CUDA backend, 0 otherwise. */
OPTIMIZED_C_EXPORT int32_t optimized_built_with_cuda(void);
/* Number of usable CUDA devices (0 without CUDA, a driver or a device). Never fails. */
OPTIMIZED_C_EXPORT int32_t optimized_cuda_device_count(void);
/* OPTIMIZED_C_API_VERSION of the library that is loaded. */
OPTIMIZED_C_EXPORT int32_t optimized_c_api_version(void);

#ifdef __cplusplus
}
#endif

#endif /* OPTIMIZED_C_API_H */
