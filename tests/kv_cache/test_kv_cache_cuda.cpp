// The CUDA rungs of the KV-cache family (contiguous_naive, paged, paged_split, paged_mma, auto)
// through the
// public API against the float64 reference (src/testing/kv_cache_reference.h): page sizes 1, 7, 16,
// 64, 256; sequence lengths 0, 1, 17, 4097 and 1 with 32768 (*Big*); GQA 1 / 4 / 8 and MQA; q_len
// 1..8; softcap / window / ALiBi; fp8 cache; append with RoPE; unchecked mode with bad pages;
// plan / run with an explicit workspace of exactly plan.workspace_bytes; a CUDA-graph capture of
// append + planned decode (validate off, explicit workspace, own stream) replayed over 100 growing
// steps, bitwise equal to eager calls and close to the float64 reference. paged_mma takes
// fp16 / bf16 q with head_dim 64 / 128 / 256: on any other case it must refuse with an Error
// (checked). Every
// test skips without a CUDA device, with the reason.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

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
  bool prefill = false;  // paged_attention_prefill
  bool validate = true;  // false: seq_lens and the page table are not read back (prefill's gather sized by capacity)
  int64_t gap = 0;       // rows between sequences of q / out (a slice of a longer prompt)
};

Buffer to_device(const Buffer& h) {
  Buffer d(h.dtype(), h.count(), Device::cuda(0));
  d.copy_from_host(h.data());
  return d;
}


// The device copy of a HostCache (pages, scales, page table) and its views.
struct DeviceCache {
  const HostCache& h;
  Buffer k, v, ks, vs, table;
  explicit DeviceCache(const HostCache& host) : h(host), k(to_device(host.k)), v(to_device(host.v)), table(to_device(host.table)) {
    if (host.dtype == DType::kF8E4M3) ks = to_device(host.k_scale), vs = to_device(host.v_scale);
  }
  PagedKVCacheView view() const {
    PagedKVCacheView c;
    c.k_pages = k.view({h.num_pages, h.page_size, h.heads_kv, h.head_dim});
    c.v_pages = v.view({h.num_pages, h.page_size, h.heads_kv, h.head_dim});
    if (h.dtype == DType::kF8E4M3) c.k_scale = ks.view({h.heads_kv}), c.v_scale = vs.view({h.heads_kv});
    return c;
  }
  TensorView table_view() const { return table.view({h.batch, h.max_pages}); }
  void to_host(HostCache& host) const {  // the pages back into the host cache
    k.copy_to_host(host.k.data());
    v.copy_to_host(host.v.data());
  }
};

// What paged_mma runs (kv_cache.h): fp16 / bf16 q, head_dim 64, 128 or 256.
bool mma_takes(const DecodeCase& cs) {
  return (cs.dtype == DType::kF16 || cs.dtype == DType::kBF16) && (cs.d == 64 || cs.d == 128 || cs.d == 256);
}

void run_decode(const DecodeCase& cs, KvCacheVariant variant) {
  const bool refused = variant == KvCacheVariant::kPagedMma && !mma_takes(cs);
  auto rng = test_rng();
  HostCache cache(cs.cache, cs.page_size, cs.hkv, cs.d, cs.lens, rng);
  const int64_t B = cache.batch, Q = cs.q_len, seq = (Q + cs.gap) * cs.hq * cs.d;
  Buffer q(cs.dtype, B * seq, Device::cpu()), out(cs.dtype, q.count(), Device::cpu());
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
  const TensorView qv = dq.view({B, Q, cs.hq, cs.d}, {seq, cs.hq * cs.d, cs.d, 1});
  const TensorView ov = dout.view({B, Q, cs.hq, cs.d}, {seq, cs.hq * cs.d, cs.d, 1});
  if (refused) {  // paged_mma: a clear Error, the output left alone
    EXPECT_THROW(paged_attention_decode(qv, cv, dt.view({B, cache.max_pages}), dl.view({B}), ov, dlse.view({B, cs.hq, Q}),
                                        o, variant),
                 Error);
    return;
  }
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
  } else if (cs.prefill) {
    o.validate = cs.validate;
    paged_attention_prefill(qv, cv, dt.view({B, cache.max_pages}), dl.view({B}), ov, dlse.view({B, cs.hq, Q}), o, variant);
  } else {
    paged_attention_decode(qv, cv, dt.view({B, cache.max_pages}), dl.view({B}), ov, dlse.view({B, cs.hq, Q}), o, variant);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  dout.copy_to_host(out.data());
  dlse.copy_to_host(lse.data());
  expect_decode_matches(cache, {cs.dtype, Q, cs.hq, 0, &q, &out, &lse, &lens, cs.window, cs.softcap,
                               cs.alibi ? &alibi : nullptr, cs.alibi == 2, cs.gap});
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
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16})
    for (int64_t d : {40, 128}) {
      DecodeCase cs;
      cs.dtype = cs.cache = dt, cs.q_len = 3, cs.lens = {100, 33}, cs.window = 20, cs.softcap = 5.0, cs.alibi = 1, cs.d = d;
      SCOPED_TRACE(d);
      run_decode(cs, GetParam());
      cs.alibi = 2, cs.window = 0;
      run_decode(cs, GetParam());
    }
}

