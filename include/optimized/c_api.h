/* The C API of optimized-ops: plain C (C99) entry points over the C++ library, for engines and
 * languages that cannot take C++ types or exceptions.
 *
 * Rules:
 *   - Every function returns an optimized_status (or a value that cannot fail; the name queries
 *     return NULL past the end, and optimized_variant_name also for an unknown family, saying so in
 *     optimized_last_error()). No C++ exception crosses this boundary: each entry catches
 *     everything and turns it into a status.
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
 * Sections, one per family: GEMM (optimized_matmul), the scaled fp8 GEMM (optimized_scaled_matmul),
 * the fused memory-bound ops (softmax, norms, bias + GELU, SiLU-and-mul; forward and backward), the
 * streaming loader (opaque handles: a shard writer and a loader), attention (forward and backward,
 * fixed length and varlen), the paged KV cache (append with RoPE, decode and prefill attention), linear
 * layers (forward and backward, bias and activation fused), the Mixture-of-Experts layer's forward
 * (optimized_moe), and one variant query for every family (optimized_variant_name / optimized_variant_check), read from the C++ variant tables.
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
  OPTIMIZED_DTYPE_F64 = 6, /* GEMM: CPU rungs cpu_naive and cpu_blocked only */
  OPTIMIZED_DTYPE_F8E5M2 = 7,
  OPTIMIZED_DTYPE_BOOL = 8 /* one byte, 0 or 1: attention masks only */
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

/* GEMM with an epilogue (include/optimized/gemm.h, GemmEpilogue), what a linear layer and its
 * backward fuse into the store of C:
 *   pre = alpha * A @ B + beta * C + bias;  forward: C = act(pre) + residual, aux = pre;
 *   activation_grad != 0: C = pre * act'(aux) + residual (aux read);  column_sums = sums over rows of C.
 * c: a's dtype, or fp32 when a and b are fp16 / bf16; row-major. Each of bias ((N), or (M) with
 * bias_along_m != 0; c's dtype, contiguous), aux and residual (c's shape and dtype, row-major) and
 * column_sums (fp32 (N), or (batch, N) for a rank-3 c) may be NULL. activation: "none" (or NULL),
 * "relu", "gelu", "gelu_tanh", "silu". The variants that fuse epilogues: the CPU rungs, "naive",
 * "register_tiled", "mma_pipeline", "wgmma_persistent" and "auto"; others return UNSUPPORTED. Column
 * sums use a workspace, allocated per call on the stream. Errors name the argument. */
OPTIMIZED_C_EXPORT optimized_status optimized_matmul_epilogue(
    const optimized_tensor* a, const optimized_tensor* b, optimized_tensor* c, const optimized_tensor* bias,
    int32_t bias_along_m, const char* activation, int32_t activation_grad, optimized_tensor* aux,
    const optimized_tensor* residual, optimized_tensor* column_sums, float alpha, float beta, const char* variant,
    void* cuda_stream);

/* Name of GEMM variant `index` (0-based, naive ... best, "auto" excluded), or NULL past the end. */
OPTIMIZED_C_EXPORT const char* optimized_gemm_variant_name(int32_t index);

/* OPTIMIZED_STATUS_OK when GEMM `variant` ("auto" or a name) runs tensors of `dtype` on
 * `device_type`; otherwise INVALID_ARGUMENT (unknown name, or a variant of the other device) or
 * UNSUPPORTED (the dtype), with the reason in optimized_last_error(). Whether a device is present
 * is not checked (optimized_cuda_device_count() tells). */
OPTIMIZED_C_EXPORT optimized_status optimized_gemm_variant_check(const char* variant, int32_t dtype,
                                                                 int32_t device_type);

/* ---- scaled (fp8) GEMM (include/optimized/gemm.h, scaled_matmul) ----------------------------
 * C = (scale_a . A) @ (scale_b . B) + bias
 *   a: (M, K), b: (K, N): fp8, OPTIMIZED_DTYPE_F8E4M3 or OPTIMIZED_DTYPE_F8E5M2 (not both e5m2), each
 *      row- or column-major (unit stride in one of the two dimensions; the Hopper rung reads a
 *      row-major and b column-major, i.e. both K-major, and copies other layouts first).
 *   c: (M, N) fp32, bf16 or fp16, row-major (rows may be further apart than N); products accumulate
 *      in fp32. c may not overlap any input.
 *   scale_a, scale_b: fp32, contiguous, on the operands' device, of any rank whose sizes multiply to
 *      the count of the layout named by scale_a_layout / scale_b_layout:
 *        "tensor"         one scale for the operand                   (1)
 *        "rowwise"        a: one per row; b: one per column           a (M), b (N)
 *        "block_1x128"    per row of a / column of b, per 128 of K     a (M, ceil(K/128)), b (N, ceil(K/128))
 *        "block_128x128"  one per 128 x 128 block                     a (ceil(M/128), ceil(K/128)),
 *                                                                     b (ceil(K/128), ceil(N/128))
 *      (block layouts row-major as shown).
 *   bias: (N) of c's dtype, contiguous, added after the scales; NULL for none.
 * variant: "auto" (or NULL), or a name from optimized_variant_name("scaled_gemm", i): "cpu",
 * "naive", "wgmma_fp8" (compute capability 9.0; refuses B scales in block_1x128). cuda_stream as for
 * optimized_matmul. Errors name the argument (a, b, c, scale_a, scale_a_layout, ..., bias, variant). */
OPTIMIZED_C_EXPORT optimized_status optimized_scaled_matmul(const optimized_tensor* a, const optimized_tensor* b,
                                                            optimized_tensor* c, const optimized_tensor* scale_a,
                                                            const char* scale_a_layout,
                                                            const optimized_tensor* scale_b,
                                                            const char* scale_b_layout, const optimized_tensor* bias,
                                                            const char* variant, void* cuda_stream);

