// =============================================================================================
// W6A8: 6-bit weights x int8 activations in the layout of GGUF's Q6_K, exact integer dot products. Per 16
// weights of a channel an int8 scale code, per 256 weights one fp16 unit: w[n, k] = D[n, t] * sc[n, h] *
// (u[n, k] - 32) with u in 0..63, h = k / 16, t = k / 256, 6.5625 bits a weight (w8a8: 8 and a float per
// channel). A Q6_K block is held exactly as stored (D its d, sc its 16 scales, u its 6-bit values).
//
// Per (row, channel) and block b of 32 (halves h = 2b, 2b + 1) the kernel takes the exact integer
//   t_b = sc[n, 2b] * S_2b + sc[n, 2b + 1] * S_2b+1,   S_h = sum_{k in h} (u[n, k] - 32) * q[m, k]
// (|S_h| <= 16 * 32 * 127 and |sc| <= 128, so |t_b| < 2^24: float(t_b) is exact), then
//   acc = fma(float(t_b), d_b * D[n, t], acc)   for b = 0, 1, ... in order;   y[m, n] = acc + bias[n].
// The VNNI, AVX2 and scalar paths compute exactly this, so they agree bit for bit, and a row depends on no
// other row.
//
// Layout: channels in groups of 16 as for w8a8. Group g, block b is 384 bytes: four 64-byte vectors of low
// nibbles as w4a8 holds its u (vector j: lane l's byte i = low4(u[k0 + i]) | low4(u[k0 + 4 + i]) << 4, k0 =
// 32b + 8j), then two 64-byte vectors of high bits (vector h covers k = 32b + 16h .. + 15: lane l's byte i
// holds high2(u[k1 + 4s + i]) at bits 2s, 2s + 1 for s = 0..3, k1 = 32b + 16h). A group's scale row is
// [nblocks][32] codes (block b: sc of half 2b for lanes 0..15, then of half 2b + 1) and [nsuper][16] fp16 D.
#include "linear.h"
#include "quant.h"

namespace specdecode {
namespace {

// =============================================================================================
struct W6Args {
  QAct x;               // with hcorr
  const uint8_t* w;     // [groups, Kp * 12]
  const uint8_t* sc;    // [groups, stride()]
  int64_t Kp;
  int64_t nblocks;
  int64_t nsuper;       // ceil(nblocks / 8)
  int64_t N;
  const float* bias;
  float* y;
  int64_t ldy;
  const uint8_t* group(int64_t g) const { return w + g * nblocks * 384; }
  int64_t stride() const { return nblocks * 32 + nsuper * 32; }
  const int8_t* codes(int64_t g) const { return reinterpret_cast<const int8_t*>(sc + g * stride()); }
  const uint16_t* units(int64_t g) const { return reinterpret_cast<const uint16_t*>(sc + g * stride() + nblocks * 32); }
};

// u of lane l, k = 32b + 4 * quad + i (quad 0..7) in group g: the scalar statement of the layout above.
static inline int w6_u(const uint8_t* wg, int64_t b, int quad, int l, int i) {
  const uint8_t lo = wg[b * 384 + (quad / 2) * 64 + 4 * l + i];
  const uint8_t hi = wg[b * 384 + 256 + (quad / 4) * 64 + 4 * l + i];
  return ((quad % 2 ? lo >> 4 : lo & 0x0F)) | (((hi >> (2 * (quad % 4))) & 3) << 4);
}

static inline void w6a8_store(const W6Args& a, int64_t m, int64_t n0, const float* v, int lanes) {
  for (int l = 0; l < lanes && n0 + l < a.N; ++l) {
    float r = v[l];
    if (a.bias) r = r + a.bias[n0 + l];
    a.y[m * a.ldy + n0 + l] = r;
  }
}

#if SPECDECODE_VNNI
// Quads 4h..4h+3 of block b as bytes u (0..63): the low nibbles of vectors 2h, 2h + 1 and the high bits of
// vector hv.
static inline SPECDECODE_ALWAYS_INLINE void w6_unpack16(__m512i v0, __m512i v1, __m512i hv, __m512i (&u)[4]) {
  const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  // (a & low) | b, per bit: vpternlog's table for a ? ... : b with c = low
  u[0] = _mm512_ternarylogic_epi32(v0, low, _mm512_and_si512(_mm512_slli_epi16(hv, 4), top), 0xEA);
  u[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v0, 4), low, _mm512_and_si512(_mm512_slli_epi16(hv, 2), top), 0xEA);
  u[2] = _mm512_ternarylogic_epi32(v1, low, _mm512_and_si512(hv, top), 0xEA);
  u[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v1, 4), low, _mm512_and_si512(_mm512_srli_epi16(hv, 2), top), 0xEA);
}

