// Third Hopper rung: the warp-specialized kernel of wgmma_ws (gemm_wgmma_ws.cuh) on a persistent
// grid of clusters, with a TMA-store epilogue. Three steps, each measured in
// docs/perf-notes/gemm.md:
//   * persistent: one block per SM walks the tiles of every batch (kernels/sched/
//     persistent_tiles.cuh, grouped rasterization for L2 reuse); the producer starts the next
//     tile's loads while the consumers run this tile's epilogue, a block's setup happens once per
//     SM, and only the last wave is partial.
//   * clusters of 2 blocks take two vertically adjacent tiles, which need the same 256 columns of
//     B: each block loads half of B's boxes and TMA multicasts them to both, so per k-block a block
//     brings 16 KiB of A + 16 KiB of B from L2 instead of 16 + 32. Less L2 traffic is less power,
//     and under the H100's power limit that is clock speed.
//   * TMA-store epilogue (beta == 0, C describable): each consumer warpgroup writes its 64 x 256
//     tile as four swizzled 64 x 64 chunks into two staging buffers and one thread hands each to
//     the TMA unit, so the consumers return to the tensor cores after ~64 shared-memory stores per
//     thread instead of waiting on 64 global ones.
//
//   * operands TMA cannot describe (auto only): padded copies in the workspace first (Staging).
//   * layouts: one instantiation per layout of A and B (row- or column-major each;
//     wgmma_mainloop.cuh): the same boxes and bytes, wgmma's transpose immediates differ.
//   * small M (decode shapes, M <= 64) and split-K: gemm_config.h's gemm_hopper_plan picks the
//     tile configuration and how many K ranges to cut each tile into when the tiles alone do not
//     fill the SMs (the fp32 partials meet in a workspace, summed in split order).
//
//   big:     block tile 128 x 256 x 64, 4 stages (192 KiB) + 32 KiB of C staging, clusters of 2
//            along M, grid = min(units, the clusters that fit at once) x 2;
//   small_m: block tile 64 x 128 x 64, 8 stages (192 KiB) + 16 KiB of C staging, one consumer.
#include <string>
#include <type_traits>

#include "core/device_facts.h"
#include "gemm/cuda/gemm_wgmma_ws.cuh"
#include "gemm/gemm_config.h"
#include "gemm/launchers.h"