/* ---- every family: one variant query ------------------------------------------------------
 * The families with named variants: "gemm", "fused", "loader", "scaled_gemm", "attention",
 * "kv_cache", "linear", "moe" (the grouped GEMM's rungs, which optimized_moe's variant names). Each
 * query reads the family's C++ variant table (all_gemm_variants(), all_fused_variants(),
 * all_loader_variants(), all_scaled_gemm_variants(), all_attention_variants(), all_kv_cache_variants(),
 * all_linear_variants(), all_grouped_gemm_variants()), so a variant added in C++ is listed here without
 * a C edit. A family name that is not one of these: INVALID_ARGUMENT, with a message naming the
 * families. */

/* Name of family `index` (0-based: "gemm", "fused", "loader", "scaled_gemm", "attention", "kv_cache",
 * "linear", "moe"), or NULL past the end. */
OPTIMIZED_C_EXPORT const char* optimized_family_name(int32_t index);

/* *count = the number of variants of `family` ("auto" excluded). */
OPTIMIZED_C_EXPORT optimized_status optimized_variant_count(const char* family, int32_t* count);

/* Name of variant `index` of `family` (0-based, in ladder order, "auto" excluded); NULL past the
 * end (optimized_last_error() then "") or for an unknown family (optimized_last_error() says why).
 * The string is static. */
OPTIMIZED_C_EXPORT const char* optimized_variant_name(const char* family, int32_t index);

/* OPTIMIZED_STATUS_OK when `family`'s `variant` ("auto" or a name, where the family has "auto")
 * runs data of `dtype` on `device_type`; otherwise INVALID_ARGUMENT (unknown family or name, or a
 * variant of the other device) or UNSUPPORTED (the dtype), the reason in optimized_last_error().
 * Whether a device is present is not checked. The loader's variants take records of any dtype on
 * either device (dtype and device_type must still be valid values). For "gemm" the same as
 * optimized_gemm_variant_check(). For "scaled_gemm" `dtype` is the inputs' (a's and b's): every
 * variant takes OPTIMIZED_DTYPE_F8E4M3 and OPTIMIZED_DTYPE_F8E5M2, and refuses the others
 * (UNSUPPORTED). For "attention" `dtype` is q's (the table's dtypes: fp32 and fp64 refused by flash2,
 * fp64 by every CUDA variant). For "kv_cache" `dtype` is q's (cpu: fp32, fp16, bf16, fp64; "auto" on
 * CUDA: UNSUPPORTED, no CUDA rung yet). For "linear" `dtype` is x's (cpu: fp32, fp16, bf16, fp64; naive:
 * fp32, fp16, bf16; fused, persistent: fp16, bf16; "auto" on CUDA: what naive takes). For "moe"
 * `dtype` is x's (cpu, naive, loop: fp32, fp16, bf16; wgmma: fp16, bf16; "auto": the three). */
OPTIMIZED_C_EXPORT optimized_status optimized_variant_check(const char* family, const char* variant,
                                                            int32_t dtype, int32_t device_type);

/* ---- fused memory-bound ops (include/optimized/fused.h) -----------------------------------
 * Row-wise ops on 2-D views (rows, width) whose last dimension has unit stride and whose rows may
 * be further apart than the width; a 1-D view is one row. One dtype for every data operand of a
 * call (fp32, fp16, bf16; fp64 on the "cpu" variant); mean and rstd are fp32 (rows), contiguous
 * (fp64 for fp64 data).
 * Optional operands are NULL when absent (a non-NULL view of rank 0 is refused: pass NULL).
 * An output may be the very same view as an input of its shape (in place); other overlaps are
 * refused. variant: "auto" (or NULL), "cpu", "unfused", "fused_streaming", "fused_registers"
 * (optimized_fused_variant_name()). cuda_stream as for optimized_matmul: CUDA work is enqueued on
 * it, asynchronously; ignored on the CPU. Errors name the argument (x, y, residual, weight, ...). */

typedef enum optimized_gelu_approximation {
  OPTIMIZED_GELU_NONE = 0, /* gelu(z) = z * Phi(z), with erf (torch's approximate='none') */
  OPTIMIZED_GELU_TANH = 1  /* the tanh form (torch's approximate='tanh') */
} optimized_gelu_approximation;

/* y = softmax(scale * x) over each row; x, y: (rows, width). */
OPTIMIZED_C_EXPORT optimized_status optimized_softmax_forward(const optimized_tensor* x, optimized_tensor* y,
                                                              double scale, const char* variant,
                                                              void* cuda_stream);
/* y = log_softmax(scale * x). */
OPTIMIZED_C_EXPORT optimized_status optimized_log_softmax_forward(const optimized_tensor* x, optimized_tensor* y,
                                                                  double scale, const char* variant,
                                                                  void* cuda_stream);
/* dx = scale * y * (dy - sum(dy * y)) from the forward output y. */
OPTIMIZED_C_EXPORT optimized_status optimized_softmax_backward(const optimized_tensor* y, const optimized_tensor* dy,
                                                               optimized_tensor* dx, double scale,
                                                               const char* variant, void* cuda_stream);
/* dx = scale * (dy - exp(y) * sum(dy)) from the forward output y (log-probabilities). */
OPTIMIZED_C_EXPORT optimized_status optimized_log_softmax_backward(const optimized_tensor* y,
                                                                   const optimized_tensor* dy, optimized_tensor* dx,
                                                                   double scale, const char* variant,
                                                                   void* cuda_stream);

/* y = (h - mean) * rstd * weight + bias, rstd = 1 / sqrt(var + eps) (biased variance), where
 * h = x, or h = x + residual (rounded to the dtype) when residual is given; then residual_out
 * (required with residual, NULL without) receives h. weight, bias: (width) or NULL. mean, rstd:
 * fp32 (rows) outputs (fp64 for fp64 data), or NULL (inference); the backward needs them. eps >= 0. */
