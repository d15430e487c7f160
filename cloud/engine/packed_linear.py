"""fp32 Linear layers on oneDNN with prepacked weights, for the target on CPU.

torch's CPU Linear goes through MKL's sgemm, which on AMD CPUs takes a slow path for the skinny
matrices of verification: a block of 2-9 tokens costs about twice one token, when the weights,
read once either way, should dominate. oneDNN's inner product with the weight packed once at load
is vendor-neutral: measured here (AMD EPYC, 1 thread, 1536x8960) 2.4 ms for 1 row and 3.4 ms for
5 rows, against 3.2 ms and 7.1 ms through MKL. Still float32, so outputs stay those of the model.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


class PackedLinear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight.detach().to_mkldnn()  # [out, in], packed once
        self.bias = None if linear.bias is None else linear.bias.detach().to_mkldnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape  # [..., in]
        x2 = x.reshape(-1, self.in_features).to_mkldnn()
        y = torch._C._nn.mkldnn_linear(x2, self.weight, self.bias)
        return y.to_dense().reshape(*shape[:-1], self.out_features)


def pack_linears(model: torch.nn.Module) -> int:
    """Replaces every float32 nn.Linear of ``model`` in place, one at a time, and returns how
    many were replaced. Only names are collected up front: holding the modules themselves would
    keep every original weight alive until the end, doubling peak memory (an OOM for a 1.5B
    target next to another process on a 24 GiB machine)."""
    if not torch.backends.mkldnn.is_available():
        log.info("oneDNN unavailable: keeping torch's Linear")
        return 0
    names = [
        (parent_name, name)
        for parent_name, parent in model.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, torch.nn.Linear) and child.weight.dtype == torch.float32
    ]
    for parent_name, name in names:
        parent = model.get_submodule(parent_name)
        setattr(parent, name, PackedLinear(getattr(parent, name)))
    return len(names)
