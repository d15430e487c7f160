"""How the target's weights are served: the format (``--weights``) and float dtype (``--dtype``).

- ``float``: the model's own modules in torch, in ``dtype`` (float32 by default: with
  oneDNN-packed linears on CPU). The reference; equal to transformers. float32 on a GPU too:
  docs/gpu.md measured bfloat16 there flipping greedy tokens between a session served alone and
  the same session batched or verified in blocks (8 and 16 of 16 sessions; float32: 0 of 48),
  so bfloat16 is asked for with ``--dtype bfloat16``, never chosen.
- ``gguf``: a GGUF source's own blocks on our batch-invariant CPU kernels, each tensor at the
  file's width (``cloud.engine.gguf_weights``).
- ``int8`` / ``int4``: weight-only quantised projections on our batch-invariant CPU kernels
  (``cloud.engine.kernel_forward``); ``int4`` keeps a 4-bit source's 4-bit tensors on their own
  groups and its finer ones in int8 (``cloud.engine.quantized``).
- ``auto``: on a GPU, ``float``; on a CPU, a calibration at load times one layer's MLP in every
  candidate this machine can run, at one row (a cloud-only step) and at nine (a verify block),
  and keeps the fastest; the table and the choice are logged. The quantised candidate is gguf
  where the model has a GGUF source, else int4 for a 4-bit source and int8 otherwise (auto never
  serves a float model in 4 bits). Where the kernels cannot serve the model
  (``kernels_misfit``: no kernels on this machine, or widths they do not read), auto serves
  float and says why in a WARNING: it never fails a model the float path can serve.
An explicit ``--dtype`` other than auto asks for the float path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHTS = ("auto", "float", "gguf", "int8", "int4")
CALIBRATION_ROWS = (1, 9)


def pick_device(requested: str | None = None) -> torch.device:
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: float32 on every device (bfloat16 is not lossless under batching: docs/gpu.md)."""
    if name == "auto":
        return torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {name!r}") from None


def check_weights(name: str) -> str:
    if name not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {name!r}")
    return name


