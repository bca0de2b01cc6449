// The C API (include/optimized/c_api.h): converts the C structs to TensorViews and options, calls
// the C++ API and turns every exception into a status code plus a thread-local message. Nothing
// thrown crosses the extern "C" boundary: each entry runs inside guarded() (catch (...)).
//
// One section per family: core (views, errors), GEMM, the scaled (fp8) GEMM, fused, loader, attention,
// the KV cache, linear, MoE (the layer's forward), and the variant query of every family, which reads the C++
// tables (all_gemm_variants(), all_scaled_gemm_variants(), all_fused_variants(), the loader's names,
// all_attention_variants(), all_kv_cache_variants(), all_linear_variants(), all_grouped_gemm_variants()) so
// that a variant added in
// C++ is reachable from C without an edit here (tests/c_api/test_c_api_tables.cpp checks it).
#include "optimized/c_api.h"

#include <array>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "optimized/attention.h"
#include "optimized/core.h"
#include "optimized/fused.h"
#include "optimized/gemm.h"
#include "optimized/kv_cache.h"
#include "optimized/linear.h"
#include "optimized/loader.h"
#include "optimized/moe.h"

namespace {

thread_local std::string g_last_error;

optimized_status to_c(optimized::Status s) { return static_cast<optimized_status>(static_cast<int>(s)); }

optimized_status fail(optimized_status status, std::string message) {
  // Assigning may itself throw std::bad_alloc; keep the status in that case.
  try {
    g_last_error = std::move(message);
  } catch (...) {
    g_last_error.clear();
  }
  return status;
}

optimized_status ok() {
  g_last_error.clear();
  return OPTIMIZED_STATUS_OK;
}

// Runs `body`; maps whatever it throws to a status and the thread-local message.
template <typename Body>
optimized_status guarded(const char* function, Body&& body) {
  try {
    body();
    return ok();
  } catch (const optimized::Error& e) {
    return fail(to_c(e.status()), e.what());
  } catch (const std::bad_alloc&) {
    return fail(OPTIMIZED_STATUS_OUT_OF_MEMORY, std::string(function) + ": out of host memory");
  } catch (const std::exception& e) {
    return fail(OPTIMIZED_STATUS_INTERNAL, std::string(function) + ": " + e.what());
  } catch (...) {
    return fail(OPTIMIZED_STATUS_INTERNAL, std::string(function) + ": unknown exception");
  }
}

[[noreturn]] void invalid(const std::string& message) {
  throw optimized::Error(optimized::Status::kInvalidArgument, message);
}

optimized::DType to_dtype(int32_t dtype, const char* name) {
  if (dtype < OPTIMIZED_DTYPE_F32 || dtype > OPTIMIZED_DTYPE_BOOL)
    invalid(std::string(name) + ": expected dtype to be an optimized_dtype value (0.." +
            std::to_string(OPTIMIZED_DTYPE_BOOL) + "); given " + std::to_string(dtype));
  return static_cast<optimized::DType>(dtype);
}

optimized::Device to_device(int32_t type, int32_t index, const char* name) {
  if (type != OPTIMIZED_DEVICE_CPU && type != OPTIMIZED_DEVICE_CUDA)
    invalid(std::string(name) + ": expected device_type OPTIMIZED_DEVICE_CPU (0) or OPTIMIZED_DEVICE_CUDA (1); given " +
            std::to_string(type));
  if (index < 0)
    invalid(std::string(name) + ": expected device_index >= 0; given " + std::to_string(index));
  if (type == OPTIMIZED_DEVICE_CPU) return optimized::Device::cpu();
  return optimized::Device::cuda(index);
}

std::string shape_string(int32_t rank, const int64_t* shape) {
  std::string s = "[";
  for (int i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

optimized::TensorView to_view(const optimized_tensor* t, const char* name) {
  if (!t) invalid(std::string(name) + ": expected a pointer to an optimized_tensor; given NULL");
  if (t->rank < 0 || t->rank > OPTIMIZED_MAX_RANK)
    invalid(std::string(name) + ": expected rank 0.." + std::to_string(OPTIMIZED_MAX_RANK) + "; given " +
            std::to_string(t->rank));
  optimized::TensorView v;
  v.data = t->data;
  v.dtype = to_dtype(t->dtype, name);
  v.device = to_device(t->device_type, t->device_index, name);
  v.rank = t->rank;
  for (int i = 0; i < t->rank; ++i) {
    v.shape[i] = t->shape[i];
    v.strides[i] = t->strides[i];
  }
  optimized::view_extent(v, name);  // sizes >= 0; element count, offsets and byte span fit int64
  return v;
}

// An optional operand: NULL is absent (the C++ empty view). A view of rank 0 is refused rather than
// read as "absent", so that an uninitialized rank cannot silently drop a weight.
optimized::TensorView optional_view(const optimized_tensor* t, const char* name) {
  if (!t) return {};
  if (t->rank == 0)
    invalid(std::string(name) + ": expected NULL (absent) or a view of rank >= 1; given a view of rank 0");
  return to_view(t, name);
}

optimized::ExecutionContext context(void* cuda_stream) {
  optimized::ExecutionContext ctx;
  ctx.cuda_stream = cuda_stream;
  return ctx;
}

void require_out(const void* p, const char* name) {
  if (!p) invalid(std::string(name) + ": expected a pointer to write the result to; given NULL");
}

// A variant (not "auto") of a family runs on one kind of device; `variant_cuda`: whether it is CUDA's.
void check_variant_device(const char* variant, bool is_auto, bool variant_cuda, const optimized::Device& device) {
  if (!is_auto && variant_cuda != device.is_cuda())
    invalid("variant: " + std::string(variant) + " runs on " + (variant_cuda ? "CUDA" : "the CPU") + " tensors; given " +
            (device.is_cuda() ? "CUDA" : "CPU") + " tensors");
}

// ---- GEMM --------------------------------------------------------------------------------------

void gemm_check(const char* variant, int32_t dtype, int32_t device_type) {
  if (!variant) invalid("variant: expected a name (\"auto\" or a variant); given NULL");
  const optimized::GemmVariant v = optimized::parse_gemm_variant(variant);
  const optimized::DType d = to_dtype(dtype, "dtype");
  const optimized::Device device = to_device(device_type, 0, "device_type");
  check_variant_device(variant, v == optimized::GemmVariant::kAuto, optimized::gemm_variant_is_cuda(v), device);
  // kAuto resolves to a variant that takes every dtype matmul takes.
  const optimized::GemmVariant probe =
      v != optimized::GemmVariant::kAuto ? v
      : device.is_cuda()                 ? optimized::GemmVariant::kCudaNaive
                                         : optimized::GemmVariant::kCpuNaive;
  if (std::string why = optimized::gemm_variant_rejects_dtype(probe, d); !why.empty())
    throw optimized::Error(optimized::Status::kUnsupported, "variant: " + why);
}

// ---- scaled (fp8) GEMM -------------------------------------------------------------------------

// The scale layout called `name`; otherwise INVALID_ARGUMENT naming the argument (`arg`) and the
// choices (the names are the C++ ones, scale_layout_name()).
optimized::ScaleLayout scale_layout(const char* name, const char* arg) {
  constexpr optimized::ScaleLayout kAll[] = {optimized::ScaleLayout::kTensor, optimized::ScaleLayout::kRowwise,
                                             optimized::ScaleLayout::kBlock1x128,
                                             optimized::ScaleLayout::kBlock128x128};
  std::string choices;
  for (optimized::ScaleLayout l : kAll) {
    if (name && optimized::scale_layout_name(l) == name) return l;
    choices += (choices.empty() ? "" : ", ") + std::string(optimized::scale_layout_name(l));
  }
  std::string given = "NULL";
  if (name) given.assign("'").append(name).append("'");
  invalid(std::string(arg) + ": expected one of " + choices + "; given " + given);
}

// A scaled GEMM variant runs on one kind of device, on fp8 inputs (fp8_e4m3, fp8_e5m2: `dtype` is
// a's and b's; C's dtype is separate). The table's rows all take both formats (scaled_variants.h).
void scaled_gemm_check(const char* variant, int32_t dtype, int32_t device_type) {
  if (!variant) invalid("variant: expected a name (\"auto\" or a variant); given NULL");
  const optimized::ScaledGemmVariant v = optimized::parse_scaled_gemm_variant(variant);
  const optimized::DType d = to_dtype(dtype, "dtype");
  const optimized::Device device = to_device(device_type, 0, "device_type");
  check_variant_device(variant, v == optimized::ScaledGemmVariant::kAuto, optimized::scaled_gemm_variant_is_cuda(v),
                       device);
  if (std::string why = optimized::scaled_gemm_variant_rejects_dtype(v, d); !why.empty())
    throw optimized::Error(optimized::Status::kUnsupported, "variant: " + why);
}

// ---- fused -------------------------------------------------------------------------------------

optimized::FusedVariant fused_variant(const char* variant) {
  return variant ? optimized::parse_fused_variant(variant) : optimized::FusedVariant::kAuto;
}

optimized::GeluApproximation gelu_form(int32_t approximate) {
  if (approximate == OPTIMIZED_GELU_NONE) return optimized::GeluApproximation::kNone;
  if (approximate == OPTIMIZED_GELU_TANH) return optimized::GeluApproximation::kTanh;
  invalid("approximate: expected OPTIMIZED_GELU_NONE (0) or OPTIMIZED_GELU_TANH (1); given " +
          std::to_string(approximate));
}

optimized::FusedOp fused_op(const char* op) {
  if (!op) invalid("op: expected a fused op name (optimized_fused_op_name); given NULL");
  return optimized::parse_fused_op(op);
}

bool flag(int32_t value, const char* name) {
  if (value != 0 && value != 1) invalid(std::string(name) + ": expected 0 or 1; given " + std::to_string(value));
  return value == 1;
}

// A fused variant runs on one kind of device, and on the dtypes resolve_fused_variant takes there
// (fp32, fp16, bf16; fp64 on the CPU): the C++ function owns that rule and its messages.
void fused_check(const char* variant, int32_t dtype, int32_t device_type) {
  if (!variant) invalid("variant: expected a name (\"auto\" or a variant); given NULL");
  const optimized::FusedVariant v = optimized::parse_fused_variant(variant);
  const optimized::DType d = to_dtype(dtype, "dtype");
  const optimized::Device device = to_device(device_type, 0, "device_type");
  check_variant_device(variant, v == optimized::FusedVariant::kAuto, optimized::fused_variant_is_cuda(v), device);
  optimized::resolve_fused_variant(optimized::FusedOp::kSoftmax, d, device, 1, false);
}

// ---- loader ------------------------------------------------------------------------------------

void loader_check(const char* variant, int32_t dtype, int32_t device_type) {
  if (!variant) invalid("variant: expected a name (synchronous or pipelined); given NULL");
  optimized::parse_loader_variant(variant);
  to_dtype(dtype, "dtype");  // records of any dtype, on either device
  to_device(device_type, 0, "device_type");
}

// ---- attention ---------------------------------------------------------------------------------

optimized::AttentionVariant attention_variant(const char* variant) {
  return variant ? optimized::parse_attention_variant(variant) : optimized::AttentionVariant::kAuto;
}

// The C options as the C++ ones; the views of alibi_slopes and mask live in `alibi` and `mask`
// (absent: rank 0). NULL: the defaults. The C++ API checks every value.
optimized::AttentionOptions attention_options(const optimized_attention_options* c, optimized::TensorView& alibi,
                                              optimized::TensorView& mask) {
  optimized::AttentionOptions o;
  if (!c) return o;
  o.softmax_scale = c->softmax_scale;
  o.causal = flag(c->causal, "options.causal");
  o.alignment = flag(c->top_left, "options.top_left") ? optimized::CausalAlignment::kTopLeft
                                                      : optimized::CausalAlignment::kBottomRight;
  o.window_left = c->window_left;
  o.window_right = c->window_right;
  o.softcap = c->softcap;
  alibi = optional_view(c->alibi_slopes, "alibi_slopes");
  mask = optional_view(c->mask, "mask");
  o.alibi_slopes = alibi;
  o.mask = mask;
  o.deterministic = flag(c->deterministic, "options.deterministic");
  o.check_cu_seqlens = !flag(c->skip_cu_seqlens_check, "options.skip_cu_seqlens_check");
  return o;
}

// An attention variant runs on one kind of device, on the dtypes of its table row (kAuto: whatever
// some variant of the device runs): the C++ table owns that rule and its messages.
void attention_check(const char* variant, int32_t dtype, int32_t device_type) {
  if (!variant) invalid("variant: expected a name (\"auto\" or a variant); given NULL");
  const optimized::AttentionVariant v = optimized::parse_attention_variant(variant);
  const optimized::DType d = to_dtype(dtype, "dtype");
  const optimized::Device device = to_device(device_type, 0, "device_type");
  const bool is_auto = v == optimized::AttentionVariant::kAuto;
  check_variant_device(variant, is_auto, optimized::attention_variant_is_cuda(v), device);
  // kAuto resolves to cpu on the CPU and to flash (every CUDA dtype) or flash2 on CUDA.
  const optimized::AttentionVariant probe =
      !is_auto ? v : device.is_cuda() ? optimized::AttentionVariant::kFlash : optimized::AttentionVariant::kCpu;
  if (std::string why = optimized::attention_variant_rejects_dtype(probe, d); !why.empty())
    throw optimized::Error(optimized::Status::kUnsupported, "variant: " + why);
}

// ---- KV cache ----------------------------------------------------------------------------------

optimized::KvCacheVariant kv_cache_variant(const char* variant) {
  return variant ? optimized::parse_kv_cache_variant(variant) : optimized::KvCacheVariant::kAuto;
}

// The C cache as the C++ view (scales absent when NULL). k_pages and v_pages are required.
optimized::PagedKVCacheView kv_cache_view(const optimized_kv_cache* c) {
  if (!c) invalid("cache: expected a pointer to an optimized_kv_cache; given NULL");
  return {to_view(c->k_pages, "k_pages"), to_view(c->v_pages, "v_pages"), optional_view(c->k_scale, "k_scale"),
          optional_view(c->v_scale, "v_scale")};
}

optimized::RopeOptions rope_options(const optimized_kv_append_options* c, bool& validate) {
  optimized::RopeOptions r;
  validate = true;
  if (!c) return r;
  switch (c->rope) {
    case OPTIMIZED_ROPE_NONE: r.layout = optimized::RopeLayout::kNone; break;
    case OPTIMIZED_ROPE_NEOX: r.layout = optimized::RopeLayout::kNeox; break;
    case OPTIMIZED_ROPE_INTERLEAVED: r.layout = optimized::RopeLayout::kInterleaved; break;
    default:
      invalid("options.rope: expected OPTIMIZED_ROPE_NONE (0), OPTIMIZED_ROPE_NEOX (1) or OPTIMIZED_ROPE_INTERLEAVED "
              "(2); given " + std::to_string(c->rope));
  }
  r.theta = c->rope_theta;
  r.rotary_dim = c->rotary_dim;
  validate = flag(c->validate, "options.validate");
  return r;
}

// The C options as the C++ ones; the view of alibi_slopes lives in `alibi`. NULL: the defaults.
optimized::DecodeOptions decode_options(const optimized_decode_options* c, optimized::TensorView& alibi) {
  optimized::DecodeOptions o;
  if (!c) return o;
  o.softmax_scale = c->softmax_scale;
  o.window_left = c->window_left;
  o.softcap = c->softcap;
  alibi = optional_view(c->alibi_slopes, "alibi_slopes");
  o.alibi_slopes = alibi;
  o.validate = flag(c->validate, "options.validate");
  return o;
}

// A KV-cache variant runs on one kind of device, on the dtypes (of q) of its table row. "auto"
// resolves to cpu on the CPU and to paged_split on CUDA (as kv_cache.cpp does).
void kv_cache_check(const char* variant, int32_t dtype, int32_t device_type) {
  if (!variant) invalid("variant: expected a name (\"auto\" or a variant); given NULL");
  const optimized::KvCacheVariant v = optimized::parse_kv_cache_variant(variant);
  const optimized::DType d = to_dtype(dtype, "dtype");
  const optimized::Device device = to_device(device_type, 0, "device_type");
  const bool is_auto = v == optimized::KvCacheVariant::kAuto;
  check_variant_device(variant, is_auto, optimized::kv_cache_variant_is_cuda(v), device);
  bool any_cuda = false;
  for (optimized::KvCacheVariant r : optimized::all_kv_cache_variants()) any_cuda |= optimized::kv_cache_variant_is_cuda(r);
  if (is_auto && device.is_cuda() && !any_cuda)
    throw optimized::Error(optimized::Status::kUnsupported,
                           "variant: auto: the kv_cache family has no CUDA variant yet (cpu runs CPU tensors)");
  const optimized::KvCacheVariant probe =
      !is_auto ? v : (device.is_cuda() ? optimized::KvCacheVariant::kPagedSplit : optimized::KvCacheVariant::kCpu);
  if (std::string why = optimized::kv_cache_variant_rejects_dtype(probe, d); !why.empty())
    throw optimized::Error(optimized::Status::kUnsupported, "variant: " + why);
}

// ---- linear ------------------------------------------------------------------------------------

optimized::LinearVariant linear_variant(const char* variant) {
  return variant ? optimized::parse_linear_variant(variant) : optimized::LinearVariant::kAuto;
}

optimized::Activation activation_of(int32_t activation) {
  if (activation < OPTIMIZED_ACTIVATION_NONE || activation > OPTIMIZED_ACTIVATION_SILU)
    invalid("activation: expected OPTIMIZED_ACTIVATION_NONE (0), _RELU (1), _GELU (2), _GELU_TANH (3) or _SILU (4); "
            "given " + std::to_string(activation));
  return static_cast<optimized::Activation>(activation);  // the same values (c_api.h)
}

// A linear variant runs on one kind of device, on the dtypes (of x) of its table row. "auto"
// resolves to cpu on the CPU; on CUDA it takes what naive takes (fp32, fp16, bf16).
void linear_check(const char* variant, int32_t dtype, int32_t device_type) {
  if (!variant) invalid("variant: expected a name (\"auto\" or a variant); given NULL");
  const optimized::LinearVariant v = optimized::parse_linear_variant(variant);
  const optimized::DType d = to_dtype(dtype, "dtype");
  const optimized::Device device = to_device(device_type, 0, "device_type");
  const bool is_auto = v == optimized::LinearVariant::kAuto;
  check_variant_device(variant, is_auto, optimized::linear_variant_is_cuda(v), device);
  const optimized::LinearVariant probe =
      !is_auto ? v : (device.is_cuda() ? optimized::LinearVariant::kNaive : optimized::LinearVariant::kCpu);
  if (std::string why = optimized::linear_variant_rejects_dtype(probe, d); !why.empty())
    throw optimized::Error(optimized::Status::kUnsupported, "variant: " + why);
}

// ---- MoE ---------------------------------------------------------------------------------------

// The grouped GEMM's variant, which optimized_moe takes (NULL: auto).
optimized::GroupedGemmVariant moe_variant(const char* variant) {
  return variant ? optimized::parse_grouped_gemm_variant(variant) : optimized::GroupedGemmVariant::kAuto;
}

// The C options as the C++ ones (NULL: the defaults). The C++ API checks the ranges and names them.
optimized::MoeLayerOptions moe_options(const optimized_moe_options* c, optimized::GroupedGemmVariant variant) {
  optimized::MoeLayerOptions o;
  o.variant = variant;
  if (!c) return o;
  o.top_k = c->top_k;
  if (c->scoring != OPTIMIZED_MOE_SCORING_SOFTMAX && c->scoring != OPTIMIZED_MOE_SCORING_SIGMOID)
    invalid("options.scoring: expected OPTIMIZED_MOE_SCORING_SOFTMAX (0) or OPTIMIZED_MOE_SCORING_SIGMOID (1); given " +
            std::to_string(c->scoring));
  o.scoring = static_cast<optimized::MoeScoring>(c->scoring);  // the same values (c_api.h)
  o.topk_softmax = flag(c->topk_softmax, "options.topk_softmax");
  o.normalize = flag(c->normalize, "options.normalize");
  o.routed_scale = c->routed_scale;
  o.capacity_factor = c->capacity_factor;
  return o;
}

// A grouped GEMM variant (what optimized_moe runs its experts on) runs on one kind of device, on the
// dtypes (of x) of its table row; "auto" takes what some variant takes.
void moe_check(const char* variant, int32_t dtype, int32_t device_type) {
  if (!variant) invalid("variant: expected a name (\"auto\" or a variant); given NULL");
  const optimized::GroupedGemmVariant v = optimized::parse_grouped_gemm_variant(variant);
  const optimized::DType d = to_dtype(dtype, "dtype");
  const optimized::Device device = to_device(device_type, 0, "device_type");
  check_variant_device(variant, v == optimized::GroupedGemmVariant::kAuto, optimized::grouped_gemm_variant_is_cuda(v),
                       device);
  if (std::string why = optimized::grouped_gemm_variant_rejects_dtype(v, d); !why.empty())
    throw optimized::Error(optimized::Status::kUnsupported, "variant: " + why);
}

// ---- every family ------------------------------------------------------------------------------

struct Family {
  const char* name;
  size_t (*count)();
  const char* (*name_at)(size_t index);  // string literals: NUL-terminated and static
  void (*check)(const char* variant, int32_t dtype, int32_t device_type);
};

constexpr Family kFamilies[] = {
    {"gemm", [] { return optimized::all_gemm_variants().size(); },
     [](size_t i) { return optimized::gemm_variant_name(optimized::all_gemm_variants()[i]).data(); }, gemm_check},
    {"fused", [] { return optimized::all_fused_variants().size(); },
     [](size_t i) { return optimized::fused_variant_name(optimized::all_fused_variants()[i]).data(); }, fused_check},
    {"loader", [] { return optimized::all_loader_variants().size(); },
     [](size_t i) { return optimized::loader_variant_name(optimized::all_loader_variants()[i]).data(); }, loader_check},
    {"scaled_gemm", [] { return optimized::all_scaled_gemm_variants().size(); },
     [](size_t i) { return optimized::scaled_gemm_variant_name(optimized::all_scaled_gemm_variants()[i]).data(); },
     scaled_gemm_check},
    {"attention", [] { return optimized::all_attention_variants().size(); },
     [](size_t i) { return optimized::attention_variant_name(optimized::all_attention_variants()[i]).data(); },
     attention_check},
    {"kv_cache", [] { return optimized::all_kv_cache_variants().size(); },
     [](size_t i) { return optimized::kv_cache_variant_name(optimized::all_kv_cache_variants()[i]).data(); },
     kv_cache_check},
    {"linear", [] { return optimized::all_linear_variants().size(); },
     [](size_t i) { return optimized::linear_variant_name(optimized::all_linear_variants()[i]).data(); },
     linear_check},
    {"moe", [] { return optimized::all_grouped_gemm_variants().size(); },
     [](size_t i) { return optimized::grouped_gemm_variant_name(optimized::all_grouped_gemm_variants()[i]).data(); },
     moe_check},
};

const Family& family(const char* name) {
  std::string names;
  for (const Family& f : kFamilies) names += (names.empty() ? "" : ", ") + std::string(f.name);
  if (!name) invalid("family: expected one of " + names + "; given NULL");
  for (const Family& f : kFamilies)
    if (std::strcmp(f.name, name) == 0) return f;
  invalid("family: expected one of " + names + "; given '" + std::string(name) + "'");
}

const char* variant_at(const Family& f, int32_t index) {
  if (index < 0 || static_cast<size_t>(index) >= f.count()) return nullptr;
  return f.name_at(static_cast<size_t>(index));
}

}  // namespace

// ---- the loader's opaque handles (declared in c_api.h) -------------------------------------------

struct optimized_shard_writer {
  std::unique_ptr<optimized::ShardWriter> writer;
  // Set when an append failed half-way: the dataset was aborted (left incomplete) with this reason.
  optimized::Status failed_status = optimized::Status::kOk;
  std::string failed;
};

struct optimized_loader {
  std::unique_ptr<optimized::Loader> loader;
  std::optional<optimized::Batch> current;  // the batch last handed out: kept alive until the next call
  void* current_stream = nullptr;           // the stream it was handed out on (CUDA)
  std::string io_backend;                   // chosen at construction; a stable string for get_info

  // Lets the memory of the batch handed out be reused once the work queued on its stream so far is
  // done (the rule torch's caching allocator follows), then drops it.
  void release_current() {
    if (!current) return;
    std::optional<optimized::Batch> batch = std::move(current);
    current.reset();
    if (batch->device().is_cuda() && batch->memory()) batch->memory()->release_after(current_stream);
  }
};

namespace {

optimized_shard_writer& writer_of(optimized_shard_writer* w) {
  if (!w) invalid("writer: expected a handle from optimized_shard_writer_create; given NULL");
  return *w;
}

const optimized_loader& loader_of(const optimized_loader* l) {
  if (!l) invalid("loader: expected a handle from optimized_loader_create; given NULL");
  return *l;
}
optimized_loader& loader_of(optimized_loader* l) {
  if (!l) invalid("loader: expected a handle from optimized_loader_create; given NULL");
  return *l;
}

void fill_options(const optimized::LoaderOptions& o, optimized_loader_options* c) {
  optimized_loader_options out{};
  out.batch_size = o.batch_size;
  out.device_type = o.device.is_cuda() ? OPTIMIZED_DEVICE_CUDA : OPTIMIZED_DEVICE_CPU;
  out.device_index = o.device.index;
  out.shuffle = o.shuffle ? 1 : 0;
  out.drop_last = o.drop_last ? 1 : 0;
  out.seed = o.seed;
  out.rank = o.rank;
  out.world_size = o.world_size;
  out.epochs = o.epochs;
  out.start_epoch = o.start.epoch;
  out.start_batch = o.start.batch;
  out.variant = nullptr;  // NULL: the C++ default (pipelined), as for io, direct_io and gds (auto)
  out.prefetch = o.prefetch;
  out.threads = o.threads;
  out.queue_depth = o.queue_depth;
  out.verify = o.verify ? 1 : 0;
  out.chunk_bytes = o.chunk_bytes;
  out.io = out.direct_io = out.gds = nullptr;
  out.staging_bytes = o.staging_bytes;
  out.worker = o.worker;
  out.num_workers = o.num_workers;
  *c = out;
}

optimized::LoaderOptions to_options(const optimized_loader_options& c) {
  optimized::LoaderOptions o;
  o.batch_size = c.batch_size;
  o.device = to_device(c.device_type, c.device_index, "device");
  o.shuffle = flag(c.shuffle, "shuffle");
  o.drop_last = flag(c.drop_last, "drop_last");
  o.seed = c.seed;
  o.rank = c.rank;
  o.world_size = c.world_size;
  o.epochs = c.epochs;
  o.start = {c.start_epoch, c.start_batch};
  if (c.variant) o.variant = optimized::parse_loader_variant(c.variant);
  o.prefetch = c.prefetch;
  o.threads = c.threads;
  o.queue_depth = c.queue_depth;
  o.verify = flag(c.verify, "verify");
  o.chunk_bytes = c.chunk_bytes;
  if (c.io) o.io = optimized::parse_io_backend(c.io);
  if (c.direct_io) o.direct_io = optimized::parse_direct_io(c.direct_io);
  if (c.gds) o.gds = optimized::parse_gds_mode(c.gds);
  o.staging_bytes = c.staging_bytes;
  o.worker = c.worker;
  o.num_workers = c.num_workers;
  return o;  // the Loader checks the ranges and names the field
}

}  // namespace

extern "C" {

optimized_status optimized_tensor_contiguous(optimized_tensor* t, void* data, optimized_dtype dtype,
                                             optimized_device_type device_type, int32_t device_index,
                                             int32_t rank, const int64_t* shape) {
  return guarded("optimized_tensor_contiguous", [&] {
    if (!t) invalid("t: expected a pointer to an optimized_tensor to fill; given NULL");
    if (rank < 0 || rank > OPTIMIZED_MAX_RANK)
      invalid("rank: expected 0.." + std::to_string(OPTIMIZED_MAX_RANK) + "; given " + std::to_string(rank));
    if (rank > 0 && !shape) invalid("shape: expected " + std::to_string(rank) + " sizes; given NULL");
    to_dtype(dtype, "dtype");
    to_device(device_type, device_index, "device");
    for (int i = 0; i < rank; ++i)
      if (shape[i] < 0)
        invalid("shape: expected sizes >= 0; given " + std::to_string(shape[i]) + " at dimension " +
                std::to_string(i));
    optimized_tensor out{};
    out.data = data;
    out.dtype = dtype;
    out.device_type = device_type;
    out.device_index = device_index;
    out.rank = rank;
    int64_t stride = 1;
    for (int i = rank - 1; i >= 0; --i) {
      out.shape[i] = shape[i];
      out.strides[i] = stride;
      // The stride of dimension i - 1 (a size 0 counts as 1, as torch's contiguous strides do).
      if (i > 0 && __builtin_mul_overflow(stride, shape[i] > 0 ? shape[i] : 1, &stride))
        invalid("shape: expected strides that fit int64; given " + shape_string(rank, shape) +
                ", whose stride of dimension " + std::to_string(i - 1) + " does not");
    }
    // The element count, the byte span and the addresses, as every view the library takes is checked.
    to_view(&out, "shape");
    *t = out;
  });
}

optimized_status optimized_matmul(const optimized_tensor* a, const optimized_tensor* b, optimized_tensor* c,
                                  float alpha, float beta, const char* variant, void* cuda_stream) {
  return guarded("optimized_matmul", [&] {
    const optimized::TensorView va = to_view(a, "a"), vb = to_view(b, "b"), vc = to_view(c, "c");
    const optimized::GemmVariant v =
        variant ? optimized::parse_gemm_variant(variant) : optimized::GemmVariant::kAuto;
    optimized::ExecutionContext ctx;
    ctx.cuda_stream = cuda_stream;
    optimized::matmul(va, vb, vc, alpha, beta, v, ctx);
  });
}

optimized_status optimized_matmul_epilogue(const optimized_tensor* a, const optimized_tensor* b, optimized_tensor* c,
                                           const optimized_tensor* bias, int32_t bias_along_m, const char* activation,
                                           int32_t activation_grad, optimized_tensor* aux,
                                           const optimized_tensor* residual, optimized_tensor* column_sums,
                                           float alpha, float beta, const char* variant, void* cuda_stream) {
  return guarded("optimized_matmul_epilogue", [&] {
    const optimized::TensorView va = to_view(a, "a"), vb = to_view(b, "b"), vc = to_view(c, "c");
    const optimized::TensorView vbias = optional_view(bias, "bias"), vaux = optional_view(aux, "aux");
    const optimized::TensorView vres = optional_view(residual, "residual");
    const optimized::TensorView vsums = optional_view(column_sums, "column_sums");
    optimized::GemmEpilogue e;
    e.bias = bias ? &vbias : nullptr;
    e.bias_along_m = bias_along_m != 0;
    e.activation = activation ? optimized::parse_activation(activation) : optimized::Activation::kNone;
    e.activation_grad = activation_grad != 0;
    e.aux = aux ? &vaux : nullptr;
    e.residual = residual ? &vres : nullptr;
    e.column_sums = column_sums ? &vsums : nullptr;
    const optimized::GemmVariant v =
        variant ? optimized::parse_gemm_variant(variant) : optimized::GemmVariant::kAuto;
    optimized::matmul(va, vb, vc, e, alpha, beta, v, context(cuda_stream));
  });
}

const char* optimized_gemm_variant_name(int32_t index) {
  try {
    return variant_at(family("gemm"), index);
  } catch (...) {
    return nullptr;
  }
}

optimized_status optimized_gemm_variant_check(const char* variant, int32_t dtype, int32_t device_type) {
  return guarded("optimized_gemm_variant_check", [&] { gemm_check(variant, dtype, device_type); });
}

// ---- scaled (fp8) GEMM -------------------------------------------------------------------------

optimized_status optimized_scaled_matmul(const optimized_tensor* a, const optimized_tensor* b, optimized_tensor* c,
                                         const optimized_tensor* scale_a, const char* scale_a_layout,
                                         const optimized_tensor* scale_b, const char* scale_b_layout,
                                         const optimized_tensor* bias, const char* variant, void* cuda_stream) {
  return guarded("optimized_scaled_matmul", [&] {
    const optimized::TensorView va = to_view(a, "a"), vb = to_view(b, "b"), vc = to_view(c, "c");
    const optimized::TensorView vsa = to_view(scale_a, "scale_a"), vsb = to_view(scale_b, "scale_b");
    const optimized::ScaleLayout la = scale_layout(scale_a_layout, "scale_a_layout");
    const optimized::ScaleLayout lb = scale_layout(scale_b_layout, "scale_b_layout");
    const optimized::TensorView vbias = optional_view(bias, "bias");
    const optimized::ScaledGemmVariant v =
        variant ? optimized::parse_scaled_gemm_variant(variant) : optimized::ScaledGemmVariant::kAuto;
    optimized::scaled_matmul(va, vb, vc, vsa, la, vsb, lb, bias ? &vbias : nullptr, v, context(cuda_stream));
  });
}

// ---- every family ------------------------------------------------------------------------------

const char* optimized_family_name(int32_t index) {
  constexpr int32_t n = static_cast<int32_t>(sizeof kFamilies / sizeof kFamilies[0]);
  return index >= 0 && index < n ? kFamilies[index].name : nullptr;
}

optimized_status optimized_variant_count(const char* family_name, int32_t* count) {
  return guarded("optimized_variant_count", [&] {
    const Family& f = family(family_name);
    require_out(count, "count");
    *count = static_cast<int32_t>(f.count());
  });
}

const char* optimized_variant_name(const char* family_name, int32_t index) {
  const char* name = nullptr;
  guarded("optimized_variant_name", [&] { name = variant_at(family(family_name), index); });
  return name;
}

optimized_status optimized_variant_check(const char* family_name, const char* variant, int32_t dtype,
                                         int32_t device_type) {
  return guarded("optimized_variant_check", [&] { family(family_name).check(variant, dtype, device_type); });
}

// ---- fused -------------------------------------------------------------------------------------

optimized_status optimized_softmax_forward(const optimized_tensor* x, optimized_tensor* y, double scale,
                                           const char* variant, void* cuda_stream) {
  return guarded("optimized_softmax_forward", [&] {
    optimized::softmax_forward(to_view(x, "x"), to_view(y, "y"), scale, false, fused_variant(variant),
                               context(cuda_stream));
  });
}

optimized_status optimized_log_softmax_forward(const optimized_tensor* x, optimized_tensor* y, double scale,
                                               const char* variant, void* cuda_stream) {
  return guarded("optimized_log_softmax_forward", [&] {
    optimized::softmax_forward(to_view(x, "x"), to_view(y, "y"), scale, true, fused_variant(variant),
                               context(cuda_stream));
  });
}

optimized_status optimized_softmax_backward(const optimized_tensor* y, const optimized_tensor* dy,
                                            optimized_tensor* dx, double scale, const char* variant,
                                            void* cuda_stream) {
  return guarded("optimized_softmax_backward", [&] {
    optimized::softmax_backward(to_view(y, "y"), to_view(dy, "dy"), to_view(dx, "dx"), scale, false,
                                fused_variant(variant), context(cuda_stream));
  });
}

optimized_status optimized_log_softmax_backward(const optimized_tensor* y, const optimized_tensor* dy,
                                                optimized_tensor* dx, double scale, const char* variant,
                                                void* cuda_stream) {
  return guarded("optimized_log_softmax_backward", [&] {
    optimized::softmax_backward(to_view(y, "y"), to_view(dy, "dy"), to_view(dx, "dx"), scale, true,
                                fused_variant(variant), context(cuda_stream));
  });
}

optimized_status optimized_layer_norm_forward(const optimized_tensor* x, const optimized_tensor* residual,
                                              const optimized_tensor* weight, const optimized_tensor* bias,
                                              double eps, optimized_tensor* y, optimized_tensor* residual_out,
                                              optimized_tensor* mean, optimized_tensor* rstd, const char* variant,
                                              void* cuda_stream) {
  return guarded("optimized_layer_norm_forward", [&] {
    optimized::layer_norm_forward(to_view(x, "x"), optional_view(residual, "residual"),
                                  optional_view(weight, "weight"), optional_view(bias, "bias"), eps,
                                  to_view(y, "y"), optional_view(residual_out, "residual_out"),
                                  optional_view(mean, "mean"), optional_view(rstd, "rstd"), fused_variant(variant),
                                  context(cuda_stream));
  });
}

optimized_status optimized_layer_norm_backward(const optimized_tensor* dy, const optimized_tensor* h,
                                               const optimized_tensor* weight, const optimized_tensor* mean,
                                               const optimized_tensor* rstd, const optimized_tensor* dresidual_out,
                                               optimized_tensor* dx, optimized_tensor* dweight,
                                               optimized_tensor* dbias, const char* variant, void* cuda_stream) {
  return guarded("optimized_layer_norm_backward", [&] {
    // mean and rstd are required: the C++ entry says so by name when they are absent.
    optimized::layer_norm_backward(to_view(dy, "dy"), to_view(h, "h"), optional_view(weight, "weight"),
                                   optional_view(mean, "mean"), optional_view(rstd, "rstd"),
                                   optional_view(dresidual_out, "dresidual_out"), to_view(dx, "dx"),
                                   optional_view(dweight, "dweight"), optional_view(dbias, "dbias"),
                                   fused_variant(variant), context(cuda_stream));
  });
}

optimized_status optimized_rms_norm_forward(const optimized_tensor* x, const optimized_tensor* residual,
                                            const optimized_tensor* weight, double eps, optimized_tensor* y,
                                            optimized_tensor* residual_out, optimized_tensor* rstd,
                                            const char* variant, void* cuda_stream) {
  return guarded("optimized_rms_norm_forward", [&] {
    optimized::rms_norm_forward(to_view(x, "x"), optional_view(residual, "residual"), optional_view(weight, "weight"),
                                eps, to_view(y, "y"), optional_view(residual_out, "residual_out"),
                                optional_view(rstd, "rstd"), fused_variant(variant), context(cuda_stream));
  });
}

optimized_status optimized_rms_norm_backward(const optimized_tensor* dy, const optimized_tensor* h,
                                             const optimized_tensor* weight, const optimized_tensor* rstd,
                                             const optimized_tensor* dresidual_out, optimized_tensor* dx,
                                             optimized_tensor* dweight, const char* variant, void* cuda_stream) {
  return guarded("optimized_rms_norm_backward", [&] {
    optimized::rms_norm_backward(to_view(dy, "dy"), to_view(h, "h"), optional_view(weight, "weight"),
                                 optional_view(rstd, "rstd"), optional_view(dresidual_out, "dresidual_out"),
                                 to_view(dx, "dx"), optional_view(dweight, "dweight"), fused_variant(variant),
                                 context(cuda_stream));
  });
}

optimized_status optimized_bias_gelu_forward(const optimized_tensor* x, const optimized_tensor* bias,
                                             int32_t approximate, optimized_tensor* y, const char* variant,
                                             void* cuda_stream) {
  return guarded("optimized_bias_gelu_forward", [&] {
    optimized::bias_gelu_forward(to_view(x, "x"), optional_view(bias, "bias"), gelu_form(approximate), to_view(y, "y"),
                                 fused_variant(variant), context(cuda_stream));
  });
}

optimized_status optimized_bias_gelu_backward(const optimized_tensor* dy, const optimized_tensor* x,
                                              const optimized_tensor* bias, int32_t approximate, optimized_tensor* dx,
                                              optimized_tensor* dbias, const char* variant, void* cuda_stream) {
  return guarded("optimized_bias_gelu_backward", [&] {
    optimized::bias_gelu_backward(to_view(dy, "dy"), to_view(x, "x"), optional_view(bias, "bias"),
                                  gelu_form(approximate), to_view(dx, "dx"), optional_view(dbias, "dbias"),
                                  fused_variant(variant), context(cuda_stream));
  });
}

optimized_status optimized_silu_and_mul_forward(const optimized_tensor* x, optimized_tensor* y, const char* variant,
                                                void* cuda_stream) {
  return guarded("optimized_silu_and_mul_forward", [&] {
    optimized::silu_and_mul_forward(to_view(x, "x"), to_view(y, "y"), fused_variant(variant), context(cuda_stream));
  });
}

optimized_status optimized_silu_and_mul_backward(const optimized_tensor* dy, const optimized_tensor* x,
                                                 optimized_tensor* dx, const char* variant, void* cuda_stream) {
  return guarded("optimized_silu_and_mul_backward", [&] {
    optimized::silu_and_mul_backward(to_view(dy, "dy"), to_view(x, "x"), to_view(dx, "dx"), fused_variant(variant),
                                     context(cuda_stream));
  });
}

const char* optimized_fused_variant_name(int32_t index) {
  try {
    return variant_at(family("fused"), index);
  } catch (...) {
    return nullptr;
  }
}

const char* optimized_fused_op_name(int32_t index) {
  try {
    const auto ops = optimized::all_fused_ops();
    if (index < 0 || static_cast<size_t>(index) >= ops.size()) return nullptr;
    return optimized::fused_op_name(ops[static_cast<size_t>(index)]).data();  // a string literal
  } catch (...) {
    return nullptr;
  }
}

optimized_status optimized_fused_resolve_variant(const char* op, int32_t dtype, int32_t device_type,
                                                 int32_t device_index, int64_t width, int32_t backward,
                                                 int32_t aligned_rows, const char** variant) {
  return guarded("optimized_fused_resolve_variant", [&] {
    require_out(variant, "variant");
    const optimized::FusedVariant v = optimized::resolve_fused_variant(
        fused_op(op), to_dtype(dtype, "dtype"), to_device(device_type, device_index, "device"), width,
        flag(backward, "backward"), flag(aligned_rows, "aligned_rows"));
    *variant = optimized::fused_variant_name(v).data();
  });
}

optimized_status optimized_fused_registers_max_width(const char* op, int32_t dtype, int32_t backward,
                                                     int32_t aligned_rows, int64_t* max_width) {
  return guarded("optimized_fused_registers_max_width", [&] {
    require_out(max_width, "max_width");
    *max_width = optimized::fused_registers_max_width(fused_op(op), to_dtype(dtype, "dtype"),
                                                      flag(backward, "backward"), flag(aligned_rows, "aligned_rows"));
  });
}

// ---- loader: shard writer ------------------------------------------------------------------------

optimized_status optimized_shard_writer_create(optimized_shard_writer** writer, const char* dir, const char* dtype,
                                               int32_t record_rank, const int64_t* record_shape,
                                               uint64_t records_per_shard, int32_t overwrite) {
  return guarded("optimized_shard_writer_create", [&] {
    require_out(writer, "writer");
    *writer = nullptr;
    if (!dir) invalid("dir: expected a directory path; given NULL");
    if (!dtype) invalid("dtype: expected an element type name (\"float32\", \"int32\", ...); given NULL");
    if (record_rank < 0 || record_rank > OPTIMIZED_SHARD_MAX_RANK)
      invalid("record_rank: expected 0.." + std::to_string(OPTIMIZED_SHARD_MAX_RANK) + "; given " +
              std::to_string(record_rank));
    if (record_rank > 0 && !record_shape)
      invalid("record_shape: expected " + std::to_string(record_rank) + " sizes; given NULL");
    std::vector<int64_t> shape(record_shape, record_shape + record_rank);
    auto handle = std::make_unique<optimized_shard_writer>();
    handle->writer = std::make_unique<optimized::ShardWriter>(dir, dtype, std::move(shape), records_per_shard,
                                                              flag(overwrite, "overwrite"));
    *writer = handle.release();
  });
}

optimized_status optimized_shard_writer_append(optimized_shard_writer* writer, const void* records, uint64_t count) {
  return guarded("optimized_shard_writer_append", [&] {
    optimized_shard_writer& w = writer_of(writer);
    if (w.failed_status != optimized::Status::kOk)
      throw optimized::Error(w.failed_status, "writer: an earlier append failed and the dataset was aborted (" +
                                                  w.failed + "); end the writer with optimized_shard_writer_abort");
    if (count == 0) return;
    if (!records) invalid("records: expected " + std::to_string(count) + " records of host memory; given NULL");
    try {
      w.writer->append(records, count);
    } catch (const std::exception& e) {
      // Records may have been written half-way: as the C++ writer does when a throw leaves its scope,
      // leave the dataset visibly incomplete rather than let a later close() finish a shorter one.
      const auto* error = dynamic_cast<const optimized::Error*>(&e);
      w.failed_status = error ? error->status() : optimized::Status::kInternal;
      w.failed = e.what();
      w.writer->abort("append failed: " + w.failed);
      throw;
    }
  });
}

optimized_status optimized_shard_writer_info(const optimized_shard_writer* writer, uint64_t* record_bytes,
                                             uint64_t* records_written) {
  return guarded("optimized_shard_writer_info", [&] {
    if (!writer) invalid("writer: expected a handle from optimized_shard_writer_create; given NULL");
    if (record_bytes) *record_bytes = writer->writer->record_bytes();
    if (records_written) *records_written = writer->writer->records_written();
  });
}

optimized_status optimized_shard_writer_close(optimized_shard_writer* writer, uint64_t* num_records,
                                              uint64_t* num_shards) {
  return guarded("optimized_shard_writer_close", [&] {
    std::unique_ptr<optimized_shard_writer> w(&writer_of(writer));  // freed however this ends
    if (w->failed_status != optimized::Status::kOk)
      throw optimized::Error(w->failed_status, "writer: an append failed (" + w->failed +
                                                   "); the dataset was left incomplete");
    const optimized::DatasetInfo info = w->writer->close();
    if (num_records) *num_records = info.num_records;
    if (num_shards) *num_shards = info.shards.size();
  });
}

optimized_status optimized_shard_writer_abort(optimized_shard_writer* writer, const char* why) {
  return guarded("optimized_shard_writer_abort", [&] {
    std::unique_ptr<optimized_shard_writer> w(&writer_of(writer));
    w->writer->abort(why ? why : "");
  });
}

// ---- loader ------------------------------------------------------------------------------------

optimized_status optimized_loader_options_default(optimized_loader_options* options) {
  return guarded("optimized_loader_options_default", [&] {
    require_out(options, "options");
    fill_options(optimized::LoaderOptions{}, options);
  });
}

optimized_status optimized_loader_create(optimized_loader** loader, const char* dir,
                                         const optimized_loader_options* options) {
  return guarded("optimized_loader_create", [&] {
    require_out(loader, "loader");
    *loader = nullptr;
    if (!dir) invalid("dir: expected a dataset directory; given NULL");
    const optimized::LoaderOptions o = options ? to_options(*options) : optimized::LoaderOptions{};
    auto handle = std::make_unique<optimized_loader>();
    handle->loader = std::make_unique<optimized::Loader>(dir, o);
    handle->io_backend = handle->loader->io_backend();
    *loader = handle.release();
  });
}

optimized_status optimized_loader_next(optimized_loader* loader, void* cuda_stream, optimized_batch* batch) {
  if (batch) *batch = optimized_batch{};
  return guarded("optimized_loader_next", [&] {
    optimized_loader& l = loader_of(loader);
    require_out(batch, "batch");
    l.release_current();
    std::optional<optimized::Batch> b = l.loader->next();
    if (!b) {
      const optimized::LoaderPosition p = l.loader->position();
      batch->end_of_epoch = 1;
      // Where the next call continues: the start of the next epoch (or, after the last epoch, its end).
      batch->epoch = p.epoch;
      batch->batch = p.batch;
      return;
    }
    if (b->device().is_cuda()) b->wait(cuda_stream);
    l.current = std::move(b);
    l.current_stream = cuda_stream;
    const optimized::Batch& c = *l.current;
    batch->data = c.data();
    batch->records = c.records();
    batch->bytes = c.bytes();
    batch->indices = c.indices().data();
    batch->epoch = c.position().epoch;
    batch->batch = c.position().batch;
    batch->device_type = c.device().is_cuda() ? OPTIMIZED_DEVICE_CUDA : OPTIMIZED_DEVICE_CPU;
    batch->device_index = c.device().index;
    batch->ready_event = c.ready_event();
  });
}

optimized_status optimized_loader_position(const optimized_loader* loader, uint64_t* epoch, uint64_t* batch) {
  return guarded("optimized_loader_position", [&] {
    const optimized_loader& l = loader_of(loader);
    require_out(epoch, "epoch");
    require_out(batch, "batch");
    const optimized::LoaderPosition p = l.loader->position();
    *epoch = p.epoch;
    *batch = p.batch;
  });
}

optimized_status optimized_loader_seek(optimized_loader* loader, uint64_t epoch, uint64_t batch) {
  return guarded("optimized_loader_seek", [&] { loader_of(loader).loader->seek({epoch, batch}); });
}

optimized_status optimized_loader_stop(optimized_loader* loader) {
  return guarded("optimized_loader_stop", [&] { loader_of(loader).loader->stop(); });
}

void optimized_loader_destroy(optimized_loader* loader) {
  if (!loader) return;
  try {
    loader->release_current();
  } catch (...) {  // a CUDA error while releasing: the memory is freed with the loader all the same
  }
  try {
    delete loader;  // ~Loader stops the threads
  } catch (...) {
  }
}

optimized_status optimized_loader_get_info(const optimized_loader* loader, optimized_loader_info* info) {
  return guarded("optimized_loader_get_info", [&] {
    const optimized_loader& l = loader_of(loader);
    require_out(info, "info");
    const optimized::DatasetInfo& d = l.loader->dataset();
    optimized_loader_info out{};
    out.num_records = d.num_records;
    out.record_bytes = d.record_bytes;
    out.num_shards = d.shards.size();
    out.dtype = d.dtype.c_str();
    out.record_rank = static_cast<int32_t>(d.record_shape.size());
    for (size_t i = 0; i < d.record_shape.size() && i < OPTIMIZED_SHARD_MAX_RANK; ++i) out.record_shape[i] = d.record_shape[i];
    out.fingerprint = optimized::dataset_fingerprint(d);
    out.batches_per_epoch = l.loader->batches_per_epoch();
    out.records_per_epoch = l.loader->records_per_epoch();
    out.io_backend = l.io_backend.c_str();
    out.direct_io = l.loader->direct_io() ? 1 : 0;
    out.gds = l.loader->gds() ? 1 : 0;
    out.prefetch = l.loader->prefetch();
    out.staging_bytes = l.loader->staging_bytes();
    *info = out;
  });
}

optimized_status optimized_loader_get_stats(const optimized_loader* loader, optimized_loader_stats* stats) {
  return guarded("optimized_loader_get_stats", [&] {
    const optimized_loader& l = loader_of(loader);
    require_out(stats, "stats");
    const optimized::LoaderStats s = l.loader->stats();
    *stats = optimized_loader_stats{s.batches, s.record_bytes, s.read_bytes, s.consumer_wait_s};
  });
}

optimized_status optimized_dataset_verify(const char* dir) {
  return guarded("optimized_dataset_verify", [&] {
    if (!dir) invalid("dir: expected a dataset directory; given NULL");
    optimized::verify_dataset(dir);
  });
}

// ---- attention ---------------------------------------------------------------------------------

optimized_status optimized_attention_options_default(optimized_attention_options* options) {
  return guarded("optimized_attention_options_default", [&] {
    require_out(options, "options");
    const optimized::AttentionOptions o;
    optimized_attention_options out{};
    out.softmax_scale = o.softmax_scale;
    out.causal = o.causal ? 1 : 0;
    out.top_left = o.alignment == optimized::CausalAlignment::kTopLeft ? 1 : 0;
    out.window_left = o.window_left;
    out.window_right = o.window_right;
    out.softcap = o.softcap;
    out.alibi_slopes = nullptr;
    out.mask = nullptr;
    out.deterministic = o.deterministic ? 1 : 0;
    out.skip_cu_seqlens_check = o.check_cu_seqlens ? 0 : 1;
    *options = out;
  });
}

optimized_status optimized_attention_forward(const optimized_tensor* q, const optimized_tensor* k,
                                             const optimized_tensor* v, optimized_tensor* out, optimized_tensor* lse,
                                             const optimized_attention_options* options, const char* variant,
                                             void* cuda_stream) {
  return guarded("optimized_attention_forward", [&] {
    optimized::TensorView alibi, mask;
    const optimized::AttentionOptions o = attention_options(options, alibi, mask);
    optimized::attention_forward(to_view(q, "q"), to_view(k, "k"), to_view(v, "v"), to_view(out, "out"),
                                 optional_view(lse, "lse"), o, attention_variant(variant), context(cuda_stream));
  });
}

optimized_status optimized_attention_backward(const optimized_tensor* dout, const optimized_tensor* q,
                                              const optimized_tensor* k, const optimized_tensor* v,
                                              const optimized_tensor* out, const optimized_tensor* lse,
                                              optimized_tensor* dq, optimized_tensor* dk, optimized_tensor* dv,
                                              const optimized_attention_options* options, const char* variant,
                                              void* cuda_stream) {
  return guarded("optimized_attention_backward", [&] {
    optimized::TensorView alibi, mask;
    const optimized::AttentionOptions o = attention_options(options, alibi, mask);
    optimized::attention_backward(to_view(dout, "dout"), to_view(q, "q"), to_view(k, "k"), to_view(v, "v"),
                                  to_view(out, "out"), to_view(lse, "lse"), to_view(dq, "dq"), to_view(dk, "dk"),
                                  to_view(dv, "dv"), o, attention_variant(variant), context(cuda_stream));
  });
}

optimized_status optimized_attention_varlen_forward(const optimized_tensor* q, const optimized_tensor* k,
                                                    const optimized_tensor* v, const optimized_tensor* cu_seqlens_q,
                                                    const optimized_tensor* cu_seqlens_k, int64_t max_seqlen_q,
                                                    int64_t max_seqlen_k, optimized_tensor* out, optimized_tensor* lse,
                                                    const optimized_attention_options* options, const char* variant,
                                                    void* cuda_stream) {
  return guarded("optimized_attention_varlen_forward", [&] {
    optimized::TensorView alibi, mask;
    const optimized::AttentionOptions o = attention_options(options, alibi, mask);
    optimized::attention_varlen_forward(to_view(q, "q"), to_view(k, "k"), to_view(v, "v"),
                                        to_view(cu_seqlens_q, "cu_seqlens_q"), to_view(cu_seqlens_k, "cu_seqlens_k"),
                                        max_seqlen_q, max_seqlen_k, to_view(out, "out"), optional_view(lse, "lse"), o,
                                        attention_variant(variant), context(cuda_stream));
  });
}

optimized_status optimized_attention_varlen_backward(
    const optimized_tensor* dout, const optimized_tensor* q, const optimized_tensor* k, const optimized_tensor* v,
    const optimized_tensor* cu_seqlens_q, const optimized_tensor* cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, const optimized_tensor* out, const optimized_tensor* lse, optimized_tensor* dq,
    optimized_tensor* dk, optimized_tensor* dv, const optimized_attention_options* options, const char* variant,
    void* cuda_stream) {
  return guarded("optimized_attention_varlen_backward", [&] {
    optimized::TensorView alibi, mask;
    const optimized::AttentionOptions o = attention_options(options, alibi, mask);
    optimized::attention_varlen_backward(to_view(dout, "dout"), to_view(q, "q"), to_view(k, "k"), to_view(v, "v"),
                                         to_view(cu_seqlens_q, "cu_seqlens_q"), to_view(cu_seqlens_k, "cu_seqlens_k"),
                                         max_seqlen_q, max_seqlen_k, to_view(out, "out"), to_view(lse, "lse"),
                                         to_view(dq, "dq"), to_view(dk, "dk"), to_view(dv, "dv"), o,
                                         attention_variant(variant), context(cuda_stream));
  });
}

optimized_status optimized_attention_resolve_variant(int32_t dtype, int64_t head_dim, int32_t device_type,
                                                     int32_t device_index, const char** variant) {
  return guarded("optimized_attention_resolve_variant", [&] {
    require_out(variant, "variant");
    const optimized::AttentionVariant v = optimized::resolve_attention_variant(
        to_dtype(dtype, "dtype"), head_dim, to_device(device_type, device_index, "device"));
    *variant = optimized::attention_variant_name(v).data();  // a string literal
  });
}

// ---- KV cache ----------------------------------------------------------------------------------

optimized_status optimized_kv_append_options_default(optimized_kv_append_options* options) {
  return guarded("optimized_kv_append_options_default", [&] {
    require_out(options, "options");
    const optimized::RopeOptions r;
    optimized_kv_append_options out{};
    out.rope = OPTIMIZED_ROPE_NONE;
    out.rope_theta = r.theta;
    out.rotary_dim = r.rotary_dim;
    out.validate = 1;
    *options = out;
  });
}

optimized_status optimized_decode_options_default(optimized_decode_options* options) {
  return guarded("optimized_decode_options_default", [&] {
    require_out(options, "options");
    const optimized::DecodeOptions o;
    optimized_decode_options out{};
    out.softmax_scale = o.softmax_scale;
    out.window_left = o.window_left;
    out.softcap = o.softcap;
    out.alibi_slopes = nullptr;
    out.validate = o.validate ? 1 : 0;
    *options = out;
  });
}

optimized_status optimized_kv_cache_append(const optimized_kv_cache* cache, const optimized_tensor* k,
                                           const optimized_tensor* v, const optimized_tensor* page_table,
                                           const optimized_tensor* positions, optimized_tensor* q,
                                           const optimized_kv_append_options* options, const char* variant,
                                           void* cuda_stream) {
  return guarded("optimized_kv_cache_append", [&] {
    bool validate = true;
    const optimized::RopeOptions rope = rope_options(options, validate);
    optimized::append_kv(kv_cache_view(cache), to_view(k, "k"), to_view(v, "v"), to_view(page_table, "page_table"),
                         to_view(positions, "positions"), optional_view(q, "q"), rope, validate,
                         kv_cache_variant(variant), context(cuda_stream));
  });
}

optimized_status optimized_paged_attention_decode(const optimized_tensor* q, const optimized_kv_cache* cache,
                                                  const optimized_tensor* page_table, const optimized_tensor* seq_lens,
                                                  optimized_tensor* out, optimized_tensor* lse,
                                                  const optimized_decode_options* options, const char* variant,
                                                  void* cuda_stream) {
  return guarded("optimized_paged_attention_decode", [&] {
    optimized::TensorView alibi;
    const optimized::DecodeOptions o = decode_options(options, alibi);
    optimized::paged_attention_decode(to_view(q, "q"), kv_cache_view(cache), to_view(page_table, "page_table"),
                                      to_view(seq_lens, "seq_lens"), to_view(out, "out"), optional_view(lse, "lse"), o,
                                      kv_cache_variant(variant), context(cuda_stream));
  });
}

optimized_status optimized_paged_attention_prefill(const optimized_tensor* q, const optimized_kv_cache* cache,
                                                   const optimized_tensor* page_table, const optimized_tensor* seq_lens,
                                                   optimized_tensor* out, optimized_tensor* lse,
                                                   const optimized_decode_options* options, const char* variant,
                                                   void* cuda_stream) {
  return guarded("optimized_paged_attention_prefill", [&] {
    optimized::TensorView alibi;
    const optimized::DecodeOptions o = decode_options(options, alibi);
    optimized::paged_attention_prefill(to_view(q, "q"), kv_cache_view(cache), to_view(page_table, "page_table"),
                                       to_view(seq_lens, "seq_lens"), to_view(out, "out"), optional_view(lse, "lse"), o,
                                       kv_cache_variant(variant), context(cuda_stream));
  });
}

// ---- linear ------------------------------------------------------------------------------------

namespace {
void c_linear_forward(const optimized_tensor* x, const optimized_tensor* weight, const optimized_tensor* bias,
                      optimized_tensor* y, optimized_tensor* pre, int32_t activation, const char* variant,
                      void* cuda_stream, bool fp8) {
  optimized::LinearForwardOptions o;
  o.activation = activation_of(activation);
  o.fp8 = fp8;
  optimized::linear_forward(to_view(x, "x"), to_view(weight, "weight"), optional_view(bias, "bias"), to_view(y, "y"),
                            optional_view(pre, "pre"), o, linear_variant(variant), context(cuda_stream));
}
void c_linear_backward(optimized_tensor* grad_input, optimized_tensor* grad_weight, optimized_tensor* grad_bias,
                       const optimized_tensor* grad_output, const optimized_tensor* input, const optimized_tensor* weight,
                       const optimized_tensor* pre, const optimized_tensor* bias, int32_t activation,
                       int32_t accumulate, const char* variant, void* cuda_stream, bool fp8) {
  optimized::LinearBackwardOptions o;
  o.activation = activation_of(activation);
  o.accumulate = flag(accumulate, "accumulate");
  o.fp8 = fp8;
  optimized::linear_backward(optional_view(grad_input, "grad_input"), optional_view(grad_weight, "grad_weight"),
                             optional_view(grad_bias, "grad_bias"), to_view(grad_output, "grad_output"),
                             to_view(input, "input"), to_view(weight, "weight"), optional_view(pre, "pre"),
                             optional_view(bias, "bias"), o, linear_variant(variant), context(cuda_stream));
}
}  // namespace

optimized_status optimized_linear_forward(const optimized_tensor* x, const optimized_tensor* weight,
                                          const optimized_tensor* bias, optimized_tensor* y, optimized_tensor* pre,
                                          int32_t activation, const char* variant, void* cuda_stream) {
  return guarded("optimized_linear_forward",
                 [&] { c_linear_forward(x, weight, bias, y, pre, activation, variant, cuda_stream, false); });
}

optimized_status optimized_linear_forward_fp8(const optimized_tensor* x, const optimized_tensor* weight,
                                              const optimized_tensor* bias, optimized_tensor* y, optimized_tensor* pre,
                                              int32_t activation, const char* variant, void* cuda_stream) {
  return guarded("optimized_linear_forward_fp8",
                 [&] { c_linear_forward(x, weight, bias, y, pre, activation, variant, cuda_stream, true); });
}

optimized_status optimized_linear_backward(optimized_tensor* grad_input, optimized_tensor* grad_weight,
                                           optimized_tensor* grad_bias, const optimized_tensor* grad_output,
                                           const optimized_tensor* input, const optimized_tensor* weight,
                                           const optimized_tensor* pre, const optimized_tensor* bias,
                                           int32_t activation, int32_t accumulate, const char* variant,
                                           void* cuda_stream) {
  return guarded("optimized_linear_backward", [&] {
    c_linear_backward(grad_input, grad_weight, grad_bias, grad_output, input, weight, pre, bias, activation, accumulate,
                      variant, cuda_stream, false);
  });
}

optimized_status optimized_linear_backward_fp8(optimized_tensor* grad_input, optimized_tensor* grad_weight,
                                               optimized_tensor* grad_bias, const optimized_tensor* grad_output,
                                               const optimized_tensor* input, const optimized_tensor* weight,
                                               const optimized_tensor* pre, const optimized_tensor* bias,
                                               int32_t activation, int32_t accumulate, const char* variant,
                                               void* cuda_stream) {
  return guarded("optimized_linear_backward_fp8", [&] {
    c_linear_backward(grad_input, grad_weight, grad_bias, grad_output, input, weight, pre, bias, activation, accumulate,
                      variant, cuda_stream, true);
  });
}

// ---- MoE ---------------------------------------------------------------------------------------

optimized_status optimized_moe_options_default(optimized_moe_options* options) {
  return guarded("optimized_moe_options_default", [&] {
    require_out(options, "options");
    const optimized::MoeLayerOptions o;
    optimized_moe_options out{};
    out.top_k = o.top_k;
    out.scoring = static_cast<int32_t>(o.scoring);
    out.topk_softmax = o.topk_softmax ? 1 : 0;
    out.normalize = o.normalize ? 1 : 0;
    out.routed_scale = o.routed_scale;
    out.capacity_factor = o.capacity_factor;
    *options = out;
  });
}

optimized_status optimized_moe(const optimized_tensor* x, const optimized_tensor* router_weight,
                               const optimized_tensor* w13, const optimized_tensor* w2, optimized_tensor* out,
                               optimized_tensor* tokens_per_expert, optimized_tensor* dropped,
                               const optimized_moe_options* options, const char* variant, void* cuda_stream) {
  return guarded("optimized_moe", [&] {
    const optimized::MoeLayerOptions o = moe_options(options, moe_variant(variant));
    optimized::moe_forward(to_view(x, "x"), to_view(router_weight, "router_weight"), to_view(w13, "w13"),
                           to_view(w2, "w2"), o, to_view(out, "out"),
                           optional_view(tokens_per_expert, "tokens_per_expert"), optional_view(dropped, "dropped"),
                           context(cuda_stream));
  });
}

const char* optimized_last_error(void) { return g_last_error.c_str(); }

const char* optimized_status_string(optimized_status status) {
  switch (status) {
    case OPTIMIZED_STATUS_OK: return "ok";
    case OPTIMIZED_STATUS_INVALID_ARGUMENT: return "invalid argument";
    case OPTIMIZED_STATUS_UNSUPPORTED: return "unsupported";
    case OPTIMIZED_STATUS_CUDA_ERROR: return "CUDA error";
    case OPTIMIZED_STATUS_OUT_OF_MEMORY: return "out of memory";
    case OPTIMIZED_STATUS_INTERNAL: return "internal error";
  }
  return "unknown status";
}

int32_t optimized_built_with_cuda(void) { return optimized::built_with_cuda() ? 1 : 0; }

int32_t optimized_cuda_device_count(void) {
  try {
    return optimized::cuda_device_count();
  } catch (...) {
    return 0;
  }
}

int32_t optimized_c_api_version(void) { return OPTIMIZED_C_API_VERSION; }

}  // extern "C"

// The C enums must keep the values of the C++ ones.
static_assert(OPTIMIZED_STATUS_INVALID_ARGUMENT == static_cast<int>(optimized::Status::kInvalidArgument));
static_assert(OPTIMIZED_STATUS_UNSUPPORTED == static_cast<int>(optimized::Status::kUnsupported));
static_assert(OPTIMIZED_STATUS_CUDA_ERROR == static_cast<int>(optimized::Status::kCudaError));
static_assert(OPTIMIZED_STATUS_OUT_OF_MEMORY == static_cast<int>(optimized::Status::kOutOfMemory));
static_assert(OPTIMIZED_STATUS_INTERNAL == static_cast<int>(optimized::Status::kInternal));
static_assert(OPTIMIZED_DTYPE_BF16 == static_cast<int>(optimized::DType::kBF16));
static_assert(OPTIMIZED_DTYPE_I64 == static_cast<int>(optimized::DType::kI64));
static_assert(OPTIMIZED_DTYPE_F64 == static_cast<int>(optimized::DType::kF64));
static_assert(OPTIMIZED_MAX_RANK == optimized::TensorView::kMaxRank);
static_assert(OPTIMIZED_MOE_SCORING_SOFTMAX == static_cast<int>(optimized::MoeScoring::kSoftmax));
static_assert(OPTIMIZED_MOE_SCORING_SIGMOID == static_cast<int>(optimized::MoeScoring::kSigmoid));
static_assert(OPTIMIZED_SHARD_MAX_RANK == optimized::kShardMaxRank);