// R rows x one group of 16 channels (every row count: a group's 384 bytes a block are reread from L1 by each
// tile of rows). Each half's sums start at -32 * sum(q) (hcorr), so they are S_h; the two halves' products
// with their codes make t_b.
template <int R>
static inline void w6a8_one(const W6Args& a, int64_t m0, int64_t g) {
  constexpr int kSums = R == 1 ? 2 : 1;  // one row: two chains per half, so the dot products do not wait
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* wg = a.group(g);
  const int8_t* cg = a.codes(g);
  const uint16_t* ug = a.units(g);
  for (int64_t b = 0; b < a.nblocks; ++b) {
    if (kPrefetch) {
      for (int l = 0; l < 6; ++l) prefetch_l2(reinterpret_cast<const char*>(wg) + (b + kW6PrefetchL2Blocks) * 384 + 64 * l);
      if ((b & 1) == 0) prefetch_l2(reinterpret_cast<const char*>(cg + (b + kW6PrefetchL2Blocks) * 32));
    }
    const uint8_t* wb = wg + b * 384;
    __m512i t[R];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m512i u[4];
      w6_unpack16(_mm512_loadu_si512(wb + 128 * h), _mm512_loadu_si512(wb + 128 * h + 64),
                  _mm512_loadu_si512(wb + 256 + 64 * h), u);
      const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cg + b * 32 + 16 * h)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* q = a.x.q + (m0 + r) * a.x.ldq + b * kQBlock + 16 * h;
        __m512i s[kSums];
        s[0] = _mm512_set1_epi32(a.x.hcorr[(m0 + r) * a.x.ldb * 2 + 2 * b + h]);
        if (kSums > 1) s[kSums - 1] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) s[j % kSums] = dpbusd_broadcast(s[j % kSums], u[j], q + 4 * j);
        if (kSums > 1) s[0] = _mm512_add_epi32(s[0], s[kSums - 1]);
        const __m512i p = _mm512_mullo_epi32(s[0], sc);
        t[r] = h == 0 ? p : _mm512_add_epi32(t[r], p);
      }
    }
    const __m512 unit = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ug + (b >> 3) * 16)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_set1_ps(a.x.d[(m0 + r) * a.x.ldb + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[r]), _mm512_mul_ps(d, unit), acc[r]);
    }
  }
  alignas(64) float out[16];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(out, acc[r]);
    w6a8_store(a, m0 + r, g * kGroup, out, 16);
  }
}

#elif SPECDECODE_AVX2
// R rows x one group of 16 channels, as two halves of 8. The weights are taken as stored (u, 0..63) and
// multiplied with q by vpmaddubsw: a pair of products is at most 16002 in magnitude, so no pair saturates. A
// 16-bit lane sums its pairs of a half block's four quads starting from its share of -32 * sum(q) (w6_corr):
// the running sum may wrap, but its final value, sum (u - 32) * q over 8 products, is at most 32512 in
// magnitude, so 16 bits hold it exactly. vpmaddwd with the half's codes then widens and scales the lane pairs
// in one instruction (|sc * 32512 * 2| < 2^31).
template <int R>
static inline void w6a8_group(const W6Args& a, int64_t m0, int64_t g) {
  constexpr int H = 2;
  __m256 acc[R][H];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int c = 0; c < H; ++c) acc[r][c] = _mm256_setzero_ps();
  const uint8_t* wg = a.group(g);
  const int8_t* cg = a.codes(g);
  const uint16_t* ug = a.units(g);
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  for (int64_t b = 0; b < a.nblocks; ++b) {
#pragma GCC unroll 6
    for (int l = 0; l < 6; ++l) prefetch(reinterpret_cast<const char*>(wg + (b + kW6PrefetchBlocks) * 384 + 64 * l));
    const uint8_t* wb = wg + b * 384;
    __m256i t[R][H];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256i s[R][H];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i corr = _mm256_set1_epi32(a.x.hcorr[(m0 + r) * a.x.ldb * 2 + 2 * b + h]);
#pragma GCC unroll 2
        for (int c = 0; c < H; ++c) s[r][c] = corr;
      }
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m256i w[H];
#pragma GCC unroll 2
        for (int c = 0; c < H; ++c) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 128 * h + 64 * (j / 2) + 32 * c));
          const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 256 + 64 * h + 32 * c));
          const __m256i lo = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, low);
          const __m256i hs = j == 0 ? _mm256_slli_epi16(hv, 4) : j == 1 ? _mm256_slli_epi16(hv, 2)
                                                             : j == 2 ? hv : _mm256_srli_epi16(hv, 2);
          w[c] = _mm256_or_si256(lo, _mm256_and_si256(hs, top));
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256i q = _mm256_set1_epi32(load4(a.x.q + (m0 + r) * a.x.ldq + b * kQBlock + 16 * h + 4 * j));
#pragma GCC unroll 2
          for (int c = 0; c < H; ++c) {
            s[r][c] = _mm256_add_epi16(s[r][c], _mm256_maddubs_epi16(w[c], q));
            __asm__("" : "+x"(s[r][c]));  // see w4a8_group (w4a8.cpp)
          }
        }
      }
