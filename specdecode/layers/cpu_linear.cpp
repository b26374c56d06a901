// Row-invariant CPU linear kernel for specdecode.
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

// Only light headers: <torch/extension.h> / pybind11 would triple the one-time JIT build time, so the
// module talks to Python through the C API and receives raw pointers validated by kernels.py.
#include <Python.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>
#include <exception>
#include <atomic>
#include <type_traits>
#include <utility>
#include <cstdlib>
#include <unistd.h>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPECDECODE_AVX2 1
#else
#define SPECDECODE_AVX2 0
#endif

namespace {

enum Fmt : int { kF32 = 0, kBF16 = 1, kI8 = 2, kW8A8 = 3, kW4A8 = 4, kW6A8 = 5 };

constexpr int64_t kUnit = 24;       // channels per parallel work unit (lcm of tile widths 8, 6, 3, 2)
constexpr int64_t kRowBlock = 64;   // rows processed per pass over a channel block
constexpr int64_t kL2Budget = 192 * 1024;  // bytes of weights per channel block (stays hot in L2)
#ifndef SPECDECODE_PREFETCH
#define SPECDECODE_PREFETCH 1
#endif
#ifndef SPECDECODE_PF_LOCALITY
#define SPECDECODE_PF_LOCALITY 3
#endif
// How far ahead (in K blocks) the AVX2 integer kernels prefetch their weight stream: the hardware
// prefetcher alone leaves the 2-row+ tiles waiting on memory.
constexpr int64_t kW8PrefetchBlocks = 4;
constexpr int64_t kW4PrefetchBlocks = 16;
// w4a8 calls with at most this many rows (decode, verification) use single-group tiles (w4a8_one); a
// 700-row prefill ran 12% slower with them, its weights being reused across row tiles from L2 anyway.
constexpr int64_t kOneGroupRows = 16;
constexpr bool kPrefetch = SPECDECODE_PREFETCH;  // software prefetch of the next weight tile

static inline void prefetch(const char* p) { __builtin_prefetch(p, 0, SPECDECODE_PF_LOCALITY); }
// The AVX-512 VNNI kernels prefetch further ahead into L2 only: requests to L1 are limited by its few miss
// buffers, so a far L1 prefetch stalls the loads it should hide, while L2 holds many more requests in flight
// and L1's own prefetcher pulls each line the last short step (see docs/benchmarks.md, session 22).
static inline void prefetch_l2(const char* p) { __builtin_prefetch(p, 0, 2); }
constexpr int64_t kW8PrefetchL2Blocks = 8;   // 512-byte blocks of one group's int8 weights
// 256-byte blocks of one group's 4-bit weights: 32 KB ahead, which keeps more lines in flight than 8 KB did
// (docs/benchmarks.md, session 26).
constexpr int64_t kW4PrefetchL2Blocks = 128;
constexpr int64_t kW6PrefetchL2Blocks = 85;  // 384-byte blocks of one group's 6-bit weights: 32 KB, as for w4a8
constexpr int64_t kW6PrefetchBlocks = 11;    // the AVX2 path's distance: about 4 KB, as kW4PrefetchBlocks

#if defined(__GNUC__)
#define SPECDECODE_ALWAYS_INLINE __attribute__((always_inline))
#else
#define SPECDECODE_ALWAYS_INLINE
#endif

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

// Floating-point control state (rounding mode, FTZ/DAZ) of the calling thread.
#if defined(__SSE__)
struct FpEnv {
  unsigned int csr;
  static FpEnv current() { return FpEnv{_mm_getcsr()}; }
};
struct FpEnvGuard {
  unsigned int saved;
  explicit FpEnvGuard(const FpEnv& e) : saved(_mm_getcsr()) {
    if (saved != e.csr) _mm_setcsr(e.csr);
  }
  ~FpEnvGuard() {
    if (_mm_getcsr() != saved) _mm_setcsr(saved);
  }
};
#else
struct FpEnv {
  static FpEnv current() { return FpEnv{}; }
};
struct FpEnvGuard {
  explicit FpEnvGuard(const FpEnv&) {}
};
#endif

// Rows per register tile for `rem` remaining rows (at most 6).
static inline int next_rows(int64_t rem) {
  if (rem <= 6) return static_cast<int>(rem);
  if (rem <= 8) return 4;  // 7 -> 4+3, 8 -> 4+4
  return 6;
}

// The work split shared by every format: threads take whole units of output channels (never a share of K,
// so the split cannot change any result), walk them in blocks that stay hot in L2, and cover the rows in
// register tiles of next_rows() rows; tile(R, m, c0, c1) computes rows [m, m+R) x channels [c0, c1).
template <typename TileFn>
static void schedule(int64_t M, int64_t N, int64_t row_bytes, int64_t macs_per_output, int64_t min_macs_per_task,
                     TileFn&& tile, int64_t unit = kUnit, int max_rows = 0) {
  const int64_t nb = std::max<int64_t>(unit, (kL2Budget / std::max<int64_t>(1, row_bytes)) / unit * unit);
  const int64_t units = (N + unit - 1) / unit;
  // Do not wake threads for tiny problems.
  const int64_t macs_per_unit = std::max<int64_t>(1, unit * macs_per_output * std::min<int64_t>(M, kRowBlock));
  const int64_t grain = std::max<int64_t>(1, min_macs_per_task / macs_per_unit);

  // Which thread computes a channel may change with M (grain) or the thread count; make every worker
  // use the caller's floating-point mode (e.g. flush-to-zero set by torch.set_flush_denormal) so
  // denormal handling can never differ between threads.
  const FpEnv caller_env = FpEnv::current();
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    const FpEnvGuard env_guard(caller_env);
    const int64_t c0 = u0 * unit;
    const int64_t c1 = std::min(N, u1 * unit);
    for (int64_t mb = 0; mb < M; mb += kRowBlock) {
      const int64_t me = std::min(M, mb + kRowBlock);
      for (int64_t cb = c0; cb < c1; cb += nb) {
        const int64_t ce = std::min(c1, cb + nb);
        for (int64_t m = mb; m < me;) {
          const int R = max_rows ? static_cast<int>(std::min<int64_t>(max_rows, me - m)) : next_rows(me - m);
          tile(R, m, cb, ce);
          m += R;
        }
      }
    }
  });
}

template <int FMT>
static void run(const Args& a, int64_t M, int64_t N) {
  schedule(M, N, a.ldw * ElemSize<FMT>::value, a.K, int64_t(1) << 16,
           [&](int R, int64_t m, int64_t c0, int64_t c1) { run_chunk<FMT>(a, R, m, c0, c1); });
}

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
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512DQ__)
#define SPECDECODE_VNNI 1
#else
#define SPECDECODE_VNNI 0
#endif

constexpr int64_t kQBlock = 32;   // activation quantization block
constexpr int64_t kGroup = 16;    // channels per interleaved weight group
constexpr int64_t kGroupUnit = 4; // groups per parallel work unit (a multiple of every tile width)

struct QAct {            // quantized activations, per row: Kp bytes of q and of |q|, Kp/32 ints and floats
  const int8_t* q;
  const int8_t* qabs;    // |q|: AVX2's unsigned-by-signed byte products take it ready-made
  const int32_t* ncorr;  // -128 * sum of the block's q values
  const float* d;        // the block's scale
  const float* noff;     // -(d * sum of the block's q values): what w4a8's block offsets are multiplied by
  const int32_t* hcorr;  // per half block (16 values), what w6a8's sums start from (w6_corr), [rows, Kp / 16]
  int64_t ldq;           // = Kp
  int64_t ldb;           // = Kp / 32
};

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

