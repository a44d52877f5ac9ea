"""Adapter over timm's ``VisionTransformer`` (ViT-Ti/S/B/L, DeiT, and friends with standard blocks),
and what the vit family declares about it: its architecture signature and its per-head weights."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from hydra_deploy.backbones.base import (
    AttentionWeights,
    BackboneAdapter,
    ImageBackbone,
    block_problems,
    is_identity,
    refuse_unsupported,
    weight_shapes,
)
from hydra_deploy.errors import BackboneError, FinetuneError, UnsupportedModelError
from hydra_deploy.optional import lazy_module

#: the vit family's one import of timm (its loading module uses this one too)
timm = lazy_module("timm", purpose="the vit family (timm Vision Transformers)", error=BackboneError)

SUPPORTED_POOLS = ("token", "avg", "max", "avgmax")


def check_supported(model: nn.Module) -> None:
    """Raise UnsupportedModelError naming every feature of ``model`` the fused ViT cannot express."""
    vision_transformer = timm.models.vision_transformer
    if not isinstance(model, vision_transformer.VisionTransformer):
        raise UnsupportedModelError(
            f"{type(model).__name__} is not a timm VisionTransformer; hydra-deploy's ViT family "
            "supports timm.models.vision_transformer.VisionTransformer models"
        )
    problems: list[str] = []
    if getattr(model, "attn_pool", None) is not None:
        problems.append("attention pooling (global_pool='map')")
    if getattr(model, "dynamic_img_size", False):
        problems.append("dynamic_img_size=True")
    if model.global_pool not in SUPPORTED_POOLS:
        problems.append(
            f"global_pool={model.global_pool!r} (supported: {', '.join(SUPPORTED_POOLS)})"
        )
    if not isinstance(model.head, nn.Linear):
        problems.append("no linear classifier head (num_classes=0); build it with num_classes > 0")
    for name in ("norm", "fc_norm"):
        sub = getattr(model, name)
        if not (is_identity(sub) or isinstance(sub, nn.LayerNorm)):
            problems.append(f"{name} is {type(sub).__name__}, expected LayerNorm or Identity")
    heads = set()
    for index, block in enumerate(model.blocks):
        where = f"block {index}"
        if type(block) is not vision_transformer.Block:
            problems.append(
                f"{where} is {type(block).__name__}, only the pre-norm timm Block is supported"
            )
            continue
        attn = block.attn
        if type(attn) is not timm.layers.attention.Attention:
            problems.append(f"{where}: attention {type(attn).__name__} is not timm's Attention")
            continue
        if not (is_identity(attn.q_norm) and is_identity(attn.k_norm)):
            problems.append(f"{where}: qk_norm is not supported")
        if not is_identity(getattr(attn, "norm", None)):
            problems.append(f"{where}: attention scale_norm is not supported")
        if getattr(attn, "gate", None) is not None:
            problems.append(f"{where}: gated attention is not supported")
        if attn.attn_dim != attn.num_heads * attn.head_dim:
            problems.append(f"{where}: attention width {attn.attn_dim} != heads x head_dim")
        heads.add((attn.num_heads, attn.head_dim))
        if type(block.mlp) is not timm.layers.Mlp or not is_identity(block.mlp.norm):
            problems.append(f"{where}: MLP {type(block.mlp).__name__} is not timm's plain Mlp")
        problems += block_problems(block, where, ("norm1", "norm2"), ("ls1", "ls2"))
    refuse_unsupported(
        problems, heads, len(model.blocks), "VisionTransformer", "the fused Hydra ViT"
    )


def architecture_signature(adapter: BackboneAdapter) -> dict[str, Any]:
    """What members of the vit family must share to be fused (the family registry's
    ``architecture``): module structure, pooling and prefix tokens, weights' shapes."""
    model = adapter.module
    flags = (
        model.global_pool,
        model.num_prefix_tokens,
        model.no_embed_class,
        getattr(model, "pool_include_prefix", False),
    )
    return {
        "pooling / prefix-token settings": flags,
        "weights' shapes or dtypes": weight_shapes(model),
        "module structure": repr(model),
    }


def head_views(module: nn.Module) -> tuple[int, list[list[tuple[torch.Tensor, int]]]]:
    """(heads per layer, per layer the views of every weight holding one slice per head): a timm
    ViT's ``attn.qkv`` weight/bias [3, H, hd, ...] (Q, K and V rows) and ``attn.proj.weight``
    [D, H, hd] (columns), detached views sharing the parameters' storage (the registry's
    ``head_views``)."""
    blocks = getattr(module, "blocks", None)
    if blocks is None:
        raise FinetuneError(
            f"{type(module).__name__} has no .blocks: it is not a timm ViT; fine-tuning takes the "
            "models of a family that declares its head_views (hydra_deploy.families)"
        )
    views = []
    for block in blocks:
        attn = block.attn
        H, hd = attn.num_heads, attn.head_dim
        layer = [
            (attn.qkv.weight.detach().view(3, H, hd, -1), 1),
            (attn.proj.weight.detach().view(attn.proj.weight.shape[0], H, hd), 1),
        ]
        if attn.qkv.bias is not None:
            layer.append((attn.qkv.bias.detach().view(3, H, hd), 1))
        views.append(layer)
    return blocks[0].attn.num_heads, views


