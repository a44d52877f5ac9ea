"""Building blocks of the fused network. Every tensor between them is stream-major: [S, B, N, D].

S is the number of residual streams the block computes: M (one per member) after the split, 1 in
the shared trunk. A component is *shared* when every member has the same weights (one weight,
broadcast over streams) and *per-stream* otherwise (a leading S axis on its weights).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hydra_deploy.backbones.base import AttentionWeights
from hydra_deploy.errors import FusionError
from hydra_deploy.fusion.grouped import DEFAULT_LOWERING, GroupedLinear


def token_mean(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The mean over tokens as a sum and a division: the dynamo exporter writes ``mean`` as opset
    18's ReduceMean (axes as an input), which does not convert to opset 17; ReduceSum does."""
    return x.sum(dim=dim) / x.shape[dim]


def all_equal(tensors: Sequence[torch.Tensor | None]) -> bool:
    """True when every tensor equals the first exactly (same shape and values), or all are None."""
    first = tensors[0]
    if first is None:
        return all(t is None for t in tensors)
    return all(
        t is not None and t.shape == first.shape and torch.equal(t, first) for t in tensors[1:]
    )


def _stack_or_share(tensors: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, bool]:
    """(the shared tensor, False) when all are equal, else (stacked [S, ...], True)."""
    if all_equal(tensors):
        return (None if tensors[0] is None else tensors[0].detach().clone()), False
    if any(t is None for t in tensors):
        raise FusionError(
            "members differ in whether a layer has a weight at all; fuse equal architectures"
        )
    return torch.stack([t.detach() for t in tensors]), True