TEST_P(CudaKvCache, Fp8Cache) {
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16})
    for (int64_t d : {64, 256}) {
      DecodeCase cs;
      cs.dtype = dt, cs.cache = DType::kF8E4M3, cs.lens = {77, 600}, cs.q_len = 2, cs.d = d;
      SCOPED_TRACE(d);
      run_decode(cs, GetParam());
    }
}

// Prefill over the cache: chunks of 37, 70 and 200 queries, right-aligned (a sequence of 20 < 37
// tokens leaves rows at negative positions: out 0, lse -inf), GQA 4, windows, ALiBi, softcap, bf16
// d = 128, an fp8 cache; auto takes the gather + flash2 path for the chunks of 64 or more.
TEST_P(CudaKvCache, PrefillChunks) {
  DecodeCase cs;
  cs.prefill = true, cs.q_len = 37, cs.lens = {300, 37, 20, 0}, cs.hq = 8, cs.hkv = 2;
  run_decode(cs, GetParam());
  cs.window = 50, cs.alibi = 1;
  run_decode(cs, GetParam());
  DecodeCase big;
  big.prefill = true, big.q_len = 200, big.lens = {1000, 250}, big.hq = 8, big.hkv = 2, big.d = 128;
  big.dtype = big.cache = DType::kBF16;
  run_decode(big, GetParam());  // auto: the gather + flash2 path (a chunk of >= 64, bf16, d = 128)
  big.window = 300, big.alibi = 2, big.softcap = 20.0;
  run_decode(big, GetParam());
  DecodeCase fp8;  // fp8 pages dequantized by the gather (auto) or the rungs
  fp8.prefill = true, fp8.q_len = 70, fp8.lens = {500, 90}, fp8.hq = 8, fp8.hkv = 2, fp8.cache = DType::kF8E4M3;
  run_decode(fp8, GetParam());
  fp8.dtype = DType::kF16;  // auto: the gather dequantizes into f16 buffers for flash2
  run_decode(fp8, GetParam());
  // auto's varlen route with short (60 < 100) and empty sequences, one sequence of exactly the chunk,
  // validated (buffers sized by the longest) and not (sized by the pages' capacity, offsets on the device).
  DecodeCase ragged;
  ragged.prefill = true, ragged.q_len = 100, ragged.lens = {400, 60, 0, 100}, ragged.hq = 4, ragged.hkv = 4;
  ragged.dtype = ragged.cache = DType::kBF16, ragged.page_size = 32;
  for (bool validate : {true, false}) {
    SCOPED_TRACE(validate);
    ragged.validate = validate;
    run_decode(ragged, GetParam());
  }
  ragged.gap = 7;  // q and out sliced out of longer prompts: auto packs them (2-D copies) and back
  run_decode(ragged, GetParam());
  DecodeCase one;  // one sequence: lse written straight into the caller's view
  one.prefill = true, one.q_len = 64, one.lens = {129}, one.d = 256, one.hq = 2, one.hkv = 1;
  run_decode(one, GetParam());
}

