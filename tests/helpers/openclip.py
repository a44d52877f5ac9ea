"""Tiny random OpenCLIP models with discriminative weights, their adapters and member copies."""

from __future__ import annotations

import copy
import math

import open_clip
import torch

from hydra_deploy.backbones import load_backbone
from hydra_deploy.backbones.openclip import OpenClipAdapter

from .vit import scramble

CLASSES = ["cat", "dog", "car", "tree", "boat"]
TEMPLATES = ["a photo of a {}.", "a drawing of the {c}."]
TEXT_CFG = dict(context_length=16, width=32, heads=4, layers=1)

TINY_CLIP = {
    "tok": dict(image_size=32, patch_size=8, width=32, head_width=8, layers=3, mlp_ratio=2.0),
    "avg_ls_quickgelu": dict(
        image_size=24,
        patch_size=8,
        width=24,
        head_width=8,
        layers=2,
        mlp_ratio=2.0,
        pool_type="avg",
        ls_init_value=0.5,
        no_ln_pre=True,
    ),
    "avg_ln_after_pool_bias": dict(
        image_size=(16, 24),
        patch_size=8,
        width=32,
        head_width=8,
        layers=2,
        mlp_ratio=3.0,
        pool_type="avg",
        final_ln_after_pool=True,
    ),
}


def tiny_clip(config: str = "tok", seed: int = 0) -> open_clip.CLIP:
    """A tiny random open_clip CLIP with scrambled weights (LayerNorms near 1, logit scale 10)."""
    torch.manual_seed(seed)
    clip = open_clip.CLIP(
        embed_dim=16,
        vision_cfg=TINY_CLIP[config],
        text_cfg=TEXT_CFG,
        quick_gelu=config == "avg_ls_quickgelu",
        init_logit_bias=-1.0 if config == "avg_ln_after_pool_bias" else None,
    )
    scramble(clip.eval(), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in clip.named_parameters():
            if ".ln_" in f".{name}" and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
        clip.logit_scale.fill_(math.log(10.0))
        if clip.logit_bias is not None:
            clip.logit_bias.fill_(-1.0)
    return clip


def tiny_adapter(config: str = "tok", seed: int = 0) -> tuple[OpenClipAdapter, open_clip.CLIP]:
    """(adapter, untouched copy of the CLIP it was built from)."""
    clip = tiny_clip(config, seed)
    reference = copy.deepcopy(clip)
    adapter = load_backbone(clip, classes=CLASSES, templates=TEMPLATES)
    return adapter, reference


def member_copy(backbone: OpenClipAdapter, seed: int, scale: float = 0.05) -> OpenClipAdapter:
    """A "fine-tuned" member: every image-tower weight moved a little (the text side is shared)."""
    module = copy.deepcopy(backbone.module)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))
    return OpenClipAdapter(module, name=backbone.name)
