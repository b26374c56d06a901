// Attention of decode / verification rows. Every score is q . k as a chain of fmas over d = 0..D-1 in order,
// every output element sum_j p_j * v_j[d] a chain of fmas in key order, and the softmax total a sum in key
// order: fma rounds once wherever it runs (an instruction, or fmaf in the portable build) and nothing else is
// contracted (the file is built with -ffp-contract=off), so a row's result does not depend on which other
// queries or keys share a tile, nor on the vector width. 16-bit caches are
// widened to fp32 (exactly) one tile at a time, so a row's arithmetic is that of an fp32 cache holding the
// same values. An int8 cache is dequantized the same way, one tile at a time, as float(q) * scale (one rounding,
// the product engine/kv_cache.py's read computes), so a row sees the same fp32 keys and values on either path.
#include "fast_exp.h"
#include "layer_stack.h"

namespace specdecode {
namespace {

// n elements from element i of base, widened to fp32.
static void kv_load(int fmt, const void* base, int64_t i, int64_t n, float* out) {
  if (fmt == kKvF32) {
    std::memcpy(out, static_cast<const float*>(base) + i, sizeof(float) * n);
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(base) + i;
  int64_t j = 0;
#if SPECDECODE_AVX2
  if (fmt == kKvBF16) {
    for (; j + 8 <= n; j += 8) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + j)));
      _mm256_storeu_ps(out + j, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
  }
#endif
#if defined(__F16C__)
  if (fmt == kKvF16)
    for (; j + 8 <= n; j += 8)
      _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + j))));
#endif
  for (; j < n; ++j) {
    if (fmt == kKvF16) {
      out[j] = half_to_float(h[j]);
    } else {
      const uint32_t u = static_cast<uint32_t>(h[j]) << 16;
      std::memcpy(out + j, &u, sizeof(float));
    }
  }
}

// One block's int8 keys ([D, kKeyTile], position j in lane j) as fp32: element (d, j) = float(q) * s[j].
// int8 -> float is exact and the product is one IEEE multiply in either branch, so both give the same bits.
static void load_key_tile_i8(const int8_t* q, const float* s, int64_t D, float* out) {
  int64_t d = 0;
#if SPECDECODE_AVX2
  const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
  for (; d < D; ++d) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + d * kKeyTile));
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
    _mm256_storeu_ps(out + d * kKeyTile, _mm256_mul_ps(lo, s0));
    _mm256_storeu_ps(out + d * kKeyTile + 8, _mm256_mul_ps(hi, s1));
  }
#endif
  for (; d < D; ++d)
    for (int64_t j = 0; j < kKeyTile; ++j) out[d * kKeyTile + j] = static_cast<float>(q[d * kKeyTile + j]) * s[j];
}

// The first `rows` positions of one block's int8 values ([kKeyTile, D]) as fp32: row j is float(q) * s[j].
static void load_value_rows_i8(const int8_t* q, const float* s, int64_t rows, int64_t D, float* out) {
  for (int64_t j = 0; j < rows; ++j) {
    const int8_t* qj = q + j * D;
    float* o = out + j * D;
    int64_t d = 0;
#if SPECDECODE_AVX2
    const __m256 sj = _mm256_set1_ps(s[j]);
    for (; d + 8 <= D; d += 8) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qj + d));
      _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), sj));
    }
#endif
    for (; d < D; ++d) o[d] = static_cast<float>(qj[d]) * s[j];
  }
}

// y[i] = fast_exp(x[i] - sub) for i < n (the softmax numerators).
static inline void exp_shifted(const float* x, float sub, float* y, int64_t n) {
  int64_t i = 0;
#if SPECDECODE_AVX2
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, fast_exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(sub))));
#endif
  for (; i < n; ++i) y[i] = fast_exp(x[i] - sub);
}

// max(s[0], ..., s[n - 1]) as the scalar loop mx = s[0]; mx = std::max(mx, s[j]) gives it (max is exact, so
// the order does not matter; a NaN is skipped unless it is s[0], and then the result is NaN as well). Eight
// lanes at a time: one scalar chain of dependent compares was the largest single cost of a long prompt's
// attention.
typedef float V8 __attribute__((vector_size(8 * sizeof(float))));
static inline float row_max(const float* s, int64_t n) {
  V8 m = V8{} + s[0];
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    V8 x;
    std::memcpy(&x, s + j, sizeof(x));
    m = m < x ? x : m;
  }
  float mx = m[0];
  for (int l = 1; l < 8; ++l) mx = std::max(mx, m[l]);
  for (; j < n; ++j) mx = std::max(mx, s[j]);
  return mx;
}

