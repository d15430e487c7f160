"""Weight-only quantised linears for the target on CPU (int8 and int4, groups of 32).

Formats (the kernels' contract, ``cpu_kernels.c``), along the input dimension in groups of 32:
- int8: ``w = scale * q``, q in [-127, 127], scale = amax / 127 (symmetric, as llama.cpp's Q8_0);
- int4: ``w = scale * q - offset``, q in [0, 15] (asymmetric: one Q4_K sub-block is exactly such
  a group, so a Q4_K_M GGUF's 4-bit tensors are served on their own grid).

``Weights`` says which format each projection gets. ``int4`` never quantises a tensor harder than
its source: when some projections already sit on a 4-bit grid (the default pair, dequantised
from Q4_K_M), the projections that do not (Q4_K_M keeps some in 6 bits) are served in int8; a
float source has no 4-bit tensor and is quantised to 4 bits throughout. The LM head is int8.
"""

from __future__ import annotations

import logging

import torch

from specsplit.cloud.engine import cpu_kernels as kernels
from specsplit.cloud.engine import decoder, formats, kernel_library

log = logging.getLogger(__name__)

GROUP = kernels.GROUP
INT4_SCALE_TOP = 4095  # int4 group scales and offsets: 12-bit integers (cpu_kernels.c)
ON_GRID = 0.9  # share of groups on a 4-bit grid for a tensor to count as 4-bit (float: ~0)