#if SPECDECODE_AVX2
// One full block of quantize_row with AVX2: the same operations lane by lane (max of |x|, the rounding of
// nearbyint, the clamps; max / min return their second operand for a NaN, as std::max(-127, v) / std::min(127,
// v) and std::max(amax, |x|) do), so the same bytes and sums. Returns the block's sum of q.
static inline int32_t quantize_block_avx2(const float* x, int8_t* q, int8_t* qabs, float* d_out) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 v[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(_mm256_and_ps(v[i], absmask), amax);
  }
  alignas(32) float m[8];
  _mm256_store_ps(m, amax);
  float a = 0.0f;
  for (int l = 0; l < 8; ++l) a = std::max(a, m[l]);
  const float d = a / 127.0f;
  const float id = d > 0.0f ? 1.0f / d : 0.0f;
  *d_out = d;
  __m256i w[4];
  for (int i = 0; i < 4; ++i) {
    __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(id)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
    w[i] = _mm256_cvtps_epi32(r);
  }
  // int32 -> int8 (exact: every value is in -127..127), back in element order
  const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(w[0], w[1]), 0xD8);
  const __m256i x16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(w[2], w[3]), 0xD8);
  const __m256i b = _mm256_permute4x64_epi64(_mm256_packs_epi16(w16, x16), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), b);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qabs), _mm256_abs_epi8(b));
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(w[0], w[1]), _mm256_add_epi32(w[2], w[3]));
  alignas(32) int32_t t[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t), s);
  int32_t sum = 0;
  for (int l = 0; l < 8; ++l) sum += t[l];
  return sum;
}
#endif

// One block of 32 (its first n values real, the rest padding): q, |q| and the scale d; returns the sum of q.
static inline int32_t quantize_block(const float* x, int64_t n, int8_t* q, int8_t* qabs, float* d_out) {
#if SPECDECODE_AVX2
  if (n == kQBlock) return quantize_block_avx2(x, q, qabs, d_out);
#endif
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f;
  const float id = d > 0.0f ? 1.0f / d : 0.0f;
  *d_out = d;
  int32_t sum = 0;
  for (int64_t i = 0; i < kQBlock; ++i) {
    float v = i < n ? std::nearbyint(x[i] * id) : 0.0f;
    v = std::min(127.0f, std::max(-127.0f, v));
    q[i] = static_cast<int8_t>(v);
    qabs[i] = static_cast<int8_t>(std::fabs(v));
    sum += q[i];
  }
  return sum;
}

// What w6a8's integer sums of one half block (16 values of q) start from, so that they take u - 32 where the
// weights hold u (0..63). The VNNI path: -32 * the sum of q. AVX2's sums are 16-bit, one per pair of a quad's
// bytes (see w6a8_group): -32 * the sum of q over bytes 0 and 1 of the four quads (low half), and over bytes 2
// and 3 (high half). Each fits in 16 bits (|.| <= 32 * 8 * 127).
static inline int32_t w6_corr(const int8_t* q) {
#if SPECDECODE_AVX2 && !SPECDECODE_VNNI
  int32_t lo = 0, hi = 0;
  for (int j = 0; j < 4; ++j) {
    lo += q[4 * j] + q[4 * j + 1];
    hi += q[4 * j + 2] + q[4 * j + 3];
  }
  return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(-32 * lo)) |
                              static_cast<uint32_t>(static_cast<uint16_t>(-32 * hi)) << 16);
#else
  int32_t sum = 0;
  for (int i = 0; i < 16; ++i) sum += q[i];
  return -32 * sum;
#endif
}

static void quantize_row(const float* x, int64_t K, int64_t Kp, int8_t* q, int8_t* qabs, int32_t* ncorr, float* dl,
                         float* noff, int32_t* hcorr) {
  for (int64_t b0 = 0; b0 < Kp; b0 += kQBlock) {
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(kQBlock, K - b0));
    float d;
    const int32_t sum = quantize_block(x + b0, n, q + b0, qabs + b0, &d);
    ncorr[b0 / kQBlock] = -128 * sum;
    dl[b0 / kQBlock] = d;
    noff[b0 / kQBlock] = -(d * static_cast<float>(sum));
    if (hcorr) {
      hcorr[b0 / 16] = w6_corr(q + b0);
      hcorr[b0 / 16 + 1] = w6_corr(q + b0 + 16);
    }
  }
}

static inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The integer formats share their tiling: TILE<R, C> computes R rows x C groups of 16 channels.
template <typename A>
using GroupTile = void (*)(const A&, int64_t, int64_t);

// Groups [g0, g1) of rows [m0, m0 + R): tiles of C groups, then single groups.
template <typename A, int R, int C, GroupTile<A> Wide, GroupTile<A> Single>
static void group_rows(const A& a, int64_t m0, int64_t g0, int64_t g1) {
  int64_t g = g0;
  for (; g + C <= g1; g += C) Wide(a, m0, g);
  for (; g < g1; ++g) Single(a, m0, g);
}

// Rows [m0, m0 + R) in passes of at most MaxRows rows, as even as can be (5 rows, at most 4: 3 + 2):
// pass(std::integral_constant<int, n>, m) handles the n rows from m.
template <int R, int MaxRows, typename Pass>
static inline void row_passes(int64_t m0, Pass&& pass) {
  constexpr int passes = (R + MaxRows - 1) / MaxRows;
  constexpr int first = (R + passes - 1) / passes;
  pass(std::integral_constant<int, first>{}, m0);
  if constexpr (R > first) row_passes<R - first, MaxRows>(m0 + first, pass);
}

// Every row and group through schedule(); rows[R - 1] handles tiles of R rows.
template <typename A, int T = 6>
static void run_groups(const A& a, int64_t M, int64_t group_bytes,
                       void (*const (&rows)[T])(const A&, int64_t, int64_t, int64_t)) {
  const int64_t groups = (a.N + kGroup - 1) / kGroup;
  schedule(M, groups, group_bytes, a.Kp * kGroup, int64_t(1) << 17,
           [&](int R, int64_t m, int64_t g0, int64_t g1) { rows[std::min(R, T) - 1](a, m, g0, g1); }, kGroupUnit,
           T > 6 ? T : 0);
}

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
          __asm__("" : "+x"(t[r][h]));  // see w4a8_group: keeps GCC from hoisting every product and spilling
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

// ---------------------------------------------------------------------------------------------
// AMX (Sapphire Rapids and later): the same integers from tile instructions (w8a8 here; w4a8 below).
// Group g, block b of the interleaved weights (8 quads x 64 bytes, contiguous) is exactly a B tile of 8 rows
// x 64 bytes, and rows m0.. of the quantized activations at block b are an A tile of R rows x 32 bytes
// (stride Kp).
// TDPBSUD (signed activation bytes x unsigned weight bytes) yields the block's R x 16 integer sums
// sum (w + 128) * q, exact; adding the block's -128 * sum(q) gives the very t_b of the VNNI path, and the
// float epilogue is the same fma per block in the same order. So the result is bitwise that of VNNI,
// for any R, while one tile instruction does the integer work of 8 * R vpdpbusd. What is left per row is
// the float epilogue, so extra verification rows cost far less (1.5B target, 16 rows: 1.35x faster).
// ---------------------------------------------------------------------------------------------
#if SPECDECODE_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define SPECDECODE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define SPECDECODE_AMX 0
#endif