// total[i] = s_i[0] + s_i[1] + ... in key order, for rows s_i of lens[i] scores: one chain of dependent
// additions per row (the order fixes the rounding), eight rows' chains interleaved so that they overlap.
static void row_totals(float* const* s, const int64_t* lens, int64_t n, float* total) {
  constexpr int kChains = 8;
  int64_t i = 0;
  for (; i + kChains <= n; i += kChains) {
    float t[kChains] = {};
    int64_t common = lens[i];
    for (int a = 1; a < kChains; ++a) common = std::min(common, lens[i + a]);
    for (int64_t j = 0; j < common; ++j)
      for (int a = 0; a < kChains; ++a) t[a] += s[i + a][j];
    for (int a = 0; a < kChains; ++a) {
      for (int64_t j = common; j < lens[i + a]; ++j) t[a] += s[i + a][j];
      total[i + a] = t[a];
    }
  }
  for (; i < n; ++i) {
    float t = 0.0f;
    for (int64_t j = 0; j < lens[i]; ++j) t += s[i][j];
    total[i] = t;
  }
}

// One vector of float lanes and the four operations the score and value loops need. fma rounds a * b + c once
// on every path (an instruction where there is one, fmaf in the portable build), so the lanes of each width
// give the same bits.
#if defined(__AVX512F__)
typedef __m512 VF;
constexpr int kLanes = 16;
static inline VF vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, VF v) { _mm512_storeu_ps(p, v); }
static inline VF vset1(float x) { return _mm512_set1_ps(x); }
static inline VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
#elif SPECDECODE_AVX2
typedef __m256 VF;
constexpr int kLanes = 8;
static inline VF vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, VF v) { _mm256_storeu_ps(p, v); }
static inline VF vset1(float x) { return _mm256_set1_ps(x); }
static inline VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
#else
typedef float VF;
constexpr int kLanes = 1;
static inline VF vload(const float* p) { return *p; }
static inline void vstore(float* p, VF v) { *p = v; }
static inline VF vset1(float x) { return x; }
static inline VF vfma(VF a, VF b, VF c) { return __builtin_fmaf(a, b, c); }
#endif
constexpr int kTileVecs = kKeyTile / kLanes;  // vectors per score tile row
// Register blocking (a row's arithmetic is the same in any block): enough independent fma chains to cover the
// fma latency on two ports, and no more accumulators than the register file holds (32 vectors with AVX-512,
// 16 with AVX2).
constexpr int kScoreRows = kLanes == 16 ? 8 : 4;
constexpr int kValueCols = kLanes == 16 ? 128 : kLanes == 8 ? 32 : 16;  // per pass of the value loop, 2 rows
constexpr int64_t kValueTile = 32;

// out[a][jj] = (sum_d q[a][d] * kt[d][jj]) * scale for NQ queries against one tile of kKeyTile transposed keys
// ([D, kKeyTile]), the sum a chain of fmas from d = 0 up: the NQ x kKeyTile independent chains keep the fma units
// busy where one dot product at a time would wait on its own additions.
template <int NQ>
static inline void score_tile(const float* const* q, const float* kt, int64_t D, float scale, int64_t jt,
                              float* const* out) {
  // One flat array of accumulators: GCC 12 kept one of a two-level array's vectors in memory across the loop,
  // a store and a reload in every fma chain step.
  VF acc[NQ * kTileVecs];
#pragma GCC unroll 16
  for (int i = 0; i < NQ * kTileVecs; ++i) acc[i] = vset1(0.0f);
  for (int64_t d = 0; d < D; ++d) {
    const float* kd = kt + d * kKeyTile;
#pragma GCC unroll 8
    for (int a = 0; a < NQ; ++a) {
      const VF qa = vset1(q[a][d]);
#pragma GCC unroll 16
      for (int c = 0; c < kTileVecs; ++c) acc[a * kTileVecs + c] = vfma(qa, vload(kd + c * kLanes), acc[a * kTileVecs + c]);
    }
  }
  // Unrolled, so that every index into acc is a constant and the array lives in registers only.
  alignas(64) float t[NQ][kKeyTile];
#pragma GCC unroll 8
  for (int a = 0; a < NQ; ++a)
#pragma GCC unroll 16
    for (int c = 0; c < kTileVecs; ++c) vstore(t[a] + c * kLanes, acc[a * kTileVecs + c]);
  for (int a = 0; a < NQ; ++a)
    for (int64_t jj = 0; jj < jt; ++jj) out[a][jj] = t[a][jj] * scale;
}

