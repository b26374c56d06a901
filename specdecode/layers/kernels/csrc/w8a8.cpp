// =============================================================================================
// W8A8: int8 weights x int8 activations with exact integer dot products.
//
// Activations are quantized inside the call, row by row, in blocks of 32 along K (like llama.cpp's
// q8_0): d = absmax / 127, q = round_half_even(x / d) computed as x * (1 / d). Per (row, channel) and
// block b the kernel takes the exact integer t_b = sum_{k in b} w[n, k] * q[m, k], then
//   acc = fma(float(t_b), d_b, acc)   for b = 0, 1, ... in order;   y[m, n] = acc * scale[n] + bias[n].
// A row's quantization depends only on that row, integer sums have no order, and the float part is one
// fixed sequence per (row, channel), so row invariance costs nothing. The AVX-512 VNNI, AVX2 and scalar
// paths compute exactly this, so they agree bit for bit.
//
// Weight layout, interleaved for the integer dot-product instructions: channels are taken in groups of
// 16 (N padded to a multiple of 16) and K in quads of 4 bytes; group g, quad j is 64 contiguous bytes
// holding channel 16g + l's bytes 4j..4j+3 in lane l. One vector load then feeds 16 channels, the 4
// activation bytes are broadcast, and one float conversion + fma per block serves 8 integer steps.
// Bytes are stored as w + 128 in uint8 (padding is 128, i.e. weight 0). vpdpbusd multiplies unsigned by
// signed bytes, so it sees (w + 128) * q; each block's integer accumulator starts at -128 * sum(q).
//
// Q8_0 (GGUF's Q8_0 blocks as stored: per channel and block of 32 an int8 q, any value -128 included, and an
// fp16 d) is the same code with Q8 = true: the same weight layout and integer sums t_b, while the float part
// takes the weight's d of the block instead of a scale per channel:
//   acc = fma(float(t_b), d_b * D[n, b], acc)   for b = 0, 1, ... in order;   y[m, n] = acc + bias[n],
// as w6a8 does (|t_b| <= 32 * 128 * 127 < 2^24: float(t_b) is exact). D is stored per group and block, the 16
// channels' fp16 values side by side (units). AVX2's products take |w| and q * sign(w) there, since a weight of
// -128 has no positive counterpart in a signed byte (w8a8's weights are within -127..127).
// =============================================================================================
#include "linear.h"
#include "quant.h"

namespace specdecode {
namespace {

struct W8Args {
  QAct x;
  const uint8_t* w;  // [ceil(N / 16), Kp * 16], interleaved
  int64_t Kp;
  int64_t nblocks;   // Kp / 32
  int64_t N;
  const float* scale;      // w8a8: per channel
  const uint16_t* units;   // q8_0: fp16 D per (group, block, lane), [ceil(N / 16), nblocks * 16]
  const float* bias;
  float* y;
  int64_t ldy;
  const uint8_t* group(int64_t g) const { return w + g * Kp * kGroup; }
  const uint16_t* group_units(int64_t g) const { return units + g * nblocks * kGroup; }
};

#if SPECDECODE_VNNI
// y = acc * scale (+ bias), Q8: acc (+ bias), for rows [m0, m0 + R) x C groups from g0: the epilogue of the VNNI
// and AMX tiles.
template <bool Q8, int R, int C>
static inline SPECDECODE_ALWAYS_INLINE void w8a8_store(const W8Args& a, int64_t m0, int64_t g0, __m512 (&acc)[R][C]) {
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    const int64_t n0 = (g0 + c) * kGroup;
    const __mmask16 live = static_cast<__mmask16>(n0 + kGroup <= a.N ? 0xFFFF : (1u << (a.N - n0)) - 1);
    const __m512 sc = Q8 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(live, a.scale + n0);
    const __m512 bi = a.bias ? _mm512_maskz_loadu_ps(live, a.bias + n0) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      __m512 v = Q8 ? acc[r][c] : _mm512_mul_ps(acc[r][c], sc);
      if (a.bias) v = _mm512_add_ps(v, bi);
      _mm512_mask_storeu_ps(a.y + (m0 + r) * a.ldy + n0, live, v);
    }
  }
}

// The weight scales of block b for C groups from g0, as floats (Q8 only).
template <int C>
static inline SPECDECODE_ALWAYS_INLINE void q8_units(const W8Args& a, int64_t g0, int64_t b, __m512 (&u)[C]) {
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    u[c] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.group_units(g0 + c) + b * kGroup)));
}