#pragma GCC unroll 2
      for (int c = 0; c < H; ++c) {
        // codes as int16 pairs (sc, sc) per int32 lane
        const __m256i s32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cg + b * 32 + 16 * h + 8 * c)));
        const __m256i sc = _mm256_or_si256(_mm256_and_si256(s32, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(s32, 16));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256i p = _mm256_madd_epi16(s[r][c], sc);
          t[r][c] = h == 0 ? p : _mm256_add_epi32(t[r][c], p);
        }
      }
    }
#pragma GCC unroll 2
    for (int c = 0; c < H; ++c) {
      const __m256 unit = load_half8(ug + (b >> 3) * 16 + 8 * c);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 d = _mm256_set1_ps(a.x.d[(m0 + r) * a.x.ldb + b]);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[r][c]), _mm256_mul_ps(d, unit), acc[r][c]);
      }
    }
  }
  alignas(32) float out[8];
#pragma GCC unroll 2
  for (int c = 0; c < H; ++c)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm256_store_ps(out, acc[r][c]);
      w6a8_store(a, m0 + r, g * kGroup + 8 * c, out, 8);
    }
}
#endif

#if SPECDECODE_VNNI
template <int R>
static void w6a8_rows(const W6Args& a, int64_t m0, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) w6a8_one<R>(a, m0, g);
}
#elif SPECDECODE_AVX2
#ifndef SPECDECODE_W6_ROWS
#define SPECDECODE_W6_ROWS 6
#endif
// Rows per pass over a group: at most kW6Rows (row_passes). Each pass unpacks the group's 6-bit values again, which
// costs more than w4a8's nibbles, so all of a tile's rows (up to 6) take one pass: their int16 sums fill the ymm
// registers, and the int32 and float sums that spill are touched once per half block. Passes of at most 3 rows were
// slower at 4-6 rows (docs/benchmarks.md, session 29).
constexpr int kW6Rows = SPECDECODE_W6_ROWS;
template <int R>
static void w6a8_rows(const W6Args& a, int64_t m0, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g)
    row_passes<R, kW6Rows>(m0, [&](auto n, int64_t m) { w6a8_group<decltype(n)::value>(a, m, g); });
}
#else  // portable scalar path, same arithmetic
template <int R>
static void w6a8_rows(const W6Args& a, int64_t m0, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = a.group(g);
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const int8_t* q = a.x.q + m * a.x.ldq;
      float out[kGroup];
      for (int l = 0; l < kGroup; ++l) {
        float acc = 0.0f;
        for (int64_t b = 0; b < a.nblocks; ++b) {
          int32_t t = 0;
          for (int h = 0; h < 2; ++h) {
            int32_t s = 0;
            for (int k = 0; k < 16; ++k) s += (w6_u(wg, b, 4 * h + k / 4, l, k % 4) - 32) * int32_t(q[b * kQBlock + 16 * h + k]);
            t += int32_t(a.codes(g)[b * 32 + 16 * h + l]) * s;
          }
          acc = std::fma(static_cast<float>(t), a.x.d[m * a.x.ldb + b] * half_to_float(a.units(g)[(b >> 3) * 16 + l]), acc);
        }
        out[l] = acc;
      }
      w6a8_store(a, m, g * kGroup, out, kGroup);
    }
  }
}
#endif

static void w6a8_run(const W6Args& a, int64_t M) {
  static void (*const rows[6])(const W6Args&, int64_t, int64_t, int64_t) = {
      w6a8_rows<1>, w6a8_rows<2>, w6a8_rows<3>, w6a8_rows<4>, w6a8_rows<5>, w6a8_rows<6>};
  run_groups(a, M, a.Kp * 12 + a.stride(), rows);
}

}  // namespace

void w6a8_linear(const Lin& l, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy) {
  W6Args a;
  a.w = static_cast<const uint8_t*>(l.w);
  a.sc = static_cast<const uint8_t*>(l.scale);
  a.Kp = l.ldw;
  a.nblocks = l.ldw / kQBlock;
  a.nsuper = (a.nblocks + 7) / 8;
  a.N = l.N;
  a.bias = l.bias;
  a.y = y;
  a.ldy = ldy;
  with_quantized_x(x, ldx, l.K, l.ldw, M, [&](const QAct& q) { a.x = q; w6a8_run(a, M); }, true);
}

}  // namespace specdecode
