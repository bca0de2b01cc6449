// Public entry of the attention family: validates the operands of the four calls (fixed length and
// varlen, forward and backward; messages name the argument, what was expected and what was given),
// normalizes the options (scale, causal into the window), fills AttentionParams, resolves the
// variant and dispatches through the variant table (attention_variants.h) to the CPU rung or a
// CUDA launcher.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "attention/attention_config.h"
#include "attention/attention_params.h"
#include "attention/attention_variants.h"
#include "core/arg_checks.h"
#include "optimized/attention.h"

#if OPTIMIZED_WITH_CUDA
#include "core/cuda_device_guard.h"
#include "core/cuda_launch.h"
#endif

namespace optimized {

namespace {

using arg::invalid;
using arg::number;
using arg::present;
using arg::shape_string;
using arg::unsupported;

std::string head_dims_text() {
  std::string s;
  for (int d : attention_head_dims()) s += (s.empty() ? "" : ", ") + std::to_string(d);
  return s;
}

// The sizes of one call, fixed by q and k.
struct Dims {
  bool varlen = false;
  int64_t batch = 0, seqlen_q = 0, seqlen_k = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  int64_t total_q = 0, total_k = 0;
};

// Collects and checks the operands of one call: every data tensor has q's dtype and device.
class Operands {
 public:
  explicit Operands(bool varlen) : varlen_(varlen) {}

  // q-shaped or k-shaped data tensors. `like_q`: (B, S_q, H_q, D) / (total_q, H_q, D); otherwise
  // k's shape. The first call (q) fixes dtype and device; the second (k) the key sizes.
  AttentionStrides data(const TensorView& t, const char* name, bool like_q, bool output) {
    const int want_rank = varlen_ ? 3 : 4;
    if (t.rank != want_rank)
      invalid(std::string(name) + ": expected rank " + std::to_string(want_rank) +
              (varlen_ ? " (total, heads, head_dim)" : " (batch, seqlen, heads, head_dim)") + "; given rank " +
              std::to_string(t.rank) + (t.rank == 0 ? " (absent)" : " " + shape_string(t)));
    const ViewExtent extent = view_extent(t, name);
    if (!t.data && extent.numel > 0) invalid(std::string(name) + ": expected a non-null data pointer; given null");
    if (first_) {
      first_ = false;
      dtype_ = t.dtype;
      device_ = t.device;
      if (dtype_ != DType::kF32 && dtype_ != DType::kF16 && dtype_ != DType::kBF16 && dtype_ != DType::kF64)
        unsupported(std::string(name) + ": expected dtype fp16, bf16, fp32 (fp64 on the cpu variant); given " +
                    std::string(dtype_name(dtype_)));
    }
    if (t.dtype != dtype_)
      invalid(std::string(name) + ": expected dtype " + std::string(dtype_name(dtype_)) + " (q's); given " +
              std::string(dtype_name(t.dtype)));
    if (!(t.device == device_))
      invalid(std::string(name) + ": expected device " + device_name(device_) + " (q's); given " +
              device_name(t.device));
    arg::check_element_aligned(t, name);
    // Shapes: (B, S, H, D) or (total, H, D).
    const int64_t* s = t.shape;
    const int64_t rows = varlen_ ? s[0] : s[1], heads = varlen_ ? s[1] : s[2], dim = varlen_ ? s[2] : s[3];
    const int64_t batch = varlen_ ? -1 : s[0];
    for (int i = 0; i < t.rank; ++i)
      if (s[i] < 0) invalid(std::string(name) + ": expected sizes >= 0; given " + shape_string(t));
    if (heads < 1 || dim < 1)
      invalid(std::string(name) + ": expected heads >= 1 and head_dim >= 1; given " + shape_string(t));
    if (!have_q_) {
      have_q_ = true;
      d_.batch = batch;
      d_.heads_q = heads;
      d_.head_dim = dim;
      if (varlen_) d_.total_q = rows;
      else d_.seqlen_q = rows, d_.total_q = batch * rows;
    } else if (!like_q && !have_k_) {
      have_k_ = true;
      if (!varlen_ && batch != d_.batch)
        invalid(std::string(name) + ": expected batch " + std::to_string(d_.batch) + " (q's); given " + shape_string(t));
      if (dim != d_.head_dim)
        invalid(std::string(name) + ": expected head_dim " + std::to_string(d_.head_dim) + " (q's); given " +
                shape_string(t));
      if (d_.heads_q % heads != 0)
        invalid(std::string(name) + ": expected a number of heads that divides q's " + std::to_string(d_.heads_q) +
                " (GQA / MQA: H_q a multiple of H_kv); given " + std::to_string(heads));
      d_.heads_kv = heads;
      if (varlen_) d_.total_k = rows;
      else d_.seqlen_k = rows, d_.total_k = batch * rows;
    } else {
      const int64_t want_rows = like_q ? (varlen_ ? d_.total_q : d_.seqlen_q) : (varlen_ ? d_.total_k : d_.seqlen_k);
      const int64_t want_heads = like_q ? d_.heads_q : d_.heads_kv;
      if ((!varlen_ && batch != d_.batch) || rows != want_rows || heads != want_heads || dim != d_.head_dim) {
        std::string want = varlen_ ? "(" + std::to_string(want_rows) + ", " + std::to_string(want_heads) + ", " +
                                         std::to_string(d_.head_dim) + ")"
                                   : "(" + std::to_string(d_.batch) + ", " + std::to_string(want_rows) + ", " +
                                         std::to_string(want_heads) + ", " + std::to_string(d_.head_dim) + ")";
        invalid(std::string(name) + ": expected shape " + want + " (" + (like_q ? "q" : "k") + "'s); given " +
                shape_string(t));
      }
    }
    if (t.strides[t.rank - 1] != 1 && dim > 1)
      invalid(std::string(name) + ": expected unit stride in the last dimension (head_dim); given " + t.describe());
    if (output) arg::check_distinct_elements(t, name);
    set_.record(t, name, output);
    AttentionStrides st;
    if (varlen_) st.row = t.strides[0], st.head = t.strides[1];
    else st.batch = t.strides[0], st.row = t.strides[1], st.head = t.strides[2];
    return st;
  }