// R rows x C groups of 16 channels.
template <bool Q8, int R, int C>
static inline void w8a8_tile(const W8Args& a, int64_t m0, int64_t g0) {
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const uint8_t* wg[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) wg[c] = a.group(g0 + c);
  for (int64_t b = 0; b < a.nblocks; ++b) {
    if (kPrefetch) {
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
#pragma GCC unroll 8
        for (int l = 0; l < 8; ++l) prefetch_l2(reinterpret_cast<const char*>(wg[c] + (b + kW8PrefetchL2Blocks) * 512 + 64 * l));
    }
    __m512i t[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i nc = _mm512_set1_epi32(a.x.ncorr[(m0 + r) * a.x.ldb + b]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) t[r][c] = nc;
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m512i wv[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(wg[c] + (b * 8 + j) * 64);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i q = _mm512_set1_epi32(load4(a.x.q + (m0 + r) * a.x.ldq + b * kQBlock + 4 * j));
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) t[r][c] = _mm512_dpbusd_epi32(t[r][c], wv[c], q);
      }
    }
    __m512 u[C];
    if constexpr (Q8) q8_units<C>(a, g0, b, u);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_set1_ps(a.x.d[(m0 + r) * a.x.ldb + b]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[r][c]), Q8 ? _mm512_mul_ps(d, u[c]) : d, acc[r][c]);
    }
  }
  w8a8_store<Q8, R, C>(a, m0, g0, acc);
}
constexpr int w8a8_width(int R) { return R <= 3 ? 4 : 2; }

#elif SPECDECODE_AVX2
// R rows x one group of 16 channels, as two halves of 8 held at once: each activation broadcast then feeds
// 16 channels. Beyond 3 rows some accumulators spill to L1, which measured cheaper than a second pass.
template <bool Q8, int R>
static inline void w8a8_group(const W8Args& a, int64_t m0, int64_t g) {
  constexpr int H = 2;
  __m256 acc[R][H];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) acc[r][h] = _mm256_setzero_ps();
  const uint8_t* wg = a.group(g);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < a.nblocks; ++b) {
    {
#pragma GCC unroll 8
      for (int l = 0; l < 8; ++l) prefetch(reinterpret_cast<const char*>(wg + (b + kW8PrefetchBlocks) * 512 + 64 * l));
    }
    __m256i t[R][H];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) t[r][h] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m256i wv[H];  // signed weights: (w + 128) ^ 0x80 == w
      __m256i wa[H];  // Q8: |w| (128 for -128, read as unsigned)
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) {
        wv[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + (b * 8 + j) * 64 + 32 * h)), flip);
        if constexpr (Q8) wa[h] = _mm256_abs_epi8(wv[h]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t at = (m0 + r) * a.x.ldq + b * kQBlock + 4 * j;
        const __m256i q = _mm256_set1_epi32(load4(a.x.q + at));
        const __m256i aq = Q8 ? q : _mm256_set1_epi32(load4(a.x.qabs + at));
#pragma GCC unroll 2
        for (int h = 0; h < H; ++h) {
          // |q| * (sign(q) * w), or for Q8 |w| * (sign(w) * q): byte pairs stay within int16 because |q| <= 127
          // and |w| <= 128.
          const __m256i p = Q8 ? _mm256_maddubs_epi16(wa[h], _mm256_sign_epi8(q, wv[h]))
                               : _mm256_maddubs_epi16(aq, _mm256_sign_epi8(wv[h], q));
          t[r][h] = _mm256_add_epi32(t[r][h], _mm256_madd_epi16(p, ones));
          __asm__("" : "+x"(t[r][h]));  // see w4a8_group (w4a8.cpp): keeps GCC from hoisting every product and spilling
        }
      }
    }
    __m256 u[H];  // Q8: the block's weight scales
    if constexpr (Q8)
      for (int h = 0; h < H; ++h) u[h] = load_half8(a.group_units(g) + b * kGroup + 8 * h);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 d = _mm256_set1_ps(a.x.d[(m0 + r) * a.x.ldb + b]);
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h)
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[r][h]), Q8 ? _mm256_mul_ps(d, u[h]) : d, acc[r][h]);
    }
  }
#pragma GCC unroll 2
  for (int h = 0; h < H; ++h) {
    const int64_t n0 = g * kGroup + 8 * h;
    alignas(32) float out[R][8];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm256_store_ps(out[r], acc[r][h]);
    for (int l = 0; l < 8 && n0 + l < a.N; ++l) {
      for (int r = 0; r < R; ++r) {
        float v = Q8 ? out[r][l] : out[r][l] * a.scale[n0 + l];
        if (a.bias) v = v + a.bias[n0 + l];
        a.y[(m0 + r) * a.ldy + n0 + l] = v;
      }
    }
  }
}
template <bool Q8, int R, int C>
static inline void w8a8_tile(const W8Args& a, int64_t m0, int64_t g0) {
  for (int c = 0; c < C; ++c) w8a8_group<Q8, R>(a, m0, g0 + c);
}
constexpr int w8a8_width(int) { return 1; }

