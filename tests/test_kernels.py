"""Row-invariant CPU linear kernel: bitwise row invariance, accuracy, fallback path."""
from __future__ import annotations

import logging
import os
import contextlib

import pytest
import torch
import torch.nn.functional as F

from specdecode.layers import kernels
from specdecode.layers.kernels import extension, q4, q6

FMTS = ("fp32", "bf16", "int8", "w8a8", "w4a8", "q8_0")
MS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 17)
SHAPES = [(n, k) for k in (64, 72, 1536) for n in (64, 257)]


@contextlib.contextmanager
def num_threads(n: int):
    prev = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


@contextlib.contextmanager
def forced_fallback():
    prev = extension.FORCE_FALLBACK
    extension.FORCE_FALLBACK = True
    try:
        yield
    finally:
        extension.FORCE_FALLBACK = prev


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) / k ** 0.5


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g)


def _reference(x: torch.Tensor, packed, bias=None) -> torch.Tensor:
    """What the kernel computes, in plain torch (the integer formats also quantize the activations)."""
    xq = kernels.quantize_activations(x) if packed.fmt in kernels.INT_ACTS else x
    return F.linear(xq, kernels.dequantize(packed), bias)


def _assert_row_invariant(packed, bias, k: int, seed: int) -> None:
    x = _x(17, k, seed)
    single = [kernels.rowinv_linear(x[i:i + 1], packed, bias) for i in range(17)]
    for m in MS:
        out = kernels.rowinv_linear(x[:m], packed, bias)
        assert out.shape == (m, packed.out_features) and out.dtype == torch.float32
        for i in range(m):
            assert torch.equal(out[i], single[i][0]), f"M={m} row {i} differs from M=1"
    # Permuted rows.
    perm = torch.randperm(17, generator=torch.Generator().manual_seed(seed + 1))
    out = kernels.rowinv_linear(x[perm].contiguous(), packed, bias)
    for j, i in enumerate(perm.tolist()):
        assert torch.equal(out[j], single[i][0]), "permuted rows differ"
    # Other rows replaced by random data (including huge / tiny magnitudes).
    for m in (5, 9, 17):
        for i in range(m):
            y = _x(m, k, seed + 100 + i) * torch.logspace(-3, 3, m)[:, None]
            y[i] = x[i]
            out = kernels.rowinv_linear(y, packed, bias)
            assert torch.equal(out[i], single[i][0]), f"row {i} depends on other rows (M={m})"


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_row_invariance(fmt, n, k):
    packed = kernels.pack_linear(_weight(n, k, n * 7 + k), fmt)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)) if n == 257 else None
    _assert_row_invariant(packed, bias, k, seed=k + n)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n,k", [(257, 72), (1031, 1536)])
def test_thread_count_invariance(fmt, n, k):
    packed = kernels.pack_linear(_weight(n, k, 11), fmt)
    bias = torch.randn(n)
    x = _x(17, k, 5)
    with num_threads(1):
        one = kernels.rowinv_linear(x, packed, bias)
        one_single = kernels.rowinv_linear(x[3:4], packed, bias)
    with num_threads(2):
        two = kernels.rowinv_linear(x, packed, bias)
        two_single = kernels.rowinv_linear(x[3:4], packed, bias)
    assert torch.equal(one, two)
    assert torch.equal(one_single[0], two[3]) and torch.equal(two_single[0], one[3])


def test_kernel_builds():
    # The machine running the test suite has a compiler; the fast path must actually be exercised.
    assert kernels.kernel_available()