  // lse: fp32 (fp64 for fp64) (B, H_q, S_q) / (H_q, total_q), unit stride along the rows.
  void lse(const TensorView& t, bool output, bool required, AttentionParams& p) {
    if (!present(t)) {
      if (required) invalid("lse: required (as the forward wrote it); given absent");
      return;
    }
    const DType want = dtype_ == DType::kF64 ? DType::kF64 : DType::kF32;
    const ViewExtent extent = view_extent(t, "lse");
    if (!t.data && extent.numel > 0) invalid("lse: expected a non-null data pointer; given null");
    if (t.dtype != want)
      invalid("lse: expected dtype " + std::string(dtype_name(want)) + "; given " + std::string(dtype_name(t.dtype)));
    if (!(t.device == device_))
      invalid("lse: expected device " + device_name(device_) + " (q's); given " + device_name(t.device));
    arg::check_element_aligned(t, "lse");
    const bool ok = varlen_ ? (t.rank == 2 && t.shape[0] == d_.heads_q && t.shape[1] == d_.total_q)
                            : (t.rank == 3 && t.shape[0] == d_.batch && t.shape[1] == d_.heads_q &&
                               t.shape[2] == d_.seqlen_q);
    if (!ok)
      invalid("lse: expected shape " +
              (varlen_ ? "(" + std::to_string(d_.heads_q) + ", " + std::to_string(d_.total_q) + ")"
                       : "(" + std::to_string(d_.batch) + ", " + std::to_string(d_.heads_q) + ", " +
                             std::to_string(d_.seqlen_q) + ")") +
              "; given " + shape_string(t));
    const int64_t rows = t.shape[t.rank - 1];
    if (rows > 1 && t.strides[t.rank - 1] != 1)
      invalid("lse: expected unit stride along the query rows; given " + t.describe());
    if (output) arg::check_distinct_elements(t, "lse");
    p.lse = t.data;
    if (varlen_) p.lse_head = t.strides[0];
    else p.lse_batch = t.strides[0], p.lse_head = t.strides[1];
    set_.record(t, "lse", output);
  }

