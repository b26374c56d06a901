// What every translation unit of the kernel shares: the instruction sets it is built for, the tuning
// constants, the work split of the linears and small exact helpers. Every source includes it first.
//
// Only light headers: <torch/extension.h> / pybind11 would triple the one-time JIT build time, so the
// module talks to Python through the C API and receives raw pointers validated by the Python side
// (specdecode/layers/kernels/). The build passes -fvisibility=hidden: the sources share their symbols with
// each other only, as one file's anonymous namespace kept them, and the module exports PyInit alone.
#pragma once

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
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512DQ__)
#define SPECDECODE_VNNI 1
#else
#define SPECDECODE_VNNI 0
#endif
// AMX tiles (Sapphire Rapids and later) for multi-row integer calls: see quant.h.
#if SPECDECODE_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define SPECDECODE_AMX 1
#include <sys/syscall.h>
#else
#define SPECDECODE_AMX 0
#endif

#ifndef SPECDECODE_PREFETCH
#define SPECDECODE_PREFETCH 1
#endif
#ifndef SPECDECODE_PF_LOCALITY
#define SPECDECODE_PF_LOCALITY 3
#endif

#if defined(__GNUC__)
#define SPECDECODE_ALWAYS_INLINE __attribute__((always_inline))
#else
#define SPECDECODE_ALWAYS_INLINE
#endif

namespace specdecode {

enum Fmt : int { kF32 = 0, kBF16 = 1, kI8 = 2, kW8A8 = 3, kW4A8 = 4, kW6A8 = 5, kQ8_0 = 6 };

constexpr int64_t kUnit = 24;       // channels per parallel work unit (lcm of tile widths 8, 6, 3, 2)
constexpr int64_t kRowBlock = 64;   // rows processed per pass over a channel block
constexpr int64_t kL2Budget = 192 * 1024;  // bytes of weights per channel block (stays hot in L2)
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
#endif

template <typename T>
static T* ptr(long long v) { return reinterpret_cast<T*>(static_cast<uintptr_t>(v)); }

}  // namespace specdecode
