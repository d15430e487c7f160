"""What the engine's tests share: the tiny target (``target_dir``) and greedy session parameters
for the tests that drive ``TargetModel``; for the kernel tests, the skip where this machine
cannot run the CPU kernels, the kernels it runs, and activations in natural order. Test modules
import the constants from here (``tests.cloud.engine.conftest``)."""

from __future__ import annotations

import pytest
import torch

from specsplit.cloud.engine import kernel_library
from specsplit.cloud.engine.cpu_kernels import QuantizedRows
from specsplit.cloud.engine.kernel_layouts import paired
from specsplit.cloud.engine.target import SessionParams
from specsplit.shared.acceptance import VerificationRule
from specsplit.shared.sampling import SamplingConfig
from specsplit.shared.tiny import make_tiny_qwen2

GREEDY = SessionParams(SamplingConfig(), VerificationRule.GREEDY)

needs_kernels = pytest.mark.skipif(
    not kernel_library.available(), reason="needs the AVX2 CPU kernels"
)
BACKENDS = kernel_library.supported_backends() if kernel_library.available() else []


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny Qwen2 target (seed 0), made once per test module."""
    return make_tiny_qwen2(tmp_path_factory.mktemp("t") / "target", seed=0)


def natural(rows: QuantizedRows) -> torch.Tensor:
    """The rows' int8 activations in natural order, whatever their kernel's layout."""
    return paired(rows.xq) if rows.backend == "avx2" else rows.xq