constexpr int kAmxRows = 16;     // rows of an A / C tile
constexpr int64_t kAmxMinRows = 3;  // up to two rows VNNI is as fast (bound by memory) and needs no tile setup
// w4a8 up to 6 rows: VNNI's single-group tiles (w4a8_one) stay faster (0.5B draft's linears, 4 rows: 12.8 ms
// against 14.4; 7 rows: 19.0 against 15.5, where VNNI needs two row tiles)
constexpr int64_t kAmx4MinRows = 7;
constexpr int64_t kAmxPrefetchBlocks = 4;  // weight blocks prefetched ahead of the tile loads

// Linux hands out AMX state only on request (once per process); without the grant a tile instruction
// faults. SPECDECODE_AMX=0 or set_amx(False) keeps the VNNI path.
static bool amx_granted() {
#if SPECDECODE_AMX
  static const bool ok = [] {
    const char* env = std::getenv("SPECDECODE_AMX");
    if (env && env[0] == '0') return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}
static std::atomic<bool> g_amx_on{true};
static bool amx_enabled() { return g_amx_on.load(std::memory_order_relaxed) && amx_granted(); }

#if SPECDECODE_AMX
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// One block of 32 inputs for rows [0, R) of the A tile at q (stride ldq) and C groups whose B tiles are at
// w[c] (8 rows of 64 bytes): sums[c][r][l] = the exact sum of q[r, k] * w[c][k / 4][4 l + k % 4]. Tiles
// 0..C-1 hold the sums, 4 the activations and 5-7 the weights.
template <int C>
static inline SPECDECODE_ALWAYS_INLINE void amx_block_sums(const int8_t* q, int64_t ldq, const uint8_t* const (&w)[C],
                                                           int32_t (&sums)[C][kAmxRows][kGroup]) {
  _tile_zero(0);
  if constexpr (C > 1) _tile_zero(1);
  if constexpr (C > 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  _tile_loadd(4, q, ldq);
  _tile_loadd(5, w[0], 64);
  _tile_dpbsud(0, 4, 5);
  if constexpr (C > 1) {
    _tile_loadd(6, w[1], 64);
    _tile_dpbsud(1, 4, 6);
  }
  if constexpr (C > 2) {
    _tile_loadd(7, w[2], 64);
    _tile_dpbsud(2, 4, 7);
    _tile_loadd(5, w[3], 64);
    _tile_dpbsud(3, 4, 5);
  }
  _tile_stored(0, sums[0], 64);
  if constexpr (C > 1) _tile_stored(1, sums[1], 64);
  if constexpr (C > 2) {
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
  }
}

// Groups per tile call for R rows (measured on the 1.5B target's shapes, weights streamed from memory: four
// groups for up to 4 rows, then two; one group with the tiles alternating between blocks was 10-20% slower).
// Several groups at once keep several weight streams in flight, as the VNNI tiles do.
constexpr int amx_width(int R) { return R <= 4 ? 4 : 2; }

// Rows [m0, m0 + R) x groups [g0, g1) of either integer format, in tiles of amx_width(R) groups.
template <typename A, int R, GroupTile<A> Wide, GroupTile<A> Single>
static void amx_rows(const A& a, int64_t m0, int64_t g0, int64_t g1) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) cfg.rows[t] = R, cfg.colsb[t] = 64;
  cfg.rows[4] = R, cfg.colsb[4] = kQBlock;
  for (int t = 5; t < 8; ++t) cfg.rows[t] = kQBlock / 4, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);  // per call: the tile state is per thread and other code may have changed it
  group_rows<A, R, amx_width(R), Wide, Single>(a, m0, g0, g1);
  _tile_release();
}

// Every row and group of a call through tiles of up to kAmxRows rows; Tiles::tile<R, C> is the format's tile.
template <typename A, typename Tiles>
struct AmxRun {
  template <int R>
  static void rows(const A& a, int64_t m0, int64_t g0, int64_t g1) {
    amx_rows<A, R, Tiles::template tile<R, amx_width(R)>, Tiles::template tile<R, 1>>(a, m0, g0, g1);
  }
  template <int... Rs>
  static void run(const A& a, int64_t M, int64_t group_bytes, std::integer_sequence<int, Rs...>) {
    static void (*const table[kAmxRows])(const A&, int64_t, int64_t, int64_t) = {rows<Rs + 1>...};
    run_groups<A, kAmxRows>(a, M, group_bytes, table);
  }
  static void run(const A& a, int64_t M, int64_t group_bytes) {
    run(a, M, group_bytes, std::make_integer_sequence<int, kAmxRows>());
  }
};

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

// Quantizes the activations of x [M, ldx] (blocks of 32, see quantize_row) and hands them to run(QAct).
template <typename RunFn>
static void with_quantized_x(const float* x, int64_t ldx, int64_t K, int64_t Kp, int64_t M, RunFn&& run,
                             bool halves = false) {
  // Kept across calls (grow only): a fresh large buffer costs page faults on every call.
  // (thread_local: referenced through plain pointers below, since worker threads have their own instances).
  thread_local std::vector<int8_t> q_buf, qabs_buf;
  thread_local std::vector<int32_t> ncorr_buf;
  thread_local std::vector<float> dl_buf, noff_buf;
  thread_local std::vector<int32_t> hcorr_buf;
  q_buf.resize(std::max<size_t>(q_buf.size(), M * Kp));
  qabs_buf.resize(q_buf.size());
  ncorr_buf.resize(std::max<size_t>(ncorr_buf.size(), M * Kp / kQBlock));
  dl_buf.resize(ncorr_buf.size());
  noff_buf.resize(ncorr_buf.size());
  if (halves) hcorr_buf.resize(std::max<size_t>(hcorr_buf.size(), M * Kp / 16));
  int8_t* const q = q_buf.data();
  int8_t* const qabs = qabs_buf.data();
  int32_t* const ncorr = ncorr_buf.data();
  float* const dl = dl_buf.data();
  float* const noff = noff_buf.data();
  int32_t* const hcorr = halves ? hcorr_buf.data() : nullptr;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, K));
  at::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(x + m * ldx, K, Kp, q + m * Kp, qabs + m * Kp, ncorr + m * Kp / kQBlock, dl + m * Kp / kQBlock,
                   noff + m * Kp / kQBlock, hcorr ? hcorr + m * Kp / 16 : nullptr);
  });
  run(QAct{q, qabs, ncorr, dl, noff, hcorr, Kp, Kp / kQBlock});
}

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