def _groups(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    kernels.check_width(k)
    return w.float().reshape(n, k // GROUP, GROUP)


def _two_level(s: torch.Tensor, k: int, top: int) -> tuple[torch.Tensor, ...]:
    """Group scales s [N, G] (>= 0) -> (integer scales [N, G] in [0, top], super-block scales
    [N, B], the scales they make, d * sc, [N, G]): uint8 for top 255, int16 (< 2^15) else."""
    n, groups = s.shape
    blocks = s.reshape(n, groups // kernels.per_block(k), -1)  # [N, B, P]
    d = blocks.amax(-1) / top
    sc = torch.round(blocks / d.clamp(min=1e-30)[..., None]).clamp(0, top)
    sc = torch.where((blocks > 0) & (sc == 0), 1.0, sc)  # a group with weights keeps a scale
    made = (sc * d[..., None]).reshape(n, groups)
    integer = sc.to(torch.uint8 if top == 255 else torch.int16).reshape(n, groups)
    return integer.contiguous(), d.contiguous(), made


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[N, K] float -> (q [N, K] int8, sc [N, G] uint8, d [N, B] float32)."""
    g = _groups(w)
    sc, d, scale = _two_level(g.abs().amax(-1) / 127, w.shape[1], 255)
    q = torch.round(g / scale.clamp(min=1e-30)[..., None]).clamp(-127, 127)
    return q.to(torch.int8).reshape(w.shape), sc, d


def _grid(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group of g [N, G, 32]: (lowest level, step, on a 4-bit grid?). A group dequantised
    from 4 bits takes at most 16 levels lo + j * step, not always the extreme ones, so its step
    is its range over a whole number of its smallest gaps. Other groups get (max - min) / 15."""
    lo, hi = g.amin(-1), g.amax(-1)
    step = (hi - lo) / 15
    fits = _on_grid(g, lo, step)
    todo = ~fits  # groups that use all 16 levels fit already; sort only the others
    if todo.any():
        rest = g[todo]  # [T, 32]
        # bfloat16 storage moved each value by up to 2^-9 of it: gaps below that are one level
        gaps = rest.sort(-1).values.diff(dim=-1)
        tiny = (rest.abs().amax(-1) * 2.0**-7)[..., None]
        gap = torch.where(gaps > tiny, gaps, torch.inf).amin(-1)
        span = hi[todo] - lo[todo]
        steps = torch.round(span / gap)
        rest_step = span / steps.clamp(min=1)
        ok = torch.isfinite(gap) & (steps <= 15) & _on_grid(rest, lo[todo], rest_step)
        step[todo] = torch.where(ok, rest_step, step[todo])
        fits[todo] = ok
    return lo, step, fits


def _on_grid(g: torch.Tensor, lo: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    level = (g - lo[..., None]) / step.clamp(min=1e-30)[..., None]
    return (level - torch.round(level)).abs().amax(-1) <= 0.25


def quantize_int4(w: torch.Tensor, recover_grid: bool = True) -> tuple[torch.Tensor, ...]:
    """[N, K] float -> (packed [N, K / 2] uint8, sc [N, G] int16, d [N, B], mn [N, G] int16,
    dm [N, B]):
    w = d * sc * q - dm * mn, offsets >= 0 (a group's zero level at or below 0, as Q4_K's).
    ``recover_grid``: find each group's own 4-bit grid (a 4-bit source) rather than min-max."""
    g = _groups(w)
    if recover_grid:
        lo, step, _ = _grid(g)
    else:
        lo = g.amin(-1)
        step = (g.amax(-1) - lo) / 15
    step = step.clamp(min=1e-30)
    # move the zero level down to <= 0 where the group has levels to spare
    spare = 15 - torch.round((g.amax(-1) - lo) / step)
    lo = lo - step * torch.minimum(spare, torch.ceil(lo.clamp(min=0) / step))
    sc, d, scale = _two_level(step, w.shape[1], INT4_SCALE_TOP)
    mn, dm, offset = _two_level((-lo).clamp(min=0), w.shape[1], INT4_SCALE_TOP)
    q = torch.round((g + offset[..., None]) / scale.clamp(min=1e-30)[..., None]).clamp(0, 15)
    q = q.to(torch.uint8)
    packed = q[..., : GROUP // 2] | (q[..., GROUP // 2 :] << 4)  # byte j: j low, j + 16 high
    n, k = w.shape
    return packed.reshape(n, k // 2).contiguous(), sc, d, mn, dm


def grid_share(w: torch.Tensor, rows: int = 256) -> float:
    """The share of groups of 32 (in w's first ``rows`` rows) whose values sit on a 4-bit grid:
    near 1 for weights dequantised from 4 bits (Q4_K_M's 4-bit tensors), ~0 for float ones."""
    return float(_grid(_groups(w[:rows]))[2].float().mean())


class QuantLinear:
    """y = x @ [W_1; W_2; ...].T + b: the linears that read one input (q/k/v, gate/up) fused
    into one output. Each part is one matmul over consecutive linears of one weight format:
    (format, tensors) in the natural layout (``cloud.engine.formats``), until ``pack`` puts them
    in the kernel's layout for ``__call__``."""

    def __init__(self, parts: list[tuple[str, tuple[torch.Tensor, ...]]], bias=None):
        self.parts, self.bias = parts, bias
        self.formats = [fmt for fmt, _ in parts]
        self.kernel_parts: list[kernels.KernelWeights] = []

    def pack(self, kernel: str | None = None) -> None:
        """Puts the weights in the layout of ``kernel`` [this CPU's] and lets the natural ones
        go (``state`` is no longer available)."""
        backend = kernel or kernel_library.backend()
        self.kernel_parts = [formats.pack(fmt, backend, tensors) for fmt, tensors in self.parts]
        self.parts = []

    @classmethod
    def fuse(cls, members: list[tuple[str, tuple[torch.Tensor, ...]]], bias=None) -> QuantLinear:
        """Linears that read one input, each (format, natural tensors): consecutive members of
        one format become one matmul (their tensors concatenated along the output columns)."""
        parts: list[tuple[str, tuple[torch.Tensor, ...]]] = []
        for fmt, tensors in members:
            if parts and parts[-1][0] == fmt:
                prev = parts[-1][1]
                tensors = tuple(torch.cat([a, b]) for a, b in zip(prev, tensors, strict=True))
                parts[-1] = (fmt, tensors)
            else:
                parts.append((fmt, tensors))
        return cls(parts, bias)

    @classmethod
    def quantize(
        cls, linears: list[torch.nn.Linear], bits: list[int], recover_grid: bool = False
    ) -> QuantLinear:
        members = [
            (f"int{b}", quantize_float(lin.weight, b, recover_grid))
            for lin, b in zip(linears, bits, strict=True)
        ]
        return cls.fuse(members, fused_bias(linears))

    def state(self) -> dict:
        if not self.parts:
            raise RuntimeError("a packed QuantLinear keeps no natural-layout weights")
        return {"parts": [[fmt, list(t)] for fmt, t in self.parts], "bias": self.bias}

    @classmethod
    def from_state(cls, state: dict) -> QuantLinear:
        """From ``state`` (as ``quant_cache`` maps it from its file): the bias is copied out,
        so that once the weights are packed nothing keeps the file's mapping alive."""
        bias = state["bias"]
        return cls(
            [(fmt, tuple(t)) for fmt, t in state["parts"]], None if bias is None else bias.clone()
        )

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.kernel_parts) or sum(
            t.numel() * t.element_size() for _, tensors in self.parts for t in tensors
        )

    def __call__(self, x: kernels.QuantizedRows) -> torch.Tensor:
        """[M, N] float32. The bias is added in torch: one IEEE add per element, no reduction,
        so its result is the same however torch splits the elements (row-local as the kernels)."""
        if not self.kernel_parts:
            self.pack(x.backend)
        outs = [formats.gemm(x, w) for w in self.kernel_parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y if self.bias is None else y + self.bias


def quantize_float(weight: torch.Tensor, bits: int, recover_grid: bool = False) -> tuple:
    """A float weight [N, K] in our int8 or int4 format (natural layout)."""
    w = weight.detach().float()
    return quantize_int4(w, recover_grid) if bits == 4 else quantize_int8(w)


def fused_bias(linears: list[torch.nn.Linear]) -> torch.Tensor | None:
    """The fused output's bias (zeros for members without one), or None if none has one."""
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat(
        [
            torch.zeros(lin.out_features) if lin.bias is None else lin.bias.detach().float()
            for lin in linears
        ]
    )


def layer_projections(layer) -> list[torch.nn.Linear]:
    """A decoder layer's projections, in ``decoder.projections(layer).all`` order."""
    return [decoder.projection(layer, n) for n in decoder.projections(layer).all]


def projections(model) -> list[torch.nn.Linear]:
    return [lin for layer in model.model.layers for lin in layer_projections(layer)]


def four_bit_source(linears: list[torch.nn.Linear], sample: int = 4) -> bool:
    """Whether the model's projections already sit on 4-bit grids (a dequantised GGUF): judged
    on a few of them."""
    step = max(1, len(linears) // sample)
    shares = [grid_share(lin.weight.detach()) for lin in linears[::step][:sample]]
    return max(shares) >= ON_GRID


def choose_bits(linears: list[torch.nn.Linear], weights: str, from_4bit: bool) -> list[int]:
    """Per projection: 8 for int8; for int4, 4 unless the source is 4-bit and this one is not."""
    if weights == "int8":
        return [8] * len(linears)
    if not from_4bit:
        return [4] * len(linears)
    return [4 if grid_share(lin.weight.detach()) >= ON_GRID else 8 for lin in linears]
