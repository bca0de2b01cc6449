/* The C API used from a C program (C11): status codes, the thread-local last-error message,
 * every error path naming its argument, and the results of every family against a double-precision
 * reference on fresh random inputs with poisoned outputs, on the CPU (and CUDA, when a device is
 * present):
 *   - GEMM: every variant, odd shapes, strided A, broadcast B;
 *   - the scaled (fp8) GEMM: a small product worked out by hand, through each CPU variant name (and on
 *     CUDA when a device is present), B row- and column-major, with and without bias, block scales
 *     into bf16, and its refusals;
 *   - fused: softmax, log_softmax, layer_norm, rms_norm (plain and with residual), bias_gelu (erf and
 *     tanh), silu_and_mul, forward and backward, odd sizes, padded rows, optional operands present
 *     and absent;
 *   - the generic variant query of every family, against the GEMM-specific and fused-specific ones;
 *   - the MoE layer (optimized_moe): a two-token layer worked out by hand, dropless and with a capacity
 *     that drops a pair, and its refusals;
 *   - the loader: a dataset written through the shard writer into a temporary directory, read back
 *     (every record exactly once per epoch, shuffled, over ranks, each I/O engine), resumed from a
 *     saved position, and refused when the directory is missing, a shard is truncated, a record is
 *     corrupt or the writer aborted.
 *
 * Prints one line per check and closes with "N passed, N failed"; exits non-zero on failure. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, truncate, pwrite, opendir */
#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "optimized/c_api.h"

#ifdef OPTIMIZED_TEST_CUDA
#include <cuda_runtime_api.h>
#endif

static int g_passed = 0, g_failed = 0;

static void check(int ok, const char* what, const char* detail) {
  if (ok) {
    ++g_passed;
    printf("ok    %s\n", what);
  } else {
    ++g_failed;
    printf("FAIL  %s%s%s\n", what, detail ? ": " : "", detail ? detail : "");
  }
}

