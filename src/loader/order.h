// The order in which a rank reads records: which dataset records make up each batch of each epoch.
//
// The epoch's order is the identity, or with shuffle a pseudo-random permutation of [0, N) from
// (seed, epoch): a keyed Feistel network on the smallest even-bit domain >= N, with cycle walking
// back into [0, N). It is a bijection evaluated per position in O(1) memory, so there is no
// N-entry table to build or keep, any batch can be computed on its own (resume is free), and every
// rank computes the same permutation. The epoch's order is then split into world_size contiguous
// ranges whose sizes differ by at most one (rank r: positions [r N / W, (r+1) N / W)).
#pragma once

#include <cstdint>
#include <vector>

namespace optimized::loader {

class Permutation {
 public:
  Permutation(uint64_t n, uint64_t seed, uint64_t epoch);
  uint64_t operator()(uint64_t position) const;  // position in [0, n) -> record in [0, n)

 private:
  uint64_t n_;
  int half_bits_;
  uint64_t mask_;
  uint64_t keys_[6];
};

struct RankOrder {
  uint64_t num_records = 0;
  bool shuffle = false;
  uint64_t seed = 0;
  uint64_t begin = 0;       // first epoch position of this rank
  uint64_t count = 0;       // positions this rank reads per epoch
  uint64_t batch_size = 1;
  uint64_t batches = 0;     // per epoch

  RankOrder(uint64_t num_records, bool shuffle, uint64_t seed, int rank, int world_size, uint64_t batch_size,
            bool drop_last);
  // Records of batch `batch` of `epoch`, appended to `out` (cleared first).
  void batch_records(uint64_t epoch, uint64_t batch, std::vector<uint64_t>& out) const;
};

}  // namespace optimized::loader