def _per_stream_view(param: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[S, D] -> [S, 1, ..., 1, D] so it broadcasts over x [S, ..., D]."""
    return param.view(param.shape[0], *([1] * (x.dim() - 2)), param.shape[-1])


class StreamLayerNorm(nn.Module):
    """LayerNorm over the last axis, with one affine shared by all streams or one per stream."""

    def __init__(self, norms: Sequence[nn.LayerNorm]) -> None:
        super().__init__()
        eps = {n.eps for n in norms}
        shapes = {tuple(n.normalized_shape) for n in norms}
        if len(eps) != 1 or len(shapes) != 1:
            raise FusionError(
                f"members' LayerNorms differ in eps or shape: eps={eps}, shapes={shapes}"
            )
        self.eps = eps.pop()
        self.dim = shapes.pop()[-1]
        weight, self.per_stream = _stack_or_share([n.weight for n in norms])
        bias, bias_per_stream = _stack_or_share([n.bias for n in norms])
        if bias_per_stream and not self.per_stream and weight is not None:
            weight = weight.expand(len(norms), -1).clone()
        self.per_stream = self.per_stream or bias_per_stream
        if self.per_stream and bias is not None and bias.dim() == 1:
            bias = bias.expand(len(norms), -1).clone()
        self.weight = None if weight is None else nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.per_stream:
            return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)
        x = F.layer_norm(x, (self.dim,), None, None, self.eps)
        if self.weight is not None:
            x = x * _per_stream_view(self.weight, x)
        if self.bias is not None:
            x = x + _per_stream_view(self.bias, x)
        return x

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}, per_stream={self.per_stream}"


class StreamScale(nn.Module):
    """LayerScale (x * gamma) with gamma shared or per stream."""

    def __init__(self, gammas: Sequence[torch.Tensor]) -> None:
        super().__init__()
        gamma, self.per_stream = _stack_or_share(gammas)
        self.gamma = nn.Parameter(gamma)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (_per_stream_view(self.gamma, x) if self.per_stream else self.gamma)


def stream_scale(layer_scales: Sequence[nn.Module]) -> nn.Module:
    """StreamScale for timm LayerScale modules, Identity when the members have none."""
    if all(isinstance(ls, nn.Identity) for ls in layer_scales):
        return nn.Identity()
    if not all(hasattr(ls, "gamma") for ls in layer_scales):
        raise FusionError("some members use LayerScale and others do not; fuse equal architectures")
    return StreamScale([ls.gamma for ls in layer_scales])


def stream_norm(norms: Sequence[nn.Module]) -> nn.Module:
    """StreamLayerNorm for LayerNorm modules, Identity when the members have none."""
    if all(isinstance(n, nn.Identity) for n in norms):
        return nn.Identity()
    if not all(isinstance(n, nn.LayerNorm) for n in norms):
        raise FusionError(
            f"members' norms are of different kinds: {sorted({type(n).__name__ for n in norms})}"
        )
    return StreamLayerNorm(norms)


class SharedMlp(nn.Module):
    """One MLP applied to every stream (the paper's averaged MLP, or members' identical MLPs)."""

    def __init__(self, fc1: nn.Linear, act: nn.Module, fc2: nn.Linear) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = fc1, act, fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GroupedMlp(nn.Module):
    """Each stream keeps its own MLP: grouped fc1 [S, D, hidden] and fc2 [S, hidden, D]."""

    def __init__(self, fc1: GroupedLinear, act: nn.Module, fc2: GroupedLinear) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = fc1, act, fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [S, B, N, D]
        return self.fc2(self.act(self.fc1(x)))


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer.to(weight.dtype)


def merge_mlps(
    fc1s: Sequence[nn.Linear],
    acts: Sequence[nn.Module],
    fc2s: Sequence[nn.Linear],
    mlp_merge: str,
    lowering: str,
) -> tuple[nn.Module, str]:
    """The fused MLP of one layer and how it was merged ("shared", "average" or "grouped")."""
    act = copy.deepcopy(acts[0])
    params = [
        [m.weight for m in fc1s],
        [m.bias for m in fc1s],
        [m.weight for m in fc2s],
        [m.bias for m in fc2s],
    ]
    if all(all_equal(group) for group in params):
        return SharedMlp(copy.deepcopy(fc1s[0]), act, copy.deepcopy(fc2s[0])), "shared"
    if mlp_merge == "average":
        w1, b1, w2, b2 = (
            None if g[0] is None else torch.stack([t.detach() for t in g]).mean(0) for g in params
        )
        return SharedMlp(_linear(w1, b1), act, _linear(w2, b2)), "average"
    if mlp_merge == "grouped":
        w1, b1, w2, b2 = (
            None if g[0] is None else torch.stack([t.detach() for t in g]) for g in params
        )
        fc1 = GroupedLinear.from_weights(w1.transpose(1, 2), b1, lowering)
        fc2 = GroupedLinear.from_weights(w2.transpose(1, 2), b2, lowering)
        return GroupedMlp(fc1, act, fc2), "grouped"
    raise FusionError(f"unknown mlp_merge {mlp_merge!r}; choose 'average' or 'grouped'")


class FusedAttention(nn.Module):
    """All streams' kept heads in one grouped QKV projection, one SDPA call, one grouped projection.

    Stream s keeps ``kept_heads[s]`` (original head indices). Streams keep up to ``k`` heads; one
    that keeps fewer is padded with zero heads (zero Q/K/V rows and zero output columns), which add
    exactly nothing. Heads never see another stream's tokens: each (stream, head) pair is its own
    attention head in the SDPA call.
    """

    def __init__(
        self,
        weights: Sequence[AttentionWeights],
        kept_heads: Sequence[Sequence[int]],
        lowering: str = DEFAULT_LOWERING,
    ) -> None:
        super().__init__()
        if len(weights) != len(kept_heads):
            raise FusionError(f"{len(weights)} weight sets for {len(kept_heads)} head lists")
        streams = len(weights)
        _, head_dim, dim = weights[0].q.shape  # [H, hd, D]
        self.streams, self.head_dim, self.dim = streams, head_dim, dim
        self.kept_heads = tuple(tuple(int(h) for h in heads) for heads in kept_heads)
        self.k = max(len(heads) for heads in self.kept_heads)
        self.padded_heads = sum(self.k - len(heads) for heads in self.kept_heads)
        ref = weights[0]
        dtype = ref.q.dtype
        has_qkv_bias = ref.q_bias is not None

        proj_bias, _ = _stack_or_share([w.proj_bias for w in weights])
        if proj_bias is not None and proj_bias.dim() == 1:
            proj_bias = proj_bias.expand(streams, dim).clone()
        if self.k == 0:  # no stream keeps a head: the layer adds only the projection's bias
            self.qkv = None
            self.proj = None
            self.proj_bias = None if proj_bias is None else nn.Parameter(proj_bias)
            return

        k, hd = self.k, head_dim
        # qkv output axis ordered (q|k|v, head, d); proj input axis ordered (head, d)
        qkv_w = torch.zeros(streams, dim, 3, k, hd, dtype=dtype)
        qkv_b = torch.zeros(streams, 3, k, hd, dtype=dtype) if has_qkv_bias else None
        proj_w = torch.zeros(streams, k, hd, dim, dtype=dtype)
        for s, (w, heads) in enumerate(zip(weights, self.kept_heads, strict=True)):
            if not heads:
                continue  # all zero heads: this stream adds only the projection bias
            idx = torch.as_tensor(heads, dtype=torch.long)
            n = len(heads)
            qkv_w[s, :, :, :n] = torch.stack([w.q[idx], w.k[idx], w.v[idx]]).permute(3, 0, 1, 2)
            if qkv_b is not None:
                qkv_b[s, :, :n] = torch.stack([w.q_bias[idx], w.k_bias[idx], w.v_bias[idx]])
            proj_w[s, :n] = w.proj[:, idx, :].permute(1, 2, 0)  # [n, hd, D]
        self.qkv = GroupedLinear.from_weights(
            qkv_w.reshape(streams, dim, 3 * k * hd),
            None if qkv_b is None else qkv_b.reshape(streams, 3 * k * hd),
            lowering,
        )
        self.proj = GroupedLinear.from_weights(
            proj_w.reshape(streams, k * hd, dim), proj_bias, lowering
        )
        self.proj_bias = None

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [S, B, N, D] -> [S, B, N, D].

        ``attn_mask`` (optional): a key-padding mask [B, N] shared by every stream, head and query,
        boolean (True = attend, False = padding) or additive float (0 = attend, a large negative
        value = padding), as ``scaled_dot_product_attention`` takes it.
        """
        S, B, N, D = x.shape  # streams, batch, tokens, width
        if self.qkv is None:
            out = x.new_zeros(S, B, N, D)
            return out if self.proj_bias is None else out + _per_stream_view(self.proj_bias, out)
        k, hd = self.k, self.head_dim
        qkv = self.qkv(x)  # [S, B, N, 3*k*hd]
        q, key, value = (
            qkv.reshape(S * B, N, 3, k, hd).permute(2, 0, 3, 1, 4).unbind(0)
        )  # [S*B, k, N, hd]
        if attn_mask is None:
            heads = F.scaled_dot_product_attention(q, key, value)  # [S*B, k, N, hd]
        else:  # [B, N] keys -> [S*B, 1, 1, N]: broadcast over streams, heads and queries
            mask = attn_mask.reshape(1, B, 1, 1, N).expand(S, B, 1, 1, N).reshape(S * B, 1, 1, N)
            heads = F.scaled_dot_product_attention(q, key, value, attn_mask=mask)
        heads = heads.transpose(1, 2).reshape(S, B, N, k * hd)  # [S, B, N, k*hd]
        return self.proj(heads)  # [S, B, N, D]

    def extra_repr(self) -> str:
        return (
            f"streams={self.streams}, heads_per_stream={[len(h) for h in self.kept_heads]}, "
            f"head_dim={self.head_dim}, padded_heads={self.padded_heads}"
        )


class FusedBlock(nn.Module):
    """Pre-norm Transformer block over S streams: x + ls1(attn(norm1(x))), then the MLP."""

    def __init__(
        self,
        norm1: nn.Module,
        attn: FusedAttention,
        ls1: nn.Module,
        norm2: nn.Module,
        mlp: nn.Module,
        ls2: nn.Module,
    ) -> None:
        super().__init__()
        self.norm1, self.attn, self.ls1 = norm1, attn, ls1
        self.norm2, self.mlp, self.ls2 = norm2, mlp, ls2

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [S, B, N, D]
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


# --- the layer stack every family shares -----------------------------------------------------------
def kept_attention_tensors(weights: AttentionWeights, heads: Sequence[int]) -> list:
    """The attention tensors of the kept ``heads`` only (what a member's layer computes with)."""
    idx = torch.as_tensor(list(heads), dtype=torch.long)
    out = [weights.q[idx], weights.k[idx], weights.v[idx], weights.proj[:, idx], weights.proj_bias]
    out += [None if b is None else b[idx] for b in (weights.q_bias, weights.k_bias, weights.v_bias)]
    return out


def layers_identical(
    layer_blocks: Sequence[nn.Module],
    weights: Sequence[AttentionWeights],
    heads: Sequence[Sequence[int]],
    module_names: Sequence[str],
) -> bool:
    """All members keep the same heads with the same attention weights, and the named submodules
    (norms, LayerScale, the MLP when grouped) of their layers hold the same parameters."""
    if any(tuple(h) != tuple(heads[0]) for h in heads):
        return False
    groups = list(zip(*[kept_attention_tensors(w, heads[0]) for w in weights], strict=True))
    for name in module_names:
        params = [list(block.get_submodule(name).parameters()) for block in layer_blocks]
        groups += list(zip(*params, strict=True))
    return all(all_equal(list(group)) for group in groups)


def embeddings_shared(tensors_per_member: Sequence[Sequence[torch.Tensor | None]]) -> bool:
    """Whether every member's embedding tensors equal the first member's."""
    return all(
        all_equal([t[i] for t in tensors_per_member]) for i in range(len(tensors_per_member[0]))
    )


class LayerStack:
    """A fused encoder: leading layers all members share run once (the trunk), then M streams.

    ``layer_blocks(layer)`` gives the members' modules of one layer, ``identical_modules`` the
    names (inside those modules) whose weights must also match for the layer to be shared, and
    ``fused_block(layer_blocks, weights, heads)`` builds one fused block and says how its MLP was
    merged. The result: ``trunk`` and ``blocks`` (module lists), ``layer_heads`` (kept heads per
    stream and layer, for counting), and the merge kinds of MLPs and norms.
    """

    def __init__(
        self,
        members: Sequence[Any],
        spec: Any,
        *,
        layer_blocks: Callable[[int], list],
        identical_modules: Sequence[str],
        fused_block: Callable,
        shared_trunk: bool,
    ) -> None:
        M = spec.num_members
        trunk, blocks, self.layer_heads = [], [], []
        self.mlp_kinds: set[str] = set()
        self.norm_kinds: set[bool | None] = set()
        in_trunk = shared_trunk
        for layer in range(spec.num_layers):
            heads = [spec.members[m].heads[layer] for m in range(M)]
            modules = layer_blocks(layer)
            weights = [member.attention_weights(layer) for member in members]
            in_trunk = in_trunk and layers_identical(modules, weights, heads, identical_modules)
            streams = 1 if in_trunk else M
            block, mlp_kind = fused_block(modules, weights[:streams], heads[:streams])
            if streams == 1 and mlp_kind == "grouped":
                raise FusionError("internal: a trunk layer cannot hold grouped MLPs")
            self.mlp_kinds.add(mlp_kind)
            self.norm_kinds.update(
                getattr(n, "per_stream", None) for n in (block.norm1, block.norm2)
            )
            (trunk if in_trunk else blocks).append(block)
            self.layer_heads.append([len(h) for h in heads[:streams]])
        self.trunk = nn.ModuleList(trunk)
        self.blocks = nn.ModuleList(blocks)

    def merge(self, embed_shared: bool, final_norms: Sequence[nn.Module] = ()) -> dict[str, Any]:
        """The merge report entries every family shares (embeddings, norms, MLP, trunk, padding)."""
        kinds = self.norm_kinds | {getattr(n, "per_stream", None) for n in final_norms}
        return {
            "embeddings": "shared" if embed_shared else "per-member",
            "norms": "per-member" if True in kinds else "shared",
            "mlp": "+".join(sorted(self.mlp_kinds)),
            "trunk_layers": len(self.trunk),
            "padded_heads": sum(b.attn.padded_heads for b in [*self.trunk, *self.blocks]),
        }


def fused_layer(
    layer_blocks: Sequence[nn.Module],
    weights: Sequence[AttentionWeights],
    heads: Sequence[Sequence[int]],
    parts: Mapping[str, str],
    mlp_merge: str,
    lowering: str,
    block_class: Callable[..., nn.Module] = FusedBlock,
) -> tuple[nn.Module, str]:
    """One fused layer from the members' layers, and how its MLP was merged.

    ``parts`` maps the roles ``norm1, norm2, fc1, act, fc2`` and, where the layer has them,
    ``ls1, ls2`` to names in one member's layer (the family registry's ``block_parts``).
    ``block_class`` takes the fused parts by role: :class:`FusedBlock` (pre-norm: ViT, OpenCLIP)
    or a family's own (BERT's post-norm block).
    """
    norm_blocks = layer_blocks[: len(weights)]

    def part(role: str, blocks: Sequence[nn.Module]) -> list:
        return [
            attrgetter(parts[role])(block) for block in blocks
        ]  # an activation may be a function

    mlp, mlp_kind = merge_mlps(
        part("fc1", layer_blocks),
        part("act", layer_blocks),
        part("fc2", layer_blocks),
        mlp_merge,
        lowering,
    )
    components = {
        "attn": FusedAttention(weights, heads, lowering),
        "norm1": stream_norm(part("norm1", norm_blocks)),
        "norm2": stream_norm(part("norm2", norm_blocks)),
        "mlp": mlp,
    }
    for role in ("ls1", "ls2"):
        if role in parts:
            components[role] = stream_scale(part(role, norm_blocks))
    return block_class(**components), mlp_kind