#else  // portable scalar path, same arithmetic
template <bool Q8, int R, int C>
static inline void w8a8_tile(const W8Args& a, int64_t m0, int64_t g0) {
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    const int8_t* q = a.x.q + m * a.x.ldq;
    const float* dl = a.x.d + m * a.x.ldb;
    for (int c = 0; c < C; ++c) {
      const uint8_t* wg = a.group(g0 + c);
      for (int l = 0; l < kGroup && (g0 + c) * kGroup + l < a.N; ++l) {
        float acc = 0.0f;
        for (int64_t b = 0; b < a.nblocks; ++b) {
          int32_t t = 0;
          for (int64_t k = b * kQBlock; k < (b + 1) * kQBlock; ++k)
            t += (int32_t(wg[(k / 4) * 64 + 4 * l + k % 4]) - 128) * int32_t(q[k]);
          acc = std::fma(static_cast<float>(t), Q8 ? dl[b] * half_to_float(a.group_units(g0 + c)[b * kGroup + l]) : dl[b],
                         acc);
        }
        const int64_t n = (g0 + c) * kGroup + l;
        float s = Q8 ? acc : acc * a.scale[n];
        if (a.bias) s = s + a.bias[n];
        a.y[m * a.ldy + n] = s;
      }
    }
  }
}
constexpr int w8a8_width(int) { return 1; }
#endif

template <bool Q8, int R>
static void w8a8_rows(const W8Args& a, int64_t m0, int64_t g0, int64_t g1) {
  group_rows<W8Args, R, w8a8_width(R), w8a8_tile<Q8, R, w8a8_width(R)>, w8a8_tile<Q8, R, 1>>(a, m0, g0, g1);
}

#if SPECDECODE_AMX
// Rows [m0, m0 + R) x C groups from g0.
template <bool Q8, int R, int C>
static inline void w8a8_amx_tile(const W8Args& a, int64_t m0, int64_t g0) {
  alignas(64) int32_t sums[C][kAmxRows][kGroup];
  const int8_t* q = a.x.q + m0 * a.x.ldq;
  const int32_t* nc = a.x.ncorr + m0 * a.x.ldb;
  const float* dl = a.x.d + m0 * a.x.ldb;
  __m512 acc[R][C] = {};
  for (int64_t b = 0; b < a.nblocks; ++b) {
    const uint8_t* w[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      w[c] = a.group(g0 + c) + b * 512;
      if (kPrefetch)
        for (int l = 0; l < 8; ++l) prefetch(reinterpret_cast<const char*>(w[c] + kAmxPrefetchBlocks * 512 + 64 * l));
    }
    amx_block_sums<C>(q + b * kQBlock, a.x.ldq, w, sums);
    __m512 u[C];
    if constexpr (Q8) q8_units<C>(a, g0, b, u);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512i n = _mm512_set1_epi32(nc[r * a.x.ldb + b]);
      const __m512 d = _mm512_set1_ps(dl[r * a.x.ldb + b]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_load_si512(sums[c][r]), n)),
                                    Q8 ? _mm512_mul_ps(d, u[c]) : d, acc[r][c]);
    }
  }
  w8a8_store<Q8, R, C>(a, m0, g0, acc);
}

template <bool Q8>
struct W8Tiles {
  template <int R, int C>
  static void tile(const W8Args& a, int64_t m0, int64_t g0) { w8a8_amx_tile<Q8, R, C>(a, m0, g0); }
};
#endif

template <bool Q8>
static void w8a8_run(const W8Args& a, int64_t M) {
  const int64_t group_bytes = a.Kp * kGroup + (Q8 ? a.nblocks * kGroup * 2 : 0);
#if SPECDECODE_AMX
  if (M >= kAmxMinRows && amx_enabled()) {
    AmxRun<W8Args, W8Tiles<Q8>>::run(a, M, group_bytes);
    return;
  }
#endif
  static void (*const rows[6])(const W8Args&, int64_t, int64_t, int64_t) = {
      w8a8_rows<Q8, 1>, w8a8_rows<Q8, 2>, w8a8_rows<Q8, 3>, w8a8_rows<Q8, 4>, w8a8_rows<Q8, 5>, w8a8_rows<Q8, 6>};
  run_groups(a, M, group_bytes, rows);
}

static W8Args w8_args(const Lin& l, float* y, int64_t ldy) {
  W8Args a;
  a.w = static_cast<const uint8_t*>(l.w);
  a.Kp = l.ldw;
  a.nblocks = l.ldw / kQBlock;
  a.N = l.N;
  a.scale = nullptr;
  a.units = nullptr;
  a.bias = l.bias;
  a.y = y;
  a.ldy = ldy;
  return a;
}

}  // namespace

void w8a8_linear(const Lin& l, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy) {
  W8Args a = w8_args(l, y, ldy);
  a.scale = static_cast<const float*>(l.scale);
  with_quantized_x(x, ldx, l.K, l.ldw, M, [&](const QAct& q) { a.x = q; w8a8_run<false>(a, M); });
}

void q8_0_linear(const Lin& l, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy) {
  W8Args a = w8_args(l, y, ldy);
  a.units = static_cast<const uint16_t*>(l.scale);
  with_quantized_x(x, ldx, l.K, l.ldw, M, [&](const QAct& q) { a.x = q; w8a8_run<true>(a, M); });
}

}  // namespace specdecode