// Scores of query rows [i, n) against one key tile, kScoreRows rows at a time.
static inline void score_rows(float* const* srow, const float* const* q, int64_t i, int64_t n, int64_t j0,
                              const float* kt, int64_t D, float scale, int64_t jt) {
  float* out[kScoreRows];
  for (; i + kScoreRows <= n; i += kScoreRows) {
    for (int a = 0; a < kScoreRows; ++a) out[a] = srow[i + a] + j0;
    score_tile<kScoreRows>(q + i, kt, D, scale, jt, out);
  }
  for (int a = 0; i + a < n; ++a) out[a] = srow[i + a] + j0;
  switch (n - i) {
    case 7: if constexpr (kScoreRows > 7) score_tile<7>(q + i, kt, D, scale, jt, out); break;
    case 6: if constexpr (kScoreRows > 6) score_tile<6>(q + i, kt, D, scale, jt, out); break;
    case 5: if constexpr (kScoreRows > 5) score_tile<5>(q + i, kt, D, scale, jt, out); break;
    case 4: if constexpr (kScoreRows > 4) score_tile<4>(q + i, kt, D, scale, jt, out); break;
    case 3: score_tile<3>(q + i, kt, D, scale, jt, out); break;
    case 2: score_tile<2>(q + i, kt, D, scale, jt, out); break;
    case 1: score_tile<1>(q + i, kt, D, scale, jt, out); break;
    default: break;
  }
}

// acc[a][c0 + d] = fma(p[a][j], v_j[c0 + d], acc[a][c0 + d]) over keys [j0, j1) in key order, for NQ queries that
// all see those keys and the CW columns from c0 (a multiple of kLanes); vals holds v_j0, v_j0+1, ... in rows of
// D. The CW x NQ running sums stay in registers for the tile.
template <int CW, int NQ>
static inline void weighted_cols(float* const* p, int64_t j0, int64_t j1, const float* vals, int64_t D, int64_t c0,
                                 float* const* acc) {
  constexpr int NV = CW / kLanes;
  VF s[NQ][NV];
  for (int a = 0; a < NQ; ++a)
    for (int c = 0; c < NV; ++c) s[a][c] = vload(acc[a] + c0 + c * kLanes);
  for (int64_t j = j0; j < j1; ++j) {
    const float* v = vals + (j - j0) * D + c0;
    for (int a = 0; a < NQ; ++a) {
      const VF e = vset1(p[a][j]);
      for (int c = 0; c < NV; ++c) s[a][c] = vfma(e, vload(v + c * kLanes), s[a][c]);
    }
  }
  for (int a = 0; a < NQ; ++a)
    for (int c = 0; c < NV; ++c) vstore(acc[a] + c0 + c * kLanes, s[a][c]);
}

// Every column of NQ queries' sums over keys [j0, j1): blocks of kValueCols columns, then single vectors, then
// the columns past the last whole vector one at a time (each element's chain is the same in any of them).
template <int NQ>
static inline void weighted_sum(float* const* p, int64_t j0, int64_t j1, const float* vals, int64_t D,
                                float* const* acc) {
  int64_t c0 = 0;
  for (; c0 + kValueCols <= D; c0 += kValueCols) weighted_cols<kValueCols, NQ>(p, j0, j1, vals, D, c0, acc);
  for (; c0 + kLanes <= D; c0 += kLanes) weighted_cols<kLanes, NQ>(p, j0, j1, vals, D, c0, acc);
  for (; c0 < D; ++c0)
    for (int a = 0; a < NQ; ++a)
      for (int64_t j = j0; j < j1; ++j) acc[a][c0] = __builtin_fmaf(p[a][j], vals[(j - j0) * D + c0], acc[a][c0]);
}

}  // namespace