static inline float half_to_float(uint16_t h) {  // exact, including subnormals
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, u;
  if (exp == 0x1Fu) {
    u = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {
    int e = -1;
    do { ++e; man <<= 1; } while (!(man & 0x400u));
    u = sign | ((112u - e) << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// s[n, b] (part 0) or o[n, b] (part 16) of lane l of group g: an exact product (see above).
static inline float w4_unit(const W4Args& a, int64_t g, int64_t b, int l, int part) {
  return static_cast<float>(a.codes(g)[b * 32 + part + l]) * half_to_float(a.units(g)[(b >> 3) * 32 + part + l]);
}

#if SPECDECODE_AVX2
// 8 fp16 values as floats (exact either way): F16C where the CPU has it, else converted one by one.
static inline __m256 load_half8(const uint16_t* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int l = 0; l < 8; ++l) f[l] = half_to_float(p[l]);
  return _mm256_load_ps(f);
#endif
}

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

// acc + vpdpbusd(w, the 4 activation bytes at p in every lane), the broadcast taken by the instruction's own
// memory operand. Where a broadcast feeds a single vpdpbusd (one group per tile), GCC's separate vpbroadcastd
// took a vector slot of its own; the same integers either way.
typedef int32_t __attribute__((may_alias)) AliasedI32;
static inline SPECDECODE_ALWAYS_INLINE __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int8_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const AliasedI32*>(p)));
  return acc;
}

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
            __asm__("" : "+x"(s[r][c]));  // see w4a8_group
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

// =============================================================================================
// One linear in any format, as kernels.PackedLinear describes it.
// =============================================================================================
struct Lin {
  int64_t fmt;        // Fmt
  const void* w;
  int64_t ldw;        // row stride for fp32 / bf16 / int8 (>= round_up(K, 8)); Kp for w8a8 / w4a8 / w6a8
  const void* scale;  // float32 [N] for int8 / w8a8, w4a8 / w6a8 codes and units (W4Args, W6Args), else unused
  const float* bias;  // [N] or null
  int64_t K, N;
};

static const char* check_lin(const Lin& l) {
  if (l.fmt < kF32 || l.fmt > kW6A8 || l.K < 0 || l.N < 0 || (l.N > 0 && l.w == nullptr)) return "bad weight";
  if (l.fmt <= kI8 ? l.ldw < ((l.K + 7) / 8) * 8 : (l.ldw % kQBlock != 0 || l.ldw < l.K)) return "bad weight stride";
  if (l.fmt >= kI8 && l.scale == nullptr) return "missing scale";
  return nullptr;
}

// y [M, ldy] = x [M, ldx] @ W.T (+ bias). Throws on allocation failure; runs without touching the GIL.
static void linear(const Lin& l, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy) {
  if (M == 0 || l.N == 0) return;
  if (l.fmt == kW8A8) {
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
  } else if (l.fmt == kW4A8) {
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
  } else if (l.fmt == kW6A8) {
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
  } else {
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
}

template <typename T>
static T* ptr(long long v) { return reinterpret_cast<T*>(static_cast<uintptr_t>(v)); }

// linear(fmt, x_ptr, ldx, w_ptr, ldw, K, scale_ptr, bias_ptr, y_ptr, ldy, M, N): every pointer is the address
// of a CPU tensor that kernels.py checked and keeps alive (scale_ptr / bias_ptr may be 0). GIL released.
PyObject* py_linear(PyObject*, PyObject* args) {
  long long fmt, xp, ldx, wp, ldw, K, sp, bp, yp, ldy, M, N;
  if (!PyArg_ParseTuple(args, "LLLLLLLLLLLL", &fmt, &xp, &ldx, &wp, &ldw, &K, &sp, &bp, &yp, &ldy, &M, &N))
    return nullptr;
  const Lin l{fmt, ptr<const void>(wp), ldw, ptr<const void>(sp), ptr<const float>(bp), K, N};
  const char* err = check_lin(l);
  if (!err && (M < 0 || (M > 1 && ldx < K) || (M > 1 && ldy < N) || (M > 0 && N > 0 && (xp == 0 || yp == 0))))
    err = "bad input or output";
  if (err) {
    PyErr_Format(PyExc_ValueError, "linear: %s", err);
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS
  try {
    linear(l, ptr<const float>(xp), ldx, M, ptr<float>(yp), ldy);
  } catch (const std::exception&) {
    err = "kernel failed";
  }
  Py_END_ALLOW_THREADS
  if (err) {
    PyErr_Format(PyExc_RuntimeError, "linear: %s", err);
    return nullptr;
  }
  Py_RETURN_NONE;
}

// =============================================================================================
// Decoder layers for decode / verification rows (llama-style: RMSNorm, rotary, GQA attention over the
// KV cache, gated SiLU MLP), one call for the whole stack. In Python each layer is ~15 small torch ops
// whose dispatch costs more than their arithmetic at these sizes (a 0.5B draft spent ~11 ms of a 24 ms
// step outside the matmuls). Same math as models/model.py's Block, not bitwise the same values: decode
// and verification rows always take this path (prefill never does), so greedy exactness rests on it
// being row-invariant, which it is: every row's norm, rotary, attention and activation is computed from
// that row alone in a fixed order, and the linears are the row-invariant kernels above.
// =============================================================================================
constexpr int kLayerFields = 6 + 4 * 7;  // see LayerDesc::from

// KV cache (engine/kv_cache.py): positions in blocks of kKeyTile, found through a block table
// ([slots, blocks_per_slot] int64). Per layer: keys [blocks, KV, D, kKeyTile] (transposed inside the block:
// one block of keys is one contiguous tile), values [blocks, KV, kKeyTile, D]; elements in one of KvFmt.
enum KvFmt : int { kKvF32 = 0, kKvF16 = 1, kKvBF16 = 2 };
constexpr int64_t kKeyTile = 16;  // positions per block = keys per score tile (kernels.KEY_TILE)

struct LayerDesc {
  const float *attn_norm, *mlp_norm, *q_norm, *k_norm;  // q_norm / k_norm null unless per-head q/k norms
  void *keys, *values;                                   // this layer's KV blocks, see KvFmt
  Lin qkv, o, gate_up, down;
  static LayerDesc from(const int64_t* f) {
    auto lin = [](const int64_t* v) {
      return Lin{v[0], ptr<const void>(v[1]), v[2], ptr<const void>(v[3]), ptr<const float>(v[4]), v[5], v[6]};
    };
    return LayerDesc{ptr<const float>(f[0]), ptr<const float>(f[1]), ptr<const float>(f[2]), ptr<const float>(f[3]),
                     ptr<void>(f[4]), ptr<void>(f[5]), lin(f + 6), lin(f + 13), lin(f + 20), lin(f + 27)};
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
};

// ---- KV element conversions. Widening is exact; narrowing rounds to nearest even, as torch's .to() does, so
// the C++ stack and the Python attention store the same bits for the same float (NaN payloads aside). ----
static inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;     // NaN
  if (a >= 0x477FF000u) return sign | 0x7C00u;    // 65520 and up round to infinity
  if (a >= 0x38800000u) {                          // normal half (2^-14 and up): rebias, drop 13 bits
    const uint32_t h = a - 0x38000000u;
    return sign | static_cast<uint16_t>((h + 0xFFFu + ((h >> 13) & 1u)) >> 13);
  }
  if (a <= 0x33000000u) return sign;               // 2^-25 and below: zero (2^-25 is a tie to even 0)
  // Subnormal half m * 2^-24: the 24-bit significand shifted right by 126 - exponent, rounded to even.
  const uint32_t e = a >> 23, sig = (a & 0x7FFFFFu) | 0x800000u, sh = 126u - e;
  uint32_t m = sig >> sh;
  const uint32_t rest = sig & ((1u << sh) - 1u), halfway = 1u << (sh - 1u);
  if (rest > halfway || (rest == halfway && (m & 1u))) ++m;
  return sign | static_cast<uint16_t>(m);
}

static inline uint16_t f32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;  // NaN
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

static inline void kv_put(int fmt, void* base, int64_t i, float f) {
  if (fmt == kKvF32) {
    static_cast<float*>(base)[i] = f;
  } else if (fmt == kKvF16) {
#if defined(__F16C__)
    static_cast<uint16_t*>(base)[i] = static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
    static_cast<uint16_t*>(base)[i] = f32_to_f16(f);
#endif
  } else {
    static_cast<uint16_t*>(base)[i] = f32_to_bf16(f);
  }
}

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

// Sum of a[i] * b[i] in 8 interleaved partial sums and one fixed pairwise reduction.
static inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// exp(x) to ~2 ulp (Cephes' range reduction and polynomial); plain float ops, so loops over it vectorize.
static inline float fast_exp(float x) {
  x = std::min(88.3762626647949f, std::max(-87.3365447504f, x));
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * 1.44269504088896341f + magic) - magic;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return p * two_n;
}

#if SPECDECODE_AVX2
// fast_exp on 8 lanes: its own operations, lane by lane, so the bits are the same (GCC does not vectorize
// fast_exp itself, because of its std::min / std::max clamps).
static inline __m256 fast_exp8(__m256 x) {
  // max(x, lo) and min(x, hi) return their second operand for a NaN, as std::max(lo, x) / std::min(hi, x) do
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365447504f)), _mm256_set1_ps(88.3762626647949f));
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), magic), magic);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

