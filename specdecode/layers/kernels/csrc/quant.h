// What the integer formats (w8a8, w4a8, w6a8) share: the activations quantized per row in blocks of 32, the
// tiling over groups of 16 channels, and the AMX tile machinery.
#pragma once

#include "common.h"

namespace specdecode {

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
// acc + vpdpbusd(w, the 4 activation bytes at p in every lane), the broadcast taken by the instruction's own
// memory operand. Where a broadcast feeds a single vpdpbusd (one group per tile), GCC's separate vpbroadcastd
// took a vector slot of its own; the same integers either way.
typedef int32_t __attribute__((may_alias)) AliasedI32;
static inline SPECDECODE_ALWAYS_INLINE __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int8_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const AliasedI32*>(p)));
  return acc;
}
#endif

// ---------------------------------------------------------------------------------------------
// AMX (Sapphire Rapids and later): the same integers from tile instructions (w8a8.cpp, w4a8.cpp).
// Group g, block b of the interleaved weights (8 quads x 64 bytes, contiguous) is exactly a B tile of 8 rows
// x 64 bytes, and rows m0.. of the quantized activations at block b are an A tile of R rows x 32 bytes
// (stride Kp).
// TDPBSUD (signed activation bytes x unsigned weight bytes) yields the block's R x 16 integer sums
// sum (w + 128) * q, exact; adding the block's -128 * sum(q) gives the very t_b of the VNNI path, and the
// float epilogue is the same fma per block in the same order. So the result is bitwise that of VNNI,
// for any R, while one tile instruction does the integer work of 8 * R vpdpbusd. What is left per row is
// the float epilogue, so extra verification rows cost far less (1.5B target, 16 rows: 1.35x faster).
// ---------------------------------------------------------------------------------------------

constexpr int kAmxRows = 16;     // rows of an A / C tile
constexpr int64_t kAmxMinRows = 3;  // up to two rows VNNI is as fast (bound by memory) and needs no tile setup
// w4a8 up to 6 rows: VNNI's single-group tiles (w4a8_one) stay faster (0.5B draft's linears, 4 rows: 12.8 ms
// against 14.4; 7 rows: 19.0 against 15.5, where VNNI needs two row tiles)
constexpr int64_t kAmx4MinRows = 7;
constexpr int64_t kAmxPrefetchBlocks = 4;  // weight blocks prefetched ahead of the tile loads

// Whether multi-row integer calls use AMX tiles: compiled in, granted by the OS and switched on (linear.cpp).
bool amx_enabled();

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
#endif

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

}  // namespace specdecode