/* ---- data ---------------------------------------------------------------------------------- */

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static float uniform(void) { /* [-1, 1), never all zeros */
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return (float)((double)(g_rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static uint16_t float_to_bf16(float f) { /* round to nearest even */
  uint32_t bits;
  memcpy(&bits, &f, 4);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return (uint16_t)(bits >> 16);
}
static float bf16_to_float(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

/* Values of element i of a buffer of dtype (fp32 or bf16). */
static double load(const void* p, int32_t dtype, int64_t i) {
  return dtype == OPTIMIZED_DTYPE_F32 ? (double)((const float*)p)[i] : (double)bf16_to_float(((const uint16_t*)p)[i]);
}

static size_t elem_size(int32_t dtype) { return dtype == OPTIMIZED_DTYPE_F32 ? 4 : 2; }

static void* random_buffer(int32_t dtype, int64_t count) {
  void* p = malloc((size_t)count * elem_size(dtype));
  for (int64_t i = 0; i < count; ++i) {
    const float v = uniform();
    if (dtype == OPTIMIZED_DTYPE_F32) ((float*)p)[i] = v;
    else ((uint16_t*)p)[i] = float_to_bf16(v);
  }
  return p;
}

static void* poisoned_buffer(int32_t dtype, int64_t count) { /* 0xFF bytes: NaN in every float dtype */
  void* p = malloc((size_t)count * elem_size(dtype));
  memset(p, 0xFF, (size_t)count * elem_size(dtype));
  return p;
}

/* ---- a GEMM case: batch x (M x K) @ (K x N), A rows lda apart, B broadcast when b_batch == 1 -- */

typedef struct {
  int64_t batch, m, n, k, lda, b_batch;
  int32_t dtype;
} gemm_case;

/* Compares c (batch, M, N contiguous) with the double reference; the bound is the one of the C++
 * check: out_eps * |ref| + 8 * sqrt(K) * 2^-24 * sum_k |a b|. Returns the worst error / bound. */
static double worst_ratio(const gemm_case* g, const void* a, const void* b, const void* c) {
  const double out_eps = g->dtype == OPTIMIZED_DTYPE_F32 ? ldexp(1.0, -24) : ldexp(1.0, -8);
  double worst = 0;
  for (int64_t p = 0; p < g->batch; ++p)
    for (int64_t i = 0; i < g->m; ++i)
      for (int64_t j = 0; j < g->n; ++j) {
        double ref = 0, mag = 0;
        for (int64_t q = 0; q < g->k; ++q) {
          const double x = load(a, g->dtype, p * g->m * g->lda + i * g->lda + q);
          const double y = load(b, g->dtype, (g->b_batch == 1 ? 0 : p) * g->k * g->n + q * g->n + j);
          ref += x * y;
          mag += fabs(x * y);
        }
        const double got = load(c, g->dtype, (p * g->m + i) * g->n + j);
        const double bound = out_eps * fabs(ref) + 8.0 * sqrt((double)g->k) * ldexp(1.0, -24) * mag + 1e-30;
        const double r = fabs(got - ref) / bound;
        if (!(r <= worst)) worst = isnan(r) ? INFINITY : r;
      }
  return worst;
}

static void fill_views(const gemm_case* g, void* a, void* b, void* c, optimized_tensor* ta, optimized_tensor* tb,
                       optimized_tensor* tc, int32_t device_type) {
  /* A: (batch, M, K) with rows lda apart (a strided view when lda > K). */
  memset(ta, 0, sizeof *ta);
  ta->data = a;
  ta->dtype = g->dtype;
  ta->device_type = device_type;
  ta->rank = 3;
  ta->shape[0] = g->batch, ta->shape[1] = g->m, ta->shape[2] = g->k;
  ta->strides[0] = g->m * g->lda, ta->strides[1] = g->lda, ta->strides[2] = 1;
  const int64_t sb[3] = {g->b_batch, g->k, g->n}, sc[3] = {g->batch, g->m, g->n};
  optimized_tensor_contiguous(tb, b, (optimized_dtype)g->dtype, (optimized_device_type)device_type, 0, 3, sb);
  optimized_tensor_contiguous(tc, c, (optimized_dtype)g->dtype, (optimized_device_type)device_type, 0, 3, sc);
}

/* NaN in the row padding of A (columns K..lda-1): a kernel that reads it fails the check. */
static void poison_padding(const gemm_case* g, void* a) {
  for (int64_t r = 0; r < g->batch * g->m; ++r)
    memset((char*)a + (size_t)(r * g->lda + g->k) * elem_size(g->dtype), 0xFF,
           (size_t)(g->lda - g->k) * elem_size(g->dtype));
}

static void run_cpu_case(const gemm_case* g, const char* variant) {
  void* a = random_buffer(g->dtype, g->batch * g->m * g->lda);
  poison_padding(g, a);
  void* b = random_buffer(g->dtype, g->b_batch * g->k * g->n);
  void* c = poisoned_buffer(g->dtype, g->batch * g->m * g->n);
  optimized_tensor ta, tb, tc;
  fill_views(g, a, b, c, &ta, &tb, &tc, OPTIMIZED_DEVICE_CPU);
  char what[160], detail[512];
  snprintf(what, sizeof what, "cpu %-11s %s batch %lld (b batch %lld) %lldx%lldx%lld lda %lld", variant,
           g->dtype == OPTIMIZED_DTYPE_F32 ? "fp32" : "bf16", (long long)g->batch, (long long)g->b_batch,
           (long long)g->m, (long long)g->n, (long long)g->k, (long long)g->lda);
  const optimized_status s = optimized_matmul(&ta, &tb, &tc, 1.0f, 0.0f, variant, NULL);
  if (s != OPTIMIZED_STATUS_OK) {
    snprintf(detail, sizeof detail, "status %s: %s", optimized_status_string(s), optimized_last_error());
    check(0, what, detail);
  } else {
    const double r = worst_ratio(g, a, b, c);
    snprintf(detail, sizeof detail, "worst error / allowed = %g", r);
    check(r <= 1.0, what, detail);
  }
  free(a), free(b), free(c);
}

#ifdef OPTIMIZED_TEST_CUDA
/* Whether device 0 is compute capability 9.0 (where the sm_90a rungs run). */
static int device_is_sm90(void) {
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
  return major == 9 && minor == 0;
}

static void run_cuda_case(const gemm_case* g, const char* variant) {
  const size_t es = elem_size(g->dtype);
  const int64_t na = g->batch * g->m * g->lda, nb = g->b_batch * g->k * g->n, nc = g->batch * g->m * g->n;
  void* a = random_buffer(g->dtype, na);
  poison_padding(g, a);
  void* b = random_buffer(g->dtype, nb);
  void* c = poisoned_buffer(g->dtype, nc);
  void *da = NULL, *db = NULL, *dc = NULL;
  cudaStream_t stream = NULL;
  char what[160], detail[512];
  snprintf(what, sizeof what, "cuda %-14s %s batch %lld %lldx%lldx%lld lda %lld", variant,
           g->dtype == OPTIMIZED_DTYPE_F32 ? "fp32" : "bf16", (long long)g->batch, (long long)g->m, (long long)g->n,
           (long long)g->k, (long long)g->lda);
  if (cudaStreamCreate(&stream) != cudaSuccess || cudaMalloc(&da, na * es) != cudaSuccess ||
      cudaMalloc(&db, nb * es) != cudaSuccess || cudaMalloc(&dc, nc * es) != cudaSuccess) {
    check(0, what, "cudaMalloc / cudaStreamCreate failed");
  } else {
    cudaMemcpy(da, a, na * es, cudaMemcpyHostToDevice);
    cudaMemcpy(db, b, nb * es, cudaMemcpyHostToDevice);
    cudaMemcpy(dc, c, nc * es, cudaMemcpyHostToDevice);
    optimized_tensor ta, tb, tc;
    fill_views(g, da, db, dc, &ta, &tb, &tc, OPTIMIZED_DEVICE_CUDA);
    const optimized_status s = optimized_matmul(&ta, &tb, &tc, 1.0f, 0.0f, variant, stream);
    const cudaError_t e = cudaStreamSynchronize(stream);
    cudaMemcpy(c, dc, nc * es, cudaMemcpyDeviceToHost);
    if (s != OPTIMIZED_STATUS_OK || e != cudaSuccess) {
      snprintf(detail, sizeof detail, "status %s: %s (stream: %s)", optimized_status_string(s),
               optimized_last_error(), cudaGetErrorString(e));
      check(0, what, detail);
    } else {
      const double r = worst_ratio(g, a, b, c);
      snprintf(detail, sizeof detail, "worst error / allowed = %g", r);
      check(r <= 1.0, what, detail);
    }
  }
  cudaFree(da), cudaFree(db), cudaFree(dc);
  if (stream) cudaStreamDestroy(stream);
  free(a), free(b), free(c);
}
#endif

/* ---- error paths ----------------------------------------------------------------------------- */

/* The call must fail with `want` and a last-error message that contains `needle`. */
static void expect_error(const char* what, optimized_status got, optimized_status want, const char* needle) {
  char detail[640];
  const char* msg = optimized_last_error();
  snprintf(detail, sizeof detail, "status %s (want %s), message '%s' (want it to contain '%s')",
           optimized_status_string(got), optimized_status_string(want), msg, needle);
  check(got == want && strstr(msg, needle) != NULL, what, detail);
}

/* Shapes and strides whose strides, element count, offsets or byte size do not fit int64: refused
 * with INVALID_ARGUMENT and a message naming the argument, never wrapped around into a small view. */
static void overflow_paths(void) {
  const int64_t p40 = (int64_t)1 << 40;
  optimized_tensor t, before;
  memset(&before, 0x5A, sizeof before);

  const int64_t wide[3] = {4, p40, p40}; /* the outer stride 2^80 */
  t = before;
  expect_error("contiguous helper: strides past int64",
               optimized_tensor_contiguous(&t, NULL, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 3, wide),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "shape: expected strides that fit int64");
  check(memcmp(&t, &before, sizeof t) == 0, "contiguous helper: a refused shape leaves *t alone", NULL);
  expect_error("contiguous helper: the message shows the shape",
               optimized_tensor_contiguous(&t, NULL, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 3, wide),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "[4, 1099511627776, 1099511627776]");

  const int64_t wide_empty[3] = {0, p40, p40}; /* no element, but the stride of dimension 0 is still 2^80 */
  expect_error("contiguous helper: strides past int64 with a size of 0",
               optimized_tensor_contiguous(&t, NULL, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 3, wide_empty),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "shape: expected strides that fit int64");

  const int64_t count[2] = {(int64_t)1 << 62, 4}; /* strides fit, 2^64 elements do not */
  expect_error("contiguous helper: element count past int64",
               optimized_tensor_contiguous(&t, NULL, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, count),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "shape: expected an element count that fits int64");

  const int64_t bytes[2] = {(int64_t)1 << 60, 2}; /* 2^61 elements fit; 2^64 bytes of fp64 do not */
  expect_error("contiguous helper: byte size past int64",
               optimized_tensor_contiguous(&t, NULL, OPTIMIZED_DTYPE_F64, OPTIMIZED_DEVICE_CPU, 0, 2, bytes),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "shape: expected a byte span that fits int64");

  /* Still accepted: large but representable, and empty shapes whose strides fit. */
  const int64_t fits[2] = {(int64_t)1 << 40, 1 << 20}, empty[3] = {p40, p40, 0};
  check(optimized_tensor_contiguous(&t, NULL, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, fits) ==
                OPTIMIZED_STATUS_OK && t.strides[0] == (1 << 20),
        "contiguous helper: 2^60 fp32 elements fit", optimized_last_error());
  check(optimized_tensor_contiguous(&t, NULL, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 3, empty) ==
                OPTIMIZED_STATUS_OK && t.strides[0] == p40 && t.strides[1] == 1,
        "contiguous helper: [2^40, 2^40, 0] (strides fit, no element)", optimized_last_error());

  /* A tensor built by hand: the entry checks its extent before using it, naming it. */
  float a[6 * 5], b[5 * 4], c[6 * 4];
  for (int i = 0; i < 30; ++i) a[i] = uniform();
  for (int i = 0; i < 20; ++i) b[i] = uniform();
  const int64_t sa[2] = {6, 5}, sb[2] = {5, 4}, sc[2] = {6, 4};
  optimized_tensor ta, tb, tc;
  optimized_tensor_contiguous(&ta, a, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, sa);
  optimized_tensor_contiguous(&tb, b, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, sb);
  optimized_tensor_contiguous(&tc, c, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, sc);
  t = tb, t.strides[0] = (int64_t)1 << 62; /* row 4 at 2^64 elements */
  expect_error("matmul: b's offsets past int64", optimized_matmul(&ta, &t, &tc, 1, 0, "auto", NULL),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "b: expected strides whose offsets fit int64");
  t = tc, t.strides[0] = (int64_t)1 << 60; /* (5 * 2^60 + 4) fp32 elements fit int64; their bytes do not */
  expect_error("matmul: c's byte span past int64", optimized_matmul(&ta, &tb, &t, 1, 0, "auto", NULL),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "c: expected a byte span that fits int64");
  t = ta, t.shape[0] = p40, t.shape[1] = p40, t.strides[0] = p40;
  expect_error("matmul: a's element count past int64", optimized_matmul(&t, &tb, &tc, 1, 0, "auto", NULL),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "a: expected an element count that fits int64");
}

static void error_paths(void) {
  float a[6 * 5], b[5 * 4], c[6 * 4], b_bad[7 * 4];
  for (int i = 0; i < 30; ++i) a[i] = uniform();
  for (int i = 0; i < 20; ++i) b[i] = uniform();
  for (int i = 0; i < 28; ++i) b_bad[i] = uniform();
  const int64_t sa[2] = {6, 5}, sb[2] = {5, 4}, sc[2] = {6, 4}, sbad[2] = {7, 4};
  optimized_tensor ta, tb, tc, tbad, t;
  optimized_tensor_contiguous(&ta, a, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, sa);
  optimized_tensor_contiguous(&tb, b, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, sb);
  optimized_tensor_contiguous(&tc, c, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, sc);
  optimized_tensor_contiguous(&tbad, b_bad, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, sbad);

  expect_error("NULL a", optimized_matmul(NULL, &tb, &tc, 1, 0, "auto", NULL), OPTIMIZED_STATUS_INVALID_ARGUMENT, "a:");
  expect_error("NULL c", optimized_matmul(&ta, &tb, NULL, 1, 0, "auto", NULL), OPTIMIZED_STATUS_INVALID_ARGUMENT, "c:");
  expect_error("K mismatch names b", optimized_matmul(&ta, &tbad, &tc, 1, 0, "auto", NULL),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "b: expected 5 rows");
  expect_error("unknown variant", optimized_matmul(&ta, &tb, &tc, 1, 0, "fastest", NULL),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "variant: expected one of auto");
  expect_error("CUDA variant on CPU tensors", optimized_matmul(&ta, &tb, &tc, 1, 0, "naive", NULL),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "variant:");
  expect_error("fp32 on a tensor-core variant", optimized_matmul(&ta, &tb, &tc, 1, 0, "wmma", NULL),
               OPTIMIZED_STATUS_UNSUPPORTED, "variant:");
  t = tb, t.dtype = 99;
  expect_error("bad dtype value names b", optimized_matmul(&ta, &t, &tc, 1, 0, "auto", NULL),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "b: expected dtype");
  t = tb, t.dtype = OPTIMIZED_DTYPE_BF16;
  expect_error("dtype mismatch names b", optimized_matmul(&ta, &t, &tc, 1, 0, "auto", NULL),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "b: expected dtype fp32");
  t = tc, t.device_type = 7;
  expect_error("bad device type names c", optimized_matmul(&ta, &tb, &t, 1, 0, "auto", NULL),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "c: expected device_type");
  t = ta, t.rank = 9;
  expect_error("rank out of range names a", optimized_matmul(&t, &tb, &tc, 1, 0, "auto", NULL),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "a: expected rank");
  t = ta, t.strides[0] = 1, t.strides[1] = 5;  /* unit row stride, columns 5 apart: 6 rows overlap */
  expect_error("a neither row- nor column-major", optimized_matmul(&t, &tb, &tc, 1, 0, "auto", NULL),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "a: expected a row-major view");
  t = tc, t.data = a;  /* c overlaps a */
  expect_error("output overlapping a", optimized_matmul(&ta, &tb, &t, 1, 0, "auto", NULL),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "c: expected an output that does not overlap");
  expect_error("contiguous helper: NULL shape",
               optimized_tensor_contiguous(&t, a, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, NULL),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "shape:");
  if (!optimized_built_with_cuda()) {
    t = ta, t.device_type = OPTIMIZED_DEVICE_CUDA;
    optimized_tensor tb2 = tb, tc2 = tc;
    tb2.device_type = tc2.device_type = OPTIMIZED_DEVICE_CUDA;
    expect_error("CUDA tensors in a CPU-only build", optimized_matmul(&t, &tb2, &tc2, 1, 0, "auto", NULL),
                 OPTIMIZED_STATUS_UNSUPPORTED, "a: CUDA tensors given");
  }

  overflow_paths();

  /* A call that succeeds clears the message. */
  const optimized_status s = optimized_matmul(&ta, &tb, &tc, 1, 0, NULL, NULL);
  check(s == OPTIMIZED_STATUS_OK && optimized_last_error()[0] == '\0', "success (NULL variant = auto) clears the error",
        optimized_last_error());
}

/* The message is per thread: a failure on another thread does not show here. */
static void* failing_thread(void* out) {
  optimized_matmul(NULL, NULL, NULL, 1, 0, "auto", NULL);
  strncpy((char*)out, optimized_last_error(), 255);
  return NULL;
}

static void thread_local_error(void) {
  char other[256] = {0};
  optimized_matmul(NULL, NULL, NULL, 1, 0, "auto", NULL);
  const char* mine_before = optimized_last_error();
  char mine[256];
  strncpy(mine, mine_before, 255);
  mine[255] = 0;
  /* Succeed here, fail there: this thread's message must stay empty. */
  float x = 1, y = 2, z = 0;
  const int64_t s11[2] = {1, 1};
  optimized_tensor tx, ty, tz;
  optimized_tensor_contiguous(&tx, &x, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, s11);
  optimized_tensor_contiguous(&ty, &y, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, s11);
  optimized_tensor_contiguous(&tz, &z, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, s11);
  optimized_matmul(&tx, &ty, &tz, 1, 0, "cpu_naive", NULL);
  pthread_t th;
  pthread_create(&th, NULL, failing_thread, other);
  pthread_join(th, NULL);
  check(strstr(mine, "a:") != NULL && other[0] != 0 && optimized_last_error()[0] == '\0' && z == 2.0f,
        "last error is thread-local", optimized_last_error());
}

/* ---- the variant query of every family ------------------------------------------------------- */

static void variant_queries(void) {
  const optimized_status I = OPTIMIZED_STATUS_INVALID_ARGUMENT, U = OPTIMIZED_STATUS_UNSUPPORTED;
  const char* const families[] = {"gemm", "fused", "loader", "scaled_gemm", "attention", "kv_cache", "linear", "moe"};
  int nf = 0;
  while (optimized_family_name(nf) != NULL) ++nf;
  check(nf == 8 && strcmp(optimized_family_name(0), families[0]) == 0 &&
            strcmp(optimized_family_name(1), families[1]) == 0 && strcmp(optimized_family_name(2), families[2]) == 0 &&
            strcmp(optimized_family_name(3), families[3]) == 0 && strcmp(optimized_family_name(4), families[4]) == 0 &&
            strcmp(optimized_family_name(5), families[5]) == 0 && strcmp(optimized_family_name(6), families[6]) == 0 &&
            strcmp(optimized_family_name(7), families[7]) == 0 && optimized_family_name(-1) == NULL,
        "families: gemm, fused, loader, scaled_gemm, attention, kv_cache, linear, moe", NULL);

  for (int f = 0; f < nf; ++f) {
    const char* family = optimized_family_name(f);
    char what[160];
    int32_t count = -1;
    snprintf(what, sizeof what, "%s: variant_count succeeds", family);
    check(optimized_variant_count(family, &count) == OPTIMIZED_STATUS_OK && count >= 1, what, optimized_last_error());
    int listed = 0, accepted = 0;
    for (const char* name; (name = optimized_variant_name(family, listed)) != NULL; ++listed) {
      /* Each listed variant runs somewhere: on its device with fp32 or bf16 (the loader: anything; the
       * scaled GEMM: fp8 inputs). */
      int ok = 0;
      for (int device = 0; device < 2 && !ok; ++device)
        ok = optimized_variant_check(family, name, OPTIMIZED_DTYPE_F32, device) == OPTIMIZED_STATUS_OK ||
             optimized_variant_check(family, name, OPTIMIZED_DTYPE_BF16, device) == OPTIMIZED_STATUS_OK ||
             optimized_variant_check(family, name, OPTIMIZED_DTYPE_F8E4M3, device) == OPTIMIZED_STATUS_OK;
      accepted += ok;
      if (strcmp(name, "auto") == 0) accepted = -1000;
    }
    snprintf(what, sizeof what, "%s: variant_count (%d) = names listed (%d), each accepted, auto not listed", family,
             (int)count, listed);
    check(count == listed && accepted == listed && optimized_variant_name(family, -1) == NULL &&
              optimized_last_error()[0] == '\0',
          what, optimized_last_error());
  }

  /* The family queries agree with the GEMM- and fused-specific ones, name by name. */
  int same = 1, i = 0;
  for (; optimized_gemm_variant_name(i) != NULL || optimized_variant_name("gemm", i) != NULL; ++i) {
    const char *a = optimized_gemm_variant_name(i), *b = optimized_variant_name("gemm", i);
    same &= a && b && strcmp(a, b) == 0;
  }
  check(same && i >= 3, "gemm: optimized_variant_name = optimized_gemm_variant_name", NULL);
  same = 1;
  int has[4] = {0, 0, 0, 0};
  const char* const fused_names[4] = {"cpu", "unfused", "fused_streaming", "fused_registers"};
  for (i = 0; optimized_fused_variant_name(i) != NULL || optimized_variant_name("fused", i) != NULL; ++i) {
    const char *a = optimized_fused_variant_name(i), *b = optimized_variant_name("fused", i);
    same &= a && b && strcmp(a, b) == 0;
    for (int k = 0; k < 4; ++k) has[k] |= a && strcmp(a, fused_names[k]) == 0;
  }
  check(same && has[0] && has[1] && has[2] && has[3] && optimized_fused_variant_name(-1) == NULL,
        "fused: optimized_variant_name = optimized_fused_variant_name (cpu, unfused, fused_streaming, fused_registers)",
        NULL);
  check(optimized_variant_name("loader", 0) && optimized_variant_name("loader", 1) &&
            strcmp(optimized_variant_name("loader", 0), "synchronous") == 0 &&
            strcmp(optimized_variant_name("loader", 1), "pipelined") == 0,
        "loader: synchronous, pipelined", NULL);

  /* The generic GEMM check is the GEMM check: the same status and message for every name, dtype and
   * device (dtype and device values out of range included). */
  int agree = 1;
  char first_diff[700] = "";
  for (int v = -1; v <= 12; ++v) {
    const char* name = v < 0 ? "auto" : v < 10 && optimized_gemm_variant_name(v) ? optimized_gemm_variant_name(v) : "nope";
    for (int32_t dtype = -1; dtype <= 7; ++dtype)
      for (int32_t device = -1; device <= 2; ++device) {
        const optimized_status s1 = optimized_gemm_variant_check(name, dtype, device);
        char m1[300];
        snprintf(m1, sizeof m1, "%s", optimized_last_error());
        const optimized_status s2 = optimized_variant_check("gemm", name, dtype, device);
        if (s1 != s2 || strcmp(m1, optimized_last_error()) != 0) {
          if (agree) snprintf(first_diff, sizeof first_diff, "%s dtype %d device %d: '%s' vs '%s'", name, (int)dtype,
                              (int)device, m1, optimized_last_error());
          agree = 0;
        }
      }
  }
  check(agree, "gemm: optimized_variant_check = optimized_gemm_variant_check everywhere", first_diff);

  /* fused checks */
  check(optimized_variant_check("fused", "auto", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU) == OPTIMIZED_STATUS_OK &&
            optimized_variant_check("fused", "cpu", OPTIMIZED_DTYPE_F64, OPTIMIZED_DEVICE_CPU) == OPTIMIZED_STATUS_OK &&
            optimized_variant_check("fused", "fused_registers", OPTIMIZED_DTYPE_BF16, OPTIMIZED_DEVICE_CUDA) ==
                OPTIMIZED_STATUS_OK &&
            optimized_variant_check("fused", "unfused", OPTIMIZED_DTYPE_F16, OPTIMIZED_DEVICE_CUDA) == OPTIMIZED_STATUS_OK,
        "fused: variant check accepts", optimized_last_error());
  expect_error("fused check: a CUDA variant on the CPU",
               optimized_variant_check("fused", "fused_registers", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU), I,
               "variant: fused_registers runs on CUDA");
  expect_error("fused check: cpu on CUDA", optimized_variant_check("fused", "cpu", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CUDA),
               I, "variant: cpu runs on the CPU");
  expect_error("fused check: fp64 on CUDA",
               optimized_variant_check("fused", "fused_streaming", OPTIMIZED_DTYPE_F64, OPTIMIZED_DEVICE_CUDA), U,
               "fp64 runs on the cpu variant only");
  expect_error("fused check: int64", optimized_variant_check("fused", "auto", OPTIMIZED_DTYPE_I64, OPTIMIZED_DEVICE_CPU), U,
               "dtype: expected fp32, fp16, bf16");
  expect_error("fused check: unknown name", optimized_variant_check("fused", "fastest", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU),
               I, "variant: expected one of auto, cpu");
  expect_error("fused check: NULL name", optimized_variant_check("fused", NULL, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU), I,
               "variant: expected a name");
  expect_error("fused check: dtype out of range", optimized_variant_check("fused", "cpu", 99, OPTIMIZED_DEVICE_CPU), I,
               "dtype: expected dtype to be an optimized_dtype value");
  expect_error("fused check: device out of range", optimized_variant_check("fused", "cpu", OPTIMIZED_DTYPE_F32, 5), I,
               "device_type: expected device_type");

  /* loader checks: any dtype, either device; the names are the loader's */
  check(optimized_variant_check("loader", "pipelined", OPTIMIZED_DTYPE_I64, OPTIMIZED_DEVICE_CUDA) == OPTIMIZED_STATUS_OK &&
            optimized_variant_check("loader", "synchronous", OPTIMIZED_DTYPE_F16, OPTIMIZED_DEVICE_CPU) == OPTIMIZED_STATUS_OK,
        "loader: variant check accepts", optimized_last_error());
  expect_error("loader check: unknown name", optimized_variant_check("loader", "auto", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU),
               I, "variant: expected one of synchronous, pipelined");
  expect_error("loader check: dtype out of range", optimized_variant_check("loader", "pipelined", -3, OPTIMIZED_DEVICE_CPU), I,
               "dtype:");

  /* unknown families */
  int32_t count = 77;
  const char* name = optimized_variant_name("distributed", 0);
  check(name == NULL && strstr(optimized_last_error(), "family: expected one of gemm, fused, loader, scaled_gemm, attention, kv_cache, linear, moe; given 'distributed'"),
        "variant name: an unknown family is NULL with a message naming the families", optimized_last_error());
  expect_error("variant count: unknown family", optimized_variant_count("distributed", &count), I,
               "family: expected one of gemm, fused, loader, scaled_gemm, attention, kv_cache, linear, moe; given 'distributed'");
  check(count == 77, "variant count: an unknown family leaves *count alone", NULL);
  expect_error("variant count: NULL family", optimized_variant_count(NULL, &count), I,
               "family: expected one of gemm, fused, loader, scaled_gemm, attention, kv_cache, linear, moe; given NULL");
  expect_error("variant count: NULL result", optimized_variant_count("gemm", NULL), I, "count: expected a pointer");
  expect_error("variant check: unknown family",
               optimized_variant_check("GEMM", "auto", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU), I,
               "family: expected one of gemm, fused, loader, scaled_gemm, attention, kv_cache, linear, moe; given 'GEMM'");
  check(optimized_variant_name("fused", 0) != NULL && optimized_last_error()[0] == '\0',
        "variant name: success clears the message", optimized_last_error());
}

/* ---- linear layers ---------------------------------------------------------------------------- */

/* One small layer worked out by hand (every value exact in fp32):
 *   x (2 x 3) = [[1, 2, 0], [0, -1, 3]], W (2 x 3) = [[1, 0, 1], [2, 1, -1]], b = [0.5, -1]
 *   pre = x W^T + b = [[1.5, 3], [3.5, -5]]; relu: y = [[1.5, 3], [3.5, 0]]
 *   dy = ones: g = dy * (pre > 0) = [[1, 1], [1, 0]]
 *   dX = g W = [[3, 1, 0], [1, 0, 1]]; dW = g^T x = [[1, 1, 3], [1, 2, 0]]; db = [2, 1] */
static int same_floats(const float* got, const float* want, int n) {
  for (int i = 0; i < n; ++i)
    if (got[i] != want[i]) return 0;
  return 1;
}

/* ---- MoE: the layer's forward ---------------------------------------------------------------- */

/* Two tokens, d = 2, E = 2 experts of F = 1, top-1, softmax weights (not normalized): with x = I and
 * router_weight = I token t's logits are e_t, so it picks expert t with weight sigmoid(1); expert 0:
 * gate = up = x0 (w13[0] = [[1, 1], [0, 0]]), w2[0] = [2, -1]; expert 1: gate = 2 x1, up = 3 x1,
 * w2[1] = [1, 0.5]. With both tokens on expert 0 and capacity_factor 0.5 (capacity ceil(0.5 * 2 / 2) = 1)
 * token 1's pair is dropped: its output is 0. */
static double silu(double z) { return z / (1.0 + exp(-z)); }

static void moe_tests(void) {
  const optimized_status I = OPTIMIZED_STATUS_INVALID_ARGUMENT;
  const float x[4] = {1, 0, 0, 1}, x_same[4] = {1, 0, 1, 0}, rw[4] = {1, 0, 0, 1};
  const float w13[8] = {1, 1, 0, 0, /* expert 1: */ 0, 0, 2, 3}, w2[4] = {2, -1, 1, 0.5f};
  float out[4] = {-7, -7, -7, -7};
  int32_t counts[2] = {-7, -7}, dropped = -7;
  const int64_t s_x[2] = {2, 2}, s_13[3] = {2, 2, 2}, s_2[3] = {2, 1, 2}, s_e[1] = {2}, s_1[1] = {1};
  optimized_tensor tx, tx_same, trw, t13, t2, tout, tcounts, tdropped;
  optimized_tensor_contiguous(&tx, (void*)x, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, s_x);
  optimized_tensor_contiguous(&tx_same, (void*)x_same, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, s_x);
  optimized_tensor_contiguous(&trw, (void*)rw, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, s_x);
  optimized_tensor_contiguous(&t13, (void*)w13, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 3, s_13);
  optimized_tensor_contiguous(&t2, (void*)w2, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 3, s_2);
  optimized_tensor_contiguous(&tout, out, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, s_x);
  optimized_tensor_contiguous(&tcounts, counts, OPTIMIZED_DTYPE_I32, OPTIMIZED_DEVICE_CPU, 0, 1, s_e);
  optimized_tensor_contiguous(&tdropped, &dropped, OPTIMIZED_DTYPE_I32, OPTIMIZED_DEVICE_CPU, 0, 1, s_1);

  optimized_moe_options o;
  optimized_status st = optimized_moe_options_default(&o);
  check(st == OPTIMIZED_STATUS_OK && o.top_k == 2 && o.scoring == OPTIMIZED_MOE_SCORING_SOFTMAX && o.topk_softmax == 0 &&
            o.normalize == 0 && o.routed_scale == 1.0f && o.capacity_factor == 0.0,
        "moe: options default (top_k 2, softmax, dropless)", optimized_last_error());
  o.top_k = 1;
  const double p = 1.0 / (1.0 + exp(-1.0)), a0 = silu(1.0), a1 = silu(2.0) * 3.0;
  const double want[4] = {p * 2 * a0, -p * a0, p * a1, p * 0.5 * a1};
  st = optimized_moe(&tx, &trw, &t13, &t2, &tout, &tcounts, &tdropped, &o, "cpu", NULL);
  int close = st == OPTIMIZED_STATUS_OK && counts[0] == 1 && counts[1] == 1 && dropped == 0;
  for (int i = 0; i < 4; ++i) close &= fabs(out[i] - want[i]) <= 1e-6 * fabs(want[i]) + 1e-7;
  check(close, "moe: a two-token layer = the hand-computed one, counts 1, 1, none dropped", optimized_last_error());

  for (int i = 0; i < 4; ++i) out[i] = -7;
  o.capacity_factor = 0.5;
  st = optimized_moe(&tx_same, &trw, &t13, &t2, &tout, &tcounts, NULL, &o, NULL, NULL);
  close = st == OPTIMIZED_STATUS_OK && counts[0] == 1 && counts[1] == 0 && out[2] == 0.0f && out[3] == 0.0f;
  close &= fabs(out[0] - want[0]) <= 1e-6 * fabs(want[0]) && fabs(out[1] - want[1]) <= 1e-6 * fabs(want[1]);
  check(close, "moe: capacity 1, both tokens on expert 0: token 1 dropped (zero output), variant NULL, dropped NULL",
        optimized_last_error());
  st = optimized_moe(&tx_same, &trw, &t13, &t2, &tout, NULL, &tdropped, &o, "auto", NULL);
  check(st == OPTIMIZED_STATUS_OK && dropped == 1, "moe: the dropped pair counted", optimized_last_error());

  expect_error("moe: w2 of rank 2", optimized_moe(&tx, &trw, &t13, &tx, &tout, NULL, NULL, NULL, NULL, NULL), I,
               "w2: expected rank 3");
  optimized_tensor t2_wide = t2;
  t2_wide.shape[2] = 1;
  expect_error("moe: w2's d_model", optimized_moe(&tx, &trw, &t13, &t2_wide, &tout, NULL, NULL, NULL, NULL, NULL), I,
               "w2: expected shape (2, 1, 2)");
  o.scoring = 9;
  expect_error("moe: options.scoring", optimized_moe(&tx, &trw, &t13, &t2, &tout, NULL, NULL, &o, NULL, NULL), I,
               "options.scoring");
  o.scoring = OPTIMIZED_MOE_SCORING_SOFTMAX, o.top_k = 3;
  expect_error("moe: top_k past E", optimized_moe(&tx, &trw, &t13, &t2, &tout, NULL, NULL, &o, NULL, NULL), I, "top_k");
  o.top_k = 1;
  expect_error("moe: a CUDA variant on CPU tensors",
               optimized_moe(&tx, &trw, &t13, &t2, &tout, NULL, NULL, &o, "naive", NULL), I, "variant: naive runs on CUDA");
  expect_error("moe: an unknown variant", optimized_moe(&tx, &trw, &t13, &t2, &tout, NULL, NULL, &o, "fastest", NULL), I,
               "variant: expected one of");
  expect_error("moe: x NULL", optimized_moe(NULL, &trw, &t13, &t2, &tout, NULL, NULL, &o, NULL, NULL), I,
               "x: expected a pointer");
  expect_error("moe: options_default(NULL)", optimized_moe_options_default(NULL), I, "options");
  check(optimized_variant_check("moe", "cpu", OPTIMIZED_DTYPE_BF16, OPTIMIZED_DEVICE_CPU) == OPTIMIZED_STATUS_OK,
        "moe: variant check, cpu takes bf16", optimized_last_error());
  expect_error("moe: variant check, wgmma on fp32",
               optimized_variant_check("moe", "wgmma", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CUDA),
               OPTIMIZED_STATUS_UNSUPPORTED, "variant: wgmma supports fp16, bf16");
}

static void linear_tests(void) {
  const optimized_status I = OPTIMIZED_STATUS_INVALID_ARGUMENT, U = OPTIMIZED_STATUS_UNSUPPORTED;
  const float x[6] = {1, 2, 0, 0, -1, 3}, w[6] = {1, 0, 1, 2, 1, -1}, b[2] = {0.5f, -1}, dy[4] = {1, 1, 1, 1};
  float y[4] = {-7, -7, -7, -7}, pre[4] = {-7, -7, -7, -7}, dx[6], dw[6], db[2];
  const int64_t s_x[2] = {2, 3}, s_w[2] = {2, 3}, s_b[1] = {2}, s_y[2] = {2, 2};
  optimized_tensor tx, tw, tb, ty, tp, tdy, tdx, tdw, tdb;
  optimized_tensor_contiguous(&tx, (void*)x, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, s_x);
  optimized_tensor_contiguous(&tw, (void*)w, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, s_w);
  optimized_tensor_contiguous(&tb, (void*)b, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 1, s_b);
  optimized_tensor_contiguous(&ty, y, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, s_y);
  optimized_tensor_contiguous(&tp, pre, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, s_y);
  optimized_tensor_contiguous(&tdy, (void*)dy, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, s_y);
  optimized_tensor_contiguous(&tdx, dx, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, s_x);
  optimized_tensor_contiguous(&tdw, dw, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, s_w);
  optimized_tensor_contiguous(&tdb, db, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 1, s_b);
  const float want_y[4] = {1.5f, 3, 3.5f, 0}, want_pre[4] = {1.5f, 3, 3.5f, -5};
  const float want_dx[6] = {3, 1, 0, 1, 0, 1}, want_dw[6] = {1, 1, 3, 1, 2, 0}, want_db[2] = {2, 1};

  optimized_status st = optimized_linear_forward(&tx, &tw, &tb, &ty, &tp, OPTIMIZED_ACTIVATION_RELU, "cpu", NULL);
  check(st == OPTIMIZED_STATUS_OK && same_floats(y, want_y, 4) && same_floats(pre, want_pre, 4),
        "linear: forward = hand-computed relu(x W^T + b), pre written", optimized_last_error());
  for (int i = 0; i < 4; ++i) y[i] = -7;
  st = optimized_linear_forward(&tx, &tw, &tb, &ty, NULL, OPTIMIZED_ACTIVATION_RELU, NULL, NULL);
  check(st == OPTIMIZED_STATUS_OK && same_floats(y, want_y, 4), "linear: forward, pre NULL, variant NULL (auto)",
        optimized_last_error());

  st = optimized_linear_backward(&tdx, &tdw, &tdb, &tdy, &tx, &tw, &tp, &tb, OPTIMIZED_ACTIVATION_RELU, 0, "cpu", NULL);
  check(st == OPTIMIZED_STATUS_OK && same_floats(dx, want_dx, 6) && same_floats(dw, want_dw, 6) &&
            same_floats(db, want_db, 2),
        "linear: backward = hand-computed dX, dW, db", optimized_last_error());
  /* pre recomputed (NULL), dX not asked for, dW and db accumulated onto the previous values */
  for (int i = 0; i < 6; ++i) dx[i] = -7;
  st = optimized_linear_backward(NULL, &tdw, &tdb, &tdy, &tx, &tw, NULL, &tb, OPTIMIZED_ACTIVATION_RELU, 1, "auto",
                                 NULL);
  int doubled = st == OPTIMIZED_STATUS_OK && dx[0] == -7;
  for (int i = 0; i < 6; ++i) doubled &= dw[i] == 2 * want_dw[i];
  for (int i = 0; i < 2; ++i) doubled &= db[i] == 2 * want_db[i];
  check(doubled, "linear: backward with pre recomputed, accumulate, grad_input NULL", optimized_last_error());

  /* fp8: the same layer through e4m3 / e5m2 copies (per-tensor current scaling) lands within the
   * quantization's few percent of the exact answer (the C++ tests hold it to the emulated reference) */
  {
    float y8[4] = {-7, -7, -7, -7}, dx8[6], dw8[6], db8[2];
    optimized_tensor ty8, tdx8, tdw8, tdb8;
    optimized_tensor_contiguous(&ty8, y8, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, s_y);
    optimized_tensor_contiguous(&tdx8, dx8, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, s_x);
    optimized_tensor_contiguous(&tdw8, dw8, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, s_w);
    optimized_tensor_contiguous(&tdb8, db8, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 1, s_b);
    st = optimized_linear_forward_fp8(&tx, &tw, &tb, &ty8, NULL, OPTIMIZED_ACTIVATION_RELU, "cpu", NULL);
    int close = st == OPTIMIZED_STATUS_OK;
    for (int i = 0; i < 4; ++i) close &= fabsf(y8[i] - want_y[i]) <= 0.1f * fabsf(want_y[i]) + 0.05f;
    check(close, "linear: fp8 forward within the quantization of relu(x W^T + b)", optimized_last_error());
    st = optimized_linear_backward_fp8(&tdx8, &tdw8, &tdb8, &tdy, &tx, &tw, &tp, &tb, OPTIMIZED_ACTIVATION_RELU, 0,
                                       "auto", NULL);
    close = st == OPTIMIZED_STATUS_OK;
    for (int i = 0; i < 6; ++i) close &= fabsf(dx8[i] - want_dx[i]) <= 0.1f * fabsf(want_dx[i]) + 0.05f;
    for (int i = 0; i < 6; ++i) close &= fabsf(dw8[i] - want_dw[i]) <= 0.1f * fabsf(want_dw[i]) + 0.05f;
    close &= same_floats(db8, want_db, 2); /* the bias gradient sums the unquantized g */
    check(close, "linear: fp8 backward within the quantization of dX, dW; db exact", optimized_last_error());
    expect_error("linear: fp8, a CUDA variant on CPU tensors",
                 optimized_linear_forward_fp8(&tx, &tw, &tb, &ty8, NULL, OPTIMIZED_ACTIVATION_NONE, "naive", NULL), I,
                 "naive runs on CUDA tensors");
  }

  expect_error("linear: activation out of range",
               optimized_linear_forward(&tx, &tw, &tb, &ty, NULL, 7, "cpu", NULL), I, "activation: expected");
  expect_error("linear: weight's K differs",
               optimized_linear_forward(&tdy, &tw, &tb, &ty, NULL, OPTIMIZED_ACTIVATION_NONE, "cpu", NULL), I,
               "weight: expected shape (N, 2)");
  expect_error("linear: accumulate not 0 or 1",
               optimized_linear_backward(&tdx, &tdw, &tdb, &tdy, &tx, &tw, &tp, &tb, OPTIMIZED_ACTIVATION_RELU, 2,
                                         "cpu", NULL),
               I, "accumulate: expected 0 or 1");
  expect_error("linear: a CUDA variant on CPU tensors",
               optimized_linear_forward(&tx, &tw, &tb, &ty, NULL, OPTIMIZED_ACTIVATION_NONE, "naive", NULL), I,
               "naive");
  expect_error("linear: unknown variant",
               optimized_linear_forward(&tx, &tw, &tb, &ty, NULL, OPTIMIZED_ACTIVATION_NONE, "fastest", NULL), I,
               "variant: expected one of");

  check(optimized_variant_check("linear", "auto", OPTIMIZED_DTYPE_F64, OPTIMIZED_DEVICE_CPU) == OPTIMIZED_STATUS_OK &&
            optimized_variant_check("linear", "persistent", OPTIMIZED_DTYPE_BF16, OPTIMIZED_DEVICE_CUDA) ==
                OPTIMIZED_STATUS_OK &&
            optimized_variant_check("linear", "naive", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CUDA) == OPTIMIZED_STATUS_OK,
        "linear: variant check accepts", optimized_last_error());
  expect_error("linear check: fused on fp32",
               optimized_variant_check("linear", "fused", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CUDA), U, "fused");
  expect_error("linear check: auto fp64 on CUDA",
               optimized_variant_check("linear", "auto", OPTIMIZED_DTYPE_F64, OPTIMIZED_DEVICE_CUDA), U, "fp64");
  expect_error("linear check: cpu on CUDA",
               optimized_variant_check("linear", "cpu", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CUDA), I,
               "variant: cpu runs on the CPU");
  check(optimized_variant_name("linear", 0) && strcmp(optimized_variant_name("linear", 0), "cpu") == 0 &&
            optimized_variant_name("linear", 3) && strcmp(optimized_variant_name("linear", 3), "persistent") == 0 &&
            optimized_variant_name("linear", 4) == NULL,
        "linear: cpu, naive, fused, persistent", NULL);
}

/* ---- scaled (fp8) GEMM ----------------------------------------------------------------------- */

/* One small product worked out by hand (every value exact in fp32 and bf16):
 *   A (2 x 3, e4m3) = [[1, 2, 0.5], [-4, 3, 1.5]], scale_a per row [0.5, 2]
 *   B (3 x 2, e5m2) = [[1, -1], [2, 0.5], [3, 4]], scale_b per tensor 0.25
 *   A @ B = [[6.5, 2], [6.5, 11.5]]; scaled [[0.8125, 0.25], [3.25, 5.75]]; + bias [1, -1]:
 *   [[1.8125, -0.75], [4.25, 4.75]]. */
static uint8_t g_fp8_a[6] = {0x38, 0x40, 0x30, 0xC8, 0x44, 0x3C};  /* e4m3, row-major (M, K) */
static uint8_t g_fp8_b[6] = {0x3C, 0xBC, 0x40, 0x38, 0x42, 0x44};  /* e5m2, row-major (K, N) */
static uint8_t g_fp8_bt[6] = {0x3C, 0x40, 0x42, 0xBC, 0x38, 0x44}; /* the same B column-major: stored (N, K) */
static float g_fp8_sa[2] = {0.5f, 2.0f}, g_fp8_sb[1] = {0.25f}, g_fp8_bias[2] = {1.0f, -1.0f};
static const float g_fp8_want[4] = {1.8125f, -0.75f, 4.25f, 4.75f};

/* The views of the worked example over a, b (row-major, or column-major when b_col_major), c,
 * the scales and the bias, on `device_type`. */
typedef struct {
  optimized_tensor a, b, c, sa, sb, bias;
} scaled_views;

static void scaled_example_views(scaled_views* v, void* a, void* b, int b_col_major, void* c, int32_t c_dtype,
                                 void* sa, void* sb, void* bias, int32_t device_type) {
  const int64_t sha[2] = {2, 3}, shb[2] = {3, 2}, shc[2] = {2, 2}, two[1] = {2}, one[1] = {1};
  const optimized_device_type d = (optimized_device_type)device_type;
  optimized_tensor_contiguous(&v->a, a, OPTIMIZED_DTYPE_F8E4M3, d, 0, 2, sha);
  optimized_tensor_contiguous(&v->b, b, OPTIMIZED_DTYPE_F8E5M2, d, 0, 2, shb);
  if (b_col_major) v->b.strides[0] = 1, v->b.strides[1] = 3;
  optimized_tensor_contiguous(&v->c, c, (optimized_dtype)c_dtype, d, 0, 2, shc);
  optimized_tensor_contiguous(&v->sa, sa, OPTIMIZED_DTYPE_F32, d, 0, 1, two);
  optimized_tensor_contiguous(&v->sb, sb, OPTIMIZED_DTYPE_F32, d, 0, 1, one);
  optimized_tensor_contiguous(&v->bias, bias, (optimized_dtype)c_dtype, d, 0, 1, two);
}

/* Whether c (4 fp32 values, then 4 NaN guards) holds the example's result (minus the bias when
 * without_bias). */
static int scaled_example_ok(const float* c, int without_bias, char* detail, size_t detail_size) {
  int ok = 1;
  for (int i = 0; i < 4; ++i) {
    const float want = g_fp8_want[i] - (without_bias ? g_fp8_bias[i % 2] : 0.0f);
    ok &= c[i] == want;
  }
  for (int i = 4; i < 8; ++i) ok &= isnan(c[i]);
  snprintf(detail, detail_size, "got [%g, %g, %g, %g], guard [%g, ...]; %s", c[0], c[1], c[2], c[3], c[4],
           optimized_last_error());
  return ok;
}

/* optimized_matmul_epilogue on the CPU: C = gelu_tanh(A @ B + bias) + residual with aux and column
 * sums, fp32, every CPU variant and auto, against double; then its gradient mode and refusals. */
static double gelu_tanh_ref(double x) { return 0.5 * x * (1 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }

static void matmul_epilogue_tests(void) {
  enum { M = 5, N = 7, K = 3 };
  float a[M * K], b[K * N], bias[N], res[M * N], c[M * N], aux[M * N], sums[N];
  for (int i = 0; i < M * K; ++i) a[i] = uniform();
  for (int i = 0; i < K * N; ++i) b[i] = uniform();
  for (int i = 0; i < N; ++i) bias[i] = uniform();
  for (int i = 0; i < M * N; ++i) res[i] = uniform();
  double pre[M * N], out[M * N], sum[N];
  for (int j = 0; j < N; ++j) sum[j] = 0;
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      double d = bias[j];
      for (int k = 0; k < K; ++k) d += (double)a[i * K + k] * b[k * N + j];
      pre[i * N + j] = d;
      out[i * N + j] = gelu_tanh_ref(d) + res[i * N + j];
      sum[j] += out[i * N + j];
    }
  const int64_t sa[2] = {M, K}, sb[2] = {K, N}, sc[2] = {M, N}, sn[1] = {N};
  optimized_tensor ta, tb, tc, tbias, tres, taux, tsums;
  optimized_tensor_contiguous(&ta, a, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, sa);
  optimized_tensor_contiguous(&tb, b, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, sb);
  optimized_tensor_contiguous(&tc, c, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, sc);
  optimized_tensor_contiguous(&tres, res, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, sc);
  optimized_tensor_contiguous(&taux, aux, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, sc);
  optimized_tensor_contiguous(&tbias, bias, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 1, sn);
  optimized_tensor_contiguous(&tsums, sums, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 1, sn);
  const char* variants[] = {"cpu_naive", "cpu_blocked", "cpu_packed", "auto"};
  for (int v = 0; v < 4; ++v) {
    memset(c, 0xFF, sizeof c), memset(aux, 0xFF, sizeof aux), memset(sums, 0xFF, sizeof sums);
    const optimized_status s = optimized_matmul_epilogue(&ta, &tb, &tc, &tbias, 0, "gelu_tanh", 0, &taux, &tres,
                                                         &tsums, 1.0f, 0.0f, variants[v], NULL);
    double worst = 0;
    for (int i = 0; i < M * N; ++i) {
      const double e1 = fabs(c[i] - out[i]) / (1e-5 * (1 + fabs(out[i]))), e2 = fabs(aux[i] - pre[i]) / (1e-5 * (1 + fabs(pre[i])));
      worst = fmax(worst, fmax(isnan(e1) ? INFINITY : e1, isnan(e2) ? INFINITY : e2));
    }
    for (int j = 0; j < N; ++j) {
      const double e = fabs(sums[j] - sum[j]) / (1e-5 * (1 + fabs(sum[j])) * M);
      worst = fmax(worst, isnan(e) ? INFINITY : e);
    }
    char what[96], detail[256];
    snprintf(what, sizeof what, "matmul_epilogue %s: gelu_tanh(a @ b + bias) + residual, aux, column sums", variants[v]);
    snprintf(detail, sizeof detail, "status %s (%s), worst error / allowed %g", optimized_status_string(s),
             optimized_last_error(), worst);
    check(s == OPTIMIZED_STATUS_OK && worst <= 1.0, what, detail);
  }
  /* The gradient mode reads aux: C = (A @ B) * gelu'(aux), aux now the pre-activations above. */
  for (int i = 0; i < M * N; ++i) aux[i] = (float)pre[i];
  memset(c, 0xFF, sizeof c);
  optimized_status s = optimized_matmul_epilogue(&ta, &tb, &tc, NULL, 0, "relu", 1, &taux, NULL, NULL, 1.0f, 0.0f,
                                                 "auto", NULL);
  double worst = 0;
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      double d = 0;
      for (int k = 0; k < K; ++k) d += (double)a[i * K + k] * b[k * N + j];
      const double want = aux[i * N + j] > 0 ? d : 0.0, e = fabs(c[i * N + j] - want) / (1e-5 * (1 + fabs(want)));
      worst = fmax(worst, isnan(e) ? INFINITY : e);
    }
  {
    char detail[256];
    snprintf(detail, sizeof detail, "status %s (%s), worst error / allowed %g", optimized_status_string(s),
             optimized_last_error(), worst);
    check(s == OPTIMIZED_STATUS_OK && worst <= 1.0, "matmul_epilogue: relu gradient through aux", detail);
  }
  expect_error("matmul_epilogue: unknown activation",
               optimized_matmul_epilogue(&ta, &tb, &tc, NULL, 0, "tanh", 0, NULL, NULL, NULL, 1, 0, "auto", NULL),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "activation: expected one of");
  expect_error("matmul_epilogue: gradient without aux",
               optimized_matmul_epilogue(&ta, &tb, &tc, NULL, 0, "gelu", 1, NULL, NULL, NULL, 1, 0, "auto", NULL),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "activation_grad");
  expect_error("matmul_epilogue: a rung without epilogues",
               optimized_matmul_epilogue(&ta, &tb, &tc, &tbias, 0, NULL, 0, NULL, NULL, NULL, 1, 0, "smem_tiled", NULL),
               OPTIMIZED_STATUS_UNSUPPORTED, "smem_tiled does not fuse epilogues");
  s = optimized_matmul_epilogue(&ta, &tb, &tc, &tc, 0, NULL, 0, NULL, NULL, NULL, 1, 0, "auto", NULL);
  expect_error("matmul_epilogue: bias of the wrong length", s, OPTIMIZED_STATUS_INVALID_ARGUMENT, "bias: expected");
}

static void scaled_matmul_tests(void) {
  const optimized_status I = OPTIMIZED_STATUS_INVALID_ARGUMENT, U = OPTIMIZED_STATUS_UNSUPPORTED;
  float c[8];
  char what[160], detail[512];
  scaled_views v;

  /* Every CPU variant name (and NULL = auto), B row- and column-major, with and without bias. */
  const char* const variants[] = {"cpu", "auto", NULL};
  for (int vi = 0; vi < 3; ++vi)
    for (int col = 0; col < 2; ++col)
      for (int with_bias = 0; with_bias < 2; ++with_bias) {
        memset(c, 0xFF, sizeof c);
        scaled_example_views(&v, g_fp8_a, col ? g_fp8_bt : g_fp8_b, col, c, OPTIMIZED_DTYPE_F32, g_fp8_sa, g_fp8_sb,
                             g_fp8_bias, OPTIMIZED_DEVICE_CPU);
        const optimized_status s = optimized_scaled_matmul(&v.a, &v.b, &v.c, &v.sa, "rowwise", &v.sb, "tensor",
                                                           with_bias ? &v.bias : NULL, variants[vi], NULL);
        snprintf(what, sizeof what, "scaled matmul %s: e4m3 x e5m2 (B %s) %s bias, fp32 out",
                 variants[vi] ? variants[vi] : "NULL (auto)", col ? "column-major" : "row-major",
                 with_bias ? "with" : "without");
        const int ok = scaled_example_ok(c, !with_bias, detail, sizeof detail);
        check(s == OPTIMIZED_STATUS_OK && ok && optimized_last_error()[0] == '\0', what, detail);
      }

  /* The same through the block layouts (K = 3: one block: A's 1x128 scales (M, 1) are its row
   * scales, B's 128x128 scale (1, 1) its tensor scale), into bf16 with a bf16 bias. */
  {
    uint16_t cb[8], bias_bf16[2] = {float_to_bf16(g_fp8_bias[0]), float_to_bf16(g_fp8_bias[1])};
    memset(cb, 0xFF, sizeof cb);
    scaled_example_views(&v, g_fp8_a, g_fp8_bt, 1, cb, OPTIMIZED_DTYPE_BF16, g_fp8_sa, g_fp8_sb, bias_bf16,
                         OPTIMIZED_DEVICE_CPU);
    v.sa.rank = 2, v.sa.shape[0] = 2, v.sa.shape[1] = 1, v.sa.strides[0] = 1, v.sa.strides[1] = 1; /* (M, ceil(K/128)) */
    const optimized_status s = optimized_scaled_matmul(&v.a, &v.b, &v.c, &v.sa, "block_1x128", &v.sb,
                                                       "block_128x128", &v.bias, "cpu", NULL);
    float got[8];
    for (int i = 0; i < 8; ++i) got[i] = bf16_to_float(cb[i]);
    check(s == OPTIMIZED_STATUS_OK && scaled_example_ok(got, 0, detail, sizeof detail),
          "scaled matmul cpu: block_1x128 x block_128x128 scales, bf16 out and bias", detail);
  }

  /* Refusals, each naming the argument. */
  scaled_example_views(&v, g_fp8_a, g_fp8_b, 0, c, OPTIMIZED_DTYPE_F32, g_fp8_sa, g_fp8_sb, g_fp8_bias,
                       OPTIMIZED_DEVICE_CPU);
  optimized_tensor t = v.sa;
  t.shape[0] = 3; /* rowwise A needs M = 2 */
  expect_error("scaled matmul: scale count names scale_a and the shape",
               optimized_scaled_matmul(&v.a, &v.b, &v.c, &t, "rowwise", &v.sb, "tensor", NULL, "cpu", NULL), I,
               "scale_a: expected 2 scales for layout rowwise (M = 2)");
  expect_error("scaled matmul: block scale count names scale_b",
               optimized_scaled_matmul(&v.a, &v.b, &v.c, &v.sa, "rowwise", &v.sb, "block_1x128", NULL, "cpu", NULL), I,
               "scale_b: expected 2 scales for layout block_1x128");
  expect_error("scaled matmul: unknown scale layout",
               optimized_scaled_matmul(&v.a, &v.b, &v.c, &v.sa, "row", &v.sb, "tensor", NULL, "cpu", NULL), I,
               "scale_a_layout: expected one of tensor, rowwise, block_1x128, block_128x128; given 'row'");
  expect_error("scaled matmul: NULL scale layout",
               optimized_scaled_matmul(&v.a, &v.b, &v.c, &v.sa, "rowwise", &v.sb, NULL, NULL, "cpu", NULL), I,
               "scale_b_layout: expected one of tensor, rowwise, block_1x128, block_128x128; given NULL");
  expect_error("scaled matmul: NULL scale_a",
               optimized_scaled_matmul(&v.a, &v.b, &v.c, NULL, "rowwise", &v.sb, "tensor", NULL, "cpu", NULL), I,
               "scale_a: expected a pointer");
  t = v.sb, t.dtype = OPTIMIZED_DTYPE_BF16;
  expect_error("scaled matmul: scale dtype",
               optimized_scaled_matmul(&v.a, &v.b, &v.c, &v.sa, "rowwise", &t, "tensor", NULL, "cpu", NULL), I,
               "scale_b: expected dtype fp32");
  t = v.a, t.dtype = OPTIMIZED_DTYPE_F8E5M2;
  expect_error("scaled matmul: e5m2 x e5m2",
               optimized_scaled_matmul(&t, &v.b, &v.c, &v.sa, "rowwise", &v.sb, "tensor", NULL, "cpu", NULL), U,
               "b: expected fp8_e4m3 when a is fp8_e5m2");
  t = v.a, t.dtype = OPTIMIZED_DTYPE_F32;
  expect_error("scaled matmul: fp32 a",
               optimized_scaled_matmul(&t, &v.b, &v.c, &v.sa, "rowwise", &v.sb, "tensor", NULL, "cpu", NULL), U,
               "a: expected dtype fp8_e4m3 or fp8_e5m2; given fp32");
  t = v.c, t.dtype = OPTIMIZED_DTYPE_I32;
  expect_error("scaled matmul: int32 c",
               optimized_scaled_matmul(&v.a, &v.b, &t, &v.sa, "rowwise", &v.sb, "tensor", NULL, "cpu", NULL), U,
               "c: expected dtype fp32, bf16 or fp16; given int32");
  t = v.bias, t.dtype = OPTIMIZED_DTYPE_BF16;
  expect_error("scaled matmul: bias dtype",
               optimized_scaled_matmul(&v.a, &v.b, &v.c, &v.sa, "rowwise", &v.sb, "tensor", &t, "cpu", NULL), I,
               "bias: expected dtype fp32 (c's); given bf16");
  t = v.bias, t.rank = 0;
  expect_error("scaled matmul: rank-0 bias",
               optimized_scaled_matmul(&v.a, &v.b, &v.c, &v.sa, "rowwise", &v.sb, "tensor", &t, "cpu", NULL), I,
               "bias: expected NULL (absent)");
  float shared[4] = {0.5f, 2.0f, 0.0f, 0.0f}; /* scale_a in the first two, C over all four */
  optimized_tensor t2 = v.sa;
  t = v.c, t.data = shared, t2.data = shared;
  expect_error("scaled matmul: c overlapping scale_a",
               optimized_scaled_matmul(&v.a, &v.b, &t, &t2, "rowwise", &v.sb, "tensor", NULL, "cpu", NULL), I,
               "c: expected an output that does not overlap scale_a");
  expect_error("scaled matmul: CUDA variant on CPU tensors",
               optimized_scaled_matmul(&v.a, &v.b, &v.c, &v.sa, "rowwise", &v.sb, "tensor", NULL, "naive", NULL), I,
               "variant: naive runs on CUDA");
  expect_error("scaled matmul: unknown variant",
               optimized_scaled_matmul(&v.a, &v.b, &v.c, &v.sa, "rowwise", &v.sb, "tensor", NULL, "fastest", NULL), I,
               "variant: expected one of auto, cpu, naive, wgmma_fp8; given 'fastest'");
  if (!optimized_built_with_cuda()) {
    scaled_views g;
    scaled_example_views(&g, g_fp8_a, g_fp8_b, 0, c, OPTIMIZED_DTYPE_F32, g_fp8_sa, g_fp8_sb, g_fp8_bias,
                         OPTIMIZED_DEVICE_CUDA);
    expect_error("scaled matmul: CUDA tensors in a CPU-only build",
                 optimized_scaled_matmul(&g.a, &g.b, &g.c, &g.sa, "rowwise", &g.sb, "tensor", NULL, NULL, NULL), U,
                 "a: CUDA tensors given");
  }
  memset(c, 0xFF, sizeof c);
  check(optimized_scaled_matmul(&v.a, &v.b, &v.c, &v.sa, "rowwise", &v.sb, "tensor", &v.bias, "cpu", NULL) ==
                OPTIMIZED_STATUS_OK && optimized_last_error()[0] == '\0',
        "scaled matmul: success clears the error", optimized_last_error());

  /* The family's variant query. */
  const char* const names[] = {"cpu", "naive", "wgmma_fp8"};
  int same = 1, n = 0;
  for (; optimized_variant_name("scaled_gemm", n) != NULL; ++n)
    same &= n < 3 && strcmp(optimized_variant_name("scaled_gemm", n), names[n]) == 0;
  check(same && n == 3, "scaled_gemm: variants cpu, naive, wgmma_fp8", NULL);
  check(optimized_variant_check("scaled_gemm", "cpu", OPTIMIZED_DTYPE_F8E4M3, OPTIMIZED_DEVICE_CPU) == OPTIMIZED_STATUS_OK &&
            optimized_variant_check("scaled_gemm", "auto", OPTIMIZED_DTYPE_F8E5M2, OPTIMIZED_DEVICE_CPU) ==
                OPTIMIZED_STATUS_OK &&
            optimized_variant_check("scaled_gemm", "wgmma_fp8", OPTIMIZED_DTYPE_F8E5M2, OPTIMIZED_DEVICE_CUDA) ==
                OPTIMIZED_STATUS_OK,
        "scaled_gemm: variant check accepts fp8", optimized_last_error());
  expect_error("scaled_gemm check: bf16 inputs",
               optimized_variant_check("scaled_gemm", "auto", OPTIMIZED_DTYPE_BF16, OPTIMIZED_DEVICE_CPU), U,
               "variant: scaled_matmul supports fp8_e4m3, fp8_e5m2; given bf16");
  expect_error("scaled_gemm check: naive on the CPU",
               optimized_variant_check("scaled_gemm", "naive", OPTIMIZED_DTYPE_F8E4M3, OPTIMIZED_DEVICE_CPU), I,
               "variant: naive runs on CUDA");

#ifdef OPTIMIZED_TEST_CUDA
  /* On a device: naive and auto (and wgmma_fp8 on compute capability 9.0) on a stream. */
  if (optimized_cuda_device_count() > 0) {
    const char* const cuda_variants[] = {"naive", "auto", "wgmma_fp8"};
    for (int vi = 0; vi < 3; ++vi) {
      if (vi == 2 && !device_is_sm90()) continue;
      void *da = NULL, *db = NULL, *dc = NULL, *dsa = NULL, *dsb = NULL, *dbias = NULL;
      cudaStream_t stream = NULL;
      snprintf(what, sizeof what, "scaled matmul %s on CUDA (own stream)", cuda_variants[vi]);
      memset(c, 0xFF, sizeof c);
      if (cudaStreamCreate(&stream) != cudaSuccess || cudaMalloc(&da, 6) != cudaSuccess ||
          cudaMalloc(&db, 6) != cudaSuccess || cudaMalloc(&dc, sizeof c) != cudaSuccess ||
          cudaMalloc(&dsa, sizeof g_fp8_sa) != cudaSuccess || cudaMalloc(&dsb, sizeof g_fp8_sb) != cudaSuccess ||
          cudaMalloc(&dbias, sizeof g_fp8_bias) != cudaSuccess) {
        check(0, what, "cudaMalloc / cudaStreamCreate failed");
      } else {
        cudaMemcpy(da, g_fp8_a, 6, cudaMemcpyHostToDevice);
        cudaMemcpy(db, g_fp8_bt, 6, cudaMemcpyHostToDevice);
        cudaMemcpy(dc, c, sizeof c, cudaMemcpyHostToDevice);
        cudaMemcpy(dsa, g_fp8_sa, sizeof g_fp8_sa, cudaMemcpyHostToDevice);
        cudaMemcpy(dsb, g_fp8_sb, sizeof g_fp8_sb, cudaMemcpyHostToDevice);
        cudaMemcpy(dbias, g_fp8_bias, sizeof g_fp8_bias, cudaMemcpyHostToDevice);
        scaled_views g;
        scaled_example_views(&g, da, db, 1, dc, OPTIMIZED_DTYPE_F32, dsa, dsb, dbias, OPTIMIZED_DEVICE_CUDA);
        const optimized_status s = optimized_scaled_matmul(&g.a, &g.b, &g.c, &g.sa, "rowwise", &g.sb, "tensor", &g.bias,
                                                           cuda_variants[vi], stream);
        const cudaError_t e = cudaStreamSynchronize(stream);
        cudaMemcpy(c, dc, sizeof c, cudaMemcpyDeviceToHost);
        const int ok = scaled_example_ok(c, 0, detail, sizeof detail);
        check(s == OPTIMIZED_STATUS_OK && e == cudaSuccess && ok, what, detail);
      }
      cudaFree(da), cudaFree(db), cudaFree(dc), cudaFree(dsa), cudaFree(dsb), cudaFree(dbias);
      if (stream) cudaStreamDestroy(stream);
    }
  }
#endif
}

/* ---- fused ops ------------------------------------------------------------------------------- */

/* The operands of a fused call, by role (the names the C API's messages use). */
enum { R_X, R_RES, R_W, R_B, R_MEAN, R_RSTD, R_DY, R_DRES, R_Y, R_RESOUT, R_DX, R_DW, R_DB, R_COUNT };
static const char* const k_role[R_COUNT] = {"x", "residual", "weight", "bias", "mean", "rstd", "dy",
                                            "dresidual_out", "y", "residual_out", "dx", "dweight", "dbias"};

enum { F_SOFTMAX, F_LOG_SOFTMAX, F_LAYER_NORM, F_RMS_NORM, F_BIAS_GELU, F_SILU_AND_MUL };

typedef struct {
  int present, output, two_d; /* two_d: (rows, cols) with rows ld apart; else a (cols) vector */
  int64_t rows, cols, ld;
  int32_t dtype;              /* the call's dtype, or fp32 for mean / rstd (fp64 for fp64 calls) */
  void* host;                 /* ld * rows elements (cols for vectors); padding NaN */
  void* dev;                  /* the CUDA copy */
  optimized_tensor view;
  double *ref, *bound;        /* outputs: reference and allowed error per element (rows x cols) */
} operand;

typedef struct {
  const char* label;
  int op, backward, approximate;
  int32_t dtype;
  int64_t rows, width, pad;            /* width: the normalized length (silu_and_mul: d) */
  int residual, weight, bias, stats;   /* forward: optional operands present; backward: residual = dres */
  int dweight, dbias;                  /* backward: parameter gradients wanted */
  double eps, scale;
} fused_spec;

typedef struct {
  fused_spec s;
  operand o[R_COUNT];
} fused_case;

static double fget(const operand* p, int64_t i) {
  return p->dtype == OPTIMIZED_DTYPE_F64 ? ((const double*)p->host)[i] : (double)((const float*)p->host)[i];
}
static void fset(operand* p, int64_t i, double v) {
  if (p->dtype == OPTIMIZED_DTYPE_F64) ((double*)p->host)[i] = v;
  else ((float*)p->host)[i] = (float)v;
}
/* What a value becomes when stored in the dtype. */
static double round_to(int32_t dtype, double v) { return dtype == OPTIMIZED_DTYPE_F64 ? v : (double)(float)v; }
static size_t fsize(int32_t dtype) { return dtype == OPTIMIZED_DTYPE_F64 ? 8 : 4; }
static int64_t op_count(const operand* p) { return p->two_d ? p->rows * p->ld : p->cols; }
static int64_t at(const operand* p, int64_t r, int64_t j) { return p->two_d ? r * p->ld + j : j; }

static void add_operand(fused_case* c, int role, int output, int two_d, int64_t cols, int32_t dtype) {
  operand* p = &c->o[role];
  p->present = 1, p->output = output, p->two_d = two_d, p->dtype = dtype;
  p->rows = two_d ? c->s.rows : 1;
  p->cols = cols;
  p->ld = two_d && c->s.rows > 1 ? cols + c->s.pad : cols;
  const int64_t n = op_count(p) > 0 ? op_count(p) : 1;
  p->host = malloc((size_t)n * fsize(dtype));
  memset(p->host, 0xFF, (size_t)n * fsize(dtype)); /* NaN: the padding, and every output element */
  if (!output)
    for (int64_t r = 0; r < p->rows; ++r)
      for (int64_t j = 0; j < cols; ++j) fset(p, at(p, r, j), uniform());
  if (output) {
    p->ref = calloc((size_t)(p->rows * cols + 1), sizeof(double));
    p->bound = calloc((size_t)(p->rows * cols + 1), sizeof(double));
  }
}

/* Builds the operands of the case: random inputs, NaN outputs and padding. */
static void fused_setup(fused_case* c) {
  const int64_t w = c->s.width, rows_w = c->s.op == F_SILU_AND_MUL ? 2 * w : w;
  const int32_t d = c->s.dtype;
  const int32_t stat_dtype = d == OPTIMIZED_DTYPE_F64 ? OPTIMIZED_DTYPE_F64 : OPTIMIZED_DTYPE_F32; /* mean / rstd */
  switch (c->s.op) {
    case F_SOFTMAX:
    case F_LOG_SOFTMAX:
      if (!c->s.backward) {
        add_operand(c, R_X, 0, 1, w, d), add_operand(c, R_Y, 1, 1, w, d);
        for (int64_t i = 0; i < op_count(&c->o[R_X]); ++i)
          if (!isnan(fget(&c->o[R_X], i))) fset(&c->o[R_X], i, 3.0 * fget(&c->o[R_X], i));
      } else { /* y: a forward output (probabilities, or log-probabilities), computed here */
        add_operand(c, R_Y, 0, 1, w, d), add_operand(c, R_DY, 0, 1, w, d), add_operand(c, R_DX, 1, 1, w, d);
        operand* y = &c->o[R_Y];
        for (int64_t r = 0; r < c->s.rows; ++r) {
          double m = -INFINITY, sum = 0;
          for (int64_t j = 0; j < w; ++j) m = fmax(m, 3.0 * fget(y, at(y, r, j)));
          for (int64_t j = 0; j < w; ++j) sum += exp(3.0 * fget(y, at(y, r, j)) - m);
          for (int64_t j = 0; j < w; ++j) {
            const double z = 3.0 * fget(y, at(y, r, j)) - m;
            fset(y, at(y, r, j), c->s.op == F_SOFTMAX ? exp(z) / sum : z - log(sum));
          }
        }
      }
      break;
    case F_LAYER_NORM:
    case F_RMS_NORM: {
      const int layer = c->s.op == F_LAYER_NORM;
      if (!c->s.backward) {
        add_operand(c, R_X, 0, 1, w, d);
        for (int64_t i = 0; i < op_count(&c->o[R_X]); ++i) /* a mean away from 0 */
          if (!isnan(fget(&c->o[R_X], i))) fset(&c->o[R_X], i, fget(&c->o[R_X], i) + 0.4);
        if (c->s.residual) add_operand(c, R_RES, 0, 1, w, d), add_operand(c, R_RESOUT, 1, 1, w, d);
        if (c->s.weight) add_operand(c, R_W, 0, 0, w, d);
        if (c->s.bias && layer) add_operand(c, R_B, 0, 0, w, d);
        add_operand(c, R_Y, 1, 1, w, d);
        if (c->s.stats) {
          if (layer) add_operand(c, R_MEAN, 1, 0, c->s.rows, stat_dtype);
          add_operand(c, R_RSTD, 1, 0, c->s.rows, stat_dtype);
        }
      } else { /* h random; mean / rstd its statistics, as the forward saves them (fp32; fp64 for fp64) */
        add_operand(c, R_DY, 0, 1, w, d), add_operand(c, R_X, 0, 1, w, d); /* R_X holds h */
        if (c->s.weight) add_operand(c, R_W, 0, 0, w, d);
        if (layer) add_operand(c, R_MEAN, 0, 0, c->s.rows, stat_dtype);
        add_operand(c, R_RSTD, 0, 0, c->s.rows, stat_dtype);
        if (c->s.residual) add_operand(c, R_DRES, 0, 1, w, d);
        add_operand(c, R_DX, 1, 1, w, d);
        if (c->s.dweight) add_operand(c, R_DW, 1, 0, w, d);
        if (c->s.dbias && layer) add_operand(c, R_DB, 1, 0, w, d);
        const operand* h = &c->o[R_X];
        for (int64_t r = 0; r < c->s.rows; ++r) {
          double mean = 0, var = 0;
          if (layer) {
            for (int64_t j = 0; j < w; ++j) mean += fget(h, at(h, r, j));
            mean /= (double)w;
          }
          for (int64_t j = 0; j < w; ++j) var += (fget(h, at(h, r, j)) - mean) * (fget(h, at(h, r, j)) - mean);
          if (layer) fset(&c->o[R_MEAN], r, mean); /* rounded to the statistics' dtype */
          fset(&c->o[R_RSTD], r, 1.0 / sqrt(var / (double)w + c->s.eps));
        }
      }
      break;
    }
    case F_BIAS_GELU:
      if (!c->s.backward) {
        add_operand(c, R_X, 0, 1, w, d);
        if (c->s.bias) add_operand(c, R_B, 0, 0, w, d);
        add_operand(c, R_Y, 1, 1, w, d);
      } else {
        add_operand(c, R_DY, 0, 1, w, d), add_operand(c, R_X, 0, 1, w, d);
        if (c->s.bias) add_operand(c, R_B, 0, 0, w, d);
        add_operand(c, R_DX, 1, 1, w, d);
        if (c->s.dbias) add_operand(c, R_DB, 1, 0, w, d);
      }
      for (int64_t i = 0; i < op_count(&c->o[R_X]); ++i) /* z over [-3, 3]: both tails of the GELU */
        if (!isnan(fget(&c->o[R_X], i))) fset(&c->o[R_X], i, 2.5 * fget(&c->o[R_X], i));
      break;
    case F_SILU_AND_MUL:
      if (!c->s.backward) {
        add_operand(c, R_X, 0, 1, rows_w, d), add_operand(c, R_Y, 1, 1, w, d);
      } else {
        add_operand(c, R_DY, 0, 1, w, d), add_operand(c, R_X, 0, 1, rows_w, d), add_operand(c, R_DX, 1, 1, rows_w, d);
      }
      for (int64_t i = 0; i < op_count(&c->o[R_X]); ++i)
        if (!isnan(fget(&c->o[R_X], i))) fset(&c->o[R_X], i, 4.0 * fget(&c->o[R_X], i));
      break;
  }
}

static void fused_free(fused_case* c) {
  for (int r = 0; r < R_COUNT; ++r) {
    free(c->o[r].host), free(c->o[r].ref), free(c->o[r].bound);
    c->o[r].host = NULL, c->o[r].ref = c->o[r].bound = NULL, c->o[r].present = 0;
  }
}

/* ---- the float64 reference and the family's tolerance rule ----
 * Every output element must satisfy |out - ref| <= 2 u_out |ref| + 8 u_c (sqrt(n) S + E) + floor
 * (tests/fused_test_util.h explains each term; u_out = u_c = 2^-24 for fp32, 2^-53 for fp64; n the
 * terms of the element's sums, S their size, E the element's own roundings). The backward reads the
 * mean / rstd set up above (fp32; fp64 for fp64), and the reference takes the same values. */
static void expect(fused_case* c, int role, int64_t r, int64_t j, double ref, double n, double S, double E) {
  operand* p = &c->o[role];
  const double u = c->s.dtype == OPTIMIZED_DTYPE_F64 && p->dtype == OPTIMIZED_DTYPE_F64 ? ldexp(1.0, -53) : ldexp(1.0, -24);
  const double uc = c->s.dtype == OPTIMIZED_DTYPE_F64 ? ldexp(1.0, -53) : ldexp(1.0, -24);
  const double floor_ = c->s.dtype == OPTIMIZED_DTYPE_F64 ? ldexp(1.0, -1022) : ldexp(1.0, -126);
  const int64_t k = p->two_d ? r * p->cols + j : j;
  p->ref[k] = ref;
  p->bound[k] = 2.0 * u * fabs(ref) + 8.0 * uc * (sqrt(n) * S + E) + floor_;
}

static double sigmoid(double a) { return 1.0 / (1.0 + exp(-a)); }
static double gelu(double z, int tanh_form) {
  if (!tanh_form) return 0.5 * z * (1.0 + erf(z / sqrt(2.0)));
  const double k = sqrt(2.0 / acos(-1.0));
  return 0.5 * z * (1.0 + tanh(k * (z + 0.044715 * z * z * z)));
}
static double gelu_grad(double z, int tanh_form) {
  if (!tanh_form) return 0.5 * (1.0 + erf(z / sqrt(2.0))) + z * exp(-0.5 * z * z) / sqrt(2.0 * acos(-1.0));
  const double k = sqrt(2.0 / acos(-1.0)), t = tanh(k * (z + 0.044715 * z * z * z));
  return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * z * z);
}

static void fused_reference(fused_case* c) {
  const int64_t w = c->s.width, rows = c->s.rows;
  const operand *x = &c->o[R_X], *res = &c->o[R_RES], *wt = &c->o[R_W], *bs = &c->o[R_B], *dy = &c->o[R_DY],
                *dres = &c->o[R_DRES], *yin = &c->o[R_Y];
  const double s = c->s.scale;
#define W_(j) (wt->present ? fget(wt, j) : 1.0)
#define B_(j) (bs->present ? fget(bs, j) : 0.0)
  switch (c->s.op) {
    case F_SOFTMAX:
    case F_LOG_SOFTMAX:
      for (int64_t r = 0; r < rows; ++r) {
        if (!c->s.backward) {
          double m = -INFINITY, sum = 0;
          for (int64_t j = 0; j < w; ++j) m = fmax(m, s * fget(x, at(x, r, j)));
          for (int64_t j = 0; j < w; ++j) sum += exp(s * fget(x, at(x, r, j)) - m);
          const double lse = m + log(sum);
          for (int64_t j = 0; j < w; ++j) {
            const double z = s * fget(x, at(x, r, j)), y = exp(z - lse);
            if (c->s.op == F_SOFTMAX) expect(c, R_Y, r, j, y, (double)w, y, y * (1 + fabs(z) + fabs(m)));
            else expect(c, R_Y, r, j, z - lse, (double)w, 1.0, 1 + fabs(z) + fabs(m) + fabs(lse));
          }
        } else {
          double dot = 0, dot_abs = 0, sdy = 0, sdy_abs = 0;
          for (int64_t j = 0; j < w; ++j) {
            const double y = fget(yin, at(yin, r, j)), g = fget(dy, at(dy, r, j));
            dot += g * y, dot_abs += fabs(g * y), sdy += g, sdy_abs += fabs(g);
          }
          for (int64_t j = 0; j < w; ++j) {
            const double y = fget(yin, at(yin, r, j)), g = fget(dy, at(dy, r, j));
            if (c->s.op == F_SOFTMAX)
              expect(c, R_DX, r, j, s * y * (g - dot), (double)w, fabs(s * y) * dot_abs, fabs(s * y) * (fabs(g) + fabs(dot)));
            else
              expect(c, R_DX, r, j, s * (g - exp(y) * sdy), (double)w, fabs(s) * exp(y) * sdy_abs,
                     fabs(s) * (fabs(g) + exp(y) * fabs(sdy) * (1 + fabs(y))));
          }
        }
      }
      break;
    case F_LAYER_NORM:
    case F_RMS_NORM: {
      const int layer = c->s.op == F_LAYER_NORM;
      if (!c->s.backward) {
        for (int64_t r = 0; r < rows; ++r) {
          double mean = 0, mean_abs = 0, var = 0;
          double* h = malloc((size_t)w * sizeof(double));
          for (int64_t j = 0; j < w; ++j) { /* h = x + residual, rounded to the dtype (fused.h) */
            const double x_j = fget(x, at(x, r, j));
            h[j] = res->present ? round_to(c->s.dtype, x_j + fget(res, at(res, r, j))) : x_j;
            if (res->present) expect(c, R_RESOUT, r, j, h[j], 1, 0, fabs(h[j]));
            mean += h[j], mean_abs += fabs(h[j]);
          }
          mean = layer ? mean / (double)w : 0.0;
          mean_abs /= (double)w;
          for (int64_t j = 0; j < w; ++j) var += (h[j] - mean) * (h[j] - mean);
          const double rstd = 1.0 / sqrt(var / (double)w + c->s.eps);
          for (int64_t j = 0; j < w; ++j) {
            const double xhat = (h[j] - mean) * rstd;
            if (layer)
              expect(c, R_Y, r, j, xhat * W_(j) + B_(j), (double)w, (fabs(xhat) + mean_abs * rstd) * fabs(W_(j)),
                     fabs(xhat * W_(j)) + fabs(B_(j)));
            else
              expect(c, R_Y, r, j, xhat * W_(j), (double)w, fabs(xhat * W_(j)), fabs(xhat * W_(j)));
          }
          if (c->o[R_MEAN].present) expect(c, R_MEAN, 0, r, mean, (double)w, mean_abs, fabs(mean));
          if (c->o[R_RSTD].present) expect(c, R_RSTD, 0, r, rstd, (double)w, rstd, rstd);
          free(h);
        }
      } else {
        double *dw = calloc((size_t)w + 1, sizeof(double)), *dw_s = calloc((size_t)w + 1, sizeof(double)),
               *dw_e = calloc((size_t)w + 1, sizeof(double)), *db = calloc((size_t)w + 1, sizeof(double)),
               *db_s = calloc((size_t)w + 1, sizeof(double));
        for (int64_t r = 0; r < rows; ++r) {
          const double mean = layer ? fget(&c->o[R_MEAN], r) : 0.0;
          const double rstd = fget(&c->o[R_RSTD], r);
          double mg = 0, mgx = 0, mg_abs = 0, mgk_abs = 0;
          for (int64_t j = 0; j < w; ++j) {
            const double xhat = (fget(x, at(x, r, j)) - mean) * rstd, g = fget(dy, at(dy, r, j)) * W_(j);
            const double K = fabs(xhat) + fabs(mean) * rstd + 1;
            mg += g, mgx += g * xhat, mg_abs += fabs(g), mgk_abs += fabs(g) * K;
          }
          mg /= (double)w, mgx /= (double)w, mg_abs /= (double)w, mgk_abs /= (double)w;
          if (!layer) mg = 0;
          for (int64_t j = 0; j < w; ++j) {
            const double xhat = (fget(x, at(x, r, j)) - mean) * rstd, g_dy = fget(dy, at(dy, r, j)), g = g_dy * W_(j);
            const double K = fabs(xhat) + fabs(mean) * rstd + 1;
            const double d_res = dres->present ? fget(dres, at(dres, r, j)) : 0.0;
            expect(c, R_DX, r, j, rstd * (g - mg - xhat * mgx) + d_res, (double)w,
                   rstd * (mg_abs + fabs(xhat) * mgk_abs), rstd * (fabs(g) + fabs(mg) + K * fabs(mgx)) + fabs(d_res));
            dw[j] += g_dy * xhat, dw_s[j] += fabs(g_dy * xhat), dw_e[j] += fabs(g_dy) * K;
            db[j] += g_dy, db_s[j] += fabs(g_dy);
          }
        }
        for (int64_t j = 0; j < w; ++j) {
          if (c->o[R_DW].present) expect(c, R_DW, 0, j, dw[j], (double)rows, dw_s[j], dw_e[j]);
          if (c->o[R_DB].present) expect(c, R_DB, 0, j, db[j], (double)rows, db_s[j], 0);
        }
        free(dw), free(dw_s), free(dw_e), free(db), free(db_s);
      }
      break;
    }
    case F_BIAS_GELU: {
      double *db = calloc((size_t)w + 1, sizeof(double)), *db_s = calloc((size_t)w + 1, sizeof(double)),
             *db_e = calloc((size_t)w + 1, sizeof(double));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < w; ++j) {
          const double z = fget(x, at(x, r, j)) + B_(j), az = fabs(z);
          if (!c->s.backward) {
            expect(c, R_Y, r, j, gelu(z, c->s.approximate), 1, 0, az * (1 + 1.13 + az + 0.05 * az * az * az));
          } else {
            const double g = fget(dy, at(dy, r, j)), dx = g * gelu_grad(z, c->s.approximate);
            const double E = fabs(g) * (1 + az) * (1 + az) * (1 + az);
            expect(c, R_DX, r, j, dx, 1, 0, E);
            db[j] += dx, db_s[j] += fabs(dx), db_e[j] += E;
          }
        }
      if (c->o[R_DB].present)
        for (int64_t j = 0; j < w; ++j) expect(c, R_DB, 0, j, db[j], (double)rows, db_s[j], db_e[j]);
      free(db), free(db_s), free(db_e);
      break;
    }
    case F_SILU_AND_MUL:
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < w; ++j) {
          const double a = fget(x, at(x, r, j)), b = fget(x, at(x, r, w + j)), sg = sigmoid(a);
          if (!c->s.backward) {
            const double y = a * sg * b;
            expect(c, R_Y, r, j, y, 1, 0, fabs(y) * (2 + fabs(a)));
          } else {
            const double g = fget(dy, at(dy, r, j)), db = g * a * sg;
            expect(c, R_DX, r, j, g * b * sg * (1 + a * (1 - sg)), 1, 0,
                   fabs(g * b) * sg * (1 + fabs(a)) * (2 + fabs(a)));
            expect(c, R_DX, r, w + j, db, 1, 0, fabs(db) * (2 + fabs(a)));
          }
        }
      break;
  }
#undef W_
#undef B_
}