OPTIMIZED_C_EXPORT optimized_status optimized_layer_norm_forward(
    const optimized_tensor* x, const optimized_tensor* residual, const optimized_tensor* weight,
    const optimized_tensor* bias, double eps, optimized_tensor* y, optimized_tensor* residual_out,
    optimized_tensor* mean, optimized_tensor* rstd, const char* variant, void* cuda_stream);
/* Gradients of layer_norm: h is what was normalized (x, or residual_out of the add form); mean and
 * rstd (required) as the forward saved them; dresidual_out: the gradient arriving at residual_out
 * (add form; added into dx) or NULL. dx: (rows, width). dweight, dbias: (width) or NULL when not
 * wanted (dweight needs weight). */
OPTIMIZED_C_EXPORT optimized_status optimized_layer_norm_backward(
    const optimized_tensor* dy, const optimized_tensor* h, const optimized_tensor* weight,
    const optimized_tensor* mean, const optimized_tensor* rstd, const optimized_tensor* dresidual_out,
    optimized_tensor* dx, optimized_tensor* dweight, optimized_tensor* dbias, const char* variant,
    void* cuda_stream);

/* y = h * rstd * weight, rstd = 1 / sqrt(mean(h^2) + eps); h, residual, residual_out, weight and
 * rstd as for optimized_layer_norm_forward. */
OPTIMIZED_C_EXPORT optimized_status optimized_rms_norm_forward(
    const optimized_tensor* x, const optimized_tensor* residual, const optimized_tensor* weight, double eps,
    optimized_tensor* y, optimized_tensor* residual_out, optimized_tensor* rstd, const char* variant,
    void* cuda_stream);
/* Gradients of rms_norm (rstd required), as for optimized_layer_norm_backward. */
OPTIMIZED_C_EXPORT optimized_status optimized_rms_norm_backward(
    const optimized_tensor* dy, const optimized_tensor* h, const optimized_tensor* weight,
    const optimized_tensor* rstd, const optimized_tensor* dresidual_out, optimized_tensor* dx,
    optimized_tensor* dweight, const char* variant, void* cuda_stream);

/* y = gelu(x + bias); bias: (width) or NULL; approximate: an optimized_gelu_approximation. */
OPTIMIZED_C_EXPORT optimized_status optimized_bias_gelu_forward(const optimized_tensor* x,
                                                                const optimized_tensor* bias,
                                                                int32_t approximate, optimized_tensor* y,
                                                                const char* variant, void* cuda_stream);
/* dx = dy * gelu'(x + bias); dbias = sum over rows of dx, or NULL when not wanted. */
OPTIMIZED_C_EXPORT optimized_status optimized_bias_gelu_backward(const optimized_tensor* dy,
                                                                 const optimized_tensor* x,
                                                                 const optimized_tensor* bias, int32_t approximate,
                                                                 optimized_tensor* dx, optimized_tensor* dbias,
                                                                 const char* variant, void* cuda_stream);

/* x: (rows, 2 * d) = [a | b]; y: (rows, d) = silu(a) * b. */
OPTIMIZED_C_EXPORT optimized_status optimized_silu_and_mul_forward(const optimized_tensor* x, optimized_tensor* y,
                                                                   const char* variant, void* cuda_stream);
/* dy: (rows, d); x: the forward input (rows, 2 * d); dx: (rows, 2 * d). */
OPTIMIZED_C_EXPORT optimized_status optimized_silu_and_mul_backward(const optimized_tensor* dy,
                                                                    const optimized_tensor* x, optimized_tensor* dx,
                                                                    const char* variant, void* cuda_stream);

/* Name of fused variant `index` (0-based: "cpu", "unfused", ..., "auto" excluded), or NULL past
 * the end. */
OPTIMIZED_C_EXPORT const char* optimized_fused_variant_name(int32_t index);
/* Name of fused op `index` (0-based: "softmax", "log_softmax", "layer_norm", "rms_norm",
 * "add_layer_norm", "add_rms_norm", "bias_gelu", "silu_and_mul"), or NULL past the end: the `op`
 * names the two queries below take. */
OPTIMIZED_C_EXPORT const char* optimized_fused_op_name(int32_t index);
/* *variant = the variant "auto" runs for `op` on rows of `width` elements of `dtype` on the device
 * (device_type, device_index); backward and aligned_rows (every row of every operand starts on a
 * 16-byte boundary) are 0 or 1. The string is static. */
OPTIMIZED_C_EXPORT optimized_status optimized_fused_resolve_variant(const char* op, int32_t dtype,
                                                                    int32_t device_type, int32_t device_index,
                                                                    int64_t width, int32_t backward,
                                                                    int32_t aligned_rows, const char** variant);
/* *max_width = the longest row "fused_registers" holds for `op` and `dtype` (0: the op has no row
 * reduction, or the dtype none of its kernels); longer rows need "fused_streaming". */
OPTIMIZED_C_EXPORT optimized_status optimized_fused_registers_max_width(const char* op, int32_t dtype,
                                                                        int32_t backward, int32_t aligned_rows,
                                                                        int64_t* max_width);

/* ---- the streaming loader (include/optimized/loader.h) ------------------------------------
 * A dataset is a directory of shard files of fixed-size records (docs/perf-notes/loader.md).
 * optimized_shard_writer writes one; optimized_loader streams batches of its records into host or
 * CUDA memory, with batches read ahead in the background. Handles are opaque; use each from one
 * thread at a time. Every function returns a status; errors name the argument, or the file and
 * record, in optimized_last_error(). */

#define OPTIMIZED_SHARD_MAX_RANK 8 /* record shapes have at most 8 dimensions */

