// The attention references (see attention_reference.h).
#include "testing/attention_reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "optimized/buffer.h"
#include "testing/tolerance.h"

namespace optimized::testing {

int64_t attention_rows_q(const AttentionParams& p) { return p.varlen() ? p.total_q : p.batch * p.seqlen_q; }
int64_t attention_rows_k(const AttentionParams& p) { return p.varlen() ? p.total_k : p.batch * p.seqlen_k; }

namespace {

// The operands of a call widened to double, in the packed order of the header (row, head, d).
struct Problem {
  const AttentionParams& p;
  int64_t rows_q = 0, rows_k = 0, D = 0, Hq = 0, Hkv = 0;
  std::vector<double> q, k, v, out, dout;

  explicit Problem(const AttentionParams& params) : p(params) {
    rows_q = attention_rows_q(p);
    rows_k = attention_rows_k(p);
    D = p.head_dim;
    Hq = p.heads_q;
    Hkv = p.heads_kv;
    load(p.q, p.q_s, rows_q, Hq, true, q);
    load(p.k, p.k_s, rows_k, Hkv, false, k);
    load(p.v, p.v_s, rows_k, Hkv, false, v);
    if (p.backward) {
      load(p.out, p.out_s, rows_q, Hq, true, out);
      load(p.dout, p.dout_s, rows_q, Hq, true, dout);
    }
  }

  AttentionSeq seq(int64_t b) const { return attention_seq(p, b); }
  // The packed row of row i of sequence b.
  int64_t row_q(int64_t b, const AttentionSeq& s, int64_t i) const { return p.varlen() ? s.start_q + i : b * p.seqlen_q + i; }
  int64_t row_k(int64_t b, const AttentionSeq& s, int64_t j) const { return p.varlen() ? s.start_k + j : b * p.seqlen_k + j; }
  const double* at(const std::vector<double>& x, int64_t row, int64_t heads, int64_t h) const {
    return x.data() + (row * heads + h) * D;
  }

 private:
  void load(const void* base, const AttentionStrides& s, int64_t rows, int64_t heads, bool is_q,
            std::vector<double>& dst) const {
    dst.assign(static_cast<size_t>(rows * heads * D), 0.0);
    if (!base) return;
    for (int64_t b = 0; b < p.batch; ++b) {
      const AttentionSeq sq = attention_seq(p, b);
      const int64_t len = is_q ? sq.len_q : sq.len_k, start = is_q ? sq.start_q : sq.start_k;
      for (int64_t i = 0; i < len; ++i) {
        const int64_t r = p.varlen() ? start + i : b * (is_q ? p.seqlen_q : p.seqlen_k) + i;
        for (int64_t h = 0; h < heads; ++h)
          for (int64_t d = 0; d < D; ++d)
            dst[static_cast<size_t>((r * heads + h) * D + d)] =
                load_as_double(base, p.dtype, b * s.batch + (start + i) * s.row + h * s.head + d);
      }
    }
  }
};

// One row's scores: the visible keys, their values, and what the backward and the terms need.
template <class M>
struct RowScores {
  std::vector<char> visible;
  std::vector<M> s, t, smag;  // score, tanh of the soft-cap (0 without), |terms| of the score
};

// kSame: the same-dtype emulation (round at every tensor torch materializes, M = float or double);
// otherwise the float64 reference (M = double or long double, no rounding).
template <class M, bool kSame>
class Computer {
 public:
  explicit Computer(const Problem& pr) : pr_(pr), p_(pr.p) {}

  M rnd(M x) const {
    if constexpr (kSame) return static_cast<M>(round_to(p_.dtype, static_cast<double>(x)));
    else return x;
  }