/* Views of every present operand, over the host buffers or (use_dev) their CUDA copies. */
static void fused_views(fused_case* c, int32_t device_type, int use_dev) {
  for (int r = 0; r < R_COUNT; ++r) {
    operand* p = &c->o[r];
    if (!p->present) continue;
    memset(&p->view, 0, sizeof p->view);
    p->view.data = use_dev ? p->dev : p->host;
    p->view.dtype = p->dtype;
    p->view.device_type = device_type;
    if (p->two_d) {
      p->view.rank = 2;
      p->view.shape[0] = p->rows, p->view.shape[1] = p->cols;
      p->view.strides[0] = p->ld, p->view.strides[1] = 1;
    } else {
      p->view.rank = 1;
      p->view.shape[0] = p->cols, p->view.strides[0] = 1;
    }
  }
}

#define V(role) (c->o[role].present ? &c->o[role].view : NULL)

static optimized_status fused_call(fused_case* c, const char* variant, void* stream) {
  switch (c->s.op) {
    case F_SOFTMAX:
      return c->s.backward ? optimized_softmax_backward(V(R_Y), V(R_DY), V(R_DX), c->s.scale, variant, stream)
                         : optimized_softmax_forward(V(R_X), V(R_Y), c->s.scale, variant, stream);
    case F_LOG_SOFTMAX:
      return c->s.backward ? optimized_log_softmax_backward(V(R_Y), V(R_DY), V(R_DX), c->s.scale, variant, stream)
                         : optimized_log_softmax_forward(V(R_X), V(R_Y), c->s.scale, variant, stream);
    case F_LAYER_NORM:
      return c->s.backward ? optimized_layer_norm_backward(V(R_DY), V(R_X), V(R_W), V(R_MEAN), V(R_RSTD), V(R_DRES),
                                                         V(R_DX), V(R_DW), V(R_DB), variant, stream)
                         : optimized_layer_norm_forward(V(R_X), V(R_RES), V(R_W), V(R_B), c->s.eps, V(R_Y), V(R_RESOUT),
                                                        V(R_MEAN), V(R_RSTD), variant, stream);
    case F_RMS_NORM:
      return c->s.backward ? optimized_rms_norm_backward(V(R_DY), V(R_X), V(R_W), V(R_RSTD), V(R_DRES), V(R_DX), V(R_DW),
                                                       variant, stream)
                         : optimized_rms_norm_forward(V(R_X), V(R_RES), V(R_W), c->s.eps, V(R_Y), V(R_RESOUT), V(R_RSTD),
                                                      variant, stream);
    case F_BIAS_GELU:
      return c->s.backward ? optimized_bias_gelu_backward(V(R_DY), V(R_X), V(R_B), c->s.approximate, V(R_DX), V(R_DB),
                                                        variant, stream)
                         : optimized_bias_gelu_forward(V(R_X), V(R_B), c->s.approximate, V(R_Y), variant, stream);
    case F_SILU_AND_MUL:
      return c->s.backward ? optimized_silu_and_mul_backward(V(R_DY), V(R_X), V(R_DX), variant, stream)
                         : optimized_silu_and_mul_forward(V(R_X), V(R_Y), variant, stream);
  }
  return OPTIMIZED_STATUS_INTERNAL;
}
#undef V

