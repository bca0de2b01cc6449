// The launcher contract on a CUDA device, through the public API: a caller-provided workspace is
// used and nothing is allocated (a captured CUDA graph holds no allocation node, and the results
// match the call that allocated its own), a workspace smaller than the call needs is refused naming
// it, the workspace queries cover every call of their sizes, and NaN rows come out NaN on every
// CUDA variant (the reductions' one NaN policy), clusters included.
// Plain C++, built in every configuration: without a CUDA device every test skips.
#include <algorithm>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "optimized/buffer.h"
#include "optimized/fused.h"
#include "optimized/gemm.h"

#if OPTIMIZED_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace optimized {
namespace {

#define SKIP_WITHOUT_CUDA()                                                                          \
  do {                                                                                               \
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: " << cuda_unavailable_reason(); \
  } while (0)

const Device kGpu = Device::cuda(0);
const std::vector<FusedVariant> kCudaVariants = {FusedVariant::kCudaUnfused, FusedVariant::kCudaFusedStreaming,
                                                 FusedVariant::kCudaFusedRegisters};

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Deterministic values in [-2, 2).
std::vector<float> values(int64_t n, uint32_t seed) {
  std::vector<float> v(static_cast<size_t>(n));
  uint32_t s = seed * 2654435761u + 1;
  for (float& x : v) {
    s = s * 1664525u + 1013904223u;
    x = static_cast<float>(s >> 8) / static_cast<float>(1u << 24) * 4.0f - 2.0f;
  }
  return v;
}

// fp32 device buffer holding `host`.
Buffer device_f32(const std::vector<float>& host) {
  Buffer b(DType::kF32, static_cast<int64_t>(host.size()), kGpu);
  b.copy_from_host(host.data());
  return b;
}
std::vector<float> to_host(const Buffer& b) {
  std::vector<float> out(static_cast<size_t>(b.count()));
  b.copy_to_host(out.data());
  return out;
}

// A layer_norm backward with every optional output (dx, dweight, dbias) on (rows, width) fp32 rows:
// the call whose workspace every CUDA variant needs (temporaries, or per-block partial sums).
struct NormBackward {
  int64_t rows, width;
  Buffer dy, h, weight, mean, rstd, dx, dweight, dbias;

  NormBackward(int64_t rows_, int64_t width_)
      : rows(rows_), width(width_),
        dy(device_f32(values(rows_ * width_, 1))), h(device_f32(values(rows_ * width_, 2))),
        weight(device_f32(values(width_, 3))), mean(device_f32(values(rows_, 4))),
        rstd(device_f32(std::vector<float>(static_cast<size_t>(rows_), 0.75f))),
        dx(DType::kF32, rows_ * width_, kGpu), dweight(DType::kF32, width_, kGpu), dbias(DType::kF32, width_, kGpu) {}

  // Outputs poisoned: what a call leaves unwritten shows as NaN. cudaMemset runs on the legacy
  // stream, which a non-blocking stream does not wait for: the device is synchronized after it (so
  // never inside a stream capture).
  void poison() {
    for (Buffer* out : {&dx, &dweight, &dbias}) out->fill_bytes(0xFF);
#if OPTIMIZED_WITH_CUDA
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
#endif
  }
  void run(FusedVariant v, const ExecutionContext& ctx) {
    layer_norm_backward(dy.view({rows, width}), h.view({rows, width}), weight.view({width}), mean.view({rows}),
                        rstd.view({rows}), TensorView{}, dx.view({rows, width}), dweight.view({width}),
                        dbias.view({width}), v, ctx);
  }
  std::vector<float> outputs() const {
    std::vector<float> all = to_host(dx);
    for (const Buffer* b : {&dweight, &dbias}) {
      const std::vector<float> part = to_host(*b);
      all.insert(all.end(), part.begin(), part.end());
    }
    return all;
  }
  size_t workspace_bytes(FusedVariant v) const {
    return fused_workspace_bytes(FusedOp::kLayerNorm, true, DType::kF32, kGpu, rows, width, v);
  }
};

#if OPTIMIZED_WITH_CUDA
#define EXPECT_CUDA_OK(call) EXPECT_EQ((call), cudaSuccess) << #call

class Stream {
 public:
  Stream() { EXPECT_CUDA_OK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s_); }
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// The nodes of `graph` of type `type`.
size_t count_nodes(cudaGraph_t graph, cudaGraphNodeType type) {
  size_t n = 0;
  EXPECT_CUDA_OK(cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  EXPECT_CUDA_OK(cudaGraphGetNodes(graph, nodes.data(), &n));
  size_t count = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType t;
    EXPECT_CUDA_OK(cudaGraphNodeGetType(node, &t));
    count += t == type;
  }
  return count;
}
#endif

TEST(CudaWorkspace, QueriesAreNonZeroWhereScratchIsNeeded) {
  SKIP_WITHOUT_CUDA();
  for (FusedVariant v : kCudaVariants) {
    SCOPED_TRACE(std::string(fused_variant_name(v)));
    // Norm backward: temporaries (unfused) or dweight / dbias partials (fused designs).
    EXPECT_GT(fused_workspace_bytes(FusedOp::kLayerNorm, true, DType::kBF16, kGpu, 4096, 1024, v), 0u);
    // bias_gelu backward: dbias partials.
    EXPECT_GT(fused_workspace_bytes(FusedOp::kBiasGelu, true, DType::kBF16, kGpu, 4096, 1024, v), 0u);
    EXPECT_EQ(fused_workspace_bytes(FusedOp::kLayerNorm, true, DType::kBF16, kGpu, 0, 1024, v), 0u);
  }
  // The fused designs need no scratch for a forward.
  EXPECT_EQ(fused_workspace_bytes(FusedOp::kSoftmax, false, DType::kBF16, kGpu, 4096, 1024,
                                  FusedVariant::kCudaFusedRegisters), 0u);
  EXPECT_EQ(fused_workspace_bytes(FusedOp::kRmsNorm, false, DType::kBF16, kGpu, 4096, 8192,
                                  FusedVariant::kCudaFusedStreaming), 0u);
}

TEST(CudaWorkspace, TooSmallIsRefusedNamingIt) {
  SKIP_WITHOUT_CUDA();
  NormBackward call(300, 1000);
  Buffer tiny(DType::kF32, 64, kGpu);  // 256 bytes
  // Room for a misaligned workspace of the full size that overlaps no operand (where allocations
  // lie side by side, as under compute-sanitizer, one running past `tiny` would overlap h).
  size_t most = 0;
  for (FusedVariant v : kCudaVariants) most = std::max(most, call.workspace_bytes(v));
  Buffer roomy(DType::kF32, static_cast<int64_t>(most / 4 + 64), kGpu);
  for (FusedVariant v : kCudaVariants) {
    SCOPED_TRACE(std::string(fused_variant_name(v)));
    // The message of the Error `ctx`'s call raises (kInvalidArgument), or a failure.
    auto refusal = [&](const ExecutionContext& ctx) -> std::string {
      try {
        call.run(v, ctx);
      } catch (const Error& e) {
        EXPECT_EQ(e.status(), Status::kInvalidArgument);
        return e.what();
      }
      ADD_FAILURE() << "the workspace was accepted";
      return "";
    };
    ExecutionContext ctx;
    ctx.workspace = {tiny.data(), 1};
    std::string why = refusal(ctx);
    EXPECT_TRUE(contains(why, "workspace: expected at least")) << why;
    EXPECT_TRUE(contains(why, "layer_norm backward (" + std::string(fused_variant_name(v)) + ")")) << why;
    EXPECT_TRUE(contains(why, "given 1 bytes")) << why;
    ctx.workspace = {static_cast<char*>(roomy.data()) + 4, call.workspace_bytes(v)};  // misaligned
    why = refusal(ctx);
    EXPECT_TRUE(contains(why, "workspace: expected data aligned to 256 bytes")) << why;
  }
#if OPTIMIZED_WITH_CUDA
  EXPECT_CUDA_OK(cudaDeviceSynchronize());
#endif
}

TEST(CudaWorkspace, GivenWorkspaceIsUsedAndNothingIsAllocated) {
  SKIP_WITHOUT_CUDA();
#if OPTIMIZED_WITH_CUDA
  for (int64_t width : {1000, 20000}) {  // 20000 fp32: fused_registers spreads a row over a cluster
    NormBackward call(300, width);
    for (FusedVariant v : kCudaVariants) {
      SCOPED_TRACE(std::string(fused_variant_name(v)) + " width " + std::to_string(width));
      Stream stream;
      ExecutionContext ctx;
      ctx.cuda_stream = stream.get();
      // Eager, the library allocating (and freeing) its own workspace on the stream.
      call.poison();
      call.run(v, ctx);
      EXPECT_CUDA_OK(cudaStreamSynchronize(stream.get()));
      const std::vector<float> eager = call.outputs();

      // Captured without a workspace: the allocation shows as a graph node (what the check detects).
      cudaGraph_t graph = nullptr;
      EXPECT_CUDA_OK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
      call.run(v, ctx);
      EXPECT_CUDA_OK(cudaStreamEndCapture(stream.get(), &graph));
      EXPECT_GT(count_nodes(graph, cudaGraphNodeTypeMemAlloc), 0u);
      EXPECT_CUDA_OK(cudaGraphDestroy(graph));

      // Captured with the caller's workspace (the query's size): no allocation node, same results.
      const size_t bytes = call.workspace_bytes(v);
      ASSERT_GT(bytes, 0u);
      Buffer ws(DType::kF32, static_cast<int64_t>((bytes + 3) / 4), kGpu);
      ctx.workspace = {ws.data(), bytes};
      EXPECT_CUDA_OK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeGlobal));
      call.run(v, ctx);
      EXPECT_CUDA_OK(cudaStreamEndCapture(stream.get(), &graph));
      EXPECT_EQ(count_nodes(graph, cudaGraphNodeTypeMemAlloc), 0u);
      EXPECT_EQ(count_nodes(graph, cudaGraphNodeTypeMemFree), 0u);
      cudaGraphExec_t exec = nullptr;
      EXPECT_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
      call.poison();
      EXPECT_CUDA_OK(cudaGraphLaunch(exec, stream.get()));
      EXPECT_CUDA_OK(cudaStreamSynchronize(stream.get()));
      const std::vector<float> replayed = call.outputs();
      ASSERT_EQ(replayed.size(), eager.size());
      EXPECT_EQ(std::memcmp(replayed.data(), eager.data(), eager.size() * sizeof(float)), 0)
          << "the graph with the caller's workspace computed something else";
      for (float x : replayed) ASSERT_TRUE(std::isfinite(x));
      EXPECT_CUDA_OK(cudaGraphExecDestroy(exec));
      EXPECT_CUDA_OK(cudaGraphDestroy(graph));
    }
  }
#endif
}

