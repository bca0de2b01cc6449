// Record order per epoch and rank: the keyed permutation and the rank split (see order.h).
#include "loader/order.h"

#include <algorithm>

namespace optimized::loader {

namespace {

// splitmix64's finalizer: a cheap 64-bit mixer whose output bits all depend on every input bit.
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

Permutation::Permutation(uint64_t n, uint64_t seed, uint64_t epoch) : n_(n) {
  int bits = 2;
  while (bits < 64 && (uint64_t{1} << bits) < n) ++bits;
  bits += bits & 1;  // even, so the two Feistel halves are equal
  half_bits_ = bits / 2;
  mask_ = (uint64_t{1} << half_bits_) - 1;
  uint64_t k = mix(seed ^ mix(epoch + 0x5bd1e995ull));
  for (uint64_t& key : keys_) key = k = mix(k);
}

uint64_t Permutation::operator()(uint64_t position) const {
  // Cycle walking: the Feistel network permutes [0, 2^bits) (< 4n values), so following it from a
  // position < n returns below n within a few steps on average, and always (it is a permutation).
  uint64_t x = position;
  do {
    uint64_t left = x >> half_bits_, right = x & mask_;
    for (uint64_t key : keys_) {
      const uint64_t next = left ^ (mix(right ^ key) & mask_);
      left = right;
      right = next;
    }
    x = (left << half_bits_) | right;
  } while (x >= n_);
  return x;
}

RankOrder::RankOrder(uint64_t n, bool shuffle_, uint64_t seed_, int rank, int world_size, uint64_t batch,
                     bool drop_last)
    : num_records(n), shuffle(shuffle_), seed(seed_), batch_size(batch) {
  const uint64_t w = static_cast<uint64_t>(world_size), r = static_cast<uint64_t>(rank);
  // (r * n) / w without overflow for any n < 2^64 and w < 2^31.
  auto split = [&](uint64_t i) {
    return (n / w) * i + ((n % w) * i) / w;
  };
  begin = split(r);
  count = split(r + 1) - begin;
  if (drop_last) {
    batches = (n / w) / batch;
    count = batches * batch;
  } else {
    batches = (count + batch - 1) / batch;
  }
}

void RankOrder::batch_records(uint64_t epoch, uint64_t batch, std::vector<uint64_t>& out) const {
  out.clear();
  const uint64_t first = batch * batch_size;
  const uint64_t last = std::min(count, first + batch_size);
  if (first >= last) return;
  out.reserve(last - first);
  if (shuffle) {
    const Permutation perm(num_records, seed, epoch);
    for (uint64_t j = first; j < last; ++j) out.push_back(perm(begin + j));
  } else {
    for (uint64_t j = first; j < last; ++j) out.push_back(begin + j);
  }
}

}  // namespace optimized::loader