// y[i] = fast_exp(x[i] - sub) for i < n (the softmax numerators).
static inline void exp_shifted(const float* x, float sub, float* y, int64_t n) {
  int64_t i = 0;
#if SPECDECODE_AVX2
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, fast_exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(sub))));
#endif
  for (; i < n; ++i) y[i] = fast_exp(x[i] - sub);
}

// r[i] = silu(r[i]) * r[I + i] for i < I: r[i] / (1 + fast_exp(-r[i])) * r[I + i], in that order.
static inline void silu_mul(float* r, int64_t I) {
  int64_t i = 0;
#if SPECDECODE_AVX2
  const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= I; i += 8) {
    const __m256 g = _mm256_loadu_ps(r + i);
    const __m256 e = fast_exp8(_mm256_xor_ps(g, neg));
    _mm256_storeu_ps(r + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(r + I + i)));
  }
#endif
  for (; i < I; ++i) r[i] = r[i] / (1.0f + fast_exp(-r[i])) * r[I + i];
}

static void rms_norm(const float* x, const float* w, int64_t n, float eps, float* y) {
  const float r = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * r) * w[i];
}

// HF's rotate-half rotary embedding: x * cos + roll(x, D / 2) * sin_signed (the sign lives in the table).
static void rotate(float* x, const float* cos, const float* sin_signed, int64_t D) {
  float t[512];
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) t[d] = x[d] * cos[d] + x[d < half ? d + half : d - half] * sin_signed[d];
  std::memcpy(x, t, sizeof(float) * D);
}

// Attention of decode / verification rows. Every score is q . k summed over d = 0..D-1 in order, every
// output element sum_j p_j * v_j[d] in key order, and the softmax total in key order: one rounding per
// multiply and per add (the file is built with -ffp-contract=off), so a row's result does not depend on
// which other queries or keys share a tile, nor on the vector width the compiler picks. 16-bit caches are
// widened to fp32 (exactly) one tile at a time, so a row's arithmetic is that of an fp32 cache holding the
// same values.
typedef float V16 __attribute__((vector_size(kKeyTile * sizeof(float))));
static inline V16 load16(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
constexpr int64_t kValueTile = 32;
// Scores one attention call keeps (floats), and the fewest query rows it takes: a long prompt's rows are cut
// into pieces of about kScoreBudget / length rows, so that their scores stay in L2 between the score, softmax
// and value passes.
constexpr int64_t kScoreBudget = 1 << 16, kMinQueryPiece = 32;

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

// acc[a][jj] = sum_d q[a][d] * kt[d][jj] for NQ queries against one tile of kKeyTile transposed keys
// ([D, kKeyTile]): the NQ x kKeyTile independent sums keep the vector units busy where one dot product at a
// time would wait on its own additions.
#if SPECDECODE_AVX2 && !defined(__AVX512F__)
// AVX2 without AVX-512: the same sums as the generic version below, lane for lane (a product, then a sum, each
// rounded once), in pairs of 8-lane registers. GCC lowers a 16-lane vector type on AVX2 by moving every
// accumulator through the stack and general registers at each step, which made this loop most of a
// verification's attention time.
template <int NQ>
static inline void score_tile(const float* const* q, const float* kt, int64_t D, float scale, int64_t jt,
                              float* const* out) {
  __m256 lo[NQ], hi[NQ];
  for (int a = 0; a < NQ; ++a) lo[a] = hi[a] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * kKeyTile), k1 = _mm256_loadu_ps(kt + d * kKeyTile + 8);
    for (int a = 0; a < NQ; ++a) {
      const __m256 qa = _mm256_set1_ps(q[a][d]);
      lo[a] = _mm256_add_ps(lo[a], _mm256_mul_ps(qa, k0));
      hi[a] = _mm256_add_ps(hi[a], _mm256_mul_ps(qa, k1));
    }
  }
  for (int a = 0; a < NQ; ++a) {
    alignas(32) float t[kKeyTile];
    _mm256_store_ps(t, lo[a]);
    _mm256_store_ps(t + 8, hi[a]);
    for (int64_t jj = 0; jj < jt; ++jj) out[a][jj] = t[jj] * scale;
  }
}
#else
template <int NQ>
static inline void score_tile(const float* const* q, const float* kt, int64_t D, float scale, int64_t jt,
                              float* const* out) {
  // GCC vector types: the sums stay in registers (as plain arrays they were kept on the stack), and
  // element-wise arithmetic is the same IEEE operation per lane whatever vector width the target has.
  V16 acc[NQ];
  for (int a = 0; a < NQ; ++a) acc[a] = V16{};
  for (int64_t d = 0; d < D; ++d) {
    const V16 k = load16(kt + d * kKeyTile);
    for (int a = 0; a < NQ; ++a) acc[a] += q[a][d] * k;
  }
  for (int a = 0; a < NQ; ++a) {
    float t[kKeyTile];
    std::memcpy(t, &acc[a], sizeof(t));
    for (int64_t jj = 0; jj < jt; ++jj) out[a][jj] = t[jj] * scale;
  }
}
#endif

// acc[a][d] += sum_j p[a][j] * v_j[d] over keys [j0, j1) in key order, for NQ queries that all see those keys;
// vals holds v_j0, v_j0+1, ... DT = D known at compile time keeps the running sums in registers for the tile.
template <int DT, int NQ>
static inline void weighted_sum(float* const* p, int64_t j0, int64_t j1, const float* vals, float* const* acc) {
  float s[NQ][DT];
  for (int a = 0; a < NQ; ++a)
    for (int64_t d = 0; d < DT; ++d) s[a][d] = acc[a][d];
  for (int64_t j = j0; j < j1; ++j) {
    const float* v = vals + (j - j0) * DT;
    for (int a = 0; a < NQ; ++a) {
      const float e = p[a][j];
      for (int64_t d = 0; d < DT; ++d) s[a][d] += e * v[d];
    }
  }
  for (int a = 0; a < NQ; ++a)
    for (int64_t d = 0; d < DT; ++d) acc[a][d] = s[a][d];
}

