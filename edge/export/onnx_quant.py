"""Weight layouts of com.microsoft MatMulNBits, as the edge's ONNX graph stores its Linears.

numpy only. ``quantize_blocks`` is the 8-bit layout (symmetric, one scale per block);
``quantize_blocks_4bit`` the 4-bit one (asymmetric, integer zero points). See
``edge.export.onnx_graph`` for which Linear gets which.
"""

from __future__ import annotations

import numpy as np

# Inputs per weight scale (MatMulNBits block_size), 8-bit and 4-bit alike. 128, not 32: on one
# AMD EPYC core (Qwen2.5-Coder-0.5B) the int4 step is 28% shorter and the prefill 29% faster, at
# the same teacher-forced agreement with the target (README.md, "Draft precision").
DEFAULT_BLOCK = 128
BLOCK_SIZES = (32, 64, 128)  # the block sizes an export may choose (edge.export.exporter)


def block_for(k: int, block: int) -> int:
    """The block size of a 4-bit Linear with ``k`` inputs: ``block``, or where that does not
    divide ``k`` the largest of ``BLOCK_SIZES`` below it that does (4-bit blocks are not
    padded; every supported family's widths are multiples of 128, tiny test models' of 32)."""
    for size in sorted((b for b in BLOCK_SIZES if b <= block), reverse=True):
        if k % size == 0:
            return size
    raise ValueError(f"4-bit weights need an input width divisible by {min(BLOCK_SIZES)}, not {k}")


def quantize_blocks(weight: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """MatMulNBits' 8-bit layout: symmetric int8 per block of ``block`` inputs, stored +128.

    weight [n, k] → (uint8 [n, ceil(k/block), block], float32 scales [n * ceil(k/block)]).
    Dequantised: (q - 128) * scale, 128 being the op's default zero point for 8 bits.
    """
    n, k = weight.shape
    n_blocks = -(-k // block)
    padded = np.zeros((n, n_blocks * block), np.float32)
    padded[:, :k] = weight
    padded = padded.reshape(n, n_blocks, block)
    scale = np.abs(padded).max(axis=-1) / 127.0  # [n, n_blocks]
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(padded / scale[..., None]), -127, 127) + 128
    return q.astype(np.uint8), scale.astype(np.float32).reshape(-1)


def quantize_blocks_4bit(
    weight: np.ndarray, block: int, tries: int = 9
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MatMulNBits' 4-bit layout, asymmetric: w ~ scale * (q - zero), q and zero in 0..15.

    weight [n, k] -> (uint8 [n, k/block, block/2]: element 2j low nibble, 2j+1 high;
    float32 scales [n * k/block]; uint8 zero points [n, ceil(k/block / 2)], packed the same).
    Integer zero points keep ORT on its int8-compute kernels (float ones fall back to a path
    ~50x slower). Each block's scale is the least-squares best of ``tries`` around min-max.
    """
    n, k = weight.shape
    if k % block:
        raise ValueError(f"4-bit weights need an input width divisible by {block}, not {k}")
    w = weight.reshape(n, k // block, block).astype(np.float32)
    lo, hi = w.min(axis=-1), w.max(axis=-1)
    span = np.maximum(hi - lo, 1e-12)
    best = (np.full(lo.shape, np.inf, np.float32), None, None, None)
    for factor in np.linspace(0.8, 1.0, tries):  # a narrower grid clips the extremes a little
        scale = span * factor / 15
        zero = np.clip(np.rint(-lo / scale), 0, 15)
        q = np.clip(np.rint(w / scale[..., None] + zero[..., None]), 0, 15)
        err = ((scale[..., None] * (q - zero[..., None]) - w) ** 2).sum(axis=-1)
        better = err < best[0]
        if best[1] is None:
            best = (err, q, scale, zero)
        else:
            best = (
                np.where(better, err, best[0]),
                np.where(better[..., None], q, best[1]),
                np.where(better, scale, best[2]),
                np.where(better, zero, best[3]),
            )
    _, q, scale, zero = best
    q = q.astype(np.uint8)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)  # [n, blocks, block/2]
    z = zero.astype(np.uint8)
    if z.shape[1] % 2:
        z = np.concatenate([z, np.zeros((n, 1), np.uint8)], axis=1)
    zeros = z[:, 0::2] | (z[:, 1::2] << 4)  # [n, ceil(blocks / 2)]
    return packed, scale.astype(np.float32).reshape(-1), zeros