namespace optimized::cuda {
namespace {

// The two configurations (gemm_config.h, GemmHopperPlan), for one layout of A and B.
template <bool kSmallM, bool kTransA = false, bool kTransB = false>
struct Config {
  static constexpr int kConsumers = kSmallM ? 1 : 2;
  static constexpr int kCluster = kSmallM ? 1 : 2;
  using Tile =
      std::conditional_t<kSmallM, kernels::WgmmaTile<64, 128, 8, kTmaStoreStagingBytes<1>, kTransA, kTransB>,
                         kernels::WgmmaTile<128, 256, 4, kTmaStoreStagingBytes<2>, kTransA, kTransB>>;
  using Scheduler = kernels::PersistentTiles<8, kCluster>;
  using Shape = WgmmaWsShape<Tile, kConsumers>;
};

template <typename T, typename TC, bool kSmallM, bool kTransA, bool kTransB>
const void* kernel_ptr() {
  using C = Config<kSmallM, kTransA, kTransB>;
  return reinterpret_cast<const void*>(
      &gemm_wgmma_ws_kernel<T, TC, typename C::Tile, C::kConsumers, typename C::Scheduler, C::kCluster, true>);
}

template <typename T, typename TC, bool kSmallM, bool kTransA, bool kTransB>
const std::string& kernel_name() {
  static const std::string name =
      std::string("gemm_wgmma_persistent<") + dtype_label<T>() + (std::is_same_v<T, TC> ? "" : ", fp32 out") + ", " +
      kLayoutName<kTransA, kTransB> +
      (kSmallM ? ", 64x128x64, 8 stages, producer + 1 consumer, small M>"
               : ", 128x256x64, 4 stages, producer + 2 consumers, cluster 2x1>");
  return name;
}

// The plan for p on the current device (SM count from the device facts; 132, an H100's, when they
// cannot be read, so that a workspace query without a device still answers for the common case).
GemmHopperPlan plan_for(const GemmParams& p) {
  int sm_count = 132;
  const DeviceFacts* facts = nullptr;
  if (current_device_facts(&facts) == cudaSuccess) sm_count = facts->sm_count;
  return gemm_hopper_plan(p.m, p.n, p.k, p.batch, sm_count);
}

// Padded copies of the operands TMA cannot describe (rows or batches not 16-byte aligned). Only
// auto gets here with such operands (gemm.cpp refuses them for a forced rung): the copies' rows
// are the stored rows (K or M for A, N or K for B, by layout) rounded up to 8 elements, made with
// strided 2-D copies at the front of the workspace, A's then B's, in the operands' own layouts;
// TMA never reads the padding (the maps end at the stored widths).
struct Staging {
  bool a = false, b = false;
  int64_t lda = 0, ldb = 0;           // the copies' row strides
  int64_t batches_a = 1, batches_b = 1;
  size_t b_offset = 0, bytes = 0;     // B's copy after A's; the total, 256-byte aligned
};

Staging staging_for(const GemmParams& p) {
  const int e = static_cast<int>(dtype_size(p.dtype));
  const auto round8 = [](int64_t x) { return (x + 7) / 8 * 8; };
  const auto round256 = [](int64_t x) { return static_cast<size_t>((x + 255) / 256 * 256); };
  Staging st;
  st.a = !tma_rejects(TmaMatrix{p.a, p.a_stored_rows(), p.a_stored_cols(), p.lda, p.batch, p.batch_stride_a, e}, "a").empty();
  st.b = !tma_rejects(TmaMatrix{p.b, p.b_stored_rows(), p.b_stored_cols(), p.ldb, p.batch, p.batch_stride_b, e}, "b").empty();
  size_t a_bytes = 0, b_bytes = 0;
  if (st.a) {
    st.lda = round8(p.a_stored_cols());
    st.batches_a = p.batch_stride_a != 0 ? p.batch : 1;
    a_bytes = round256(st.batches_a * p.a_stored_rows() * st.lda * e);
  }
  if (st.b) {
    st.ldb = round8(p.b_stored_cols());
    st.batches_b = p.batch_stride_b != 0 ? p.batch : 1;
    b_bytes = round256(st.batches_b * p.b_stored_rows() * st.ldb * e);
  }
  st.b_offset = a_bytes;
  st.bytes = a_bytes + b_bytes;
  return st;
}

// rows x cols of `batches` matrices (ld, batch stride in elements) into dst with row stride dst_ld.
cudaError_t copy_rows(void* dst, int64_t dst_ld, const void* src, int64_t ld, int64_t batch_stride, int64_t rows,
                      int64_t cols, int64_t batches, int e, cudaStream_t stream) {
  // Batches that follow each other row after row are one copy of batches * rows rows.
  const bool one = batches == 1 || batch_stride == rows * ld;
  const int64_t height = one ? batches * rows : rows;
  for (int64_t z = 0; z < (one ? 1 : batches); ++z) {
    if (cudaError_t err = cudaMemcpy2DAsync(static_cast<char*>(dst) + z * rows * dst_ld * e, dst_ld * e,
                                            static_cast<const char*>(src) + z * batch_stride * e, ld * e, cols * e,
                                            height, cudaMemcpyDeviceToDevice, stream);
        err != cudaSuccess)
      return err;
  }
  return cudaSuccess;
}

// p with its operands replaced by their staged copies (made on `stream`) where `st` says.
cudaError_t stage(const GemmParams& p, const Staging& st, void* workspace, cudaStream_t stream, GemmParams* q) {
  const int e = static_cast<int>(dtype_size(p.dtype));
  *q = p;
  if (st.a) {
    if (cudaError_t err = copy_rows(workspace, st.lda, p.a, p.lda, p.batch_stride_a, p.a_stored_rows(),
                                    p.a_stored_cols(), st.batches_a, e, stream);
        err != cudaSuccess)
      return err;
    q->a = workspace;
    q->lda = st.lda;
    q->batch_stride_a = st.batches_a > 1 ? p.a_stored_rows() * st.lda : 0;
  }
  if (st.b) {
    void* b = static_cast<char*>(workspace) + st.b_offset;
    if (cudaError_t err = copy_rows(b, st.ldb, p.b, p.ldb, p.batch_stride_b, p.b_stored_rows(), p.b_stored_cols(),
                                    st.batches_b, e, stream);
        err != cudaSuccess)
      return err;
    q->b = b;
    q->ldb = st.ldb;
    q->batch_stride_b = st.batches_b > 1 ? p.b_stored_rows() * st.ldb : 0;
  }
  return cudaSuccess;
}

template <bool kSmallM>
size_t split_bytes(const GemmParams& p, int splits, size_t* counters_offset) {
  using Tile = typename Config<kSmallM>::Tile;
  return hopper_split_bytes(p, Tile::kBM, Tile::kBN, splits, counters_offset);
}

// Column sums: one row of partials per 16 rows of a tile (a consumer warp's rows).
template <bool kSmallM>
int64_t partial_rows(const GemmParams& p) {
  constexpr int kBM = Config<kSmallM>::Tile::kBM;
  return ceil_div(p.m, int64_t(kBM)) * (kBM / 16);
}

// The workspace after the staged copies: split-K's partials and counters, then the column-sum
// partials.
template <bool kSmallM>
size_t scratch_bytes(const GemmParams& p, int splits, size_t* column_offset) {
  size_t counters_offset = 0;
  *column_offset = (split_bytes<kSmallM>(p, splits, &counters_offset) + 255) / 256 * 256;
  return *column_offset + column_sum_bytes(p, partial_rows<kSmallM>(p));
}

template <typename T, typename TC, bool kSmallM, bool kTransA, bool kTransB>
cudaError_t launch(const GemmParams& p, int splits, const Workspace& workspace, cudaStream_t stream) {
  using C = Config<kSmallM, kTransA, kTransB>;
  using Tile = typename C::Tile;
  CUtensorMap map_a, map_b, map_c{}, map_aux{};
  HopperGemmArgs args;
  if (cudaError_t e = make_hopper_args(p, Tile::kBM, &map_a, &map_b, &args, &map_c, &map_aux); e != cudaSuccess)
    return e;
  const void* kernel = kernel_ptr<T, TC, kSmallM, kTransA, kTransB>();
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kSmemBytes);
      e != cudaSuccess)
    return e;
  typename C::Scheduler sched{static_cast<int>(ceil_div(p.m, int64_t(Tile::kBM))),
                              static_cast<int>(ceil_div(p.n, int64_t(Tile::kBN))), p.batch, splits};
  if (!sched.fits()) return cudaErrorInvalidConfiguration;
  size_t column_offset = 0;
  if (workspace.bytes < scratch_bytes<kSmallM>(p, splits, &column_offset) ||
      ((splits > 1 || p.epi.column_sums) && workspace.data == nullptr))
    return cudaErrorInvalidValue;
  if (p.epi.column_sums)
    args.column_partials = reinterpret_cast<float*>(static_cast<char*>(workspace.data) + column_offset);
  if (splits > 1) {
    size_t counters_offset = 0;
    const size_t need = split_bytes<kSmallM>(p, splits, &counters_offset);
    args.splits = splits;
    args.tiles_n = sched.tiles_n;
    args.slot_rows = static_cast<int>(p.m < Tile::kBM ? p.m : Tile::kBM);
    args.partials = static_cast<float*>(workspace.data);
    args.counters = reinterpret_cast<unsigned*>(static_cast<char*>(workspace.data) + counters_offset);
    if (cudaError_t e = cudaMemsetAsync(args.counters, 0, need - counters_offset, stream); e != cudaSuccess) return e;
  }
  ClusterLaunch grid(C::kCluster, C::Shape::kThreads, Tile::kSmemBytes, stream);
  if (cudaError_t e = grid.size_grid(kernel, sched.total()); e != cudaSuccess) return e;
  if (cudaError_t e = cudaLaunchKernelEx(
          &grid.config, &gemm_wgmma_ws_kernel<T, TC, Tile, C::kConsumers, typename C::Scheduler, C::kCluster, true>,
          map_a, map_b, map_c, map_aux, args, sched);
      e != cudaSuccess)
    return e;
  return p.epi.column_sums ? finish_column_sums(p, args.column_partials, partial_rows<kSmallM>(p), stream)
                           : cudaSuccess;
}

}  // namespace