  // Scores of row i of (b, h) over the sequence's keys.
  void scores(int64_t b, const AttentionSeq& sq, int64_t h, int64_t i, RowScores<M>& r) const {
    const int64_t Lk = sq.len_k, g = h / (pr_.Hq / pr_.Hkv), D = pr_.D;
    r.visible.assign(static_cast<size_t>(Lk), 0);
    r.s.assign(static_cast<size_t>(Lk), M(0));
    r.t.assign(static_cast<size_t>(Lk), M(0));
    r.smag.assign(static_cast<size_t>(Lk), M(0));
    const int64_t offset = p_.top_left ? 0 : sq.len_k - sq.len_q, diag = i + offset;
    const M scale = static_cast<M>(p_.scale), cap = static_cast<M>(p_.softcap);
    const M slope = p_.alibi ? static_cast<M>(p_.alibi[b * p_.alibi_batch + h]) : M(0);
    const double* q = pr_.at(pr_.q, pr_.row_q(b, sq, i), pr_.Hq, h);
    for (int64_t j = 0; j < Lk; ++j) {
      if (p_.window_left >= 0 && j < diag - p_.window_left) continue;
      if (p_.window_right >= 0 && j > diag + p_.window_right) continue;
      M mask = 0;
      if (p_.mask) {
        const int64_t at = b * p_.mask_s[0] + h * p_.mask_s[1] + i * p_.mask_s[2] + j * p_.mask_s[3];
        if (p_.mask_dtype == DType::kBool) {
          if (static_cast<const uint8_t*>(p_.mask)[at] == 0) continue;
        } else {
          mask = static_cast<M>(load_as_double(p_.mask, p_.mask_dtype, at));
        }
      }
      const double* k = pr_.at(pr_.k, pr_.row_k(b, sq, j), pr_.Hkv, g);
      M dot = 0, mag = 0;
      for (int64_t d = 0; d < D; ++d) {
        dot += static_cast<M>(q[d]) * static_cast<M>(k[d]);
        mag += std::fabs(static_cast<M>(q[d]) * static_cast<M>(k[d]));
      }
      M x = rnd(dot * scale);
      M t = 0;
      if (cap > M(0)) {
        t = rnd(std::tanh(rnd(x / cap)));
        x = rnd(cap * t);
      }
      const int64_t dist = diag - j;
      const M bias = slope * static_cast<M>(dist < 0 ? -dist : dist);
      if (slope != M(0)) x = rnd(x + rnd(-bias));
      if (p_.mask && p_.mask_dtype != DType::kBool) x = rnd(x + rnd(mask));
      r.visible[static_cast<size_t>(j)] = 1;
      r.s[static_cast<size_t>(j)] = x;
      r.t[static_cast<size_t>(j)] = t;
      r.smag[static_cast<size_t>(j)] = std::fabs(scale) * mag + std::fabs(bias) + std::fabs(mask);
    }
  }

  // P of the row (0 where hidden; all 0 with no visible key), its max and lse. Returns false when
  // no key is visible.
  bool softmax(const RowScores<M>& r, std::vector<M>& P, M* lse) const {
    const size_t n = r.s.size();
    P.assign(n, M(0));
    M m = -INFINITY;
    bool nan = false;
    for (size_t j = 0; j < n; ++j) {
      if (!r.visible[j]) continue;
      if (std::isnan(r.s[j])) nan = true;
      else if (r.s[j] > m) m = r.s[j];
    }
    if (nan) m = NAN;
    if (m == -INFINITY) {
      *lse = -INFINITY;
      return false;
    }
    M l = 0;
    for (size_t j = 0; j < n; ++j)
      if (r.visible[j]) l += std::exp(r.s[j] - m);
    for (size_t j = 0; j < n; ++j)
      if (r.visible[j]) P[j] = rnd(std::exp(r.s[j] - m) / l);
    *lse = m + std::log(l);
    return true;
  }

