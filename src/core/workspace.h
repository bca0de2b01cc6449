// Carving a workspace into the slices of one launch, or measuring what those slices take.
//
// A launcher that needs scratch runs the same code twice: once with a counting arena (no memory)
// to answer its workspace query, once with the caller's workspace to launch. So the size the API
// allocates (or checks a caller's workspace against) and the slices the kernels use cannot
// disagree. Slices are aligned to 256 bytes; mark()/release() give them stack lifetimes, so that
// temporaries whose lives do not overlap share bytes (stream order makes that safe on one stream).
// Host-only and CUDA-free; never throws.
#pragma once

#include <cstddef>
#include <cstdint>

#include "optimized/core.h"

namespace optimized {

class WorkspaceArena {
 public:
  static constexpr size_t kAlignment = 256;

  // Measures: take() returns nullptr and peak() grows.
  WorkspaceArena() = default;
  // Carves `ws`: take() returns slices of it, nullptr (and ok() false) past its end.
  explicit WorkspaceArena(const Workspace& ws)
      : base_(static_cast<char*>(ws.data)), capacity_(ws.bytes), counting_(false) {}

  bool counting() const { return counting_; }
  bool ok() const { return ok_; }
  size_t peak() const { return peak_; }  // bytes the slices taken so far need at most

  // `count` elements of T (count >= 0).
  template <typename T>
  T* take(int64_t count) {
    const size_t bytes = static_cast<size_t>(count) * sizeof(T);
    const size_t begin = top_;
    top_ = begin + (bytes + kAlignment - 1) / kAlignment * kAlignment;
    if (top_ > peak_) peak_ = top_;
    if (counting_) return nullptr;
    if (top_ > capacity_) {
      ok_ = false;
      return nullptr;
    }
    return reinterpret_cast<T*>(base_ + begin);
  }

  // Slices taken after mark() are given back by release(mark).
  size_t mark() const { return top_; }
  void release(size_t mark) { top_ = mark; }

 private:
  char* base_ = nullptr;
  size_t capacity_ = 0;
  bool counting_ = true;
  bool ok_ = true;
  size_t top_ = 0;
  size_t peak_ = 0;
};

// Slices taken in a scope go back when it ends.
class ArenaScope {
 public:
  explicit ArenaScope(WorkspaceArena& arena) : arena_(arena), mark_(arena.mark()) {}
  ~ArenaScope() { arena_.release(mark_); }
  ArenaScope(const ArenaScope&) = delete;
  ArenaScope& operator=(const ArenaScope&) = delete;

 private:
  WorkspaceArena& arena_;
  size_t mark_;
};

}  // namespace optimized
