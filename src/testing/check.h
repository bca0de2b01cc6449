// The result of a check against the float64 reference, shared by every family's check, and the
// reduction rule of tolerance.h applied to one unit of values.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "optimized/core.h"

namespace optimized::testing {

struct CheckResult {
  bool passed = false;
  double worst_ratio = 0;    // max over checked elements of error / allowed (<= 1 passes)
  double max_rel_error = 0;  // ||out - ref||_inf / ||ref||_inf over checked elements
  int64_t checked = 0;       // elements compared
  int64_t failures = 0;      // elements over their bound or with mismatched NaN/Inf
  std::string first_failure; // "C[0, 3, 17] = nan, expected 1.25 (allowed 1e-6)"; empty if passed

  // Folds `other` (another part of the same output, or another output) into this one; `where`
  // prefixes its first failure. A default (empty) result takes other's verdict.
  void merge(const CheckResult& other, const std::string& where = "");
};

// One element against its reference: NaN must meet NaN, an infinite reference must be matched
// exactly, else |got - ref| <= allowed (a NaN got fails). Returns error / allowed (inf when the
// NaN/Inf rule fails), and whether it passed.
bool element_ok(double got, double ref, double allowed, double* ratio);

// The parameters of the reduction rule for one output (tolerance.h).
struct ReductionRule {
  DType out = DType::kF32;  // the output's dtype
  int64_t n = 1;            // the reduction length behind an element
  double u_acc = 0;         // accumulation_unit(), or 2^-24 when fp32 statistics are read
};

// The rule on one unit of `count` values: got[i] against ref[i], with same[i] the same-dtype
// reference (rounded to rule.out here); terms: the magnitude of what was summed into the unit (the
// scale is max(max |ref|, terms)). Accumulates into `into`; name(i) labels element i in the first
// failure ("y[3, 17]").
void check_reduction_unit(const ReductionRule& rule, const double* got, const double* ref, const double* same,
                          int64_t count, double terms, const std::function<std::string(int64_t)>& name,
                          CheckResult& into);

}  // namespace optimized::testing
