"""GGUF's block-32 formats (Q8_0, Q5_0, Q4_0) on our kernels: the file's values and bytes kept,
and both kernels equal to the canonical product bit for bit (cpu_block_quants.c's header)."""

from __future__ import annotations

import ctypes
import dataclasses
import re
from functools import cache

import gguf
import numpy as np
import pytest
import torch

from specsplit.cloud.engine import block_quants as bq
from specsplit.cloud.engine import cpu_kernels as kernels
from specsplit.cloud.engine import kernel_library
from specsplit.shared.build_steps import cache_dir
from specsplit.shared.weights.sources import DRAFT_DEFAULT
from tests.cloud.engine.conftest import BACKENDS, natural, needs_kernels

pytestmark = needs_kernels

QTYPE = {
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q5_0": gguf.GGMLQuantizationType.Q5_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
}
DRAFT_GGUF = cache_dir() / "gguf" / DRAFT_DEFAULT.gguf_file
# float16 scales at the edges: largest, -largest, smallest subnormal, smallest normal, zero
EXTREME_D = np.array([65504.0, -65504.0, 2.0**-24, 2.0**-14, 0.0], dtype=np.float16)


def random_blocks(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """[n, k / 32 blocks] of random bytes (every level, q8_0's -128 too), scales ~1e-2 with
    every EXTREME_D among them."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // 32, bq.BLOCK_BYTES[fmt]), dtype=np.uint8)
    d = (rng.standard_normal((n, k // 32)) * 1e-2).astype(np.float16)
    d.reshape(-1)[: len(EXTREME_D)] = EXTREME_D
    blocks[..., :2] = d[..., None].view(np.uint8).reshape(n, k // 32, 2)
    return blocks.reshape(n, -1)


@cache
def _draft_tensors(rows: int) -> dict[str, np.ndarray]:
    """The first ``rows`` rows' blocks of the draft GGUF's first layer tensor of each block-32
    format it has (reading the file's index takes a while: once per session)."""
    found: dict[str, np.ndarray] = {}
    for t in gguf.GGUFReader(DRAFT_GGUF).tensors:
        fmt = next((f for f, q in QTYPE.items() if q == t.tensor_type), None)
        if fmt and fmt not in found and t.name.startswith("blk.") and t.data.shape[0] >= rows:
            found[fmt] = np.array(t.data[:rows])
    return found


def draft_tensor(fmt: str) -> np.ndarray:
    """100 rows (a whole number of neither kernel's column blocks) of a real ``fmt`` tensor."""
    if not DRAFT_GGUF.is_file():
        pytest.skip(f"{DRAFT_GGUF} is not cached")
    tensors = _draft_tensors(100)
    if fmt not in tensors:
        pytest.skip(f"the draft GGUF has no {fmt} tensor")
    return tensors[fmt]


@pytest.mark.parametrize("fmt", bq.FORMATS)
def test_the_natural_layout_keeps_the_blocks_values_and_bytes(fmt):
    raw = random_blocks(fmt, 24, 896, seed=1)
    tensors = bq.from_gguf(fmt, raw)
    expected = gguf.quants.dequantize(raw, QTYPE[fmt])
    assert np.array_equal(bq.dequantize(fmt, tensors).numpy(), expected)
    assert sum(t.numel() * t.element_size() for t in tensors) == raw.nbytes
    assert raw.nbytes == 24 * 896 * bq.BYTES_PER_WEIGHT[fmt]


@pytest.mark.realmodels
@pytest.mark.parametrize("fmt", ["q8_0", "q5_0"])
def test_real_draft_rows_dequantise_as_gguf_does(fmt):
    raw = draft_tensor(fmt)
    expected = gguf.quants.dequantize(raw, QTYPE[fmt])
    assert np.array_equal(bq.dequantize(fmt, bq.from_gguf(fmt, raw)).numpy(), expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", bq.FORMATS)
@pytest.mark.parametrize("k", [896, 256, 64])  # 4, 8 and 2 groups per super-block
def test_every_kernel_computes_the_canonical_product_bit_for_bit(backend, fmt, k):
    """Rows 1..17 (every tile remainder, several tiles), N = 45 (not whole vectors), scales at
    float16's edges, every level; activations with an outlier."""
    tensors = bq.from_gguf(fmt, random_blocks(fmt, 45, k, seed=k))
    weights = bq.pack(fmt, backend, tensors)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(17, k, generator=gen) * 3
    x[:, 5] = 100.0  # most of the row's values quantise near zero
    for m in range(1, 18):
        rows = kernels.QuantizedRows(x[:m], kernel=backend)
        expected = bq.reference_gemm(fmt, natural(rows), rows.xs, rows.xsum, tensors)
        assert torch.equal(bq.gemm(fmt, rows, weights), expected), f"{m} rows"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", bq.FORMATS)
def test_the_product_is_the_same_at_every_thread_count(backend, fmt):
    tensors = bq.from_gguf(fmt, random_blocks(fmt, 200, 896, seed=2))
    weights = bq.pack(fmt, backend, tensors)
    rows = kernels.QuantizedRows(torch.randn(9, 896), kernel=backend)
    expected = bq.reference_gemm(fmt, natural(rows), rows.xs, rows.xsum, tensors)
    threads = torch.get_num_threads()
    try:
        for n in (1, 3, 4, 8):
            torch.set_num_threads(n)
            assert torch.equal(bq.gemm(fmt, rows, weights), expected), f"{n} threads"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.realmodels
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["q8_0", "q5_0"])
def test_a_real_draft_tensor_is_computed_bit_for_bit(backend, fmt):
    tensors = bq.from_gguf(fmt, draft_tensor(fmt))  # K = 896: super-blocks of 128
    x = torch.randn(9, 896, generator=torch.Generator().manual_seed(3))
    rows = kernels.QuantizedRows(x, kernel=backend)
    expected = bq.reference_gemm(fmt, natural(rows), rows.xs, rows.xsum, tensors)
    assert torch.equal(bq.gemm(fmt, rows, bq.pack(fmt, backend, tensors)), expected)


@pytest.mark.parametrize("fmt", bq.FORMATS)
def test_the_canonical_product_is_the_dequantised_one(fmt):
    """The product of the weights and activations the quantised values stand for."""
    w = np.random.default_rng(4).standard_normal((40, 256)).astype(np.float32) * 0.05
    tensors = bq.from_gguf(fmt, gguf.quants.quantize(w, QTYPE[fmt]))
    rows = kernels.QuantizedRows(torch.randn(5, 256), kernel="avx2")
    xd = natural(rows).float() * rows.xs.repeat_interleave(256, 1)  # one super-block a row
    got = bq.reference_gemm(fmt, natural(rows), rows.xs, rows.xsum, tensors)
    torch.testing.assert_close(got, xd @ bq.dequantize(fmt, tensors).T, rtol=1e-4, atol=1e-4)


def test_bad_blocks_and_mismatched_weights_are_refused():
    raw = random_blocks("q5_0", 4, 64, seed=5)
    with pytest.raises(ValueError, match="unknown block-32 format"):
        bq.from_gguf("q6_k", raw)
    with pytest.raises(ValueError, match="2-D uint8"):
        bq.from_gguf("q5_0", raw.astype(np.int16))
    with pytest.raises(ValueError, match="not whole blocks of 22 bytes"):
        bq.from_gguf("q5_0", raw[:, :40])
    bad = raw.copy()
    bad[2, 22:24] = np.array([np.inf], dtype=np.float16).view(np.uint8)
    with pytest.raises(ValueError, match=r"row 2, group 1\) has a non-finite scale"):
        bq.from_gguf("q5_0", bad)
    qs, qh, d = bq.from_gguf("q5_0", raw)
    with pytest.raises(ValueError, match="q4_0 natural layout"):
        bq.pack("q4_0", "avx2", (qs, qh, d))
    with pytest.raises(ValueError, match="float16 scales"):
        bq.pack("q5_0", "avx2", (qs, qh, d.float()))
    with pytest.raises(ValueError, match="multiple of 64"):
        bq.pack("q5_0", "avx2", bq.from_gguf("q5_0", random_blocks("q5_0", 4, 96, seed=5)))
    weights = bq.pack("q5_0", "avx2", (qs, qh, d))
    rows = kernels.QuantizedRows(torch.randn(2, 64), kernel="avx2")
    with pytest.raises(ValueError, match="do not match"):
        bq.gemm("q4_0", rows, weights)
    with pytest.raises(ValueError, match="bytes per stream"):
        bq.gemm("q5_0", rows, dataclasses.replace(weights, n=9))


def test_the_ctypes_table_matches_the_header():
    """The block-32 functions' prototypes in cpu_kernels.h, as ctypes reads them."""
    header = kernel_library.HEADER.read_text()
    ctype = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
    for name in ("specsplit_block_gemm", "specsplit_block_gemm_vnni"):
        match = re.search(rf"void {name}\(([^)]*)\);", header)
        assert match, f"{name} is not declared in {kernel_library.HEADER.name}"
        params = [" ".join(p.split()) for p in match.group(1).split(",")]
        want = [ctypes.c_void_p if "*" in p else ctype[p.rsplit(" ", 1)[0]] for p in params]
        assert kernel_library._SIGNATURES[name] == want