def build_vit(kwargs: dict) -> nn.Module:
    """A random-weight VisionTransformer from ``TimmVitAdapter.constructor_kwargs()``."""
    kwargs = dict(kwargs)
    eps = kwargs.pop("layer_norm_eps", 1e-6)
    approximate = kwargs.pop("gelu_approximate", "none")
    for key in ("img_size", "patch_size"):
        kwargs[key] = tuple(kwargs[key])
    try:
        return timm.models.vision_transformer.VisionTransformer(
            **kwargs,
            norm_layer=partial(nn.LayerNorm, eps=eps),
            act_layer=partial(nn.GELU, approximate=approximate),
        ).eval()
    except (TypeError, AssertionError) as err:
        raise UnsupportedModelError(f"cannot rebuild the ViT from {kwargs}: {err}") from err


class TimmVitAdapter(ImageBackbone):
    """A timm VisionTransformer seen through the common adapter interface."""

    family = "vit"
    shared_parameter_prefixes = (
        "cls_token",
        "reg_token",
        "pos_embed",
        "patch_embed.",
        "norm_pre.",
        "norm.",
        "fc_norm.",
        "head.",
    )
    embedding_parameter_prefixes = (
        "cls_token",
        "reg_token",
        "pos_embed",
        "patch_embed.",
        "norm_pre.",
    )
    layer_parameter_prefix = "blocks.{}."

    def __init__(self, model: nn.Module, name: str | None = None, weights: str = "random") -> None:
        check_supported(model)
        self.module = model.eval()
        self.name = (
            name or getattr(model, "default_cfg", {}).get("architecture") or type(model).__name__
        )
        self.weights = weights
        first = model.blocks[0].attn
        self.num_layers = len(model.blocks)
        self.num_heads = first.num_heads
        self.head_dim = first.head_dim
        self.embed_dim = model.embed_dim
        self.num_classes = model.num_classes
        self.mlp_hidden = model.blocks[0].mlp.fc1.out_features
        self.num_prefix_tokens = model.num_prefix_tokens
        self.num_patches = model.patch_embed.num_patches
        self.num_tokens = self.num_patches + self.num_prefix_tokens
        self.img_size = tuple(model.patch_embed.img_size)
        self.in_chans = model.patch_embed.proj.in_channels
        self.patch_size = tuple(int(s) for s in model.patch_embed.proj.kernel_size)

    # ---------------------------------------------------------------------------------------------
    def _gate_targets(self) -> list[nn.Module]:
        return [block.attn.proj for block in self.module.blocks]

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        model = self.module
        return model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(inputs))))

    def run_layers(self, hidden: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        for block in self.module.blocks[start:stop]:
            hidden = block(hidden)
        return hidden

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.module.forward_head(self.module.norm(hidden))

    def attention_weights(self, layer: int) -> AttentionWeights:
        attn = self.module.blocks[layer].attn
        return AttentionWeights.from_packed(
            attn.qkv.weight, attn.qkv.bias, attn.proj.weight, attn.proj.bias, self.num_heads
        )

    def constructor_kwargs(self) -> dict:
        """The ``VisionTransformer(**kwargs)`` arguments that rebuild this architecture (JSON-able).

        Enough to re-create the module a checkpoint's state dict loads into; the values of
        LayerScale's ``init_values`` do not matter (weights are loaded after).
        """
        model, block = self.module, self.module.blocks[0]
        act = block.mlp.act
        if type(act) is not nn.GELU:
            raise UnsupportedModelError(
                f"cannot record how to rebuild an MLP activation {type(act).__name__} (only GELU)"
            )
        return {
            "img_size": list(self.img_size),
            "patch_size": list(model.patch_embed.patch_size),
            "in_chans": self.in_chans,
            "num_classes": self.num_classes,
            "global_pool": model.global_pool,
            "embed_dim": self.embed_dim,
            "depth": self.num_layers,
            "num_heads": self.num_heads,
            "mlp_ratio": self.mlp_hidden / self.embed_dim,
            "qkv_bias": block.attn.qkv.bias is not None,
            "proj_bias": block.attn.proj.bias is not None,
            "init_values": 1e-5 if hasattr(block.ls1, "gamma") else None,
            "class_token": model.cls_token is not None,
            "pos_embed": "learn" if model.pos_embed is not None else "none",
            "no_embed_class": bool(model.no_embed_class),
            "reg_tokens": int(getattr(model, "num_reg_tokens", 0)),
            "pre_norm": isinstance(model.norm_pre, nn.LayerNorm),
            # timm: final_norm enables a norm, fc_norm puts it after pooling instead of before
            "final_norm": isinstance(model.norm, nn.LayerNorm)
            or isinstance(model.fc_norm, nn.LayerNorm),
            "fc_norm": isinstance(model.fc_norm, nn.LayerNorm),
            "pool_include_prefix": bool(getattr(model, "pool_include_prefix", False)),
            "layer_norm_eps": float(block.norm1.eps),
            "gelu_approximate": act.approximate,
        }

    def data_config(self) -> dict:
        """Preprocessing (timm's data config: input size, interpolation, crop, mean, std).

        The model's pretrained config may describe another resolution or channel count (a
        224-pixel RGB default for a model built with img_size=16 or in_chans=1): the backbone's own
        input shape wins, and a single-channel model takes the first entry of a 3-channel mean/std.
        """
        config = timm.data.resolve_data_config({}, model=self.module)
        config["input_size"] = (self.in_chans, *self.img_size)
        for key in ("mean", "std"):
            values = tuple(float(v) for v in config[key])
            config[key] = values if len(values) == self.in_chans else values[:1] * self.in_chans
        return config

    @property
    def preprocessing_defaulted(self) -> tuple[str, ...]:
        """The decisive entries of :meth:`data_config` taken from timm's default for the
        architecture because the checkpoint recorded none (the fused model's record keeps them)."""
        return tuple(getattr(self.module, "preprocessing_defaulted", ()))

    def head_macs(self) -> int:
        """The classifier's multiply-accumulates per image."""
        return self.embed_dim * self.num_classes
