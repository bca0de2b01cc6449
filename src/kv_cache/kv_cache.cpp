// Public entry of the KV-cache family (include/optimized/kv_cache.h): validates the operands of
// append_kv and paged_attention_decode (messages name the argument, what was expected and what was
// given), checks the page tables with `validate` (host read-back), fills KvAppendParams /
// KvDecodeParams, resolves the variant and dispatches through the variant table
// (kv_cache_variants.h): the cpu rung on the host, the CUDA rungs through launch_on_cuda (append_kv
// on CUDA runs the one append launcher). plan_paged_decode / the plan overload of
// paged_attention_decode: the split and workspace chosen once, a step that neither allocates nor
// synchronizes (with validate off, or under capture where the read-back is skipped).
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/arg_checks.h"
#include "core/workspace.h"
#include "kv_cache/kv_cache_config.h"
#include "kv_cache/kv_cache_params.h"
#include "kv_cache/kv_cache_variants.h"
#include "optimized/attention.h"
#include "optimized/kv_cache.h"

#if OPTIMIZED_WITH_CUDA
#include <cuda_runtime.h>

#include "core/cuda_device_guard.h"
#include "core/cuda_launch.h"
#include "core/device_facts.h"
#include "kv_cache/launchers.h"
#endif

namespace optimized {

namespace {

using arg::dname;
using arg::invalid;
using arg::number;
using arg::present;
using arg::shape_string;
using arg::unsupported;

std::string dims_string(std::initializer_list<int64_t> dims) {
  std::string s = "(";
  bool first = true;
  for (int64_t d : dims) s += (first ? "" : ", ") + std::to_string(d), first = false;
  return s + ")";
}


bool float_data(DType d) { return d == DType::kF32 || d == DType::kF16 || d == DType::kBF16 || d == DType::kF64; }

// Collects the operands of one call: one device for all, outputs distinct from every other operand.
// The call's operands (core/arg_checks.h's OperandSet: device, extent, alignment, overlaps), each
// first checked for its rank; k_pages and v_pages may share one allocation (interleaved, as vLLM's
// (num_pages, 2, ...) cache) and are not checked against each other.
class Operands : public arg::OperandSet {
 public:
  void view(const TensorView& t, const char* name, int rank, const char* layout, bool output) {
    if (t.rank != rank)
      invalid(std::string(name) + ": expected rank " + std::to_string(rank) + " " + layout + "; given rank " +
              std::to_string(t.rank) + (t.rank == 0 ? " (absent)" : " " + shape_string(t)));
    add(t, name, output);
  }

  void unit_last(const TensorView& t, const char* name, const char* what) {
    if (t.shape[t.rank - 1] > 1 && t.strides[t.rank - 1] != 1)
      invalid(std::string(name) + ": expected unit stride in the last dimension (" + what + "); given " + t.describe());
  }

  void check_overlaps() const { OperandSet::check_overlaps(&pages_pair); }

