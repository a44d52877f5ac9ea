"""Grouped fully-connected layers: G independent linear maps applied to G stacked streams.

``grouped_linear`` is the functional core, :class:`GroupedLinear` the module wrapper. The math is
one: ``y[g] = x[g] @ weight[g] + bias[g]`` with ``x`` [G, ..., in], ``weight`` [G, in, out]. It has
several lowerings (how the math becomes kernels / ONNX nodes), all proven equal in the tests:

- ``loop`` (default): G separate products on 2-D weights, stacked (ONNX: G MatMuls on 2-D
  initializers, then a Concat). Measured fastest on the CPU: ONNX Runtime prepacks a 2-D constant
  weight, and ViT-B/16's per-member Q/K/V and output projections ran 38% / 52% slower per FLOP as
  one 3-D batched MatMul (``benchmarks/profile_ort.py``);
- ``bmm``: one batched matrix product over the [G, in, out] weight (ONNX: one MatMul; one kernel
  for all groups, which may suit a GPU at small batch better: unmeasured here);
- ``dense``: one product with the block-diagonal [G*in, G*out] matrix (G x the multiply-adds);
- ``conv1d``: a grouped 1x1 convolution (``groups=G``);
- ``einsum``: ``torch.einsum`` (exports as an ONNX ``Einsum``; kept for comparison).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hydra_deploy.errors import FusionError

LOWERINGS = ("bmm", "loop", "dense", "conv1d", "einsum")
DEFAULT_LOWERING = "loop"


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    lowering: str = DEFAULT_LOWERING,
) -> torch.Tensor:
    """``x`` [G, *, in], ``weight`` [G, in, out], ``bias`` [G, out] -> [G, *, out]."""
    groups, in_features, out_features = weight.shape
    if x.shape[0] != groups or x.shape[-1] != in_features:
        raise FusionError(
            f"grouped_linear: input {tuple(x.shape)} does not fit weight {tuple(weight.shape)} "
            f"(expected [{groups}, ..., {in_features}])"
        )
    middle = x.shape[1:-1]
    rows = math.prod(middle)
    flat = x.reshape(groups, rows, in_features)  # [G, R, in]
    if lowering == "bmm":
        if bias is None:
            out = torch.bmm(flat, weight)
        else:
            out = torch.baddbmm(bias.unsqueeze(1), flat, weight)
    elif lowering == "loop":
        # x @ W (+ b), not F.linear: exports as MatMul (+ Add) on a 2-D constant weight, which
        # ONNX Runtime prepacks and runs in FP16 too (its CPU Gemm has no FP16 kernel)
        out = torch.stack(
            [
                flat[g] @ weight[g] if bias is None else flat[g] @ weight[g] + bias[g]
                for g in range(groups)
            ]
        )
    elif lowering == "dense":
        block = torch.block_diag(*weight.unbind(0))  # [G*in, G*out]
        out = flat.transpose(0, 1).reshape(rows, groups * in_features) @ block  # [R, G*out]
        if bias is not None:
            out = out + bias.reshape(1, groups * out_features)
        out = out.view(rows, groups, out_features).transpose(0, 1)
    elif lowering == "conv1d":
        signal = flat.transpose(1, 2).reshape(1, groups * in_features, rows)  # [1, G*in, R]
        kernel = weight.transpose(1, 2).reshape(groups * out_features, in_features, 1)
        out = F.conv1d(signal, kernel, None if bias is None else bias.reshape(-1), groups=groups)
        out = out.view(groups, out_features, rows).transpose(1, 2)
    elif lowering == "einsum":
        out = torch.einsum("gri,gio->gro", flat, weight)
        if bias is not None:
            out = out + bias.unsqueeze(1)
    else:
        raise FusionError(
            f"unknown grouped-linear lowering {lowering!r}; choose one of {LOWERINGS}"
        )
    return out.reshape(groups, *middle, out_features)


class GroupedLinear(nn.Module):
    """G independent linear layers over stacked streams: [G, *, in] -> [G, *, out]."""

    def __init__(
        self,
        groups: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        lowering: str = DEFAULT_LOWERING,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        _init: bool = True,
    ) -> None:
        super().__init__()
        if groups < 1 or in_features < 1 or out_features < 1:
            raise FusionError(
                f"GroupedLinear needs positive sizes, got groups={groups}, in={in_features}, "
                f"out={out_features}"
            )
        if lowering not in LOWERINGS:
            raise FusionError(
                f"unknown grouped-linear lowering {lowering!r}; choose one of {LOWERINGS}"
            )
        self.groups, self.in_features, self.out_features = groups, in_features, out_features
        self.lowering = lowering
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(groups, in_features, out_features, **factory))
        self.bias = nn.Parameter(torch.empty(groups, out_features, **factory)) if bias else None
        if _init:
            self.reset_parameters()

    @classmethod
    def from_weights(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        lowering: str = DEFAULT_LOWERING,
    ) -> GroupedLinear:
        """Wrap existing weights: ``weight`` [G, in, out], ``bias`` [G, out] or None."""
        groups, in_features, out_features = weight.shape
        layer = cls(
            groups,
            in_features,
            out_features,
            bias=bias is not None,
            lowering=lowering,
            device=weight.device,
            dtype=weight.dtype,
            _init=False,
        )
        with torch.no_grad():
            layer.weight.copy_(weight)
            if bias is not None:
                layer.bias.copy_(bias.reshape(groups, out_features))
        return layer

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.in_features)  # as nn.Linear, per group
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return grouped_linear(x, self.weight, self.bias, self.lowering)

    def extra_repr(self) -> str:
        return (
            f"groups={self.groups}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, lowering={self.lowering!r}"
        )
