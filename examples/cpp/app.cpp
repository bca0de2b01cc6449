// C = A @ B through the C++ API, on the CPU so that it runs anywhere. On a GPU: device pointers,
// Device::cuda(), and the cudaStream_t in ExecutionContext{stream}.
#include <optimized/gemm.h>

#include <cstdio>
#include <vector>

int main() {
  using namespace optimized;
  const int64_t M = 64, N = 48, K = 80;
  std::vector<float> a(M * K, 1.0f), b(K * N, 0.5f), c(M * N, -1.0f);
  // Row-major matrices (rows, cols) with leading dimensions (here: contiguous rows).
  matmul(TensorView::matrix(a.data(), DType::kF32, Device::cpu(), M, K, K),
         TensorView::matrix(b.data(), DType::kF32, Device::cpu(), K, N, N),
         TensorView::matrix(c.data(), DType::kF32, Device::cpu(), M, N, N),
         /*alpha=*/1.0f, /*beta=*/0.0f, GemmVariant::kAuto, ExecutionContext{});
  std::printf("c[0][0] = %g (expected %g)\n", c[0], 0.5 * K);

  try {  // every entry validates its arguments; the message names the argument
    matmul(TensorView::matrix(a.data(), DType::kF32, Device::cpu(), M, K, K),
           TensorView::matrix(b.data(), DType::kF32, Device::cpu(), K - 1, N, N),
           TensorView::matrix(c.data(), DType::kF32, Device::cpu(), M, N, N));
  } catch (const Error& e) {
    std::printf("%s: %s\n", std::string(status_name(e.status())).c_str(), e.what());
  }
  return c[0] == 0.5f * K ? 0 : 1;
}
