// =============================================================================================
// Decoder layers for decode / verification rows (llama-style: RMSNorm, rotary, GQA attention over the
// KV cache, gated SiLU MLP), one call for the whole stack. In Python each layer is ~15 small torch ops
// whose dispatch costs more than their arithmetic at these sizes (a 0.5B draft spent ~11 ms of a 24 ms
// step outside the matmuls). Same math as models/model.py's Block, not bitwise the same values: decode
// and verification rows always take this path (prefill never does), so greedy exactness rests on it
// being row-invariant, which it is: every row's norm, rotary, attention and activation is computed from
// that row alone in a fixed order, and the linears are the row-invariant kernels (linear.h).
// =============================================================================================
#include "fast_exp.h"
#include "layer_stack.h"

namespace specdecode {
namespace {

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

// x[0..D) as int8 at q[0], q[stride], ... and its scale at *s (KvFmt kKvI8): engine/kv_cache.py's
// quantize_int8 operation for operation (exact absmax, one fp32 division for the scale, one per value, round to
// nearest even in the default rounding mode), so the stack and the Python path store the same bytes. An
// all-zero row stores scale 0 and zeros. (NaN rows are not matched: torch's absmax propagates a NaN, this one
// skips it.)
static inline void quantize_row(const float* x, int64_t D, int8_t* q, int64_t stride, float* s) {
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float scale = amax / 127.0f;
  const float div = scale > 0.0f ? scale : 1.0f;
  for (int64_t d = 0; d < D; ++d) {
    const float r = std::min(127.0f, std::max(-127.0f, std::nearbyint(x[d] / div)));
    q[d * stride] = static_cast<int8_t>(r);
  }
  *s = scale;
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
      if (g.kv_fmt == kKvI8) {
        const int64_t sa = g.scale_at(blk, kv) + off;
        quantize_row(row + (H + kv) * D, D, static_cast<int8_t*>(L.keys) + at + off, kKeyTile, L.key_scales + sa);
        quantize_row(row + (H + KV + kv) * D, D, static_cast<int8_t*>(L.values) + at + off * D, 1,
                     L.value_scales + sa);
        continue;
      }
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

}  // namespace

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
  if (!err && (kv_fmt < kKvF32 || kv_fmt > kKvI8 || btp == 0 || bps * kKeyTile < max_len || nblocks <= 0))
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
    if (!err && kv_fmt == kKvI8 && (!L.key_scales || !L.value_scales)) err = "int8 KV cache without scales";
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

}  // namespace specdecode