typedef struct optimized_shard_writer optimized_shard_writer;
typedef struct optimized_loader optimized_loader;

/* Starts a dataset in `dir` (created if missing; holding shard files already: INVALID_ARGUMENT
 * unless overwrite, which deletes them). dtype: "uint8", "int8", "int16", "uint16", "int32",
 * "uint32", "int64", "float16", "bfloat16", "float32", "float64"; record_shape: record_rank
 * (0 .. OPTIMIZED_SHARD_MAX_RANK) sizes (NULL when 0: scalar records); records_per_shard >= 1.
 * Until optimized_shard_writer_close() succeeds the dataset is marked incomplete and cannot be
 * opened. On success *writer is a new handle, to be ended by _close or _abort. */
OPTIMIZED_C_EXPORT optimized_status optimized_shard_writer_create(optimized_shard_writer** writer, const char* dir,
                                                                  const char* dtype, int32_t record_rank,
                                                                  const int64_t* record_shape,
                                                                  uint64_t records_per_shard, int32_t overwrite);
/* Appends `count` records (record_bytes each, packed) from host memory. A failure while writing
 * (disk full, I/O error) aborts the dataset (left incomplete, with the reason); later calls on this
 * writer fail, and only _abort (or _close, which then reports the failure) ends it. */
OPTIMIZED_C_EXPORT optimized_status optimized_shard_writer_append(optimized_shard_writer* writer,
                                                                  const void* records, uint64_t count);
/* Bytes per record (dtype size * prod(record_shape)) and records appended so far. */
OPTIMIZED_C_EXPORT optimized_status optimized_shard_writer_info(const optimized_shard_writer* writer,
                                                                uint64_t* record_bytes, uint64_t* records_written);
/* Finishes every shard and header and removes the incomplete marker; *num_records and *num_shards
 * (each may be NULL) receive what was written. Frees the handle, whether it succeeds or not. */
OPTIMIZED_C_EXPORT optimized_status optimized_shard_writer_close(optimized_shard_writer* writer,
                                                                 uint64_t* num_records, uint64_t* num_shards);
/* Stops writing and leaves the dataset visibly incomplete ("aborted after N records: why"; why may
 * be NULL). Frees the handle. */
OPTIMIZED_C_EXPORT optimized_status optimized_shard_writer_abort(optimized_shard_writer* writer, const char* why);

/* Loader options; optimized_loader_options_default() fills the C++ defaults. Strings are read
 * during optimized_loader_create() only; NULL means the default. */
typedef struct optimized_loader_options {
  int64_t batch_size;        /* records per batch (>= 1; default 1) */
  int32_t device_type;       /* where batches are delivered: an optimized_device_type (default CPU) */
  int32_t device_index;      /* CUDA ordinal */
  int32_t shuffle;           /* 1: a permutation of all records per epoch, from (seed, epoch) */
  int32_t drop_last;         /* 1: full batches only (every rank yields as many) */
  uint64_t seed;
  int32_t rank;              /* data-parallel rank in [0, world_size) */
  int32_t world_size;
  uint64_t epochs;           /* 0: no limit */
  uint64_t start_epoch;      /* resume here: a position from optimized_loader_position() */
  uint64_t start_batch;
  const char* variant;       /* "pipelined" (default) or "synchronous" */
  int32_t prefetch;          /* batches in flight ahead of the consumer (>= 1) */
  int32_t threads;           /* worker threads; 0: from the core count */
  int32_t queue_depth;       /* io_uring reads in flight */
  int32_t verify;            /* 1: check every record's CRC32C as it arrives */
  uint64_t chunk_bytes;      /* largest single read (a multiple of 4096) */
  const char* io;            /* "auto", "io_uring", "pread", "mmap" */
  const char* direct_io;     /* "auto", "on", "off" (O_DIRECT) */
  const char* gds;           /* "auto", "on", "off" (GPUDirect Storage) */
  uint64_t staging_bytes;    /* the most host memory the staging ring may hold */
  int32_t worker;            /* interleaving over consumers: batches worker, worker + num_workers, ... */
  int32_t num_workers;
} optimized_loader_options;

/* Fills *options with the defaults of the C++ LoaderOptions. */
OPTIMIZED_C_EXPORT optimized_status optimized_loader_options_default(optimized_loader_options* options);

/* Opens the dataset in `dir` (every shard's header and size checked: a missing directory, a
 * missing, truncated or extra shard, or an incomplete dataset fail, naming the file) and starts
 * reading. options: NULL for the defaults. On success *loader is a new handle. */
OPTIMIZED_C_EXPORT optimized_status optimized_loader_create(optimized_loader** loader, const char* dir,
                                                            const optimized_loader_options* options);

/* One batch, as optimized_loader_next() returns it. */
typedef struct optimized_batch {
  void* data;               /* records * record_bytes bytes, packed; CUDA memory for a CUDA loader */
  int64_t records;          /* records in the batch; 0 at the end of an epoch */
  uint64_t bytes;
  const uint64_t* indices;  /* the dataset index of each record, in batch order */
  uint64_t epoch, batch;    /* the batch's position (end_of_epoch: where the next call continues) */
  int32_t end_of_epoch;     /* 1: no batch (the epoch ended; the next call starts the next one) */
  int32_t device_type, device_index;
  void* ready_event;        /* CUDA: the cudaEvent_t recorded after the copy into data; NULL on the CPU */
} optimized_batch;

/* The next batch of the current epoch, or end_of_epoch = 1 once at the end of each epoch (and
 * always after the last epoch when options.epochs is set). The memory and the indices stay valid
 * until the next call of optimized_loader_next() or optimized_loader_destroy() on this loader. CUDA: the batch
 * is copied asynchronously; cuda_stream (a cudaStream_t, NULL: the legacy default stream) is made
 * to wait for the copy, so work queued on it after this call sees the batch (synchronize it before
 * reading from the host); the memory is reused only after the work queued on that stream before the
 * call that releases the batch, so the stream must live until then. A read or checksum failure names the shard file and the record;
 * the loader then keeps failing until optimized_loader_seek(). */
