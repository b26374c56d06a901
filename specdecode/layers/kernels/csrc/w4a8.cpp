// =============================================================================================
// W4A8: 4-bit weights x int8 activations, exact integer dot products, in the layout of GGUF's Q4_K: per block
// of 32 weights of a channel an 8-bit scale code and an 8-bit offset code, and per 8 blocks (256 weights) one
// fp16 scale and one fp16 offset unit, so 18.5 bytes per 32 weights (an fp16 scale and offset per block took 20).
//
// Weight w[n, k] = s[n, b] * u[n, k] - o[n, b] with u in 0..15, b = k / 32, t = b / 8 and
//   s[n, b] = D[n, t] * cs[n, b],   o[n, b] = Dm[n, t] * co[n, b]   (cs, co: int8 codes; D, Dm: fp16).
// Both products are exact in float (8 + 11 significant bits), so every path gets the same s and o whatever
// instructions it uses. Per (row, channel) and block b the kernel takes the exact integer
// t_b = sum_{k in b} u[n, k] * q[m, k], then
//   acc = fma(float(t_b), d_b * s[n, b], acc)   for b = 0, 1, ... in order,
// and the offsets' share in a chain of its own, in block order,
//   c = 0;   c = fma(-(d_b * sum_{k in b} q[m, k]), o[n, b], c)   for b = 0, 1, ...;   y[m, n] = (acc + c) + bias[n],
// which w4a8_store, the end of every path (VNNI, AMX, AVX2, scalar), applies. Every path does exactly this, so
// they agree bit for bit and a row never depends on the other rows. A Q4_K block is held exactly as stored
// (D, Dm its d and dmin; cs, co its 6-bit scale and minimum).
//
// Layout: channels in groups of 16 as for w8a8; group g, block b, quarter j (8 k values) is 64 bytes in
// which lane l (channel 16g + l) holds 4 bytes, byte i = u[k0 + i] | u[k0 + 4 + i] << 4 with
// k0 = 32b + 8j. The low nibbles then line up with activation bytes k0..k0+3 and the high ones with
// k0+4..k0+7. A group's scale row is [nblocks][32] codes (block b: cs of lanes 0..15, then co of lanes
// 0..15), then [nsuper][32] fp16 (super-block t: D of lanes 0..15, then Dm of lanes 0..15).
#include "linear.h"
#include "quant.h"

namespace specdecode {
namespace {

// =============================================================================================
struct W4Args {
  QAct x;
  const uint8_t* w;     // [groups, Kp * 8]
  const uint8_t* sc;    // [groups, stride()]: codes, then super-block units (see above)
  int64_t Kp;
  int64_t nblocks;
  int64_t nsuper;       // ceil(nblocks / 8)
  int64_t N;
  const float* bias;
  float* y;
  int64_t ldy;
  bool one_group;       // few rows: tiles of a single group (see w4a8_one)
  const uint8_t* group(int64_t g) const { return w + g * Kp * (kGroup / 2); }
  int64_t stride() const { return nblocks * 32 + nsuper * 64; }
  const int8_t* codes(int64_t g) const { return reinterpret_cast<const int8_t*>(sc + g * stride()); }
  const uint16_t* units(int64_t g) const { return reinterpret_cast<const uint16_t*>(sc + g * stride() + nblocks * 32); }
};

// s[n, b] (part 0) or o[n, b] (part 16) of lane l of group g: an exact product (see above).
static inline float w4_unit(const W4Args& a, int64_t g, int64_t b, int l, int part) {
  return static_cast<float>(a.codes(g)[b * 32 + part + l]) * half_to_float(a.units(g)[(b >> 3) * 32 + part + l]);
}

#if SPECDECODE_AVX2
// w4_unit of lanes [l0, l0 + 8) of the group whose codes and units start at cg and ug (part added to l0).
static inline __m256 w4_unit8(const int8_t* cg, const uint16_t* ug, int64_t b, int l0) {
  const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cg + b * 32 + l0))));
  return _mm256_mul_ps(c, load_half8(ug + (b >> 3) * 32 + l0));
}
#endif

