// Rotary position embedding (RoPE): the layout and options shared by every op that rotates q / k
// (the fused family's rope_forward / rope_backward, include/optimized/fused.h; the KV cache's
// append_kv, include/optimized/kv_cache.h). Torch-free.
//
// For pair i of the rotary dims (i < rotary_dim / 2) of a row at position p:
//   angle = p * inv_freq[i],  inv_freq[i] = theta^(-2i / rotary_dim)
//   (x0, x1) -> (x0 cos(angle) - x1 sin(angle), x1 cos(angle) + x0 sin(angle))
// where the pair is
//   kNeox:        (x[i], x[i + rotary_dim / 2])  (GPT-NeoX, Llama in HF: "rotate_half")
//   kInterleaved: (x[2i], x[2i + 1])            (GPT-J, Llama's original)
// Dimensions past rotary_dim pass through.
#pragma once

#include <cstdint>
#include <string_view>

namespace optimized {

enum class RopeLayout : uint8_t { kNone, kNeox, kInterleaved };

struct RopeOptions {
  RopeLayout layout = RopeLayout::kNone;  // kNone: no rotation (append_kv); rope_forward needs one of the others
  double theta = 10000.0;
  int64_t rotary_dim = 0;  // 0: head_dim; else even, <= head_dim
};

std::string_view rope_layout_name(RopeLayout layout);  // "none", "neox", "interleaved"
// "neox" / "interleaved" / "none"; otherwise Error kInvalidArgument
// "layout: expected one of neox, interleaved, none; given 'x'".
RopeLayout parse_rope_layout(std::string_view name);

}  // namespace optimized