OPTIMIZED_C_EXPORT optimized_status optimized_loader_next(optimized_loader* loader, void* cuda_stream,
                                                          optimized_batch* batch);
/* Where the next batch comes from: batch `*batch` of epoch `*epoch`. Save it to resume (with
 * optimized_loader_get_info()'s fingerprint, which identifies the dataset). */
OPTIMIZED_C_EXPORT optimized_status optimized_loader_position(const optimized_loader* loader, uint64_t* epoch,
                                                              uint64_t* batch);
/* Continues at (epoch, batch): what a new loader created with start_epoch, start_batch reads. */
OPTIMIZED_C_EXPORT optimized_status optimized_loader_seek(optimized_loader* loader, uint64_t epoch,
                                                          uint64_t batch);
/* Stops the reads and frees the staging memory; the current batch stays valid. Later
 * optimized_loader_next() calls fail. */
OPTIMIZED_C_EXPORT optimized_status optimized_loader_stop(optimized_loader* loader);
/* Stops the loader and frees the handle (and the current batch). NULL: no effect. */
OPTIMIZED_C_EXPORT void optimized_loader_destroy(optimized_loader* loader);

/* What a loader reads. The strings live as long as the loader. */
typedef struct optimized_loader_info {
  uint64_t num_records;      /* in the dataset */
  uint64_t record_bytes;
  uint64_t num_shards;
  const char* dtype;         /* the records' element type ("int32", ...) */
  int32_t record_rank;
  int64_t record_shape[OPTIMIZED_SHARD_MAX_RANK];
  uint64_t fingerprint;      /* identifies the dataset's contents, for resuming */
  uint64_t batches_per_epoch;/* this rank's (this worker's) */
  uint64_t records_per_epoch;
  const char* io_backend;    /* "io_uring", "pread", "mmap" or "cufile" */
  int32_t direct_io;         /* 1: O_DIRECT in use */
  int32_t gds;               /* 1: reads go to GPU memory through cuFile */
  int32_t prefetch;          /* slots in the staging ring */
  uint64_t staging_bytes;
} optimized_loader_info;

OPTIMIZED_C_EXPORT optimized_status optimized_loader_get_info(const optimized_loader* loader,
                                                              optimized_loader_info* info);

typedef struct optimized_loader_stats {
  uint64_t batches;          /* handed to the consumer */
  uint64_t record_bytes;     /* record bytes handed to the consumer */
  uint64_t read_bytes;       /* bytes read from storage */
  double consumer_wait_s;    /* time optimized_loader_next() spent waiting */
} optimized_loader_stats;

OPTIMIZED_C_EXPORT optimized_status optimized_loader_get_stats(const optimized_loader* loader,
                                                               optimized_loader_stats* stats);

/* Reads and checks every shard and every record's checksum (a full scrub); the first mismatch
 * names the file and the record. */
OPTIMIZED_C_EXPORT optimized_status optimized_dataset_verify(const char* dir);

/* ---- attention (include/optimized/attention.h) -------------------------------------------
 * out = softmax(S) V with S = score(Q K^T), forward and backward; the ladder "cpu", "naive",
 * "flash", "flash2", "hopper" (optimized_variant_name("attention", i); hopper: sm_90a, head dims 64 and 128), "auto"
 * (or NULL): cpu on the CPU, on
 * CUDA flash2 where it runs the call (fp16 / bf16), else flash.
 *
 * Layouts (every view: last dimension of unit stride, other strides free, so (B, S, H, D) and
 * (B, H, S, D) memory both run without a copy):
 *   fixed length: q (B, S_q, H_q, D); k, v (B, S_k, H_kv, D); out, dout, dq: q's shape; dk, dv: k's;
 *                 lse (B, H_q, S_q) fp32 (fp64 for fp64), unit stride along S_q.
 *   varlen:       q (total_q, H_q, D); k, v (total_k, H_kv, D); cu_seqlens_q / _k int32 (B + 1),
 *                 contiguous, on the tensors' device (cu[0] = 0, non-decreasing, cu[B] = total);
 *                 max_seqlen_q / _k at least the longest sequence; lse (H_q, total_q).
 * Dtypes: fp16, bf16 on every variant; fp32 on cpu, naive, flash; fp64 on cpu. H_q a multiple of
 * H_kv (GQA / MQA). Head dims: any on cpu; on CUDA multiples of 8 up to 256. The score of query i
 * and key j, the window, soft-cap, ALiBi and mask rules, and the rows with no visible key (out 0,
 * lse -inf) are those of include/optimized/attention.h. Outputs may not overlap any operand.
 * lse may be NULL in a forward (not written); the backward requires the forward's. cuda_stream as
 * for optimized_matmul. CUDA variants that need scratch (naive; flash2's backward) allocate it on
 * the stream per call. Errors name the argument (q, k, v, out, lse, mask, alibi_slopes, window_left,
 * softcap, cu_seqlens_q, variant, ...). */