// Every call of the query's sizes runs in a workspace of exactly the query's bytes (a launcher
// needing more would be refused with "workspace: expected at least"): every op, both directions,
// every CUDA variant, aligned and misaligned rows, short and long rows.
TEST(CudaWorkspace, QueryCoversEveryCallOfItsSizes) {
  SKIP_WITHOUT_CUDA();
  const int64_t rows = 67;
  for (int64_t width : {6, 1000, 20000}) {
    for (int64_t offset : {0, 1}) {  // offset 1: no row starts on a 16-byte boundary
      const int64_t cols = 2 * width + offset;
      Buffer a(DType::kBF16, rows * cols + 64, kGpu), b(DType::kBF16, rows * cols + 64, kGpu),
          c(DType::kBF16, rows * cols + 64, kGpu), vec(DType::kBF16, 2 * width + 8, kGpu),
          vec2(DType::kBF16, 2 * width + 8, kGpu), stats(DType::kF32, 2 * rows, kGpu), ws(DType::kF32, 1, kGpu);
      for (Buffer* buf : {&a, &b, &c, &vec, &vec2}) buf->fill_bytes(0x3C);  // bf16 0x3C3C: ~0.0115
      stats.fill_bytes(0x3F);                                            // fp32 ~0.75
      auto rows_of = [&](const Buffer& buf, int64_t w) {
        return TensorView(static_cast<uint16_t*>(buf.data()) + offset, DType::kBF16, kGpu, {rows, w}, {cols, 1});
      };
      auto v1 = [&](const Buffer& buf) { return TensorView(buf.data(), DType::kBF16, kGpu, {width}); };
      auto st = [&](int64_t i) { return TensorView(static_cast<float*>(stats.data()) + i * rows, DType::kF32, kGpu, {rows}); };
      for (FusedVariant v : kCudaVariants) {
        for (FusedOp op : all_fused_ops()) {
          for (bool bwd : {false, true}) {
            const int64_t limit = fused_registers_max_width(op, DType::kBF16, bwd, offset == 0);  // 0: none
            if (v == FusedVariant::kCudaFusedRegisters && limit > 0 && width > limit) continue;
            SCOPED_TRACE(std::string(fused_variant_name(v)) + " " + std::string(fused_op_name(op)) +
                         (bwd ? " bwd" : " fwd") + " width " + std::to_string(width) + " offset " +
                         std::to_string(offset));
            const size_t bytes = fused_workspace_bytes(op, bwd, DType::kBF16, kGpu, rows, width, v);
            Buffer scratch(DType::kF32, static_cast<int64_t>(bytes / 4 + 1), kGpu);
            ExecutionContext ctx;
            ctx.workspace = {scratch.data(), bytes};
            const TensorView none{};
            try {
              switch (op) {
                case FusedOp::kSoftmax:
                case FusedOp::kLogSoftmax:
                  if (bwd)
                    softmax_backward(rows_of(a, width), rows_of(b, width), rows_of(c, width), 1.0,
                                     op == FusedOp::kLogSoftmax, v, ctx);
                  else
                    softmax_forward(rows_of(a, width), rows_of(c, width), 1.0, op == FusedOp::kLogSoftmax, v, ctx);
                  break;
                case FusedOp::kLayerNorm:
                case FusedOp::kAddLayerNorm: {
                  const bool add = op == FusedOp::kAddLayerNorm;
                  if (bwd)
                    layer_norm_backward(rows_of(a, width), rows_of(b, width), v1(vec), st(0), st(1),
                                        add ? rows_of(b, width) : none, rows_of(c, width), v1(vec2), none, v, ctx);
                  else
                    layer_norm_forward(rows_of(a, width), add ? rows_of(b, width) : none, v1(vec), v1(vec2), 1e-5,
                                       rows_of(c, width), add ? rows_of(b, width) : none, none, none, v, ctx);
                  break;
                }
                case FusedOp::kRmsNorm:
                case FusedOp::kAddRmsNorm: {
                  const bool add = op == FusedOp::kAddRmsNorm;
                  if (bwd)
                    rms_norm_backward(rows_of(a, width), rows_of(b, width), v1(vec), st(1),
                                      add ? rows_of(b, width) : none, rows_of(c, width), v1(vec2), v, ctx);
                  else
                    rms_norm_forward(rows_of(a, width), add ? rows_of(b, width) : none, v1(vec), 1e-5,
                                     rows_of(c, width), add ? rows_of(b, width) : none, none, v, ctx);
                  break;
                }
                case FusedOp::kBiasGelu:
                  if (bwd)
                    bias_gelu_backward(rows_of(a, width), rows_of(b, width), v1(vec), GeluApproximation::kNone,
                                       rows_of(c, width), v1(vec2), v, ctx);
                  else
                    bias_gelu_forward(rows_of(a, width), v1(vec), GeluApproximation::kTanh, rows_of(c, width), v, ctx);
                  break;
                case FusedOp::kSiluAndMul:
                  if (bwd)
                    silu_and_mul_backward(rows_of(a, width), rows_of(b, 2 * width), rows_of(c, 2 * width), v, ctx);
                  else
                    silu_and_mul_forward(rows_of(b, 2 * width), rows_of(c, width), v, ctx);
                  break;
              }
            } catch (const Error& e) {
              ADD_FAILURE() << e.what();
            }
          }
        }
      }
#if OPTIMIZED_WITH_CUDA
      EXPECT_CUDA_OK(cudaDeviceSynchronize());
#endif
    }
  }
}

