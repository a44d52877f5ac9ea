"""The OpenCLIP adapter: what the fused model supports of an image tower, and the common interface
over a :class:`~hydra_deploy.backbones.openclip.zero_shot.ZeroShotClassifier`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hydra_deploy.backbones.base import (
    AttentionWeights,
    BackboneAdapter,
    ImageBackbone,
    MustMatch,
    block_problems,
    is_identity,
    refuse_unsupported,
    weight_shapes,
)
from hydra_deploy.backbones.openclip.attention import GatedMultiheadAttention, install_gates
from hydra_deploy.backbones.openclip.zero_shot import ZeroShotClassifier
from hydra_deploy.errors import BackboneError, UnsupportedModelError
from hydra_deploy.optional import lazy_module

#: the openclip family's one import of open_clip (its loading module uses this one too)
open_clip = lazy_module("open_clip", purpose="the openclip family", error=BackboneError)

logger = logging.getLogger("hydra_deploy")

#: open_clip's eval ``resize_mode`` -> timm's ``crop_mode`` (with ``crop_pct=1.0``).
_CROP_MODES = {"shortest": "center", "squash": "squash", "longest": "border"}
SUPPORTED_POOLS = ("tok", "avg")


def check_supported(visual: nn.Module) -> None:
    """Raise UnsupportedModelError naming every feature of the image tower the fused model lacks."""
    transformer = open_clip.transformer
    if not isinstance(visual, transformer.VisionTransformer):
        kind = type(visual).__name__
        hint = {
            "ModifiedResNet": "ResNet image towers (RN50, ...) have no attention heads to prune",
            "TimmModel": "timm-based image towers (ConvNeXt, ...) are not supported",
        }.get(kind, "only open_clip's VisionTransformer image tower is supported")
        raise UnsupportedModelError(f"the OpenCLIP image tower is a {kind}: {hint}")
    problems: list[str] = []
    if getattr(visual, "attn_pool", None) is not None:
        problems.append("attentional pooling (CoCa-style attn_pool)")
    if visual.pool_type not in SUPPORTED_POOLS:
        problems.append(f"pool_type={visual.pool_type!r} (supported: {', '.join(SUPPORTED_POOLS)})")
    if visual.proj is None:
        problems.append("no output projection (proj=None)")
    if not getattr(visual.transformer, "batch_first", True):
        problems.append("a sequence-first (batch_first=False) transformer; update open_clip")
    if not (is_identity(visual.ln_pre) or isinstance(visual.ln_pre, nn.LayerNorm)):
        problems.append(f"ln_pre is {type(visual.ln_pre).__name__}")
    if not isinstance(visual.ln_post, nn.LayerNorm):
        problems.append(f"ln_post is {type(visual.ln_post).__name__}")
    heads = set()
    for index, block in enumerate(visual.transformer.resblocks):
        where = f"block {index}"
        if type(block) is not transformer.ResidualAttentionBlock:
            problems.append(
                f"{where} is {type(block).__name__} (custom blocks: qk_norm, scaled cosine "
                "attention, head scaling); only ResidualAttentionBlock is supported"
            )
            continue
        if hasattr(block, "ln_1_kv"):
            problems.append(f"{where}: cross-attention")
        attn = block.attn
        if not isinstance(attn, (nn.MultiheadAttention, GatedMultiheadAttention)):
            problems.append(f"{where}: attention {type(attn).__name__}")
            continue
        heads.add((attn.num_heads, attn.head_dim))
        problems += block_problems(block, where, ("ln_1", "ln_2"), ("ls_1", "ls_2"))
        mlp = block.mlp
        if not (
            isinstance(getattr(mlp, "c_fc", None), nn.Linear)
            and isinstance(getattr(mlp, "c_proj", None), nn.Linear)
            and len(mlp) == 3
        ):
            problems.append(f"{where}: the MLP is not c_fc -> activation -> c_proj")
    blocks = len(visual.transformer.resblocks)
    refuse_unsupported(problems, heads, blocks, "OpenCLIP image tower", "the fused Hydra model")


#: how members that differ in their zero-shot classifier are made fusable
_SHARED_TEXT_SIDE = (
    "Hydra members share the text side: build them with the same classes, templates and text tower"
)


def architecture_signature(adapter: BackboneAdapter) -> dict[str, Any]:
    """What members of the openclip family must share to be fused (the family registry's
    ``architecture``): the image tower's structure, pooling and weights' shapes, and the zero-shot
    classifier itself (class weights, logit scale and bias: every member uses the same)."""
    classifier = adapter.module
    visual = classifier.visual
    flags = (visual.pool_type, bool(visual.final_ln_after_pool), classifier.logit_bias is None)
    signature: dict[str, Any] = {
        "pooling settings": flags,
        "weights' shapes or dtypes": weight_shapes(classifier),
        "module structure": repr(visual),
    }
    for name in ("class_weights", "logit_scale", "logit_bias"):
        value = getattr(classifier, name)
        signature[f"zero-shot classifier ({name})"] = MustMatch(value, _SHARED_TEXT_SIDE)
    return signature


class OpenClipAdapter(ImageBackbone):
    """An OpenCLIP image tower with a zero-shot classifier, seen through the common interface.

    Build it with :func:`load_openclip` (a model name) or :func:`wrap_openclip` (a built model).
    """

    family = "openclip"

    def __init__(
        self,
        classifier: ZeroShotClassifier,
        name: str,
        weights: str = "random",
        model_name: str | None = None,
        templates: Sequence[str] | None = None,
    ) -> None:
        if not isinstance(classifier, ZeroShotClassifier):
            raise BackboneError(
                f"OpenClipAdapter wraps a ZeroShotClassifier, got {type(classifier).__name__}; "
                "use load_openclip or wrap_openclip"
            )
        visual = classifier.visual
        check_supported(visual)
        install_gates(visual)
        self.module = classifier.eval()
        self.name = name
        self.weights = weights
        self.model_name = model_name
        self.templates = None if templates is None else list(templates)
        self.class_names = classifier.class_names
        first = visual.transformer.resblocks[0]
        self.num_layers = len(visual.transformer.resblocks)
        self.num_heads = first.attn.num_heads
        self.head_dim = first.attn.head_dim
        self.embed_dim = visual.transformer.width
        self.output_dim = int(visual.proj.shape[1])
        self.num_classes = classifier.num_classes
        self.mlp_hidden = first.mlp.c_fc.out_features
        self.img_size = tuple(int(s) for s in visual.image_size)
        self.patch_size = tuple(int(s) for s in visual.patch_size)
        self.in_chans = visual.conv1.in_channels
        self.num_patches = visual.grid_size[0] * visual.grid_size[1]
        self.num_prefix_tokens = 1
        self.num_tokens = self.num_patches + 1

    # ---------------------------------------------------------------------------------------------
    @property
    def visual(self) -> nn.Module:
        return self.module.visual

    def _gate_targets(self) -> list[nn.Module]:
        return [block.attn.out_proj for block in self.visual.transformer.resblocks]

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        visual = self.visual
        x = visual.conv1(inputs)  # [B, D, gh, gw]
        x = x.flatten(2).transpose(1, 2)  # [B, P, D]
        cls = visual.class_embedding.to(x.dtype).view(1, 1, -1).expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + visual.positional_embedding.to(x.dtype)
        return visual.ln_pre(visual.patch_dropout(x))  # [B, N, D]

    def run_layers(self, hidden: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        for block in self.visual.transformer.resblocks[start:stop]:
            hidden = block(hidden)
        return hidden

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, N, D] -> [B, D]: the class token ('tok') or the mean of the patch tokens ('avg')."""
        return hidden[:, 0] if self.visual.pool_type == "tok" else hidden[:, 1:].mean(dim=1)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        visual = self.visual
        if visual.final_ln_after_pool:
            pooled = visual.ln_post(self.pool(hidden))
        else:
            pooled = self.pool(visual.ln_post(hidden))
        return self.module.logits(pooled @ visual.proj)

    def attention_weights(self, layer: int) -> AttentionWeights:
        attn = self.visual.transformer.resblocks[layer].attn
        out = attn.out_proj
        return AttentionWeights.from_packed(
            attn.in_proj_weight, attn.in_proj_bias, out.weight, out.bias, self.num_heads
        )

    # ---------------------------------------------------------------------------------------------
    def preprocess_cfg(self) -> dict[str, Any]:
        """open_clip's preprocessing config of the model (its defaults where the model has none)."""
        config = dataclasses.asdict(open_clip.transform.PreprocessCfg())
        config.update(getattr(self.visual, "preprocess_cfg", None) or {})
        config["size"] = self.img_size
        return config

    def data_config(self) -> dict[str, Any]:
        """Preprocessing as a timm data config, equal to open_clip's eval transform.

        open_clip's eval transform is: resize (bicubic for the released models) so the shorter
        side is the input size, center-crop, scale to [0, 1], normalise with the model's
        ``image_mean`` / ``image_std``. As a timm config that is ``crop_pct=1.0`` with
        ``crop_mode="center"`` (open_clip's ``resize_mode="shortest"``; ``"squash"`` maps to
        ``"squash"``, ``"longest"`` to ``"border"``, whose padding colour differs).
        """
        config = self.preprocess_cfg()
        resize_mode = config.get("resize_mode", "shortest")
        if resize_mode not in _CROP_MODES:
            raise UnsupportedModelError(
                f"open_clip resize_mode {resize_mode!r} has no timm equivalent "
                f"(supported: {', '.join(_CROP_MODES)})"
            )
        return {
            "input_size": (self.in_chans, *self.img_size),
            "interpolation": str(config.get("interpolation", "bicubic")),
            "mean": tuple(float(v) for v in config["mean"]),
            "std": tuple(float(v) for v in config["std"]),
            "crop_pct": 1.0,
            "crop_mode": _CROP_MODES[resize_mode],
        }

    def constructor_kwargs(self) -> dict[str, Any]:
        """JSON-able arguments that rebuild this image tower and classifier (see rebuild_openclip).

        Weights are not included: the rebuilt model has placeholder weights to load a state dict into.
        """
        visual = self.visual
        block = visual.transformer.resblocks[0]
        act = block.mlp[1]
        if isinstance(act, open_clip.transformer.QuickGELU):
            quick_gelu, approximate = True, "none"
        elif type(act) is nn.GELU:
            quick_gelu, approximate = False, act.approximate
        else:
            raise UnsupportedModelError(
                f"cannot record how to rebuild an MLP activation {type(act).__name__} "
                "(only GELU and QuickGELU)"
            )
        preprocess = self.preprocess_cfg()
        return {
            "image_size": list(self.img_size),
            "patch_size": list(self.patch_size),
            "width": self.embed_dim,
            "layers": self.num_layers,
            "heads": self.num_heads,
            # +0.5: open_clip takes int(width * mlp_ratio), which must give mlp_hidden exactly
            "mlp_ratio": (self.mlp_hidden + 0.5) / self.embed_dim,
            "ls_init_value": 1.0 if hasattr(block.ls_1, "gamma") else None,
            "output_dim": self.output_dim,
            "pool_type": visual.pool_type,
            "final_ln_after_pool": bool(visual.final_ln_after_pool),
            "no_ln_pre": is_identity(visual.ln_pre),
            "quick_gelu": quick_gelu,
            "gelu_approximate": approximate,
            "layer_norm_eps": float(block.ln_1.eps),
            "num_classes": self.num_classes,
            "logit_bias": self.module.logit_bias is not None,
            "preprocess_cfg": {
                k: (list(v) if isinstance(v, tuple) else v) for k, v in preprocess.items()
            },
        }

    def backbone_kwargs(self) -> dict[str, Any]:
        """What an export folder records to rebuild the model: name, classes, templates, tower."""
        return {
            "name": self.name,
            "model_name": self.model_name,
            "classes": list(self.class_names or []),
            "templates": None if self.templates is None else list(self.templates),
            "weights": self.weights,
            "vision": self.constructor_kwargs(),
        }

    def head_macs(self) -> int:
        """The projection to the joint space and the class-weight product, per image (the text
        side is computed once, offline: not counted)."""
        return self.embed_dim * self.output_dim + self.output_dim * self.num_classes
