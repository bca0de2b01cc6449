// The --metrics child's side (see metrics.h): keep one row of the planned groups, and run its first
// timed call between cudaProfilerStart and cudaProfilerStop so that ncu (--profile-from-start off)
// profiles that call's kernels and nothing else.
#pragma once

#include <vector>

#include "harness/family.h"
#include "metrics.h"

namespace bench::metrics {

// Keeps row `row` (the index in report order: groups in order, rows in planned order) of `runs`:
// every other row "skipped" (reason "--only-row"), no baseline of the group's own or another row's,
// one short measurement; the kept row's group wrapped so that its first timed call is profiled.
// Returns false when `row` is out of range or not a CUDA row planned to run.
bool keep_only_row(std::vector<FamilyRun>& runs, int row, RowIdentity& identity);

// The compute capability of device 0 (major*10 + minor), 0 without a GPU.
int device_compute_capability();

RowIdentity identity_of(const Result& r);

}  // namespace bench::metrics