static void weighted_sum_any(const float* p, int64_t j0, int64_t j1, const float* vals, int64_t D, float* acc) {
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t d = 0; d < D; ++d) acc[d] += p[j] * vals[(j - j0) * D + d];
}

// One KV head against query rows [i0, i1) of a stretch of rows of one request that starts at row m0 (one cache
// slot, increasing positions); query row i is row m0 + i / rep's query head kv * rep + i % rep, and attends to
// keys [0, pos]. Keys and values are read once for all of those rows, so a verification pass over k + 1 rows
// streams the request's KV cache once, not k + 1 times. A long prompt's rows are split into several calls (the
// task list in layer_forward) so that their scores stay in cache; a row's arithmetic is the same in any split. Each
// block's keys are one transposed tile ([D, kKeyTile]), so nothing is transposed per step. Lanes of the last
// block past the newest key hold stale or zero values, and score tiles past a row's own position are not
// computed for it; such scores are never read.
static void attend_rows(const LayerDesc& L, const StackDims& g, const float* qkv, int64_t nqkv, const int64_t* pos,
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
    const int64_t at = g.at(g.block(slot, j0), kv);
    const float* tile = key_tile;
    if (g.kv_fmt == kKvF32) tile = static_cast<const float*>(L.keys) + at;
    else kv_load(g.kv_fmt, L.keys, at, D * kKeyTile, key_tile);
    float* out[4];
    int64_t i = first;
    for (; i + 4 <= n; i += 4) {
      for (int a = 0; a < 4; ++a) out[a] = srow[i + a] + j0;
      score_tile<4>(q.data() + i, tile, D, g.scale, jt, out);
    }
    for (int a = 0; i + a < n; ++a) out[a] = srow[i + a] + j0;
    if (n - i == 3) score_tile<3>(q.data() + i, tile, D, g.scale, jt, out);
    else if (n - i == 2) score_tile<2>(q.data() + i, tile, D, g.scale, jt, out);
    else if (n - i == 1) score_tile<1>(q.data() + i, tile, D, g.scale, jt, out);
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
    for (int64_t b0 = j0; b0 < jend; b0 += kKeyTile)
      kv_load(g.kv_fmt, L.values, g.at(g.block(slot, b0), kv), std::min(kKeyTile, jend - b0) * D,
              val_tile + (b0 - j0) * D);
    for (int64_t i = 0; i < n;) {
      const int64_t j1 = std::min(j0 + kValueTile, lens[i]);
      const bool pair = i + 1 < n && lens[i + 1] == lens[i] && (D == 128 || D == 64);
      if (j1 > j0) {
        if (D == 128 && pair) weighted_sum<128, 2>(&srow[i], j0, j1, val_tile, &arow[i]);
        else if (D == 128) weighted_sum<128, 1>(&srow[i], j0, j1, val_tile, &arow[i]);
        else if (D == 64 && pair) weighted_sum<64, 2>(&srow[i], j0, j1, val_tile, &arow[i]);
        else if (D == 64) weighted_sum<64, 1>(&srow[i], j0, j1, val_tile, &arow[i]);
        else weighted_sum_any(srow[i], j0, j1, val_tile, D, arow[i]);
      }
      i += pair ? 2 : 1;
    }
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < D; ++d) orow[i][d] = arow[i][d] / total[i];
}

static void layer_forward(const LayerDesc& L, const StackDims& g, float* x, int64_t M, const int64_t* pos,
                          const int64_t* slot, const float* cos, const float* sin_signed) {
  const int64_t h = g.hidden, D = g.D, H = g.H, KV = g.KV, I = g.I, rep = H / KV, nqkv = (H + 2 * KV) * D;
  if (M == 0) return;
  // Scratch kept across calls: fresh buffers this size come from mmap and cost a page fault per 4 KB.
  thread_local std::vector<float> buf;
  buf.resize(std::max<size_t>(buf.size(), M * (h + nqkv + H * D + 2 * I)));
  float* const y = buf.data();
  float* const qkv = y + M * h;
  float* const att = qkv + M * nqkv;
  float* const gu = att + M * H * D;
  for (int64_t m = 0; m < M; ++m) rms_norm(x + m * h, L.attn_norm, h, g.eps, y + m * h);
  linear(L.qkv, y, h, M, qkv, nqkv);
  for (int64_t m = 0; m < M; ++m) {
    float* row = qkv + m * nqkv;
    const float* c = cos + pos[m] * D;
    const float* sn = sin_signed + pos[m] * D;
    for (int64_t hd = 0; hd < H + KV; ++hd) {
      float* v = row + hd * D;
      if (L.q_norm) rms_norm(v, hd < H ? L.q_norm : L.k_norm, D, g.eps, v);
      rotate(v, c, sn, D);
    }
    const int64_t blk = g.block(slot[m], pos[m]), off = pos[m] % kKeyTile;
    for (int64_t kv = 0; kv < KV; ++kv) {  // all rows' keys first: later rows of a request attend to them
      const int64_t at = g.at(blk, kv);
      for (int64_t d = 0; d < D; ++d) {
        kv_put(g.kv_fmt, L.keys, at + d * kKeyTile + off, row[(H + kv) * D + d]);
        kv_put(g.kv_fmt, L.values, at + off * D + d, row[(H + KV + kv) * D + d]);
      }
    }
  }
  // Attention tasks: each stretch of rows of one request (same slot, increasing positions) x KV head, its
  // query rows cut into pieces whose scores fit in cache (a long prompt's scores would not).
  std::vector<int64_t> runs{0};
  for (int64_t m = 1; m < M; ++m)
    if (slot[m] != slot[m - 1] || pos[m] <= pos[m - 1]) runs.push_back(m);
  runs.push_back(M);
  struct Task { int64_t m0, i0, i1, kv; };
  std::vector<Task> tasks;
  for (size_t r = 0; r + 1 < runs.size(); ++r) {
    const int64_t m0 = runs[r], n = (runs[r + 1] - m0) * rep, len = pos[runs[r + 1] - 1] + 1;
    const int64_t piece = std::max<int64_t>(kMinQueryPiece, kScoreBudget / len / 4 * 4);
    for (int64_t kv = 0; kv < KV; ++kv)
      for (int64_t i0 = 0; i0 < n; i0 += piece) tasks.push_back({m0, i0, std::min(n, i0 + piece), kv});
  }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> scratch;
    for (int64_t t = t0; t < t1; ++t) {
      const Task& k = tasks[t];
      attend_rows(L, g, qkv, nqkv, pos, slot[k.m0], k.m0, k.i0, k.i1, k.kv, rep, att, H * D, scratch);
    }
  });
  linear(L.o, att, H * D, M, y, h);
  for (int64_t i = 0; i < M * h; ++i) x[i] = x[i] + y[i];
  for (int64_t m = 0; m < M; ++m) rms_norm(x + m * h, L.mlp_norm, h, g.eps, y + m * h);
  linear(L.gate_up, y, h, M, gu, 2 * I);
  for (int64_t m = 0; m < M; ++m) silu_mul(gu + m * 2 * I, I);  // silu(gate) * up, in the first I columns
  linear(L.down, gu, 2 * I, M, y, h);
  for (int64_t i = 0; i < M * h; ++i) x[i] = x[i] + y[i];
}