  // cu_seqlens: int32 (B + 1), contiguous, q's device.
  const int32_t* cu_seqlens(const TensorView& t, const char* name) {
    if (!present(t)) invalid(std::string(name) + ": required for varlen; given absent");
    view_extent(t, name);
    if (t.dtype != DType::kI32)
      invalid(std::string(name) + ": expected dtype int32; given " + std::string(dtype_name(t.dtype)));
    if (!(t.device == device_))
      invalid(std::string(name) + ": expected device " + device_name(device_) + " (q's); given " + device_name(t.device));
    if (t.rank != 1 || t.shape[0] < 1)
      invalid(std::string(name) + ": expected shape (batch + 1) with batch >= 0; given " + shape_string(t));
    if (t.shape[0] > 1 && t.strides[0] != 1) invalid(std::string(name) + ": expected a contiguous vector; given " + t.describe());
    if (!t.data) invalid(std::string(name) + ": expected a non-null data pointer; given null");
    arg::check_element_aligned(t, name);
    const int64_t batch = t.shape[0] - 1;
    if (d_.batch < 0) d_.batch = batch;
    else if (batch != d_.batch)
      invalid(std::string(name) + ": expected shape (" + std::to_string(d_.batch + 1) +
              ") (the same number of sequences as cu_seqlens_q); given " + shape_string(t));
    set_.record(t, name, false);
    return static_cast<const int32_t*>(t.data);
  }

  const Dims& dims() const { return d_; }
  Dims& dims() { return d_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  void add_input(const TensorView& t, const char* name) { set_.record(t, name, false); }

  // Outputs may not overlap any other operand (no in-place attention).
  void check_overlaps() const { set_.check_overlaps(); }

  void check_workspace(const Workspace& ws) const { set_.check_workspace(ws); }

  // Whether every data operand's rows start on 16-byte boundaries (flash2's cp.async).
  bool rows_aligned() const {
    const int64_t elem = static_cast<int64_t>(dtype_size(dtype_));
    bool aligned = true;
    set_.for_each([&](const TensorView& t, const char* name) {
      if (std::strcmp(name, "lse") == 0 || std::strncmp(name, "cu_seqlens", 10) == 0 ||
          std::strcmp(name, "alibi_slopes") == 0 || std::strcmp(name, "mask") == 0)
        return;
      if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) aligned = false;
      for (int i = 0; i + 1 < t.rank; ++i)
        if (t.shape[i] > 1 && (t.strides[i] * elem) % 16 != 0) aligned = false;
    });
    return aligned;
  }

