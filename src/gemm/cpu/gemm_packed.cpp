// gemm_packed: the GotoBLAS/BLIS loop nest around a register-blocked microkernel.
//
//   for each batch item
//     for jc over N in NC steps
//       for pc over K in KC steps
//         pack B[pc:pc+KC, jc:jc+NC] into NR-wide micro-panels   (shared; sized for L2)
//         for each unit (a group of rows, all NR panels)          (threads take units dynamically)
//           for ic over the unit's rows in MC steps
//             pack A[ic:ic+MC, pc:pc+KC] into MR-tall micro-panels (per thread)
//             for ir over MC in MR steps                           (A micro-panel MR x KC: in L1)
//               for jr over NC in NR steps                         (B micro-panels stream from L2)
//                 microkernel: C[ir:ir+MR, jr:jr+NR] = alpha * Ap_ir @ Bp_jr + beta * C
//
// The jr loop is innermost (not BLIS's ir): one A micro-panel is reused from L1 by every B
// micro-panel of the L2-resident B block. When there are fewer row groups than threads, units
// also split the NR panels. fp16/bf16 operands are widened to fp32 while packing; their C is
// accumulated in an fp32 workspace over all of K and rounded once, in the epilogue.
//
// This file is compiled for the baseline ISA: it only picks and calls the ISA-specific pieces
// (gemm_packed_avx512.cpp, gemm_packed_avx2.cpp) after checking cpuid, so no AVX instruction runs
// on a machine without it.
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string_view>

#include "gemm/cpu/cpu_gemm.h"
#include "gemm/cpu/gemm_packed_kernels.h"
#include "optimized/buffer.h"

namespace optimized::cpu {
namespace packed {
namespace {

// ---- portable microkernel: 4 x 16 in plain C++ (the compiler vectorizes what it can) ----------
constexpr int kPMR = 4;
constexpr int kPNR = 16;

void portable_full(int64_t kc, const float* __restrict ap, const float* __restrict bp, float* c,
                   int64_t ldc, float alpha, float beta) {
  // Row by row (i-k-j): the 16 accumulators of a row stay in vector registers over all of K
  // and the j loop vectorizes; the B micro-panel is re-read from L1 once per row.
  float acc[kPMR][kPNR];
  for (int i = 0; i < kPMR; ++i) {
    float row[kPNR] = {};
    for (int64_t k = 0; k < kc; ++k) {
      const float a = ap[k * kPMR + i];
      const float* __restrict b = bp + k * kPNR;
      for (int j = 0; j < kPNR; ++j) row[j] += a * b[j];
    }
    for (int j = 0; j < kPNR; ++j) acc[i][j] = row[j];
  }
  for (int i = 0; i < kPMR; ++i) {
    float* r = c + i * ldc;
    if (beta == 0.0f) {
      for (int j = 0; j < kPNR; ++j) r[j] = alpha * acc[i][j];
    } else {
      for (int j = 0; j < kPNR; ++j) r[j] = alpha * acc[i][j] + beta * r[j];
    }
  }
}

void portable_kernel(int64_t kc, const float* ap, const float* bp, float* c, int64_t ldc,
                     float alpha, float beta, int m, int n) {
  if (m == kPMR && n == kPNR) return portable_full(kc, ap, bp, c, ldc, alpha, beta);
  kernel_edge<kPMR, kPNR>(portable_full, kc, ap, bp, c, ldc, alpha, beta, m, n);
}

void portable_pack_a(DType dtype, const void* a, int64_t rs, int64_t cs, int64_t mc, int64_t kc, float* ap) {
  pack_a_dispatch<kPMR>(dtype, a, rs, cs, mc, kc, ap);
}

void portable_pack_b(DType dtype, const void* b, int64_t rs, int64_t cs, int64_t kc, int64_t nc, float* bp) {
  pack_b_dispatch<kPNR>(dtype, b, rs, cs, kc, nc, bp);
}

void portable_epilogue(DType dtype, const float* w, int64_t ldw, void* c, int64_t ldc,
                       int64_t rows, int64_t n, float alpha, float beta) {
  uint16_t* c16 = static_cast<uint16_t*>(c);
  if (dtype == DType::kBF16) return epilogue_bf16(w, ldw, c16, ldc, rows, n, alpha, beta);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; ++j) {
      float v = alpha * w[r * ldw + j];
      if (beta != 0.0f) v += beta * h2f(c16[r * ldc + j]);
      c16[r * ldc + j] = float_to_half(v);
    }
  }
}

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};
using FloatBuf = std::unique_ptr<float[], FreeDeleter>;

