// What every family's variant table is made of, and what is generated from it.
//
// A family lists its variants once, in a constexpr table of VariantInfo (src/<family>/
// <family>_variants.h): enum, name, backend, dtypes, minimum compute capability, launcher (and the
// launcher's workspace query and resource report). Names and parsing, the list of variants, which
// variants run a dtype, the refusals' messages and the dispatch are read from that table; nothing
// else in the family spells a variant's name or its dtypes again. Host-only, CUDA-free.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

#include "optimized/core.h"

#if OPTIMIZED_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace optimized {

enum class Backend : uint8_t { kCpu, kCuda };

// The function types a table holds: the CPU backend (params, cpu_threads), and under the launcher
// contract (core/cuda_launch.h) the launcher, its workspace query and its kernel report. A build
// without CUDA has none of the latter: their types are std::nullptr_t and OPTIMIZED_CUDA_FN(f) is
// nullptr there.
template <typename Params>
using CpuBackendFn = void (*)(const Params&, int cpu_threads);
#if OPTIMIZED_WITH_CUDA
template <typename Params>
using LauncherFn = cudaError_t (*)(const Params&, const Workspace&, cudaStream_t);
template <typename Params>
using WorkspaceQueryFn = cudaError_t (*)(const Params&, size_t* bytes);
template <typename Params, typename Report>
using ResourcesFn = cudaError_t (*)(const Params&, Report*);
#define OPTIMIZED_CUDA_FN(function) &function
#if OPTIMIZED_WITH_SM90A
#define OPTIMIZED_SM90A_FN(function) &function
#else
#define OPTIMIZED_SM90A_FN(function) nullptr
#endif
#else
template <typename Params>
using LauncherFn = std::nullptr_t;
template <typename Params>
using WorkspaceQueryFn = std::nullptr_t;
template <typename Params, typename Report>
using ResourcesFn = std::nullptr_t;
#define OPTIMIZED_CUDA_FN(function) nullptr
#define OPTIMIZED_SM90A_FN(function) nullptr
#endif

// A row's architecture rule: kAtLeast runs on min_compute_capability or newer; kArchSpecific is
// code for one architecture's 'a' target (sm_90a: wgmma, setmaxnreg), which runs on exactly that
// compute capability.
enum class ArchRule : uint8_t { kAtLeast, kArchSpecific };
inline constexpr ArchRule kArchSpecific = ArchRule::kArchSpecific;

// A set of dtypes.
class DTypeSet {
 public:
  constexpr DTypeSet() = default;
  constexpr DTypeSet(std::initializer_list<DType> dtypes) {
    for (DType d : dtypes) bits_ |= bit(d);
  }
  constexpr bool has(DType d) const { return (bits_ & bit(d)) != 0; }
  constexpr DTypeSet operator|(DTypeSet o) const { return DTypeSet(bits_ | o.bits_); }
  // "fp32, fp16, bf16" (in DType order).
  std::string names() const {
    std::string s;
    for (int i = 0; i < 32; ++i)
      if (bits_ & (1u << i)) s += (s.empty() ? "" : ", ") + std::string(dtype_name(static_cast<DType>(i)));
    return s;
  }

 private:
  constexpr explicit DTypeSet(uint32_t bits) : bits_(bits) {}
  static constexpr uint32_t bit(DType d) { return 1u << static_cast<unsigned>(d); }
  uint32_t bits_ = 0;
};

// One row of a family's table. Cpu / Launch / Workspace / Resources: the family's function pointer
// types (std::nullptr_t where a build has none, e.g. the CUDA launchers of a CPU-only build).
template <typename Variant, typename Cpu, typename Launch, typename WorkspaceQuery, typename Resources>
struct VariantInfo {
  Variant variant;
  std::string_view name;           // what users type: "mma_pipeline"
  Backend backend;
  DTypeSet dtypes;                 // what it runs
  int min_compute_capability;      // CUDA: major * 10 + minor the kernels need (0 on the CPU)
  std::string_view dtype_note;     // why the dtypes are what they are ("tensor cores"), or empty
  Cpu cpu;                         // backend kCpu: the host implementation
  Launch launch;                   // backend kCuda: the launcher (null in CPU-only builds)
  WorkspaceQuery workspace;        // the launcher's workspace query; null: needs none
  Resources resources;             // the launcher's kernel report; null: none
  ArchRule arch = ArchRule::kAtLeast;  // how min_compute_capability reads
};

// ---- what the table generates (Table: a std::array of VariantInfo) --------------------------

// The table's variants in its order (what all_<family>_variants() returns).
template <typename Row, size_t N>
constexpr auto variant_enums(const std::array<Row, N>& table) {
  std::array<decltype(Row::variant), N> out{};
  for (size_t i = 0; i < N; ++i) out[i] = table[i].variant;
  return out;
}