 private:
  bool varlen_;
  bool first_ = true, have_q_ = false, have_k_ = false;
  DType dtype_ = DType::kF16;
  Device device_ = Device::cpu();
  Dims d_;
  arg::OperandSet set_;  // the operands recorded (checked above), for the overlap checks
};

// Options -> params: scale, window (causal folded in), softcap, ALiBi, mask.
void apply_options(const AttentionOptions& o, Operands& ops, AttentionParams& p) {
  const Dims& d = ops.dims();
  if (std::isnan(o.softmax_scale)) p.scale = 1.0 / std::sqrt(static_cast<double>(d.head_dim));
  else if (!std::isfinite(o.softmax_scale))
    invalid("softmax_scale: expected a finite value (or NaN for 1/sqrt(head_dim)); given " + number(o.softmax_scale));
  else p.scale = o.softmax_scale;
  if (o.window_left < -1) invalid("window_left: expected -1 (unbounded) or >= 0; given " + std::to_string(o.window_left));
  if (o.window_right < -1)
    invalid("window_right: expected -1 (unbounded) or >= 0; given " + std::to_string(o.window_right));
  if (!(o.softcap >= 0.0) || !std::isfinite(o.softcap))
    invalid("softcap: expected a finite value >= 0 (0: off); given " + number(o.softcap));
  // A window side wider than any sequence can be is unbounded (-1): the kernels' key ranges are
  // i + offset -+ window, which must not overflow.
  constexpr int64_t kWidest = int64_t{1} << 40;
  const int64_t left = o.window_left > kWidest ? -1 : o.window_left;
  const int64_t right = o.window_right > kWidest ? -1 : o.window_right;
  p.causal = o.causal;
  p.top_left = o.alignment == CausalAlignment::kTopLeft;
  p.window_left = left;
  p.window_right = o.causal ? 0 : right;
  p.softcap = o.softcap;
  // fp32 math (every rung but fp64's) takes the scalars as floats: one outside float's range would
  // silently turn into 0 or inf there.
  if (ops.dtype() != DType::kF64) {
    if (std::fabs(p.scale) > std::numeric_limits<float>::max())
      invalid("softmax_scale: expected a value inside float's range for " + std::string(dtype_name(ops.dtype())) +
              " inputs (fp32 math); given " + number(p.scale));
    if (p.softcap > 0 && (p.softcap > std::numeric_limits<float>::max() ||
                          p.softcap < std::numeric_limits<float>::min()))
      invalid("softcap: expected 0 (off) or a value inside float's normal range for " +
              std::string(dtype_name(ops.dtype())) + " inputs (fp32 math); given " + number(p.softcap));
  }

  if (present(o.alibi_slopes)) {
    const TensorView& a = o.alibi_slopes;
    view_extent(a, "alibi_slopes");
    if (a.dtype != DType::kF32)
      invalid("alibi_slopes: expected dtype fp32; given " + std::string(dtype_name(a.dtype)));
    if (!(a.device == ops.device()))
      invalid("alibi_slopes: expected device " + device_name(ops.device()) + " (q's); given " + device_name(a.device));
    const bool one = a.rank == 1 && a.shape[0] == d.heads_q;
    const bool two = a.rank == 2 && a.shape[0] == d.batch && a.shape[1] == d.heads_q;
    if (!one && !two)
      invalid("alibi_slopes: expected shape (" + std::to_string(d.heads_q) + ") or (" + std::to_string(d.batch) + ", " +
              std::to_string(d.heads_q) + "); given " + shape_string(a));
    if (d.heads_q > 1 && a.strides[a.rank - 1] != 1)
      invalid("alibi_slopes: expected unit stride along the heads; given " + a.describe());
    if (!a.data) invalid("alibi_slopes: expected a non-null data pointer; given null");
    arg::check_element_aligned(a, "alibi_slopes");
    p.alibi = static_cast<const float*>(a.data);
    p.alibi_batch = two ? a.strides[0] : 0;
    ops.add_input(a, "alibi_slopes");
  }

  if (present(o.mask)) {
    const TensorView& m = o.mask;
    if (d.varlen) invalid("mask: not supported by the varlen ops (use per-sequence windows or fixed length); given a mask");
    const ViewExtent mask_extent = view_extent(m, "mask");
    const DType q = ops.dtype();
    const bool ok_dtype = m.dtype == DType::kBool || m.dtype == q || m.dtype == DType::kF32;
    if (!ok_dtype)
      invalid("mask: expected dtype bool or an additive " + std::string(dtype_name(q)) + " or fp32 mask; given " +
              std::string(dtype_name(m.dtype)));
    if (!(m.device == ops.device()))
      invalid("mask: expected device " + device_name(ops.device()) + " (q's); given " + device_name(m.device));
    if (m.rank != 4)
      invalid("mask: expected rank 4 broadcastable to (batch, heads_q, seqlen_q, seqlen_k); given rank " +
              std::to_string(m.rank) + " " + shape_string(m));
    const int64_t full[4] = {d.batch, d.heads_q, d.seqlen_q, d.seqlen_k};
    static const char* const kDimNames[4] = {"batch", "heads_q", "seqlen_q", "seqlen_k"};
    for (int i = 0; i < 4; ++i) {
      if (m.shape[i] != full[i] && m.shape[i] != 1)
        invalid("mask: expected shape broadcastable to (" + std::to_string(full[0]) + ", " + std::to_string(full[1]) +
                ", " + std::to_string(full[2]) + ", " + std::to_string(full[3]) + "); dimension " + std::to_string(i) +
                " (" + kDimNames[i] + ") is " + std::to_string(m.shape[i]));
      p.mask_s[i] = m.shape[i] == 1 ? 0 : m.strides[i];
    }
    if (!m.data && mask_extent.numel > 0) invalid("mask: expected a non-null data pointer; given null");
    arg::check_element_aligned(m, "mask");
    p.mask = m.data;
    p.mask_dtype = m.dtype;
    ops.add_input(m, "mask");
  }
}

// The CUDA rungs' head-dim rule.
void check_cuda_head_dim(int64_t head_dim) {
  if (head_dim % 8 != 0 || head_dim > 256)
    unsupported("head_dim: the CUDA variants run head dims " + head_dims_text() +
                " and any multiple of 8 up to 256 (rounded up to the next of those); given " + std::to_string(head_dim) +
                " (the cpu variant takes any head_dim)");
}

// What the hopper rung (forward only, wgmma / TMA) does not run yet: Error kUnsupported naming the
// feature and the rung that runs it; rows TMA cannot describe: kInvalidArgument.
void check_hopper(const AttentionParams& p, const std::string& what, bool aligned) {
  const std::string use = " (use flash2 or auto, which run it)";
  if (p.head_dim != 64 && p.head_dim != 128)
    unsupported("head_dim: hopper runs head dims 64 and 128; given " + std::to_string(p.head_dim) + use);
  if (p.softcap > 0) unsupported("softcap: hopper does not run a soft-cap yet; given " + number(p.softcap) + use);
  if (p.alibi) unsupported("alibi_slopes: hopper does not run ALiBi yet; given slopes" + use);
  if (p.mask) unsupported("mask: hopper does not run an explicit mask yet; given a mask" + use);
  if (!aligned)
    invalid(what + ": hopper loads q, k, v by TMA, which needs every row of q, k, v, out to start on a 16-byte "
            "boundary (data pointers and batch / row / head strides multiples of 16 bytes); given a view that "
            "does not (use flash or auto)");
}

// Whether auto runs the hopper forward for p on `device` (attention_config.h: the measured rule).
bool auto_hopper_forward([[maybe_unused]] const AttentionParams& p, [[maybe_unused]] const Device& device,
                         [[maybe_unused]] bool aligned) {
#if OPTIMIZED_WITH_CUDA && OPTIMIZED_WITH_SM90A
  if (!device.is_cuda()) return false;
  const DeviceFacts* facts = nullptr;
  if (device_facts(device.index, &facts) != cudaSuccess) return false;
  return auto_runs_hopper_forward(p, facts->compute_capability, true, aligned);
#else
  return false;
#endif
}

AttentionVariant resolve(AttentionVariant variant, DType dtype, int64_t head_dim, Device device, bool aligned) {
  if (variant != AttentionVariant::kAuto) return variant;
  if (!device.is_cuda()) return AttentionVariant::kCpu;
  if ((dtype == DType::kF16 || dtype == DType::kBF16) && aligned && head_dim % 8 == 0 && head_dim <= 256)
    return AttentionVariant::kFlash2;
  return AttentionVariant::kFlash;
}

// cu_seqlens: 0 first, non-decreasing, last = total rows, every length <= max_seqlen.
void check_seqlens(const std::vector<int32_t>& cu, const char* name, int64_t total, int64_t max_seqlen,
                   const char* max_name) {
  if (cu.front() != 0) invalid(std::string(name) + ": expected cu[0] = 0; given " + std::to_string(cu.front()));
  for (size_t b = 0; b + 1 < cu.size(); ++b) {
    const int64_t len = static_cast<int64_t>(cu[b + 1]) - cu[b];
    if (len < 0)
      invalid(std::string(name) + ": expected non-decreasing offsets; given cu[" + std::to_string(b + 1) + "] = " +
              std::to_string(cu[b + 1]) + " < cu[" + std::to_string(b) + "] = " + std::to_string(cu[b]));
    if (len > max_seqlen)
      invalid(std::string(max_name) + ": expected at least the longest sequence; sequence " + std::to_string(b) +
              " has " + std::to_string(len) + " rows, given " + std::to_string(max_seqlen));
  }
  if (cu.back() != total)
    invalid(std::string(name) + ": expected the last offset to be the packed rows " + std::to_string(total) +
            "; given " + std::to_string(cu.back()));
}

// Reads cu_seqlens back and checks them (the CPU always; CUDA unless the stream is capturing).
void check_cu_seqlens(const AttentionParams& p, Device device, const AttentionOptions& o, const ExecutionContext& ctx,
                      int64_t max_q, int64_t max_k) {
  const size_t n = static_cast<size_t>(p.batch + 1);
  std::vector<int32_t> cq(n), ck(n);
  if (!device.is_cuda()) {
    std::memcpy(cq.data(), p.cu_seqlens_q, n * sizeof(int32_t));
    std::memcpy(ck.data(), p.cu_seqlens_k, n * sizeof(int32_t));
  } else {
    if (!o.check_cu_seqlens) return;
#if OPTIMIZED_WITH_CUDA
    if (cuda_device_count() == 0) return;  // the run refuses the device right after
    DeviceGuard guard(device.index);
    const auto stream = static_cast<cudaStream_t>(ctx.cuda_stream);
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing (cu_seqlens check)");
    if (capture != cudaStreamCaptureStatusNone) return;
    check_cuda(cudaMemcpyAsync(cq.data(), p.cu_seqlens_q, n * sizeof(int32_t), cudaMemcpyDeviceToHost, stream),
               "cudaMemcpyAsync (cu_seqlens_q check)");
    check_cuda(cudaMemcpyAsync(ck.data(), p.cu_seqlens_k, n * sizeof(int32_t), cudaMemcpyDeviceToHost, stream),
               "cudaMemcpyAsync (cu_seqlens_k check)");
    check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize (cu_seqlens check)");
#else
    (void)ctx;
    return;
#endif
  }
  check_seqlens(cq, "cu_seqlens_q", p.total_q, max_q, "max_seqlen_q");
  check_seqlens(ck, "cu_seqlens_k", p.total_k, max_k, "max_seqlen_k");
}

// Resolves the variant, checks it can run the call, and runs it.
void run(AttentionParams& p, Operands& ops, const AttentionOptions& o, AttentionVariant variant,
         const ExecutionContext& ctx) {
  const Dims& d = ops.dims();
  const Device device = ops.device();
  p.dtype = ops.dtype();
  p.batch = d.batch;
  p.heads_q = d.heads_q;
  p.heads_kv = d.heads_kv;
  p.head_dim = d.head_dim;
  p.total_q = d.total_q;
  p.total_k = d.total_k;
  if (!d.varlen) p.seqlen_q = d.seqlen_q, p.seqlen_k = d.seqlen_k;
  ops.check_overlaps();
  const std::string what = std::string("attention") + (d.varlen ? " varlen" : "") + (p.backward ? " backward" : " forward");
  const bool aligned = ops.rows_aligned();
  const bool asked_auto = variant == AttentionVariant::kAuto;
  variant = resolve(variant, p.dtype, p.head_dim, device, aligned);
  if (asked_auto && variant == AttentionVariant::kFlash2 && auto_hopper_forward(p, device, aligned))
    variant = AttentionVariant::kHopper;
  const AttentionVariantInfo& row = attention_variant_info(variant);
  if (std::string why = variant_rejects_device(row, device); !why.empty()) invalid(why);
  if (std::string why = attention_variant_rejects_dtype(variant, p.dtype); !why.empty()) unsupported("q: " + why);
  if (row.backend == Backend::kCuda) {
    check_cuda_head_dim(p.head_dim);
    // Grids put heads and batches on y and z; the kernels index rows of a sequence in 32 bits.
    if (p.batch > 65535 || p.heads_q > 65535)
      unsupported(what + ": the CUDA variants take up to 65535 sequences and 65535 query heads; given batch " +
                  std::to_string(p.batch) + " and " + std::to_string(p.heads_q) + " heads");
    constexpr int64_t k31 = int64_t{1} << 31;
    if (p.seqlen_q >= k31 || p.seqlen_k >= k31 || p.seqlen_q + 2 * p.seqlen_k >= k31 || p.total_q >= k31 ||
        p.total_k >= k31)
      unsupported(what + ": the CUDA variants take sequences with seqlen_q + 2 * seqlen_k < 2^31 and fewer than 2^31 "
                  "packed rows; given seqlen_q " + std::to_string(p.seqlen_q) + ", seqlen_k " +
                  std::to_string(p.seqlen_k) + ", " + std::to_string(p.total_q) + " and " +
                  std::to_string(p.total_k) + " packed rows");
    if (variant == AttentionVariant::kFlash2 && !aligned)
      invalid(what + ": flash2 needs every row of q, k, v, out (and dout, dq, dk, dv) to start on a 16-byte "
              "boundary (data pointers and batch / row / head strides multiples of 16 bytes); given a view that "
              "does not (use flash or auto)");
    if (variant == AttentionVariant::kHopper) check_hopper(p, what, aligned);
    ops.check_workspace(ctx.workspace);
    if (cuda_device_count() == 0)
      unsupported(what + ": operands on " + device_name(device) + " but no CUDA device can be used: " +
                  cuda_unavailable_reason());
  }
  if (d.varlen) check_cu_seqlens(p, device, o, ctx, p.seqlen_q, p.seqlen_k);
  // Nothing to write: no query rows in the forward; no rows at all in the backward (a backward with
  // keys but no queries still writes dk = dv = 0, which the rungs do).
  if (p.batch == 0) return;
  if (!p.backward && p.total_q == 0) return;
  if (p.backward && p.total_q == 0 && p.total_k == 0) return;
  if (row.backend == Backend::kCpu) {
    row.cpu(p, ctx.cpu_threads);
    return;
  }
#if OPTIMIZED_WITH_CUDA
  launch_on_cuda(row, p, device.index, ctx, what + " (" + std::string(row.name) + ")");
#else
  unsupported(what + ": this build has no CUDA backend (built without CUDA)");
#endif
}

void check_max_seqlen(int64_t v, const char* name) {
  if (v < 0) invalid(std::string(name) + ": expected >= 0; given " + std::to_string(v));
}

// ---- the four calls -------------------------------------------------------------------------

// The forward's tensors into p (q first: it fixes dtype and device).
void forward_operands(Operands& ops, AttentionParams& p, const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& out) {
  p.q_s = ops.data(q, "q", true, false);
  p.k_s = ops.data(k, "k", false, false);
  p.v_s = ops.data(v, "v", false, false);
  p.out_s = ops.data(out, "out", true, true);
  p.q = q.data, p.k = k.data, p.v = v.data, p.out = out.data;
}

// The backward's tensors into p.
void backward_operands(Operands& ops, AttentionParams& p, const AttentionOptions& options, const TensorView& dout,
                       const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& dq, const TensorView& dk, const TensorView& dv) {
  p.backward = true;
  p.deterministic = options.deterministic;
  p.q_s = ops.data(q, "q", true, false);
  p.k_s = ops.data(k, "k", false, false);
  p.v_s = ops.data(v, "v", false, false);
  p.out_s = ops.data(out, "out", true, false);
  p.dout_s = ops.data(dout, "dout", true, false);
  p.dq_s = ops.data(dq, "dq", true, true);
  p.dk_s = ops.data(dk, "dk", false, true);
  p.dv_s = ops.data(dv, "dv", false, true);
  p.q = q.data, p.k = k.data, p.v = v.data, p.out = out.data, p.dout = dout.data;
  p.dq = dq.data, p.dk = dk.data, p.dv = dv.data;
}

// Varlen's offsets and bounds into p.
void varlen_operands(Operands& ops, AttentionParams& p, const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                     int64_t max_seqlen_q, int64_t max_seqlen_k) {
  p.cu_seqlens_q = ops.cu_seqlens(cu_seqlens_q, "cu_seqlens_q");
  p.cu_seqlens_k = ops.cu_seqlens(cu_seqlens_k, "cu_seqlens_k");
  check_max_seqlen(max_seqlen_q, "max_seqlen_q");
  check_max_seqlen(max_seqlen_k, "max_seqlen_k");
  ops.dims().varlen = true;
  p.seqlen_q = max_seqlen_q, p.seqlen_k = max_seqlen_k;
}

// lse (written by the forward when given; read, and required, by the backward), the options, the run.
void finish(Operands& ops, AttentionParams& p, const TensorView& lse, const AttentionOptions& options,
            AttentionVariant variant, const ExecutionContext& ctx) {
  ops.lse(lse, !p.backward, p.backward, p);
  apply_options(options, ops, p);
  run(p, ops, options, variant, ctx);
}

}  // namespace

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& lse, const AttentionOptions& options, AttentionVariant variant,
                       const ExecutionContext& ctx) {
  AttentionParams p;
  Operands ops(false);
  forward_operands(ops, p, q, k, v, out);
  finish(ops, p, lse, options, variant, ctx);
}

void attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& lse, const TensorView& dq, const TensorView& dk,
                        const TensorView& dv, const AttentionOptions& options, AttentionVariant variant,
                        const ExecutionContext& ctx) {
  AttentionParams p;
  Operands ops(false);
  backward_operands(ops, p, options, dout, q, k, v, out, dq, dk, dv);
  finish(ops, p, lse, options, variant, ctx);
}

void attention_varlen_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                              const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k, int64_t max_seqlen_q,
                              int64_t max_seqlen_k, const TensorView& out, const TensorView& lse,
                              const AttentionOptions& options, AttentionVariant variant, const ExecutionContext& ctx) {
  AttentionParams p;
  Operands ops(true);
  forward_operands(ops, p, q, k, v, out);
  varlen_operands(ops, p, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  finish(ops, p, lse, options, variant, ctx);
}

void attention_varlen_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k, int64_t max_seqlen_q,
                               int64_t max_seqlen_k, const TensorView& out, const TensorView& lse,
                               const TensorView& dq, const TensorView& dk, const TensorView& dv,
                               const AttentionOptions& options, AttentionVariant variant,
                               const ExecutionContext& ctx) {
  AttentionParams p;
  Operands ops(true);
  backward_operands(ops, p, options, dout, q, k, v, out, dq, dk, dv);
  varlen_operands(ops, p, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  finish(ops, p, lse, options, variant, ctx);
}

// ---- queries --------------------------------------------------------------------------------

AttentionVariant resolve_attention_variant(DType dtype, int64_t head_dim, Device device) {
  if (device.is_cuda() && device.index < 0) invalid("device: expected a CUDA ordinal >= 0; given " + device_name(device));
  if (head_dim < 1) invalid("head_dim: expected >= 1; given " + std::to_string(head_dim));
  if (std::string why = attention_variant_rejects_dtype(AttentionVariant::kAuto, dtype); !why.empty()) unsupported(why);
  if (device.is_cuda() && dtype == DType::kF64)
    unsupported("dtype: fp64 runs on the cpu variant only; given fp64 on " + device_name(device));
  return resolve(AttentionVariant::kAuto, dtype, head_dim, device, true);
}

size_t attention_workspace_bytes(const AttentionShape& shape, DType dtype, Device device, bool backward,
                                 const AttentionOptions& options, AttentionVariant variant) {
  if (shape.batch < 0 || shape.seqlen_q < 0 || shape.seqlen_k < 0 || shape.heads_q < 1 || shape.heads_kv < 1 ||
      shape.head_dim < 1 || shape.heads_q % shape.heads_kv != 0)
    invalid("shape: expected batch, seqlen_q, seqlen_k >= 0, head_dim >= 1 and heads_q a multiple of heads_kv >= 1");
  variant = resolve(variant, dtype, shape.head_dim, device, true);
  const AttentionVariantInfo& row = attention_variant_info(variant);
  if (std::string why = variant_rejects_device(row, device); !why.empty()) invalid(why);
  if (std::string why = attention_variant_rejects_dtype(variant, dtype); !why.empty()) unsupported("dtype: " + why);
  if (row.backend == Backend::kCpu) return 0;
  check_cuda_head_dim(shape.head_dim);
#if OPTIMIZED_WITH_CUDA
  AttentionParams p;
  p.dtype = dtype;
  p.backward = backward;
  p.deterministic = options.deterministic;
  p.batch = shape.batch;
  p.seqlen_q = shape.seqlen_q;
  p.seqlen_k = shape.seqlen_k;
  p.heads_q = shape.heads_q;
  p.heads_kv = shape.heads_kv;
  p.head_dim = shape.head_dim;
  p.total_q = shape.total_q >= 0 ? shape.total_q : shape.batch * shape.seqlen_q;
  p.total_k = shape.batch * shape.seqlen_k;
  if (cuda_device_count() == 0)
    unsupported("attention_workspace_bytes: no CUDA device can be used: " + cuda_unavailable_reason());
  DeviceGuard guard(device.index);
  return launcher_workspace_bytes(row, p, "attention workspace query (" + std::string(row.name) + ")");
#else
  (void)backward, (void)options;
  unsupported("attention_workspace_bytes: this build has no CUDA backend (built without CUDA)");
#endif
}

}  // namespace optimized