def test_a_built_kernel_is_imported_without_the_build_system():
    """Once built, a fresh process imports the kernel module by its content-derived name straight from the
    build directory: torch.utils.cpp_extension (and setuptools with it) is never imported."""
    import subprocess
    import sys

    assert kernels.kernel_available()  # built (or imported) by this process
    code = ("import sys; from specdecode.layers import kernels; from specdecode.layers.kernels import extension; "
            "assert kernels.kernel_available(); "
            "print(extension._ext.__file__, 'torch.utils.cpp_extension' in sys.modules, 'setuptools' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    path, ext_loaded, setuptools_loaded = out.stdout.split()
    assert path == extension._ext.__file__
    assert os.path.basename(path) in {extension._build_name(f) + ".so" for f in extension._BUILD_ATTEMPTS}
    assert ext_loaded == "False" and setuptools_loaded == "False"


def test_a_stale_build_lock_is_cleared(tmp_path):
    """A build killed mid-way leaves torch's ``lock`` file in its build directory, and every later
    cpp_extension.load there would wait on it forever: the next start removes it (one warning) and builds."""
    import subprocess
    import sys

    directory = tmp_path / extension._build_name(extension._BUILD_ATTEMPTS[0])
    directory.mkdir()
    (directory / "lock").touch()  # what a killed build leaves: torch's lock and no module
    code = ("import logging, sys; logging.basicConfig(stream=sys.stderr); from specdecode.layers import kernels; "
            "assert kernels.kernel_available()")
    env = dict(os.environ, SPECDECODE_KERNEL_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, env=env)
    assert out.returncode == 0, out.stderr
    warned = [line for line in out.stderr.splitlines() if "stale kernel build lock" in line]
    assert len(warned) == 1 and str(directory / "lock") in warned[0]
    assert not (directory / "lock").exists()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("n,k", [(64, 64), (257, 72), (300, 1536), (96, 4100)])
def test_accuracy(n, k):
    w = _weight(n, k, 1)
    x = _x(9, k, 2)
    bias = torch.randn(n)
    ref = F.linear(x, w)

    p32 = kernels.pack_linear(w, "fp32")
    assert _rel_err(kernels.rowinv_linear(x, p32), ref) < 1e-4
    assert torch.equal(kernels.dequantize(p32), w)

    pbf = kernels.pack_linear(w, "bf16")
    wbf = kernels.dequantize(pbf)
    assert torch.equal(wbf, w.bfloat16().float())
    assert _rel_err(kernels.rowinv_linear(x, pbf), F.linear(x, wbf)) < 1e-4

    p8 = kernels.pack_linear(w, "int8")
    w8 = kernels.dequantize(p8)
    assert w8.shape == (n, k) and w8.dtype == torch.float32
    assert _rel_err(kernels.rowinv_linear(x, p8), F.linear(x, w8)) < 1e-4
    # int8 quantization itself: symmetric per-channel, round to nearest.
    scale = w.abs().amax(dim=1) / 127
    assert (w8 - w).abs().le(scale[:, None] / 2 * (1 + 1e-5)).all()
    assert _rel_err(kernels.rowinv_linear(x, p8), ref) < 2e-2

    pw = kernels.pack_linear(w, "w8a8")
    assert torch.equal(kernels.dequantize(pw), w8)  # same weights as int8, stored with an offset
    assert _rel_err(kernels.rowinv_linear(x, pw), _reference(x, pw)) < 1e-5
    assert _rel_err(kernels.rowinv_linear(x, pw), ref) < 3e-2

    p4 = kernels.pack_linear(w, "w4a8")
    w4 = kernels.dequantize(p4)
    assert w4.shape == (n, k)
    # 4-bit weights with a scale per 32: each block's values are 16 levels of its scale, and the chosen grid
    # is at least as good as the plain absmax/8 one (one of the candidates) rounded to the same units' codes.
    blocks = F.pad(w, (0, -k % 32)).view(n, -1, 32)
    q_blocks = F.pad(w4, (0, -k % 32)).view(n, -1, 32)
    f = q4._w4_unpack(p4)
    for i in range(min(n, 8)):
        for b in range(blocks.shape[1]):
            levels = torch.unique(q_blocks[i, b])
            assert len(levels) <= 16
            blk = blocks[i, b]
            v = blk[blk.abs().argmax()]
            unit, unit_o = float(f.D[i, b // 8]), float(f.Dm[i, b // 8])
            s = torch.round(-v / 8 / unit).clamp(-127, 127) * unit if unit else torch.tensor(0.0)
            o = torch.round(-v / unit_o).clamp(-127, 127) * unit_o if unit_o else torch.tensor(0.0)
            u = torch.round((blk + o) / s).clamp(0, 15) if s else torch.zeros_like(blk)
            plain = (u * s - o - blk).pow(2).sum()
            assert (q_blocks[i, b] - blk).pow(2).sum() <= plain * (1 + 1e-5) + 1e-12
    assert _rel_err(kernels.rowinv_linear(x, p4), _reference(x, p4)) < 1e-5
    assert _rel_err(kernels.rowinv_linear(x, p4), ref) < 0.25

    for p in (p32, pbf, p8, pw, p4):
        out = kernels.rowinv_linear(x, p, bias)
        assert _rel_err(out, _reference(x, p, bias)) < 1e-4
        assert torch.equal(out, kernels.rowinv_linear(x, p) + bias) or _rel_err(
            out, kernels.rowinv_linear(x, p) + bias) < 1e-6


def test_input_dtypes_and_edge_cases():
    w = _weight(40, 24, 3)
    p = kernels.pack_linear(w.bfloat16(), "int8")
    x = _x(3, 24, 4)
    out = kernels.rowinv_linear(x, p, torch.zeros(40, dtype=torch.bfloat16))
    assert torch.equal(out, kernels.rowinv_linear(x, p))
    # Non-contiguous input and zero rows.
    xt = _x(24, 3, 4).t()
    assert torch.equal(kernels.rowinv_linear(xt, p), kernels.rowinv_linear(xt.contiguous(), p))
    assert kernels.rowinv_linear(x[:0], p).shape == (0, 40)
    # All-zero weight rows quantize cleanly.
    wz = w.clone()
    wz[5] = 0
    pz = kernels.pack_linear(wz, "int8")
    assert torch.all(kernels.rowinv_linear(x, pz)[:, 5] == 0)
    with pytest.raises(ValueError):
        kernels.pack_linear(w, "fp8")
    with pytest.raises(ValueError):
        kernels.rowinv_linear(_x(2, 25, 0), p)


@pytest.mark.parametrize("fmt", FMTS)
def test_fallback_row_invariant(fmt, monkeypatch):
    n, k = 257, 72
    packed = kernels.pack_linear(_weight(n, k, 9), fmt)
    bias = torch.randn(n)
    x = _x(9, k, 10)
    fast = kernels.rowinv_linear(x, packed, bias)
    with forced_fallback():
        assert not kernels.kernel_available()
        _assert_row_invariant(packed, bias, k, seed=4)
        slow = kernels.rowinv_linear(x, packed, bias)
    assert _rel_err(slow, fast) < 1e-4
    monkeypatch.setenv("SPECDECODE_DISABLE_KERNEL", "1")
    assert not kernels.kernel_available()
    assert torch.equal(kernels.rowinv_linear(x, packed, bias), slow)
    monkeypatch.delenv("SPECDECODE_DISABLE_KERNEL")
    assert kernels.kernel_available()


def test_build_failure_falls_back_with_one_warning(monkeypatch):
    def boom():
        raise RuntimeError("no compiler")

    monkeypatch.setattr(extension, "_ext", None)
    monkeypatch.setattr(extension, "_build_failed", False)
    monkeypatch.setattr(extension, "_load_extension", boom)
    # Our own handler on the kernel's logger: caplog depends on propagation to the root logger, which other
    # in-process tests (the CLI sets up its own handlers) may change.
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    log = logging.getLogger(extension.__name__)
    log.addHandler(handler)
    try:
        packed = kernels.pack_linear(_weight(64, 72, 1), "int8")
        x = _x(5, 72, 2)
        assert not kernels.kernel_available()
        out = kernels.rowinv_linear(x, packed)
        out1 = kernels.rowinv_linear(x[2:3], packed)
    finally:
        log.removeHandler(handler)
    assert torch.equal(out[2], out1[0])
    assert len([r for r in records if "could not build" in r.getMessage()]) == 1


@pytest.mark.parametrize("fmt", FMTS)
def test_many_rows(fmt):
    # More rows than one row block (64): still every row equals its own M=1 result.
    n, k = 53, 40
    packed = kernels.pack_linear(_weight(n, k, 21), fmt)
    x = _x(150, k, 22)
    out = kernels.rowinv_linear(x, packed)
    for i in (0, 5, 63, 64, 65, 127, 128, 149):
        assert torch.equal(out[i], kernels.rowinv_linear(x[i:i + 1], packed)[0])
    assert _rel_err(out, _reference(x, packed)) < 1e-4


def test_flush_denormal_mode_is_uniform_across_threads():
    # Tiny weights produce denormal products; whatever mode the caller uses, all rows/threads agree.
    n, k = 257, 64
    packed = kernels.pack_linear(_weight(n, k, 31) * 1e-30, "fp32")
    x = _x(9, k, 32) * 1e-10
    for flush in (False, True):
        if not torch.set_flush_denormal(flush):
            pytest.skip("flush-denormal not supported on this CPU")
        try:
            full = kernels.rowinv_linear(x, packed)
            for i in range(9):
                assert torch.equal(full[i], kernels.rowinv_linear(x[i:i + 1], packed)[0])
            with num_threads(1):
                assert torch.equal(kernels.rowinv_linear(x, packed), full)
        finally:
            torch.set_flush_denormal(False)


def test_non_cpu_input_uses_dense_weight_on_that_device():
    # "meta" stands in for an accelerator: no CPU-only shortcut may be taken for non-CPU inputs.
    w = _weight(33, 20, 41)
    for fmt in FMTS:
        p = kernels.pack_linear(w, fmt)
        out = kernels.rowinv_linear(torch.empty(4, 20, device="meta"), p, torch.zeros(33))
        assert out.device.type == "meta" and out.shape == (4, 33)


def test_pack_from_half_precision_weights():
    w = _weight(40, 24, 5)
    x = _x(3, 24, 6)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        for fmt in FMTS:
            p = kernels.pack_linear(w.to(dtype), fmt)
            assert (p.fmt, p.out_features, p.in_features) == (fmt, 40, 24)
            assert _rel_err(kernels.rowinv_linear(x, p), _reference(x, p)) < 1e-4


def test_activation_quantization_is_per_row_and_per_block():
    x = _x(3, 100, 51) * torch.tensor([1.0, 1e-3, 1e3])[:, None]
    x[1, 40:64] = 0  # an all-zero block quantizes to zeros
    q = kernels.quantize_activations(x)
    assert q.shape == x.shape
    for i in range(3):
        assert torch.equal(kernels.quantize_activations(x[i:i + 1])[0], q[i])
        for b0 in range(0, 100, kernels.ACT_BLOCK):
            blk = x[i, b0:b0 + kernels.ACT_BLOCK]
            step = blk.abs().max() / 127
            assert ((q[i, b0:b0 + kernels.ACT_BLOCK] - blk).abs() <= step / 2 * 1.001 + 1e-30).all()
    assert torch.all(q[1, 40:64] == 0)


def _q4k_blocks(n: int, k: int, seed: int) -> torch.Tensor:
    """Random GGUF Q4_K rows (uint8 [n, k / 256 * 144]): random bytes but d and dmin, which are small fp16
    values (and one super-block of each row has a negative d, which the format allows)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 256, 144), dtype=torch.uint8, generator=g)
    units = (torch.rand(n, k // 256, 2, generator=g) * 0.004 + 1e-5).half()
    units[:, 0, 0] = -units[:, 0, 0]
    blocks[:, :, :4] = units.view(torch.uint8).view(n, k // 256, 4)
    return blocks.view(n, -1)


def test_w4a8_holds_q4k_blocks_exactly_as_stored():
    """A GGUF Q4_K tensor packed from its stored blocks (``pack_q4k``) holds exactly the weights llama.cpp's
    own dequantization gives (gguf-py's, bit for bit), and the kernel multiplies with those weights."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    n, k = 40, 768
    blocks = _q4k_blocks(n, k, 3)
    want = torch.from_numpy(gguf_dequantize(blocks.numpy(), GGMLQuantizationType.Q4_K).astype(np.float32))
    p = kernels.pack_q4k(blocks, k)
    assert p.nbytes == 48 * k // 32 * 18.5  # 18.5 bytes per 32 weights (40 channels padded to 48)
    assert torch.equal(kernels.dequantize(p), want.view(n, k))
    x = _x(5, k, 4)
    assert _rel_err(kernels.rowinv_linear(x, p), kernels.quantize_activations(x) @ want.view(n, k).T) < 1e-5
    with pytest.raises(ValueError, match="multiple of 256"):
        kernels.pack_q4k(blocks[:, :144], 200)


def test_w4a8_quantizes_float_weights_to_grids_of_the_codes():
    """Other weights get per block the best of a few grids, rounded to the codes: every weight lies within half
    a step of its block's grid (or is clipped at its end), and the error is that of 4-bit weights."""
    w = _weight(70, 300, 5)
    p = kernels.pack_linear(w, "w4a8")
    f = q4._w4_unpack(p)
    s = q4._w4_values(f.cs, f.D)[:, :, None]
    o = q4._w4_values(f.co, f.Dm)[:, :, None]
    wp = F.pad(w, (0, 20)).view(70, -1, 32)
    inside = ((wp + o) / s >= -0.5) & ((wp + o) / s <= 15.5)
    err = (kernels.dequantize(p) - w).view(70, -1).abs()
    assert (F.pad(err, (0, 20)).view(70, -1, 32)[inside] <= (s.abs() / 2 * 1.0001).expand_as(wp)[inside]).all()
    assert float((err.pow(2).mean() / w.pow(2).mean())) < 0.01


def test_w4a8_select_rows_and_layout_round_trip():
    w = _weight(70, 100, 5)
    p = kernels.pack_linear(w, "w4a8")
    f = q4._w4_unpack(p)
    assert f.u.shape == (70, 128) and f.cs.shape == f.co.shape == (70, 4) and f.D.shape == f.Dm.shape == (70, 1)
    assert int(f.u.min()) >= 0 and int(f.u.max()) <= 15 and bool((f.co != 0).any())
    again = kernels.pack_w4(f, 100)
    assert torch.equal(again.weight, p.weight) and torch.equal(again.scale, p.scale)
    rows = torch.tensor([69, 0, 17, 16, 33])
    sub = p.select_rows(rows)
    # Rows are cut byte for byte: the same layout as unpacking them and packing again.
    for cut in (rows, torch.arange(70).flip(0), torch.tensor([3])):
        ref = kernels.pack_w4(q4._w4_unpack_rows(p, cut), 100)
        got = p.select_rows(cut)
        assert torch.equal(got.weight, ref.weight) and torch.equal(got.scale, ref.scale), cut
        assert got.out_features == ref.out_features == len(cut)
    assert torch.equal(kernels.dequantize(sub), kernels.dequantize(p)[rows])
    x = _x(6, 100, 6)
    assert torch.equal(kernels.rowinv_linear(x, sub), kernels.rowinv_linear(x, p)[:, rows])


def q8_0_blocks(n: int, k: int, seed: int) -> torch.Tensor:
    """Random GGUF Q8_0 rows (uint8 [n, k / 32 * 34]): random int8 values (-128 in every row) and small fp16 d of
    both signs."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 34), dtype=torch.uint8, generator=g)
    blocks[:, 0, 2] = 0x80
    d = ((torch.rand(n, k // 32, generator=g) - 0.3) * 0.01).half()
    blocks[:, :, :2] = d.view(torch.uint8).view(n, k // 32, 2)
    return blocks.view(n, -1)


def _q6k_blocks(n: int, k: int, seed: int) -> torch.Tensor:
    """Random GGUF Q6_K rows (uint8 [n, k / 256 * 210]): random bytes (so int8 scales of both signs, -128
    included somewhere) but d, a small fp16 value (negative in one super-block of each row)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 256, 210), dtype=torch.uint8, generator=g)
    blocks[0, 0, 192] = 0x80  # scale -128: the largest |t_b| the kernel's integer sums must hold
    d = (torch.rand(n, k // 256, generator=g) * 0.001 + 1e-5).half()
    d[:, 0] = -d[:, 0]
    blocks[:, :, 208:] = d.view(torch.uint8).view(n, k // 256, 2)
    return blocks.view(n, -1)


def test_w6a8_holds_q6k_blocks_exactly_as_stored():
    """A GGUF Q6_K tensor packed from its stored blocks (``pack_q6k``) holds exactly the weights gguf-py's Q6_K
    dequantization gives, in 6.5625 bits a weight, and the kernel multiplies with those weights: its exact
    integer sums agree with a float64 product to float32 rounding, even with every activation at the end of
    its range (the largest sums the format allows)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    n, k = 40, 768
    blocks = _q6k_blocks(n, k, 3)
    want = torch.from_numpy(gguf_dequantize(blocks.numpy(), GGMLQuantizationType.Q6_K).astype(np.float32)).view(n, k)
    p = kernels.pack_q6k(blocks, k)
    assert p.fmt == "w6a8" and p.nbytes == 48 * k * 6.5625 / 8  # 40 channels padded to 48
    assert torch.equal(kernels.dequantize(p), want)
    for x in (_x(5, k, 4), torch.full((2, k), 1.0), torch.full((1, k), -3.0)):
        ref = kernels.quantize_activations(x).double() @ want.double().T
        assert _rel_err(kernels.rowinv_linear(x, p).double(), ref) < 1e-6
    with pytest.raises(ValueError, match="multiple of 256"):
        kernels.pack_q6k(blocks[:, :210], 200)


def test_w6a8_quantizes_float_weights_and_round_trips():
    """Float weights in w6a8: within half a step of their 16's grid (or clipped at its end), rows cut from a
    packed weight are the rows of the whole, and fields -> layout -> fields is the identity."""
    w = _weight(70, 300, 5)
    p = kernels.pack_linear(w, "w6a8")
    f = q6._w6_unpack_rows(p, torch.arange(70))
    assert f.u.shape == (70, 320) and f.sc.shape == (70, 20) and f.D.shape == (70, 2)
    assert int(f.u.max()) <= 63 and int(f.u.min()) == 0
    step = (f.D.float().repeat_interleave(16, dim=1)[:, :20] * f.sc.float())[:, :, None]
    err = F.pad((kernels.dequantize(p) - w).abs(), (0, 20)).view(70, 20, 16)
    on_grid = F.pad(w, (0, 20)).view(70, 20, 16) / step
    inside = (on_grid >= -32.5) & (on_grid <= 31.5)
    assert bool(inside[:, :18].float().mean() > 0.99) and (err <= step.abs() / 2 * 1.0001)[inside].all()
    assert float(err.pow(2).mean() / w.pow(2).mean()) < 2e-3
    again = kernels.pack_w6(f, 300)
    assert torch.equal(again.weight, p.weight) and torch.equal(again.scale, p.scale)
    rows = torch.tensor([69, 0, 17, 16, 33])
    sub = p.select_rows(rows)
    assert torch.equal(kernels.dequantize(sub), kernels.dequantize(p)[rows])
    x = _x(6, 300, 6)
    assert torch.equal(kernels.rowinv_linear(x, sub), kernels.rowinv_linear(x, p)[:, rows])
    for m in (1, 2, 3, 7, 17):  # every row count: row i is the same bits alone and among others
        y = kernels.rowinv_linear(_x(m, 300, 7), p)
        assert torch.equal(y[-1:], kernels.rowinv_linear(_x(m, 300, 7)[-1:], p))


def _kv_edge_values() -> torch.Tensor:
    """Floats around every rounding decision of float32 -> float16 / bfloat16: each 16-bit value, the midpoints
    between neighbours (ties) and one float32 step either side, subnormals, overflow and specials."""
    halves = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    bfs = (torch.arange(0, 1 << 16, dtype=torch.int32) << 16).view(torch.float32)
    out = []
    for v in (halves, bfs):
        v = v[torch.isfinite(v)].unique()
        mid = (v[:-1].double() + v[1:].double()) / 2
        mid = mid[mid.abs() < 3e38].float()
        out += [v, mid, torch.nextafter(mid, torch.tensor(float("inf"))), torch.nextafter(mid, torch.tensor(-float("inf")))]
    special = torch.tensor([0.0, -0.0, 65504.0, 65519.996, 65520.0, 65536.0, 2.0 ** -24, 2.0 ** -25, 2.0 ** -26,
                            1e-45, -1e-40, 1.5 * 2.0 ** -25, float("inf"), -float("inf"), 3.4e38, -3.4e38])
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(200000, generator=g) * torch.exp(torch.empty(200000).uniform_(-40, 25, generator=g))
    return torch.cat(out + [special, wide]).contiguous()


def _kv_store(ext, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(x.numel(), dtype=dtype)
    ext.kv_store(kernels.KV_DTYPES[dtype], x.data_ptr(), out.data_ptr(), x.numel())
    return out


def _assert_kv_store_matches_torch(ext) -> None:
    x = _kv_edge_values()
    for dtype in (torch.float16, torch.bfloat16):
        got, want = _kv_store(ext, x, dtype), x.to(dtype)
        same = got.view(torch.int16) == want.view(torch.int16)
        bad = (~same).nonzero()[:5, 0]
        assert bool(same.all()), f"{dtype}: {x[bad].tolist()} -> {got[bad].tolist()}, torch {want[bad].tolist()}"
    assert torch.equal(_kv_store(ext, x, torch.float32), x)


def test_kv_cache_narrowing_matches_torch():
    """The C++ stack stores keys and values with the same round-to-nearest-even as torch's .to(), bit for bit,
    including ties, subnormals and overflow, so both attention paths write one cache format."""
    if not kernels.kernel_available():
        pytest.fail("the kernel must build on the test machine")
    _assert_kv_store_matches_torch(extension._ext)


def _stack_logits(path, kv_cache_dtype: str = "auto") -> torch.Tensor:
    """Verification rows through the C++ stack over a 16-bit (or int8) cache (two requests, one crossing blocks,
    with more keys than one vector of scores)."""
    from specdecode.engine.model_runner import ModelRunner
    from specdecode.models.loader import load_model

    r = ModelRunner(load_model(path, "float32", "cpu", 64, "w8a8"), 2, 64, "cpu", kv_cache_dtype=kv_cache_dtype)
    want = torch.int8 if kv_cache_dtype == "int8" else torch.float16
    assert r.model._layer_stack() is not None and r.kv_cache.dtype == want
    ids = torch.randint(5, 500, (50,), generator=torch.Generator().manual_seed(1)).tolist()
    r.prefill(0, ids[:37])
    r.prefill(1, ids[:5])
    return torch.cat(r.forward_rows([(0, 37, ids[37:43]), (1, 5, ids[5:6])], all_logits=True))


def test_integer_instruction_sets_agree_bitwise(tmp_path, tiny_models):
    """The AVX-512 VNNI, AVX2 and portable paths compute the same integer lanes and the same float
    epilogue, so a model gives the same tokens on any x86 CPU. Builds the kernel with the wider
    instruction sets switched off and compares against the default build. The decoder stack over a 16-bit
    KV cache (F16C conversions, or the portable ones without it) and over an int8 one (AVX2 or scalar
    quantize / dequantize) agrees bitwise too."""
    from torch.utils import cpp_extension

    from tiny import build_model

    if not kernels.kernel_available():
        pytest.fail("the kernel must build on the test machine")
    base = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"]
    variants = {"scalar": base}
    if extension._ext.isa() == "avx512-vnni":
        variants["avx2"] = base + ["-march=native", "-mno-avx512f"]
    if extension._ext.isa() != "scalar":  # w4a8's units are fp16: the path without F16C converts them itself
        variants["avx2_no_f16c"] = base + ["-march=native", "-mno-avx512f", "-mno-f16c"]
    cases = []
    for i, (n, k) in enumerate([(64, 64), (257, 72), (131, 1536), (40, 4100)]):
        w = _weight(n, k, 60 + i)
        for fmt in ("w8a8", "w4a8", "w6a8"):
            cases.append((kernels.pack_linear(w, fmt), _x(7, k, 70 + i) * 4, torch.randn(n)))
        if k % 256 == 0:  # stored Q4_K and Q6_K blocks: 6-bit codes, negative units, a scale of -128
            cases.append((kernels.pack_q4k(_q4k_blocks(n, k, 80 + i), k), _x(7, k, 70 + i) * 4, torch.randn(n)))
            cases.append((kernels.pack_q6k(_q6k_blocks(n, k, 90 + i), k), _x(7, k, 70 + i) * 4, torch.randn(n)))
        if k % 32 == 0:  # stored Q8_0 blocks: any int8 value, -128 included
            cases.append((kernels.pack_q8_0(q8_0_blocks(n, k, 95 + i), k), _x(7, k, 70 + i) * 4, torch.randn(n)))
        cases.append((kernels.pack_linear(w, "q8_0"), _x(7, k, 70 + i) * 4, torch.randn(n)))
    # 7 rows take the tiles of 4 and 3 rows; 1 and 2 rows (decode, short verification) take the paths that run
    # the offsets' chains inside the block loop.
    cases += [(p, x[:n], b) for p, x, b in list(cases) for n in (1, 2)]
    expected = [kernels.rowinv_linear(x, p, b) for p, x, b in cases]
    models = [tiny_models["qwen3"], build_model("qwen2", tmp_path / "head64", layers=1, hidden=256)]  # D 32, 64
    stack_cases = [(m, dt) for m in models for dt in ("auto", "int8")]
    expected_stack = [_stack_logits(m, dt) for m, dt in stack_cases]
    saved = extension._ext
    try:
        for name, flags in variants.items():
            mod = cpp_extension.load(name=f"specdecode_w8a8_{name}_{extension._cpu_tag()}",
                                     sources=list(extension._SOURCES),
                                     extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                     build_directory=str(tmp_path), verbose=False)
            assert mod.isa() == name.removesuffix("_no_f16c")
            extension._ext = mod
            for (p, x, b), want in zip(cases, expected):
                assert torch.equal(kernels.rowinv_linear(x, p, b), want), f"{name} differs from {saved.isa()}"
            _assert_kv_store_matches_torch(mod)
            for (m, dt), want in zip(stack_cases, expected_stack):
                assert torch.equal(_stack_logits(m, dt), want), f"decoder stack ({dt}): {name} differs from {saved.isa()}"
    finally:
        extension._ext = saved


def _cpu_has_amx() -> bool:
    with open("/proc/cpuinfo") as f:
        flags = next((line.split() for line in f if line.startswith("flags")), [])
    return "amx_int8" in flags and "amx_tile" in flags


@pytest.mark.parametrize("fmt", ["w8a8", "w4a8", "q8_0"])
def test_amx_tiles_agree_bitwise_with_vnni(fmt):
    """Where the CPU has AMX, multi-row integer calls run on tiles; their sums and epilogue are those of the
    VNNI path, so every row (any count, any tile width, ragged N and K) is bitwise the same either way."""
    if not kernels.kernel_available():
        pytest.fail("the kernel must build on the test machine")
    if not kernels.set_amx(True):
        # Only acceptable where the CPU has no AMX (or the build has no VNNI path to match it against).
        assert not (_cpu_has_amx() and extension._ext.isa() == "avx512-vnni"), "AMX CPU, but the tiles are unused"
        return
    try:
        for i, (n, k) in enumerate([(64, 64), (257, 72), (131, 1536), (40, 4100)]):
            p, b = kernels.pack_linear(_weight(n, k, 80 + i), fmt), torch.randn(n)
            for m in (1, 2, 3, 4, 5, 7, 9, 13, 16, 17, 40):
                x = _x(m, k, 90 + m) * 4
                for bias in (None, b):
                    got = kernels.rowinv_linear(x, p, bias)
                    assert kernels.set_amx(False) is False
                    want = kernels.rowinv_linear(x, p, bias)
                    assert kernels.set_amx(True)
                    assert torch.equal(got, want), (n, k, m, bias is None)
                    # and each row equals that row computed alone
                    assert torch.equal(got[m // 2:m // 2 + 1], kernels.rowinv_linear(x[m // 2:m // 2 + 1], p, bias))
    finally:
        kernels.set_amx(True)


def test_top_probability_matches_the_softmax():
    """The extension's top probability (a fast exp) agrees with float64 softmax to 1e-4 across lengths that do and
    do not fill its vector lanes and across sharp and flat rows; a NaN or +inf gives None (as the torch path does),
    and -inf entries (masked tokens) weigh nothing."""
    from specdecode.layers.sampler import top_probability

    assert kernels.kernel_available()
    g = torch.Generator().manual_seed(7)
    for n in (1, 15, 16, 33, 1000, 151936):
        for scale in (0.01, 1.0, 8.0, 100.0):
            row = torch.randn(n, generator=g) * scale
            want = float(torch.softmax(row.double(), -1).max())
            assert kernels.top_probability(row) == pytest.approx(want, rel=1e-4)
            assert top_probability(row) == pytest.approx(want, rel=1e-4)
    row = torch.randn(1001, generator=g)
    masked = row.clone()
    masked[::3] = float("-inf")
    assert top_probability(masked) == pytest.approx(float(torch.softmax(masked.double(), -1).max()), rel=1e-4)
    for bad in (float("nan"), float("inf")):
        broken = row.clone()
        broken[500] = bad
        assert kernels.top_probability(broken) == -1.0 and top_probability(broken) is None
    assert top_probability(torch.full((40,), float("-inf"))) is None