def _best_ms(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _mlp_timer(fmt: str, hidden: int, intermediate: int, gguf_mlp: tuple[str, str] | None = None):
    """A function rows -> ms for one layer's MLP projections (gate/up fused, down) in ``fmt``
    (``gguf``: in the formats ``gguf_mlp`` names, the file's gate/up and down ones)."""
    torch.manual_seed(0)
    up = torch.randn(2 * intermediate, hidden) * 0.02
    down = torch.randn(hidden, intermediate) * 0.02
    if fmt == "gguf":
        from specsplit.cloud.engine import cpu_kernels as kernels
        from specsplit.cloud.engine import formats, kernel_library
        from specsplit.cloud.engine.gguf_weights import synthetic

        backend = kernel_library.backend()
        up_fmt, down_fmt = gguf_mlp
        wu = formats.pack(up_fmt, backend, synthetic(up_fmt, 2 * intermediate, hidden))
        wd = formats.pack(down_fmt, backend, synthetic(down_fmt, hidden, intermediate))

        def run(x):
            h = formats.gemm(kernels.QuantizedRows(x), wu)[:, :intermediate]
            return formats.gemm(kernels.QuantizedRows(h.contiguous()), wd)

    elif fmt in ("int8", "int4"):
        from specsplit.cloud.engine import cpu_kernels as kernels
        from specsplit.cloud.engine.quantized import quantize_int4, quantize_int8

        quantize, bits = (quantize_int8, 8) if fmt == "int8" else (quantize_int4, 4)
        wu, wd = kernels.pack(bits, quantize(up)), kernels.pack(bits, quantize(down))

        def run(x):
            h = kernels.gemm(kernels.QuantizedRows(x), wu)[:, :intermediate]
            return kernels.gemm(kernels.QuantizedRows(h.contiguous()), wd)

    else:
        from specsplit.cloud.engine.packed_linear import PackedLinear

        dtype = DTYPES[fmt]
        lin_up = torch.nn.Linear(hidden, 2 * intermediate, bias=False, dtype=dtype)
        lin_down = torch.nn.Linear(intermediate, hidden, bias=False, dtype=dtype)
        lin_up.weight.data, lin_down.weight.data = up.to(dtype), down.to(dtype)
        if dtype == torch.float32 and torch.backends.mkldnn.is_available():
            lin_up, lin_down = PackedLinear(lin_up), PackedLinear(lin_down)

        def run(x):
            return lin_down(lin_up(x.to(dtype))[:, :intermediate])

    def timed(rows: int) -> float:
        x = torch.randn(rows, hidden)
        with torch.inference_mode():
            return _best_ms(lambda: run(x))

    return timed


def calibrate(
    config, quantized: str | None, gguf_mlp: tuple[str, str] | None = None
) -> dict[str, dict[int, float]]:
    """ms of one layer's MLP by format and rows, for each candidate on this CPU."""
    candidates = ["float32", "bfloat16", *([quantized] if quantized else [])]
    table = {}
    for fmt in candidates:
        timed = _mlp_timer(fmt, config.hidden_size, config.intermediate_size, gguf_mlp)
        table[fmt] = {rows: timed(rows) for rows in CALIBRATION_ROWS}
    return table


def kernels_misfit(config) -> str | None:
    """Why the CPU kernels cannot serve a model of ``config`` on this machine, or None."""
    from specsplit.cloud.engine import cpu_kernels, decoder, kernel_library

    reason = kernel_library.unavailable()
    if reason is None and not cpu_kernels.fits(config):
        reason = (
            f"its widths (hidden {config.hidden_size}, intermediate "
            f"{config.intermediate_size}, {config.num_attention_heads} heads of "
            f"{decoder.head_dim(config)}) are not what the CPU kernels read (multiples of "
            f"{cpu_kernels.PAIR}, heads of multiples of 16)"
        )
    return reason


def choose(
    weights: str,
    dtype: str,
    device: torch.device,
    config,
    four_bit: Callable[[], bool],
    gguf_path=None,
) -> tuple[str, torch.dtype]:
    """(format, float dtype): ``float`` with the dtype to run in, or ``gguf``/``int8``/``int4``
    (whose activations are float32). Calibrates when both are auto on a CPU. ``four_bit``:
    whether the source sits on 4-bit grids (``quantized.four_bit_source``), asked only where auto
    considers the kernels, since models they cannot read cannot be probed either. ``gguf_path``:
    the model's GGUF source, if it has one (``gguf_weights.source_gguf``)."""
    check_weights(weights)
    if weights == "gguf" and gguf_path is None:
        raise ValueError(
            "--weights gguf serves a GGUF source's blocks: this target was not converted from a "
            "GGUF and holds no single *.gguf file"
        )
    if weights != "auto":
        if weights != "float" and device.type != "cpu":
            raise ValueError(f"--weights {weights} runs on CPU kernels; on {device} use float")
        return weights, torch.float32 if weights != "float" else resolve_dtype(dtype, device)
    if dtype != "auto" or device.type != "cpu":
        return "float", resolve_dtype(dtype, device)
    misfit = kernels_misfit(config)
    if misfit is not None:
        from specsplit.cloud.engine.kernel_library import SLOW_FALLBACK

        log.warning("--weights auto serves float: %s; %s", misfit, SLOW_FALLBACK)
    gguf_mlp = None
    if misfit is None and gguf_path is not None:
        from specsplit.cloud.engine.gguf_weights import mlp_formats

        gguf_mlp = mlp_formats(gguf_path, config)
    if misfit is not None:
        quantized = None
    elif gguf_mlp is not None:
        quantized = "gguf"
    else:
        quantized = "int4" if four_bit() else "int8"
    table = calibrate(config, quantized, gguf_mlp)
    best = min(table, key=lambda fmt: sum(table[fmt].values()))
    log.info(
        "target weights by calibration (one layer's MLP, ms at %s rows): %s -> %s",
        "/".join(map(str, CALIBRATION_ROWS)),
        {fmt: [round(ms, 2) for ms in by_rows.values()] for fmt, by_rows in table.items()},
        best,
    )
    return ("float", DTYPES[best]) if best in DTYPES else (best, torch.float32)
