// The table of the CUTLASS peers' kernels (bench/gemm/cutlass_peers.h): one entry per (peer, input
// dtype, B layout), each made in a translation unit of its own under bench/gemm/cutlass/ (the sm90
// templates compile slowly: split, they build in parallel and ccache keeps them). No CUTLASS here.
#pragma once

#include <memory>
#include <vector>

#include "gemm/cutlass_peers.h"

namespace bench::cutlass_kernels {

struct Entry {
  const char* peer;              // "cutlass_ws_128x128"
  optimized::DType in, out;      // A and B; C
  bool b_k_major;                // B stored (N, K) (our trans_b, "NT"); else (K, N) row-major ("NN")
  int align;                     // elements per 16 bytes of A / B: K, and N for a row-major B
  int align_c;                   // elements per 16 bytes of C: N
  std::unique_ptr<CutlassGemm> (*make)(const CutlassProblem&, const std::vector<CutlassOperands>&, void* stream);
  const char* not_built = nullptr;  // a table row without a kernel (make null): why (the row's skip reason)
};

// Each translation unit appends its kernels (bench/gemm/cutlass/<dtype>_<peer>.cu).
void add_bf16_ws_128x128(std::vector<Entry>& out);
void add_bf16_ws_128x256(std::vector<Entry>& out);
void add_bf16_pingpong_64x128(std::vector<Entry>& out);
void add_bf16_pingpong_128x128(std::vector<Entry>& out);
void add_bf16_sm80(std::vector<Entry>& out);
void add_fp8_ws_128x128(std::vector<Entry>& out);
void add_fp8_ws_128x192(std::vector<Entry>& out);
void add_fp8_pingpong_64x128(std::vector<Entry>& out);
void add_fp8_pingpong_64x192(std::vector<Entry>& out);
void add_fp8_sm89(std::vector<Entry>& out);

}  // namespace bench::cutlass_kernels
