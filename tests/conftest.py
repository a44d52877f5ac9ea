"""Shared test set-up: hypothesis profiles and tiny random ViTs with discriminative weights."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from hydra_deploy.backbones import load_backbone
from hydra_deploy.specs import HydraSpec

# CI runs derandomized (reproducible); locally `HYPOTHESIS_PROFILE=dev` explores many more examples.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "dev",
    deadline=None,
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# One thread: tiny models are fastest so, and on a busy machine the barriers of multi-threaded
# kernels cost tiny forwards up to 100x (measured beside a running benchmark).
torch.set_num_threads(1)


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


@pytest.fixture(scope="session")
def tiny_vits():
    """One tiny adapter per configuration in TINY_VIT (built once per session)."""
    return {name: tiny_vit(name) for name in TINY_VIT}


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


@pytest.fixture(scope="session")
def digits_vit():
    """(adapter, train, val) of a tiny ViT trained on digits; built once per test session."""
    return train_digits_vit()


# --- shared by the fusion and export tests ---------------------------------------------------------
@st.composite
def specs(draw, backbone, max_members: int = 5) -> HydraSpec:
    """Random valid specs: 1..5 members, unequal and empty head subsets, sometimes a shared prefix."""
    L, H = backbone.num_layers, backbone.num_heads
    members = draw(st.integers(1, max_members))
    layer_heads = st.lists(st.integers(0, H - 1), unique=True, max_size=H).map(sorted)
    heads = [[draw(layer_heads) for _ in range(L)] for _ in range(members)]
    shared = draw(st.integers(0, L))
    for member in heads[1:]:
        member[:shared] = heads[0][:shared]
    return HydraSpec(backbone.name, L, H, backbone.head_dim, [{"heads": h} for h in heads])


def perturbed_members(backbone, count: int, seed: int, scale: float = 0.05) -> list:
    """``count`` "fine-tuned" copies of the backbone: every weight moved a little, differently."""
    members = []
    for index in range(count):
        module = copy.deepcopy(backbone.module)
        generator = torch.Generator().manual_seed(seed * 101 + index)
        with torch.no_grad():
            for param in module.parameters():
                param.add_(scale * torch.randn(param.shape, generator=generator))
        members.append(load_backbone(module))
    return members


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """A tiny ViT Hydra export folder (2 members x 2 heads, batch profile 1/2/4), made once per
    session; tests that damage it work on a copy."""
    from hydra_deploy.export import export_onnx
    from hydra_deploy.fusion import fuse

    backbone = tiny_vit("token")
    spec = HydraSpec.random(backbone.name, 3, 4, 8, members=2, heads_per_member=2, seed=0)
    out = tmp_path_factory.mktemp("tiny-export") / "export"
    export_onnx(fuse(backbone, spec), out, batch=(1, 2, 4), exporter="torchscript", validate=False)
    return out