/* Every output element within its bound (NaN fails), the padding of every output still NaN. */
static void fused_compare(fused_case* c, const char* what) {
  char detail[512];
  double worst = 0;
  const char* worst_role = "";
  int padding_written = 0;
  for (int role = 0; role < R_COUNT; ++role) {
    const operand* p = &c->o[role];
    if (!p->present || !p->output) continue;
    for (int64_t r = 0; r < p->rows; ++r)
      for (int64_t j = 0; j < p->ld; ++j) {
        const double got = fget(p, at(p, r, j));
        if (j >= p->cols) {
          padding_written |= !isnan(got);
          continue;
        }
        const int64_t k = r * p->cols + j;
        double ratio = fabs(got - p->ref[k]) / p->bound[k];
        if (isnan(ratio)) ratio = INFINITY;
        if (ratio > worst) worst = ratio, worst_role = k_role[role];
      }
  }
  snprintf(detail, sizeof detail, "worst error / allowed = %g (%s)%s", worst, worst_role,
           padding_written ? "; row padding of an output was written" : "");
  check(worst <= 1.0 && !padding_written, what, detail);
}

static void run_fused_cpu(fused_case* c, const char* variant) {
  char what[200], detail[600];
  snprintf(what, sizeof what, "cpu %-5s fused %s %s %s rows %lld width %lld pad %lld", variant ? variant : "NULL",
           c->s.label, c->s.backward ? "bwd" : "fwd", c->s.dtype == OPTIMIZED_DTYPE_F64 ? "fp64" : "fp32",
           (long long)c->s.rows, (long long)c->s.width, (long long)c->s.pad);
  fused_setup(c);
  fused_reference(c);
  fused_views(c, OPTIMIZED_DEVICE_CPU, 0);
  const optimized_status s = fused_call(c, variant, NULL);
  if (s != OPTIMIZED_STATUS_OK) {
    snprintf(detail, sizeof detail, "status %s: %s", optimized_status_string(s), optimized_last_error());
    check(0, what, detail);
  } else {
    fused_compare(c, what);
  }
  fused_free(c);
}

