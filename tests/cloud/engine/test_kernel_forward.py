"""The quantised target on our CPU kernels: right numbers, and rows that never see the batch.

Batch invariance is the property lossless greedy needs in reduced precision: a row's logits must
be bit-for-bit the same whether its session runs alone, one token at a time (cloud-only), or as a
block of k + 1 rows beside other sessions of other lengths (split, batched).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specsplit.cloud.engine import cpu_kernels as kernels
from specsplit.cloud.engine.kernel_layouts import int4_levels, paired, reference_gemm
from specsplit.cloud.engine.quantized import grid_share, quantize_int4, quantize_int8
from specsplit.cloud.engine.ragged import Segment
from specsplit.cloud.engine.target import Open, SessionParams, TargetModel, Verify
from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.sampling import SamplingConfig
from specsplit.shared.tiny import make_tiny_qwen2
from tests.cloud.engine.passes import ragged_passes, stepped_alone

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the AVX2 CPU kernels")

GREEDY = SessionParams(SamplingConfig(), VerificationRule.GREEDY)
BACKENDS = kernels.supported_backends() if kernels.available() else []


def natural(rows: kernels.QuantizedRows) -> torch.Tensor:
    """The rows' int8 values in natural order, whatever the kernel's layout."""
    return paired(rows.xq) if rows.backend == "avx2" else rows.xq


def dequantised(fmt: str, tensors, k: int) -> torch.Tensor:
    """The float weights a quantised tensor stands for (the formats of cpu_kernels.c)."""
    q, sc, d = tensors[:3]
    n = q.shape[0]
    per = k // 32 // d.shape[1]
    scale = (sc.float() * d.repeat_interleave(per, 1))[..., None]  # [N, G, 1]
    if fmt == "int8":
        return (q.float().reshape(n, -1, 32) * scale).reshape(n, k)
    mn, dm = tensors[3:]
    levels = int4_levels(q).float().reshape(n, k // 32, 32)
    offset = (mn.float() * dm.repeat_interleave(per, 1))[..., None]
    return (levels * scale - offset).reshape(n, k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("k", [256, 128, 64])  # 8, 4 and 2 groups per super-block
def test_gemm_equals_the_dequantised_product(fmt, k, backend):
    torch.manual_seed(0)
    w = torch.randn(40, k) * 0.05
    x = torch.randn(5, k)
    tensors = quantize_int8(w) if fmt == "int8" else quantize_int4(w)
    wd = dequantised(fmt, tensors, k)
    assert (wd - w).norm() / w.norm() < (0.01 if fmt == "int8" else 0.15)
    rows = kernels.QuantizedRows(x, kernel=backend)
    per = k // 32 // rows.xs.shape[1]
    xd = natural(rows).float() * rows.xs.repeat_interleave(32 * per, 1)  # x as kernels see it
    got = kernels.gemm(rows, kernels.pack(8 if fmt == "int8" else 4, tensors, backend))
    torch.testing.assert_close(got, xd @ wd.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n, k", [(40, 256), (16, 128), (33, 64), (48, 1536)])
def test_every_kernel_computes_the_canonical_product_bit_for_bit(backend, bits, n, k):
    """The C kernels (AVX2, AVX-512 VNNI) equal the canonical product written in torch, bit for
    bit: so they equal each other, and a target answers the same on every CPU it runs on. Large
    activations and weights push the integer sums towards their bounds."""
    gen = torch.Generator().manual_seed(n * k + bits)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[:, :32] *= 40  # one group far larger than the rest: extreme integer scales
    tensors = quantize_int8(w) if bits == 8 else quantize_int4(w)
    x = torch.randn(7, k, generator=gen) * 3
    x[:, 5] = 100.0  # an outlier: most of the row's values quantise near zero
    rows = kernels.QuantizedRows(x, kernel=backend)
    expected = reference_gemm(natural(rows), rows.xs, rows.xsum, bits, tensors)
    assert torch.equal(kernels.gemm(rows, kernels.pack(bits, tensors, backend)), expected)


def test_the_paired_layout_is_its_own_inverse_and_checks_widths():
    x = torch.arange(2 * 128).reshape(2, 128)
    p = kernels.paired(x)
    assert p[0, :32].tolist() == [*range(16), *range(32, 48)]  # first halves of groups 0, 1
    assert torch.equal(kernels.paired(p), x)
    with pytest.raises(ValueError, match="multiple of 64"):
        kernels.QuantizedRows(torch.zeros(1, 96))
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize_int4(torch.zeros(4, 96))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_row_does_not_depend_on_the_other_rows_or_threads(fmt, backend):
    torch.manual_seed(1)
    w = torch.randn(72, 512) * 0.05
    bits = 8 if fmt == "int8" else 4
    weights = kernels.pack(bits, quantize_int8(w) if bits == 8 else quantize_int4(w), backend)
    x = torch.randn(11, 512)
    together = kernels.gemm(kernels.QuantizedRows(x, kernel=backend), weights)
    for i in range(11):
        alone = kernels.gemm(kernels.QuantizedRows(x[i : i + 1], kernel=backend), weights)
        assert torch.equal(alone[0], together[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        again = kernels.gemm(kernels.QuantizedRows(x, kernel=backend), weights)
        assert torch.equal(again, together)
    finally:
        torch.set_num_threads(threads)


def test_a_model_fits_the_kernels_only_with_heads_of_whole_16_value_steps():
    """The calibration offers the quantised formats only where their engine takes the model:
    projections in whole pairs of groups, and heads a multiple of 16 values wide."""
    from transformers import Qwen2Config

    widths = dict(hidden_size=576, intermediate_size=1152, num_attention_heads=8)
    assert kernels.fits(Qwen2Config(**widths, head_dim=64))
    assert not kernels.fits(Qwen2Config(**widths))  # head_dim 72: the projections would fit
    assert not kernels.fits(Qwen2Config(**widths | {"intermediate_size": 1160}, head_dim=64))


def test_a_4bit_source_is_recognised_and_kept_on_its_grid():
    """Groups dequantised from 4 bits (not all 16 levels used, stored in bfloat16) are found on
    their grid; float weights are not."""
    gen = torch.Generator().manual_seed(2)
    levels = torch.randint(1, 14, (64, 16, 32), generator=gen).float()  # 13 levels of 16
    step = torch.rand(64, 16, 1, generator=gen) * 0.01 + 0.001
    w = (levels * step - 8 * step).reshape(64, 512).bfloat16().float()
    assert grid_share(w) > 0.95
    assert grid_share(torch.randn(64, 512, generator=gen)) < 0.05
    wd = dequantised("int4", quantize_int4(w), 512)
    # on the source's grid, only the 8-bit group scales err (min-max would err up to step/2)
    assert ((wd - w).abs() / step.repeat_interleave(32, 1).reshape(64, 512)).max() < 0.05


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_qwen2(tmp_path_factory.mktemp("k") / "t", seed=3, hidden_size=64)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_logits_are_bitwise_the_same_alone_and_batched(tiny_dir, fmt):
    """Sessions of different lengths advance together in ragged blocks of 1..6 rows; every row's
    logits equal those of the same session stepped alone, one row per pass."""
    target = TargetModel(tiny_dir, device="cpu", calibrate=False, weights=fmt)
    forward = target.forward
    rng = np.random.default_rng(4)
    sequences = [rng.integers(0, 256, size=n).tolist() for n in (40, 3, 17, 28)]

    alone = [stepped_alone(forward, seq) for seq in sequences]
    got = ragged_passes(forward, sequences, rng, 6)
    for sid, logits in enumerate(got):
        assert torch.equal(logits, alone[sid]), sid


@pytest.mark.skipif(len(BACKENDS) < 2, reason="this CPU runs one kernel only")
def test_every_kernel_gives_the_same_logits_for_a_whole_model(tiny_dir, monkeypatch):
    """A target served on another CPU (another kernel) answers bit for bit the same: a session
    that fails over to a replica on another machine continues exactly."""
    logits = []
    try:
        for backend in BACKENDS:
            monkeypatch.setenv(kernels.BACKEND_ENV, backend)
            kernels.backend.cache_clear()
            target = TargetModel(tiny_dir, device="cpu", calibrate=False, weights="int4")
            slot = target.forward.slots.open(1)
            logits.append(target.forward([Segment(slot, [3, 1, 4, 1, 5, 9, 2, 6], True)])[0])
    finally:
        monkeypatch.delenv(kernels.BACKEND_ENV)
        kernels.backend.cache_clear()
    assert all(torch.equal(logits[0], other) for other in logits[1:])


def test_a_kernel_the_cpu_cannot_run_is_refused(monkeypatch):
    monkeypatch.setenv(kernels.BACKEND_ENV, "sse2")
    kernels.backend.cache_clear()
    try:
        with pytest.raises(ValueError, match="not one of"):
            kernels.backend()
    finally:
        monkeypatch.delenv(kernels.BACKEND_ENV)
        kernels.backend.cache_clear()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_split_greedy_equals_cloud_only_greedy(tiny_dir, fmt):
    """Verify rounds with drafts that are partly right give exactly the cloud-only tokens."""
    target = TargetModel(tiny_dir, device="cpu", calibrate=False, weights=fmt)
    prompt, n_new = [5, 9, 2, 77, 31], 24
    target.run([Open(1, prompt, GREEDY)])
    cloud_only = list(prompt)
    while len(cloud_only) < len(prompt) + n_new:
        [out], _ = target.run([Verify(1, len(cloud_only), [cloud_only[-1]])])
        cloud_only.append(out.result.token)
    target.end(1)
    rng = np.random.default_rng(5)
    target.run([Open(2, prompt, GREEDY)])
    split = list(prompt)
    while len(split) < len(prompt) + n_new:
        truth = cloud_only[len(split) : len(split) + 5]
        drafts = [t if rng.random() < 0.7 else int(rng.integers(0, 256)) for t in truth]
        [out], _ = target.run([Verify(2, len(split), [split[-1], *drafts])])
        split += out.result.emitted(drafts)
    assert split[: len(cloud_only)] == cloud_only


def test_quantised_weights_are_kept_and_reloaded(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path))
    first = TargetModel(tiny_dir, device="cpu", calibrate=False, weights="int4")
    assert list((tmp_path / "quantized").glob("*.pt"))

    def no_quantising(*args):
        raise AssertionError("quantised again instead of loading the kept weights")

    monkeypatch.setattr("specsplit.cloud.engine.kernel_forward.quantize_layer", no_quantising)
    again = TargetModel(tiny_dir, device="cpu", calibrate=False, weights="int4")
    logits = []
    for target in (first, again):
        slot = target.forward.slots.open(1)
        logits.append(target.forward([Segment(slot, [1, 2, 3, 4], True)])[0])
    assert torch.equal(*logits)


def _change_a_weight(model_dir) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.model.norm.weight[0] += 1.0
    model.save_pretrained(model_dir)


def test_the_key_follows_content_not_the_path(tiny_dir, tmp_path):
    """A model directory (or a whole cache) copied elsewhere finds its entries; a changed
    weight file does not."""
    import shutil

    from specsplit.cloud.engine import quant_cache

    copy = shutil.copytree(tiny_dir, tmp_path / "elsewhere" / "model")
    assert quant_cache.key(copy, "int4", False) == quant_cache.key(tiny_dir, "int4", False)
    assert quant_cache.key(copy, "int8", False) != quant_cache.key(copy, "int4", False)
    _change_a_weight(copy)
    changed, before = quant_cache.key(copy, "int4", False), quant_cache.key(tiny_dir, "int4", False)
    assert changed != before and changed.split("-")[0] == before.split("-")[0]


def test_a_new_entry_replaces_the_outdated_ones_of_its_model_and_format(
    tiny_dir, tmp_path, monkeypatch
):
    """An entry is ~1.2 GB for the real target: a changed quantiser or weight file must not
    leave the old one behind, and other models' or formats' entries must stay."""
    from specsplit.cloud.engine import quant_cache

    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path))
    TargetModel(tiny_dir, device="cpu", calibrate=False, weights="int4")
    TargetModel(tiny_dir, device="cpu", calibrate=False, weights="int8")
    kept = {p.name for p in (tmp_path / "quantized").glob("*.pt")}
    assert len(kept) == 2
    int4 = quant_cache.key(tiny_dir, "int4", False)
    outdated = tmp_path / "quantized" / f"{int4.split('-')[0]}-000000000000.pt"
    outdated.write_bytes(b"an entry of an older quantiser")
    _change_a_weight(tiny_dir)  # a changed weight file: a new key for the same slot
    TargetModel(tiny_dir, device="cpu", calibrate=False, weights="int4")
    after = {p.name for p in (tmp_path / "quantized").glob("*.pt")}
    assert not outdated.exists() and f"{int4}.pt" not in after
    assert len(after) == 2 and len(after & kept) == 1  # int8's stays


def test_the_kernels_compute_the_float_models_logits(tiny_dir, tmp_path):
    """The fused norm + quantisation, the in-place rotary embedding and the matmuls together
    stay close to the float model (transformers' modules) at every position. int8: its error
    on this random tiny model is ~5%, at most ~11% (int4's is ~35%, too coarse to tell a wrong
    norm or rotation apart); both formats share every op but the matmuls' inner loop."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    gen = torch.Generator().manual_seed(7)
    for name, p in model.named_parameters():  # norms start at ones: make them matter
        if "norm" in name:
            p.data = 0.5 + torch.rand(p.shape, generator=gen)
    model.save_pretrained(tmp_path / "normed")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tiny_dir / f).exists():
            (tmp_path / "normed" / f).write_bytes((tiny_dir / f).read_bytes())
    prompt = np.random.default_rng(6).integers(0, 256, size=24).tolist()
    logits = {}
    for weights in ("float", "int8"):
        target = TargetModel(tmp_path / "normed", device="cpu", calibrate=False, weights=weights)
        slot = target.forward.slots.open(1)
        logits[weights] = target.forward([Segment(slot, prompt, True)])[0]
    ref, got = logits["float"], logits["int8"]
    err = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert err.mean() < 0.08 and err.max() < 0.2, err