  void run(AttentionReference& res, AttentionReference* terms) const {
    const int64_t Hq = pr_.Hq, Hkv = pr_.Hkv, D = pr_.D, group = Hq / Hkv;
    const size_t nq = static_cast<size_t>(pr_.rows_q * Hq), nk = static_cast<size_t>(pr_.rows_k * Hkv);
    const bool bwd = p_.backward;
    const M scale = static_cast<M>(p_.scale);
    if (!bwd) {
      res.out.assign(nq * static_cast<size_t>(D), 0.0);
      res.lse.assign(nq, -INFINITY);
    } else {
      res.dq.assign(nq * static_cast<size_t>(D), 0.0);
      res.dk.assign(nk * static_cast<size_t>(D), 0.0);
      res.dv.assign(nk * static_cast<size_t>(D), 0.0);
    }
    if (terms) {
      *terms = AttentionReference{};
      if (!bwd) {
        terms->out.assign(nq, 0.0);
        terms->lse.assign(nq, 0.0);
      } else {
        terms->dq.assign(nq, 0.0);
        terms->dk.assign(nk, 0.0);
        terms->dv.assign(nk, 0.0);
      }
    }
    RowScores<M> rs;
    std::vector<M> P, acc(static_cast<size_t>(D)), dP;
    std::vector<M> dk_h, dv_h;  // same-dtype GQA: one head's dk / dv, rounded before the group sum
    for (int64_t b = 0; b < p_.batch; ++b) {
      const AttentionSeq sq = pr_.seq(b);
      const int64_t Lk = sq.len_k;
      for (int64_t g = 0; g < Hkv; ++g) {
        std::vector<M> dk_g(static_cast<size_t>(Lk * D), M(0)), dv_g(static_cast<size_t>(Lk * D), M(0));
        std::vector<double> tk(static_cast<size_t>(Lk), 0.0), tv(static_cast<size_t>(Lk), 0.0);
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          dk_h.assign(static_cast<size_t>(Lk * D), M(0));
          dv_h.assign(static_cast<size_t>(Lk * D), M(0));
          for (int64_t i = 0; i < sq.len_q; ++i) {
            const int64_t r = pr_.row_q(b, sq, i);
            const size_t unit = static_cast<size_t>(r * Hq + h);
            scores(b, sq, h, i, rs);
            M lse = 0;
            const bool any = softmax(rs, P, &lse);
            // The terms' factor: 1 + the largest score magnitude (an error in s is relative in p).
            double E = 1;
            for (int64_t j = 0; j < Lk; ++j)
              if (rs.visible[static_cast<size_t>(j)] && std::isfinite(static_cast<double>(rs.smag[static_cast<size_t>(j)])))
                E = std::max(E, 1.0 + static_cast<double>(rs.smag[static_cast<size_t>(j)]));
            if (!bwd) {
              res.lse[unit] = static_cast<double>(lse);
              std::fill(acc.begin(), acc.end(), M(0));
              double vmax = 0;
              if (any) {
                for (int64_t j = 0; j < Lk; ++j) {
                  if (!rs.visible[static_cast<size_t>(j)]) continue;
                  const double* vj = pr_.at(pr_.v, pr_.row_k(b, sq, j), Hkv, g);
                  for (int64_t d = 0; d < D; ++d) {
                    acc[static_cast<size_t>(d)] += P[static_cast<size_t>(j)] * static_cast<M>(vj[d]);
                    if (std::isfinite(vj[d])) vmax = std::max(vmax, std::fabs(vj[d]));
                  }
                }
              }
              for (int64_t d = 0; d < D; ++d) res.out[unit * static_cast<size_t>(D) + static_cast<size_t>(d)] =
                  static_cast<double>(acc[static_cast<size_t>(d)]);
              if (terms) {
                terms->out[unit] = vmax * E;
                terms->lse[unit] = E;
              }
              continue;
            }
            if (!any) continue;  // no visible key: no gradient (dq stays 0)
            const double* dO = pr_.at(pr_.dout, r, Hq, h);
            const double* O = pr_.at(pr_.out, r, Hq, h);
            const double* qi = pr_.at(pr_.q, r, Hq, h);
            dP.assign(static_cast<size_t>(Lk), M(0));
            std::vector<double> dpmag(static_cast<size_t>(Lk), 0.0);
            M Di = 0;
            double Dmag = 0, dOmax = 0, qmax = 0;
            for (int64_t d = 0; d < D; ++d) {
              Di += static_cast<M>(dO[d]) * static_cast<M>(O[d]);
              Dmag += std::fabs(dO[d] * O[d]);
              if (std::isfinite(dO[d])) dOmax = std::max(dOmax, std::fabs(dO[d]));
              if (std::isfinite(qi[d])) qmax = std::max(qmax, std::fabs(qi[d]));
            }
            M sumPdP = 0;
            for (int64_t j = 0; j < Lk; ++j) {
              if (!rs.visible[static_cast<size_t>(j)]) continue;
              const double* vj = pr_.at(pr_.v, pr_.row_k(b, sq, j), Hkv, g);
              M s = 0;
              double mag = 0;
              for (int64_t d = 0; d < D; ++d) {
                s += static_cast<M>(dO[d]) * static_cast<M>(vj[d]);
                mag += std::fabs(dO[d] * vj[d]);
              }
              dP[static_cast<size_t>(j)] = rnd(s);
              dpmag[static_cast<size_t>(j)] = mag;
              sumPdP += P[static_cast<size_t>(j)] * dP[static_cast<size_t>(j)];
            }
            // The float64 reference reads D from the given out (as the rungs do); torch's softmax
            // backward sums P dP.
            const M Drow = kSame ? sumPdP : Di;
            std::fill(acc.begin(), acc.end(), M(0));
            double tq = 0;
            for (int64_t j = 0; j < Lk; ++j) {
              const size_t js = static_cast<size_t>(j);
              if (!rs.visible[js]) continue;
              const M pj = P[js];
              M ds = rnd(pj * (dP[js] - Drow));
              if (p_.softcap > 0) ds = rnd(ds * rnd(M(1) - rs.t[js] * rs.t[js]));
              const double* kj = pr_.at(pr_.k, pr_.row_k(b, sq, j), Hkv, g);
              double kmax = 0;
              for (int64_t d = 0; d < D; ++d) {
                const size_t jd = js * static_cast<size_t>(D) + static_cast<size_t>(d);
                acc[static_cast<size_t>(d)] += ds * static_cast<M>(kj[d]);
                dk_h[jd] += ds * static_cast<M>(qi[d]);
                dv_h[jd] += pj * static_cast<M>(dO[d]);
                if (std::isfinite(kj[d])) kmax = std::max(kmax, std::fabs(kj[d]));
              }
              if (terms) {
                const double pe = std::isfinite(static_cast<double>(pj)) ? static_cast<double>(pj) * E : 0.0;
                const double dsm = std::fabs(static_cast<double>(p_.scale)) * (dpmag[js] + Dmag);
                tq += pe * dsm * kmax;
                tk[js] += pe * dsm * qmax;
                tv[js] += pe * dOmax;
              }
            }
            for (int64_t d = 0; d < D; ++d)
              res.dq[unit * static_cast<size_t>(D) + static_cast<size_t>(d)] = static_cast<double>(scale * acc[static_cast<size_t>(d)]);
            if (terms) terms->dq[unit] = tq;
          }
          if (bwd) {
            // torch's GQA (k, v repeated per query head): each head's dk / dv is a tensor of the
            // dtype, summed over the group in the dtype; one head alone is left to the check.
            for (size_t x = 0; x < dk_g.size(); ++x) {
              const M dkx = scale * dk_h[x], dvx = dv_h[x];
              dk_g[x] += group > 1 ? rnd(dkx) : dkx;
              dv_g[x] += group > 1 ? rnd(dvx) : dvx;
            }
          }
        }
        if (!bwd) continue;
        for (int64_t j = 0; j < Lk; ++j) {
          const size_t unit = static_cast<size_t>(pr_.row_k(b, sq, j) * Hkv + g);
          for (int64_t d = 0; d < D; ++d) {
            const size_t x = static_cast<size_t>(j * D + d);
            res.dk[unit * static_cast<size_t>(D) + static_cast<size_t>(d)] = static_cast<double>(dk_g[x]);
            res.dv[unit * static_cast<size_t>(D) + static_cast<size_t>(d)] = static_cast<double>(dv_g[x]);
          }
          if (terms) {
            terms->dk[unit] = tk[static_cast<size_t>(j)];
            terms->dv[unit] = tv[static_cast<size_t>(j)];
          }
        }
      }
    }
  }

 private:
  const Problem& pr_;
  const AttentionParams& p_;
};

}  // namespace

AttentionReference attention_reference_f64(const AttentionParams& p, AttentionReference* terms) {
  const Problem pr(p);
  AttentionReference r;
  if (p.dtype == DType::kF64) Computer<long double, false>(pr).run(r, terms);
  else Computer<double, false>(pr).run(r, terms);
  return r;
}

AttentionReference attention_reference_same_dtype(const AttentionParams& p) {
  const Problem pr(p);
  AttentionReference r;
  if (p.dtype == DType::kF64) Computer<double, true>(pr).run(r, nullptr);
  else Computer<float, true>(pr).run(r, nullptr);
  return r;
}

}  // namespace optimized::testing
