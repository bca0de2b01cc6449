// The CUDA rungs of the KV-cache family (contiguous_naive, paged, paged_split, auto) through the
// public API against the float64 reference (src/testing/kv_cache_reference.h): page sizes 1, 7, 16,
// 64, 256; sequence lengths 0, 1, 17, 4097 and 1 with 32768 (*Big*); GQA 1 / 4 / 8 and MQA; q_len
// 1..8; softcap / window / ALiBi; fp8 cache; append with RoPE; unchecked mode with bad pages;
// plan / run with an explicit workspace of exactly plan.workspace_bytes. Every test skips without
// a CUDA device, with the reason. Written without a GPU: not yet run.
// TODO (next session, on the GPU): the CUDA-graph capture of append + decode replayed over growing
// steps against eager.
#include <gtest/gtest.h>

#include <cstring>

#include "kv_cache_test_util.h"
#include "testing/kv_cache_reference.h"

namespace optimized::testing {
namespace {

struct DecodeCase {
  DType dtype = DType::kF16, cache = DType::kF16;
  int64_t page_size = 16, hq = 4, hkv = 2, d = 64, q_len = 1;
  std::vector<int64_t> lens = {17, 5};
  int64_t window = -1;
  double softcap = 0;
  int alibi = 0;
  bool planned = false;
};

Buffer to_device(const Buffer& h) {
  Buffer d(h.dtype(), h.count(), Device::cuda(0));
  d.copy_from_host(h.data());
  return d;
}

void run_decode(const DecodeCase& cs, KvCacheVariant variant) {
  auto rng = test_rng();
  HostCache cache(cs.cache, cs.page_size, cs.hkv, cs.d, cs.lens, rng);
  const int64_t B = cache.batch, Q = cs.q_len;
  Buffer q(cs.dtype, B * Q * cs.hq * cs.d, Device::cpu()), out(cs.dtype, q.count(), Device::cpu());
  fill_random(q, rng, -1.5, 1.5);
  Buffer lse(DType::kF32, B * cs.hq * Q, Device::cpu()), lens(DType::kI32, B, Device::cpu()),
      alibi(DType::kF32, B * cs.hq, Device::cpu());
  for (int64_t b = 0; b < B; ++b) static_cast<int32_t*>(lens.data())[b] = static_cast<int32_t>(cs.lens[b]);
  fill_random(alibi, rng, 0.0, 0.5);
  Buffer dk = to_device(cache.k), dv = to_device(cache.v), dt = to_device(cache.table), dq = to_device(q),
         dl = to_device(lens), da = to_device(alibi);
  Buffer dout(cs.dtype, q.count(), Device::cuda(0)), dlse(DType::kF32, lse.count(), Device::cuda(0));
  dout.fill_bytes(0xFF), dlse.fill_bytes(0xFF);  // poison
  Buffer dks, dvs;
  PagedKVCacheView cv;
  cv.k_pages = dk.view({cache.num_pages, cs.page_size, cs.hkv, cs.d});
  cv.v_pages = dv.view({cache.num_pages, cs.page_size, cs.hkv, cs.d});
  if (cs.cache == DType::kF8E4M3) {
    dks = to_device(cache.k_scale), dvs = to_device(cache.v_scale);
    cv.k_scale = dks.view({cs.hkv}), cv.v_scale = dvs.view({cs.hkv});
  }
  DecodeOptions o;
  o.window_left = cs.window, o.softcap = cs.softcap;
  if (cs.alibi == 1) o.alibi_slopes = da.view({cs.hq});
  if (cs.alibi == 2) o.alibi_slopes = da.view({B, cs.hq});
  const TensorView qv = dq.view({B, Q, cs.hq, cs.d}), ov = dout.view({B, Q, cs.hq, cs.d});
  if (cs.planned) {
    int64_t max_len = 0;
    for (int64_t l : cs.lens) max_len = std::max(max_len, l);
    const DecodePlan plan = plan_paged_decode(B, cs.hq, cs.hkv, cs.d, Q, cs.page_size, max_len, cs.dtype, cs.cache,
                                              Device::cuda(0), variant);
    Buffer ws(DType::kI32, static_cast<int64_t>(plan.workspace_bytes / 4 + 1), Device::cuda(0));
    ExecutionContext ctx;
    ctx.workspace = {ws.data(), plan.workspace_bytes};
    o.validate = false;
    paged_attention_decode(qv, cv, dt.view({B, cache.max_pages}), dl.view({B}), ov, dlse.view({B, cs.hq, Q}), o, plan, ctx);
  } else {
    paged_attention_decode(qv, cv, dt.view({B, cache.max_pages}), dl.view({B}), ov, dlse.view({B, cs.hq, Q}), o, variant);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  dout.copy_to_host(out.data());
  dlse.copy_to_host(lse.data());
  KvDecodeParams p;
  p.cache = cache.pages(), p.table = cache.table_params();
  p.dtype = cs.dtype, p.batch = B, p.q_len = Q, p.heads_q = cs.hq;
  p.q = q.data(), p.q_b = Q * cs.hq * cs.d, p.q_t = cs.hq * cs.d, p.q_h = cs.d;
  p.out = out.data(), p.out_b = p.q_b, p.out_t = p.q_t, p.out_h = p.q_h;
  p.lse = static_cast<float*>(lse.data()), p.lse_b = cs.hq * Q, p.lse_h = Q;
  p.seq_lens = static_cast<const int32_t*>(lens.data());
  p.scale = 1.0 / std::sqrt(double(cs.d)), p.window_left = cs.window, p.softcap = cs.softcap;
  if (cs.alibi) p.alibi = static_cast<const float*>(alibi.data()), p.alibi_b = cs.alibi == 2 ? cs.hq : 0;
  const CheckResult r = check_kv_decode(p);
  EXPECT_TRUE(r.passed) << r.first_failure;
}

class CudaKvCache : public ::testing::TestWithParam<KvCacheVariant> {
 protected:
  void SetUp() override { SKIP_WITHOUT_CUDA(); }
};

TEST_P(CudaKvCache, PageSizesAndLengths) {
  for (int64_t ps : {1, 7, 16, 64, 256}) {
    DecodeCase cs;
    cs.page_size = ps, cs.lens = {0, 1, 17, 300};
    SCOPED_TRACE(ps);
    run_decode(cs, GetParam());
  }
}

TEST_P(CudaKvCache, Big4097) {
  DecodeCase cs;
  cs.lens = {4097}, cs.hq = 8, cs.hkv = 2, cs.d = 128;
  run_decode(cs, GetParam());
}

TEST_P(CudaKvCache, BigMixed1And32k) {
  DecodeCase cs;
  cs.lens = {1, 32768}, cs.hq = 8, cs.hkv = 1, cs.d = 128, cs.dtype = cs.cache = DType::kBF16;
  run_decode(cs, GetParam());
}

TEST_P(CudaKvCache, GqaMqaAndQLen) {
  for (auto [hq, hkv] : std::vector<std::pair<int64_t, int64_t>>{{2, 2}, {8, 2}, {16, 2}, {32, 1}})
    for (int64_t ql : {1, 3, 8}) {
      DecodeCase cs;
      cs.hq = hq, cs.hkv = hkv, cs.q_len = ql, cs.lens = {40, 8, 0}, cs.page_size = 7;
      SCOPED_TRACE(hq * 100 + ql);
      run_decode(cs, GetParam());
    }
}

TEST_P(CudaKvCache, SoftcapWindowAlibiDtypes) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    DecodeCase cs;
    cs.dtype = cs.cache = dt, cs.q_len = 3, cs.lens = {100, 33}, cs.window = 20, cs.softcap = 5.0, cs.alibi = 1, cs.d = 40;
    run_decode(cs, GetParam());
    cs.alibi = 2, cs.window = 0;
    run_decode(cs, GetParam());
  }
}

TEST_P(CudaKvCache, Fp8Cache) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    DecodeCase cs;
    cs.dtype = dt, cs.cache = DType::kF8E4M3, cs.lens = {77, 600}, cs.q_len = 2;
    run_decode(cs, GetParam());
  }
}

TEST_P(CudaKvCache, PlanRunExactWorkspace) {
  DecodeCase cs;
  cs.lens = {3000}, cs.hq = 8, cs.hkv = 2, cs.d = 128, cs.planned = true;
  run_decode(cs, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Rungs, CudaKvCache,
                         ::testing::Values(KvCacheVariant::kContiguousNaive, KvCacheVariant::kPaged,
                                           KvCacheVariant::kPagedSplit, KvCacheVariant::kAuto),
                         [](const auto& info) { return std::string(kv_cache_variant_name(info.param)); });

}  // namespace
}  // namespace optimized::testing