#ifdef OPTIMIZED_TEST_CUDA
static void run_fused_cuda(fused_case* c, const char* variant) {
  char what[200], detail[600];
  snprintf(what, sizeof what, "cuda %-15s fused %s %s rows %lld width %lld pad %lld", variant, c->s.label,
           c->s.backward ? "bwd" : "fwd", (long long)c->s.rows, (long long)c->s.width, (long long)c->s.pad);
  fused_setup(c);
  fused_reference(c);
  cudaStream_t stream = NULL;
  int ok = cudaStreamCreate(&stream) == cudaSuccess;
  for (int r = 0; r < R_COUNT && ok; ++r) {
    operand* p = &c->o[r];
    if (!p->present) continue;
    const size_t bytes = (size_t)(op_count(p) > 0 ? op_count(p) : 1) * fsize(p->dtype);
    ok = cudaMalloc(&p->dev, bytes) == cudaSuccess && cudaMemcpy(p->dev, p->host, bytes, cudaMemcpyHostToDevice) == cudaSuccess;
  }
  if (!ok) {
    check(0, what, "cudaMalloc / cudaMemcpy / cudaStreamCreate failed");
  } else {
    fused_views(c, OPTIMIZED_DEVICE_CUDA, 1);
    const optimized_status s = fused_call(c, variant, stream);
    const cudaError_t e = cudaStreamSynchronize(stream);
    for (int r = 0; r < R_COUNT; ++r) {
      operand* p = &c->o[r];
      if (p->present && p->output)
        cudaMemcpy(p->host, p->dev, (size_t)(op_count(p) > 0 ? op_count(p) : 1) * fsize(p->dtype), cudaMemcpyDeviceToHost);
    }
    if (s != OPTIMIZED_STATUS_OK || e != cudaSuccess) {
      snprintf(detail, sizeof detail, "status %s: %s (stream: %s)", optimized_status_string(s), optimized_last_error(),
               cudaGetErrorString(e));
      check(0, what, detail);
    } else {
      fused_compare(c, what);
    }
  }
  for (int r = 0; r < R_COUNT; ++r) {
    if (c->o[r].dev) cudaFree(c->o[r].dev);
    c->o[r].dev = NULL;
  }
  if (stream) cudaStreamDestroy(stream);
  fused_free(c);
}
#endif

/* Odd sizes (1, primes), padded rows, optional operands present and absent, every op forward and
 * backward. */
static const fused_spec k_fused_cases[] = {
    /* label        op              bwd gelu dtype             rows width pad res w  b  stats dw db eps   scale */
    {"softmax",      F_SOFTMAX,      0, 0, OPTIMIZED_DTYPE_F32, 3, 37, 3, 0, 0, 0, 0, 0, 0, 0, 0.7},
    {"softmax",      F_SOFTMAX,      0, 0, OPTIMIZED_DTYPE_F32, 5, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1.0},
    {"log_softmax",  F_LOG_SOFTMAX,  0, 0, OPTIMIZED_DTYPE_F32, 2, 53, 5, 0, 0, 0, 0, 0, 0, 0, 1.0},
    {"softmax",      F_SOFTMAX,      1, 0, OPTIMIZED_DTYPE_F32, 3, 37, 2, 0, 0, 0, 0, 0, 0, 0, 1.3},
    {"log_softmax",  F_LOG_SOFTMAX,  1, 0, OPTIMIZED_DTYPE_F32, 4, 29, 0, 0, 0, 0, 0, 0, 0, 0, 0.5},
    {"layer_norm",   F_LAYER_NORM,   0, 0, OPTIMIZED_DTYPE_F32, 5, 29, 4, 0, 1, 1, 1, 0, 0, 1e-5, 1},
    {"add_layer_norm (no weight, bias, stats)", F_LAYER_NORM, 0, 0, OPTIMIZED_DTYPE_F32, 3, 31, 1, 1, 0, 0, 0, 0, 0, 1e-3, 1},
    {"layer_norm",   F_LAYER_NORM,   1, 0, OPTIMIZED_DTYPE_F32, 5, 29, 4, 0, 1, 0, 0, 1, 1, 1e-5, 1},
    {"add_layer_norm (dresidual_out, no weight)", F_LAYER_NORM, 1, 0, OPTIMIZED_DTYPE_F32, 7, 13, 0, 1, 0, 0, 0, 0, 1, 1e-5, 1},
    {"layer_norm (zero rows)", F_LAYER_NORM, 1, 0, OPTIMIZED_DTYPE_F32, 0, 11, 0, 0, 1, 0, 0, 1, 1, 1e-5, 1},
    {"add_rms_norm", F_RMS_NORM,     0, 0, OPTIMIZED_DTYPE_F32, 4, 41, 1, 1, 1, 0, 1, 0, 0, 1e-6, 1},
    {"rms_norm",     F_RMS_NORM,     0, 0, OPTIMIZED_DTYPE_F32, 1, 97, 0, 0, 0, 0, 0, 0, 0, 1e-6, 1},
    {"add_rms_norm", F_RMS_NORM,     1, 0, OPTIMIZED_DTYPE_F32, 4, 41, 1, 1, 1, 0, 0, 1, 0, 1e-6, 1},
    {"bias_gelu erf", F_BIAS_GELU,   0, OPTIMIZED_GELU_NONE, OPTIMIZED_DTYPE_F32, 3, 23, 2, 0, 0, 1, 0, 0, 0, 0, 1},
    {"bias_gelu tanh (no bias)", F_BIAS_GELU, 0, OPTIMIZED_GELU_TANH, OPTIMIZED_DTYPE_F32, 2, 17, 0, 0, 0, 0, 0, 0, 0, 0, 1},
    {"bias_gelu erf", F_BIAS_GELU,   1, OPTIMIZED_GELU_NONE, OPTIMIZED_DTYPE_F32, 3, 23, 2, 0, 0, 1, 0, 0, 1, 0, 1},
    {"bias_gelu tanh", F_BIAS_GELU,  1, OPTIMIZED_GELU_TANH, OPTIMIZED_DTYPE_F32, 5, 7, 0, 0, 0, 1, 0, 0, 1, 0, 1},
    {"silu_and_mul", F_SILU_AND_MUL, 0, 0, OPTIMIZED_DTYPE_F32, 3, 19, 2, 0, 0, 0, 0, 0, 0, 0, 1},
    {"silu_and_mul", F_SILU_AND_MUL, 1, 0, OPTIMIZED_DTYPE_F32, 3, 19, 2, 0, 0, 0, 0, 0, 0, 0, 1},
    /* fp64 (the cpu variant computes in fp64): the bound shrinks to fp64 rounding */
    {"add_rms_norm", F_RMS_NORM,     0, 0, OPTIMIZED_DTYPE_F64, 3, 19, 1, 1, 1, 0, 1, 0, 0, 1e-6, 1},
    {"softmax",      F_SOFTMAX,      1, 0, OPTIMIZED_DTYPE_F64, 2, 31, 0, 0, 0, 0, 0, 0, 0, 0, 0.9},
};
#define N_FUSED_CASES ((int)(sizeof k_fused_cases / sizeof k_fused_cases[0]))

static fused_case make_case(const fused_spec* spec) {
  fused_case c;
  memset(&c, 0, sizeof c);
  c.s = *spec;
  return c;
}

static void fused_results(void) {
  for (int i = 0; i < N_FUSED_CASES; ++i) {
    fused_case c = make_case(&k_fused_cases[i]);
    run_fused_cpu(&c, "cpu");
    c = make_case(&k_fused_cases[i]);
    run_fused_cpu(&c, "auto");
  }
  fused_case c = make_case(&k_fused_cases[0]);
  run_fused_cpu(&c, NULL); /* NULL variant: auto */
#ifdef OPTIMIZED_TEST_CUDA
  if (optimized_cuda_device_count() > 0) {
    const char* const variants[] = {"auto", "unfused", "fused_streaming", "fused_registers"};
    for (int v = 0; v < 4; ++v)
      for (int i = 0; i < N_FUSED_CASES; ++i) {
        if (k_fused_cases[i].dtype == OPTIMIZED_DTYPE_F64) continue; /* fp64 runs on the cpu variant only */
        c = make_case(&k_fused_cases[i]);
        run_fused_cuda(&c, variants[v]);
      }
  } else {
    printf("skip  fused CUDA cases: no CUDA device\n");
  }
#endif
}

/* Every error path of the fused entries: the status, and a message that names the argument. */
static void fused_error_paths(void) {
  enum { ROWS = 3, W = 37 };
  static float x[ROWS * W], y[ROWS * W], dy[ROWS * W], dx[ROWS * (W + 1)], wv[W], bv[W], st[ROWS], st2[ROWS];
  for (int i = 0; i < ROWS * W; ++i) x[i] = uniform(), dy[i] = uniform(), y[i] = 1.0f / W;
  for (int i = 0; i < W; ++i) wv[i] = uniform(), bv[i] = uniform();
  for (int i = 0; i < ROWS; ++i) st[i] = 0.1f, st2[i] = 1.0f;
  const int64_t srw[2] = {ROWS, W}, srw1[2] = {ROWS, W + 1}, sw[1] = {W}, sw1[1] = {W - 1}, sr[1] = {ROWS};
  optimized_tensor tx, ty, tdy, tdx, tdx_wide, tw, tb, tb_short, tmean, trstd, t;
  optimized_tensor_contiguous(&tx, x, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, srw);
  optimized_tensor_contiguous(&ty, y, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, srw);
  optimized_tensor_contiguous(&tdy, dy, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, srw);
  optimized_tensor_contiguous(&tdx, dx, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, srw);
  optimized_tensor_contiguous(&tdx_wide, dx, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, srw1);
  optimized_tensor_contiguous(&tw, wv, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 1, sw);
  optimized_tensor_contiguous(&tb, bv, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 1, sw);
  optimized_tensor_contiguous(&tb_short, bv, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 1, sw1);
  optimized_tensor_contiguous(&tmean, st, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 1, sr);
  optimized_tensor_contiguous(&trstd, st2, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 1, sr);
  const optimized_status I = OPTIMIZED_STATUS_INVALID_ARGUMENT, U = OPTIMIZED_STATUS_UNSUPPORTED;

  expect_error("fused: softmax NULL x", optimized_softmax_forward(NULL, &ty, 1, "auto", NULL), I, "x: expected a pointer");
  expect_error("fused: softmax NULL y", optimized_softmax_forward(&tx, NULL, 1, "auto", NULL), I, "y: expected a pointer");
  expect_error("fused: softmax backward NULL dy", optimized_softmax_backward(&ty, NULL, &tdx, 1, "cpu", NULL), I, "dy:");
  expect_error("fused: log_softmax backward NULL dx", optimized_log_softmax_backward(&ty, &tdy, NULL, 1, "cpu", NULL),
               I, "dx:");
  expect_error("fused: unknown variant", optimized_softmax_forward(&tx, &ty, 1, "fastest", NULL), I,
               "variant: expected one of auto, cpu, unfused, fused_streaming, fused_registers");
  expect_error("fused: CUDA variant on CPU tensors", optimized_softmax_forward(&tx, &ty, 1, "fused_streaming", NULL), I,
               "variant fused_streaming");
  expect_error("fused: mismatched shape names y", optimized_softmax_forward(&tx, &tdx_wide, 1, "cpu", NULL), I,
               "y: expected shape (3, 37)");
  expect_error("fused: mismatched shape names dx", optimized_softmax_backward(&ty, &tdy, &tdx_wide, 1, "cpu", NULL), I,
               "dx: expected shape (3, 37)");
  t = ty, t.dtype = OPTIMIZED_DTYPE_BF16;
  expect_error("fused: mismatched dtype names y", optimized_softmax_forward(&tx, &t, 1, "cpu", NULL), I,
               "y: expected dtype fp32");
  t = tx, t.dtype = OPTIMIZED_DTYPE_I32;
  expect_error("fused: int32 x is unsupported", optimized_softmax_forward(&t, &ty, 1, "cpu", NULL), U,
               "x: expected dtype fp32, fp16, bf16");
  t = tx, t.dtype = 42;
  expect_error("fused: a dtype value out of range names x", optimized_softmax_forward(&t, &ty, 1, "cpu", NULL), I,
               "x: expected dtype");
  t = ty, t.device_type = 9;
  expect_error("fused: bad device type names y", optimized_softmax_forward(&tx, &t, 1, "cpu", NULL), I,
               "y: expected device_type");
  t = tx, t.strides[0] = 1, t.strides[1] = ROWS; /* column-major */
  expect_error("fused: non-unit last stride names x", optimized_softmax_forward(&t, &ty, 1, "cpu", NULL), I,
               "x: expected unit stride");
  t = tdx, t.data = dy + 1; /* dx overlapping dy, not the same view */
  expect_error("fused: overlapping output names dx", optimized_softmax_backward(&ty, &tdy, &t, 1, "cpu", NULL), I,
               "dx: expected an output that does not overlap dy");
  t = tx, t.rank = 0;
  expect_error("fused: a required operand of rank 0 names x", optimized_softmax_forward(&t, &ty, 1, "cpu", NULL), I,
               "x: expected rank 1 (width) or 2 (rows, width)");

  /* layer_norm / rms_norm */
  expect_error("fused: layer_norm bias of the wrong length",
               optimized_layer_norm_forward(&tx, NULL, &tw, &tb_short, 1e-5, &ty, NULL, NULL, NULL, "cpu", NULL), I,
               "bias: expected shape (37)");
  t = tw, t.rank = 0;
  expect_error("fused: a rank-0 view for an optional operand names weight",
               optimized_layer_norm_forward(&tx, NULL, &t, NULL, 1e-5, &ty, NULL, NULL, NULL, "cpu", NULL), I,
               "weight: expected NULL (absent)");
  expect_error("fused: negative eps", optimized_rms_norm_forward(&tx, NULL, &tw, -1.0, &ty, NULL, NULL, "cpu", NULL), I,
               "eps: expected >= 0");
  expect_error("fused: residual without residual_out",
               optimized_rms_norm_forward(&tx, &tdy, &tw, 1e-5, &ty, NULL, NULL, "cpu", NULL), I,
               "residual_out: required with residual");
  expect_error("fused: residual_out without residual",
               optimized_layer_norm_forward(&tx, NULL, NULL, NULL, 1e-5, &ty, &tdx, NULL, NULL, "cpu", NULL), I,
               "residual_out: given without residual");
  expect_error("fused: layer_norm backward without mean",
               optimized_layer_norm_backward(&tdy, &tx, &tw, NULL, &trstd, NULL, &tdx, NULL, NULL, "cpu", NULL), I,
               "mean: required");
  expect_error("fused: rms_norm backward without rstd",
               optimized_rms_norm_backward(&tdy, &tx, &tw, NULL, NULL, &tdx, NULL, "cpu", NULL), I, "rstd: required");
  expect_error("fused: rms_norm backward NULL h",
               optimized_rms_norm_backward(&tdy, NULL, &tw, &trstd, NULL, &tdx, NULL, "cpu", NULL), I, "h: expected a pointer");
  expect_error("fused: dweight without weight",
               optimized_rms_norm_backward(&tdy, &tx, NULL, &trstd, NULL, &tdx, &tb, "cpu", NULL), I,
               "dweight: asked for without weight");
  t = trstd, t.dtype = OPTIMIZED_DTYPE_BF16;
  expect_error("fused: rstd must be fp32", optimized_rms_norm_forward(&tx, NULL, NULL, 1e-5, &ty, NULL, &t, "cpu", NULL),
               I, "rstd: expected dtype fp32");
  const int64_t sr2[1] = {ROWS - 1};
  optimized_tensor_contiguous(&t, st, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 1, sr2);
  expect_error("fused: mean of the wrong length",
               optimized_layer_norm_forward(&tx, NULL, NULL, NULL, 1e-5, &ty, NULL, &t, NULL, "cpu", NULL), I,
               "mean: expected shape (3)");

  /* bias_gelu, silu_and_mul */
  expect_error("fused: bias_gelu bad approximate", optimized_bias_gelu_forward(&tx, &tb, 7, &ty, "cpu", NULL), I,
               "approximate: expected OPTIMIZED_GELU_NONE (0) or OPTIMIZED_GELU_TANH (1); given 7");
  expect_error("fused: bias_gelu backward NULL x",
               optimized_bias_gelu_backward(&tdy, NULL, &tb, OPTIMIZED_GELU_NONE, &tdx, NULL, "cpu", NULL), I, "x:");
  expect_error("fused: silu_and_mul odd last dimension", optimized_silu_and_mul_forward(&tx, &ty, "cpu", NULL), I,
               "x: expected an even last dimension");
  {
    const int64_t s2d[2] = {ROWS, 2 * 18}, sd[2] = {ROWS, 17};
    optimized_tensor tx2, tyd;
    optimized_tensor_contiguous(&tx2, dx, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, s2d);
    optimized_tensor_contiguous(&tyd, y, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, sd);
    expect_error("fused: silu_and_mul y of the wrong width", optimized_silu_and_mul_forward(&tx2, &tyd, "cpu", NULL), I,
                 "y: expected shape (3, 18)");
  }

  /* CUDA tensors where no CUDA device can run them: UNSUPPORTED, after the argument checks. */
  if (optimized_cuda_device_count() == 0) {
    optimized_tensor cx = tx, cy = ty;
    cx.device_type = cy.device_type = OPTIMIZED_DEVICE_CUDA;
    expect_error("fused: CUDA tensors without a usable CUDA device",
                 optimized_softmax_forward(&cx, &cy, 1, "auto", NULL), U, "softmax forward");
  }

  /* The variant queries of the family. */
  const char* v = NULL;
  check(optimized_fused_resolve_variant("softmax", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 4096, 0, 1, &v) ==
                OPTIMIZED_STATUS_OK && v && strcmp(v, "cpu") == 0,
        "fused resolve: auto on the CPU is cpu", optimized_last_error());
  int64_t fwd = -1, fwd_unaligned = -1, bwd = -1, gelu_w = -1, bf16 = -1;
  check(optimized_fused_registers_max_width("softmax", OPTIMIZED_DTYPE_F32, 0, 1, &fwd) == OPTIMIZED_STATUS_OK &&
            optimized_fused_registers_max_width("softmax", OPTIMIZED_DTYPE_F32, 0, 0, &fwd_unaligned) == OPTIMIZED_STATUS_OK &&
            optimized_fused_registers_max_width("softmax", OPTIMIZED_DTYPE_F32, 1, 1, &bwd) == OPTIMIZED_STATUS_OK &&
            optimized_fused_registers_max_width("softmax", OPTIMIZED_DTYPE_BF16, 0, 1, &bf16) == OPTIMIZED_STATUS_OK &&
            optimized_fused_registers_max_width("bias_gelu", OPTIMIZED_DTYPE_F32, 0, 1, &gelu_w) == OPTIMIZED_STATUS_OK,
        "fused registers max width: queries succeed", optimized_last_error());
  char detail[200];
  snprintf(detail, sizeof detail, "fwd %lld, unaligned %lld, bwd %lld, bf16 %lld, bias_gelu %lld", (long long)fwd,
           (long long)fwd_unaligned, (long long)bwd, (long long)bf16, (long long)gelu_w);
  check(fwd > 0 && fwd_unaligned > 0 && fwd_unaligned <= fwd && bwd > 0 && bwd <= fwd && bf16 >= fwd && gelu_w == 0,
        "fused registers max width: a limit for row ops, none for elementwise ones", detail);
  int64_t rms_bf16 = -1;
  check(optimized_fused_registers_max_width("rms_norm", OPTIMIZED_DTYPE_BF16, 0, 1, &rms_bf16) == OPTIMIZED_STATUS_OK &&
            rms_bf16 > 0 &&
            optimized_fused_resolve_variant("rms_norm", OPTIMIZED_DTYPE_BF16, OPTIMIZED_DEVICE_CUDA, 0, rms_bf16 + 1, 0, 1,
                                            &v) ==
                OPTIMIZED_STATUS_OK && v && strcmp(v, "fused_streaming") == 0,
        "fused resolve: past the registers' limit auto streams", optimized_last_error());
  check(optimized_fused_resolve_variant("softmax", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CUDA, 0, 1024, 1, 1, &v) ==
                OPTIMIZED_STATUS_OK && v && strcmp(v, "cpu") != 0 &&
            optimized_variant_check("fused", v, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CUDA) == OPTIMIZED_STATUS_OK,
        "fused resolve: auto on CUDA is a CUDA variant", optimized_last_error());
  expect_error("fused resolve: unknown op",
               optimized_fused_resolve_variant("softmaxx", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 8, 0, 1, &v), I,
               "op: expected one of softmax, log_softmax");
  expect_error("fused resolve: NULL op",
               optimized_fused_resolve_variant(NULL, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 8, 0, 1, &v), I, "op:");
  expect_error("fused resolve: NULL result",
               optimized_fused_resolve_variant("softmax", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 8, 0, 1, NULL), I,
               "variant: expected a pointer");
  expect_error("fused resolve: negative width",
               optimized_fused_resolve_variant("softmax", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, -1, 0, 1, &v), I,
               "width: expected a row length >= 0");
  expect_error("fused resolve: int32",
               optimized_fused_resolve_variant("softmax", OPTIMIZED_DTYPE_I32, OPTIMIZED_DEVICE_CPU, 0, 8, 0, 1, &v), U,
               "dtype: expected fp32, fp16, bf16");
  expect_error("fused resolve: fp64 on CUDA",
               optimized_fused_resolve_variant("softmax", OPTIMIZED_DTYPE_F64, OPTIMIZED_DEVICE_CUDA, 0, 8, 0, 1, &v), U,
               "fp64 runs on the cpu variant only");
  expect_error("fused resolve: negative CUDA ordinal",
               optimized_fused_resolve_variant("softmax", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CUDA, -1, 8, 0, 1, &v), I,
               "device: expected device_index >= 0");
  expect_error("fused resolve: backward not 0 or 1",
               optimized_fused_resolve_variant("softmax", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 8, 2, 1, &v), I,
               "backward: expected 0 or 1");
  expect_error("fused max width: NULL result",
               optimized_fused_registers_max_width("softmax", OPTIMIZED_DTYPE_F32, 0, 1, NULL), I, "max_width:");
  expect_error("fused max width: unknown op",
               optimized_fused_registers_max_width("gelu", OPTIMIZED_DTYPE_F32, 0, 1, &fwd), I, "op: expected one of");
  int ops = 0, has_silu = 0;
  for (const char* name; (name = optimized_fused_op_name(ops)) != NULL; ++ops) {
    has_silu |= strcmp(name, "silu_and_mul") == 0;
    check(optimized_fused_registers_max_width(name, OPTIMIZED_DTYPE_F32, 0, 1, &fwd) == OPTIMIZED_STATUS_OK,
          "fused op names are what the queries take", name);
  }
  check(ops == 8 && has_silu && optimized_fused_op_name(-1) == NULL, "fused op names: 8, NULL past the ends", NULL);
}

