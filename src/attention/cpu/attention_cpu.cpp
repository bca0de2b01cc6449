// cpu_attention: the CPU rung of the attention ladder, forward and backward of every feature of
// optimized/attention.h on host memory, and the code the CUDA rungs are explained against. fp64
// runs it in fp64 throughout, so that torch's float64 gradcheck holds the library's own algebra.
//
// Forward, one (sequence b, query head h, query row i) at a time, threads (OpenMP) over all of them:
//   q_i widened to the math type A (fp32; fp64 for fp64);
//   [lo, hi) = the keys the causal / window rule lets row i see (AttentionScore::key_range);
//   s_j = score.value(q_i . k_j, i, j) + mask(b, h, i, j)  (a false bool mask: the key is skipped);
//   m = max_j s_j, propagating NaN; m = -inf (no visible key): out_i = 0, lse_i = -inf;
//   p_j = exp(s_j - m), l = sum_j p_j, out_i = sum_j p_j v_j / l, lse_i = m + log(l).
// A NaN in q_i, or in a k_j / v_j that row i sees, makes the row NaN; an infinite score makes
// s_j - m NaN (inf - inf), so the row is NaN as in torch.
//
// Backward, one (sequence b, kv head g) at a time, threads over them: the query heads of the GQA
// group (in order) and their rows are visited by the one thread that owns g, so dk / dv of (b, g)
// add their terms in one fixed order whatever the thread count (deterministic, as the rung must be
// for float64 gradcheck). Per query row i of head h:
//   D_i = dout_i . out_i;  p_j = exp(s_j - lse_i) (the forward's lse: no second softmax pass);
//   dv_j += p_j dout_i;  dp_j = dout_i . v_j;  ds_j = p_j (dp_j - D_i);
//   through the soft-cap: ds_j *= 1 - t_j^2 with t_j = tanh(scale q_i . k_j / softcap);
//   dq_i = scale sum_j ds_j k_j (stored at once: row i belongs to this thread alone);
//   dk_j += scale ds_j q_i.
// A row with lse -inf (no visible key) adds nothing and its dq is 0; dk / dv rows no query sees
// are 0. dk / dv accumulate in A over the group's rows and are stored once at the end.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/cpu_loops.h"
#include "attention/attention_params.h"
#include "attention/cpu/attention_cpu.h"
#include "core/host_dtype.h"
#include "optimized/buffer.h"