// The head dims and GQA packings of the tensor-core rung, over several splits (plan) and one.
TEST_P(CudaKvCache, HeadDimsPlannedAndNot) {
  for (int64_t d : {64, 128, 256})
    for (bool planned : {false, true}) {
      DecodeCase cs;
      cs.dtype = cs.cache = DType::kBF16, cs.d = d, cs.hq = 8, cs.hkv = 1, cs.q_len = 2, cs.lens = {1000, 3, 129};
      cs.page_size = 16, cs.planned = planned;
      SCOPED_TRACE(d * 10 + planned);
      run_decode(cs, GetParam());
    }
}

TEST_P(CudaKvCache, PlanRunExactWorkspace) {
  DecodeCase cs;
  cs.lens = {3000}, cs.hq = 8, cs.hkv = 2, cs.d = 128, cs.planned = true;
  run_decode(cs, GetParam());
}

// Append with RoPE (neox / interleaved, rotary_dim < head_dim, fp8 cache, q rotated in place) on a
// CUDA variant against the float64 append reference; unwritten slots keep their bytes.
void run_append_cuda(KvCacheVariant variant, DType dt, DType cache_dt, RopeLayout layout, int64_t rotary_dim,
                     int64_t S) {
  auto rng = test_rng();
  AppendCase c(dt, cache_dt, layout, rotary_dim, S, 64, rng);
  const int64_t B = c.B, H = c.H, Hq = c.Hq, D = c.D;
  DeviceCache dc(c.cache);
  Buffer dk = to_device(c.k), dv = to_device(c.v), dq = to_device(c.q), dpos = to_device(c.pos);
  append_kv(dc.view(), dk.view({B, S, H, D}), dv.view({B, S, H, D}), dc.table_view(), dpos.view({B, S}),
            dq.view({B, S, Hq, D}), c.rope, true, variant);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  dc.to_host(c.cache);
  dq.copy_to_host(c.q.data());  // the rotated q, for the check
  c.check();
}

TEST_P(CudaKvCache, AppendRope) {
  for (RopeLayout l : {RopeLayout::kNone, RopeLayout::kNeox, RopeLayout::kInterleaved})
    for (int64_t rd : {0, 32}) {
      SCOPED_TRACE(static_cast<int>(l) * 100 + rd);
      run_append_cuda(GetParam(), DType::kF32, DType::kF32, l, rd, 5);
      run_append_cuda(GetParam(), DType::kBF16, DType::kBF16, l, rd, 1);
      run_append_cuda(GetParam(), DType::kF16, DType::kF16, l, rd, 3);
      run_append_cuda(GetParam(), DType::kF16, DType::kF8E4M3, l, rd, 4);
      run_append_cuda(GetParam(), DType::kBF16, DType::kF8E4M3, l, rd, 2);
    }
}

// Unchecked mode: out-of-range page indices (2^30, -5) and a seq_len past the table read as masked
// keys (never out of bounds, no CUDA error); validate refuses them. fp32 with head_dim 16, or fp16
// with 64 on paged_mma (what it takes).
TEST_P(CudaKvCache, UncheckedBadPagesMasked) {
  const bool mma = GetParam() == KvCacheVariant::kPagedMma;
  const DType dt = mma ? DType::kF16 : DType::kF32;
  const int64_t D = mma ? 64 : 16;
  for (int32_t len : {40, 100}) {
    SCOPED_TRACE(len);
    auto rng = test_rng();
    HostCache cache(dt, 8, 2, D, {40}, rng);  // 5 pages of 8: 40 tokens
    cache.entries()[2] = 1 << 30;  // tokens 16..23
    cache.entries()[3] = -5;       // tokens 24..31
    Buffer q(dt, 2 * 4 * D, Device::cpu()), out(dt, q.count(), Device::cpu()),
        lens(DType::kI32, 1, Device::cpu()), lse(DType::kF32, 4 * 2, Device::cpu());
    fill_random(q, rng);
    static_cast<int32_t*>(lens.data())[0] = len;
    DeviceCache dc(cache);
    Buffer dq = to_device(q), dl = to_device(lens), dout(dt, q.count(), Device::cuda(0)),
           dlse(DType::kF32, lse.count(), Device::cuda(0));
    dout.fill_bytes(0xFF), dlse.fill_bytes(0xFF);
    DecodeOptions o;
    EXPECT_THROW(paged_attention_decode(dq.view({1, 2, 4, D}), dc.view(), dc.table_view(), dl.view({1}),
                                        dout.view({1, 2, 4, D}), dlse.view({1, 4, 2}), o, GetParam()),
                 Error);
    o.validate = false;
    paged_attention_decode(dq.view({1, 2, 4, D}), dc.view(), dc.table_view(), dl.view({1}), dout.view({1, 2, 4, D}),
                           dlse.view({1, 4, 2}), o, GetParam());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    dout.copy_to_host(out.data());
    dlse.copy_to_host(lse.data());
    expect_decode_matches(cache, {dt, 2, 4, 0, &q, &out, &lse, &lens});
  }
}