FloatBuf alloc_floats(int64_t count) {
  const size_t bytes = (static_cast<size_t>(count) * sizeof(float) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, bytes > 0 ? bytes : 64);
  if (p == nullptr) throw Error(Status::kOutOfMemory, "gemm_packed: cannot allocate packing buffers");
  return FloatBuf(static_cast<float*>(p));
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The best supported ISA; OPTIMIZED_CPU_ISA=avx2|portable may only pick a lower one (for tests
// of the other paths on a bigger machine).
const IsaOps& select_ops() {
  static const IsaOps* chosen = [] {
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    const char* env = std::getenv("OPTIMIZED_CPU_ISA");
    const std::string_view want = env != nullptr ? env : "";
    if (avx512 && (want.empty() || want == "avx512")) return &avx512_ops();
    if (avx2 && want != "portable") return &avx2_ops();
    return &portable_ops();
  }();
  return *chosen;
}

}  // namespace

const IsaOps& portable_ops() {
  static const IsaOps ops{"portable",        {kPMR, kPNR, 64, 256, 1024}, portable_pack_a,
                          portable_pack_b,   portable_kernel,              portable_epilogue};
  return ops;
}

}  // namespace packed

const char* packed_microkernel_isa() { return packed::select_ops().name; }

void gemm_packed(const GemmParams& p, int threads) {
  using namespace packed;
  const IsaOps& ops = select_ops();
  const int64_t MR = ops.blk.mr, NR = ops.blk.nr;
  const int64_t MC = ops.blk.mc, KC = ops.blk.kc, NC = ops.blk.nc;
  const int64_t M = p.m, N = p.n, K = p.k;
  const DType dtype = p.dtype;
  const size_t esz = dtype_size(dtype);
  const bool wide = dtype == DType::kF32;  // fp32 C is accumulated in place
  // The operands' strides along (row, column) as the product sees them: packing reads either layout.
  const int64_t a_rs = p.trans_a ? 1 : p.lda, a_cs = p.trans_a ? p.lda : 1;
  const int64_t b_rs = p.trans_b ? 1 : p.ldb, b_cs = p.trans_b ? p.ldb : 1;

  // Threads: no more than the work can use (tiny products run on one).
  int nth = threads > 0 ? threads : omp_get_max_threads();
  const int64_t m_panels = ceil_div(M, MR);
  const double flops = 2.0 * static_cast<double>(M) * N * K * p.batch;
  if (flops < 2.0 * 96 * 96 * 96) nth = 1;
  nth = static_cast<int>(std::min<int64_t>(nth, m_panels * ceil_div(std::min(N, NC), NR)));
  nth = std::max(nth, 1);

  const int64_t kc_max = std::min(K, KC);
  const int64_t nc_max = std::min(ceil_div(N, NR) * NR, NC);
  const int64_t mc_max = std::min(m_panels * MR, MC);
  FloatBuf bpack = alloc_floats(nc_max * kc_max);
  FloatBuf work = wide ? FloatBuf() : alloc_floats(M * N);
  float* const bp = bpack.get();

  const char* const a_base = static_cast<const char*>(p.a);
  const char* const b_base = static_cast<const char*>(p.b);
  char* const c_base = static_cast<char*>(p.c);

  // Work units of one (jc, pc) step: row groups x column chunks, handed out dynamically so that
  // a thread that gets descheduled does not hold the others at the barrier. Row groups are an
  // even split of the MR panels into a multiple of the thread count (balanced when the machine
  // is quiet); column chunks only when there are too few row groups to go around.
  const int64_t target_group = std::max<int64_t>(1, MC / MR);  // MR panels per row group
  int64_t row_groups = nth * ceil_div(m_panels, int64_t{nth} * target_group);
  row_groups = std::min(row_groups, m_panels);
  const int64_t col_chunks = nth == 1 || row_groups >= 2 * nth ? 1 : ceil_div(2 * nth, row_groups);

#pragma omp parallel num_threads(nth)
  {
    FloatBuf apack = alloc_floats(mc_max * kc_max);
    float* const ap = apack.get();

    for (int64_t bi = 0; bi < p.batch; ++bi) {
      const char* const A = a_base + static_cast<size_t>(bi * p.batch_stride_a) * esz;
      const char* const B = b_base + static_cast<size_t>(bi * p.batch_stride_b) * esz;
      char* const C = c_base + static_cast<size_t>(bi * p.batch_stride_c) * esz;
      float* const cf = wide ? reinterpret_cast<float*>(C) : work.get();
      const int64_t ldcf = wide ? p.ldc : N;

      for (int64_t jc = 0; jc < N; jc += NC) {
        const int64_t nc = std::min(NC, N - jc);
        const int64_t n_panels = ceil_div(nc, NR);
        for (int64_t pc = 0; pc < K; pc += KC) {
          const int64_t kc = std::min(KC, K - pc);
          // Pack the B block, a few NR panels per unit (the implicit barrier publishes it).
#pragma omp for schedule(dynamic, 1)
          for (int64_t s0 = 0; s0 < n_panels; s0 += 4) {
            const int64_t s1 = std::min(n_panels, s0 + 4);
            ops.pack_b(dtype, B + static_cast<size_t>(p.b_index(pc, jc + s0 * NR)) * esz, b_rs, b_cs, kc,
                       std::min(nc - s0 * NR, (s1 - s0) * NR), bp + s0 * NR * kc);
          }
          const float alpha = wide ? p.alpha : 1.0f;
          const float beta = pc == 0 ? (wide ? p.beta : 0.0f) : 1.0f;
          // The implicit barrier at the end keeps the B block alive until every unit is done.
#pragma omp for schedule(dynamic, 1)
          for (int64_t u = 0; u < row_groups * col_chunks; ++u) {
            const int64_t g = u / col_chunks, cchunk = u % col_chunks;
            const int64_t row_lo = std::min(M, (m_panels * g / row_groups) * MR);
            const int64_t row_hi = std::min(M, (m_panels * (g + 1) / row_groups) * MR);
            const int64_t q_lo = n_panels * cchunk / col_chunks;
            const int64_t q_hi = n_panels * (cchunk + 1) / col_chunks;
            for (int64_t ic = row_lo; ic < row_hi; ic += MC) {
              const int64_t mc = std::min(MC, row_hi - ic);
              ops.pack_a(dtype, A + static_cast<size_t>(p.a_index(ic, pc)) * esz, a_rs, a_cs, mc, kc, ap);
              // One MR x KC micro-panel of A stays in L1 while the NR panels of B stream from L2.
              for (int64_t ir = 0; ir < mc; ir += MR) {
                const int m = static_cast<int>(std::min(MR, mc - ir));
                float* const crow = cf + (ic + ir) * ldcf + jc;
                for (int64_t q = q_lo; q < q_hi; ++q) {
                  const int64_t j = q * NR;
                  const int n = static_cast<int>(std::min(NR, nc - j));
                  ops.kernel(kc, ap + ir * kc, bp + j * kc, crow + j, ldcf, alpha, beta, m, n);
                }
              }
            }
          }
        }
      }
      if (!wide) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r += 16) {
          const int64_t rows = std::min<int64_t>(16, M - r);
          ops.epilogue(dtype, work.get() + r * N, N, C + static_cast<size_t>(r * p.ldc) * esz,
                       p.ldc, rows, N, p.alpha, p.beta);
        }
      }
    }
  }
}

}  // namespace optimized::cpu