cudaError_t gemm_wgmma_persistent(const GemmParams& p, const Workspace& workspace, cudaStream_t stream) {
  const GemmHopperPlan plan = plan_for(p);
  const Staging st = staging_for(p);
  GemmParams q = p;
  Workspace rest = workspace;  // after the staged copies: split-K's scratch
  if (st.bytes > 0) {
    if (workspace.data == nullptr || workspace.bytes < st.bytes) return cudaErrorInvalidValue;
    if (cudaError_t e = stage(p, st, workspace.data, stream, &q); e != cudaSuccess) return e;
    rest = {static_cast<char*>(workspace.data) + st.bytes, workspace.bytes - st.bytes};
  }
  return dispatch_half_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return dispatch_c_dtype<T>(p, [&]<typename TC>() -> cudaError_t {
      return dispatch_layout(q, [&]<bool kTransA, bool kTransB>() {
        return plan.small_m ? launch<T, TC, true, kTransA, kTransB>(q, plan.splits, rest, stream)
                            : launch<T, TC, false, kTransA, kTransB>(q, plan.splits, rest, stream);
      });
    });
  });
}

cudaError_t gemm_wgmma_persistent_workspace(const GemmParams& p, size_t* bytes) {
  const GemmHopperPlan plan = plan_for(p);
  size_t column_offset = 0;
  *bytes = staging_for(p).bytes + (plan.small_m ? scratch_bytes<true>(p, plan.splits, &column_offset)
                                                : scratch_bytes<false>(p, plan.splits, &column_offset));
  return cudaSuccess;
}

cudaError_t gemm_wgmma_persistent_resources(const GemmParams& p, KernelResources* out) {
  const GemmHopperPlan plan = plan_for(p);
  return dispatch_half_dtype(p.dtype, [&]<typename T>() -> cudaError_t {
    return dispatch_c_dtype<T>(p, [&]<typename TC>() -> cudaError_t {
      return dispatch_layout(p, [&]<bool kTransA, bool kTransB>() -> cudaError_t {
        const auto describe = [&]<bool kSmallM>() -> cudaError_t {
          using C = Config<kSmallM, kTransA, kTransB>;
          const void* kernel = kernel_ptr<T, TC, kSmallM, kTransA, kTransB>();
          if (cudaError_t e =
                  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::Tile::kSmemBytes);
              e != cudaSuccess)
            return e;
          return describe_kernel(kernel, kernel_name<T, TC, kSmallM, kTransA, kTransB>().c_str(), C::Shape::kThreads,
                                 C::Tile::kSmemBytes, out);
        };
        return plan.small_m ? describe.template operator()<true>() : describe.template operator()<false>();
      });
    });
  });
}

}  // namespace optimized::cuda