typedef struct optimized_attention_options {
  double softmax_scale;  /* NaN: 1 / sqrt(D); any finite value is used as given */
  int32_t causal;        /* 0 or 1 */
  int32_t top_left;      /* 0: causal / window aligned bottom-right (flash-attn: query i sees keys
                            j <= i + S_k - S_q); 1: top-left (torch SDPA: j <= i) */
  int64_t window_left;   /* sliding window in keys around the aligned diagonal; -1: unbounded */
  int64_t window_right;
  double softcap;        /* > 0: s = softcap * tanh(s / softcap); 0: off */
  const optimized_tensor* alibi_slopes; /* fp32 (H_q) or (B, H_q); NULL: off */
  const optimized_tensor* mask; /* fixed length only: 4-D, broadcastable to (B, H_q, S_q, S_k) (size-1
                                   or stride-0 dimensions broadcast), bool (nonzero: attend) or
                                   additive (q's dtype or fp32); NULL: none */
  int32_t deterministic;        /* backward: 1 gives the same bits on every run (no atomics) */
  int32_t skip_cu_seqlens_check; /* varlen on CUDA: 0 reads cu_seqlens back to the host (a sync) and
                                    checks them (skipped while the stream is being captured); 1
                                    trusts them. The CPU always checks. */
} optimized_attention_options;

/* Fills *options with the defaults: softmax_scale NaN, no causal / window / softcap / ALiBi / mask,
 * bottom-right alignment, nondeterministic backward, cu_seqlens checked. Start from these (a
 * zeroed struct means softmax_scale 0). */
OPTIMIZED_C_EXPORT optimized_status optimized_attention_options_default(optimized_attention_options* options);

/* out (and lse, when not NULL) from q, k, v. options: NULL for the defaults. */
OPTIMIZED_C_EXPORT optimized_status optimized_attention_forward(const optimized_tensor* q, const optimized_tensor* k,
                                                                const optimized_tensor* v, optimized_tensor* out,
                                                                optimized_tensor* lse,
                                                                const optimized_attention_options* options,
                                                                const char* variant, void* cuda_stream);
/* dq, dk, dv from dout and the forward's q, k, v, out and lse, with the forward's options. GQA: dk,
 * dv summed over each group of query heads. */
OPTIMIZED_C_EXPORT optimized_status optimized_attention_backward(
    const optimized_tensor* dout, const optimized_tensor* q, const optimized_tensor* k, const optimized_tensor* v,
    const optimized_tensor* out, const optimized_tensor* lse, optimized_tensor* dq, optimized_tensor* dk,
    optimized_tensor* dv, const optimized_attention_options* options, const char* variant, void* cuda_stream);
/* The packed forms (options->mask must be NULL). */
OPTIMIZED_C_EXPORT optimized_status optimized_attention_varlen_forward(
    const optimized_tensor* q, const optimized_tensor* k, const optimized_tensor* v,
    const optimized_tensor* cu_seqlens_q, const optimized_tensor* cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, optimized_tensor* out, optimized_tensor* lse, const optimized_attention_options* options,
    const char* variant, void* cuda_stream);
OPTIMIZED_C_EXPORT optimized_status optimized_attention_varlen_backward(
    const optimized_tensor* dout, const optimized_tensor* q, const optimized_tensor* k, const optimized_tensor* v,
    const optimized_tensor* cu_seqlens_q, const optimized_tensor* cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, const optimized_tensor* out, const optimized_tensor* lse, optimized_tensor* dq,
    optimized_tensor* dk, optimized_tensor* dv, const optimized_attention_options* options, const char* variant,
    void* cuda_stream);

/* *variant = the variant "auto" runs for `dtype` and `head_dim` on the device (device_type,
 * device_index). The string is static. */
OPTIMIZED_C_EXPORT optimized_status optimized_attention_resolve_variant(int32_t dtype, int64_t head_dim,
                                                                        int32_t device_type, int32_t device_index,
                                                                        const char** variant);

/* ---- KV cache (include/optimized/kv_cache.h) ----------------------------------------------
 * The paged KV cache of autoregressive decoding: K and V pages (num_pages, page_size, H_kv, D),
 * page_size 1 to 256, last dimension contiguous; a page table (B, max_pages_per_seq) int32 maps page
 * p of sequence b to a cache page (token t lives in page page_table[b][t / page_size], slot
 * t % page_size); seq_lens (B) int32. Pages fp16, bf16, fp32 (fp64 on cpu), or fp8 e4m3 with fp32
 * (H_kv) k_scale / v_scale (value = fp8 * scale). The ladder: "cpu" (optimized_variant_name
 * ("kv_cache", i)), "auto" (or NULL): cpu on the CPU; CUDA tensors: UNSUPPORTED until the CUDA rungs
 * come.
 *
 * Append: k, v (B, S_new, H_kv, D) written at positions (B, S_new) int32 (< 0: padding, skipped);
 * with rope, k is rotated before it is stored and q (B, S_new, H_q, D), when not NULL, is rotated in
 * place. Decode: q (B, q_len, H_q, D), q_len 1 to 8, the last q_len tokens of each sequence (already
 * appended), causal inside them; out like q; lse (B, H_q, q_len) fp32 or NULL. A sequence of length
 * 0 (or a query that sees no key) gives out 0 and lse -inf. With validate (the default) the page
 * table, positions and seq_lens are read back and checked (INVALID_ARGUMENT naming the entry);
 * without, nothing is read back and out-of-range pages are never read (masked). Errors name the
 * argument (k_pages, page_table, positions, seq_lens, q, out, rope.rotary_dim, window_left, ...). */

typedef enum optimized_rope_layout {
  OPTIMIZED_ROPE_NONE = 0,
  OPTIMIZED_ROPE_NEOX = 1,        /* pairs (x[i], x[i + rotary_dim / 2]): GPT-NeoX, Llama in HF */
  OPTIMIZED_ROPE_INTERLEAVED = 2  /* pairs (x[2i], x[2i + 1]): GPT-J, Llama's original */
} optimized_rope_layout;

/* The cache as views. k_scale, v_scale: NULL unless the pages are fp8 e4m3. */
typedef struct optimized_kv_cache {
  const optimized_tensor* k_pages;
  const optimized_tensor* v_pages;
  const optimized_tensor* k_scale;
  const optimized_tensor* v_scale;
} optimized_kv_cache;

