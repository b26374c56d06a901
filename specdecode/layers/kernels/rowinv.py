"""``rowinv_linear``: a linear whose output rows are bitwise independent of the batch, on the extension or the
pure-torch fallback, and the same as an opaque op for torch.compile."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specdecode.layers.kernels import extension
from specdecode.layers.kernels.fallback import _dense_on, _fallback
from specdecode.layers.kernels.formats import INT_ACTS
from specdecode.layers.kernels.int8 import quantize_activations
from specdecode.layers.kernels.packed import PackedLinear


def rowinv_linear(x: torch.Tensor, packed: PackedLinear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] float32 -> [M, N] float32``, row i bitwise independent of M, other rows and threads."""
    if x.ndim != 2 or x.shape[1] != packed.in_features:
        raise ValueError(f"rowinv_linear: expected x of shape [M, {packed.in_features}], got {tuple(x.shape)}")
    if x.dtype is not torch.float32:
        x = x.float()
    if not x.is_cpu:
        # Accelerators: plain BLAS on a cached dequantized copy. Row invariance is NOT guaranteed.
        w = _dense_on(packed, x.device)
        b = bias.to(device=x.device, dtype=torch.float32) if bias is not None else None
        return F.linear(quantize_activations(x) if packed.fmt in INT_ACTS else x, w, b)
    if not x.is_contiguous():
        x = x.contiguous()
    if extension._disabled() or not packed.weight.is_cpu:
        return _fallback(x, packed, bias)
    ext = extension._ext if extension._ext is not None else extension._get_ext()
    if ext is None:
        return _fallback(x, packed, bias)

    # The extension takes raw pointers: every layout assumption is checked here.
    N = packed.out_features
    wptr, ldw, code, scale = packed._kernel_args()
    if bias is not None:
        if not (bias.dtype is torch.float32 and bias.is_cpu and bias.is_contiguous()):
            bias = bias.detach().to(device="cpu", dtype=torch.float32).contiguous()
        if bias.numel() != N:
            raise ValueError(f"rowinv_linear: bias has {bias.numel()} elements, expected {N}")
    M, K = x.shape
    y = torch.empty(M, N, dtype=torch.float32)
    ext.linear(code, x.data_ptr(), K, wptr, ldw, K, scale.data_ptr() if scale is not None else 0,
               bias.data_ptr() if bias is not None else 0, y.data_ptr(), N, M, N)
    return y


# rowinv_linear as an opaque op, so that torch.compile keeps it in the graph (a plain C extension call
# would break the graph at every linear) and fuses only what lies between the linears. It takes the packed
# weight's tensors, not the PackedLinear: graph inputs, so every layer shares one graph.
@torch.library.custom_op("specdecode::rowinv_linear", mutates_args=())
def rowinv_linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
                     fmt: str, out_features: int) -> torch.Tensor:
    return rowinv_linear(x, PackedLinear(fmt, weight, scale, x.shape[1], out_features), bias)


@rowinv_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, fmt: str,
      out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features, dtype=torch.float32)
