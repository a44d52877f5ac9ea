"""Tiny random timm ViTs with discriminative weights, and a tiny ViT trained on digits."""

from __future__ import annotations

import torch

from hydra_deploy.backbones import load_backbone


def scramble(module: torch.nn.Module, seed: int, gain: float = 1.5) -> torch.nn.Module:
    """Re-draw every weight at a scale that makes attention peaky and members' outputs distinct.

    timm's init (std 0.02) gives near-uniform attention, under which a bug that mixes heads or
    members can hide; these weights keep activations O(1) but make every head matter.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if param.dim() >= 2 and "pos_embed" not in name and "token" not in name:
                fan_in = param[0].numel()
                param.copy_(noise * gain / fan_in**0.5)
            elif (
                name.endswith("norm1.weight")
                or name.endswith("norm2.weight")
                or "norm.weight" in name
            ):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("gamma"):
                param.copy_(0.5 + 0.2 * noise)
            else:
                param.copy_(0.3 * noise)
    return module


TINY_VIT = {
    "token": dict(
        img_size=16, patch_size=4, depth=3, num_heads=4, embed_dim=32, num_classes=5, qkv_bias=True
    ),
    "avg_reg_ls": dict(
        img_size=16,
        patch_size=4,
        depth=3,
        num_heads=4,
        embed_dim=32,
        num_classes=5,
        qkv_bias=False,
        class_token=False,
        global_pool="avg",
        reg_tokens=2,
        init_values=0.1,
        no_embed_class=True,
    ),
    "prenorm": dict(
        img_size=16,
        patch_size=8,
        depth=2,
        num_heads=3,
        embed_dim=24,
        num_classes=4,
        pre_norm=True,
        qkv_bias=True,
        mlp_ratio=2.0,
    ),
}


def tiny_vit(config: str = "token", seed: int = 0):
    """A tiny random timm ViT adapter with scrambled (discriminative) weights."""
    import timm

    torch.manual_seed(seed)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **TINY_VIT[config])
    return load_backbone(scramble(model.eval(), seed))


def tiny_hydra():
    """The tests' usual tiny Hydra: :func:`tiny_vit` fused with 3 members keeping 2, 1 and 3
    heads per layer (a random spec, seed 0)."""
    from hydra_deploy.fusion import fuse
    from hydra_deploy.specs import HydraSpec

    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=3, heads_per_member=[2, 1, 3], seed=0)
    return fuse(backbone, spec)


def digits_data(size: int = 16):
    """scikit-learn's digits (1,797 8x8 images, 10 classes) upsampled to ``size``, as tensors."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # [N, 1, 8, 8]
    x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return (x - 0.5) / 0.5, torch.tensor(digits.target, dtype=torch.long)


def train_digits_vit(epochs: int = 6, seed: int = 0):
    """A tiny ViT trained on 1,500 digits for a few epochs (about 10 s on one CPU thread).

    Returns (adapter, train LabelledData, validation LabelledData).
    """
    import timm

    from hydra_deploy.pruning import load_data

    x, y = digits_data()
    torch.manual_seed(seed)
    model = timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=16,
        patch_size=4,
        in_chans=1,
        embed_dim=32,
        depth=3,
        num_heads=4,
        mlp_ratio=2.0,
        num_classes=10,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(1500, generator=generator)
        for start in range(0, 1500, 64):
            idx = order[start : start + 64]
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    backbone = load_backbone(model)
    train = load_data((x[:1500], y[:1500]), backbone, name="digits-train")
    val = load_data((x[1500:], y[1500:]), backbone, name="digits-val")
    return backbone, train, val
