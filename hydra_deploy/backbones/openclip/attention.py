"""The gate-able attention of an OpenCLIP image tower.

``nn.MultiheadAttention`` applies its output projection inside ``F.multi_head_attention_forward``
(or a fused native kernel), where no module hook can reach the concatenated head outputs. The
adapter therefore replaces, in place, every image-tower block's ``attn`` by a
:class:`GatedMultiheadAttention` holding the *same* parameter objects (same state-dict keys:
``in_proj_weight``, ``in_proj_bias``, ``out_proj.*``). It computes the same function with explicit
steps (input projection, ``F.scaled_dot_product_attention``, then ``self.out_proj`` called as a
module), so a forward pre-hook on ``out_proj`` sees the heads' outputs [B, N, H*hd] and
:meth:`BackboneAdapter.head_gates` can scale them. The passed model's image tower keeps computing
the same function (to float rounding); its text tower is untouched.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hydra_deploy.errors import UnsupportedModelError


class GatedMultiheadAttention(nn.Module):
    """``nn.MultiheadAttention`` (self-attention, packed in-projection) with a hookable out_proj.

    Built from an existing module by :meth:`from_multihead`, sharing its parameters. Called like
    the original (``attn(q, k, v, need_weights=False, attn_mask=None)``) and returns
    ``(output, None)``. The output projection runs as ``self.out_proj(heads)`` with ``heads``
    [B, N, H*hd], head h in columns ``h*hd:(h+1)*hd``, which is where the adapter's gates act.
    """

    def __init__(self, attn: nn.MultiheadAttention) -> None:
        super().__init__()
        self.embed_dim = attn.embed_dim
        self.num_heads = attn.num_heads
        self.head_dim = attn.head_dim
        self.batch_first = attn.batch_first
        self.dropout = attn.dropout
        self.in_proj_weight = attn.in_proj_weight  # [3D, D], rows (q|k|v, head, d): shared
        self.in_proj_bias = attn.in_proj_bias  # [3D] or None
        self.out_proj = attn.out_proj  # the gate target

    @classmethod
    def from_multihead(cls, attn: nn.MultiheadAttention) -> GatedMultiheadAttention:
        problems = []
        if not attn._qkv_same_embed_dim:
            problems.append("separate q/k/v projection weights (kdim/vdim)")
        if attn.bias_k is not None or attn.bias_v is not None:
            problems.append("add_bias_kv")
        if attn.add_zero_attn:
            problems.append("add_zero_attn")
        if problems:
            raise UnsupportedModelError(
                f"attention with {', '.join(problems)} is not supported (open_clip's image tower "
                "uses plain packed self-attention)"
            )
        return cls(attn)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, None]:
        if need_weights:
            raise UnsupportedModelError("GatedMultiheadAttention does not return attention weights")
        if key_padding_mask is not None:
            raise UnsupportedModelError("GatedMultiheadAttention does not take key_padding_mask")
        key = query if key is None else key
        value = key if value is None else value
        if not self.batch_first:  # [N, B, D] -> [B, N, D]
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        H, hd = self.num_heads, self.head_dim
        B, N = query.shape[:2]
        if key is query and value is query:  # self-attention: one packed projection
            q, k, v = F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        else:
            weights = self.in_proj_weight.chunk(3)
            biases = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
            q, k, v = (
                F.linear(t, w, b)
                for t, w, b in zip((query, key, value), weights, biases, strict=True)
            )
        q, k, v = (t.reshape(B, -1, H, hd).transpose(1, 2) for t in (q, k, v))  # [B, H, N, hd]
        if attn_mask is not None and attn_mask.dtype == torch.bool:  # True = masked out (torch MHA)
            attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill(
                attn_mask, -torch.inf
            )
        heads = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.dropout if self.training else 0.0
        )  # [B, H, N, hd]
        heads = heads.transpose(1, 2).reshape(B, N, H * hd)  # [B, N, H*hd]: the gates act here
        out = self.out_proj(heads)  # [B, N, D]
        return (out if self.batch_first else out.transpose(0, 1)), None


def install_gates(visual: nn.Module) -> None:
    """Replace every image-tower block's MultiheadAttention by a GatedMultiheadAttention (idempotent)."""
    for block in visual.transformer.resblocks:
        if not isinstance(block.attn, GatedMultiheadAttention):
            block.attn = GatedMultiheadAttention.from_multihead(block.attn)