// One KV head against query rows [i0, i1) of a stretch of rows of one request that starts at row m0 (one cache
// slot, increasing positions); query row i is row m0 + i / rep's query head kv * rep + i % rep, and attends to
// keys [0, pos]. Keys and values are read once for all of those rows, so a verification pass over k + 1 rows
// streams the request's KV cache once, not k + 1 times. A long prompt's rows are split into several calls (the
// task list in layer_forward) so that their scores stay in cache; a row's arithmetic is the same in any split. Each
// block's keys are one transposed tile ([D, kKeyTile]), so nothing is transposed per step. Lanes of the last
// block past the newest key hold stale or zero values, and score tiles past a row's own position are not
// computed for it; such scores are never read.
void attend_rows(const LayerDesc& L, const StackDims& g, const float* qkv, int64_t nqkv, const int64_t* pos,
                 int64_t slot, int64_t m0, int64_t i0, int64_t i1, int64_t kv, int64_t rep, float* att,
                 int64_t ld_att, std::vector<float>& scratch) {
  const int64_t D = g.D, n = i1 - i0;
  int64_t len = 0;
  for (int64_t i = i0; i < i1; ++i) len = std::max(len, pos[m0 + i / rep] + 1);
  const int64_t ld = (len + kKeyTile - 1) / kKeyTile * kKeyTile;
  // scores [n, ld], totals [n], sums [n, D], one widened key tile [D, kKeyTile], one value tile [kValueTile, D]
  scratch.resize(n * ld + n + n * D + D * kKeyTile + kValueTile * D);
  float* const scores = scratch.data();
  float* const total = scores + n * ld;
  float* const acc = total + n;
  float* const key_tile = acc + n * D;
  float* const val_tile = key_tile + D * kKeyTile;
  std::vector<const float*> q(n);
  std::vector<float*> srow(n), orow(n);
  std::vector<int64_t> lens(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t m = m0 + (i0 + i) / rep, h = kv * rep + (i0 + i) % rep;
    q[i] = qkv + m * nqkv + h * D;
    orow[i] = att + m * ld_att + h * D;
    srow[i] = scores + i * ld;
    lens[i] = pos[m] + 1;
  }
  int64_t first = 0;  // rows before it end before the tile: lens never decreases along the rows
  for (int64_t j0 = 0; j0 < len; j0 += kKeyTile) {
    while (first < n && lens[first] <= j0) ++first;
    const int64_t jt = std::min(kKeyTile, len - j0);
    const int64_t blk = g.block(slot, j0), at = g.at(blk, kv);
    const float* tile = key_tile;
    if (g.kv_fmt == kKvF32) tile = static_cast<const float*>(L.keys) + at;
    else if (g.kv_fmt == kKvI8)
      load_key_tile_i8(static_cast<const int8_t*>(L.keys) + at, L.key_scales + g.scale_at(blk, kv), D, key_tile);
    else kv_load(g.kv_fmt, L.keys, at, D * kKeyTile, key_tile);
    score_rows(srow.data(), q.data(), first, n, j0, tile, D, g.scale, jt);
  }
  for (int64_t i = 0; i < n; ++i) {  // softmax numerators; keys past a row's own position are never read
    float* s = srow[i];
    exp_shifted(s, row_max(s, lens[i]), s, lens[i]);
  }
  row_totals(srow.data(), lens.data(), n, total);
  // Values in tiles of kValueTile keys (widened into val_tile), each tile used by every query while it sits in
  // L1 (a pass over all values per query would stream them from L3 once per query). A query's sums still run
  // in key order.
  std::vector<float*> arow(n);
  for (int64_t i = 0; i < n; ++i) arow[i] = acc + i * D;
  std::fill(acc, acc + n * D, 0.0f);
  for (int64_t j0 = 0; j0 < len; j0 += kValueTile) {
    const int64_t jend = std::min(j0 + kValueTile, len);
    for (int64_t b0 = j0; b0 < jend; b0 += kKeyTile) {  // b0 is a block's first position
      const int64_t blk = g.block(slot, b0), rows = std::min(kKeyTile, jend - b0);
      if (g.kv_fmt == kKvI8)
        load_value_rows_i8(static_cast<const int8_t*>(L.values) + g.at(blk, kv), L.value_scales + g.scale_at(blk, kv),
                           rows, D, val_tile + (b0 - j0) * D);
      else kv_load(g.kv_fmt, L.values, g.at(blk, kv), rows * D, val_tile + (b0 - j0) * D);
    }
    for (int64_t i = 0; i < n;) {
      const int64_t j1 = std::min(j0 + kValueTile, lens[i]);
      const bool pair = i + 1 < n && lens[i + 1] == lens[i];
      if (j1 > j0) {
        if (pair) weighted_sum<2>(&srow[i], j0, j1, val_tile, D, &arow[i]);
        else weighted_sum<1>(&srow[i], j0, j1, val_tile, D, &arow[i]);
      }
      i += pair ? 2 : 1;
    }
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < D; ++d) orow[i][d] = arow[i][d] / total[i];
}

}  // namespace specdecode