typedef struct optimized_kv_append_options {
  int32_t rope;          /* an optimized_rope_layout */
  double rope_theta;     /* angle of pair i: position * rope_theta^(-2i / rotary_dim) */
  int64_t rotary_dim;    /* 0: head_dim; else even, <= head_dim; dimensions past it pass through */
  int32_t validate;      /* 1: read page_table / positions back and check them; 0: trust them */
} optimized_kv_append_options;

typedef struct optimized_decode_options {
  double softmax_scale;  /* NaN: 1 / sqrt(D) */
  int64_t window_left;   /* keys more than window_left before a query's position are masked; -1: none */
  double softcap;        /* > 0: s = softcap * tanh(s / softcap); 0: off */
  const optimized_tensor* alibi_slopes; /* fp32 (H_q) or (B, H_q); NULL: off */
  int32_t validate;      /* 1: read page_table / seq_lens back and check them; 0: trust them */
} optimized_decode_options;

/* The defaults: no rope, theta 10000, rotary_dim 0, validate 1. */
OPTIMIZED_C_EXPORT optimized_status optimized_kv_append_options_default(optimized_kv_append_options* options);
/* The defaults: softmax_scale NaN, no window / softcap / ALiBi, validate 1 (a zeroed struct means
 * softmax_scale 0 and no validation: start from these). */
OPTIMIZED_C_EXPORT optimized_status optimized_decode_options_default(optimized_decode_options* options);

/* Writes k, v into the cache's pages (and rotates q in place when not NULL and rope is on).
 * options: NULL for the defaults. */
OPTIMIZED_C_EXPORT optimized_status optimized_kv_cache_append(const optimized_kv_cache* cache,
                                                              const optimized_tensor* k, const optimized_tensor* v,
                                                              const optimized_tensor* page_table,
                                                              const optimized_tensor* positions, optimized_tensor* q,
                                                              const optimized_kv_append_options* options,
                                                              const char* variant, void* cuda_stream);

/* out (and lse, when not NULL) of q over the cached tokens. options: NULL for the defaults. */
OPTIMIZED_C_EXPORT optimized_status optimized_paged_attention_decode(const optimized_tensor* q,
                                                                     const optimized_kv_cache* cache,
                                                                     const optimized_tensor* page_table,
                                                                     const optimized_tensor* seq_lens,
                                                                     optimized_tensor* out, optimized_tensor* lse,
                                                                     const optimized_decode_options* options,
                                                                     const char* variant, void* cuda_stream);

/* Prefill over the cache (chunked prefill): as optimized_paged_attention_decode with q
 * (B, S_new, H_q, D) of any S_new >= 1, the chunk right-aligned to each sequence's end
 * (include/optimized/kv_cache.h, paged_attention_prefill). */
OPTIMIZED_C_EXPORT optimized_status optimized_paged_attention_prefill(const optimized_tensor* q,
                                                                      const optimized_kv_cache* cache,
                                                                      const optimized_tensor* page_table,
                                                                      const optimized_tensor* seq_lens,
                                                                      optimized_tensor* out, optimized_tensor* lse,
                                                                      const optimized_decode_options* options,
                                                                      const char* variant, void* cuda_stream);

/* ---- linear layers (include/optimized/linear.h) ------------------------------------------
 * y = act(x W^T + b) and its backward, on the GEMM with its epilogue.
 *   x, input (..., K): leading dimensions flattened to M rows (M may be 0), uniformly strided, unit
 *                      stride along K
 *   weight (N, K):     row-major (torch.nn.Linear's layout); K, N >= 1
 *   bias (N):          contiguous; NULL for none
 *   y, pre (..., N):   x's leading dimensions; pre = x W^T + b, written when not NULL
 * One dtype for every operand (fp32, fp16, bf16; fp64 on "cpu"), except grad_weight and grad_bias,
 * which may be fp32 for 16-bit inputs (master gradients); products accumulate in fp32 (fp64 for
 * fp64). The ladder (optimized_variant_name("linear", i)): "cpu", "naive", "fused" (fp16 / bf16),
 * "persistent" (Hopper, fp16 / bf16, 16-byte aligned rows); "auto" (or NULL): cpu on the CPU, the GEMM
 * family's choice on CUDA. Outputs may not overlap any operand. cuda_stream as for optimized_matmul.
 * Errors name the argument (x, weight, bias, y, pre, grad_output, input, grad_input, activation,
 * variant, ...). */

/* The activation of the epilogue: the same values as the C++ optimized::Activation. */
typedef enum optimized_activation {
  OPTIMIZED_ACTIVATION_NONE = 0,
  OPTIMIZED_ACTIVATION_RELU = 1,      /* max(z, 0) */
  OPTIMIZED_ACTIVATION_GELU = 2,      /* z * Phi(z), with erf (torch's gelu, approximate='none') */
  OPTIMIZED_ACTIVATION_GELU_TANH = 3, /* the tanh form (approximate='tanh') */
  OPTIMIZED_ACTIVATION_SILU = 4       /* z * sigmoid(z) */
} optimized_activation;

/* y = act(x W^T + b); pre (NULL: not written) = x W^T + b. activation: an optimized_activation. */
OPTIMIZED_C_EXPORT optimized_status optimized_linear_forward(const optimized_tensor* x, const optimized_tensor* weight,
                                                             const optimized_tensor* bias, optimized_tensor* y,
                                                             optimized_tensor* pre, int32_t activation,
                                                             const char* variant, void* cuda_stream);

/* With g = grad_output (no activation) or grad_output * act'(pre): grad_input = g W (..., K),
 * grad_weight = g^T input (N, K), grad_bias = the sums of g over the rows (N, in a fixed order: the
 * same bits every run); each NULL: not computed. pre: the forward's, or NULL with an activation to
 * recompute it from input, weight and bias (bias then the forward's; NULL: it had none). accumulate
 * (0 or 1): 1 adds dW and db to what grad_weight and grad_bias hold. No rows (M = 0): grad_weight and
 * grad_bias are zeroed (left as they are with accumulate). */
