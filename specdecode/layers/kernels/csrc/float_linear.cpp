// The row-invariant linear of the float-activation formats: fp32, bf16 and int8 weights.
//
// y[m, n] = (sum_k x[m, k] * w[n, k]) * scale[n] + bias[n]
//
// Guarantees
//  * Row invariance: the value of y[m, n] depends only on x[m, :], w[n, :], scale[n], bias[n].
//    Every (row, channel) dot product is accumulated in one 8-lane fp32 accumulator, walking K in
//    steps of 8 from k = 0 upwards (the K tail is one masked step), followed by one fixed horizontal
//    reduction, then "* scale" and "+ bias" as separate roundings. Tiles of different shapes (R rows
//    x C channels) only change how many of these independent accumulators are live at once, never
//    the arithmetic of any single one. Threads split output channels only, never K. So the result
//    does not depend on M, on the other rows, on the tile a row lands in, or on the thread count.
//  * Weights are streamed once per call for M <= kRowBlock: for each block of output channels all
//    rows are processed while the block is hot in L2.
//
// Must be compiled without -ffast-math (and with -ffp-contract=off so the scalar fallback is never
// contracted differently in different instantiations).
#include "linear.h"

namespace specdecode {
namespace {

// ---------------------------------------------------------------------------------------------
// 8-lane vector abstraction: AVX2 intrinsics or a portable scalar emulation. Both paths apply the
// same sequence of operations to every (row, channel) pair.
// ---------------------------------------------------------------------------------------------
#if SPECDECODE_AVX2
using Vec = __m256;

static inline Vec vzero() { return _mm256_setzero_ps(); }
static inline Vec vload_x(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256i tail_mask(int n) {
  // lanes [0, n) active
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx);
}
static inline Vec vload_x_tail(const float* p, __m256i mask) { return _mm256_maskload_ps(p, mask); }
static inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
// Keep a loaded activation vector in a register (GCC otherwise re-loads it as a memory operand of
// every FMA that uses it). Pure register constraint, no effect on the value.
static inline Vec pin(Vec v) {
  __asm__("" : "+x"(v));
  return v;
}
static inline float vhsum(Vec v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);                       // lanes (0+4, 1+5, 2+6, 3+7)
  __m128 sh = _mm_movehl_ps(lo, lo);             // (2+6, 3+7, ...)
  lo = _mm_add_ps(lo, sh);                       // (0+4+2+6, 1+5+3+7, ...)
  sh = _mm_shuffle_ps(lo, lo, 0x55);             // lane 1
  lo = _mm_add_ss(lo, sh);
  return _mm_cvtss_f32(lo);
}

template <int FMT>
static inline Vec vload_w(const void* base, int64_t idx);

template <>
inline Vec vload_w<kF32>(const void* base, int64_t idx) {
  return _mm256_loadu_ps(static_cast<const float*>(base) + idx);
}
template <>
inline Vec vload_w<kBF16>(const void* base, int64_t idx) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + idx));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
template <>
inline Vec vload_w<kI8>(const void* base, int64_t idx) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + idx));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

#else  // portable fallback

struct Vec {
  float v[8];
};
using Mask = int;

static inline Vec vzero() {
  Vec r;
  for (int l = 0; l < 8; ++l) r.v[l] = 0.0f;
  return r;
}
static inline Vec vload_x(const float* p) {
  Vec r;
  for (int l = 0; l < 8; ++l) r.v[l] = p[l];
  return r;
}
static inline int tail_mask(int n) { return n; }
static inline Vec pin(Vec v) { return v; }
static inline Vec vload_x_tail(const float* p, int n) {
  Vec r;
  for (int l = 0; l < 8; ++l) r.v[l] = l < n ? p[l] : 0.0f;
  return r;
}
static inline Vec vfma(Vec a, Vec b, Vec c) {
  Vec r;
  for (int l = 0; l < 8; ++l) {
    const float p = a.v[l] * b.v[l];  // -ffp-contract=off: two roundings, always
    r.v[l] = c.v[l] + p;
  }
  return r;
}
static inline float vhsum(Vec v) {
  // same tree as the AVX2 path
  const float a0 = v.v[0] + v.v[4], a1 = v.v[1] + v.v[5], a2 = v.v[2] + v.v[6], a3 = v.v[3] + v.v[7];
  const float b0 = a0 + a2, b1 = a1 + a3;
  return b0 + b1;
}

static inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

template <int FMT>
static inline Vec vload_w(const void* base, int64_t idx) {
  Vec r;
  for (int l = 0; l < 8; ++l) {
    if (FMT == kF32) {
      r.v[l] = static_cast<const float*>(base)[idx + l];
    } else if (FMT == kBF16) {
      r.v[l] = bf16_to_f32(static_cast<const uint16_t*>(base)[idx + l]);
    } else {
      r.v[l] = static_cast<float>(static_cast<const int8_t*>(base)[idx + l]);
    }
  }
  return r;
}
#endif

template <int FMT>
struct ElemSize {
  static constexpr int64_t value = FMT == kF32 ? 4 : (FMT == kBF16 ? 2 : 1);
};

struct Args {
  const float* x;      // [M, ldx]
  int64_t ldx;
  const void* w;       // [N, ldw] (ldw >= round_up(K, 8), zero padded past K)
  int64_t ldw;
  int64_t K;
  const float* scale;  // [N] or nullptr
  const float* bias;   // [N] or nullptr
  float* y;            // [M, ldy]
  int64_t ldy;
};

