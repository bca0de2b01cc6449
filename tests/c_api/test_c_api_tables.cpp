// The C API's variant lists are the C++ tables: a variant added in C++ must be reachable from C,
// by name, in the same order, and checked the same way. C cannot call the C++ tables, so this
// consistency check is C++ (the C program, test_c_api.c, tests the entries themselves).
//
// Three layers are compared for every family:
//   1. the enum: every value whose name no other value shares (so not the name switch's fallback,
//      "unknown" / "?"), or whose name parses back to it, is a named variant; each one but "auto"
//      must parse back to itself (it is in the family's table) and be listed by the C API. This catches a variant added to the enum and
//      its name but forgotten in the table, and, for the loader (which has no all_loader_variants()
//      yet), a variant the C API's list lacks;
//   2. the table (all_gemm_variants(), all_fused_variants(), all_scaled_gemm_variants()): equal, in
//      order, to the C list;
//   3. the C list through each entry: optimized_variant_name(family, i), the family-specific
//      optimized_gemm_variant_name / optimized_fused_variant_name, optimized_variant_count, and
//      optimized_variant_check's verdict against the C++ rule (gemm_variant_rejects_dtype, the
//      variant's device; the scaled GEMM's fp8 inputs).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "optimized/c_api.h"
#include "optimized/core.h"
#include "optimized/attention.h"
#include "optimized/fused.h"
#include "optimized/gemm.h"
#include "optimized/kv_cache.h"
#include "optimized/linear.h"
#include "optimized/loader.h"
#include "optimized/moe.h"

