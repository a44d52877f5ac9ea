"""The common view every backbone adapter gives of a Transformer classifier.

An adapter wraps a framework model (timm, Hugging Face, OpenCLIP) and exposes what the rest of the
pipeline needs: its layer and head geometry, per-head gates (the meaning of "member m run alone" is
the backbone run with the other heads' outputs gated to zero) and the attention weights of one layer
in a canonical, framework-independent layout.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from hydra_deploy.errors import SpecError, UnsupportedModelError
from hydra_deploy.specs import HydraSpec

#: the warning for a backbone built without trained weights (its name, then how to give them)
RANDOM_WEIGHTS = "%s: random weights (no checkpoint given); pass %s for trained weights"


@dataclass(frozen=True)
class MustMatch:
    """An entry of a family's architecture signature with its own advice: ``value`` must be equal
    in every member, ``fix`` says how to make it so (default: copies of one backbone)."""

    value: Any
    fix: str


def weight_shapes(module: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every state-dict entry's (shape, dtype): the part of an architecture signature that says
    whether members' weights can be stacked."""
    return {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}


def random_pixel_values(batch_size: int, seed: int, input_size: Sequence[int]) -> torch.Tensor:
    """Seeded random ``pixel_values`` [batch, C, H, W] (an image model's example inputs)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, *input_size, generator=generator)


def is_identity(module: nn.Module | None) -> bool:
    return module is None or isinstance(module, nn.Identity)


def block_problems(
    block: nn.Module, where: str, norms: Sequence[str], scales: Sequence[str]
) -> list[str]:
    """What a fused pre-norm block cannot express in ``block``'s ``norms`` (LayerNorms only) and
    layer ``scales`` (identity or a LayerScale's ``gamma``)."""
    problems = [
        f"{where}: {name} is not a LayerNorm"
        for name in norms
        if not isinstance(getattr(block, name), nn.LayerNorm)
    ]
    for name in scales:
        scale = getattr(block, name)
        if not (is_identity(scale) or hasattr(scale, "gamma")):
            problems.append(f"{where}: {name} is {type(scale).__name__}")
    return problems


def refuse_unsupported(problems: list[str], heads: set, blocks: int, what: str, fused: str) -> None:
    """Raise UnsupportedModelError naming every problem found in ``what`` (blocks of different
    head geometry and no block at all included); ``fused``: the fused model that lacks them."""
    if len(heads) > 1:
        problems.append(f"blocks differ in heads x head_dim: {sorted(heads)}")
    if blocks == 0:
        problems.append(f"the {what} has no transformer blocks")
    if problems:
        raise UnsupportedModelError(
            f"this {what} uses features {fused} does not implement: " + "; ".join(problems)
        )


@dataclass(frozen=True)
class AttentionWeights:
    """One layer's self-attention in canonical layout (H heads of size hd, model width D).

    q, k, v: [H, hd, D] (output rows of each head's projection), q_bias/k_bias/v_bias: [H, hd] or None;
    proj: [D, H, hd] (the output projection's columns grouped by head), proj_bias: [D] or None.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    proj: torch.Tensor
    proj_bias: torch.Tensor | None

    @classmethod
    def from_packed(
        cls,
        qkv: torch.Tensor,
        qkv_bias: torch.Tensor | None,
        proj: torch.Tensor,
        proj_bias: torch.Tensor | None,
        num_heads: int,
    ) -> AttentionWeights:
        """From one packed Q/K/V projection (weight [3 * H * hd, D], bias [3 * H * hd]) and the
        output projection (weight [D, H * hd]), as timm's ``qkv`` and torch's ``in_proj`` hold them."""
        D = proj.shape[0]
        hd = qkv.shape[0] // (3 * num_heads)
        q, k, v = qkv.detach().view(3, num_heads, hd, -1)
        biases = (None,) * 3 if qkv_bias is None else qkv_bias.detach().view(3, num_heads, hd)
        return cls(
            q=q,
            k=k,
            v=v,
            q_bias=biases[0],
            k_bias=biases[1],
            v_bias=biases[2],
            proj=proj.detach().view(D, num_heads, hd),
            proj_bias=None if proj_bias is None else proj_bias.detach(),
        )


class BackboneAdapter(abc.ABC):
    """Uniform view over a Transformer classifier. Subclasses set the attributes below."""

    family: str = ""  # "vit", "bert", "openclip"
    name: str = ""  # registry alias, timm name, ... (recorded in specs and exports)
    weights: str = "random"  # "random", "hub" or the checkpoint path the weights came from
    module: nn.Module
    num_layers: int
    num_heads: int
    head_dim: int
    embed_dim: int
    num_classes: int
    mlp_hidden: int  # the MLP's hidden width (fc1's outputs)
    #: Parameter-name prefixes (of ``module``) of the parts outside the attention blocks that the
    #: fused model stores once when the members' copies are equal: embeddings, final norm, pooler,
    #: classifier. ``finetune_members(shared_parts="frozen" | "averaged")`` keeps them equal.
    shared_parameter_prefixes: tuple[str, ...] = ()
    #: The embeddings' share of ``shared_parameter_prefixes`` (where a shared trunk starts).
    embedding_parameter_prefixes: tuple[str, ...] = ()
    #: ``layer_parameter_prefix.format(l)`` starts the names of layer ``l``'s parameters.
    layer_parameter_prefix: str = ""

    # --- per-head gates --------------------------------------------------------------------------
    @abc.abstractmethod
    def _gate_targets(self) -> list[nn.Module]:
        """One module per layer whose *input* is the concatenation of that layer's head outputs."""
        raise NotImplementedError

    @contextlib.contextmanager
    def head_gates(self, gates: torch.Tensor | np.ndarray) -> Iterator[torch.Tensor]:
        """Multiply each head's output by its gate while the context is open.

        ``gates`` is [num_layers, num_heads] (one gate per head) or [batch, num_layers, num_heads]
        (one per example; the batch must match the inputs). A tensor that requires grad stays in
        the graph, so ``|dLoss/dgates|`` is the Taylor head importance. Yields the gate tensor.
        """
        gates = self._check_mask(gates)
        handles = []
        for layer, target in enumerate(self._gate_targets()):

            def pre_hook(_module, args, layer=layer):
                (x, *rest) = args  # [B, N, H*hd]: the heads' outputs, concatenated
                scale = gates[..., layer, :].to(x.dtype).repeat_interleave(self.head_dim, dim=-1)
                if scale.dim() == 2:  # per-example gates [B, H*hd] -> [B, 1, H*hd]
                    scale = scale.unsqueeze(1)
                return (x * scale, *rest)

            handles.append(target.register_forward_pre_hook(pre_hook))
        try:
            yield gates
        finally:
            for handle in handles:
                handle.remove()

    def check_spec(self, spec: Any, user: str = "this call") -> None:
        """Raise SpecError unless ``spec`` is a HydraSpec for this backbone's layers and heads."""
        if not isinstance(spec, HydraSpec):
            raise SpecError(
                f"{user} expects a HydraSpec, got {type(spec).__name__}; see HydraSpec.from_json"
            )
        expected = {
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
        }
        wrong = [
            f"{k}={getattr(spec, k)} (backbone has {v})"
            for k, v in expected.items()
            if getattr(spec, k) != v
        ]
        if wrong:
            raise SpecError(
                f"the spec does not fit backbone {self.name}: {', '.join(wrong)}; build the spec "
                "for this backbone (e.g. HydraSpec.random(..., num_layers=backbone.num_layers, ...))"
            )

    def _check_mask(self, mask: torch.Tensor | np.ndarray) -> torch.Tensor:
        if not isinstance(mask, torch.Tensor):
            mask = torch.as_tensor(np.asarray(mask, dtype=np.float32))
        expected = (self.num_layers, self.num_heads)
        if tuple(mask.shape[-2:]) != expected or mask.dim() not in (2, 3):
            raise SpecError(
                f"head mask has shape {tuple(mask.shape)}, expected {expected} or (batch, *{expected}) "
                f"(layers x heads of {self.name})"
            )
        return mask

    def forward(self, inputs: torch.Tensor, head_mask: torch.Tensor | np.ndarray | None = None):
        """Reference forward of the backbone; with ``head_mask`` [L, H] the masked heads are off.

        This defines "member m run alone": ``forward(x, spec.head_mask(m))``.
        """
        if head_mask is None:
            return self.module(inputs)
        with self.head_gates(head_mask):
            return self.module(inputs)

    __call__ = forward

    # --- the forward pass in three parts (circuit search caches the hidden states between them) ---
    @abc.abstractmethod
    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        """Inputs -> the hidden states entering layer 0."""
        raise NotImplementedError

    @abc.abstractmethod
    def run_layers(self, hidden: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Hidden states entering layer ``start`` -> those leaving layer ``stop - 1``."""
        raise NotImplementedError

    @abc.abstractmethod
    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states after the last layer -> logits."""
        raise NotImplementedError

    # --- weights in canonical layout -------------------------------------------------------------
    @abc.abstractmethod
    def attention_weights(self, layer: int) -> AttentionWeights:
        raise NotImplementedError

    @abc.abstractmethod
    def example_inputs(self, batch_size: int = 2, seed: int = 0) -> torch.Tensor:
        raise NotImplementedError

    @abc.abstractmethod
    def macs(self) -> int:
        """Multiply-accumulates of one forward pass per example (docs/design.md, "Counting FLOPs")."""
        raise NotImplementedError

    def encoder_macs(self, layer_heads: Sequence[Sequence[int]] | None, tokens: int) -> int:
        """Multiply-accumulates of the Transformer layers for one example of ``tokens`` tokens.

        The one count of a layer every family's ``macs`` adds its embeddings and head to.
        ``layer_heads[l]`` lists the kept-head count of every residual stream computed in layer l
        (None: the single model, ``[[num_heads]] * num_layers``); the MLP runs once per stream.
        """
        if layer_heads is None:
            layer_heads = [[self.num_heads]] * self.num_layers
        N, D, hd = tokens, self.embed_dim, self.head_dim
        total = 0
        for streams in layer_heads:
            for kept in streams:
                width = kept * hd
                total += N * D * 3 * width  # Q, K, V projections
                total += 2 * kept * N * N * hd  # scores and weighted sum
                total += N * width * D  # output projection
                total += 2 * N * D * self.mlp_hidden  # MLP
        return int(total)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, layers={self.num_layers}, "
            f"heads={self.num_heads}x{self.head_dim}, dim={self.embed_dim}, "
            f"classes={self.num_classes}, weights={self.weights!r})"
        )


class ImageBackbone(BackboneAdapter):
    """An adapter of an image family: ``pixel_values`` [B, in_chans, *img_size] cut into
    ``num_patches`` patches of ``patch_size`` by the patch embedding; ``num_tokens`` with the
    prefix tokens. Subclasses give :meth:`head_macs`."""

    in_chans: int
    img_size: tuple[int, int]
    patch_size: tuple[int, int]
    num_patches: int
    num_tokens: int

    def example_inputs(self, batch_size: int = 2, seed: int = 0) -> torch.Tensor:
        return random_pixel_values(batch_size, seed, (self.in_chans, *self.img_size))

    @abc.abstractmethod
    def head_macs(self) -> int:
        """Multiply-accumulates of one stream's head per image (after pooling)."""
        raise NotImplementedError

    def macs(
        self,
        layer_heads: Sequence[Sequence[int]] | None = None,
        embed_streams: int = 1,
        head_streams: int = 1,
    ) -> int:
        """Multiply-accumulates per image: the layers' (:meth:`encoder_macs`, ``layer_heads``),
        ``embed_streams`` patch embeddings and ``head_streams`` heads (:meth:`head_macs`)."""
        ph, pw = self.patch_size
        patch = self.num_patches * self.in_chans * ph * pw * self.embed_dim
        total = embed_streams * patch + head_streams * self.head_macs()
        return int(total) + self.encoder_macs(layer_heads, self.num_tokens)