// The offsets' chain c (see above) of R rows from m0 for 8 channels from n0 (a multiple of 8): each offset
// vector is loaded once for all R rows.
template <int R>
static inline void w4a8_offsets(const W4Args& a, int64_t m0, int64_t n0, float (*c)[8]) {
  const int64_t g = n0 / kGroup;
  const int l0 = static_cast<int>(n0 % kGroup);
  const float* nq = a.x.noff + m0 * a.x.ldb;
#if SPECDECODE_AVX2
  const int8_t* cg = a.codes(g);
  const uint16_t* ug = a.units(g);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.nblocks; ++b) {
    const __m256 ob = w4_unit8(cg, ug, b, 16 + l0);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(nq[r * a.x.ldb + b]), ob, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(c[r], acc[r]);
#else
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < 8; ++l) {
      float acc = 0.0f;
      for (int64_t b = 0; b < a.nblocks; ++b) acc = std::fma(nq[r * a.x.ldb + b], w4_unit(a, g, b, l0 + l, 16), acc);
      c[r][l] = acc;
    }
#endif
}

// y[m, n0 + l] = (v[l] + c[l]) + bias for the lanes inside N; c: the offsets' chain, computed here if not given.
static inline void w4a8_store(const W4Args& a, int64_t m, int64_t n0, const float* v, int lanes,
                              const float* c = nullptr) {
  alignas(32) float own[2][8];
  if (c == nullptr) {
    for (int h = 0; h < lanes; h += 8) w4a8_offsets<1>(a, m, n0 + h, &own[h / 8]);
  }
  for (int l = 0; l < lanes && n0 + l < a.N; ++l) {
    float r = v[l] + (c ? c[l] : own[l / 8][l % 8]);
    if (a.bias) r = r + a.bias[n0 + l];
    a.y[m * a.ldy + n0 + l] = r;
  }
}

#if SPECDECODE_VNNI
// w4_unit of all 16 lanes of block b (part 0: scales, 16: offsets) of the group whose codes and units start at
// cg and ug.
static inline SPECDECODE_ALWAYS_INLINE __m512 w4_unit16(const int8_t* cg, const uint16_t* ug, int64_t b, int part) {
  const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cg + b * 32 + part))));
  return _mm512_mul_ps(c, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ug + (b >> 3) * 32 + part))));
}

// Block b of the offsets' chains (see w4a8_offsets) of R rows from m0, all 16 channels of group g: one offset
// vector for every row, one fma per row and lane, in block order.
template <int R>
static inline SPECDECODE_ALWAYS_INLINE void w4a8_offsets_block(const W4Args& a, int64_t m0, const int8_t* cg,
                                                               const uint16_t* ug, int64_t b, __m512 (&oc)[R]) {
  const __m512 ob = w4_unit16(cg, ug, b, 16);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) oc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a.x.noff[(m0 + r) * a.x.ldb + b]), ob, oc[r]);
}

// y = acc (+ bias) for rows [m0, m0 + R) x C groups from g0: the epilogue of the VNNI and AMX tiles.
template <int R, int C>
static inline SPECDECODE_ALWAYS_INLINE void w4a8_store_tile(const W4Args& a, int64_t m0, int64_t g0,
                                                            __m512 (&acc)[R][C]) {
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    alignas(64) float out[16], off[R][16];
    // The offsets' chains of the R rows at once, all 16 lanes: each offset vector is loaded once for every
    // row, and the R chains run side by side (one row's chain alone waits on its fma latency at every block).
    const int8_t* cg = a.codes(g0 + c);
    const uint16_t* ug = a.units(g0 + c);
    __m512 oc[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) oc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a.nblocks; ++b) w4a8_offsets_block<R>(a, m0, cg, ug, b, oc);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) _mm512_store_ps(off[r], oc[r]);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      _mm512_store_ps(out, acc[r][c]);
      w4a8_store(a, m0 + r, (g0 + c) * kGroup, out, 16, off[r]);
    }
  }
}

template <int R, int C>
static inline void w4a8_tile(const W4Args& a, int64_t m0, int64_t g0) {
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < a.nblocks; ++b) {
    if (kPrefetch) {
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const char* wg = reinterpret_cast<const char*>(a.group(g0 + c));
        for (int l = 0; l < 4; ++l) prefetch_l2(wg + (b + kW4PrefetchL2Blocks) * 256 + 64 * l);
        if ((b & 1) == 0) prefetch_l2(reinterpret_cast<const char*>(a.codes(g0 + c) + (b + kW4PrefetchL2Blocks) * 32));
      }
    }
    __m512i t[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) t[r][c] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m512i lo[C], hi[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const __m512i v = _mm512_loadu_si512(a.group(g0 + c) + (b * 4 + j) * 64);
        lo[c] = _mm512_and_si512(v, low);
        hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* q = a.x.q + (m0 + r) * a.x.ldq + b * kQBlock + 8 * j;
        const __m512i q0 = _mm512_set1_epi32(load4(q)), q1 = _mm512_set1_epi32(load4(q + 4));
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) t[r][c] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(t[r][c], lo[c], q0), hi[c], q1);
      }
    }
    __m512 sc[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) sc[c] = w4_unit16(a.codes(g0 + c), a.units(g0 + c), b, 0);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_set1_ps(a.x.d[(m0 + r) * a.x.ldb + b]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[r][c]), _mm512_mul_ps(d, sc[c]), acc[r][c]);
    }
  }
  w4a8_store_tile<R, C>(a, m0, g0, acc);
}
constexpr int w4a8_width(int R) { return R <= 2 ? 4 : 2; }