OPTIMIZED_C_EXPORT optimized_status optimized_linear_backward(
    optimized_tensor* grad_input, optimized_tensor* grad_weight, optimized_tensor* grad_bias,
    const optimized_tensor* grad_output, const optimized_tensor* input, const optimized_tensor* weight,
    const optimized_tensor* pre, const optimized_tensor* bias, int32_t activation, int32_t accumulate,
    const char* variant, void* cuda_stream);

/* The same two with fp8 GEMMs (include/optimized/linear.h, LinearForwardOptions::fp8): x and
 * weight quantized to e4m3, the gradient to e5m2, each with per-tensor current scaling (the scale
 * fp8_max / max|t| of its own values in this call); products in fp32, the epilogue as above.
 * Variants "auto", "cpu", "naive", "persistent" (Hopper); fp32, fp16, bf16 inputs. */
OPTIMIZED_C_EXPORT optimized_status optimized_linear_forward_fp8(const optimized_tensor* x,
                                                                 const optimized_tensor* weight,
                                                                 const optimized_tensor* bias, optimized_tensor* y,
                                                                 optimized_tensor* pre, int32_t activation,
                                                                 const char* variant, void* cuda_stream);
OPTIMIZED_C_EXPORT optimized_status optimized_linear_backward_fp8(
    optimized_tensor* grad_input, optimized_tensor* grad_weight, optimized_tensor* grad_bias,
    const optimized_tensor* grad_output, const optimized_tensor* input, const optimized_tensor* weight,
    const optimized_tensor* pre, const optimized_tensor* bias, int32_t activation, int32_t accumulate,
    const char* variant, void* cuda_stream);

/* ---- Mixture of Experts (include/optimized/moe.h, moe_forward) ---------------------------------
 * The forward of an MoE feed-forward layer with SwiGLU experts:
 *   logits = x @ router_weight^T (fp32); top-k routing; the (token, expert) pairs sorted by expert
 *   (capacity: each expert keeps its first pairs, earlier tokens first); per expert e, for its tokens:
 *   y = (silu(x @ G_e) * (x @ U_e)) @ D_e with w13[e] = [G_e | U_e], w2[e] = D_e;
 *   out[t] = sum_j weight[t, j] y[t, j] (dropped pairs add nothing; fp32 sums, the same bits every run).
 *   x (T, d):               fp32, fp16 or bf16; unit stride along d, rows any stride apart
 *   router_weight (E, d):   x's dtype, or fp32 (fp32 with 16-bit x: CPU only for now, UNSUPPORTED on
 *                           CUDA); unit stride along d
 *   w13 (E, d, 2F):         x's dtype, any strides (the wgmma rung wants unit stride along 2F, F a
 *                           multiple of 8)
 *   w2 (E, F, d):           x's dtype, any strides
 *   out (T, d):             x's dtype; unit stride along d
 *   tokens_per_expert (E):  int32, contiguous, or NULL: the pairs each expert processed (after the
 *                           capacity)
 *   dropped (1):            int32, or NULL: the pairs the capacity dropped
 * E at most 1024; 1 <= top_k <= min(E, 32). variant: the grouped GEMM's, "auto" (or NULL) or a name
 * from optimized_variant_name("moe", i): "cpu", "naive", "loop" (one GEMM per expert: reads the
 * offsets back, a synchronisation), "wgmma" (Hopper, fp16 / bf16). cuda_stream as for optimized_matmul:
 * no step synchronises the host except the "loop" rung (which "auto" picks on CUDA devices without
 * wgmma, outside stream capture). The intermediates live in a workspace allocated per call on the
 * stream. Outputs may not overlap any operand. Errors name the argument (x, router_weight, w13, w2,
 * out, tokens_per_expert, dropped, top_k, options.scoring, topk_softmax, routed_scale, capacity_factor,
 * variant, ...). */

/* The router's scores: the same values as the C++ optimized::MoeScoring. */
typedef enum optimized_moe_scoring {
  OPTIMIZED_MOE_SCORING_SOFTMAX = 0, /* softmax over the E logits */
  OPTIMIZED_MOE_SCORING_SIGMOID = 1  /* sigmoid of each logit */
} optimized_moe_scoring;

typedef struct optimized_moe_options {
  int32_t top_k;           /* experts per token */
  int32_t scoring;         /* an optimized_moe_scoring */
  int32_t topk_softmax;    /* 1: choose on the logits, weights = the softmax over the chosen k (Mixtral's
                              order; softmax scoring only) */
  int32_t normalize;       /* 1: weights / their sum over the k */
  float routed_scale;      /* weights * routed_scale (after normalize) */
  double capacity_factor;  /* <= 0: dropless; > 0: each expert keeps ceil(capacity_factor T k / E) pairs */
} optimized_moe_options;

/* Fills *options with the defaults of the C++ MoeLayerOptions: top_k 2, softmax, no topk_softmax, no
 * normalize, routed_scale 1, dropless. */
OPTIMIZED_C_EXPORT optimized_status optimized_moe_options_default(optimized_moe_options* options);

/* out (and tokens_per_expert, dropped, when not NULL) of the layer. options: NULL for the defaults. */
OPTIMIZED_C_EXPORT optimized_status optimized_moe(const optimized_tensor* x, const optimized_tensor* router_weight,
                                                  const optimized_tensor* w13, const optimized_tensor* w2,
                                                  optimized_tensor* out, optimized_tensor* tokens_per_expert,
                                                  optimized_tensor* dropped, const optimized_moe_options* options,
                                                  const char* variant, void* cuda_stream);

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