// decoder_layers(table_ptr, n_layers, x_ptr, M, pos_ptr, slot_ptr, cos_ptr, sin_ptr, n_pos,
//                hidden, H, KV, D, I, slots, max_len, eps, scale, kv_fmt, block_table_ptr, blocks_per_slot,
//                num_blocks)
// table: int64 [n_layers, kLayerFields] (LayerDesc::from); x float32 [M, hidden], updated in place;
// pos / slot int64 [M]; cos / sin float32 [n_pos, D]; block_table int64 [slots, blocks_per_slot] with entries
// below num_blocks (the blocks of each layer's keys / values). kernels.LayerStack builds and keeps alive every
// tensor these addresses point to.
PyObject* py_decoder_layers(PyObject*, PyObject* args) {
  long long tp, nl, xp, M, pp, sp, cp, snp, npos, hidden, H, KV, D, I, slots, max_len, btp, bps, nblocks;
  double eps, scale;
  int kv_fmt;
  if (!PyArg_ParseTuple(args, "LLLLLLLLLLLLLLLLddiLLL", &tp, &nl, &xp, &M, &pp, &sp, &cp, &snp, &npos, &hidden, &H,
                        &KV, &D, &I, &slots, &max_len, &eps, &scale, &kv_fmt, &btp, &bps, &nblocks))
    return nullptr;
  const StackDims g{hidden, H, KV, D, I, slots, max_len, static_cast<float>(eps), static_cast<float>(scale),
                    kv_fmt, ptr<const int64_t>(btp), bps, nblocks};
  const int64_t* pos = ptr<const int64_t>(pp);
  const int64_t* slot = ptr<const int64_t>(sp);
  const char* err = nullptr;
  if (tp == 0 || nl < 0 || xp == 0 || M < 0 || pp == 0 || sp == 0 || cp == 0 || snp == 0 || hidden <= 0 ||
      H <= 0 || KV <= 0 || H % KV != 0 || D <= 0 || D % 2 != 0 || D > 512 || I <= 0 || max_len > npos)
    err = "bad dimensions";
  if (!err && (kv_fmt < kKvF32 || kv_fmt > kKvBF16 || btp == 0 || bps * kKeyTile < max_len || nblocks <= 0))
    err = "bad KV cache description";
  for (int64_t m = 0; !err && m < M; ++m)
    if (pos[m] < 0 || pos[m] >= max_len || slot[m] < 0 || slot[m] >= slots) err = "position or slot out of range";
  for (int64_t m = 0; !err && m < M; ++m)  // every block a row writes or reads
    for (int64_t p = 0; !err && p <= pos[m]; p += kKeyTile)
      if (g.block(slot[m], p) < 0 || g.block(slot[m], p) >= nblocks) err = "block table entry out of range";
  std::vector<LayerDesc> layers;
  for (int64_t i = 0; !err && i < nl; ++i) {
    const LayerDesc L = LayerDesc::from(ptr<const int64_t>(tp) + i * kLayerFields);
    const Lin* lins[4] = {&L.qkv, &L.o, &L.gate_up, &L.down};
    for (const Lin* l : lins) err = err ? err : check_lin(*l);
    if (!err && (L.qkv.K != hidden || L.qkv.N != (H + 2 * KV) * D || L.o.K != H * D || L.o.N != hidden ||
                 L.gate_up.K != hidden || L.gate_up.N != 2 * I || L.down.K != I || L.down.N != hidden ||
                 !L.attn_norm || !L.mlp_norm || !L.keys || !L.values || (!L.q_norm != !L.k_norm)))
      err = "layer table does not match the dimensions";
    layers.push_back(L);
  }
  if (err) {
    PyErr_Format(PyExc_ValueError, "decoder_layers: %s", err);
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS
  try {
    for (const LayerDesc& L : layers)
      layer_forward(L, g, ptr<float>(xp), M, pos, slot, ptr<const float>(cp), ptr<const float>(snp));
  } catch (const std::exception&) {
    err = "kernel failed";
  }
  Py_END_ALLOW_THREADS
  if (err) {
    PyErr_Format(PyExc_RuntimeError, "decoder_layers: %s", err);
    return nullptr;
  }
  Py_RETURN_NONE;
}

// kv_store(kv_fmt, src_ptr, dst_ptr, n): the stack's own narrowing of n floats to a KV format, so that tests can
// hold it against torch's.
PyObject* py_kv_store(PyObject*, PyObject* args) {
  int fmt;
  long long src, dst, n;
  if (!PyArg_ParseTuple(args, "iLLL", &fmt, &src, &dst, &n)) return nullptr;
  if (fmt < kKvF32 || fmt > kKvBF16 || src == 0 || dst == 0 || n < 0) {
    PyErr_SetString(PyExc_ValueError, "kv_store: bad arguments");
    return nullptr;
  }
  for (int64_t i = 0; i < n; ++i) kv_put(fmt, ptr<void>(dst), i, ptr<const float>(src)[i]);
  Py_RETURN_NONE;
}

// ---------------------------------------------------------------------------------------------
// The softmax's largest probability of one row of logits: what adaptive speculation judges a draft model by
// before it drafts (AdaptiveK.note_confidence), once per request and step. torch's logsumexp spends most of
// its time on a libm-exact exp; a policy's signal does not need that, so exp here is 2^(x log2 e) from a
// rounded integer power and a degree-6 polynomial on [-1/2, 1/2] (relative error below 1e-6). Written with
// vector extensions so that every ISA computes the same lanes with the same operations, 16 at a time.
// (Attention's fast_exp, whose bits that path fixes, is 8 lanes wide and more precise: summed over a row it
// was no faster than torch.)
typedef float VF16 __attribute__((vector_size(16 * sizeof(float))));
typedef int32_t VI16 __attribute__((vector_size(16 * sizeof(int32_t))));

template <typename F, typename I>
static inline F exp_nonpositive(F x) {  // exp(x) for x <= 0; below -87 it returns exp(-87) (about 1.6e-38)
  const F zero{};
  const F lo = zero - 87.0f;            // a splat of -87 in either type
  x = x < lo ? lo : x;                  // (NaN stays NaN: the comparison is false)
  const F t = x * 1.44269504f;
  const F y = t + 12582912.0f;          // 1.5 * 2^23: rounds t to an integer in y's low mantissa bits
  const F n = y - 12582912.0f;
  const F f = t - n;                    // in [-1/2, 1/2]
  F p = f * 1.5403530e-4f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  I bits;
  std::memcpy(&bits, &y, sizeof(bits));
  bits = (bits - 0x4B400000 + 127) << 23;  // 2^n
  F scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// top_probability(ptr, n) -> max(softmax(row)), or -1.0 if the row holds a NaN or an infinity.
PyObject* py_top_probability(PyObject*, PyObject* args) {
  long long xp, n;
  if (!PyArg_ParseTuple(args, "LL", &xp, &n)) return nullptr;
  if (xp == 0 || n <= 0) {
    PyErr_SetString(PyExc_ValueError, "top_probability: bad arguments");
    return nullptr;
  }
  const float* x = ptr<const float>(xp);
  double result;
  Py_BEGIN_ALLOW_THREADS
  const int64_t body = n / 16 * 16;
  float m = x[0];
  bool bad = false;
  {
    VF16 top = VF16{} + m;
    VI16 nan = {};
    for (int64_t i = 0; i < body; i += 16) {
      VF16 v;
      std::memcpy(&v, x + i, sizeof(v));
      nan |= v != v;
      top = v > top ? v : top;
    }
    for (int l = 0; l < 16; ++l) {
      bad |= nan[l] != 0;
      m = top[l] > m ? top[l] : m;
    }
  }
  for (int64_t i = body; i < n; ++i) {
    bad |= x[i] != x[i];
    m = x[i] > m ? x[i] : m;
  }
  if (bad || !std::isfinite(m)) {
    result = -1.0;
  } else {
    VF16 acc = {};
    VF16 mv = acc + m;
    for (int64_t i = 0; i < body; i += 16) {
      VF16 v;
      std::memcpy(&v, x + i, sizeof(v));
      acc += exp_nonpositive<VF16, VI16>(v - mv);
    }
    float sum = 0.0f;
    for (int l = 0; l < 16; ++l) sum += acc[l];
    for (int64_t i = body; i < n; ++i) sum += exp_nonpositive<float, int32_t>(x[i] - m);
    result = 1.0 / static_cast<double>(sum);
  }
  Py_END_ALLOW_THREADS
  return PyFloat_FromDouble(result);
}

// ---------------------------------------------------------------------------------------------
// words_sums(base, fd, items) -> [sum or None]: the packed-weight cache's checksums (models/packed_cache.py),
// all of an entry's tensors in one call that releases the GIL. Each item is (offset, nbytes, from_file): the
// sum modulo 2^64 of the ceil(nbytes / 8) little-endian 64-bit words at that offset, read from the mapping at
// ``base`` or, for tensors read sparsely, with pread from ``fd`` (their pages then stay out of the resident
// set). None: the file ended inside the item. One call lets a start-up's checksums overlap the work other
// threads do under the GIL (the tokenizer's parse, the web stack's imports), instead of waiting for the GIL
// once per tensor.
static uint64_t words_sum(const uint8_t* p, int64_t nwords) {
  uint64_t acc[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= nwords; i += 4) {
    uint64_t w[4];
    std::memcpy(w, p + 8 * i, sizeof(w));
    acc[0] += w[0]; acc[1] += w[1]; acc[2] += w[2]; acc[3] += w[3];
  }
  for (; i < nwords; ++i) {
    uint64_t w;
    std::memcpy(&w, p + 8 * i, sizeof(w));
    acc[0] += w;
  }
  return acc[0] + acc[1] + acc[2] + acc[3];
}

PyObject* py_words_sums(PyObject*, PyObject* args) {
  long long base;
  int fd;
  PyObject* items;
  if (!PyArg_ParseTuple(args, "LiO", &base, &fd, &items)) return nullptr;
  PyObject* seq = PySequence_Fast(items, "words_sums: items must be a sequence");
  if (seq == nullptr) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  std::vector<long long> off(n), len(n);
  std::vector<int> from_file(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* it = PySequence_Fast_GET_ITEM(seq, i);
    if (!PyArg_ParseTuple(it, "LLp", &off[i], &len[i], &from_file[i])) {
      Py_DECREF(seq);
      return nullptr;
    }
    if (off[i] < 0 || len[i] < 0 || (!from_file[i] && base == 0)) {
      Py_DECREF(seq);
      PyErr_SetString(PyExc_ValueError, "words_sums: bad item");
      return nullptr;
    }
  }
  Py_DECREF(seq);
  std::vector<uint64_t> sums(n, 0);
  std::vector<char> ok(n, 1);
  Py_BEGIN_ALLOW_THREADS
  at::parallel_for(0, n, 1, [&](int64_t i0, int64_t i1) {
    constexpr int64_t kChunk = 4 << 20;  // bytes per pread, a multiple of 8
    std::vector<uint8_t> buf;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t padded = (len[i] + 7) / 8 * 8;
      if (!from_file[i]) {
        sums[i] = words_sum(ptr<const uint8_t>(base + off[i]), padded / 8);
        continue;
      }
      if (buf.empty()) buf.resize(kChunk);
      uint64_t total = 0;
      for (int64_t done = 0; done < padded;) {
        const int64_t want = std::min(kChunk, padded - done);
        int64_t got = 0;
        while (got < want) {
          const ssize_t r = pread(fd, buf.data() + got, want - got, off[i] + done + got);
          if (r <= 0) break;
          got += r;
        }
        if (got < want) {
          ok[i] = 0;
          break;
        }
        total += words_sum(buf.data(), want / 8);
        done += want;
      }
      sums[i] = total;
    }
  });
  Py_END_ALLOW_THREADS
  PyObject* out = PyList_New(n);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* v = ok[i] ? PyLong_FromUnsignedLongLong(sums[i]) : (Py_INCREF(Py_None), Py_None);
    if (v == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, i, v);
  }
  return out;
}