#define ASSERT_CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

// A CUDA graph of one decode step -- append the new token of each sequence (RoPE neox on k and q),
// then the planned decode with an explicit workspace, validate off -- captured once on an own
// stream and replayed over 100 growing steps; positions, seq_lens and the new k / v / q are
// uploaded with cudaMemcpyAsync on the stream between replays (outside the graph). Each replay's
// out and lse equal (bitwise) an eager run of the same calls on a twin cache; at a few steps the
// out is checked against the float64 reference.
TEST_P(CudaKvCache, GraphReplayGrowingSteps) {
  const KvCacheVariant variant = GetParam();
  auto rng = test_rng();
  const int64_t B = 2, Hq = 8, Hkv = 2, D = 64, P = 16, steps = 100;
  const std::vector<int64_t> start = {50, 300};
  HostCache cache(DType::kF16, P, Hkv, D, {start[0] + steps, start[1] + steps}, rng);
  DeviceCache graph_cache(cache), eager_cache(cache);
  const DecodePlan plan = plan_paged_decode(B, Hq, Hkv, D, 1, P, start[1] + steps, DType::kF16, DType::kF16,
                                            Device::cuda(0), variant);
  ASSERT_NE(plan.variant, KvCacheVariant::kAuto);
  const int64_t ws_words = static_cast<int64_t>(plan.workspace_bytes / 4 + 64);
  Buffer ws_graph(DType::kI32, ws_words, Device::cuda(0)), ws_eager(DType::kI32, ws_words, Device::cuda(0));
  // Host inputs of a step and their device twins (one set per side).
  Buffer hk(DType::kF16, B * Hkv * D, Device::cpu()), hv(DType::kF16, hk.count(), Device::cpu()),
      hq(DType::kF16, B * Hq * D, Device::cpu()), hpos(DType::kI32, B, Device::cpu()), hlens(DType::kI32, B, Device::cpu());
  struct Side {
    Buffer k, v, q, pos, lens, out, lse;
  };
  auto make_side = [&] {
    return Side{Buffer(DType::kF16, hk.count(), Device::cuda(0)), Buffer(DType::kF16, hk.count(), Device::cuda(0)),
                Buffer(DType::kF16, hq.count(), Device::cuda(0)), Buffer(DType::kI32, B, Device::cuda(0)),
                Buffer(DType::kI32, B, Device::cuda(0)),          Buffer(DType::kF16, hq.count(), Device::cuda(0)),
                Buffer(DType::kF32, B * Hq, Device::cuda(0))};
  };
  Side g = make_side(), e = make_side();
  OwnStream own;
  const auto stream = static_cast<cudaStream_t>(own.get());
  RopeOptions ro;
  ro.layout = RopeLayout::kNeox;
  DecodeOptions o;
  o.validate = false;
  auto step_calls = [&](const DeviceCache& dc, Side& s, Buffer& ws) {
    ExecutionContext ctx;
    ctx.cuda_stream = stream;
    append_kv(dc.view(), s.k.view({B, 1, Hkv, D}), s.v.view({B, 1, Hkv, D}), dc.table_view(), s.pos.view({B, 1}),
              s.q.view({B, 1, Hq, D}), ro, false, variant, ctx);
    ctx.workspace = {ws.data(), plan.workspace_bytes};
    paged_attention_decode(s.q.view({B, 1, Hq, D}), dc.view(), dc.table_view(), s.lens.view({B}),
                           s.out.view({B, 1, Hq, D}), s.lse.view({B, Hq, 1}), o, plan, ctx);
  };
  auto upload = [&](Side& s) {
    ASSERT_CUDA_OK(cudaMemcpyAsync(s.k.data(), hk.data(), hk.bytes(), cudaMemcpyHostToDevice, stream));
    ASSERT_CUDA_OK(cudaMemcpyAsync(s.v.data(), hv.data(), hv.bytes(), cudaMemcpyHostToDevice, stream));
    ASSERT_CUDA_OK(cudaMemcpyAsync(s.q.data(), hq.data(), hq.bytes(), cudaMemcpyHostToDevice, stream));
    ASSERT_CUDA_OK(cudaMemcpyAsync(s.pos.data(), hpos.data(), hpos.bytes(), cudaMemcpyHostToDevice, stream));
    ASSERT_CUDA_OK(cudaMemcpyAsync(s.lens.data(), hlens.data(), hlens.bytes(), cudaMemcpyHostToDevice, stream));
  };
  // Capture (nothing runs); the inputs are uploaded before each replay.
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    step_calls(graph_cache, g, ws_graph);
  } catch (const Error& err) {
    cudaStreamEndCapture(stream, &graph);
    if (graph) cudaGraphDestroy(graph);
    FAIL() << "capture threw: " << err.what();
  }
  ASSERT_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  ASSERT_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  std::vector<uint16_t> out_g(static_cast<size_t>(hq.count())), out_e(out_g.size());
  std::vector<float> lse_g(static_cast<size_t>(B * Hq)), lse_e(lse_g.size());
  for (int64_t step = 0; step < steps; ++step) {
    SCOPED_TRACE(step);
    fill_random(hk, rng), fill_random(hv, rng), fill_random(hq, rng, -1.5, 1.5);
    for (int64_t b = 0; b < B; ++b) {
      static_cast<int32_t*>(hpos.data())[b] = static_cast<int32_t>(start[b] + step);
      static_cast<int32_t*>(hlens.data())[b] = static_cast<int32_t>(start[b] + step + 1);
    }
    upload(g);
    ASSERT_CUDA_OK(cudaGraphLaunch(exec, stream));
    upload(e);
    step_calls(eager_cache, e, ws_eager);
    ASSERT_CUDA_OK(cudaMemcpyAsync(out_g.data(), g.out.data(), g.out.bytes(), cudaMemcpyDeviceToHost, stream));
    ASSERT_CUDA_OK(cudaMemcpyAsync(out_e.data(), e.out.data(), e.out.bytes(), cudaMemcpyDeviceToHost, stream));
    ASSERT_CUDA_OK(cudaMemcpyAsync(lse_g.data(), g.lse.data(), g.lse.bytes(), cudaMemcpyDeviceToHost, stream));
    ASSERT_CUDA_OK(cudaMemcpyAsync(lse_e.data(), e.lse.data(), e.lse.bytes(), cudaMemcpyDeviceToHost, stream));
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
    ASSERT_EQ(0, std::memcmp(out_g.data(), out_e.data(), out_g.size() * sizeof(uint16_t))) << "out: graph != eager";
    ASSERT_EQ(0, std::memcmp(lse_g.data(), lse_e.data(), lse_g.size() * sizeof(float))) << "lse: graph != eager";
    if (step == 0 || step == 37 || step == steps - 1) {  // the float64 reference on the eager cache
      HostCache& host = cache;
      eager_cache.to_host(host);
      Buffer q_rot(DType::kF16, hq.count(), Device::cpu()), out(DType::kF16, hq.count(), Device::cpu());
      e.q.copy_to_host(q_rot.data());
      std::memcpy(out.data(), out_g.data(), out.bytes());
      Buffer lse(DType::kF32, B * Hq, Device::cpu());
      std::memcpy(lse.data(), lse_g.data(), lse.bytes());
      expect_decode_matches(host, {DType::kF16, 1, Hq, 0, &q_rot, &out, &lse, &hlens});
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

INSTANTIATE_TEST_SUITE_P(Rungs, CudaKvCache,
                         ::testing::Values(KvCacheVariant::kContiguousNaive, KvCacheVariant::kPaged,
                                           KvCacheVariant::kPagedSplit, KvCacheVariant::kPagedMma,
                                           KvCacheVariant::kAuto),
                         [](const auto& info) { return std::string(kv_cache_variant_name(info.param)); });

}  // namespace
}  // namespace optimized::testing
