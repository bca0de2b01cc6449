// The C API (include/optimized/c_api.h): converts the C structs to TensorViews, calls the C++ API
// and turns every exception into a status code plus a thread-local message. Nothing thrown
// crosses the extern "C" boundary: each entry ends in catch (...).
#include "optimized/c_api.h"

#include <new>
#include <string>

#include "optimized/core.h"
#include "optimized/gemm.h"

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
  if (dtype < OPTIMIZED_DTYPE_F32 || dtype > OPTIMIZED_DTYPE_F64)
    invalid(std::string(name) + ": expected dtype to be an optimized_dtype value (0.." +
            std::to_string(OPTIMIZED_DTYPE_F64) + "); given " + std::to_string(dtype));
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

const char* optimized_gemm_variant_name(int32_t index) {
  try {
    const auto variants = optimized::all_gemm_variants();
    if (index < 0 || static_cast<size_t>(index) >= variants.size()) return nullptr;
    // gemm_variant_name returns views of string literals: NUL-terminated.
    return optimized::gemm_variant_name(variants[static_cast<size_t>(index)]).data();
  } catch (...) {
    return nullptr;
  }
}

optimized_status optimized_gemm_variant_check(const char* variant, int32_t dtype, int32_t device_type) {
  return guarded("optimized_gemm_variant_check", [&] {
    if (!variant) invalid("variant: expected a name (\"auto\" or a variant); given NULL");
    const optimized::GemmVariant v = optimized::parse_gemm_variant(variant);
    const optimized::DType d = to_dtype(dtype, "dtype");
    const optimized::Device device = to_device(device_type, 0, "device_type");
    if (v != optimized::GemmVariant::kAuto && optimized::gemm_variant_is_cuda(v) != device.is_cuda())
      invalid("variant: " + std::string(variant) + " runs on " +
              (optimized::gemm_variant_is_cuda(v) ? "CUDA" : "the CPU") + " tensors; given " +
              (device.is_cuda() ? "CUDA" : "CPU") + " tensors");
    // kAuto resolves to a variant that takes every dtype matmul takes.
    const optimized::GemmVariant probe =
        v != optimized::GemmVariant::kAuto ? v
        : device.is_cuda()                 ? optimized::GemmVariant::kCudaNaive
                                           : optimized::GemmVariant::kCpuNaive;
    if (std::string why = optimized::gemm_variant_rejects_dtype(probe, d); !why.empty())
      throw optimized::Error(optimized::Status::kUnsupported, "variant: " + why);
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