/* ---- the loader ------------------------------------------------------------------------------ */

enum { REC_INTS = 3, N_RECORDS = 50, PER_SHARD = 7 };

/* Record i of the test dataset: int32 (3), distinct per record. */
static void record_values(uint64_t i, int32_t* out) {
  out[0] = (int32_t)i, out[1] = (int32_t)(7 * i + 1), out[2] = -(int32_t)i - 5;
}

static char g_tmp[256];

static void path_in_tmp(char* out, size_t size, const char* name) { snprintf(out, size, "%s/%s", g_tmp, name); }

/* Removes the temporary tree: the root holds dataset directories, which hold files only. */
static void remove_tree(const char* dir, int depth) {
  DIR* d = opendir(dir);
  if (!d) return;
  struct dirent* e;
  char path[512];
  while ((e = readdir(d)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode) && depth < 2) remove_tree(path, depth + 1);
    else unlink(path);
  }
  closedir(d);
  rmdir(dir);
}

/* Writes records [0, n) in chunks of the given sizes (the last chunk takes the rest). */
static optimized_status write_dataset(const char* dir, uint64_t n, uint64_t per_shard, uint64_t* shards) {
  optimized_shard_writer* w = NULL;
  const int64_t shape[1] = {REC_INTS};
  optimized_status s = optimized_shard_writer_create(&w, dir, "int32", 1, shape, per_shard, 0);
  if (s != OPTIMIZED_STATUS_OK) return s;
  int32_t* records = malloc((size_t)(n + 1) * REC_INTS * sizeof(int32_t));
  for (uint64_t i = 0; i < n; ++i) record_values(i, records + i * REC_INTS);
  const uint64_t chunks[3] = {1, 13, 0};
  uint64_t done = 0;
  for (int k = 0; k < 3 && s == OPTIMIZED_STATUS_OK; ++k) {
    uint64_t count = k == 2 ? n - done : (chunks[k] < n - done ? chunks[k] : n - done);
    s = optimized_shard_writer_append(w, records + done * REC_INTS, count);
    done += count;
  }
  free(records);
  if (s != OPTIMIZED_STATUS_OK) {
    optimized_shard_writer_abort(w, "test: append failed");
    return s;
  }
  uint64_t written = 0;
  s = optimized_shard_writer_close(w, &written, shards);
  return s == OPTIMIZED_STATUS_OK && written != n ? OPTIMIZED_STATUS_INTERNAL : s;
}

/* Checks one CPU batch (records hold their values) and counts each record's index in seen[]. */
static int check_batch_records(const optimized_batch* b, const void* host_data, int* seen, uint64_t num_records) {
  int ok = b->bytes == (uint64_t)b->records * REC_INTS * sizeof(int32_t);
  for (int64_t r = 0; r < b->records && ok; ++r) {
    const uint64_t idx = b->indices[r];
    int32_t want[REC_INTS];
    if (idx >= num_records) return 0;
    record_values(idx, want);
    ok = memcmp((const char*)host_data + (size_t)r * sizeof want, want, sizeof want) == 0;
    seen[idx]++;
  }
  return ok;
}

/* Reads the rest of the current epoch: every batch's data checked, indices counted in seen[];
 * *batches gets the count; order[] (may be NULL) the indices in order. 0 on any failure. */
static int read_epoch(optimized_loader* l, int* seen, uint64_t* batches, uint64_t* order, char* detail, size_t size) {
  optimized_batch b;
  uint64_t n = 0, k = 0;
  for (;;) {
    const optimized_status s = optimized_loader_next(l, NULL, &b);
    if (s != OPTIMIZED_STATUS_OK) {
      snprintf(detail, size, "next: %s: %s", optimized_status_string(s), optimized_last_error());
      return 0;
    }
    if (b.end_of_epoch) break;
    if (b.device_type != OPTIMIZED_DEVICE_CPU || b.data == NULL || b.ready_event != NULL) {
      snprintf(detail, size, "a CPU batch with device %d, data %p, event %p", (int)b.device_type, b.data, b.ready_event);
      return 0;
    }
    if (!check_batch_records(&b, b.data, seen, N_RECORDS)) {
      snprintf(detail, size, "batch %llu: a record does not hold its values", (unsigned long long)n);
      return 0;
    }
    if (order)
      for (int64_t r = 0; r < b.records; ++r) order[k++] = b.indices[r];
    ++n;
  }
  *batches = n;
  return 1;
}

static int all_once(const int* seen, int n) {
  for (int i = 0; i < n; ++i)
    if (seen[i] != 1) return 0;
  return 1;
}

static void loader_reads(const char* ds) {
  const optimized_status I = OPTIMIZED_STATUS_INVALID_ARGUMENT;
  char detail[600];
  optimized_loader_options o;
  check(optimized_loader_options_default(&o) == OPTIMIZED_STATUS_OK && o.batch_size == 1 && o.world_size == 1 &&
            o.prefetch >= 1 && o.verify == 1 && o.device_type == OPTIMIZED_DEVICE_CPU && o.variant == NULL,
        "loader options: the C++ defaults", optimized_last_error());
  o.batch_size = 4, o.shuffle = 1, o.seed = 11, o.threads = 2, o.prefetch = 2;
  optimized_loader* l = NULL;
  optimized_status s = optimized_loader_create(&l, ds, &o);
  check(s == OPTIMIZED_STATUS_OK && l != NULL, "loader: create (batch 4, shuffled)", optimized_last_error());
  if (s != OPTIMIZED_STATUS_OK) return;

  optimized_loader_info info;
  s = optimized_loader_get_info(l, &info);
  snprintf(detail, sizeof detail, "status %s, records %llu, bytes %llu, shards %llu, dtype %s, rank %d, batches %llu, io %s",
           optimized_status_string(s), (unsigned long long)info.num_records, (unsigned long long)info.record_bytes,
           (unsigned long long)info.num_shards, s == OPTIMIZED_STATUS_OK ? info.dtype : "?", (int)info.record_rank,
           (unsigned long long)info.batches_per_epoch, s == OPTIMIZED_STATUS_OK ? info.io_backend : "?");
  check(s == OPTIMIZED_STATUS_OK && info.num_records == N_RECORDS && info.record_bytes == REC_INTS * 4 &&
            info.num_shards == (N_RECORDS + PER_SHARD - 1) / PER_SHARD && strcmp(info.dtype, "int32") == 0 &&
            info.record_rank == 1 && info.record_shape[0] == REC_INTS && info.batches_per_epoch == 13 &&
            info.records_per_epoch == N_RECORDS && info.io_backend[0] != '\0' && info.fingerprint != 0,
        "loader: info", detail);

  /* Epochs 0 and 1: every record exactly once, in different shuffled orders. */
  int seen[N_RECORDS];
  uint64_t order0[N_RECORDS], order1[N_RECORDS], batches = 0, epoch = 99, batch = 99;
  memset(seen, 0, sizeof seen);
  int ok = read_epoch(l, seen, &batches, order0, detail, sizeof detail);
  check(ok && batches == 13 && all_once(seen, N_RECORDS), "loader: epoch 0 reads every record exactly once", detail);
  check(optimized_loader_position(l, &epoch, &batch) == OPTIMIZED_STATUS_OK && epoch == 1 && batch == 0,
        "loader: after the end of epoch 0 the position is (1, 0)", optimized_last_error());
  memset(seen, 0, sizeof seen);
  ok = read_epoch(l, seen, &batches, order1, detail, sizeof detail);
  check(ok && batches == 13 && all_once(seen, N_RECORDS) && memcmp(order0, order1, sizeof order0) != 0,
        "loader: epoch 1 reads every record exactly once, in another order", detail);

  /* Resume: 5 batches into epoch 2, save the position, read the rest; a new loader started there and
   * a seek of this one read the same batches. */
  optimized_batch b;
  for (int k = 0; k < 5; ++k) optimized_loader_next(l, NULL, &b);
  check(b.epoch == 2 && b.batch == 4 && b.records == 4, "loader: a batch carries its position", NULL);
  check(optimized_loader_position(l, &epoch, &batch) == OPTIMIZED_STATUS_OK && epoch == 2 && batch == 5,
        "loader: position after 5 batches of epoch 2", optimized_last_error());
  uint64_t rest[N_RECORDS], resumed[N_RECORDS], sought[N_RECORDS], n_rest = 0, n_resumed = 0, n_sought = 0;
  memset(seen, 0, sizeof seen);
  ok = read_epoch(l, seen, &n_rest, rest, detail, sizeof detail);
  check(ok && n_rest == 8, "loader: the rest of epoch 2", detail);

  optimized_loader_options r = o;
  r.start_epoch = epoch, r.start_batch = batch;
  optimized_loader* l2 = NULL;
  s = optimized_loader_create(&l2, ds, &r);
  memset(seen, 0, sizeof seen);
  ok = s == OPTIMIZED_STATUS_OK && read_epoch(l2, seen, &n_resumed, resumed, detail, sizeof detail);
  check(ok && n_resumed == n_rest && memcmp(rest, resumed, (size_t)(N_RECORDS - 20) * sizeof(uint64_t)) == 0,
        "loader: a loader created at the saved position reads the same batches", s ? optimized_last_error() : detail);
  optimized_loader_destroy(l2);

  check(optimized_loader_seek(l, epoch, batch) == OPTIMIZED_STATUS_OK, "loader: seek", optimized_last_error());
  memset(seen, 0, sizeof seen);
  ok = read_epoch(l, seen, &n_sought, sought, detail, sizeof detail);
  check(ok && n_sought == n_rest && memcmp(rest, sought, (size_t)(N_RECORDS - 20) * sizeof(uint64_t)) == 0,
        "loader: seek to the saved position reads the same batches", detail);

  optimized_loader_stats st;
  check(optimized_loader_get_stats(l, &st) == OPTIMIZED_STATUS_OK && st.batches == 13 + 13 + 5 + 8 + 8 &&
            st.record_bytes > 0 && st.read_bytes >= st.record_bytes,
        "loader: stats count the batches handed out", optimized_last_error());

  expect_error("loader: seek past the epoch", optimized_loader_seek(l, 0, 999), I, "position: batch 999 is past");
  check(optimized_loader_stop(l) == OPTIMIZED_STATUS_OK, "loader: stop", optimized_last_error());
  expect_error("loader: next after stop", optimized_loader_next(l, NULL, &b), I, "stopped");
  check(b.data == NULL && b.records == 0 && b.end_of_epoch == 0, "loader: a failed next clears the batch", NULL);
  optimized_loader_destroy(l);
  optimized_loader_destroy(NULL);

  /* Two ranks: together every record once; drop_last: full batches only, as many on each rank. */
  for (int drop = 0; drop < 2; ++drop) {
    memset(seen, 0, sizeof seen);
    uint64_t nb[2] = {0, 0};
    int all_full = 1;
    ok = 1;
    for (int rank = 0; rank < 2 && ok; ++rank) {
      optimized_loader_options rk = o;
      rk.world_size = 2, rk.rank = rank, rk.drop_last = drop, rk.seed = 3;
      optimized_loader* lr = NULL;
      ok = optimized_loader_create(&lr, ds, &rk) == OPTIMIZED_STATUS_OK;
      for (;;) {
        if (!ok || optimized_loader_next(lr, NULL, &b) != OPTIMIZED_STATUS_OK) {
          ok = 0;
          break;
        }
        if (b.end_of_epoch) break;
        ok = check_batch_records(&b, b.data, seen, N_RECORDS);
        all_full &= b.records == 4;
        ++nb[rank];
      }
      optimized_loader_destroy(lr);
    }
    int twice = 0, total = 0;
    for (int i = 0; i < N_RECORDS; ++i) twice |= seen[i] > 1, total += seen[i];
    snprintf(detail, sizeof detail, "batches %llu + %llu, records %d, %s", (unsigned long long)nb[0],
             (unsigned long long)nb[1], total, optimized_last_error());
    if (!drop)
      check(ok && all_once(seen, N_RECORDS), "loader: two ranks together read every record exactly once", detail);
    else
      check(ok && !twice && all_full && nb[0] == 6 && nb[1] == 6 && total == 48,
            "loader: drop_last gives each rank 6 full batches", detail);
  }

  /* Each reading path: the synchronous rung with pread, mmap, the page cache; a limit of one epoch. */
  const char* const variants[] = {"synchronous", "pipelined", "pipelined"};
  const char* const ios[] = {"pread", "mmap", "auto"};
  const char* const directs[] = {"auto", "auto", "off"};
  for (int k = 0; k < 3; ++k) {
    optimized_loader_options io = o;
    io.variant = variants[k], io.io = ios[k], io.direct_io = directs[k], io.epochs = 1, io.batch_size = 9;
    optimized_loader* li = NULL;
    char what[160];
    snprintf(what, sizeof what, "loader: %s, io %s, direct_io %s: one epoch, every record once, then the end", variants[k],
             ios[k], directs[k]);
    memset(seen, 0, sizeof seen);
    s = optimized_loader_create(&li, ds, &io);
    ok = s == OPTIMIZED_STATUS_OK && read_epoch(li, seen, &batches, NULL, detail, sizeof detail);
    if (s != OPTIMIZED_STATUS_OK) snprintf(detail, sizeof detail, "create: %s", optimized_last_error());
    /* epochs = 1: after the last epoch every call says end_of_epoch */
    int ended = ok && optimized_loader_next(li, NULL, &b) == OPTIMIZED_STATUS_OK && b.end_of_epoch &&
                optimized_loader_next(li, NULL, &b) == OPTIMIZED_STATUS_OK && b.end_of_epoch;
    check(ok && ended && batches == 6 && all_once(seen, N_RECORDS), what, detail);
    optimized_loader_destroy(li);
  }

  /* The handle's arguments. */
  optimized_loader* none = (optimized_loader*)&o; /* must be overwritten with NULL on failure */
  optimized_loader_options bad = o;
  bad.batch_size = 0;
  expect_error("loader: batch_size 0", optimized_loader_create(&none, ds, &bad), I, "batch_size: expected >= 1");
  check(none == NULL, "loader: a failed create sets *loader to NULL", NULL);
  bad = o, bad.device_type = 5;
  expect_error("loader: bad device type", optimized_loader_create(&none, ds, &bad), I, "device: expected device_type");
  bad = o, bad.io = "floppy";
  expect_error("loader: bad io engine", optimized_loader_create(&none, ds, &bad), I, "io: expected");
  bad = o, bad.variant = "fast";
  expect_error("loader: bad variant", optimized_loader_create(&none, ds, &bad), I, "variant: expected");
  bad = o, bad.direct_io = "maybe";
  expect_error("loader: bad direct_io", optimized_loader_create(&none, ds, &bad), I, "direct_io");
  bad = o, bad.shuffle = 2;
  expect_error("loader: shuffle not 0 or 1", optimized_loader_create(&none, ds, &bad), I, "shuffle: expected 0 or 1");
  bad = o, bad.world_size = 2, bad.rank = 2;
  expect_error("loader: rank out of range", optimized_loader_create(&none, ds, &bad), I, "rank: expected in [0, 2)");
  bad = o, bad.start_batch = 14;
  expect_error("loader: start past the epoch", optimized_loader_create(&none, ds, &bad), I, "start: batch 14");
  expect_error("loader: NULL dir", optimized_loader_create(&none, NULL, &o), I, "dir:");
  expect_error("loader: NULL handle pointer", optimized_loader_create(NULL, ds, &o), I, "loader:");
  expect_error("loader: next on NULL", optimized_loader_next(NULL, NULL, &b), I, "loader: expected a handle");
  expect_error("loader: position on NULL", optimized_loader_position(NULL, &epoch, &batch), I, "loader:");
  expect_error("loader: info on NULL", optimized_loader_get_info(NULL, &info), I, "loader:");
  expect_error("loader: options default NULL", optimized_loader_options_default(NULL), I, "options:");
  if (optimized_cuda_device_count() == 0) {
    bad = o, bad.device_type = OPTIMIZED_DEVICE_CUDA;
    s = optimized_loader_create(&none, ds, &bad);
    check(s != OPTIMIZED_STATUS_OK && strstr(optimized_last_error(), "device:") != NULL,
          "loader: a CUDA loader without a usable device names device", optimized_last_error());
  }
  /* NULL options: the defaults (batch 1) */
  s = optimized_loader_create(&l, ds, NULL);
  check(s == OPTIMIZED_STATUS_OK && optimized_loader_get_info(l, &info) == OPTIMIZED_STATUS_OK &&
            info.batches_per_epoch == N_RECORDS,
        "loader: NULL options are the defaults", optimized_last_error());
  if (s == OPTIMIZED_STATUS_OK) {
    expect_error("loader: next with a NULL batch", optimized_loader_next(l, NULL, NULL), I, "batch:");
    optimized_loader_destroy(l); /* with batches read ahead, none handed out */
  }
}

