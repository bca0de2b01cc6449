// The CUTLASS peers' table and checks (see cutlass_peers.h). Plain C++: the kernels live in
// bench/gemm/cutlass/*.cu, built only with OPTIMIZED_CUTLASS (OPTIMIZED_WITH_CUTLASS=1 here).
#include "gemm/cutlass_peers.h"

#include <algorithm>
#include <stdexcept>

#include "harness/driver.h"
#include "harness/gpu_timer.h"

#if OPTIMIZED_WITH_CUTLASS
#include "gemm/cutlass/kernels.h"
#endif

namespace bench {

using optimized::DType;

namespace {

#if OPTIMIZED_WITH_CUTLASS
std::string dtype_text(DType d) { return std::string(optimized::dtype_name(d)); }

const std::vector<cutlass_kernels::Entry>& table() {
  static const std::vector<cutlass_kernels::Entry> entries = [] {
    namespace ck = cutlass_kernels;
    std::vector<ck::Entry> e;
    // fp8 rows of bf16's tile shapes that are not built: with the FP8 mainloop's promotion a
    // consumer warpgroup holds two fp32 accumulators of its tile, and 64x256 (cooperative 128x256)
    // or 128x128 (ping-pong 128x128) per warpgroup is 2 x 128 registers per thread: ptxas spilled.
    const auto unbuilt = [&e](const char* peer, const char* reason) {
      e.push_back(ck::Entry{peer, DType::kF8E4M3, DType::kBF16, true, 16, 8, nullptr, reason});
    };
    ck::add_bf16_ws_128x128(e);
    ck::add_bf16_ws_128x256(e);
    ck::add_bf16_pingpong_64x128(e);
    ck::add_bf16_pingpong_128x128(e);
    ck::add_bf16_sm80(e);
    ck::add_fp8_ws_128x128(e);
    ck::add_fp8_ws_128x192(e);
    unbuilt("cutlass_ws_128x256",
            "not built for fp8: with fp32 promotion each warpgroup keeps two accumulators of its 64x256 half-tile, "
            "2 x 128 registers per thread (ptxas spilled); see cutlass_ws_128x192");
    ck::add_fp8_pingpong_64x128(e);
    ck::add_fp8_pingpong_64x192(e);
    unbuilt("cutlass_pingpong_128x128",
            "not built for fp8: with fp32 promotion each ping-pong warpgroup keeps two accumulators of its 128x128 "
            "tile, 2 x 128 registers per thread (ptxas spilled); see cutlass_pingpong_64x192");
    ck::add_fp8_sm89(e);
    return e;
  }();
  return entries;
}
#endif

const char* kNotBuilt =
    "this optimized-bench has no CUTLASS peers: build with -DOPTIMIZED_CUTLASS=ON (or AUTO) on a CUDA build for "
    "sm_90a, with the CUTLASS headers from scripts/fetch-wheels (the nvidia-cutlass wheel in .whl/) or "
    "-DOPTIMIZED_CUTLASS_DIR";


}  // namespace

bool cutlass_peers_built() {
#if OPTIMIZED_WITH_CUTLASS
  return true;
#else
  return false;
#endif
}

std::string cutlass_version() {
#ifdef OPTIMIZED_CUTLASS_VERSION
  return OPTIMIZED_CUTLASS_VERSION;
#else
  return "";
#endif
}

std::vector<std::string> cutlass_peer_names(DType in) {
  std::vector<std::string> out;
#if OPTIMIZED_WITH_CUTLASS
  for (const auto& e : table())
    if (e.in == in && std::find(out.begin(), out.end(), e.peer) == out.end()) out.push_back(e.peer);
#else
  (void)in;
#endif
  return out;
}

std::vector<std::string> parse_cutlass_peers(const std::vector<std::string>& items) {
  std::vector<std::string> out, known = cutlass_peer_names(DType::kBF16);
  for (const std::string& n : cutlass_peer_names(DType::kF8E4M3))
    if (std::find(known.begin(), known.end(), n) == known.end()) known.push_back(n);
  auto add = [&](const std::string& n) {
    if (std::find(out.begin(), out.end(), n) == out.end()) out.push_back(n);
  };
  for (const std::string& item : split_commas(items)) {
    if (item == "none") continue;
    if (!cutlass_peers_built()) throw std::invalid_argument(std::string("--peers ") + item + ": " + kNotBuilt);
    if (item == "cutlass") {
      for (const std::string& n : known) add(n);
    } else if (std::find(known.begin(), known.end(), item) != known.end()) {
      add(item);
    } else {
      std::string choices = "cutlass, none";
      for (const std::string& n : known) choices += ", " + n;
      throw std::invalid_argument("--peers: unknown peer '" + item + "' (supported: " + choices + ")");
    }
  }
  return out;
}

std::string cutlass_peer_rejects(const std::string& name, const CutlassProblem& p) {
#if OPTIMIZED_WITH_CUTLASS
  bool named = false, has_in = false, has_out = false;
  const cutlass_kernels::Entry* match = nullptr;
  for (const auto& e : table()) {
    if (name != e.peer) continue;
    named = true;
    if (e.in != p.in) continue;
    has_in = true;
    if (e.out != p.out) continue;
    has_out = true;
    if (e.b_k_major == p.trans_b) match = &e;
  }
  if (!named) return "unknown CUTLASS peer '" + name + "'";
  if (!has_in) {
    std::string built;
    for (const auto& e : table())
      if (name == e.peer && built.find(dtype_text(e.in)) == std::string::npos)
        built += (built.empty() ? "" : ", ") + dtype_text(e.in);
    return name + " is built for " + built + " only, not " + dtype_text(p.in);
  }
  if (!has_out) return name + " is built with a bf16 C only, not " + dtype_text(p.out);
  for (const auto& e : table())
    if (name == e.peer && e.in == p.in && e.not_built) return e.not_built;
  if (p.trans_a) return "the CUTLASS peers are built for a row-major A only (layouts NN, NT)";
  if (!match) {
    if (p.in == DType::kF8E4M3)
      return "fp8: the CUTLASS peers are built for B stored (N, K) (K-major, layout TN) only, what fp8 wgmma reads "
             "(cuBLASLt, the baseline, gets a K-major copy made outside the timing)";
    return "B stored " + std::string(p.trans_b ? "(N, K)" : "(K, N)") + ": not a layout built for the CUTLASS peers";
  }
  // TMA (sm90) and 16-byte cp.async (sm80): every stored row starts on 16 bytes.
  const auto aligned = [](int64_t v, int a) { return v % a == 0; };
  if (!aligned(p.k, match->align) || (!p.trans_b && !aligned(p.n, match->align)) || !aligned(p.n, match->align_c))
  {
    std::string why = "CUTLASS's kernels here need 16-byte rows (TMA, 16-byte cp.async): K";
    if (!p.trans_b || match->align_c == match->align) why += " and N";
    why += " multiples of " + std::to_string(match->align);
    if (p.trans_b && match->align_c != match->align) why += ", N of " + std::to_string(match->align_c) + " (C)";
    return why + "; given " + std::to_string(p.m) + "x" + std::to_string(p.n) + "x" + std::to_string(p.k);
  }
  if (p.m > INT32_MAX || p.n > INT32_MAX || p.k > INT32_MAX || p.batch > INT32_MAX)
    return "sizes past 2^31 (CUTLASS's problem shape is int)";
  return "";
#else
  (void)name, (void)p;
  return kNotBuilt;
#endif
}

std::string cutlass_device_rejects() {
  static const std::string why = [] {
    const GpuInfo gpu = query_gpu();
    if (!gpu.available) return std::string("no CUDA GPU found");
    if (gpu.cc_major != 9 || gpu.cc_minor != 0)
      return "the CUTLASS peers are compiled for sm_90a alone; this GPU is compute capability " +
             std::to_string(gpu.cc_major) + "." + std::to_string(gpu.cc_minor);
    return std::string();
  }();
  return why;
}

std::unique_ptr<CutlassGemm> make_cutlass_gemm(const std::string& name, const CutlassProblem& p,
                                               const std::vector<CutlassOperands>& sets, void* stream) {
#if OPTIMIZED_WITH_CUTLASS
  const std::string why = cutlass_peer_rejects(name, p);
  if (!why.empty()) throw std::runtime_error(why);
  for (const auto& e : table())
    if (name == e.peer && e.in == p.in && e.out == p.out && e.b_k_major == p.trans_b && e.make)
      return e.make(p, sets, stream);
  throw std::runtime_error("no CUTLASS kernel for " + name);
#else
  (void)name, (void)p, (void)sets, (void)stream;
  throw std::runtime_error(kNotBuilt);
#endif
}

}  // namespace bench