PyObject* py_isa(PyObject*, PyObject*) {
  return PyUnicode_FromString(SPECDECODE_VNNI ? "avx512-vnni" : SPECDECODE_AVX2 ? "avx2" : "scalar");
}

// amx([on]) -> whether multi-row integer calls (w8a8 from kAmxMinRows, w4a8 from kAmx4MinRows rows) use AMX
// tiles: compiled in, granted by the OS and switched on.
PyObject* py_amx(PyObject*, PyObject* args) {
  int on = -1;
  if (!PyArg_ParseTuple(args, "|i", &on)) return nullptr;
  if (on >= 0) g_amx_on.store(on != 0);
  return PyBool_FromLong(amx_enabled());
}

PyObject* py_has_avx2(PyObject*, PyObject*) { return PyBool_FromLong(SPECDECODE_AVX2); }

PyMethodDef kMethods[] = {
    {"linear", py_linear, METH_VARARGS, "Row-invariant linear on raw CPU pointers"},
    {"decoder_layers", py_decoder_layers, METH_VARARGS, "Decoder layers for decode / verification rows"},
    {"kv_store", py_kv_store, METH_VARARGS, "kv_store(fmt, src, dst, n): floats to a KV cache format"},
    {"has_avx2", py_has_avx2, METH_NOARGS, "True if compiled with AVX2/FMA intrinsics"},
    {"isa", py_isa, METH_NOARGS, "Instruction set of the W8A8 path"},
    {"top_probability", py_top_probability, METH_VARARGS, "top_probability(ptr, n): max of softmax of n floats"},
    {"words_sums", py_words_sums, METH_VARARGS, "words_sums(base, fd, [(offset, nbytes, from_file)]): checksums"},
    {"amx", py_amx, METH_VARARGS, "amx([on]): switch AMX tiles for multi-row W8A8 / W4A8 calls; returns whether in use"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "specdecode_cpu_linear", nullptr, -1, kMethods,
                       nullptr, nullptr, nullptr, nullptr};

}  // namespace

#define SPECDECODE_CAT2(a, b) a##b
#define SPECDECODE_CAT(a, b) SPECDECODE_CAT2(a, b)
PyMODINIT_FUNC SPECDECODE_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&kModule); }