namespace optimized {
namespace {

using namespace host;  // F32, F64, F16, BF16

// Row i (of sequence seq's rows, start already added by the caller) of head h of tensor x.
template <class D>
const typename D::T* row_ptr(const void* base, const AttentionStrides& s, int64_t b, int64_t r, int64_t h) {
  return static_cast<const typename D::T*>(base) + b * s.batch + r * s.row + h * s.head;
}
template <class D>
typename D::T* row_ptr(void* base, const AttentionStrides& s, int64_t b, int64_t r, int64_t h) {
  return static_cast<typename D::T*>(base) + b * s.batch + r * s.row + h * s.head;
}

template <class D>
void load(const typename D::T* src, int64_t n, typename D::Acc* dst) {
  for (int64_t d = 0; d < n; ++d) dst[d] = D::load(src[d]);
}
template <class D>
void store(const typename D::Acc* src, int64_t n, typename D::T* dst) {
  for (int64_t d = 0; d < n; ++d) dst[d] = D::store(src[d]);
}

// a . b over n values of the math type (n = D is small: one accumulator in order, as the reference
// sums them; fp64 stays exact math).
template <class A>
A dot(const A* a, const A* b, int64_t n) {
  A s = 0;
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

// The explicit mask of (b, h, i, j): kBool yields 0 (attend) or -inf; additive dtypes their value.
// `visible` false: a bool mask hides the key (it takes no part in the sum at all).
template <class A>
A mask_value(const AttentionParams& p, int64_t b, int64_t h, int64_t i, int64_t j, bool* visible) {
  *visible = true;
  if (!p.mask) return A(0);
  const int64_t at = b * p.mask_s[0] + h * p.mask_s[1] + i * p.mask_s[2] + j * p.mask_s[3];
  if (p.mask_dtype == DType::kBool) {
    *visible = static_cast<const uint8_t*>(p.mask)[at] != 0;
    return A(0);
  }
  return static_cast<A>(load_as_double(p.mask, p.mask_dtype, at));
}

// The scores of row i over its key range [lo, hi): s[j - lo]; keys a bool mask hides get -inf and
// hidden[j - lo] = 1. dots[j - lo] keeps q_i . k_j (the backward's soft-cap derivative needs it).
template <class D>
void row_scores(const AttentionParams& p, const AttentionScore<typename D::Acc>& sc, const AttentionSeq& seq,
                int64_t b, int64_t h, int64_t i, int64_t lo, int64_t hi, const typename D::Acc* q,
                typename D::Acc* kbuf, typename D::Acc* s, typename D::Acc* dots, uint8_t* hidden) {
  using A = typename D::Acc;
  const int64_t Dh = p.head_dim, g = h / p.group();
  for (int64_t j = lo; j < hi; ++j) {
    bool visible = true;
    const A m = mask_value<A>(p, b, h, i, j, &visible);
    hidden[j - lo] = visible ? 0 : 1;
    if (!visible) {
      s[j - lo] = -INFINITY;
      dots[j - lo] = 0;
      continue;
    }
    load<D>(row_ptr<D>(p.k, p.k_s, b, seq.start_k + j, g), Dh, kbuf);
    const A d = dot(q, kbuf, Dh);
    dots[j - lo] = d;
    s[j - lo] = sc.value(d, i, j) + m;
  }
}

std::vector<AttentionSeq> sequences(const AttentionParams& p) {
  std::vector<AttentionSeq> seqs(static_cast<size_t>(p.batch));
  for (int64_t b = 0; b < p.batch; ++b) seqs[static_cast<size_t>(b)] = attention_seq(p, b);
  return seqs;
}

// The longest of the sequences' lengths (len_q or len_k); 0 for none.
int64_t longest(const std::vector<AttentionSeq>& seqs, int64_t AttentionSeq::*len) {
  int64_t m = 0;
  for (const AttentionSeq& s : seqs) m = std::max(m, s.*len);
  return m;
}

// lse of (b, h, row start_q + i): fp32, or fp64 for fp64 inputs.
int64_t lse_index(const AttentionParams& p, const AttentionSeq& seq, int64_t b, int64_t h, int64_t i) {
  return b * p.lse_batch + h * p.lse_head + seq.start_q + i;
}

// ---- forward ----------------------------------------------------------------------------------

template <class D>
void forward(const AttentionParams& p, int threads) {
  using A = typename D::Acc;
  using LseT = A;  // fp32 lse for fp32 math, fp64 for fp64
  const std::vector<AttentionSeq> seqs = sequences(p);
  // The longest real sequences (varlen's max_seqlen is only a bound the caller gives).
  const int64_t Dh = p.head_dim, Sq = longest(seqs, &AttentionSeq::len_q), Sk = longest(seqs, &AttentionSeq::len_k);
  const int64_t items = p.batch * p.heads_q * Sq;  // (b, h, i); rows past a varlen sequence's end skip
  const int nth = cpu_thread_count(threads, items);
#pragma omp parallel num_threads(nth)
  {
    std::vector<A> q(static_cast<size_t>(Dh)), kv(static_cast<size_t>(Dh)), o(static_cast<size_t>(Dh));
    std::vector<A> s(static_cast<size_t>(Sk)), dots(static_cast<size_t>(Sk));
    std::vector<uint8_t> hidden(static_cast<size_t>(Sk));
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t i = item % Sq, h = (item / Sq) % p.heads_q, b = item / (Sq * p.heads_q);
      const AttentionSeq& seq = seqs[static_cast<size_t>(b)];
      if (i >= seq.len_q) continue;
      const AttentionScore<A> sc(p, seq, b, h);
      const int64_t lo = sc.key_lo(i), hi = std::max(lo, sc.key_hi(i)), n = hi - lo;
      load<D>(row_ptr<D>(p.q, p.q_s, b, seq.start_q + i, h), Dh, q.data());
      row_scores<D>(p, sc, seq, b, h, i, lo, hi, q.data(), kv.data(), s.data(), dots.data(), hidden.data());
      const A m = nan_propagating_max(s.data(), n);
      std::fill(o.begin(), o.end(), A(0));
      A lse = -INFINITY;
      if (!(m == -INFINITY)) {  // some key visible (or NaN, which flows through)
        A l = 0;
        const int64_t g = h / p.group();
        for (int64_t j = lo; j < hi; ++j) {
          if (hidden[j - lo]) continue;
          const A pj = std::exp(s[j - lo] - m);
          l += pj;
          load<D>(row_ptr<D>(p.v, p.v_s, b, seq.start_k + j, g), Dh, kv.data());
          for (int64_t d = 0; d < Dh; ++d) o[d] += pj * kv[d];
        }
        const A inv = A(1) / l;
        for (int64_t d = 0; d < Dh; ++d) o[d] *= inv;
        lse = m + std::log(l);
      }
      store<D>(o.data(), Dh, row_ptr<D>(p.out, p.out_s, b, seq.start_q + i, h));
      if (p.lse) static_cast<LseT*>(p.lse)[lse_index(p, seq, b, h, i)] = lse;
    }
  }
}

// ---- backward ---------------------------------------------------------------------------------

template <class D>
void backward(const AttentionParams& p, int threads) {
  using A = typename D::Acc;
  using LseT = A;
  const std::vector<AttentionSeq> seqs = sequences(p);
  const int64_t Dh = p.head_dim, Sk = longest(seqs, &AttentionSeq::len_k), group = p.group();
  const int64_t items = p.batch * p.heads_kv;  // (b, kv head): every dk / dv sum stays in one thread
  const int nth = cpu_thread_count(threads, items);
#pragma omp parallel num_threads(nth)
  {
    std::vector<A> q(static_cast<size_t>(Dh)), kv(static_cast<size_t>(Dh)), dout(static_cast<size_t>(Dh)),
        o(static_cast<size_t>(Dh)), dq(static_cast<size_t>(Dh));
    std::vector<A> s(static_cast<size_t>(Sk)), dots(static_cast<size_t>(Sk));
    std::vector<uint8_t> hidden(static_cast<size_t>(Sk));
    std::vector<A> dk, dv;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t g = item % p.heads_kv, b = item / p.heads_kv;
      const AttentionSeq& seq = seqs[static_cast<size_t>(b)];
      dk.assign(static_cast<size_t>(seq.len_k * Dh), A(0));
      dv.assign(static_cast<size_t>(seq.len_k * Dh), A(0));
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const AttentionScore<A> sc(p, seq, b, h);
        for (int64_t i = 0; i < seq.len_q; ++i) {
          std::fill(dq.begin(), dq.end(), A(0));
          const A lse = static_cast<const LseT*>(p.lse)[lse_index(p, seq, b, h, i)];
          const int64_t lo = sc.key_lo(i), hi = std::max(lo, sc.key_hi(i));
          if (!(lse == -INFINITY) && hi > lo) {
            load<D>(row_ptr<D>(p.q, p.q_s, b, seq.start_q + i, h), Dh, q.data());
            load<D>(row_ptr<D>(p.dout, p.dout_s, b, seq.start_q + i, h), Dh, dout.data());
            load<D>(row_ptr<D>(p.out, p.out_s, b, seq.start_q + i, h), Dh, o.data());
            const A Di = dot(dout.data(), o.data(), Dh);
            row_scores<D>(p, sc, seq, b, h, i, lo, hi, q.data(), kv.data(), s.data(), dots.data(), hidden.data());
            for (int64_t j = lo; j < hi; ++j) {
              if (hidden[j - lo]) continue;
              const A pj = std::exp(s[j - lo] - lse);
              A* dvj = &dv[static_cast<size_t>(j * Dh)];
              for (int64_t d = 0; d < Dh; ++d) dvj[d] += pj * dout[d];
              load<D>(row_ptr<D>(p.v, p.v_s, b, seq.start_k + j, g), Dh, kv.data());
              const A dp = dot(dout.data(), kv.data(), Dh);
              A ds = pj * (dp - Di);
              if (sc.softcap > A(0)) {
                const A t = std::tanh(sc.scale * dots[j - lo] / sc.softcap);
                ds *= AttentionScore<A>::softcap_grad_from_tanh(t);
              }
              ds *= sc.scale;
              load<D>(row_ptr<D>(p.k, p.k_s, b, seq.start_k + j, g), Dh, kv.data());
              A* dkj = &dk[static_cast<size_t>(j * Dh)];
              for (int64_t d = 0; d < Dh; ++d) {
                dq[d] += ds * kv[d];
                dkj[d] += ds * q[d];
              }
            }
          }
          store<D>(dq.data(), Dh, row_ptr<D>(p.dq, p.dq_s, b, seq.start_q + i, h));
        }
      }
      for (int64_t j = 0; j < seq.len_k; ++j) {
        store<D>(&dk[static_cast<size_t>(j * Dh)], Dh, row_ptr<D>(p.dk, p.dk_s, b, seq.start_k + j, g));
        store<D>(&dv[static_cast<size_t>(j * Dh)], Dh, row_ptr<D>(p.dv, p.dv_s, b, seq.start_k + j, g));
      }
    }
  }
}

template <class D>
void run(const AttentionParams& p, int threads) {
  if (p.batch <= 0 || p.heads_q <= 0 || p.heads_kv <= 0 || p.head_dim <= 0) return;
  if (p.backward) backward<D>(p, threads);
  else forward<D>(p, threads);
}

}  // namespace

void cpu_attention(const AttentionParams& params, int threads) {
  host::visit_traits(params.dtype, [&]<class D>() { run<D>(params, threads); });
}

}  // namespace optimized