static void loader_tests(void) {
  const optimized_status I = OPTIMIZED_STATUS_INVALID_ARGUMENT;
  const char* base = getenv("TMPDIR");
  snprintf(g_tmp, sizeof g_tmp, "%s/optimized_c_api_XXXXXX", base && base[0] ? base : "/tmp");
  if (!mkdtemp(g_tmp)) {
    check(0, "loader: a temporary directory", g_tmp);
    return;
  }
  char ds[300], other[300], file[400];
  path_in_tmp(ds, sizeof ds, "ds");
  uint64_t shards = 0;
  optimized_status s = write_dataset(ds, N_RECORDS, PER_SHARD, &shards);
  check(s == OPTIMIZED_STATUS_OK && shards == (N_RECORDS + PER_SHARD - 1) / PER_SHARD,
        "shard writer: 50 records in 8 shards", optimized_last_error());
  check(optimized_dataset_verify(ds) == OPTIMIZED_STATUS_OK, "dataset verify: the written dataset", optimized_last_error());

  /* Writer arguments and states. */
  optimized_shard_writer* w = (optimized_shard_writer*)&shards;
  const int64_t shape[1] = {REC_INTS}, neg[1] = {-2};
  path_in_tmp(other, sizeof other, "other");
  expect_error("shard writer: unknown dtype", optimized_shard_writer_create(&w, other, "float128", 1, shape, 4, 0), I,
               "dtype: expected one of");
  check(w == NULL, "shard writer: a failed create sets *writer to NULL", NULL);
  expect_error("shard writer: records_per_shard 0", optimized_shard_writer_create(&w, other, "int32", 1, shape, 0, 0), I,
               "records_per_shard: expected >= 1");
  expect_error("shard writer: record_rank 9", optimized_shard_writer_create(&w, other, "int32", 9, shape, 4, 0), I,
               "record_rank: expected 0..8");
  expect_error("shard writer: NULL record_shape", optimized_shard_writer_create(&w, other, "int32", 1, NULL, 4, 0), I,
               "record_shape:");
  expect_error("shard writer: negative size", optimized_shard_writer_create(&w, other, "int32", 1, neg, 4, 0), I,
               "record_shape");
  expect_error("shard writer: NULL dir", optimized_shard_writer_create(&w, NULL, "int32", 1, shape, 4, 0), I, "dir:");
  expect_error("shard writer: NULL dtype", optimized_shard_writer_create(&w, other, NULL, 1, shape, 4, 0), I, "dtype:");
  expect_error("shard writer: NULL handle pointer", optimized_shard_writer_create(NULL, other, "int32", 1, shape, 4, 0), I,
               "writer:");
  expect_error("shard writer: a directory with a dataset, without overwrite",
               optimized_shard_writer_create(&w, ds, "int32", 1, shape, 4, 0), I, "already holds");
  expect_error("shard writer: append on NULL", optimized_shard_writer_append(NULL, shape, 1), I, "writer:");
  expect_error("shard writer: close NULL", optimized_shard_writer_close(NULL, NULL, NULL), I, "writer:");

  /* An aborted dataset is refused, saying so. */
  s = optimized_shard_writer_create(&w, other, "int32", 1, shape, 4, 0);
  int32_t recs[5 * REC_INTS];
  for (int i = 0; i < 5; ++i) record_values((uint64_t)i, recs + i * REC_INTS);
  uint64_t rb = 0, written = 0;
  check(s == OPTIMIZED_STATUS_OK && optimized_shard_writer_append(w, recs, 5) == OPTIMIZED_STATUS_OK &&
            optimized_shard_writer_info(w, &rb, &written) == OPTIMIZED_STATUS_OK && rb == 12 && written == 5,
        "shard writer: info", optimized_last_error());
  expect_error("shard writer: append NULL records", optimized_shard_writer_append(w, NULL, 3), I,
               "records: expected 3 records");
  check(optimized_shard_writer_append(w, NULL, 0) == OPTIMIZED_STATUS_OK, "shard writer: appending 0 records", NULL);
  check(optimized_shard_writer_abort(w, "the C test aborts") == OPTIMIZED_STATUS_OK, "shard writer: abort",
        optimized_last_error());
  optimized_loader* l = (optimized_loader*)&shards;
  expect_error("loader: an aborted dataset", optimized_loader_create(&l, other, NULL), I,
               "aborted after 5 records: the C test aborts");
  check(l == NULL, "loader: a failed create sets *loader to NULL", NULL);

  /* overwrite = 1 replaces it; 0 records is a valid (empty) dataset. */
  uint64_t nrec = 9, nsh = 0;
  s = optimized_shard_writer_create(&w, other, "float32", 0, NULL, 4, 1);
  check(s == OPTIMIZED_STATUS_OK && optimized_shard_writer_close(w, &nrec, &nsh) == OPTIMIZED_STATUS_OK && nrec == 0 &&
            nsh == 1,
        "shard writer: overwrite, scalar records, none written", optimized_last_error());

  /* A missing directory. */
  path_in_tmp(other, sizeof other, "no_such_dataset");
  s = optimized_loader_create(&l, other, NULL);
  check(s != OPTIMIZED_STATUS_OK && strstr(optimized_last_error(), "no_such_dataset") &&
            strstr(optimized_last_error(), "does not exist"),
        "loader: a missing directory is named", optimized_last_error());

  /* A truncated shard: refused at create, naming the file; verify says the same. */
  path_in_tmp(other, sizeof other, "truncated");
  s = write_dataset(other, 10, 4, &shards);
  snprintf(file, sizeof file, "%s/shard-00001.osh", other);
  struct stat st;
  const int cut = s == OPTIMIZED_STATUS_OK && stat(file, &st) == 0 && truncate(file, st.st_size - 100) == 0;
  check(cut, "loader: truncate a shard of a second dataset", optimized_last_error());
  s = optimized_loader_create(&l, other, NULL);
  check(s != OPTIMIZED_STATUS_OK && strstr(optimized_last_error(), "shard-00001.osh") != NULL,
        "loader: a truncated shard is named", optimized_last_error());
  s = optimized_dataset_verify(other);
  check(s != OPTIMIZED_STATUS_OK && strstr(optimized_last_error(), "shard-00001.osh") != NULL,
        "dataset verify: a truncated shard is named", optimized_last_error());
  expect_error("dataset verify: NULL dir", optimized_dataset_verify(NULL), I, "dir:");

  /* A corrupt record: opening succeeds (headers are fine), reading it fails naming the file. */
  path_in_tmp(other, sizeof other, "corrupt");
  s = write_dataset(other, 10, 4, &shards);
  snprintf(file, sizeof file, "%s/shard-00000.osh", other);
  int fd = open(file, O_WRONLY);
  const unsigned char junk = 0xA5;
  const int flipped = s == OPTIMIZED_STATUS_OK && fd >= 0 && pwrite(fd, &junk, 1, 4096 + 2 * 12 + 1) == 1;
  if (fd >= 0) close(fd);
  optimized_loader_options o;
  optimized_loader_options_default(&o);
  o.batch_size = 10, o.direct_io = "off";
  s = flipped ? optimized_loader_create(&l, other, &o) : OPTIMIZED_STATUS_INTERNAL;
  check(s == OPTIMIZED_STATUS_OK, "loader: a dataset with a corrupt record opens", optimized_last_error());
  if (s == OPTIMIZED_STATUS_OK) {
    optimized_batch b;
    s = optimized_loader_next(l, NULL, &b);
    check(s != OPTIMIZED_STATUS_OK && strstr(optimized_last_error(), "shard-00000.osh") != NULL,
          "loader: a corrupt record fails next, naming the file", optimized_last_error());
    optimized_loader_destroy(l);
  }

  loader_reads(ds);

#ifdef OPTIMIZED_TEST_CUDA
  if (optimized_cuda_device_count() > 0) {
    optimized_loader_options_default(&o);
    o.batch_size = 8, o.shuffle = 1, o.device_type = OPTIMIZED_DEVICE_CUDA, o.device_index = 0;
    cudaStream_t stream = NULL;
    cudaStreamCreate(&stream);
    int seen[N_RECORDS];
    memset(seen, 0, sizeof seen);
    s = optimized_loader_create(&l, ds, &o);
    int ok = s == OPTIMIZED_STATUS_OK, batches = 0;
    char detail[400] = "";
    if (!ok) snprintf(detail, sizeof detail, "create: %s", optimized_last_error());
    int32_t host[8 * REC_INTS];
    while (ok) {
      optimized_batch b;
      if (optimized_loader_next(l, stream, &b) != OPTIMIZED_STATUS_OK) {
        snprintf(detail, sizeof detail, "next: %s", optimized_last_error());
        ok = 0;
        break;
      }
      if (b.end_of_epoch) break;
      ok = b.device_type == OPTIMIZED_DEVICE_CUDA && b.ready_event != NULL && b.records <= 8 &&
           cudaMemcpyAsync(host, b.data, b.bytes, cudaMemcpyDeviceToHost, stream) == cudaSuccess &&
           cudaStreamSynchronize(stream) == cudaSuccess && check_batch_records(&b, host, seen, N_RECORDS);
      ++batches;
    }
    check(ok && batches == 7 && all_once(seen, N_RECORDS), "loader cuda: an epoch into device memory, every record once",
          detail);
    optimized_loader_destroy(l);
    cudaStreamDestroy(stream);
  } else {
    printf("skip  loader CUDA cases: no CUDA device\n");
  }
#endif

  remove_tree(g_tmp, 0);
}

/* ---- attention ------------------------------------------------------------------------------ */
/* Forward and backward on the CPU variant (fixed length with GQA, causal bottom-right, a scale, ALiBi;
 * varlen with an empty sequence) against a double-precision reference written out here, outputs
 * poisoned first; then the refusals, each naming its argument. */

/* One (sequence, query head): queries q[i * rs] (len_q rows), keys / values k[j * rs], v[j * rs]
 * (len_k rows), D columns; causal aligned bottom-right; slope: ALiBi (0: off). Writes out and lse,
 * and accumulates dq, dk, dv (double buffers laid out as q, k, v) from dout. */
static void attention_reference(const float* q, const float* k, const float* v, const float* dout, int64_t rs,
                                int64_t len_q, int64_t len_k, int64_t d, double scale, int causal, double slope,
                                double* out, double* lse, int64_t lse_stride, double* dq, double* dk, double* dv) {
  double p[16];
  const int64_t offset = len_k - len_q;
  for (int64_t i = 0; i < len_q; ++i) {
    double m = -INFINITY, sum = 0;
    for (int64_t j = 0; j < len_k; ++j) {
      double s = 0;
      for (int64_t c = 0; c < d; ++c) s += (double)q[i * rs + c] * (double)k[j * rs + c];
      s = s * scale - slope * fabs((double)(i + offset - j));
      p[j] = causal && j > i + offset ? -INFINITY : s;
      if (p[j] > m) m = p[j];
    }
    for (int64_t j = 0; j < len_k; ++j) sum += p[j] == -INFINITY ? 0 : exp(p[j] - m);
    const double l = sum > 0 ? m + log(sum) : -INFINITY;
    lse[i * lse_stride] = l;
    double delta = 0;
    for (int64_t j = 0; j < len_k; ++j) p[j] = sum > 0 && p[j] != -INFINITY ? exp(p[j] - l) : 0;
    for (int64_t c = 0; c < d; ++c) {
      double o = 0;
      for (int64_t j = 0; j < len_k; ++j) o += p[j] * (double)v[j * rs + c];
      out[i * rs + c] = o;
      delta += o * (double)dout[i * rs + c];
    }
    for (int64_t j = 0; j < len_k; ++j) {
      double dp = 0;
      for (int64_t c = 0; c < d; ++c) {
        dp += (double)dout[i * rs + c] * (double)v[j * rs + c];
        dv[j * rs + c] += p[j] * (double)dout[i * rs + c];
      }
      const double ds = p[j] * (dp - delta) * scale;
      for (int64_t c = 0; c < d; ++c) {
        dq[i * rs + c] += ds * (double)k[j * rs + c];
        dk[j * rs + c] += ds * (double)q[i * rs + c];
      }
    }
  }
}

/* Worst |got - want| / (1 + |want|) over n elements; infinite when got is NaN (unwritten), 0 where
 * both are -inf. */
static double attention_worst(const float* got, const double* want, int64_t n) {
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (isinf(want[i]) && got[i] == (float)want[i]) continue;
    const double e = isnan(got[i]) ? INFINITY : fabs((double)got[i] - want[i]) / (1.0 + fabs(want[i]));
    if (e > worst) worst = e;
  }
  return worst;
}

static float* attention_random(int64_t n) { return (float*)random_buffer(OPTIMIZED_DTYPE_F32, n); }

static void attention_check_results(const char* what, const float* out, const float* lse, const float* dq,
                                    const float* dk, const float* dv, const double* r_out, const double* r_lse,
                                    const double* r_dq, const double* r_dk, const double* r_dv, int64_t nq,
                                    int64_t nk, int64_t nl) {
  char name[200], detail[200];
  const double tol = 2e-5;
  const double e[5] = {attention_worst(out, r_out, nq), attention_worst(lse, r_lse, nl), attention_worst(dq, r_dq, nq),
                       attention_worst(dk, r_dk, nk), attention_worst(dv, r_dv, nk)};
  snprintf(name, sizeof name, "%s: out, lse, dq, dk, dv match the float64 reference", what);
  snprintf(detail, sizeof detail, "worst relative errors %.3g %.3g %.3g %.3g %.3g (tolerance %.1g)", e[0], e[1], e[2],
           e[3], e[4], tol);
  check(e[0] <= tol && e[1] <= tol && e[2] <= tol && e[3] <= tol && e[4] <= tol, name, detail);
}

static void attention_tests(void) {
  const optimized_status I = OPTIMIZED_STATUS_INVALID_ARGUMENT;
  enum { B = 2, SQ = 3, SK = 5, HQ = 4, HKV = 2, D = 3 };
  const int64_t nq = B * SQ * HQ * D, nk = B * SK * HKV * D, nl = B * HQ * SQ;
  float *q = attention_random(nq), *k = attention_random(nk), *v = attention_random(nk), *dout = attention_random(nq);
  float *out = (float*)poisoned_buffer(OPTIMIZED_DTYPE_F32, nq), *lse = (float*)poisoned_buffer(OPTIMIZED_DTYPE_F32, nl);
  float *dq = (float*)poisoned_buffer(OPTIMIZED_DTYPE_F32, nq), *dk = (float*)poisoned_buffer(OPTIMIZED_DTYPE_F32, nk);
  float *dv = (float*)poisoned_buffer(OPTIMIZED_DTYPE_F32, nk);
  double *r_out = calloc(nq, sizeof(double)), *r_lse = calloc(nl, sizeof(double)), *r_dq = calloc(nq, sizeof(double));
  double *r_dk = calloc(nk, sizeof(double)), *r_dv = calloc(nk, sizeof(double));
  float slopes[HQ] = {0.25f, 0.5f, 0.125f, 1.0f};
  const int64_t s_q[4] = {B, SQ, HQ, D}, s_k[4] = {B, SK, HKV, D}, s_l[3] = {B, HQ, SQ}, s_a[1] = {HQ};
  optimized_tensor tq, tk, tv, tdo, to, tl, tdq, tdk, tdv, ta;
  optimized_tensor_contiguous(&tq, q, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 4, s_q);
  optimized_tensor_contiguous(&tk, k, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 4, s_k);
  optimized_tensor_contiguous(&tv, v, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 4, s_k);
  optimized_tensor_contiguous(&tdo, dout, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 4, s_q);
  optimized_tensor_contiguous(&to, out, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 4, s_q);
  optimized_tensor_contiguous(&tl, lse, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 3, s_l);
  optimized_tensor_contiguous(&tdq, dq, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 4, s_q);
  optimized_tensor_contiguous(&tdk, dk, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 4, s_k);
  optimized_tensor_contiguous(&tdv, dv, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 4, s_k);
  optimized_tensor_contiguous(&ta, slopes, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 1, s_a);

  optimized_attention_options o;
  check(optimized_attention_options_default(&o) == OPTIMIZED_STATUS_OK && isnan(o.softmax_scale) && o.causal == 0 &&
            o.top_left == 0 && o.window_left == -1 && o.window_right == -1 && o.softcap == 0 && !o.alibi_slopes &&
            !o.mask && o.deterministic == 0 && o.skip_cu_seqlens_check == 0,
        "attention: options_default", optimized_last_error());

  /* Fixed length, two option sets: the defaults (options NULL) and causal + scale + ALiBi. */
  for (int set = 0; set < 2; ++set) {
    const int causal = set == 1;
    const double scale = set == 1 ? 0.7 : 1.0 / sqrt((double)D);
    if (set == 1) {
      o.causal = 1;
      o.softmax_scale = scale;
      o.alibi_slopes = &ta;
    }
    memset(r_dk, 0, nk * sizeof(double));
    memset(r_dv, 0, nk * sizeof(double));
    {
      /* rows of q / out / dq are HQ * D apart and rows of k / v HKV * D apart: copy each head to a packed
       * (rows, D) scratch, run the reference there and scatter back. */
      float sq_[SQ * D], sk_[SK * D], sv_[SK * D], sdo_[SQ * D];
      double so_[SQ * D], sdq_[SQ * D], sdk_[SK * D], sdv_[SK * D];
      for (int b = 0; b < B; ++b)
        for (int h = 0; h < HQ; ++h) {
          const int g = h / (HQ / HKV);
          for (int i = 0; i < SQ; ++i)
            for (int c = 0; c < D; ++c) {
              sq_[i * D + c] = q[(((int64_t)b * SQ + i) * HQ + h) * D + c];
              sdo_[i * D + c] = dout[(((int64_t)b * SQ + i) * HQ + h) * D + c];
            }
          for (int j = 0; j < SK; ++j)
            for (int c = 0; c < D; ++c) {
              sk_[j * D + c] = k[(((int64_t)b * SK + j) * HKV + g) * D + c];
              sv_[j * D + c] = v[(((int64_t)b * SK + j) * HKV + g) * D + c];
            }
          memset(sdq_, 0, sizeof sdq_);
          memset(sdk_, 0, sizeof sdk_);
          memset(sdv_, 0, sizeof sdv_);
          attention_reference(sq_, sk_, sv_, sdo_, D, SQ, SK, D, scale, causal, set == 1 ? slopes[h] : 0, so_,
                              r_lse + ((int64_t)b * HQ + h) * SQ, 1, sdq_, sdk_, sdv_);
          for (int i = 0; i < SQ; ++i)
            for (int c = 0; c < D; ++c) {
              r_out[(((int64_t)b * SQ + i) * HQ + h) * D + c] = so_[i * D + c];
              r_dq[(((int64_t)b * SQ + i) * HQ + h) * D + c] = sdq_[i * D + c];
            }
          for (int j = 0; j < SK; ++j)
            for (int c = 0; c < D; ++c) {
              r_dk[(((int64_t)b * SK + j) * HKV + g) * D + c] += sdk_[j * D + c];
              r_dv[(((int64_t)b * SK + j) * HKV + g) * D + c] += sdv_[j * D + c];
            }
        }
    }
    const char* variant = set == 0 ? "cpu" : "auto";
    const optimized_attention_options* opts = set == 0 ? NULL : &o;
    const optimized_status sf = optimized_attention_forward(&tq, &tk, &tv, &to, &tl, opts, variant, NULL);
    check(sf == OPTIMIZED_STATUS_OK, set == 0 ? "attention: forward (defaults)" : "attention: forward (causal, ALiBi)",
          optimized_last_error());
    const optimized_status sb =
        optimized_attention_backward(&tdo, &tq, &tk, &tv, &to, &tl, &tdq, &tdk, &tdv, opts, variant, NULL);
    check(sb == OPTIMIZED_STATUS_OK, set == 0 ? "attention: backward (defaults)" : "attention: backward (causal, ALiBi)",
          optimized_last_error());
    attention_check_results(set == 0 ? "attention defaults" : "attention causal + scale + ALiBi, GQA 2", out, lse, dq,
                            dk, dv, r_out, r_lse, r_dq, r_dk, r_dv, nq, nk, nl);
    memset(out, 0xFF, nq * sizeof(float));
    memset(lse, 0xFF, nl * sizeof(float));
    memset(dq, 0xFF, nq * sizeof(float));
    memset(dk, 0xFF, nk * sizeof(float));
    memset(dv, 0xFF, nk * sizeof(float));
  }
  /* lse may be absent in a forward */
  check(optimized_attention_forward(&tq, &tk, &tv, &to, NULL, NULL, "cpu", NULL) == OPTIMIZED_STATUS_OK &&
            !isnan(out[0]) && isnan(lse[0]),
        "attention: forward without lse", optimized_last_error());

  /* Varlen: the same buffers read as packed sequences, q lengths {2, 0, 4}, k lengths {3, 4, 3}, H_q 4,
   * H_kv 2: q (6, 4, 3), k, v (10, 2, 3). Reference per sequence, as above. */
  {
    int32_t cu_q[4] = {0, 2, 2, 6}, cu_k[4] = {0, 3, 7, 10};
    const int64_t s_vq[3] = {6, HQ, D}, s_vk[3] = {10, HKV, D}, s_vl[2] = {HQ, 6}, s_cu[1] = {4};
    optimized_tensor vq, vk, vv, vdo, vo, vl, vdq, vdk, vdv, tcq, tck;
    optimized_tensor_contiguous(&vq, q, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 3, s_vq);
    optimized_tensor_contiguous(&vk, k, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 3, s_vk);
    optimized_tensor_contiguous(&vv, v, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 3, s_vk);
    optimized_tensor_contiguous(&vdo, dout, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 3, s_vq);
    optimized_tensor_contiguous(&vo, out, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 3, s_vq);
    optimized_tensor_contiguous(&vl, lse, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 2, s_vl);
    optimized_tensor_contiguous(&vdq, dq, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 3, s_vq);
    optimized_tensor_contiguous(&vdk, dk, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 3, s_vk);
    optimized_tensor_contiguous(&vdv, dv, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 3, s_vk);
    optimized_tensor_contiguous(&tcq, cu_q, OPTIMIZED_DTYPE_I32, OPTIMIZED_DEVICE_CPU, 0, 1, s_cu);
    optimized_tensor_contiguous(&tck, cu_k, OPTIMIZED_DTYPE_I32, OPTIMIZED_DEVICE_CPU, 0, 1, s_cu);
    optimized_attention_options vo_opts;
    optimized_attention_options_default(&vo_opts);
    vo_opts.causal = 1;
    memset(r_out, 0, nq * sizeof(double));
    memset(r_dq, 0, nq * sizeof(double));
    memset(r_dk, 0, nk * sizeof(double));
    memset(r_dv, 0, nk * sizeof(double));
    const double scale = 1.0 / sqrt((double)D);
    float sq_[8 * D], sk_[8 * D], sv_[8 * D], sdo_[8 * D];
    double so_[8 * D], sl_[8], sdq_[8 * D], sdk_[8 * D], sdv_[8 * D];
    for (int b = 0; b < 3; ++b)
      for (int h = 0; h < HQ; ++h) {
        const int g = h / (HQ / HKV), lq = cu_q[b + 1] - cu_q[b], lk = cu_k[b + 1] - cu_k[b];
        for (int i = 0; i < lq; ++i)
          for (int c = 0; c < D; ++c) {
            sq_[i * D + c] = q[((int64_t)(cu_q[b] + i) * HQ + h) * D + c];
            sdo_[i * D + c] = dout[((int64_t)(cu_q[b] + i) * HQ + h) * D + c];
          }
        for (int j = 0; j < lk; ++j)
          for (int c = 0; c < D; ++c) {
            sk_[j * D + c] = k[((int64_t)(cu_k[b] + j) * HKV + g) * D + c];
            sv_[j * D + c] = v[((int64_t)(cu_k[b] + j) * HKV + g) * D + c];
          }
        memset(sdq_, 0, sizeof sdq_);
        memset(sdk_, 0, sizeof sdk_);
        memset(sdv_, 0, sizeof sdv_);
        attention_reference(sq_, sk_, sv_, sdo_, D, lq, lk, D, scale, 1, 0, so_, sl_, 1, sdq_, sdk_, sdv_);
        for (int i = 0; i < lq; ++i) {
          r_lse[(int64_t)h * 6 + cu_q[b] + i] = sl_[i];
          for (int c = 0; c < D; ++c) {
            r_out[((int64_t)(cu_q[b] + i) * HQ + h) * D + c] = so_[i * D + c];
            r_dq[((int64_t)(cu_q[b] + i) * HQ + h) * D + c] = sdq_[i * D + c];
          }
        }
        for (int j = 0; j < lk; ++j)
          for (int c = 0; c < D; ++c) {
            r_dk[((int64_t)(cu_k[b] + j) * HKV + g) * D + c] += sdk_[j * D + c];
            r_dv[((int64_t)(cu_k[b] + j) * HKV + g) * D + c] += sdv_[j * D + c];
          }
      }
    check(optimized_attention_varlen_forward(&vq, &vk, &vv, &tcq, &tck, 4, 4, &vo, &vl, &vo_opts, "cpu", NULL) ==
              OPTIMIZED_STATUS_OK,
          "attention varlen: forward", optimized_last_error());
    check(optimized_attention_varlen_backward(&vdo, &vq, &vk, &vv, &tcq, &tck, 4, 4, &vo, &vl, &vdq, &vdk, &vdv,
                                              &vo_opts, "cpu", NULL) == OPTIMIZED_STATUS_OK,
          "attention varlen: backward", optimized_last_error());
    attention_check_results("attention varlen causal (lengths 2, 0, 4), GQA 2", out, lse, dq, dk, dv, r_out, r_lse,
                            r_dq, r_dk, r_dv, 6 * HQ * D, 10 * HKV * D, HQ * 6);

    /* varlen refusals */
    cu_q[2] = 1; /* decreasing: 0, 2, 1, 6 */
    expect_error("attention varlen: cu_seqlens_q not monotone",
                 optimized_attention_varlen_forward(&vq, &vk, &vv, &tcq, &tck, 4, 4, &vo, &vl, NULL, "cpu", NULL), I,
                 "cu_seqlens_q");
    cu_q[2] = 2;
    tck.shape[0] = 3;
    expect_error("attention varlen: cu_seqlens_k of another length",
                 optimized_attention_varlen_forward(&vq, &vk, &vv, &tcq, &tck, 4, 4, &vo, &vl, NULL, "cpu", NULL), I,
                 "cu_seqlens_k: expected shape (4)");
    tck.shape[0] = 4;
    const int64_t s_m[4] = {1, 1, 1, 1};
    uint8_t one = 1;
    optimized_tensor tm;
    optimized_tensor_contiguous(&tm, &one, OPTIMIZED_DTYPE_BOOL, OPTIMIZED_DEVICE_CPU, 0, 4, s_m);
    vo_opts.mask = &tm;
    expect_error("attention varlen: a mask",
                 optimized_attention_varlen_forward(&vq, &vk, &vv, &tcq, &tck, 4, 4, &vo, &vl, &vo_opts, "cpu", NULL),
                 I, "mask: not supported by the varlen ops");
  }

  /* Fixed-length refusals, each naming its argument. */
  optimized_tensor bad = tk;
  bad.shape[2] = 3; /* H_kv 3 does not divide H_q 4 */
  expect_error("attention: heads that do not divide",
               optimized_attention_forward(&tq, &bad, &bad, &to, &tl, NULL, "cpu", NULL), I,
               "k: expected a number of heads that divides q's 4");
  bad = tk;
  bad.shape[3] = 2;
  expect_error("attention: head dims that differ", optimized_attention_forward(&tq, &bad, &bad, &to, &tl, NULL, "cpu", NULL),
               I, "k: expected head_dim 3");
  expect_error("attention: unknown variant", optimized_attention_forward(&tq, &tk, &tv, &to, &tl, NULL, "fastest", NULL),
               I, "variant: expected one of");
  expect_error("attention: a CUDA variant on CPU tensors",
               optimized_attention_forward(&tq, &tk, &tv, &to, &tl, NULL, "flash2", NULL), I,
               "variant: flash2 runs on CUDA");
  optimized_attention_options_default(&o);
  o.causal = 2;
  expect_error("attention: causal not 0 or 1", optimized_attention_forward(&tq, &tk, &tv, &to, &tl, &o, "cpu", NULL), I,
               "options.causal: expected 0 or 1; given 2");
  optimized_attention_options_default(&o);
  o.softcap = -1;
  expect_error("attention: a negative softcap", optimized_attention_forward(&tq, &tk, &tv, &to, &tl, &o, "cpu", NULL), I,
               "softcap: expected a finite value >= 0");
  expect_error("attention: backward without lse",
               optimized_attention_backward(&tdo, &tq, &tk, &tv, &to, NULL, &tdq, &tdk, &tdv, NULL, "cpu", NULL), I,
               "lse: expected a pointer to an optimized_tensor; given NULL");
  expect_error("attention: out overlapping q", optimized_attention_forward(&tq, &tk, &tv, &tq, &tl, NULL, "cpu", NULL), I,
               "out: expected an output that does not overlap");
  expect_error("attention: options_default to NULL", optimized_attention_options_default(NULL), I,
               "options: expected a pointer");

  /* The family's variant query and auto. */
  const char* resolved = NULL;
  check(optimized_attention_resolve_variant(OPTIMIZED_DTYPE_F32, 64, OPTIMIZED_DEVICE_CPU, 0, &resolved) ==
                OPTIMIZED_STATUS_OK &&
            resolved && strcmp(resolved, "cpu") == 0,
        "attention: auto resolves to cpu on the CPU", optimized_last_error());
  check(optimized_variant_check("attention", "cpu", OPTIMIZED_DTYPE_F64, OPTIMIZED_DEVICE_CPU) == OPTIMIZED_STATUS_OK &&
            optimized_variant_check("attention", "flash2", OPTIMIZED_DTYPE_BF16, OPTIMIZED_DEVICE_CUDA) ==
                OPTIMIZED_STATUS_OK &&
            optimized_variant_check("attention", "auto", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CUDA) == OPTIMIZED_STATUS_OK,
        "attention: variant check accepts", optimized_last_error());
  expect_error("attention check: flash2 on fp32",
               optimized_variant_check("attention", "flash2", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CUDA),
               OPTIMIZED_STATUS_UNSUPPORTED, "variant:");
  expect_error("attention check: cpu on CUDA",
               optimized_variant_check("attention", "cpu", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CUDA), I,
               "variant: cpu runs on the CPU");
  const char* const names[5] = {"cpu", "naive", "flash", "flash2", "hopper"};
  int listed = 1;
  for (int i = 0; i < 5; ++i) listed &= optimized_variant_name("attention", i) && strcmp(optimized_variant_name("attention", i), names[i]) == 0;
  check(listed && optimized_variant_name("attention", 5) == NULL, "attention: variants cpu, naive, flash, flash2, hopper", NULL);

  free(q), free(k), free(v), free(dout), free(out), free(lse), free(dq), free(dk), free(dv);
  free(r_out), free(r_lse), free(r_dq), free(r_dk), free(r_dv);
}

