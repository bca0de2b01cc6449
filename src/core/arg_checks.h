// What the families' public entries (fused.cpp, attention.cpp, kv_cache.cpp, linear.cpp, the GEMM
// operands) share to check arguments and word their errors: the Error shorthands, "absent" optional
// views, numbers and shapes as message text, two checks of a single view, and the operands of one
// call (OperandSet: one device, outputs that overlap nothing else). Host only, internal.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "optimized/core.h"

namespace optimized::arg {

[[noreturn]] inline void invalid(const std::string& message) { throw Error(Status::kInvalidArgument, message); }
[[noreturn]] inline void unsupported(const std::string& message) { throw Error(Status::kUnsupported, message); }

// A dtype's name as a string, for messages ("bf16").
inline std::string dname(DType d) { return std::string(dtype_name(d)); }

// An optional operand passed as an empty view (rank 0) is absent.
inline bool present(const TensorView& t) { return t.rank != 0; }

// A double as the shortest text that reads back to it ("-1", "1e-05", "nan", "inf"). Not through
// an ostream: formatting a double with iostreams crashed inside num_put when the library ran in the
// H100's Python process (GCC 13 build, torch 2.11; C++ test processes were fine), and to_chars needs
// no locale.
inline std::string number(double v) {
  char text[64];
  const std::to_chars_result r = std::to_chars(text, text + sizeof text, v);
  return std::string(text, r.ptr);
}

// "(2, 3, 4)".
inline std::string shape_string(const TensorView& t) {
  std::string s = "(";
  for (int i = 0; i < t.rank; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + ")";
}

// Error kInvalidArgument naming `name` unless t's data is aligned to its element size.
inline void check_element_aligned(const TensorView& t, const char* name) {
  if (reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype) != 0)
    invalid(std::string(name) + ": expected data aligned to the element size (" + std::to_string(dtype_size(t.dtype)) +
            " bytes)");
}

// An output's elements must be distinct memory: sorted by stride, each dimension of size > 1 steps
// past everything the smaller ones span (a zero stride, or head rows interleaved with query rows,
// would have two threads write one address). A view with no element passes.
inline void check_distinct_elements(const TensorView& t, const char* name) {
  for (int i = 0; i < t.rank; ++i)
    if (t.shape[i] == 0) return;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (|stride|, size)
  for (int i = 0; i < t.rank; ++i)
    if (t.shape[i] > 1) dims.push_back({t.strides[i] < 0 ? -t.strides[i] : t.strides[i], t.shape[i]});
  std::sort(dims.begin(), dims.end());
  int64_t span = 1;  // elements covered by the smaller dimensions
  for (const auto& [stride, size] : dims) {
    if (stride < span)
      invalid(std::string(name) + ": expected an output whose elements do not overlap one another; given " +
              t.describe());
    span = stride * (size - 1) + span;
  }
}

// The operands of one call, for the checks they share: add() checks one view -- its extent,
// non-null data, the call's device (the first operand added fixes it), alignment to the element
// size, and for an output distinct elements -- and records it; check_overlaps() then refuses an
// output that overlaps any other operand (`exempt`: pairs of names allowed to share memory).
class OperandSet {
 public:
  void add(const TensorView& t, const char* name, bool output) {
    const ViewExtent extent = view_extent(t, name);
    if (!t.data && extent.numel > 0) invalid(std::string(name) + ": expected a non-null data pointer; given null");
    if (first_.empty()) {
      first_ = name;
      device_ = t.device;
      if (device_.is_cuda() && device_.index < 0)
        invalid(std::string(name) + ": expected a CUDA ordinal >= 0; given " + device_name(device_));
    } else if (!(t.device == device_)) {
      invalid(std::string(name) + ": expected device " + device_name(device_) + " (" + first_ + "'s); given " +
              device_name(t.device));
    }
    check_element_aligned(t, name);
    if (output) check_distinct_elements(t, name);
    record(t, name, output);
  }
  // Records a view checked elsewhere, for check_overlaps.
  void record(const TensorView& t, const char* name, bool output) {
    (output ? outputs_ : inputs_).push_back({&t, name});
  }

  void check_overlaps(bool (*exempt)(const char*, const char*) = nullptr) const {
    for (size_t i = 0; i < outputs_.size(); ++i) {
      const auto& [out, out_name] = outputs_[i];
      const ViewExtent o = view_extent(*out, out_name);
      if (o.bytes == 0) continue;
      auto clash = [&](const TensorView& other, const char* other_name) {
        if (exempt && exempt(out_name, other_name)) return;
        const ViewExtent b = view_extent(other, other_name);
        if (b.bytes > 0 && o.begin < b.end && b.begin < o.end)
          invalid(std::string(out_name) + ": expected an output that does not overlap " + other_name +
                  "; given overlapping memory");
      };
      for (const auto& [in, in_name] : inputs_) clash(*in, in_name);
      for (size_t j = 0; j < outputs_.size(); ++j)
        if (j != i) clash(*outputs_[j].first, outputs_[j].second);
    }
  }

  Device device() const { return device_; }

  // A caller's workspace is scratch the kernels write: it may not overlap any operand recorded.
  void check_workspace(const Workspace& ws) const {
    if (!ws.data || ws.bytes == 0) return;
    const auto w0 = reinterpret_cast<uintptr_t>(ws.data), w1 = w0 + ws.bytes;
    for_each([&](const TensorView& t, const char* name) {
      const ViewExtent e = view_extent(t, name);
      if (e.bytes > 0 && w0 < e.end && e.begin < w1)
        invalid(std::string("workspace: expected memory that does not overlap ") + name + "; given overlapping memory");
    });
  }

  // f(view, name) for every operand recorded, inputs first.
  template <class F>
  void for_each(F&& f) const {
    for (const auto* list : {&inputs_, &outputs_})
      for (const auto& [t, name] : *list) f(*t, name);
  }

 private:
  std::string first_;
  Device device_ = Device::cpu();
  std::vector<std::pair<const TensorView*, const char*>> inputs_, outputs_;
};

}  // namespace optimized::arg
