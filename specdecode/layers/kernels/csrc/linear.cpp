// One linear in any format: the dispatch over the formats' sources, the Python entry point and the AMX switch.
#include "linear.h"
#include "quant.h"

namespace specdecode {
namespace {

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
}  // namespace

bool amx_enabled() { return g_amx_on.load(std::memory_order_relaxed) && amx_granted(); }

const char* check_lin(const Lin& l) {
  if (l.fmt < kF32 || l.fmt > kQ8_0 || l.K < 0 || l.N < 0 || (l.N > 0 && l.w == nullptr)) return "bad weight";
  if (l.fmt <= kI8 ? l.ldw < ((l.K + 7) / 8) * 8 : (l.ldw % kQBlock != 0 || l.ldw < l.K)) return "bad weight stride";
  if (l.fmt >= kI8 && l.scale == nullptr) return "missing scale";
  return nullptr;
}

// y [M, ldy] = x [M, ldx] @ W.T (+ bias). Throws on allocation failure; runs without touching the GIL.
void linear(const Lin& l, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy) {
  if (M == 0 || l.N == 0) return;
  if (l.fmt == kW8A8) w8a8_linear(l, x, ldx, M, y, ldy);
  else if (l.fmt == kW4A8) w4a8_linear(l, x, ldx, M, y, ldy);
  else if (l.fmt == kW6A8) w6a8_linear(l, x, ldx, M, y, ldy);
  else if (l.fmt == kQ8_0) q8_0_linear(l, x, ldx, M, y, ldy);
  else float_linear(l, x, ldx, M, y, ldy);
}

// linear(fmt, x_ptr, ldx, w_ptr, ldw, K, scale_ptr, bias_ptr, y_ptr, ldy, M, N): every pointer is the address
// of a CPU tensor that kernels.rowinv_linear checked and keeps alive (scale_ptr / bias_ptr may be 0). GIL released.
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


// amx([on]) -> whether multi-row integer calls (w8a8 from kAmxMinRows, w4a8 from kAmx4MinRows rows) use AMX
// tiles: compiled in, granted by the OS and switched on.
PyObject* py_amx(PyObject*, PyObject* args) {
  int on = -1;
  if (!PyArg_ParseTuple(args, "|i", &on)) return nullptr;
  if (on >= 0) g_amx_on.store(on != 0);
  return PyBool_FromLong(amx_enabled());
}

PyObject* py_isa(PyObject*, PyObject*) {
  return PyUnicode_FromString(SPECDECODE_VNNI ? "avx512-vnni" : SPECDECODE_AVX2 ? "avx2" : "scalar");
}

PyObject* py_has_avx2(PyObject*, PyObject*) { return PyBool_FromLong(SPECDECODE_AVX2); }

}  // namespace specdecode