// One NaN in a row makes the whole row NaN, on every CUDA variant (NaN propagates through the row
// reductions: the max of softmax, the sums of the norms), for rows held by one block and by a
// cluster of blocks; the other rows stay finite.
TEST(CudaNanPolicy, ANanRowIsNanOnEveryVariant) {
  SKIP_WITHOUT_CUDA();
  const int64_t rows = 5;
  for (int64_t width : {33, 2048, 20000}) {  // fp32 20000: fused_registers uses a cluster of 4
    std::vector<float> host = values(rows * width, 7);
    host[static_cast<size_t>(2 * width + width / 3)] = NAN;  // row 2
    Buffer x = device_f32(host), y(DType::kF32, rows * width, kGpu), w = device_f32(values(width, 8));
    for (FusedVariant v : kCudaVariants) {
      for (FusedOp op : {FusedOp::kSoftmax, FusedOp::kLogSoftmax, FusedOp::kLayerNorm, FusedOp::kRmsNorm}) {
        SCOPED_TRACE(std::string(fused_variant_name(v)) + " " + std::string(fused_op_name(op)) + " width " +
                     std::to_string(width));
        y.fill_bytes(0);
        const TensorView xv = x.view({rows, width}), yv = y.view({rows, width});
        if (op == FusedOp::kSoftmax || op == FusedOp::kLogSoftmax)
          softmax_forward(xv, yv, 1.0, op == FusedOp::kLogSoftmax, v);
        else if (op == FusedOp::kLayerNorm)
          layer_norm_forward(xv, TensorView{}, w.view({width}), TensorView{}, 1e-5, yv, TensorView{}, TensorView{},
                             TensorView{}, v);
        else
          rms_norm_forward(xv, TensorView{}, w.view({width}), 1e-5, yv, TensorView{}, TensorView{}, v);
        const std::vector<float> out = to_host(y);
        for (int64_t r = 0; r < rows; ++r) {
          int64_t nans = 0;
          for (int64_t c = 0; c < width; ++c) nans += std::isnan(out[static_cast<size_t>(r * width + c)]);
          EXPECT_EQ(nans, r == 2 ? width : 0) << "row " << r;
        }
      }
    }
  }
}

}  // namespace
}  // namespace optimized
