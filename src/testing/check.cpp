// CheckResult and the per-unit reduction check (see check.h).
#include "testing/check.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "testing/tolerance.h"

namespace optimized::testing {

void CheckResult::merge(const CheckResult& other, const std::string& where) {
  const bool was_empty = checked == 0 && failures == 0 && first_failure.empty();
  if (first_failure.empty() && !other.first_failure.empty()) first_failure = where + other.first_failure;
  checked += other.checked;
  failures += other.failures;
  worst_ratio = std::max(worst_ratio, other.worst_ratio);
  max_rel_error = std::max(max_rel_error, other.max_rel_error);
  passed = (was_empty || passed) && other.passed && failures == 0;
}

bool element_ok(double got, double ref, double allowed, double* ratio) {
  if (std::isnan(ref) || std::isnan(got) || std::isinf(ref)) {
    const bool ok = (std::isnan(ref) && std::isnan(got)) || (std::isinf(ref) && got == ref);
    *ratio = ok ? 0.0 : INFINITY;
    return ok;
  }
  // A finite reference beyond the dtype's range legitimately rounds to Inf only when the bound says so.
  const double err = std::isinf(got) ? INFINITY : std::fabs(got - ref);
  *ratio = allowed > 0 ? err / allowed : (err > 0 ? INFINITY : 0.0);
  return err <= allowed;
}

void check_reduction_unit(const ReductionRule& rule, const double* got, const double* ref, const double* same,
                          int64_t count, double terms, const std::function<std::string(int64_t)>& name,
                          CheckResult& into) {
  double same_error = 0, max_ref = 0, max_err = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (!std::isfinite(ref[i])) continue;
    max_ref = std::max(max_ref, std::fabs(ref[i]));
    const double s = round_to(rule.out, same[i]);
    if (std::isfinite(s)) same_error = std::max(same_error, std::fabs(s - ref[i]));
  }
  const double t = std::isfinite(terms) ? terms : 0.0;
  const double allowed = reduction_allowed_error(rule.out, rule.n, same_error, max_ref, t, rule.u_acc);
  const double scale = std::max(max_ref, t);
  CheckResult r;
  for (int64_t i = 0; i < count; ++i) {
    double ratio = 0;
    const bool ok = element_ok(got[i], ref[i], allowed, &ratio);
    ++r.checked;
    r.worst_ratio = std::max(r.worst_ratio, ratio);
    if (std::isfinite(ref[i]) && std::isfinite(got[i])) max_err = std::max(max_err, std::fabs(got[i] - ref[i]));
    if (!ok && r.failures++ == 0) {
      std::ostringstream s;
      s.precision(9);
      s << name(i) << " = " << got[i] << ", expected " << ref[i] << " (error " << std::fabs(got[i] - ref[i])
        << ", allowed " << allowed << ": 2 x the same-dtype reference's " << same_error << " + noise at scale "
        << scale << ")";
      r.first_failure = s.str();
    }
  }
  r.max_rel_error = max_ref > 0 ? max_err / max_ref : max_err;
  r.passed = r.failures == 0;
  into.merge(r);
}

}  // namespace optimized::testing