 private:
  static bool pages_pair(const char* a, const char* b) {
    const std::string x = a, y = b;
    return (x == "k_pages" && y == "v_pages") || (x == "v_pages" && y == "k_pages");
  }
};

// The cache: k_pages / v_pages (num_pages, page_size, H_kv, D), one shape and dtype; fp8 scales.
KvCachePages check_cache(const PagedKVCacheView& c, Operands& ops, bool output) {
  const char* layout = "(num_pages, page_size, heads_kv, head_dim)";
  ops.view(c.k_pages, "k_pages", 4, layout, output);
  ops.view(c.v_pages, "v_pages", 4, layout, output);
  const TensorView& k = c.k_pages;
  const DType dt = k.dtype;
  if (!float_data(dt) && dt != DType::kF8E4M3)
    unsupported("k_pages: expected dtype fp16, bf16, fp32, fp64 (cpu) or fp8_e4m3; given " + dname(dt));
  if (c.v_pages.dtype != dt)
    invalid("v_pages: expected dtype " + dname(dt) + " (k_pages'); given " + dname(c.v_pages.dtype));
  for (int i = 0; i < 4; ++i)
    if (c.v_pages.shape[i] != k.shape[i])
      invalid("v_pages: expected shape " + shape_string(k) + " (k_pages'); given " + shape_string(c.v_pages));
  if (k.shape[1] < 1 || k.shape[1] > 256)
    invalid("k_pages: expected a page_size (dimension 1) from 1 to 256; given " + std::to_string(k.shape[1]));
  if (k.shape[2] < 1 || k.shape[3] < 1)
    invalid("k_pages: expected heads_kv >= 1 and head_dim >= 1; given " + shape_string(k));
  ops.unit_last(k, "k_pages", "head_dim");
  ops.unit_last(c.v_pages, "v_pages", "head_dim");
  if (k.data && k.data == c.v_pages.data && k.shape[0] > 0)
    invalid("v_pages: expected memory distinct from k_pages; given the same data pointer");
  KvCachePages p;
  p.dtype = dt;
  p.num_pages = k.shape[0], p.page_size = k.shape[1], p.heads_kv = k.shape[2], p.head_dim = k.shape[3];
  p.k_pages = k.data, p.v_pages = c.v_pages.data;
  p.k_page = k.strides[0], p.k_slot = k.strides[1], p.k_head = k.strides[2];
  p.v_page = c.v_pages.strides[0], p.v_slot = c.v_pages.strides[1], p.v_head = c.v_pages.strides[2];
  const bool fp8 = dt == DType::kF8E4M3;
  for (const auto& [t, name] : {std::pair<const TensorView*, const char*>{&c.k_scale, "k_scale"}, {&c.v_scale, "v_scale"}}) {
    if (!fp8) {
      if (present(*t))
        invalid(std::string(name) + ": expected absent (scales belong to an fp8_e4m3 cache); given " + t->describe() +
                " with a " + dname(dt) + " cache");
      continue;
    }
    if (!present(*t)) invalid(std::string(name) + ": required with an fp8_e4m3 cache (fp32 (heads_kv)); given absent");
    ops.view(*t, name, 1, "(heads_kv)", false);
    if (t->dtype != DType::kF32) invalid(std::string(name) + ": expected dtype fp32; given " + dname(t->dtype));
    if (t->shape[0] != p.heads_kv)
      invalid(std::string(name) + ": expected shape (" + std::to_string(p.heads_kv) + ") (heads_kv); given " +
              shape_string(*t));
    ops.unit_last(*t, name, "heads_kv");
  }
  if (fp8) {
    p.k_scale = static_cast<const float*>(c.k_scale.data);
    p.v_scale = static_cast<const float*>(c.v_scale.data);
  }
  return p;
}

// The dtype of q / k / v / out against the cache's: the cache's, or fp16 / bf16 / fp32 into fp8.
void check_data_dtype(const TensorView& t, const char* name, DType cache) {
  const DType d = t.dtype;
  if (!float_data(d))
    unsupported(std::string(name) + ": expected dtype fp16, bf16, fp32 (fp64 on the cpu variant); given " + dname(d));
  if (cache == DType::kF8E4M3) {
    if (d == DType::kF64)
      unsupported(std::string(name) + ": expected dtype fp16, bf16 or fp32 with an fp8_e4m3 cache; given fp64");
  } else if (d != cache) {
    invalid(std::string(name) + ": expected dtype " + dname(cache) + " (the cache's); given " + dname(d));
  }
}

void check_shape(const TensorView& t, const char* name, std::initializer_list<int64_t> want, const char* whose) {
  size_t i = 0;
  for (int64_t w : want)
    if (t.shape[i++] != w)
      invalid(std::string(name) + ": expected shape " + dims_string(want) + " (" + whose + "); given " + shape_string(t));
}

// page_table int32 (B, max_pages), unit stride along the pages.
KvPageTable check_table(const TensorView& t, Operands& ops, int64_t batch) {
  ops.view(t, "page_table", 2, "(batch, max_pages)", false);
  if (t.dtype != DType::kI32) invalid("page_table: expected dtype int32; given " + dname(t.dtype));
  if (t.shape[0] != batch)
    invalid("page_table: expected " + std::to_string(batch) + " rows (batch); given " + shape_string(t));
  ops.unit_last(t, "page_table", "pages");
  KvPageTable p;
  p.entries = static_cast<const int32_t*>(t.data);
  p.batch = t.shape[0], p.max_pages = t.shape[1], p.row = t.strides[0];
  return p;
}

// An int32 operand as host memory: itself on the CPU; on CUDA a copy read back on the context's
// stream (empty: nothing read, the stream is capturing or no device can be used). Returns the
// pointer to element 0 of the view.
const int32_t* host_ints(const TensorView& t, Device device, const ExecutionContext& ctx, std::vector<int32_t>& copy,
                         const char* name) {
  if (!device.is_cuda()) return static_cast<const int32_t*>(t.data);
  const ViewExtent e = view_extent(t, name);
  if (e.numel == 0) return nullptr;
#if OPTIMIZED_WITH_CUDA
  if (cuda_device_count() == 0) return nullptr;
  DeviceGuard guard(device.index);
  const auto stream = static_cast<cudaStream_t>(ctx.cuda_stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing (kv_cache validate)");
  if (capture != cudaStreamCaptureStatusNone) return nullptr;
  const int64_t count = e.highest - e.lowest + 1;
  copy.resize(static_cast<size_t>(count));
  check_cuda(cudaMemcpyAsync(copy.data(), static_cast<const int32_t*>(t.data) + e.lowest,
                             static_cast<size_t>(count) * sizeof(int32_t), cudaMemcpyDeviceToHost, stream),
             "cudaMemcpyAsync (kv_cache validate)");
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize (kv_cache validate)");
  return copy.data() - e.lowest;
#else
  (void)ctx, (void)copy;
  return nullptr;
#endif
}

void check_rope(const RopeOptions& r, int64_t head_dim, KvAppendParams& p) {
  if (r.layout != RopeLayout::kNone && r.layout != RopeLayout::kNeox && r.layout != RopeLayout::kInterleaved)
    invalid("rope.layout: expected kNone, kNeox or kInterleaved; given " + std::to_string(static_cast<int>(r.layout)));
  p.rope = r.layout;
  if (r.layout == RopeLayout::kNone) return;
  if (!std::isfinite(r.theta) || !(r.theta > 0)) invalid("rope.theta: expected a finite value > 0; given " + number(r.theta));
  const int64_t rd = r.rotary_dim == 0 ? head_dim : r.rotary_dim;
  if (rd < 2 || rd % 2 != 0 || rd > head_dim)
    invalid("rope.rotary_dim: expected 0 (head_dim) or an even value from 2 to head_dim " + std::to_string(head_dim) +
            "; given " + std::to_string(r.rotary_dim) + (r.rotary_dim == 0 ? " (head_dim is odd or < 2)" : ""));
  p.rope_theta = r.theta;
  p.rotary_dim = rd;
}

// Why paged_mma cannot run a decode (empty: it can): q's dtype, the head dim, and (c given: a call,
// not a plan) the alignment of the cache rows its 16-byte copies read.
std::string mma_rejects(DType dtype, int64_t head_dim, const KvCachePages* c) {
  if (dtype != DType::kF16 && dtype != DType::kBF16)
    return "takes fp16 or bf16 q (the tensor cores' inputs); given " + dname(dtype);
  if (!kv_cache_config::mma_head_dim(head_dim))
    return "takes head_dim 64, 128 or 256; given " + std::to_string(head_dim);
  if (c) {
    const int64_t vec = c->dtype == DType::kF8E4M3 ? 16 : 8;  // elements of 16 bytes
    const bool ok = reinterpret_cast<uintptr_t>(c->k_pages) % 16 == 0 && reinterpret_cast<uintptr_t>(c->v_pages) % 16 == 0 &&
                    c->k_page % vec == 0 && c->k_slot % vec == 0 && c->k_head % vec == 0 && c->v_page % vec == 0 &&
                    c->v_slot % vec == 0 && c->v_head % vec == 0;
    if (!ok)
      return "reads cache rows in 16-byte copies: expected k_pages and v_pages 16-byte aligned with page, slot "
             "and head strides multiples of " +
             std::to_string(vec) + " elements; given k strides (" + std::to_string(c->k_page) + ", " +
             std::to_string(c->k_slot) + ", " + std::to_string(c->k_head) + "), v strides (" + std::to_string(c->v_page) +
             ", " + std::to_string(c->v_slot) + ", " + std::to_string(c->v_head) + ")";
  }
  return {};
}

// Resolves the variant and refuses a device or build it cannot run on (dtypes: check_variant_dtype,
// for decode); returns the row to run. auto on CUDA: paged_mma where it runs (mma_fits), paged_split
// elsewhere.
const KvCacheVariantInfo& resolve(KvCacheVariant variant, Device device, bool mma_fits = false) {
  if (variant == KvCacheVariant::kAuto) {
    if (device.is_cuda()) {
#if !OPTIMIZED_WITH_CUDA
      unsupported("variant: this build has no CUDA (configure with CUDA to run the kv_cache CUDA rungs); given tensors on " +
                  device_name(device));
#endif
      variant = mma_fits ? KvCacheVariant::kPagedMma : KvCacheVariant::kPagedSplit;
    } else {
      variant = KvCacheVariant::kCpu;
    }
  }
  const KvCacheVariantInfo& row = kv_cache_variant_info(variant);
  if (std::string why = variant_rejects_device(row, device); !why.empty()) invalid(why);
#if !OPTIMIZED_WITH_CUDA
  if (row.backend == Backend::kCuda)
    unsupported("variant: " + std::string(row.name) + " needs a CUDA build; this build has none");
#endif
  return row;
}

// The decode rungs' dtypes (append runs one kernel for every CUDA variant and checks its own).
void check_variant_dtype(const KvCacheVariantInfo& row, DType dtype, const char* data_name) {
  if (std::string why = kv_cache_variant_rejects_dtype(row.variant, dtype); !why.empty())
    unsupported(std::string(data_name) + ": " + why);
}

// The CUDA rungs hold fp32 rows of head_dim in shared memory: up to kv_cache_config::kMaxHeadDim.
void check_cuda_head_dim(Device device, int64_t head_dim) {
#if OPTIMIZED_WITH_CUDA
  if (device.is_cuda() && head_dim > kv_cache_config::kMaxHeadDim)
    unsupported("k_pages: the CUDA variants take head_dim up to " + std::to_string(kv_cache_config::kMaxHeadDim) +
                "; given " + std::to_string(head_dim));
#else
  (void)device, (void)head_dim;
#endif
}

void check_variant_value(KvCacheVariant v) {
  if (v != KvCacheVariant::kAuto && !find_variant(kKvCacheVariants, v))
    invalid("variant: expected one of " + variant_choices(kKvCacheVariants) + "; given value " +
            std::to_string(static_cast<int>(v)));
}

}  // namespace

// ---- append ---------------------------------------------------------------------------------

void append_kv(const PagedKVCacheView& cache, const TensorView& k, const TensorView& v, const TensorView& page_table,
               const TensorView& positions, const TensorView& q, const RopeOptions& rope, bool validate,
               KvCacheVariant variant, const ExecutionContext& ctx) {
  check_variant_value(variant);
  Operands ops;
  const char* data_layout = "(batch, new_tokens, heads, head_dim)";
  ops.view(k, "k", 4, data_layout, false);
  KvAppendParams p;
  p.cache = check_cache(cache, ops, true);
  const KvCachePages& c = p.cache;
  check_data_dtype(k, "k", c.dtype);
  const int64_t B = k.shape[0], S = k.shape[1];
  if (k.shape[2] != c.heads_kv || k.shape[3] != c.head_dim)
    invalid("k: expected shape (" + std::to_string(B) + ", " + std::to_string(S) + ", " + std::to_string(c.heads_kv) +
            ", " + std::to_string(c.head_dim) + ") (heads_kv and head_dim of the cache); given " + shape_string(k));
  ops.unit_last(k, "k", "head_dim");
  ops.view(v, "v", 4, data_layout, false);
  if (v.dtype != k.dtype) invalid("v: expected dtype " + dname(k.dtype) + " (k's); given " + dname(v.dtype));
  check_shape(v, "v", {B, S, c.heads_kv, c.head_dim}, "k's");
  ops.unit_last(v, "v", "head_dim");
  p.table = check_table(page_table, ops, B);
  ops.view(positions, "positions", 2, "(batch, new_tokens)", false);
  if (positions.dtype != DType::kI32) invalid("positions: expected dtype int32; given " + dname(positions.dtype));
  check_shape(positions, "positions", {B, S}, "k's batch and new_tokens");
  ops.unit_last(positions, "positions", "new_tokens");
  if (present(q)) {
    ops.view(q, "q", 4, data_layout, true);
    if (q.dtype != k.dtype) invalid("q: expected dtype " + dname(k.dtype) + " (k's); given " + dname(q.dtype));
    if (q.shape[0] != B || q.shape[1] != S || q.shape[3] != c.head_dim || q.shape[2] < 1 || q.shape[2] % c.heads_kv != 0)
      invalid("q: expected shape (" + std::to_string(B) + ", " + std::to_string(S) + ", H_q, " +
              std::to_string(c.head_dim) + ") with H_q a multiple of heads_kv " + std::to_string(c.heads_kv) +
              "; given " + shape_string(q));
    ops.unit_last(q, "q", "head_dim");
    p.q = q.data, p.q_b = q.strides[0], p.q_s = q.strides[1], p.q_h = q.strides[2], p.heads_q = q.shape[2];
  }
  check_rope(rope, c.head_dim, p);
  ops.check_overlaps();
  p.dtype = k.dtype;
  p.new_tokens = S;
  p.k = k.data, p.v = v.data;
  p.k_b = k.strides[0], p.k_s = k.strides[1], p.k_h = k.strides[2];
  p.v_b = v.strides[0], p.v_s = v.strides[1], p.v_h = v.strides[2];
  p.positions = static_cast<const int32_t*>(positions.data);
  p.pos_b = positions.strides[0];
  const Device device = ops.device();
  if (device.is_cuda() && p.dtype == DType::kF64)
    unsupported("k: fp64 runs on the cpu variant only; given fp64 on " + device_name(device));

  if (validate && B * S > 0) {
    std::vector<int32_t> table_copy, pos_copy;
    const int32_t* table = host_ints(page_table, device, ctx, table_copy, "page_table");
    const int32_t* pos = host_ints(positions, device, ctx, pos_copy, "positions");
    if (pos) {
      std::unordered_map<int64_t, int64_t> slots;  // page * page_size + slot -> token b * S + s
      for (int64_t b = 0; b < B; ++b)
        for (int64_t s = 0; s < S; ++s) {
          const int64_t at = pos[b * p.pos_b + s];
          if (at < 0) continue;
          const int64_t page_index = at / c.page_size;
          const std::string token = "token (" + std::to_string(b) + ", " + std::to_string(s) + ")";
          if (page_index >= p.table.max_pages)
            invalid("positions: " + token + " at position " + std::to_string(at) + " needs page index " +
                    std::to_string(page_index) + " of its sequence; page_table has " +
                    std::to_string(p.table.max_pages) + " pages per sequence");
          if (!table) continue;
          const int64_t page = table[b * p.table.row + page_index];
          if (page < 0 || page >= c.num_pages)
            invalid("page_table: expected page indices in [0, " + std::to_string(c.num_pages) + ") (num_pages); " +
                    "page_table[" + std::to_string(b) + "][" + std::to_string(page_index) + "] = " +
                    std::to_string(page) + " (used by " + token + ")");
          const int64_t key = page * c.page_size + at % c.page_size;
          const auto [it, fresh] = slots.emplace(key, b * S + s);
          if (!fresh)
            invalid("positions: expected every appended token to write its own cache slot; tokens (" +
                    std::to_string(it->second / S) + ", " + std::to_string(it->second % S) + ") and (" +
                    std::to_string(b) + ", " + std::to_string(s) + ") both write page " + std::to_string(page) +
                    ", slot " + std::to_string(at % c.page_size));
        }
    }
  }
  const KvCacheVariantInfo& row = resolve(variant, device);
  if (B * S == 0) return;
  if (row.backend == Backend::kCpu) return row.cpu.append(p, ctx.cpu_threads);
#if OPTIMIZED_WITH_CUDA
  check_cuda_head_dim(device, c.head_dim);
  // One append kernel serves every CUDA variant: a row of the variant's facts with its launcher.
  struct AppendRow {
    std::string_view name;
    int min_compute_capability;
    ArchRule arch;
    LauncherFn<KvAppendParams> launch;
    std::nullptr_t workspace;
  };
  const AppendRow append_row{row.name, row.min_compute_capability, row.arch, &cuda::kv_cache_append, nullptr};
  launch_on_cuda(append_row, p, device.index, ctx, "append_kv (" + std::string(row.name) + ")");
#endif
}

// ---- decode ---------------------------------------------------------------------------------

namespace {

// A planned call must have the plan's shape, dtypes, page size, device and variant.
void check_fits_plan(const DecodePlan& plan, const KvCacheVariantInfo& row, const KvDecodeParams& p,
                     const KvCachePages& c, Device device) {
  auto fit = [](bool ok, const std::string& name, const std::string& what, int64_t want, int64_t given) {
    if (!ok)
      invalid(name + ": expected " + what + " " + std::to_string(want) + " (the plan's); given " + std::to_string(given));
  };
  fit(p.batch == plan.batch, "q", "batch", plan.batch, p.batch);
  fit(p.heads_q == plan.heads_q, "q", "heads_q", plan.heads_q, p.heads_q);
  fit(p.q_len == plan.q_len, "q", "q_len", plan.q_len, p.q_len);
  fit(c.heads_kv == plan.heads_kv, "k_pages", "heads_kv", plan.heads_kv, c.heads_kv);
  fit(c.head_dim == plan.head_dim, "k_pages", "head_dim", plan.head_dim, c.head_dim);
  fit(c.page_size == plan.page_size, "k_pages", "page_size", plan.page_size, c.page_size);
  if (p.dtype != plan.dtype) invalid("q: expected dtype " + dname(plan.dtype) + " (the plan's); given " + dname(p.dtype));
  if (c.dtype != plan.cache_dtype)
    invalid("k_pages: expected dtype " + dname(plan.cache_dtype) + " (the plan's); given " + dname(c.dtype));
  if (!(device == plan.device))
    invalid("q: expected device " + device_name(plan.device) + " (the plan's); given " + device_name(device));
  if (row.variant != plan.variant)
    invalid("plan: its variant " + std::string(kv_cache_variant_name(plan.variant)) + " does not resolve to itself");
  if (plan.splits < 1) invalid("plan: expected splits >= 1; given " + std::to_string(plan.splits));
}

// The workspace and split of a CUDA decode (the plan's rule, kv_cache_config.h).
#if OPTIMIZED_WITH_CUDA
// p: the shape fields (dtype, batch, q_len, heads_q, the cache's dtype, heads_kv, head_dim); the
// current device is `device`.
int64_t device_splits(const KvCacheVariantInfo& row, int device, const KvDecodeParams& p, int64_t max_seq_len) {
  if (row.variant == KvCacheVariant::kPagedMma) {
    int64_t splits = 1;
    check_cuda(cuda::kv_cache_paged_mma_splits(p, max_seq_len, &splits), "paged_mma's split (occupancy query)");
    return splits;
  }
  if (row.variant != KvCacheVariant::kPagedSplit) return 1;
  const DeviceFacts* facts = nullptr;
  check_cuda(device_facts(device, &facts), "cudaDeviceGetAttribute (device facts)");
  return kv_cache_config::decode_splits(p.batch, p.cache.heads_kv, max_seq_len, facts->sm_count);
}
#endif

// Whether prefill with variant auto runs on the attention family's forward
// (kv_cache_config::kPrefillAttentionMinChunk): a chunk that long, and on CUDA fp16 / bf16 q with a
// head dim flash2 is compiled for (the CPU's attention rung takes every dtype and head dim).
// Whether t (B, S, H, D) already is varlen's (B * S, H, D) rows: one sequence, or a batch stride of
// S rows (any row and head strides).
bool packed(const TensorView& t) { return t.shape[0] == 1 || t.strides[0] == t.shape[1] * t.strides[1]; }
// Whether t can be copied into them by one strided 2-D copy: each sequence's (S, H, D) block
// contiguous, blocks apart by at least their size (a slice of a longer prompt along S).
bool blocks_contiguous(const TensorView& t) {
  return t.strides[2] == t.shape[3] && t.strides[1] == t.shape[2] * t.shape[3] &&
         t.strides[0] >= t.shape[1] * t.strides[1];
}

// `len`: the gather's rows per sequence (prefill_through_attention). q and out must be varlen's
// packed (B * S_new, H_q, D) rows or copyable into them (packed / blocks_contiguous); the packed
// rows fit varlen's 32-bit offsets.
bool prefill_on_attention(const KvDecodeParams& p, const TensorView& q, const TensorView& out, Device device,
                          int64_t len) {
  if (p.q_len < kv_cache_config::kPrefillAttentionMinChunk) return false;
  if (len < 1) return false;  // no key anywhere: the rung writes the zeros
  constexpr int64_t k31 = int64_t{1} << 31;
  if (p.batch * len >= k31 || p.batch * p.q_len >= k31) return false;
  for (const TensorView* t : {&q, &out})
    if (!packed(*t) && !blocks_contiguous(*t)) return false;
  if (!device.is_cuda()) return p.dtype != DType::kF64;  // (fp64's lse is fp32 here, attention's fp64)
  if (p.dtype != DType::kF16 && p.dtype != DType::kBF16) return false;
  for (int d : attention_head_dims())
    if (d == p.cache.head_dim) return true;
  return false;
}

// Prefill on attention_varlen_forward (flash2 on CUDA, its cpu rung on the host): the sequences'
// K/V gathered into packed buffers of q's dtype (B * len rows at most; on the host, where seq_lens is
// read, exactly their sum) with cu_seqlens written beside them (a call workspace on CUDA, host memory
// on the CPU), q and out packed as (B * S_new, H_q, D) views, then causal bottom-right attention with
// decode's options: varlen puts the chunk's query t of sequence b at t + L_b - S_new, its position.
// lse: varlen writes (H_q, B * S_new); for B > 1 into a buffer unpacked into the caller's view after.
// A q or out whose sequences' blocks are not back to back (a slice of a longer prompt) is copied
// into (q) or out of (out) a packed buffer: one strided 2-D copy of B blocks each.
void prefill_through_attention(const TensorView& q, const TensorView& out, const TensorView& lse, const DecodeOptions& o,
                               const KvDecodeParams& p, Device device, const ExecutionContext& ctx, int64_t len) {
  const KvCachePages& c = p.cache;
  const std::string what = "paged_attention_prefill (auto: gather + attention_varlen_forward)";
  const int64_t B = p.batch, S = p.q_len, Hq = p.heads_q, D = c.head_dim;
  int64_t kv_rows = B * len;
  if (!device.is_cuda()) {  // the CPU's varlen checks the offsets: the buffers hold exactly the keys
    kv_rows = 0;
    for (int64_t b = 0; b < B; ++b) kv_rows += std::clamp<int64_t>(p.seq_lens[b], 0, len);
  }
  const bool lse_buffer = present(lse) && B > 1;
  const int64_t block_bytes = S * Hq * D * static_cast<int64_t>(dtype_size(p.dtype));  // one sequence's q / out
  const bool q_buffer = !packed(q), out_buffer = !packed(out);
  void* q_rows = nullptr;  // the packed copies, when taken
  void* out_rows = nullptr;
  KvGatherParams g;
  g.cache = c, g.table = p.table, g.seq_lens = p.seq_lens, g.dtype = p.dtype, g.batch = B, g.len = len, g.q_len = S;
  float* lse_packed = nullptr;
  auto carve = [&](WorkspaceArena& arena) {
    const int64_t kv_elems = kv_rows * c.heads_kv * D;
    g.k_out = arena.take<unsigned char>(kv_elems * static_cast<int64_t>(dtype_size(p.dtype)));
    g.v_out = arena.take<unsigned char>(kv_elems * static_cast<int64_t>(dtype_size(p.dtype)));
    g.cu_q = arena.take<int32_t>(B + 1), g.cu_k = arena.take<int32_t>(B + 1);
    if (lse_buffer) lse_packed = arena.take<float>(Hq * B * S);
    if (q_buffer) q_rows = arena.take<unsigned char>(B * block_bytes);
    if (out_buffer) out_rows = arena.take<unsigned char>(B * block_bytes);
  };
  WorkspaceArena sizing;
  carve(sizing);
  const size_t total = sizing.peak();
  auto attend = [&](const ExecutionContext& actx) {
    const TensorView k(g.k_out, p.dtype, device, {kv_rows, c.heads_kv, D});
    const TensorView v(g.v_out, p.dtype, device, {kv_rows, c.heads_kv, D});
    const auto rows = [&](const TensorView& t, void* data, bool copy) {  // t's rows, or their packed copy
      return copy ? TensorView(data, t.dtype, device, {B * S, Hq, D})
                  : TensorView(t.data, t.dtype, device, {B * S, Hq, D}, {t.strides[1], t.strides[2], 1});
    };
    const TensorView qv = rows(q, q_rows, q_buffer), ov = rows(out, out_rows, out_buffer);
    const TensorView cu_q(g.cu_q, DType::kI32, device, {B + 1});
    const TensorView cu_k(g.cu_k, DType::kI32, device, {B + 1});
    TensorView lv;
    if (lse_buffer) lv = TensorView(lse_packed, DType::kF32, device, {Hq, B * S});
    else if (present(lse)) lv = TensorView(lse.data, DType::kF32, device, {Hq, S}, {lse.strides[1], 1});
    AttentionOptions ao;
    ao.softmax_scale = p.scale;
    ao.causal = true;
    ao.alignment = CausalAlignment::kBottomRight;
    ao.window_left = p.window_left;
    ao.softcap = p.softcap;
    ao.alibi_slopes = o.alibi_slopes;
    ao.check_cu_seqlens = false;  // written by the gather, bounded by construction
    attention_varlen_forward(qv, k, v, cu_q, cu_k, S, len, ov, lv, ao, AttentionVariant::kAuto, actx);
  };
  if (device.is_cuda()) {
#if OPTIMIZED_WITH_CUDA
    DeviceGuard guard(device.index);
    const auto stream = static_cast<cudaStream_t>(ctx.cuda_stream);
    CallWorkspace ws(ctx, total, what, device.index, stream);
    WorkspaceArena arena(ws.get());
    carve(arena);
    const auto es = static_cast<int64_t>(dtype_size(p.dtype));
    if (q_buffer)
      check_cuda(cudaMemcpy2DAsync(q_rows, block_bytes, q.data, q.strides[0] * es, block_bytes, B,
                                   cudaMemcpyDeviceToDevice, stream),
                 what + ": packing q");
    check_cuda(cuda::kv_cache_gather(g, stream), what + ": gather");
    ExecutionContext actx = ctx;
    actx.workspace = {};  // (ours holds the buffers; attention takes its own when it needs one)
    attend(actx);
    if (out_buffer)
      check_cuda(cudaMemcpy2DAsync(out.data, out.strides[0] * es, out_rows, block_bytes, block_bytes, B,
                                   cudaMemcpyDeviceToDevice, stream),
                 what + ": unpacking out");
    if (lse_buffer)
      check_cuda(cuda::kv_cache_lse_unpack(lse_packed, p.lse, B, Hq, S, p.lse_b, p.lse_h, stream), what + ": lse");
    ws.release(what);
#endif
    return;
  }
  std::vector<std::max_align_t> host((total + sizeof(std::max_align_t) - 1) / sizeof(std::max_align_t));
  WorkspaceArena arena(Workspace{host.data(), total});
  carve(arena);
  const auto es = static_cast<int64_t>(dtype_size(p.dtype));
  for (int64_t b = 0; q_buffer && b < B; ++b)
    std::memcpy(static_cast<char*>(q_rows) + b * block_bytes, static_cast<const char*>(q.data) + b * q.strides[0] * es,
                static_cast<size_t>(block_bytes));
  cpu_kv_gather(g, ctx.cpu_threads);
  attend(ctx);
  for (int64_t b = 0; out_buffer && b < B; ++b)
    std::memcpy(static_cast<char*>(out.data) + b * out.strides[0] * es, static_cast<const char*>(out_rows) + b * block_bytes,
                static_cast<size_t>(block_bytes));
  if (lse_buffer)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t r = 0; r < B * S; ++r) p.lse[(r / S) * p.lse_b + h * p.lse_h + r % S] = lse_packed[h * B * S + r];
}

void decode_impl(const TensorView& q, const PagedKVCacheView& cache, const TensorView& page_table,
                 const TensorView& seq_lens, const TensorView& out, const TensorView& lse, const DecodeOptions& o,
                 KvCacheVariant variant, const ExecutionContext& ctx, const DecodePlan* plan, bool prefill = false) {
  check_variant_value(variant);
  Operands ops;
  const char* data_layout = "(batch, q_len, heads_q, head_dim)";
  ops.view(q, "q", 4, data_layout, false);
  KvDecodeParams p;
  p.cache = check_cache(cache, ops, false);
  const KvCachePages& c = p.cache;
  check_data_dtype(q, "q", c.dtype);
  const int64_t B = q.shape[0], Q = q.shape[1], Hq = q.shape[2];
  if (prefill && Q < 1) invalid("q: expected S_new (dimension 1) >= 1; given " + shape_string(q));
  if (!prefill && (Q < 1 || Q > 8))
    invalid("q: expected q_len (dimension 1) from 1 to 8 (paged_attention_prefill takes longer chunks); given " +
            shape_string(q));
  if (q.shape[3] != c.head_dim)
    invalid("q: expected head_dim " + std::to_string(c.head_dim) + " (the cache's); given " + shape_string(q));
  if (Hq < 1 || Hq % c.heads_kv != 0)
    invalid("q: expected heads_q a multiple of the cache's heads_kv " + std::to_string(c.heads_kv) +
            " (GQA / MQA); given " + shape_string(q));
  ops.unit_last(q, "q", "head_dim");
  p.table = check_table(page_table, ops, B);
  ops.view(seq_lens, "seq_lens", 1, "(batch)", false);
  if (seq_lens.dtype != DType::kI32) invalid("seq_lens: expected dtype int32; given " + dname(seq_lens.dtype));
  check_shape(seq_lens, "seq_lens", {B}, "q's batch");
  if (B > 1 && seq_lens.strides[0] != 1) invalid("seq_lens: expected a contiguous vector; given " + seq_lens.describe());
  ops.view(out, "out", 4, data_layout, true);
  if (out.dtype != q.dtype) invalid("out: expected dtype " + dname(q.dtype) + " (q's); given " + dname(out.dtype));
  check_shape(out, "out", {B, Q, Hq, c.head_dim}, "q's");
  ops.unit_last(out, "out", "head_dim");
  if (present(lse)) {
    ops.view(lse, "lse", 3, "(batch, heads_q, q_len)", true);
    if (lse.dtype != DType::kF32) invalid("lse: expected dtype fp32; given " + dname(lse.dtype));
    check_shape(lse, "lse", {B, Hq, Q}, "q's batch, heads_q, q_len");
    ops.unit_last(lse, "lse", "q_len");
    p.lse = static_cast<float*>(lse.data), p.lse_b = lse.strides[0], p.lse_h = lse.strides[1];
  }
  // Options.
  if (std::isnan(o.softmax_scale)) p.scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  else if (!std::isfinite(o.softmax_scale))
    invalid("softmax_scale: expected a finite value (or NaN for 1/sqrt(head_dim)); given " + number(o.softmax_scale));
  else p.scale = o.softmax_scale;
  if (o.window_left < -1) invalid("window_left: expected -1 (unbounded) or >= 0; given " + std::to_string(o.window_left));
  if (!(o.softcap >= 0.0) || !std::isfinite(o.softcap))
    invalid("softcap: expected a finite value >= 0 (0: off); given " + number(o.softcap));
  if (q.dtype != DType::kF64) {
    if (std::fabs(p.scale) > std::numeric_limits<float>::max())
      invalid("softmax_scale: expected a value inside float's range for " + dname(q.dtype) + " inputs (fp32 math); given " +
              number(p.scale));
    if (o.softcap > 0 && (o.softcap > std::numeric_limits<float>::max() || o.softcap < std::numeric_limits<float>::min()))
      invalid("softcap: expected 0 (off) or a value inside float's normal range for " + dname(q.dtype) +
              " inputs (fp32 math); given " + number(o.softcap));
  }
  p.window_left = o.window_left > (int64_t{1} << 40) ? -1 : o.window_left;
  p.softcap = o.softcap;
  if (present(o.alibi_slopes)) {
    const TensorView& a = o.alibi_slopes;
    const bool one = a.rank == 1 && a.shape[0] == Hq;
    const bool two = a.rank == 2 && a.shape[0] == B && a.shape[1] == Hq;
    if (!one && !two)
      invalid("alibi_slopes: expected shape (" + std::to_string(Hq) + ") or (" + std::to_string(B) + ", " +
              std::to_string(Hq) + "); given " + shape_string(a));
    ops.view(a, "alibi_slopes", a.rank, "", false);
    if (a.dtype != DType::kF32) invalid("alibi_slopes: expected dtype fp32; given " + dname(a.dtype));
    ops.unit_last(a, "alibi_slopes", "heads_q");
    p.alibi = static_cast<const float*>(a.data);
    p.alibi_b = two ? a.strides[0] : 0;
  }
  ops.check_overlaps();
  p.dtype = q.dtype;
  p.batch = B, p.q_len = Q, p.heads_q = Hq;
  p.q = q.data, p.q_b = q.strides[0], p.q_t = q.strides[1], p.q_h = q.strides[2];
  p.out = out.data, p.out_b = out.strides[0], p.out_t = out.strides[1], p.out_h = out.strides[2];
  p.seq_lens = static_cast<const int32_t*>(seq_lens.data);
  const Device device = ops.device();
  if (device.is_cuda() && p.dtype == DType::kF64)
    unsupported("q: fp64 runs on the cpu variant only; given fp64 on " + device_name(device));

  // The rows per sequence of prefill's gather: the longest sequence when its length is read back
  // here, else the page table's capacity.
  int64_t gather_len = p.table.max_pages * c.page_size;
  if (o.validate && B > 0) {
    std::vector<int32_t> table_copy, lens_copy;
    const int32_t* lens = host_ints(seq_lens, device, ctx, lens_copy, "seq_lens");
    const int32_t* table = host_ints(page_table, device, ctx, table_copy, "page_table");
    const int64_t capacity = p.table.max_pages * c.page_size;
    if (lens) gather_len = 0;
    if (lens)
      for (int64_t b = 0; b < B; ++b) {
        const int64_t len = lens[b];
        gather_len = std::max(gather_len, std::min(std::max<int64_t>(len, 0), capacity));
        if (len < 0) invalid("seq_lens: expected lengths >= 0; seq_lens[" + std::to_string(b) + "] = " + std::to_string(len));
        if (!prefill && len > 0 && len < Q)
          invalid("seq_lens: expected 0 or at least q_len " + std::to_string(Q) + " (the new tokens are cached); seq_lens[" +
                  std::to_string(b) + "] = " + std::to_string(len));
        if (len > capacity)
          invalid("seq_lens: expected at most max_pages * page_size = " + std::to_string(capacity) +
                  " (the pages page_table provides); seq_lens[" + std::to_string(b) + "] = " + std::to_string(len));
        if (!table) continue;
        const int64_t used = (len + c.page_size - 1) / c.page_size;
        for (int64_t i = 0; i < used; ++i) {
          const int64_t page = table[b * p.table.row + i];
          if (page < 0 || page >= c.num_pages)
            invalid("page_table: expected page indices in [0, " + std::to_string(c.num_pages) + ") (num_pages); " +
                    "page_table[" + std::to_string(b) + "][" + std::to_string(i) + "] = " + std::to_string(page) +
                    " (sequence " + std::to_string(b) + " holds " + std::to_string(len) + " tokens)");
        }
      }
  }
  const std::string mma_why = mma_rejects(p.dtype, c.head_dim, &c);
  const KvCacheVariantInfo& row = resolve(variant, device, mma_why.empty());
  check_variant_dtype(row, p.dtype, "q");
  if (row.variant == KvCacheVariant::kPagedMma && !mma_why.empty()) unsupported("variant: " + std::string(row.name) + ": " + mma_why);
  if (plan) check_fits_plan(*plan, row, p, c, device);
  if (B == 0 || Hq == 0) return;
  if (prefill && variant == KvCacheVariant::kAuto && prefill_on_attention(p, q, out, device, gather_len))
    return prefill_through_attention(q, out, lse, o, p, device, ctx, gather_len);
  if (row.backend == Backend::kCpu) return row.cpu.decode(p, ctx.cpu_threads);
#if OPTIMIZED_WITH_CUDA
  check_cuda_head_dim(device, c.head_dim);
  const std::string what = "paged_attention_decode (" + std::string(row.name) + ")";
  if (plan) {
    if (plan->splits > kv_cache_config::kMaxSplits)
      invalid("plan: expected splits <= " + std::to_string(kv_cache_config::kMaxSplits) + "; given " +
              std::to_string(plan->splits));
    p.splits = plan->splits;
    // What the launch needs for the plan's split, asked of the launcher itself (a plan built or
    // edited by hand is not trusted): a planned step never allocates.
    DeviceGuard guard(device.index);
    const size_t need = launcher_workspace_bytes(row, p, what);
    if (need > 0 && (ctx.workspace.data == nullptr || ctx.workspace.bytes < need))
      invalid("workspace: expected ExecutionContext::workspace of at least " + std::to_string(need) +
              " bytes with a plan of " + std::to_string(plan->splits) +
              " splits (a planned step does not allocate; plan.workspace_bytes says how much); given " +
              (ctx.workspace.data ? std::to_string(ctx.workspace.bytes) + " bytes" : std::string("none")));
  } else {
    DeviceGuard guard(device.index);
    p.splits = device_splits(row, device.index, p, p.table.max_pages * c.page_size);
  }
  launch_on_cuda(row, p, device.index, ctx, what);
#endif
}

}  // namespace

void paged_attention_decode(const TensorView& q, const PagedKVCacheView& cache, const TensorView& page_table,
                            const TensorView& seq_lens, const TensorView& out, const TensorView& lse,
                            const DecodeOptions& options, KvCacheVariant variant, const ExecutionContext& ctx) {
  decode_impl(q, cache, page_table, seq_lens, out, lse, options, variant, ctx, nullptr);
}

void paged_attention_prefill(const TensorView& q, const PagedKVCacheView& cache, const TensorView& page_table,
                             const TensorView& seq_lens, const TensorView& out, const TensorView& lse,
                             const DecodeOptions& options, KvCacheVariant variant, const ExecutionContext& ctx) {
  decode_impl(q, cache, page_table, seq_lens, out, lse, options, variant, ctx, nullptr, true);
}

void paged_attention_decode(const TensorView& q, const PagedKVCacheView& cache, const TensorView& page_table,
                            const TensorView& seq_lens, const TensorView& out, const TensorView& lse,
                            const DecodeOptions& options, const DecodePlan& plan, const ExecutionContext& ctx) {
  decode_impl(q, cache, page_table, seq_lens, out, lse, options, plan.variant, ctx, &plan);
}

DecodePlan plan_paged_decode(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t head_dim, int64_t q_len,
                             int64_t page_size, int64_t max_seq_len, DType dtype, DType cache_dtype, Device device,
                             KvCacheVariant variant) {
  check_variant_value(variant);
  auto need = [](bool ok, const std::string& name, const std::string& expected, int64_t given) {
    if (!ok) invalid(name + ": expected " + expected + "; given " + std::to_string(given));
  };
  need(batch >= 0, "batch", ">= 0", batch);
  need(heads_kv >= 1, "heads_kv", ">= 1", heads_kv);
  need(heads_q >= 1 && heads_q % heads_kv == 0, "heads_q", "a multiple of heads_kv " + std::to_string(heads_kv), heads_q);
  need(head_dim >= 1, "head_dim", ">= 1", head_dim);
  need(q_len >= 1 && q_len <= 8, "q_len", "1 to 8", q_len);
  need(page_size >= 1 && page_size <= 256, "page_size", "1 to 256", page_size);
  need(max_seq_len >= 0, "max_seq_len", ">= 0", max_seq_len);
  if (!float_data(dtype)) unsupported("dtype: expected fp16, bf16, fp32 (fp64 on the cpu variant); given " + dname(dtype));
  if (cache_dtype != dtype && cache_dtype != DType::kF8E4M3)
    invalid("cache_dtype: expected " + dname(dtype) + " (dtype) or fp8_e4m3; given " + dname(cache_dtype));
  if (cache_dtype == DType::kF8E4M3 && dtype == DType::kF64)
    unsupported("dtype: expected fp16, bf16 or fp32 with an fp8_e4m3 cache; given fp64");
  if (device.is_cuda() && device.index < 0) invalid("device: expected a CUDA ordinal >= 0; given " + device_name(device));
  if (device.is_cuda() && dtype == DType::kF64)
    unsupported("dtype: fp64 runs on the cpu variant only; given fp64 on " + device_name(device));
  const std::string mma_why = mma_rejects(dtype, head_dim, nullptr);
  const KvCacheVariantInfo& row = resolve(variant, device, mma_why.empty());
  check_variant_dtype(row, dtype, "dtype");
  if (row.variant == KvCacheVariant::kPagedMma && !mma_why.empty()) unsupported("variant: " + std::string(row.name) + ": " + mma_why);
  DecodePlan plan;
  plan.variant = row.variant;
  plan.device = device;
  plan.batch = batch, plan.heads_q = heads_q, plan.heads_kv = heads_kv, plan.head_dim = head_dim, plan.q_len = q_len;
  plan.page_size = page_size, plan.max_seq_len = max_seq_len;
  plan.dtype = dtype, plan.cache_dtype = cache_dtype;
  plan.splits = 1;
  plan.workspace_bytes = 0;
#if OPTIMIZED_WITH_CUDA
  if (row.backend == Backend::kCuda) {
    check_cuda_head_dim(device, head_dim);
    DeviceGuard guard(device.index);
    KvDecodeParams p;
    p.dtype = dtype, p.batch = batch, p.q_len = q_len, p.heads_q = heads_q;
    p.cache.dtype = cache_dtype, p.cache.heads_kv = heads_kv, p.cache.head_dim = head_dim, p.cache.page_size = page_size;
    plan.splits = p.splits = device_splits(row, device.index, p, max_seq_len);
    plan.workspace_bytes = launcher_workspace_bytes(row, p, "plan_paged_decode (" + std::string(row.name) + ")");
  }
#endif
  return plan;
}

}  // namespace optimized