// R rows x one group of 16 channels, for decode and verification rows. A tile of several groups reads
// several weight and scale streams at once; a 0.5B draft's short rows (K = 896: 7 KB per group) then spend
// more time starting streams than reading them. One group at a time walks a thread's share as one weight
// stream and one scale stream (docs/benchmarks.md has the draft step's gain). Independent integer sums per
// row keep the dot-product chain from waiting on latency; integer sums are exact, so splitting them changes
// no result. With more rows the rows' own chains are independent enough, and fewer sums leave fewer
// additions and no spilled registers.
template <int R>
static inline void w4a8_one(const W4Args& a, int64_t m0, int64_t g) {
  constexpr int kSums = R == 1 ? 4 : R <= 3 ? 2 : 1;
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  const uint8_t* wg = a.group(g);
  const int8_t* cg = a.codes(g);
  const uint16_t* ug = a.units(g);
  // The offsets' chain (see w4a8_offsets) of all 16 channels, block by block beside the integer sums: the
  // same fma per lane in the same block order, so the same bits, but its latency now hides behind the weight
  // stream instead of following it as two serial passes per row.
  __m512 oacc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) oacc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.nblocks; ++b) {
    if (kPrefetch) {
      for (int l = 0; l < 4; ++l) prefetch_l2(reinterpret_cast<const char*>(wg) + (b + kW4PrefetchL2Blocks) * 256 + 64 * l);
      if ((b & 1) == 0) prefetch_l2(reinterpret_cast<const char*>(cg + (b + kW4PrefetchL2Blocks) * 32));
    }
    w4a8_offsets_block<R>(a, m0, cg, ug, b, oacc);
    __m512i t[R][kSums];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int i = 0; i < kSums; ++i) t[r][i] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(wg + (b * 4 + j) * 64);
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      const int s0 = (2 * j) % kSums, s1 = (2 * j + 1) % kSums;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* q = a.x.q + (m0 + r) * a.x.ldq + b * kQBlock + 8 * j;
        t[r][s0] = dpbusd_broadcast(t[r][s0], lo, q);
        t[r][s1] = dpbusd_broadcast(t[r][s1], hi, q + 4);
      }
    }
    const __m512 sc = w4_unit16(cg, ug, b, 0);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512i tt = t[r][0];
#pragma GCC unroll 4
      for (int i = 1; i < kSums; ++i) tt = _mm512_add_epi32(tt, t[r][i]);
      const __m512 d = _mm512_set1_ps(a.x.d[(m0 + r) * a.x.ldb + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tt), _mm512_mul_ps(d, sc), acc[r]);
    }
  }
  alignas(64) float out[16], c[16];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(out, acc[r]);
    _mm512_store_ps(c, oacc[r]);
    w4a8_store(a, m0 + r, g * kGroup, out, 16, c);
  }
}