// The row of `v`; null for the family's auto value.
template <typename Table, typename Variant>
constexpr const typename Table::value_type* find_variant(const Table& table, Variant v) {
  for (const auto& row : table)
    if (row.variant == v) return &row;
  return nullptr;
}

// The row of `v`; Error kInternal for the auto value (resolve it first).
template <typename Table, typename Variant>
const typename Table::value_type& variant_row(const Table& table, Variant v) {
  if (const auto* row = find_variant(table, v)) return *row;
  throw Error(Status::kInternal, "variant: auto has no row in the variant table (resolve it first)");
}

template <typename Table, typename Variant>
std::string_view variant_name(const Table& table, Variant v) {
  const auto* row = find_variant(table, v);
  return row ? row->name : std::string_view("auto");
}

// "auto, cpu_naive, ..." (auto first, then the table's order).
template <typename Table>
std::string variant_choices(const Table& table) {
  std::string s = "auto";
  for (const auto& row : table) s += ", " + std::string(row.name);
  return s;
}

// The variant called `name` ("auto" gives auto_value); otherwise Error kInvalidArgument
// "variant: expected one of auto, ...; given 'x'".
template <typename Table, typename Variant>
Variant parse_variant(const Table& table, std::string_view name, Variant auto_value) {
  if (name == "auto") return auto_value;
  for (const auto& row : table)
    if (row.name == name) return row.variant;
  throw Error(Status::kInvalidArgument,
              "variant: expected one of " + variant_choices(table) + "; given '" + std::string(name) + "'");
}

// Every dtype some variant of the table runs.
template <typename Table>
DTypeSet table_dtypes(const Table& table) {
  DTypeSet all;
  for (const auto& row : table) all = all | row.dtypes;
  return all;
}

// "cpu_naive, cpu_blocked": the variants that run `dtype`.
template <typename Table>
std::string variants_running(const Table& table, DType dtype) {
  std::string s;
  for (const auto& row : table)
    if (row.dtypes.has(dtype)) s += (s.empty() ? "" : ", ") + std::string(row.name);
  return s;
}

// Whether `v` (not the auto value) runs on CUDA; its minimum compute capability (0: auto or CPU).
template <typename Table, typename Variant>
bool variant_is_cuda(const Table& table, Variant v) {
  const auto* row = find_variant(table, v);
  return row && row->backend == Backend::kCuda;
}
template <typename Table, typename Variant>
int variant_min_compute_capability(const Table& table, Variant v) {
  const auto* row = find_variant(table, v);
  return row ? row->min_compute_capability : 0;
}

// Empty when `row` runs `dtype`; otherwise why not: "<name> supports <dtypes> (<note>); given
// <dtype>", the note being the row's, else where the dtype runs ("fp64 runs on cpu_naive, ...").
// A dtype no variant runs: "<family> supports <every dtype>; given <dtype>".
template <typename Table, typename Row>
std::string variant_rejects_dtype(const Table& table, const Row& row, DType dtype, std::string_view family) {
  if (row.dtypes.has(dtype)) return "";
  const std::string given = "; given " + std::string(dtype_name(dtype));
  if (!table_dtypes(table).has(dtype))
    return std::string(family) + " supports " + table_dtypes(table).names() + given;
  const std::string note = !row.dtype_note.empty()
                               ? std::string(row.dtype_note)
                               : std::string(dtype_name(dtype)) + " runs on " + variants_running(table, dtype);
  return std::string(row.name) + " supports " + row.dtypes.names() + " (" + note + ")" + given;
}

}  // namespace optimized

namespace optimized {

// Empty when `row` runs on tensors of `device`'s kind; otherwise "variant: <name> runs on CUDA
// tensors; given tensors on cpu" (and the CPU way round).
template <typename Row>
std::string variant_rejects_device(const Row& row, const Device& device) {
  const bool cuda = row.backend == Backend::kCuda;
  if (cuda == device.is_cuda()) return "";
  return "variant: " + std::string(row.name) + " runs on " + (cuda ? "CUDA" : "the CPU") + " tensors; given tensors on " +
         device_name(device);
}

// variant_rejects_dtype for a variant of the table, or (the auto value, not in the table) for the
// family as a whole: auto runs whatever some variant runs.
template <typename Table, typename Variant>
std::string variant_or_auto_rejects_dtype(const Table& table, Variant v, DType dtype, std::string_view family) {
  if (const auto* row = find_variant(table, v)) return variant_rejects_dtype(table, *row, dtype, family);
  const DTypeSet all = table_dtypes(table);
  return all.has(dtype) ? "" : std::string(family) + " supports " + all.names() + "; given " + std::string(dtype_name(dtype));
}

}  // namespace optimized
