// The decoder layers' shared description: the layer table, the KV cache layout and attention's entry point.
#pragma once

#include "linear.h"

namespace specdecode {

constexpr int kLayerFields = 8 + 4 * 7;  // see LayerDesc::from

// KV cache (engine/kv_cache.py): positions in blocks of kKeyTile, found through a block table
// ([slots, blocks_per_slot] int64). Per layer: keys [blocks, KV, D, kKeyTile] (transposed inside the block:
// one block of keys is one contiguous tile), values [blocks, KV, kKeyTile, D]; elements in one of KvFmt.
// kKvI8: int8 elements, and per layer two fp32 scale arrays [blocks, KV, kKeyTile] (keys', values'): the row of
// one (position, KV head) holds round(x / s) with s = absmax / 127 and reads back as float(q) * s
// (engine/kv_cache.py quantize_int8 and read do the same operations).
enum KvFmt : int { kKvF32 = 0, kKvF16 = 1, kKvBF16 = 2, kKvI8 = 3 };
constexpr int64_t kKeyTile = 16;  // positions per block = keys per score tile (kernels.KEY_TILE)

struct LayerDesc {
  const float *attn_norm, *mlp_norm, *q_norm, *k_norm;  // q_norm / k_norm null unless per-head q/k norms
  void *keys, *values;                                   // this layer's KV blocks, see KvFmt
  float *key_scales, *value_scales;                      // kKvI8 only (else null)
  Lin qkv, o, gate_up, down;
  static LayerDesc from(const int64_t* f) {
    auto lin = [](const int64_t* v) {
      return Lin{v[0], ptr<const void>(v[1]), v[2], ptr<const void>(v[3]), ptr<const float>(v[4]), v[5], v[6]};
    };
    return LayerDesc{ptr<const float>(f[0]), ptr<const float>(f[1]), ptr<const float>(f[2]), ptr<const float>(f[3]),
                     ptr<void>(f[4]), ptr<void>(f[5]), ptr<float>(f[6]), ptr<float>(f[7]),
                     lin(f + 8), lin(f + 15), lin(f + 22), lin(f + 29)};
  }
};

struct StackDims {
  int64_t hidden, H, KV, D, I, slots, max_len;
  float eps, scale;
  int kv_fmt;                  // KvFmt
  const int64_t* block_table;  // [slots, blocks_per_slot]
  int64_t blocks_per_slot, num_blocks;
  // Block of position p of a slot, and the element offset of (block, KV head) in a layer's keys or values.
  int64_t block(int64_t slot, int64_t p) const { return block_table[slot * blocks_per_slot + p / kKeyTile]; }
  int64_t at(int64_t blk, int64_t kv) const { return (blk * KV + kv) * D * kKeyTile; }
  // Offset of (block, KV head)'s kKeyTile scales in a layer's key or value scales (kKvI8).
  int64_t scale_at(int64_t blk, int64_t kv) const { return (blk * KV + kv) * kKeyTile; }
};

// Scores one attention call keeps (floats), and the fewest query rows it takes: a long prompt's rows are cut
// into pieces of kScoreBudget / length rows but at least kMinQueryPiece. Below about 340 positions the budget
// decides and a piece's scores stay in L2 between the score, softmax and value passes; beyond, the floor does:
// each piece widens every key and value tile again, so fewer, larger pieces (scores in L3) cost less than
// pieces sized for L2 (docs/long_context.md).
constexpr int64_t kScoreBudget = 1 << 16, kMinQueryPiece = 192;

// Attention of query rows [i0, i1) of one request's stretch of rows from m0 against one KV head (attention.cpp).
void attend_rows(const LayerDesc& L, const StackDims& g, const float* qkv, int64_t nqkv, const int64_t* pos,
                 int64_t slot, int64_t m0, int64_t i0, int64_t i1, int64_t kv, int64_t rep, float* att,
                 int64_t ld_att, std::vector<float>& scratch);

}  // namespace specdecode