#elif SPECDECODE_AVX2
// R rows x one group of 16 channels, as two halves of 8 held at once. Products of a nibble (<= 15) and an
// activation byte (|q| <= 127) summed in pairs are at most 3810 in magnitude, so a block's 8 pair sums
// per lane fit int16 exactly (<= 30480) and are widened once per block.
template <int R>
static inline void w4a8_group(const W4Args& a, int64_t m0, int64_t g) {
  constexpr int H = 2;
  __m256 acc[R][H];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) acc[r][h] = _mm256_setzero_ps();
  const uint8_t* wg = a.group(g);
  const int8_t* cg = a.codes(g);
  const uint16_t* ug = a.units(g);
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  // With few rows the offsets' chains (see w4a8_offsets) run beside the integer sums, block by block: the same
  // fma per lane in the same order, so the same bits, with their latency hidden behind the weight stream. With
  // more rows their registers would spill, and the R chains side by side after the loop keep the units busy.
  constexpr bool kInLoop = R <= 3;
  __m256 oacc[R][H];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) oacc[r][h] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.nblocks; ++b) {
    if (kInLoop) {
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) {
        const __m256 ob = w4_unit8(cg, ug, b, 16 + 8 * h);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          oacc[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(a.x.noff[(m0 + r) * a.x.ldb + b]), ob, oacc[r][h]);
      }
    }
    {
#pragma GCC unroll 4
      for (int l = 0; l < 4; ++l) prefetch(reinterpret_cast<const char*>(wg + (b + kW4PrefetchBlocks) * 256 + 64 * l));
      if ((b & 1) == 0) prefetch(reinterpret_cast<const char*>(cg + (b + kW4PrefetchBlocks) * 32));
    }
    __m256i t[R][H];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) t[r][h] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m256i lo[H], hi[H];
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + (b * 4 + j) * 64 + 32 * h));
        lo[h] = _mm256_and_si256(v, low);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* q = a.x.q + (m0 + r) * a.x.ldq + b * kQBlock + 8 * j;
        const __m256i q0 = _mm256_set1_epi32(load4(q)), q1 = _mm256_set1_epi32(load4(q + 4));
#pragma GCC unroll 2
        for (int h = 0; h < H; ++h) {
          t[r][h] = _mm256_add_epi16(t[r][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], q0),
                                                               _mm256_maddubs_epi16(hi[h], q1)));
          // The sum must be in a register here. Without this, GCC reassociates the integer adds: it computes
          // every product of the block first and spills most of them to the stack (about 1.2x slower).
          __asm__("" : "+x"(t[r][h]));
        }
      }
    }
    __m256 sc[H];
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) sc[h] = w4_unit8(cg, ug, b, 8 * h);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 d = _mm256_set1_ps(a.x.d[(m0 + r) * a.x.ldb + b]);
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) {
        const __m256i t32 = _mm256_madd_epi16(t[r][h], ones);
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t32), _mm256_mul_ps(d, sc[h]), acc[r][h]);
      }
    }
  }
#pragma GCC unroll 2
  for (int h = 0; h < H; ++h) {
    alignas(32) float out[8], c[R][8];
    if (kInLoop) {
      for (int r = 0; r < R; ++r) _mm256_store_ps(c[r], oacc[r][h]);
    } else {
      w4a8_offsets<R>(a, m0, g * kGroup + 8 * h, c);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm256_store_ps(out, acc[r][h]);
      w4a8_store(a, m0 + r, g * kGroup + 8 * h, out, 8, c[r]);
    }
  }
}
#ifndef SPECDECODE_W4_ROWS
#define SPECDECODE_W4_ROWS 4
#endif
// Rows per pass over a group: at most kW4Rows (row_passes). Each pass unpacks the group's nibbles again, from L1; more
// rows' accumulators than the 16 ymm registers hold spill, but only the float ones, once per block.
constexpr int kW4Rows = SPECDECODE_W4_ROWS;
template <int R>
static inline void w4a8_group_rows(const W4Args& a, int64_t m0, int64_t g) {
  row_passes<R, kW4Rows>(m0, [&](auto n, int64_t m) { w4a8_group<decltype(n)::value>(a, m, g); });
}
template <int R, int C>
static inline void w4a8_tile(const W4Args& a, int64_t m0, int64_t g0) {
  for (int c = 0; c < C; ++c) w4a8_group_rows<R>(a, m0, g0 + c);
}
constexpr int w4a8_width(int) { return 1; }

#else  // portable scalar path, same arithmetic
template <int R, int C>
static inline void w4a8_tile(const W4Args& a, int64_t m0, int64_t g0) {
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    const int8_t* q = a.x.q + m * a.x.ldq;
    const float* dl = a.x.d + m * a.x.ldb;
    for (int c = 0; c < C; ++c) {
      const uint8_t* wg = a.group(g0 + c);
      float out[kGroup];
      for (int l = 0; l < kGroup; ++l) {
        float acc = 0.0f;
        for (int64_t b = 0; b < a.nblocks; ++b) {
          int32_t t = 0;
          for (int64_t k = b * kQBlock; k < (b + 1) * kQBlock; ++k) {
            const int64_t j = (k % kQBlock) / 8, i = k % 8;
            const uint8_t byte = wg[(b * 4 + j) * 64 + 4 * l + i % 4];
            t += int32_t(i < 4 ? byte & 0x0F : byte >> 4) * int32_t(q[k]);
          }
          acc = std::fma(static_cast<float>(t), dl[b] * w4_unit(a, g0 + c, b, l, 0), acc);
        }
        out[l] = acc;
      }
      w4a8_store(a, m, (g0 + c) * kGroup, out, kGroup);
    }
  }
}
constexpr int w4a8_width(int) { return 1; }
#endif