namespace {

using namespace optimized;

std::vector<std::string> c_list(const char* family) {
  std::vector<std::string> out;
  for (int32_t i = 0; const char* name = optimized_variant_name(family, i); ++i) out.emplace_back(name);
  EXPECT_STREQ(optimized_last_error(), "") << family;
  return out;
}

std::vector<std::string> c_list(const char* (*name_at)(int32_t)) {
  std::vector<std::string> out;
  for (int32_t i = 0; const char* name = name_at(i); ++i) out.emplace_back(name);
  return out;
}

// Every value of the enum's 256 that is a named variant, "auto" excluded, in value order: its name
// is its own (shared by no other value: not the name switch's fallback), or parses back to it (the
// loader's name function has no fallback string: every other value reads "pipelined").
template <typename E, typename Name, typename Parse>
std::vector<std::pair<E, std::string>> named_values(Name name, Parse parse) {
  static_assert(sizeof(std::underlying_type_t<E>) == 1, "the scan covers one-byte enums");
  std::map<std::string, int> uses;
  for (int v = 0; v < 256; ++v) ++uses[std::string(name(static_cast<E>(v)))];
  std::vector<std::pair<E, std::string>> out;
  for (int v = 0; v < 256; ++v) {
    const E value = static_cast<E>(v);
    const std::string n(name(value));
    bool round_trip = false;
    try {
      round_trip = parse(n) == value;
    } catch (const Error&) {
    }
    if ((uses[n] == 1 || round_trip) && n != "auto") out.emplace_back(value, n);
  }
  return out;
}

template <typename E, typename Parse>
void expect_named_values_reachable(const std::vector<std::pair<E, std::string>>& named, Parse parse,
                                   const std::vector<std::string>& c_names, const char* family) {
  for (const auto& [value, name] : named) {
    E parsed{};
    try {
      parsed = parse(name);
    } catch (const Error& e) {
      ADD_FAILURE() << family << " variant '" << name << "' (value " << static_cast<int>(value)
                    << ") has a name but is not in the family's table: " << e.what();
      continue;
    }
    EXPECT_EQ(static_cast<int>(parsed), static_cast<int>(value)) << family << " " << name;
    EXPECT_NE(std::find(c_names.begin(), c_names.end(), name), c_names.end())
        << family << " variant '" << name << "' is not reachable from the C API";
  }
}

TEST(CApiTables, FamiliesAreListed) {
  std::vector<std::string> families;
  for (int32_t i = 0; const char* f = optimized_family_name(i); ++i) families.emplace_back(f);
  EXPECT_EQ(families,
            (std::vector<std::string>{"gemm", "fused", "loader", "scaled_gemm", "attention", "kv_cache", "linear", "moe"}));
  for (const std::string& f : families) {
    int32_t count = -1;
    ASSERT_EQ(optimized_variant_count(f.c_str(), &count), OPTIMIZED_STATUS_OK) << optimized_last_error();
    EXPECT_EQ(static_cast<size_t>(count), c_list(f.c_str()).size()) << f;
  }
}

TEST(CApiTables, GemmListIsTheTable) {
  std::vector<std::string> table;
  for (GemmVariant v : all_gemm_variants()) table.emplace_back(gemm_variant_name(v));
  const std::vector<std::string> c_names = c_list("gemm");
  EXPECT_EQ(c_names, table);
  EXPECT_EQ(c_list(optimized_gemm_variant_name), table);
  const auto named = named_values<GemmVariant>(gemm_variant_name, parse_gemm_variant);
  EXPECT_EQ(named.size(), table.size());
  expect_named_values_reachable(named, parse_gemm_variant, c_names, "gemm");
}

TEST(CApiTables, FusedListIsTheTable) {
  std::vector<std::string> table;
  for (FusedVariant v : all_fused_variants()) table.emplace_back(fused_variant_name(v));
  const std::vector<std::string> c_names = c_list("fused");
  EXPECT_EQ(c_names, table);
  EXPECT_EQ(c_list(optimized_fused_variant_name), table);
  const auto named = named_values<FusedVariant>(fused_variant_name, parse_fused_variant);
  EXPECT_EQ(named.size(), table.size());
  expect_named_values_reachable(named, parse_fused_variant, c_names, "fused");

  std::vector<std::string> ops;
  for (FusedOp op : all_fused_ops()) ops.emplace_back(fused_op_name(op));
  EXPECT_EQ(c_list(optimized_fused_op_name), ops);
}

TEST(CApiTables, AttentionListIsTheTable) {
  std::vector<std::string> table;
  for (AttentionVariant v : all_attention_variants()) table.emplace_back(attention_variant_name(v));
  const std::vector<std::string> c_names = c_list("attention");
  EXPECT_EQ(c_names, table);
  const auto named = named_values<AttentionVariant>(attention_variant_name, parse_attention_variant);
  EXPECT_EQ(named.size(), table.size());
  expect_named_values_reachable(named, parse_attention_variant, c_names, "attention");
}

TEST(CApiTables, KvCacheListIsTheTable) {
  std::vector<std::string> table;
  for (KvCacheVariant v : all_kv_cache_variants()) table.emplace_back(kv_cache_variant_name(v));
  const std::vector<std::string> c_names = c_list("kv_cache");
  EXPECT_EQ(c_names, table);
  EXPECT_FALSE(table.empty());
  const auto named = named_values<KvCacheVariant>(kv_cache_variant_name, parse_kv_cache_variant);
  EXPECT_EQ(named.size(), table.size());
  expect_named_values_reachable(named, parse_kv_cache_variant, c_names, "kv_cache");
}

TEST(CApiTables, LinearListIsTheTable) {
  std::vector<std::string> table;
  for (LinearVariant v : all_linear_variants()) table.emplace_back(linear_variant_name(v));
  const std::vector<std::string> c_names = c_list("linear");
  EXPECT_EQ(c_names, table);
  EXPECT_FALSE(table.empty());
  const auto named = named_values<LinearVariant>(linear_variant_name, parse_linear_variant);
  EXPECT_EQ(named.size(), table.size());
  expect_named_values_reachable(named, parse_linear_variant, c_names, "linear");
}

// "moe": the grouped GEMM's rungs (what optimized_moe's variant names).
TEST(CApiTables, MoeListIsTheTable) {
  std::vector<std::string> table;
  for (GroupedGemmVariant v : all_grouped_gemm_variants()) table.emplace_back(grouped_gemm_variant_name(v));
  const std::vector<std::string> c_names = c_list("moe");
  EXPECT_EQ(c_names, table);
  EXPECT_FALSE(table.empty());
  const auto named = named_values<GroupedGemmVariant>(grouped_gemm_variant_name, parse_grouped_gemm_variant);
  EXPECT_EQ(named.size(), table.size());
  expect_named_values_reachable(named, parse_grouped_gemm_variant, c_names, "moe");
}

// "moe": a rung runs on its device the dtypes of its table row (grouped_gemm_variant_rejects_dtype); on
// the other device it is refused by name; "auto" takes fp32, fp16, bf16 on either.
TEST(CApiTables, MoeCheckFollowsTheCppRule) {
  const DType all[] = {DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3, DType::kF8E5M2, DType::kI32, DType::kI64,
                       DType::kF64};
  for (GroupedGemmVariant v : all_grouped_gemm_variants()) {
    const std::string name(grouped_gemm_variant_name(v));
    const int32_t device = grouped_gemm_variant_is_cuda(v) ? OPTIMIZED_DEVICE_CUDA : OPTIMIZED_DEVICE_CPU;
    const int32_t other = device == OPTIMIZED_DEVICE_CPU ? OPTIMIZED_DEVICE_CUDA : OPTIMIZED_DEVICE_CPU;
    for (DType d : all) {
      const std::string why = grouped_gemm_variant_rejects_dtype(v, d);
      const optimized_status s = optimized_variant_check("moe", name.c_str(), static_cast<int32_t>(d), device);
      if (why.empty()) {
        EXPECT_EQ(s, OPTIMIZED_STATUS_OK) << name << " " << dtype_name(d) << ": " << optimized_last_error();
      } else {
        EXPECT_EQ(s, OPTIMIZED_STATUS_UNSUPPORTED) << name << " " << dtype_name(d);
        EXPECT_NE(std::string(optimized_last_error()).find(why), std::string::npos) << optimized_last_error();
      }
      EXPECT_EQ(optimized_variant_check("moe", name.c_str(), static_cast<int32_t>(d), other),
                OPTIMIZED_STATUS_INVALID_ARGUMENT)
          << name;
      EXPECT_EQ(std::string(optimized_last_error()).rfind("variant: " + name, 0), 0u) << optimized_last_error();
    }
  }
  for (int32_t device : {OPTIMIZED_DEVICE_CPU, OPTIMIZED_DEVICE_CUDA})
    for (DType d : all) {
      const bool floating = d == DType::kF32 || d == DType::kF16 || d == DType::kBF16;
      EXPECT_EQ(optimized_variant_check("moe", "auto", static_cast<int32_t>(d), device),
                floating ? OPTIMIZED_STATUS_OK : OPTIMIZED_STATUS_UNSUPPORTED)
          << dtype_name(d) << ": " << optimized_last_error();
    }
}

TEST(CApiTables, ScaledGemmListIsTheTable) {
  std::vector<std::string> table;
  for (ScaledGemmVariant v : all_scaled_gemm_variants()) table.emplace_back(scaled_gemm_variant_name(v));
  const std::vector<std::string> c_names = c_list("scaled_gemm");
  EXPECT_EQ(c_names, table);
  EXPECT_FALSE(table.empty());
  const auto named = named_values<ScaledGemmVariant>(scaled_gemm_variant_name, parse_scaled_gemm_variant);
  EXPECT_EQ(named.size(), table.size());
  expect_named_values_reachable(named, parse_scaled_gemm_variant, c_names, "scaled_gemm");
}

TEST(CApiTables, LoaderListIsEveryNamedVariant) {
  const auto named = named_values<LoaderVariant>(loader_variant_name, parse_loader_variant);
  std::vector<std::string> names;
  for (const auto& [value, name] : named) names.push_back(name);
  const std::vector<std::string> c_names = c_list("loader");
  EXPECT_EQ(c_names, names);
  std::vector<std::string> table;
  for (LoaderVariant v : all_loader_variants()) table.emplace_back(loader_variant_name(v));
  EXPECT_EQ(table, names);
  expect_named_values_reachable(named, parse_loader_variant, c_names, "loader");
}

// The C check's verdict on each listed variant's own device is the C++ rule: OK where
// gemm_variant_rejects_dtype is empty, UNSUPPORTED with that reason where not.
TEST(CApiTables, GemmCheckFollowsTheCppRule) {
  for (GemmVariant v : all_gemm_variants()) {
    const std::string name(gemm_variant_name(v));
    const int32_t device = gemm_variant_is_cuda(v) ? OPTIMIZED_DEVICE_CUDA : OPTIMIZED_DEVICE_CPU;
    for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3, DType::kF8E5M2, DType::kI32, DType::kI64,
                    DType::kF64}) {
      const std::string why = gemm_variant_rejects_dtype(v, d);
      const optimized_status s = optimized_variant_check("gemm", name.c_str(), static_cast<int32_t>(d), device);
      if (why.empty()) {
        EXPECT_EQ(s, OPTIMIZED_STATUS_OK) << name << " " << dtype_name(d) << ": " << optimized_last_error();
      } else {
        EXPECT_EQ(s, OPTIMIZED_STATUS_UNSUPPORTED) << name << " " << dtype_name(d);
        EXPECT_NE(std::string(optimized_last_error()).find(why), std::string::npos) << optimized_last_error();
      }
      // On the other device: refused, naming the variant.
      const int32_t other = device == OPTIMIZED_DEVICE_CPU ? OPTIMIZED_DEVICE_CUDA : OPTIMIZED_DEVICE_CPU;
      EXPECT_EQ(optimized_variant_check("gemm", name.c_str(), static_cast<int32_t>(d), other),
                OPTIMIZED_STATUS_INVALID_ARGUMENT)
          << name;
    }
  }
}

