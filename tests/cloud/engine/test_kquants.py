"""GGUF K-quants (cloud.engine.kquants): the natural layout keeps the GGUF's values at about its
bytes, and every kernel computes the canonical product bit for bit, whatever the rows, the
thread count and the scales."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specsplit.cloud.engine import cpu_kernels as kernels
from specsplit.cloud.engine import kernel_layouts, kernel_library, kquants
from specsplit.shared.build_steps import cache_dir
from specsplit.shared.weights.sources import TARGET_DEFAULT
from tests.cloud.engine.conftest import BACKENDS, natural, needs_kernels

gguf = pytest.importorskip("gguf")

TYPES = {
    "q4_k": gguf.GGMLQuantizationType.Q4_K,
    "q5_k": gguf.GGMLQuantizationType.Q5_K,
    "q6_k": gguf.GGMLQuantizationType.Q6_K,
}
DEFAULT_GGUF = cache_dir() / "gguf" / TARGET_DEFAULT.gguf_file
REAL = pytest.mark.skipif(
    not DEFAULT_GGUF.is_file(), reason="the default target's GGUF is not cached"
)


def gguf_blocks(fmt: str, n: int, k: int, seed: int = 0, d=None, dmin=None) -> np.ndarray:
    """[n, k / 256 blocks] of random ggml blocks (every level and sub-block scale drawn from its
    whole range), with float16 super-block scales ``d`` / ``dmin`` (random if None)."""
    rng = np.random.default_rng(seed)
    size = kquants.GGUF_BLOCK_BYTES[fmt]
    raw = rng.integers(0, 256, size=(n * k // 256, size), dtype=np.uint8)

    def halves(v) -> np.ndarray:  # float16 per block as [blocks, 2] bytes
        if v is None:
            v = rng.uniform(1e-4, 1e-2, raw.shape[0])
        v = np.ascontiguousarray(np.broadcast_to(np.asarray(v, np.float16), raw.shape[:1]))
        return v.view(np.uint8).reshape(-1, 2)

    if fmt == "q6_k":
        raw[:, 208:210] = halves(d)
    else:
        raw[:, 0:2], raw[:, 2:4] = halves(d), halves(dmin)
    return raw.reshape(n, -1)


@pytest.fixture(scope="module")
def default_gguf():
    return {t.name: t for t in gguf.GGUFReader(DEFAULT_GGUF).tensors}


def expected(fmt: str, x: kernels.QuantizedRows, tensors) -> torch.Tensor:
    return kquants.reference_gemm(fmt, natural(x), x.xs, x.xsum, tensors)


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (
        f"{int((got != want).sum())} of {got.numel()} differ, max {float((got - want).abs().max())}"
    )


@pytest.mark.parametrize("fmt", kquants.FORMATS)
def test_dequantize_equals_gguf_on_synthetic_blocks(fmt):
    raw = gguf_blocks(fmt, n=7, k=768, seed=1)
    want = gguf.quants.dequantize(raw, TYPES[fmt])
    got = kquants.dequantize(fmt, kquants.from_gguf(fmt, raw)).numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@REAL
def test_the_natural_layout_keeps_the_default_ggufs_values_at_its_bytes(default_gguf):
    seen = set()
    for t in default_gguf.values():
        fmt = t.tensor_type.name.lower()
        if fmt not in kquants.FORMATS or fmt in seen:
            continue
        seen.add(fmt)
        raw = np.asarray(t.data)[:64]
        tensors = kquants.from_gguf(fmt, raw)
        got = kquants.dequantize(fmt, tensors).numpy()
        want = gguf.quants.dequantize(raw, t.tensor_type)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), t.name
        assert raw.nbytes <= kquants.nbytes(tensors) <= 1.03 * raw.nbytes, fmt
        weights = raw.shape[0] * raw.shape[1] // kquants.GGUF_BLOCK_BYTES[fmt] * 256
        assert weights * kquants.GGUF_BYTES_PER_WEIGHT[fmt] == raw.nbytes
        assert weights * kquants.BYTES_PER_WEIGHT[fmt] == kquants.nbytes(tensors)
    assert seen == {"q4_k", "q6_k"}  # Q4_K_M has no Q5_K: the synthetic tests cover it


def test_malformed_blocks_are_refused():
    with pytest.raises(ValueError, match="multiple of 144"):
        kquants.from_gguf("q4_k", np.zeros((2, 100), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        kquants.from_gguf("q6_k", np.zeros((2, 210), np.int8))
    with pytest.raises(ValueError, match="unknown K-quant format"):
        kquants.from_gguf("q3_k", np.zeros((2, 110), np.uint8))


@needs_kernels
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", kquants.FORMATS)
def test_a_kernel_reads_the_natural_layouts_bytes(fmt, backend):
    """Where N is a whole number of 16-column blocks, no layout adds a byte (BYTES_PER_WEIGHT)."""
    n, k = 32, 512
    tensors = kquants.from_gguf(fmt, gguf_blocks(fmt, n, k))
    assert kquants.nbytes(tensors) == n * k * kquants.BYTES_PER_WEIGHT[fmt]
    assert kquants.pack(fmt, backend, tensors).nbytes == kquants.nbytes(tensors)


def test_natural_tensors_of_the_wrong_dtype_or_shape_are_refused():
    tensors = kquants.from_gguf("q6_k", gguf_blocks("q6_k", 4, 512))
    assert kquants.check("q6_k", tensors) == (4, 512)
    packed, high, sc, d = tensors
    with pytest.raises(ValueError, match="q6_k sc: torch.uint8"):
        kquants.check("q6_k", (packed, high, sc.view(torch.uint8), d))
    with pytest.raises(ValueError, match=r"q6_k d: .* \(4, 1\), expected .* \(4, 2\)"):
        kquants.pack("q6_k", "avx2", (packed, high, sc, d[:, :1]))
    with pytest.raises(ValueError, match="q4_k takes 5 tensors"):
        kquants.dequantize("q4_k", tensors)
    with pytest.raises(ValueError, match="not whole super-blocks"):
        kquants.check("q6_k", (packed[:, :64], high, sc, d))


@needs_kernels
def test_q4_k_is_the_int4_product_with_narrower_containers():
    tensors = kquants.from_gguf("q4_k", gguf_blocks("q4_k", n=40, k=512, seed=2))
    packed, sc, d, mn, dm = tensors
    int4 = (packed, sc.to(torch.int16), d.float(), mn.to(torch.int16), dm.float())
    x = kernels.QuantizedRows(torch.randn(5, 512), kernel="avx2")
    want = kernel_layouts.reference_gemm(natural(x), x.xs, x.xsum, 4, int4)
    assert_bits_equal(expected("q4_k", x, tensors), want)


@needs_kernels
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", kquants.FORMATS)
def test_every_kernel_computes_the_canonical_product_at_every_row_count(fmt, backend):
    n, k = 37, 768  # N not a multiple of 16: the VNNI kernel's padded block
    tensors = kquants.from_gguf(fmt, gguf_blocks(fmt, n, k, seed=3))
    w = kquants.pack(fmt, backend, tensors)
    x = torch.randn(17, k) * torch.logspace(-3, 3, 17)[:, None]
    for m in range(1, 18):
        rows = kernels.QuantizedRows(x[:m], kernel=backend)
        assert_bits_equal(kquants.gemm(fmt, rows, w), expected(fmt, rows, tensors))


@needs_kernels
@pytest.mark.parametrize("backend", BACKENDS)
def test_q6_k_activation_sums_on_the_stack_or_in_a_work_buffer(backend):
    """Up to kquants.LOCAL_SUMS sums per 16 activations the kernel keeps them on its stack;
    beyond, in the buffer gemm hands in: both give the canonical product."""
    n, k = 20, 8192
    tensors = kquants.from_gguf("q6_k", gguf_blocks("q6_k", n, k, seed=6))
    w = kquants.pack("q6_k", backend, tensors)
    x = torch.randn(17, k)
    for m in (16, 17):  # 16 * 8192 / 16 == LOCAL_SUMS
        rows = kernels.QuantizedRows(x[:m], kernel=backend)
        assert_bits_equal(kquants.gemm("q6_k", rows, w), expected("q6_k", rows, tensors))
    rows = kernels.QuantizedRows(x, kernel=backend)
    monkey = pytest.MonkeyPatch()
    monkey.setattr(kquants, "LOCAL_SUMS", 10**9)  # gemm hands in no buffer: the C side refuses
    try:
        with pytest.raises(RuntimeError, match="no work buffer for 17 rows"):
            kquants.gemm("q6_k", rows, w)
    finally:
        monkey.undo()


@needs_kernels
@pytest.mark.parametrize("threads", [1, 3, 4, 8])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", kquants.FORMATS)
def test_a_row_does_not_depend_on_the_thread_count(fmt, backend, threads):
    before = torch.get_num_threads()
    n, k = 101, 512
    tensors = kquants.from_gguf(fmt, gguf_blocks(fmt, n, k, seed=4))
    w = kquants.pack(fmt, backend, tensors)
    x = torch.randn(9, k)
    torch.set_num_threads(threads)
    try:
        rows = kernels.QuantizedRows(x, kernel=backend)
        got = kquants.gemm(fmt, rows, w)
    finally:
        torch.set_num_threads(before)
    assert_bits_equal(got, expected(fmt, rows, tensors))


@needs_kernels
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", kquants.FORMATS)
def test_extreme_scales_and_levels_stay_exact(fmt, backend):
    """Every level and sub-block scale at the top of its range (the integer paths' largest
    partial sums), activations all at +-127, and float16 super-block scales from the largest
    normal to subnormal, negative and zero."""
    n, k = 24, 512
    scales = np.array([65504.0, -65504.0, 6e-8, -6e-5, 0.0, 1.0] * 8, np.float16)
    raw = gguf_blocks(fmt, n, k, seed=5, d=scales, dmin=scales[::-1])
    size = kquants.GGUF_BLOCK_BYTES[fmt]
    blocks = raw.reshape(-1, size)
    if fmt == "q6_k":
        blocks[::2, :192] = 0xFF  # levels 63
        blocks[1::2, :192] = 0  # levels 0: q - 32 = -32
        blocks[::2, 192:208] = 0x80  # scale -128
        blocks[1::2, 192:208] = 0x7F
    else:
        blocks[:, 4:] = 0xFF  # levels 15 / 31, scales and mins 63
    tensors = kquants.from_gguf(fmt, raw)
    signs = torch.where(
        torch.rand(6, k, generator=torch.Generator().manual_seed(0)) < 0.5, -1.0, 1.0
    )
    x = torch.cat([torch.ones(1, k), -torch.ones(1, k), signs, torch.zeros(1, k)])
    w = kquants.pack(fmt, backend, tensors)
    rows = kernels.QuantizedRows(x, kernel=backend)
    got = kquants.gemm(fmt, rows, w)
    assert torch.isfinite(got).all()
    assert_bits_equal(got, expected(fmt, rows, tensors))


@needs_kernels
@REAL
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "name, count",
    [("blk.0.ffn_gate.weight", None), ("blk.0.ffn_down.weight", None), ("output.weight", 1000)],
)
def test_real_tensors_of_the_default_gguf(default_gguf, name, count, backend):
    t = default_gguf[name]
    fmt = t.tensor_type.name.lower()
    tensors = kquants.from_gguf(fmt, np.asarray(t.data)[:count])
    w = kquants.pack(fmt, backend, tensors)
    x = torch.randn(3, w.k)
    rows = kernels.QuantizedRows(x, kernel=backend)
    got = kquants.gemm(fmt, rows, w)
    assert_bits_equal(got, expected(fmt, rows, tensors))
    # and it is the product of the dequantised weights, up to the activations' int8 rounding
    exact = x @ kquants.dequantize(fmt, tensors).T
    assert (got - exact).abs().max() <= 0.02 * exact.abs().max()


@needs_kernels
def test_weights_of_another_format_or_kernel_are_refused():
    tensors = kquants.from_gguf("q6_k", gguf_blocks("q6_k", 16, 256))
    w = kquants.pack("q6_k", "avx2", tensors)
    with pytest.raises(ValueError, match="gemm of q4_k given q6_k"):
        kquants.gemm("q4_k", kernels.QuantizedRows(torch.randn(1, 256), kernel="avx2"), w)
    if "avx512vnni" in BACKENDS:
        with pytest.raises(ValueError, match="weights for avx2"):
            kquants.gemm("q6_k", kernels.QuantizedRows(torch.randn(1, 256), kernel="avx512vnni"), w)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        kquants.pack("q6_k", "neon", tensors)


@needs_kernels
def test_weights_moved_by_replace_point_the_kernel_at_their_new_tensors():
    """The target moves packed weights into huge pages with ``dataclasses.replace``: the C
    struct must follow the new tensors, never the ones let go."""
    import dataclasses

    from specsplit.cloud.engine import formats
    from specsplit.cloud.engine.gguf_weights import synthetic

    backend = kernel_library.backend()
    w = formats.pack("q6_k", backend, synthetic("q6_k", 48, 512))
    x = kernels.QuantizedRows(torch.randn(3, 512), kernel=backend)
    want = formats.gemm(x, w)
    moved = dataclasses.replace(w, tensors=tuple(t.clone() for t in w.tensors))
    del w
    assert moved.c_weights.ql == moved.tensors[0].data_ptr()
    assert torch.equal(formats.gemm(x, moved), want)