template <int R>
static void w4a8_rows(const W4Args& a, int64_t m0, int64_t g0, int64_t g1) {
#if SPECDECODE_VNNI
  if (a.one_group) {
    for (int64_t g = g0; g < g1; ++g) w4a8_one<R>(a, m0, g);
    return;
  }
#endif
  group_rows<W4Args, R, w4a8_width(R), w4a8_tile<R, w4a8_width(R)>, w4a8_tile<R, 1>>(a, m0, g0, g1);
}

#if SPECDECODE_AMX
// AMX for the 4-bit format: each block's nibbles are spread to bytes (quarter j's low nibbles are quad 2j of
// the block, its high ones quad 2j + 1), which makes them a B tile; the sums and the epilogue
// fma(float(t_b), d_b * s[n, b], acc) are those of the VNNI path, so the output is bitwise the same.
template <int R, int C>
static inline void w4a8_amx_tile(const W4Args& a, int64_t m0, int64_t g0) {
  alignas(64) int32_t sums[C][kAmxRows][kGroup];
  alignas(64) uint8_t bytes[C][512];
  const int8_t* q = a.x.q + m0 * a.x.ldq;
  const float* dl = a.x.d + m0 * a.x.ldb;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const uint8_t* w[C];
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) w[c] = bytes[c];
  __m512 acc[R][C] = {};
  for (int64_t b = 0; b < a.nblocks; ++b) {
    __m512 sc[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const uint8_t* wg = a.group(g0 + c) + b * 256;
      if (kPrefetch) {
        for (int l = 0; l < 4; ++l) prefetch(reinterpret_cast<const char*>(wg) + kW4PrefetchBlocks * 256 + 64 * l);
        if ((b & 1) == 0) prefetch(reinterpret_cast<const char*>(a.codes(g0 + c) + (b + kW4PrefetchBlocks) * 32));
      }
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(wg + 64 * j);
        _mm512_store_si512(bytes[c] + 128 * j, _mm512_and_si512(v, low));
        _mm512_store_si512(bytes[c] + 128 * j + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
      }
      sc[c] = w4_unit16(a.codes(g0 + c), a.units(g0 + c), b, 0);
    }
    amx_block_sums<C>(q + b * kQBlock, a.x.ldq, w, sums);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_set1_ps(dl[r * a.x.ldb + b]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[c][r])),
                                    _mm512_mul_ps(d, sc[c]), acc[r][c]);
    }
  }
  w4a8_store_tile<R, C>(a, m0, g0, acc);
}

struct W4Tiles {
  template <int R, int C>
  static void tile(const W4Args& a, int64_t m0, int64_t g0) { w4a8_amx_tile<R, C>(a, m0, g0); }
};
#endif

static void w4a8_run(const W4Args& a, int64_t M) {
  const int64_t group_bytes = a.Kp * kGroup / 2 + a.stride();
#if SPECDECODE_AMX
  if (M >= kAmx4MinRows && amx_enabled()) {
    AmxRun<W4Args, W4Tiles>::run(a, M, group_bytes);
    return;
  }
#endif
  static void (*const rows[6])(const W4Args&, int64_t, int64_t, int64_t) = {
      w4a8_rows<1>, w4a8_rows<2>, w4a8_rows<3>, w4a8_rows<4>, w4a8_rows<5>, w4a8_rows<6>};
  run_groups(a, M, group_bytes, rows);
}

}  // namespace

void w4a8_linear(const Lin& l, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy) {
  W4Args a;
  a.w = static_cast<const uint8_t*>(l.w);
  a.sc = static_cast<const uint8_t*>(l.scale);
  a.Kp = l.ldw;
  a.nblocks = l.ldw / kQBlock;
  a.nsuper = (a.nblocks + 7) / 8;
  a.N = l.N;
  a.bias = l.bias;
  a.y = y;
  a.ldy = ldy;
  a.one_group = M <= kOneGroupRows;
  with_quantized_x(x, ldx, l.K, l.ldw, M, [&](const QAct& q) { a.x = q; w4a8_run(a, M); });
}

}  // namespace specdecode