// Scaled GEMM: every listed variant (and auto) takes fp8 inputs, e4m3 and e5m2, on its own device and
// refuses every other dtype (UNSUPPORTED, naming it); on the other device it is refused by name.
TEST(CApiTables, ScaledGemmCheckFollowsTheCppRule) {
  std::vector<std::pair<std::string, bool>> variants = {{"auto", false}, {"auto", true}};
  for (ScaledGemmVariant v : all_scaled_gemm_variants())
    variants.emplace_back(std::string(scaled_gemm_variant_name(v)), scaled_gemm_variant_is_cuda(v));
  for (const auto& [name, cuda] : variants) {
    const int32_t device = cuda ? OPTIMIZED_DEVICE_CUDA : OPTIMIZED_DEVICE_CPU;
    for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3, DType::kF8E5M2, DType::kI32, DType::kI64,
                    DType::kF64}) {
      const bool fp8 = d == DType::kF8E4M3 || d == DType::kF8E5M2;
      const optimized_status s = optimized_variant_check("scaled_gemm", name.c_str(), static_cast<int32_t>(d), device);
      EXPECT_EQ(s, fp8 ? OPTIMIZED_STATUS_OK : OPTIMIZED_STATUS_UNSUPPORTED)
          << name << " " << dtype_name(d) << ": " << optimized_last_error();
      if (!fp8) {
        EXPECT_NE(std::string(optimized_last_error()).find(std::string(dtype_name(d))), std::string::npos)
            << optimized_last_error();
      }
      if (name == "auto") continue;
      const int32_t other = cuda ? OPTIMIZED_DEVICE_CPU : OPTIMIZED_DEVICE_CUDA;
      EXPECT_EQ(optimized_variant_check("scaled_gemm", name.c_str(), static_cast<int32_t>(d), other),
                OPTIMIZED_STATUS_INVALID_ARGUMENT)
          << name;
      EXPECT_EQ(std::string(optimized_last_error()).rfind("variant: " + name, 0), 0u) << optimized_last_error();
    }
  }
  EXPECT_EQ(optimized_variant_check("scaled_gemm", "wgmma", OPTIMIZED_DTYPE_F8E4M3, OPTIMIZED_DEVICE_CUDA),
            OPTIMIZED_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(optimized_last_error()).find("auto, cpu, naive, wgmma_fp8"), std::string::npos)
      << optimized_last_error();
}

// Fused: a variant runs on its device the dtypes resolve_fused_variant takes there.
TEST(CApiTables, FusedCheckFollowsTheCppRule) {
  for (FusedVariant v : all_fused_variants()) {
    const std::string name(fused_variant_name(v));
    const Device device = fused_variant_is_cuda(v) ? Device::cuda(0) : Device::cpu();
    for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3, DType::kF8E5M2, DType::kI32, DType::kI64,
                    DType::kF64}) {
      bool takes = true;
      try {
        resolve_fused_variant(FusedOp::kSoftmax, d, device, 1, false);
      } catch (const Error&) {
        takes = false;
      }
      const optimized_status s = optimized_variant_check("fused", name.c_str(), static_cast<int32_t>(d),
                                                         device.is_cuda() ? OPTIMIZED_DEVICE_CUDA : OPTIMIZED_DEVICE_CPU);
      EXPECT_EQ(s, takes ? OPTIMIZED_STATUS_OK : OPTIMIZED_STATUS_UNSUPPORTED)
          << name << " " << dtype_name(d) << ": " << optimized_last_error();
    }
  }
}

}  // namespace
