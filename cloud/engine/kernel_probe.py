"""What ``specsplit-cloud kernels`` reports: the CPU kernels built and loaded ahead of serving,
the backend a target would use, the CPU features seen, and the bytes a second one gemm streams.

The probe times one row through an int4 matrix much larger than any CPU's last-level cache
(~80 MB in the kernel's layout), as a one-row step reads its weights: memory-bound, so its
bytes/second is what bounds the target's tokens/second (``weight bytes per pass / rate``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specsplit.cloud.engine import cpu_kernels as kernels
from specsplit.cloud.engine import kernel_library
from specsplit.cloud.engine.kernel_layouts import LANES

# Linux's names for the features the kernels use (/proc/cpuinfo), in the order reported.
FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni")
PROBE_N, PROBE_K = 32768, 4096  # int4: 64 MiB of weights, ~80 MB with their scales
PROBE_S = 0.5  # seconds of timed gemms (the last one may end past it)


@dataclass(frozen=True)
class Report:
    library: str  # the built library's path
    built_s: float | None  # seconds its build took now; None: it was built already
    compiler: str  # the first line of its --version
    cpu: str  # the CPU's model name
    features: tuple[str, ...]  # of FEATURES, those the CPU has (empty: flags unknown)
    backend: str  # the matmul kernel a target would use (kernel_library.backend())
    backends: tuple[str, ...]  # those this CPU runs
    threads: int
    gemm_bytes: int  # weight bytes one probe gemm reads
    gemm_s: float  # its best time

    @property
    def bytes_per_s(self) -> float:
        return self.gemm_bytes / self.gemm_s


def _int4_weights(n: int, k: int) -> tuple[torch.Tensor, ...]:
    """Natural-layout int4 weights (``kernel_layouts``) of constant levels and scales: the
    probe times reads, not values."""
    groups, blocks = k // kernels.GROUP, k // (kernels.GROUP * kernels.per_block(k))
    packed = torch.full((n, k // 2), 0x5A, dtype=torch.uint8)
    sc = torch.full((n, groups), 1000, dtype=torch.int16)
    mn = torch.full((n, groups), 300, dtype=torch.int16)
    d, dm = torch.full((n, blocks), 1e-4), torch.full((n, blocks), 1e-5)
    return packed, sc, d, mn, dm


def gemm_rate(n: int = PROBE_N, k: int = PROBE_K, seconds: float = PROBE_S) -> tuple[int, float]:
    """(weight bytes, best seconds) of one row times an int4 [n, k] matrix on this backend.
    The matrix is one block of 16 columns packed and repeated: every layout's tensors lead with
    the columns (or blocks of 16 of them), so this is the layout that packing n columns gives,
    in a fraction of its time."""
    block = kernels.pack(4, _int4_weights(LANES, k))
    tensors = tuple(t.repeat(n // LANES, *[1] * (t.dim() - 1)) for t in block.tensors)
    w = kernels.KernelWeights(block.backend, 4, n // LANES * LANES, k, tensors)
    x = kernels.QuantizedRows(torch.randn(1, k, generator=torch.Generator().manual_seed(1)))
    kernels.gemm(x, w)  # pages the weights in
    best, spent = float("inf"), 0.0
    while spent < seconds:
        t0 = time.perf_counter()
        kernels.gemm(x, w)
        took = time.perf_counter() - t0
        best, spent = min(best, took), spent + took
    return w.nbytes, best


def run() -> Report:
    """Builds the library if it is not built, loads it and times a gemm; raises
    ``kernel_library.KernelsUnavailable`` (with the reason) where the kernels cannot run."""
    path, built_s = kernel_library.build(ahead=True)
    kernel_library.library()
    flags = kernel_library.cpu_features() or frozenset()
    nbytes, best = gemm_rate()
    return Report(
        library=str(path),
        built_s=built_s,
        compiler=kernel_library.compiler().version.splitlines()[0],
        cpu=kernel_library.cpu_model(),
        features=tuple(f for f in FEATURES if f in flags),
        backend=kernel_library.backend(),
        backends=tuple(kernel_library.supported_backends()),
        threads=torch.get_num_threads(),
        gemm_bytes=nbytes,
        gemm_s=best,
    )
