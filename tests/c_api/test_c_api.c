/* The C API used from a C program (C11): status codes, the thread-local last-error message,
 * every error path naming its argument, and GEMM results on the CPU (and CUDA, when a device is
 * present) against a double-precision reference on fresh random inputs with poisoned outputs.
 *
 * Prints one line per check and closes with "N passed, N failed"; exits non-zero on failure. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
  t = ta, t.strides[0] = 1, t.strides[1] = 6;  /* transposed: the last dimension is not unit-stride */
  expect_error("column-major a", optimized_matmul(&t, &tb, &tc, 1, 0, "auto", NULL),
               OPTIMIZED_STATUS_INVALID_ARGUMENT, "a: expected unit stride");
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

/* ---- main ------------------------------------------------------------------------------------ */

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

  /* Odd shapes (1, primes), strided A, broadcast B, both dtypes, every CPU variant. */
  const gemm_case cases[] = {
      {1, 1, 1, 1, 1, 1, OPTIMIZED_DTYPE_F32},     {1, 17, 13, 31, 31, 1, OPTIMIZED_DTYPE_F32},
      {1, 37, 41, 53, 60, 1, OPTIMIZED_DTYPE_F32}, {3, 7, 29, 11, 16, 3, OPTIMIZED_DTYPE_F32},
      {4, 19, 5, 23, 23, 1, OPTIMIZED_DTYPE_F32},  {1, 67, 71, 73, 80, 1, OPTIMIZED_DTYPE_BF16},
      {2, 1, 97, 3, 3, 2, OPTIMIZED_DTYPE_BF16},
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
        if (cases[i].dtype == OPTIMIZED_DTYPE_F32 && (strcmp(name, "wmma") == 0 || strcmp(name, "mma_pipeline") == 0))
          continue; /* tensor-core variants take fp16/bf16 only */
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
