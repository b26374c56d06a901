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
  const float* scale;
  const float* bias;
  float* y;
  int64_t ldy;
  const uint8_t* group(int64_t g) const { return w + g * Kp * kGroup; }
};

#if SPECDECODE_VNNI
// y = acc * scale (+ bias) for rows [m0, m0 + R) x C groups from g0: the epilogue of the VNNI and AMX tiles.
template <int R, int C>
static inline SPECDECODE_ALWAYS_INLINE void w8a8_store(const W8Args& a, int64_t m0, int64_t g0, __m512 (&acc)[R][C]) {
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    const int64_t n0 = (g0 + c) * kGroup;
    const __mmask16 live = static_cast<__mmask16>(n0 + kGroup <= a.N ? 0xFFFF : (1u << (a.N - n0)) - 1);
    const __m512 sc = _mm512_maskz_loadu_ps(live, a.scale + n0);
    const __m512 bi = a.bias ? _mm512_maskz_loadu_ps(live, a.bias + n0) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      __m512 v = _mm512_mul_ps(acc[r][c], sc);
      if (a.bias) v = _mm512_add_ps(v, bi);
      _mm512_mask_storeu_ps(a.y + (m0 + r) * a.ldy + n0, live, v);
    }
  }
}

// R rows x C groups of 16 channels.
template <int R, int C>
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
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_set1_ps(a.x.d[(m0 + r) * a.x.ldb + b]);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[r][c]), d, acc[r][c]);
    }
  }
  w8a8_store<R, C>(a, m0, g0, acc);
}
constexpr int w8a8_width(int R) { return R <= 3 ? 4 : 2; }

#elif SPECDECODE_AVX2
// R rows x one group of 16 channels, as two halves of 8 held at once: each activation broadcast then feeds
// 16 channels. Beyond 3 rows some accumulators spill to L1, which measured cheaper than a second pass.
template <int R>
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
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h)
        wv[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + (b * 8 + j) * 64 + 32 * h)), flip);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t at = (m0 + r) * a.x.ldq + b * kQBlock + 4 * j;
        const __m256i q = _mm256_set1_epi32(load4(a.x.q + at));
        const __m256i aq = _mm256_set1_epi32(load4(a.x.qabs + at));
#pragma GCC unroll 2
        for (int h = 0; h < H; ++h) {
          // |q| * (sign(q) * w): byte pairs stay within int16 because |q|, |w| <= 127.
          const __m256i p = _mm256_maddubs_epi16(aq, _mm256_sign_epi8(wv[h], q));
          t[r][h] = _mm256_add_epi32(t[r][h], _mm256_madd_epi16(p, ones));
          __asm__("" : "+x"(t[r][h]));  // see w4a8_group (w4a8.cpp): keeps GCC from hoisting every product and spilling
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 d = _mm256_set1_ps(a.x.d[(m0 + r) * a.x.ldb + b]);
#pragma GCC unroll 2
      for (int h = 0; h < H; ++h) acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[r][h]), d, acc[r][h]);
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
        float v = out[r][l] * a.scale[n0 + l];
        if (a.bias) v = v + a.bias[n0 + l];
        a.y[(m0 + r) * a.ldy + n0 + l] = v;
      }
    }
  }
}
template <int R, int C>
static inline void w8a8_tile(const W8Args& a, int64_t m0, int64_t g0) {
  for (int c = 0; c < C; ++c) w8a8_group<R>(a, m0, g0 + c);
}
constexpr int w8a8_width(int) { return 1; }

#else  // portable scalar path, same arithmetic
template <int R, int C>
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
          acc = std::fma(static_cast<float>(t), dl[b], acc);
        }
        const int64_t n = (g0 + c) * kGroup + l;
        float s = acc * a.scale[n];
        if (a.bias) s = s + a.bias[n];
        a.y[m * a.ldy + n] = s;
      }
    }
  }
}
constexpr int w8a8_width(int) { return 1; }
#endif

template <int R>
static void w8a8_rows(const W8Args& a, int64_t m0, int64_t g0, int64_t g1) {
  group_rows<W8Args, R, w8a8_width(R), w8a8_tile<R, w8a8_width(R)>, w8a8_tile<R, 1>>(a, m0, g0, g1);
}

#if SPECDECODE_AMX
// Rows [m0, m0 + R) x C groups from g0.
template <int R, int C>
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
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512i n = _mm512_set1_epi32(nc[r * a.x.ldb + b]);
      const __m512 d = _mm512_set1_ps(dl[r * a.x.ldb + b]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_load_si512(sums[c][r]), n)), d, acc[r][c]);
    }
  }
  w8a8_store<R, C>(a, m0, g0, acc);
}

struct W8Tiles {
  template <int R, int C>
  static void tile(const W8Args& a, int64_t m0, int64_t g0) { w8a8_amx_tile<R, C>(a, m0, g0); }
};
#endif

static void w8a8_run(const W8Args& a, int64_t M) {
#if SPECDECODE_AMX
  if (M >= kAmxMinRows && amx_enabled()) {
    AmxRun<W8Args, W8Tiles>::run(a, M, a.Kp * kGroup);
    return;
  }
#endif
  static void (*const rows[6])(const W8Args&, int64_t, int64_t, int64_t) = {
      w8a8_rows<1>, w8a8_rows<2>, w8a8_rows<3>, w8a8_rows<4>, w8a8_rows<5>, w8a8_rows<6>};
  run_groups(a, M, a.Kp * kGroup, rows);
}

}  // namespace

void w8a8_linear(const Lin& l, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy) {
  W8Args a;
  a.w = static_cast<const uint8_t*>(l.w);
  a.Kp = l.ldw;
  a.nblocks = l.ldw / kQBlock;
  a.N = l.N;
  a.scale = static_cast<const float*>(l.scale);
  a.bias = l.bias;
  a.y = y;
  a.ldy = ldy;
  with_quantized_x(x, ldx, l.K, l.ldw, M, [&](const QAct& q) { a.x = q; w8a8_run(a, M); });
}

}  // namespace specdecode
