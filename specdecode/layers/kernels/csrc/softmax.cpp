// ---------------------------------------------------------------------------------------------
// The softmax's largest probability of one row of logits: what adaptive speculation judges a draft model by
// before it drafts (AdaptiveK.note_confidence), once per request and step. torch's logsumexp spends most of
// its time on a libm-exact exp; a policy's signal does not need that, so exp here is 2^(x log2 e) from a
// rounded integer power and a degree-6 polynomial on [-1/2, 1/2] (relative error below 1e-6). Written with
// vector extensions so that every ISA computes the same lanes with the same operations, 16 at a time.
// (Attention's fast_exp, whose bits that path fixes, is 8 lanes wide and more precise: summed over a row it
// was no faster than torch.)
#include "common.h"

namespace specdecode {
namespace {

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

}  // namespace

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

}  // namespace specdecode