// R rows x C channels. Each of the R*C accumulators follows exactly the same op sequence.
template <int FMT, int R, int C>
static inline void tile(const Args& a, int64_t m0, int64_t n0) {
  Vec acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = vzero();

  const float* xr[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) xr[r] = a.x + (m0 + r) * a.ldx;
  const char* wr[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    wr[c] = static_cast<const char*>(a.w) + (n0 + c) * a.ldw * ElemSize<FMT>::value;

  // Register budget (16 ymm): keep the R activation vectors resident when they fit, else keep the C
  // weight vectors resident. Either way each accumulator sees the same FMA sequence.
  constexpr bool x_resident = R * C + R + 1 <= 16;
  auto step = [&](int64_t k) SPECDECODE_ALWAYS_INLINE {
    if constexpr (x_resident) {
      Vec xv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) xv[r] = pin(vload_x(xr[r] + k));
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        const Vec wv = vload_w<FMT>(wr[c], k);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][c] = vfma(xv[r], wv, acc[r][c]);
      }
    } else {
      Vec wv[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) wv[c] = vload_w<FMT>(wr[c], k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const Vec xv = pin(vload_x(xr[r] + k));
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
      }
    }
  };

  const int64_t K8 = a.K & ~int64_t(7);
  int64_t k = 0;
  if constexpr (kPrefetch) {
    // Weight rows are short (a few KB), too short for the hardware prefetcher to ramp up, so we fetch
    // the next tile's rows (contiguous: the C rows right after ours) at the pace we consume ours:
    // kStep bytes per k step, one cache line per kUnroll steps (or several lines per step).
    constexpr int64_t kStep = C * 8 * ElemSize<FMT>::value;
    constexpr int kUnroll = kStep >= 64 ? 1 : static_cast<int>((64 + kStep - 1) / kStep);
    constexpr int kLines = static_cast<int>((kUnroll * kStep + 63) / 64);
    const char* pf = static_cast<const char*>(a.w) + (n0 + C) * a.ldw * ElemSize<FMT>::value;
    for (; k + 8 * kUnroll <= K8; k += 8 * kUnroll) {
      const char* p = pf + (k >> 3) * kStep;
#pragma GCC unroll 8
      for (int l = 0; l < kLines; ++l) prefetch(p + 64 * l);
#pragma GCC unroll 8
      for (int u = 0; u < kUnroll; ++u) step(k + 8 * u);
    }
  }
  for (; k < K8; k += 8) step(k);
  if (K8 < a.K) {  // tail: masked activation load, weights are zero padded
    const auto mask = tail_mask(static_cast<int>(a.K - K8));
    Vec wv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) wv[c] = vload_w<FMT>(wr[c], K8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const Vec xv = vload_x_tail(xr[r] + K8, mask);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
    }
  }

#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float* yr = a.y + (m0 + r) * a.ldy + n0;
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      float s = vhsum(acc[r][c]);
      if (a.scale) s = s * a.scale[n0 + c];
      if (a.bias) s = s + a.bias[n0 + c];
      yr[c] = s;
    }
  }
}

// Channel width used for a tile of R rows (keeps accumulators + weight vectors within 16 ymm regs).
// (Measured on Zen 3: e.g. R=4 x C=3 spills for bf16; 4 x 2 is faster for every format.)
constexpr int width_for_rows(int R) { return R == 1 ? 8 : R == 2 ? 6 : R == 3 ? 3 : 2; }

// Rows [m0, m0+R) x channels [n0, n1): full-width tiles, then single-channel tiles for the rest.
template <int FMT, int R>
static void row_chunk(const Args& a, int64_t m0, int64_t n0, int64_t n1) {
  constexpr int C = width_for_rows(R);
  int64_t n = n0;
  for (; n + C <= n1; n += C) tile<FMT, R, C>(a, m0, n);
  for (; n < n1; ++n) tile<FMT, R, 1>(a, m0, n);
}

template <int FMT>
static void run_chunk(const Args& a, int R, int64_t m0, int64_t n0, int64_t n1) {
  switch (R) {
    case 1: row_chunk<FMT, 1>(a, m0, n0, n1); break;
    case 2: row_chunk<FMT, 2>(a, m0, n0, n1); break;
    case 3: row_chunk<FMT, 3>(a, m0, n0, n1); break;
    case 4: row_chunk<FMT, 4>(a, m0, n0, n1); break;
    case 5: row_chunk<FMT, 5>(a, m0, n0, n1); break;
    default: row_chunk<FMT, 6>(a, m0, n0, n1); break;
  }
}

template <int FMT>
static void run(const Args& a, int64_t M, int64_t N) {
  schedule(M, N, a.ldw * ElemSize<FMT>::value, a.K, int64_t(1) << 16,
           [&](int R, int64_t m, int64_t c0, int64_t c1) { run_chunk<FMT>(a, R, m, c0, c1); });
}

}  // namespace

void float_linear(const Lin& l, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy) {
  Args a;
  a.x = x;
  a.ldx = ldx;
  a.w = l.w;
  a.ldw = l.ldw;
  a.K = l.K;
  a.scale = static_cast<const float*>(l.scale);
  a.bias = l.bias;
  a.y = y;
  a.ldy = ldy;
  switch (l.fmt) {
    case kF32: run<kF32>(a, M, l.N); break;
    case kBF16: run<kBF16>(a, M, l.N); break;
    default: run<kI8>(a, M, l.N); break;
  }
}

}  // namespace specdecode
