// One linear in any format, as kernels.PackedLinear describes it: the entry points of the formats' sources.
#pragma once

#include "common.h"

namespace specdecode {

struct Lin {
  int64_t fmt;        // Fmt
  const void* w;
  int64_t ldw;        // row stride for fp32 / bf16 / int8 (>= round_up(K, 8)); Kp for w8a8 / w4a8 / w6a8 / q8_0
  const void* scale;  // float32 [N] for int8 / w8a8, w4a8 / w6a8 codes and units (W4Args, W6Args), q8_0 fp16
                      // block scales (W8Args::units), else unused
  const float* bias;  // [N] or null
  int64_t K, N;
};

// "bad weight", "bad weight stride", "missing scale", or null for a linear the kernels can run.
const char* check_lin(const Lin& l);

// y [M, ldy] = x [M, ldx] @ W.T (+ bias). Throws on allocation failure; runs without touching the GIL.
void linear(const Lin& l, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy);

// The formats' own entry points, with linear()'s contract (M and N are nonzero).
void float_linear(const Lin& l, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy);  // fp32 / bf16 / int8
void w8a8_linear(const Lin& l, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy);
void q8_0_linear(const Lin& l, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy);
void w4a8_linear(const Lin& l, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy);
void w6a8_linear(const Lin& l, const float* x, int64_t ldx, int64_t M, float* y, int64_t ldy);

}  // namespace specdecode