/* ---- main ------------------------------------------------------------------------------------ */

/* ---- KV cache ------------------------------------------------------------------------------- */

/* One sequence, page_size 2, three pages, the table [2, 0]: tokens 0, 1 in page 2, token 2 in page 0.
 * H_kv 1, H_q 2 (GQA), D 2, fp32. Append three tokens, then decode the last one against a hand-written
 * softmax; then the error codes. */
static void kv_cache_tests(void) {
  const optimized_status I = OPTIMIZED_STATUS_INVALID_ARGUMENT, U = OPTIMIZED_STATUS_UNSUPPORTED;
  enum { P = 3, PS = 2, HKV = 1, HQ = 2, D = 2, S = 3 };
  float kp[P * PS * HKV * D], vp[P * PS * HKV * D];
  for (int i = 0; i < P * PS * HKV * D; ++i) kp[i] = vp[i] = -99.0f; /* poisoned */
  const float k[S * HKV * D] = {0.5f, -1.0f, 0.25f, 0.75f, -0.5f, 1.0f};
  const float v[S * HKV * D] = {1.0f, 2.0f, -3.0f, 0.5f, 0.25f, -1.5f};
  int32_t table[2] = {2, 0}, positions[S] = {0, 1, 2}, seq_lens[1] = {S};
  const float q[HQ * D] = {1.0f, 0.5f, -0.75f, 2.0f};
  float out[HQ * D] = {-7, -7, -7, -7}, lse[HQ] = {-7, -7};
  const int64_t s_pages[4] = {P, PS, HKV, D}, s_kv[4] = {1, S, HKV, D}, s_table[2] = {1, 2}, s_pos[2] = {1, S},
                s_lens[1] = {1}, s_q[4] = {1, 1, HQ, D}, s_lse[3] = {1, HQ, 1};
  optimized_tensor tkp, tvp, tk, tv, tt, tpos, tlens, tq, to, tl;
  optimized_tensor_contiguous(&tkp, kp, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 4, s_pages);
  optimized_tensor_contiguous(&tvp, vp, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 4, s_pages);
  optimized_tensor_contiguous(&tk, (void*)k, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 4, s_kv);
  optimized_tensor_contiguous(&tv, (void*)v, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 4, s_kv);
  optimized_tensor_contiguous(&tt, table, OPTIMIZED_DTYPE_I32, OPTIMIZED_DEVICE_CPU, 0, 2, s_table);
  optimized_tensor_contiguous(&tpos, positions, OPTIMIZED_DTYPE_I32, OPTIMIZED_DEVICE_CPU, 0, 2, s_pos);
  optimized_tensor_contiguous(&tlens, seq_lens, OPTIMIZED_DTYPE_I32, OPTIMIZED_DEVICE_CPU, 0, 1, s_lens);
  optimized_tensor_contiguous(&tq, (void*)q, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 4, s_q);
  optimized_tensor_contiguous(&to, out, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 4, s_q);
  optimized_tensor_contiguous(&tl, lse, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 3, s_lse);
  const optimized_kv_cache cache = {&tkp, &tvp, NULL, NULL};

  optimized_kv_append_options ao;
  optimized_decode_options dopt;
  check(optimized_kv_append_options_default(&ao) == OPTIMIZED_STATUS_OK && ao.rope == OPTIMIZED_ROPE_NONE &&
            ao.rope_theta == 10000.0 && ao.rotary_dim == 0 && ao.validate == 1,
        "kv_cache: append options_default", optimized_last_error());
  check(optimized_decode_options_default(&dopt) == OPTIMIZED_STATUS_OK && isnan(dopt.softmax_scale) &&
            dopt.window_left == -1 && dopt.softcap == 0 && !dopt.alibi_slopes && dopt.validate == 1,
        "kv_cache: decode options_default", optimized_last_error());

  optimized_status st = optimized_kv_cache_append(&cache, &tk, &tv, &tt, &tpos, NULL, NULL, "cpu", NULL);
  check(st == OPTIMIZED_STATUS_OK, "kv_cache: append succeeds", optimized_last_error());
  /* token t -> page table[t / 2], slot t % 2 */
  int placed = 1;
  for (int t = 0; t < S; ++t)
    for (int d = 0; d < D; ++d) {
      const int at = (table[t / PS] * PS + t % PS) * D + d;
      placed &= kp[at] == k[t * D + d] && vp[at] == v[t * D + d];
    }
  placed &= kp[(0 * PS + 1) * D] == -99.0f && kp[(1 * PS + 0) * D] == -99.0f; /* untouched slots */
  check(placed, "kv_cache: append places each token in its page and slot", NULL);

  st = optimized_paged_attention_decode(&tq, &cache, &tt, &tlens, &to, &tl, NULL, "auto", NULL);
  check(st == OPTIMIZED_STATUS_OK, "kv_cache: decode succeeds", optimized_last_error());
  double worst = 0;
  for (int h = 0; h < HQ; ++h) {
    double s[S], m = -INFINITY, sum = 0, o[D] = {0, 0};
    for (int t = 0; t < S; ++t) {
      s[t] = (q[h * D] * (double)k[t * D] + q[h * D + 1] * (double)k[t * D + 1]) / sqrt((double)D);
      if (s[t] > m) m = s[t];
    }
    for (int t = 0; t < S; ++t) sum += exp(s[t] - m);
    for (int t = 0; t < S; ++t)
      for (int d = 0; d < D; ++d) o[d] += exp(s[t] - m) / sum * v[t * D + d];
    for (int d = 0; d < D; ++d) worst = fmax(worst, fabs(out[h * D + d] - o[d]));
    worst = fmax(worst, fabs(lse[h] - (m + log(sum))));
  }
  char detail[64];
  snprintf(detail, sizeof detail, "worst error %.3g", worst);
  check(worst < 1e-5, "kv_cache: decode = hand-written softmax (GQA, two pages)", detail);

  /* prefill with the same single query = decode's result, bit for bit (one rule, one cpu rung) */
  {
    float out_p[HQ * D] = {-7, -7, -7, -7}, lse_p[HQ] = {-7, -7}; /* poisoned */
    optimized_tensor top, tlp;
    optimized_tensor_contiguous(&top, out_p, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 4, s_q);
    optimized_tensor_contiguous(&tlp, lse_p, OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU, 0, 3, s_lse);
    st = optimized_paged_attention_prefill(&tq, &cache, &tt, &tlens, &top, &tlp, NULL, "cpu", NULL);
    int same = st == OPTIMIZED_STATUS_OK;
    for (int i = 0; same && i < HQ * D; ++i) same = out_p[i] == out[i];
    for (int i = 0; same && i < HQ; ++i) same = lse_p[i] == lse[i];
    check(same, "kv_cache: prefill of one query equals decode", optimized_last_error());
  }

  /* softcap through the options: still finite and different */
  dopt.softcap = 0.5;
  st = optimized_paged_attention_decode(&tq, &cache, &tt, &tlens, &to, NULL, &dopt, "cpu", NULL);
  check(st == OPTIMIZED_STATUS_OK && isfinite(out[0]), "kv_cache: decode with softcap, lse NULL", optimized_last_error());
  dopt.softcap = 0;

  /* error codes */
  table[1] = 3; /* == num_pages */
  expect_error("kv_cache: append, page index out of range",
               optimized_kv_cache_append(&cache, &tk, &tv, &tt, &tpos, NULL, &ao, "cpu", NULL), I, "page_table");
  expect_error("kv_cache: decode, page index out of range",
               optimized_paged_attention_decode(&tq, &cache, &tt, &tlens, &to, &tl, &dopt, "cpu", NULL), I,
               "page_table");
  table[1] = 0;
  seq_lens[0] = 5; /* two pages of 2 hold 4 tokens */
  expect_error("kv_cache: decode, seq_len beyond the pages",
               optimized_paged_attention_decode(&tq, &cache, &tt, &tlens, &to, &tl, NULL, "cpu", NULL), I, "seq_lens");
  seq_lens[0] = S;
  expect_error("kv_cache: NULL cache", optimized_kv_cache_append(NULL, &tk, &tv, &tt, &tpos, NULL, NULL, "cpu", NULL),
               I, "cache: expected a pointer");
  ao.rope = 7;
  expect_error("kv_cache: rope out of range",
               optimized_kv_cache_append(&cache, &tk, &tv, &tt, &tpos, NULL, &ao, "cpu", NULL), I, "options.rope");
  ao.rope = OPTIMIZED_ROPE_NONE;
  expect_error("kv_cache: unknown variant",
               optimized_paged_attention_decode(&tq, &cache, &tt, &tlens, &to, &tl, NULL, "fastest", NULL), I,
               "variant");
  expect_error("kv_cache: k of the wrong head dim",
               optimized_kv_cache_append(&cache, &tq, &tv, &tt, &tpos, NULL, NULL, "cpu", NULL), I, "k");
  check(optimized_variant_check("kv_cache", "cpu", OPTIMIZED_DTYPE_F64, OPTIMIZED_DEVICE_CPU) == OPTIMIZED_STATUS_OK &&
            optimized_variant_check("kv_cache", "auto", OPTIMIZED_DTYPE_BF16, OPTIMIZED_DEVICE_CPU) == OPTIMIZED_STATUS_OK,
        "kv_cache: variant check accepts cpu", optimized_last_error());
  check(optimized_variant_check("kv_cache", "auto", OPTIMIZED_DTYPE_BF16, OPTIMIZED_DEVICE_CUDA) == OPTIMIZED_STATUS_OK &&
            optimized_variant_check("kv_cache", "paged_split", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CUDA) ==
                OPTIMIZED_STATUS_OK,
        "kv_cache: variant check accepts auto / paged_split on CUDA", optimized_last_error());
  expect_error("kv_cache check: auto on CUDA with fp64",
               optimized_variant_check("kv_cache", "auto", OPTIMIZED_DTYPE_F64, OPTIMIZED_DEVICE_CUDA), U,
               "paged_split");
  expect_error("kv_cache check: cpu on CUDA",
               optimized_variant_check("kv_cache", "cpu", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CUDA), I,
               "variant: cpu runs on the CPU");
}

int main(void) {
  check(optimized_c_api_version() == OPTIMIZED_C_API_VERSION, "C API version matches the header", NULL);
  check(strcmp(optimized_status_string(OPTIMIZED_STATUS_OK), "ok") == 0 &&
            strcmp(optimized_status_string(OPTIMIZED_STATUS_INVALID_ARGUMENT), "invalid argument") == 0 &&
            strcmp(optimized_status_string((optimized_status)42), "unknown status") == 0,
        "status strings", NULL);

  /* Variant names: a NULL-terminated list without "auto". */
  int count = 0, has_cpu_naive = 0;
  for (const char* name; (name = optimized_gemm_variant_name(count)) != NULL; ++count) {
    if (strcmp(name, "cpu_naive") == 0) has_cpu_naive = 1;
    check(strcmp(name, "auto") != 0, "variant list excludes auto", name);
  }
  check(count >= 3 && has_cpu_naive && optimized_gemm_variant_name(-1) == NULL, "variant list", NULL);

  check(optimized_gemm_variant_check("auto", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU) == OPTIMIZED_STATUS_OK &&
            optimized_gemm_variant_check("mma_pipeline", OPTIMIZED_DTYPE_BF16, OPTIMIZED_DEVICE_CUDA) ==
                OPTIMIZED_STATUS_OK,
        "variant check accepts", optimized_last_error());
  expect_error("variant check: wmma on fp32",
               optimized_gemm_variant_check("wmma", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CUDA),
               OPTIMIZED_STATUS_UNSUPPORTED, "variant: wmma supports fp16, bf16");
  expect_error("variant check: CPU rung on CUDA",
               optimized_gemm_variant_check("cpu_packed", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CUDA),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "variant: cpu_packed runs on the CPU");
  expect_error("variant check: unknown name",
               optimized_gemm_variant_check("fastest", OPTIMIZED_DTYPE_F32, OPTIMIZED_DEVICE_CPU),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "variant: expected one of");
  expect_error("variant check: int32", optimized_gemm_variant_check("auto", OPTIMIZED_DTYPE_I32, OPTIMIZED_DEVICE_CPU),
               OPTIMIZED_STATUS_UNSUPPORTED, "int32");

  int64_t shape[3] = {2, 3, 5};
  optimized_tensor t;
  check(optimized_tensor_contiguous(&t, NULL, OPTIMIZED_DTYPE_BF16, OPTIMIZED_DEVICE_CPU, 0, 3, shape) ==
                OPTIMIZED_STATUS_OK &&
            t.rank == 3 && t.strides[0] == 15 && t.strides[1] == 5 && t.strides[2] == 1,
        "contiguous helper strides", NULL);

  error_paths();
  thread_local_error();
  variant_queries();
  scaled_matmul_tests();
  matmul_epilogue_tests();
  fused_error_paths();
  fused_results();
  loader_tests();
  attention_tests();
  kv_cache_tests();
  linear_tests();
  moe_tests();

  /* Odd shapes (1, primes), strided A, broadcast B, both dtypes, every CPU variant. */
  const gemm_case cases[] = {
      {1, 1, 1, 1, 1, 1, OPTIMIZED_DTYPE_F32},     {1, 17, 13, 31, 31, 1, OPTIMIZED_DTYPE_F32},
      {1, 37, 41, 53, 60, 1, OPTIMIZED_DTYPE_F32}, {3, 7, 29, 11, 16, 3, OPTIMIZED_DTYPE_F32},
      {4, 19, 5, 23, 23, 1, OPTIMIZED_DTYPE_F32},  {1, 67, 71, 73, 80, 1, OPTIMIZED_DTYPE_BF16},
      {2, 1, 97, 3, 3, 2, OPTIMIZED_DTYPE_BF16},   {2, 67, 72, 73, 80, 1, OPTIMIZED_DTYPE_BF16},
  };
  const int ncases = (int)(sizeof cases / sizeof cases[0]);
  for (int v = 0; optimized_gemm_variant_name(v) != NULL; ++v) {
    const char* name = optimized_gemm_variant_name(v);
    if (strncmp(name, "cpu_", 4) != 0) continue;
    for (int i = 0; i < ncases; ++i) run_cpu_case(&cases[i], name);
  }
  for (int i = 0; i < ncases; ++i) run_cpu_case(&cases[i], "auto");

#ifdef OPTIMIZED_TEST_CUDA
  if (optimized_cuda_device_count() > 0) {
    for (int v = 0; optimized_gemm_variant_name(v) != NULL; ++v) {
      const char* name = optimized_gemm_variant_name(v);
      if (strncmp(name, "cpu_", 4) == 0) continue;
      for (int i = 0; i < ncases; ++i) {
        const int hopper = strncmp(name, "wgmma_", 6) == 0;
        if (cases[i].dtype == OPTIMIZED_DTYPE_F32 && (strcmp(name, "wmma") == 0 || strcmp(name, "mma_pipeline") == 0 || hopper))
          continue; /* tensor-core variants take fp16/bf16 only */
        if (hopper && (cases[i].lda % 8 != 0 || cases[i].n % 8 != 0 || !device_is_sm90()))
          continue; /* TMA needs 16-byte rows (test_gemm_cuda checks the refusal); sm_90a code needs 9.0 */
        run_cuda_case(&cases[i], name);
      }
    }
  } else {
    printf("skip  CUDA cases: no CUDA device\n");
  }
#else
  printf("skip  CUDA cases: built without CUDA\n");
#endif

  printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
