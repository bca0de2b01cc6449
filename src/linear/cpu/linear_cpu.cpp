// g = dy * act'(pre) and the bias gradient on the host (cpu/linear_cpu.h).
#include "linear/cpu/linear_cpu.h"

#include <algorithm>
#include <array>

#include "core/cpu_loops.h"
#include "core/host_dtype.h"
#include "gemm/cpu/activation.h"
#include "optimized/buffer.h"

namespace optimized::cpu {
namespace {

constexpr int64_t kColumnsPerBlock = 64;  // one thread's columns: 64 running sums stay in L1

template <typename H>
void act_grad(const LinearGradParams& p, int threads) {
  using T = typename H::T;
  using Acc = typename H::Acc;
  const auto* dy = static_cast<const T*>(p.dy);
  const auto* pre = static_cast<const T*>(p.pre);
  auto* g = static_cast<T*>(p.g);
  const int64_t blocks = (p.n + kColumnsPerBlock - 1) / kColumnsPerBlock;
#pragma omp parallel for num_threads(cpu_thread_count(threads, blocks)) schedule(static)
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t j0 = block * kColumnsPerBlock, j1 = std::min(p.n, j0 + kColumnsPerBlock);
    std::array<double, kColumnsPerBlock> sums{};
    for (int64_t i = 0; i < p.m; ++i) {
      const T* dy_row = dy + i * p.ld_dy;
      for (int64_t j = j0; j < j1; ++j) {
        Acc v = H::load(dy_row[j]);
        if (p.act != 0) v *= activate_grad<Acc>(p.act, H::load(pre[i * p.ld_pre + j]));
        if (g) g[i * p.ld_g + j] = H::store(v);
        sums[static_cast<size_t>(j - j0)] += static_cast<double>(v);
      }
    }
    if (!p.bias_grad) continue;
    for (int64_t j = j0; j < j1; ++j) {
      double s = sums[static_cast<size_t>(j - j0)];
      if (p.accumulate) s += load_as_double(p.bias_grad, p.bias_grad_dtype, j);
      store_from_double(p.bias_grad, p.bias_grad_dtype, j, s);
    }
  }
}

}  // namespace

void linear_act_grad(const LinearGradParams& p, int cpu_threads) {
  switch (p.dtype) {
    case DType::kF32: return act_grad<host::F32>(p, cpu_threads);
    case DType::kF64: return act_grad<host::F64>(p, cpu_threads);
    case DType::kF16: return act_grad<host::F16>(p, cpu_threads);
    case DType::kBF16: return act_grad<host::BF16>(p, cpu_threads);
    default: break;
  }
}

}  // namespace optimized::cpu
